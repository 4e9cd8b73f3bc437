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
  atomic_init(&ctx->cal_cur, INT64_MAX);
  atomic_init(&ctx->cal_prev, INT64_MAX);
  atomic_init(&ctx->cal_window_start, INT64_MIN / 2);
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

/* Called by whoever took `life` to zero: turn the slot into a record, free the slot, push. */
static void nw_op_complete(struct nw_op* op, uint32_t gen, bool reaped) {
  struct nw_op_rec rec = op->rec;
  uint64_t gs = atomic_load_explicit(&op->gpu_start, memory_order_relaxed);
  uint64_t ge = atomic_load_explicit(&op->gpu_stop, memory_order_relaxed);
  uint32_t timed = atomic_load_explicit(&op->kch_timed, memory_order_relaxed);
  int64_t off = nw_cal_offset(op->ctx);
  rec.comm = op->ctx->comm;
  if (!reaped && op->expect_kch > 0 && timed >= op->expect_kch && gs != UINT64_MAX && ge >= gs &&
      off != INT64_MAX) {
    rec.timing = NW_TIMING_KERNEL_GPU;
    rec.start_ns = (int64_t)gs + off;
    rec.exec_ns = (int64_t)(ge - gs);
  } else {
    /* No (complete) GPU timing: the channel events were not asked for, or some never came
     * (reaped after NCCLWATCH_OP_TIMEOUT_MS or flushed at finalize/exit). */
    rec.timing = NW_TIMING_HOST;
    rec.start_ns = op->launch_ns;
    rec.exec_ns = 0;
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

bool nw_op_reap(struct nw_op* op, int64_t now_ns, int64_t timeout_ns, bool force) {
  if (atomic_load_explicit(&op->state, memory_order_acquire) != NW_OP_OPEN) return false;
  if (!force) {
    int64_t st = atomic_load_explicit(&op->stopped_ns, memory_order_relaxed);
    if (st == 0 || now_ns - st < timeout_ns) return false;
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

void nw_cal_sample(struct nw_ctx* ctx, int64_t host_ns, uint64_t gpu_ns) {
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

int64_t nw_cal_offset(struct nw_ctx* ctx) {
  int64_t a = atomic_load_explicit(&ctx->cal_cur, memory_order_relaxed);
  int64_t b = atomic_load_explicit(&ctx->cal_prev, memory_order_relaxed);
  return a < b ? a : b;
}
