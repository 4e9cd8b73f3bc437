/* Op slots of one communicator, their completion, and the GPU clock calibration. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "nw.h"

#define NW_REMAINING(w) ((uint32_t)(w))
#define NW_GEN(w) ((uint32_t)((w) >> 32))
#define NW_ALLOC_PROBES 32

int nw_ctx_pool_init(struct nw_ctx* ctx, uint32_t n_ops) {
  ctx->ops = calloc(n_ops, sizeof *ctx->ops);
  if (!ctx->ops) return -1;
  ctx->n_ops = n_ops;
  atomic_init(&ctx->cursor, 0);
  for (uint32_t i = 0; i < n_ops; i++) {
    struct nw_op* op = &ctx->ops[i];
    op->hdr.kind = NW_KIND_OP;
    atomic_init(&op->hdr.generation, 0);
    atomic_init(&op->state, NW_OP_FREE);
    atomic_init(&op->life, 0);
    op->ctx = ctx;
    for (int c = 0; c < NW_MAX_CHANNELS; c++) {
      op->kch[c].hdr.kind = NW_KIND_KCH;
      atomic_init(&op->kch[c].hdr.generation, 0);
      op->kch[c].op = op;
    }
  }
  atomic_init(&ctx->newest_started_launch_ns, INT64_MIN);
  atomic_init(&ctx->desync_since_ns, INT64_MAX);
  atomic_init(&ctx->untrusted_ops, 0);
  atomic_init(&ctx->issued, 0);
  atomic_init(&ctx->colls, 0);
  atomic_init(&ctx->done, 0);
  atomic_init(&ctx->last_done_ns, 0);
  atomic_init(&ctx->busy_since_ns, 0);
  return 0;
}

void nw_ctx_pool_free(struct nw_ctx* ctx) {
  free(ctx->ops);
  ctx->ops = NULL;
  ctx->n_ops = 0;
}

/* Round-robin claim (as in NCCL's example plugin) rather than a free list: slots are
 * reused in the order they were taken, so a straggling event for a finished op finds its
 * slot idle or bumped in generation for as long as possible. No allocation, no lock. */
struct nw_op* nw_op_alloc(struct nw_ctx* ctx) {
  uint32_t probes = ctx->n_ops < NW_ALLOC_PROBES ? ctx->n_ops : NW_ALLOC_PROBES;
  for (uint32_t p = 0; p < probes; p++) {
    uint32_t i = atomic_fetch_add_explicit(&ctx->cursor, 1, memory_order_relaxed) % ctx->n_ops;
    uint32_t expected = NW_OP_FREE;
    if (atomic_compare_exchange_strong_explicit(&ctx->ops[i].state, &expected, NW_OP_OPEN,
                                                memory_order_acquire, memory_order_relaxed))
      return &ctx->ops[i];
  }
  /* Slots are taken in order, so long-lived ops (a straggling collective, a stuck one
   * waiting for the reaper) sit in runs; before calling the pool full, look at every
   * slot once: a relaxed load each, no CAS unless one looks free. */
  uint32_t from = atomic_load_explicit(&ctx->cursor, memory_order_relaxed);
  for (uint32_t p = 0; p < ctx->n_ops; p++) {
    uint32_t i = (from + p) % ctx->n_ops;
    uint32_t expected = NW_OP_FREE;
    if (atomic_load_explicit(&ctx->ops[i].state, memory_order_relaxed) == NW_OP_FREE &&
        atomic_compare_exchange_strong_explicit(&ctx->ops[i].state, &expected, NW_OP_OPEN,
                                                memory_order_acquire, memory_order_relaxed)) {
      atomic_store_explicit(&ctx->cursor, i + 1, memory_order_relaxed);
      return &ctx->ops[i];
    }
  }
  return NULL;
}

static void nw_op_free(struct nw_op* op, uint32_t gen) {
  /* Bump the generation on free too: a stale stop compares against it and fails. */
  atomic_store_explicit(&op->hdr.generation, gen + 1, memory_order_relaxed);
  atomic_store_explicit(&op->life, (uint64_t)(gen + 1) << 32, memory_order_release);
  atomic_store_explicit(&op->state, NW_OP_FREE, memory_order_release);
}

/* NCCL calls the Coll start right after launching the kernel on its direct path, so the
 * GPU can start a little before launch_ns; more than this is not that. */
#define NW_EARLY_NS (1000LL * 1000)

void nw_ctx_desync(struct nw_ctx* ctx, int64_t since_ns, const char* why) {
  int64_t cur = atomic_load_explicit(&ctx->desync_since_ns, memory_order_relaxed);
  if (cur != INT64_MAX) return;
  if (!atomic_compare_exchange_strong_explicit(&ctx->desync_since_ns, &cur, since_ns, memory_order_relaxed,
                                               memory_order_relaxed))
    return;
  if (nw_g.logfn)
    nw_g.logfn(NW_LOG_WARN, NW_LOG_PROFILE, __FILE__, __LINE__,
               "ncclwatch: communicator %s: %s; NCCL's per-channel profiler counters are now out of "
               "step (NCCL 2.27-2.30 count that work on the GPU but not on the host), so later "
               "channel timestamps belong to other ops: its ops are recorded host-timed from now on",
               ctx->comm->hash_hex, why);
}

/* Called by whoever took `life` to zero: turn the slot into a record, free the slot, push. */
static void nw_op_complete(struct nw_op* op, uint32_t gen, bool reaped) {
  struct nw_op_rec rec = op->rec;
  /* Every way out below (a record, an untimed or ring_full drop) counts: issued - done must
   * come back to 0 whatever happens to the op's line. */
  nw_prog_done(op->ctx);
  if (op->in_flight) atomic_fetch_sub_explicit(&nw_g.timed_in_flight, 1, memory_order_relaxed);
  uint64_t gs = atomic_load_explicit(&op->gpu_start, memory_order_relaxed);
  uint64_t ge = atomic_load_explicit(&op->gpu_stop, memory_order_relaxed);
  uint32_t timed = atomic_load_explicit(&op->kch_timed, memory_order_relaxed);
  rec.comm = op->ctx->comm;
  bool gpu = !reaped && op->expect_kch > 0 && timed >= op->expect_kch && gs != UINT64_MAX && ge >= gs;
  if (gpu && op->launch_ns >= atomic_load_explicit(&op->ctx->desync_since_ns, memory_order_relaxed)) {
    gpu = false;
    atomic_fetch_add_explicit(&op->ctx->untrusted_ops, 1, memory_order_relaxed);
  }
  if (gpu) {
    /* A GPU start well before NCCL even launched the op is another op's timestamp: keep
     * this op host-timed (the calibrated start is never early, so no false alarm from it). */
    int64_t off = nw_cal_offset(rec.comm);
    if (off != INT64_MAX && (int64_t)gs + off < op->launch_ns - NW_EARLY_NS) {
      gpu = false;
      atomic_fetch_add_explicit(&op->ctx->untrusted_ops, 1, memory_order_relaxed);
    }
  }
  if (gpu) {
    rec.timing = NW_TIMING_KERNEL_GPU;
    /* Still the GPU clock: the writer converts it with the calibration as of writing,
     * which has seen more samples (the first ops' own samples are the least reliable). */
    rec.start_ns = (int64_t)gs;
    rec.exec_ns = (int64_t)(ge - gs);
  } else if (op->sampled_out) {
    /* Counted and sized like every op; its group did not ask for GPU timestamps. */
    rec.timing = NW_TIMING_SAMPLED_OUT;
    rec.start_ns = op->launch_ns;
    rec.exec_ns = 0;
    atomic_fetch_add_explicit(&nw_g.ops_sampled_out, 1, memory_order_relaxed);
  } else {
    /* No (complete) GPU timing: some channel events never came (reaped after
     * NCCLWATCH_OP_TIMEOUT_MS or flushed at finalize/exit). */
    rec.timing = NW_TIMING_HOST;
    rec.start_ns = op->launch_ns;
    rec.exec_ns = 0;
    if (nw_g.cfg.debug && nw_g.logfn)
      nw_g.logfn(NW_LOG_INFO, NW_LOG_PROFILE, __FILE__, __LINE__,
                 "ncclwatch: %s %s seq %llu peer %d host-timed%s: channels %u expected, %u started, "
                 "%u stopped with a time", rec.comm->hash_hex, rec.op, (unsigned long long)rec.seq,
                 rec.peer, reaped ? " (reaped)" : "", op->expect_kch,
                 atomic_load_explicit(&op->kch_started, memory_order_relaxed), timed);
  }
  nw_op_free(op, gen);
  if (rec.timing == NW_TIMING_HOST && nw_g.cfg.require_gpu_timing) {
    nw_count_drop(NW_DROP_UNTIMED);
    return;
  }
  nw_ring_push(&rec);
}

void nw_op_release(struct nw_op* op, uint32_t gen) {
  uint64_t w = atomic_load_explicit(&op->life, memory_order_acquire);
  for (;;) {
    if (NW_GEN(w) != gen || NW_REMAINING(w) == 0) {
      /* The op was reaped (and maybe its slot reused) before this stop arrived. */
      atomic_fetch_add_explicit(&nw_g.stale_events, 1, memory_order_relaxed);
      return;
    }
    if (atomic_compare_exchange_weak_explicit(&op->life, &w, w - 1, memory_order_acq_rel,
                                              memory_order_acquire))
      break;
  }
  if (NW_REMAINING(w - 1) == 0) nw_op_complete(op, gen, false);
}

/* An op stopped this long ago that has seen no channel start while a later op of its
 * communicator has, will never see one: NCCL said nChannels > 0 but made no proxy op for
 * it (NCCL 2.27-2.30 do so for Send/Recv to self, handled at start; this catches others). */
#define NW_ORPHAN_NS (1000LL * 1000 * 1000)

bool nw_op_reap(struct nw_op* op, int64_t now_ns, int64_t timeout_ns, bool force) {
  if (atomic_load_explicit(&op->state, memory_order_acquire) != NW_OP_OPEN) return false;
  if (!force) {
    int64_t st = atomic_load_explicit(&op->stopped_ns, memory_order_relaxed);
    if (st == 0) return false;
    bool orphan = now_ns - st >= NW_ORPHAN_NS &&
                  atomic_load_explicit(&op->kch_started, memory_order_relaxed) == 0 &&
                  atomic_load_explicit(&op->ctx->newest_started_launch_ns, memory_order_relaxed) >
                      op->launch_ns;
    if (!orphan && now_ns - st < timeout_ns) return false;
  }
  uint64_t w = atomic_load_explicit(&op->life, memory_order_acquire);
  /* remaining == 0: free, or claimed but not yet published by its starting thread. */
  if (NW_REMAINING(w) == 0) return false;
  if (!atomic_compare_exchange_strong_explicit(&op->life, &w, (uint64_t)NW_GEN(w) << 32,
                                               memory_order_acq_rel, memory_order_relaxed))
    return false;
  nw_op_complete(op, NW_GEN(w), true);
  return true;
}

size_t nw_ctx_reap(struct nw_ctx* ctx, int64_t now_ns, int64_t timeout_ns, bool force) {
  size_t n = 0;
  for (uint32_t i = 0; i < ctx->n_ops; i++) n += nw_op_reap(&ctx->ops[i], now_ns, timeout_ns, force);
  return n;
}

/* GPU globaltimer -> wall clock.
 *
 * NCCL calls KernelCh start only after its proxy thread saw the GPU write the channel's
 * start timestamp, so at that callback host_now >= (true host time of the GPU start), and
 * host_now - pTimer >= true offset, with the excess being the polling latency. The least
 * excess seen is the best estimate: keep the minimum of host_now - pTimer. The two clocks
 * may drift apart (NTP slews CLOCK_REALTIME; the GPU timer is only periodically re-synced),
 * so the minimum is taken over a sliding window (current + previous 10 s) rather than the
 * whole run. Converted start times are thus late by at least the smallest polling delay
 * (microseconds), never early; exec_ns is a difference of GPU timestamps and has no such
 * bias. */
#define NW_CAL_WINDOW_NS (10LL * 1000 * 1000 * 1000)

void nw_cal_init(struct nw_comm* ctx) {
  atomic_init(&ctx->cal_cur, INT64_MAX);
  atomic_init(&ctx->cal_prev, INT64_MAX);
  atomic_init(&ctx->cal_window_start, INT64_MIN / 2);
}

void nw_cal_sample(struct nw_comm* ctx, int64_t host_ns, uint64_t gpu_ns) {
  int64_t off = host_ns - (int64_t)gpu_ns;
  int64_t ws = atomic_load_explicit(&ctx->cal_window_start, memory_order_relaxed);
  if (host_ns - ws > NW_CAL_WINDOW_NS &&
      atomic_compare_exchange_strong_explicit(&ctx->cal_window_start, &ws, host_ns,
                                              memory_order_relaxed, memory_order_relaxed)) {
    atomic_store_explicit(&ctx->cal_prev,
                          atomic_load_explicit(&ctx->cal_cur, memory_order_relaxed),
                          memory_order_relaxed);
    atomic_store_explicit(&ctx->cal_cur, off, memory_order_relaxed);
    return;
  }
  int64_t cur = atomic_load_explicit(&ctx->cal_cur, memory_order_relaxed);
  while (off < cur && !atomic_compare_exchange_weak_explicit(&ctx->cal_cur, &cur, off,
                                                              memory_order_relaxed,
                                                              memory_order_relaxed)) {
  }
}

int64_t nw_cal_offset(const struct nw_comm* ctx) {
  int64_t a = atomic_load_explicit((_Atomic int64_t*)&ctx->cal_cur, memory_order_relaxed);
  int64_t b = atomic_load_explicit((_Atomic int64_t*)&ctx->cal_prev, memory_order_relaxed);
  return a < b ? a : b;
}
