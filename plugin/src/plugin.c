/* ncclwatch's NCCL profiler plugin: the callbacks and the exported tables.
 *
 * An op (one Coll or P2p event) is complete when both its Coll/P2p stop (which only
 * means "enqueued") and the stop of each of its KernelCh events (one per channel, carrying
 * GPU timestamps) have arrived, in any order, from any threads: the op slot counts them
 * down (pool.c) and whoever takes the count to zero pushes one record into its thread's
 * ring (ring.c). The writer thread (writer.c) turns records into spool lines.
 *
 * Hot path (start/stop/record): no lock, no allocation (except a thread's first ring),
 * no syscall; only init/finalize take locks. Callbacks always return success.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "nw.h"
#include "rules.h"

#define NW_EXPORT __attribute__((visibility("default")))

struct nw_global nw_g = {
    .life_mu = PTHREAD_MUTEX_INITIALIZER,
    .ctx_mu = PTHREAD_MUTEX_INITIALIZER,
    .first_rank = -1,
};

const char* const nw_drop_reason_names[NW_DROP_N] = {
    "pool_full", "ring_full", "disk_full", "write_error", "untimed", "quarantined", "other",
};

int64_t nw_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts); /* vDSO: no syscall */
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t nw_coarse_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME_COARSE, &ts); /* the kernel's last tick: a plain memory read */
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

void nw_count_drop(enum nw_drop_reason reason) {
  atomic_fetch_add_explicit(&nw_g.dropped[reason], 1, memory_order_relaxed);
}

/* Handles for events we track no state for. NCCL stores an API handle and hands it back as
 * the Coll/P2p parent, even on graph replays long after the API call, so it must be static:
 * a pointer compare recovers, without any lookup, whether the op was captured in a CUDA
 * graph and whether its group ran with KernelCh (sampler.c). */
static struct nw_hdr nw_api[2][2] = {{{NW_KIND_STATIC, 0}, {NW_KIND_STATIC, 0}},
                                     {{NW_KIND_STATIC, 0}, {NW_KIND_STATIC, 0}}}; /* [graph][sampled out] */
static struct nw_hdr nw_group_api = {NW_KIND_GROUP, 0};

static void nw_copy_str(char* dst, size_t n, const char* src) {
  size_t i = 0;
  /* NCCL's names are ASCII; anything else would break the record, so it cannot pass. */
  for (; src && i + 1 < n && src[i]; i++) {
    unsigned char c = (unsigned char)src[i];
    dst[i] = (c >= 0x20 && c < 0x7f) ? (char)c : '?';
  }
  dst[i] = '\0';
}

static bool nw_is_rooted(const char* func) {
  switch (func[0]) { /* AllReduce/AllGather, the common ones, take no strcmp */
    case 'B': return !strcmp(func, "Broadcast");
    case 'R': return !strcmp(func, "Reduce");
    case 'G': return !strcmp(func, "Gather");
    case 'S': return !strcmp(func, "Scatter");
    default: return false;
  }
}

/* CollApi/P2pApi start (v5+): NCCL copied the activation mask into this call's task just
 * before (ncclProfilerStartGroupApiEvent), and only the GroupApi stop on this same thread
 * changes it (sampler.c), so the mask now is the task's. */
static void* nw_api_start(struct nw_ctx* ctx, bool graph, const char* func, size_t count) {
  int* mask = atomic_load_explicit(&nw_g.mask_ptr, memory_order_relaxed);
  bool sampled_out = mask && !(__atomic_load_n(mask, __ATOMIC_RELAXED) & NW_EV_KERNEL_CH);
  nw_sampler_api(ctx, func, count);
  /* A graph captured without KernelCh: NCCL counts its work once on the host, at capture
   * (ncclProxySaveOp's Profiler case), while the kernel counts it at every replay, so this
   * communicator's later channel events carry other ops' timestamps, as after a Send/Recv to
   * self. Seen on 2xH200 as ~1,600 ops "started" before their launch after 50 replays. */
  if (graph && sampled_out && ctx) nw_ctx_desync(ctx, nw_now_ns(), "a CUDA graph captured without GPU timing");
  return &nw_api[graph][sampled_out];
}

static void* nw_op_start(struct nw_ctx* ctx, bool p2p, const char* func, const char* dtype,
                         const char* algo, const char* proto, uint64_t seq, size_t count,
                         int peer_or_root, int n_channels, void* parent) {
  struct nw_op* op = nw_op_alloc(ctx);
  if (!op) {
    nw_count_drop(NW_DROP_POOL_FULL);
    return NULL;
  }
  struct nw_op_rec* r = &op->rec;
  nw_copy_str(r->op, sizeof r->op, func);
  /* NCCL spells it "AlltoAll"; the contract and the bandwidth rules say "AllToAll". */
  if (r->op[3] == 't' && !strcmp(r->op, "AlltoAll")) memcpy(r->op, "AllToAll", 9);
  nw_copy_str(r->dtype, sizeof r->dtype, dtype);
  nw_copy_str(r->algo, sizeof r->algo, p2p ? "" : algo);
  nw_copy_str(r->proto, sizeof r->proto, p2p ? "" : proto);
  r->count = count;
  r->channels = (uint8_t)n_channels;
  r->p2p = p2p;
  r->graph = parent == &nw_api[1][0] || parent == &nw_api[1][1];
  op->sampled_out = parent == &nw_api[0][1] || parent == &nw_api[1][1];
  int expect = op->sampled_out ? 0 : n_channels < NW_MAX_CHANNELS ? n_channels : NW_MAX_CHANNELS;
  if (p2p) {
    /* Send/Recv to self is a local copy NCCL makes without a proxy op, hence without
     * channel events, though it reports nChannels > 0 (enqueue.cc: nProxyOps = selfSend ? 0 : 2). */
    if (peer_or_root == ctx->comm->rank) {
      expect = 0;
      /* ... while the kernel still advances its per-channel counter for it (when its
       * group asked for KernelCh at all). */
      if (n_channels > 0 && !op->sampled_out) nw_ctx_desync(ctx, nw_now_ns(), "a Send/Recv to self");
    }
    /* NCCL has no sequence number for p2p: count per (communicator, direction, peer). */
    uint32_t dir = strcmp(r->op, "Send") == 0 ? 0 : 1;
    uint32_t nranks = (uint32_t)ctx->comm->nranks;
    uint32_t idx = (peer_or_root >= 0 && (uint32_t)peer_or_root < nranks)
                       ? dir * nranks + (uint32_t)peer_or_root
                       : 2 * nranks + dir;
    r->seq = atomic_fetch_add_explicit(&ctx->p2p_seq[idx], 1, memory_order_relaxed);
    r->peer = peer_or_root;
  } else {
    r->seq = seq;
    r->peer = nw_is_rooted(r->op) ? peer_or_root : -1;
  }
  op->expect_kch = (uint8_t)expect;
  /* While sampling, the next timed group waits for this op's channel events (sampler.c). */
  op->in_flight = expect > 0 && atomic_load_explicit(&nw_g.sampling, memory_order_relaxed);
  if (op->in_flight) atomic_fetch_add_explicit(&nw_g.timed_in_flight, 1, memory_order_relaxed);
  op->launch_ns = nw_now_ns();
  nw_prog_start(ctx, p2p, op->launch_ns);
  atomic_store_explicit(&op->stopped_ns, 0, memory_order_relaxed);
  atomic_store_explicit(&op->gpu_start, UINT64_MAX, memory_order_relaxed);
  atomic_store_explicit(&op->gpu_stop, 0, memory_order_relaxed);
  atomic_store_explicit(&op->kch_timed, 0, memory_order_relaxed);
  atomic_store_explicit(&op->kch_started, 0, memory_order_relaxed);
  uint32_t gen = (uint32_t)(atomic_load_explicit(&op->life, memory_order_relaxed) >> 32) + 1;
  atomic_store_explicit(&op->hdr.generation, gen, memory_order_relaxed);
  /* Publishing the count last makes the slot visible to the reaper only when complete. */
  atomic_store_explicit(&op->life, ((uint64_t)gen << 32) | (uint32_t)(1 + expect),
                        memory_order_release);
  return op;
}

static void* nw_kch_start(struct nw_ctx* ctx, void* parent, uint8_t channel, uint64_t p_timer) {
  struct nw_hdr* ph = parent;
  if (!ph || ph->kind != NW_KIND_OP) return NULL;
  struct nw_op* op = (struct nw_op*)ph;
  uint64_t w = atomic_load_explicit(&op->life, memory_order_acquire);
  if (atomic_load_explicit(&op->state, memory_order_relaxed) != NW_OP_OPEN || (uint32_t)w == 0 ||
      op->expect_kch == 0 || channel >= NW_MAX_CHANNELS) {
    atomic_fetch_add_explicit(&nw_g.stale_events, 1, memory_order_relaxed);
    return NULL;
  }
  struct nw_kch* k = &op->kch[channel];
  atomic_store_explicit(&k->hdr.generation, (uint32_t)(w >> 32), memory_order_relaxed);
  atomic_fetch_add_explicit(&op->kch_started, 1, memory_order_relaxed);
  int64_t newest = atomic_load_explicit(&ctx->newest_started_launch_ns, memory_order_relaxed);
  while (op->launch_ns > newest &&
         !atomic_compare_exchange_weak_explicit(&ctx->newest_started_launch_ns, &newest, op->launch_ns,
                                                memory_order_relaxed, memory_order_relaxed)) {
  }
  if (p_timer) {
    uint64_t cur = atomic_load_explicit(&op->gpu_start, memory_order_relaxed);
    while (p_timer < cur && !atomic_compare_exchange_weak_explicit(
                                &op->gpu_start, &cur, p_timer, memory_order_relaxed,
                                memory_order_relaxed)) {
    }
    nw_cal_sample(ctx->comm, nw_now_ns(), p_timer);
  }
  return k;
}

static void nw_kch_stop_time(struct nw_kch* k, uint64_t p_timer) {
  struct nw_op* op = k->op;
  uint32_t gen = atomic_load_explicit(&k->hdr.generation, memory_order_relaxed);
  uint64_t w = atomic_load_explicit(&op->life, memory_order_acquire);
  if ((uint32_t)(w >> 32) != gen || (uint32_t)w == 0) {
    atomic_fetch_add_explicit(&nw_g.stale_events, 1, memory_order_relaxed);
    return;
  }
  if (!p_timer) return;
  /* The stop callback also comes after the GPU wrote its timestamp: another upper bound
   * of the clock offset, often a tighter one than the start's (see pool.c). */
  nw_cal_sample(op->ctx->comm, nw_now_ns(), p_timer);
  uint64_t cur = atomic_load_explicit(&op->gpu_stop, memory_order_relaxed);
  while (p_timer > cur && !atomic_compare_exchange_weak_explicit(&op->gpu_stop, &cur, p_timer,
                                                                  memory_order_relaxed,
                                                                  memory_order_relaxed)) {
  }
  atomic_fetch_add_explicit(&op->kch_timed, 1, memory_order_relaxed);
}

/* --- callbacks ------------------------------------------------------------------- */

#define NW_START_V5_BODY(ctx, handle, d)                                                     \
  do {                                                                                       \
    *(handle) = NULL;                                                                        \
    if (!(ctx) || !(d)) return NW_NCCL_SUCCESS;                                              \
    switch ((d)->type) {                                                                     \
      case NW_EV_COLL:                                                                       \
        *(handle) = nw_op_start(ctx, false, (d)->coll.func, (d)->coll.datatype, (d)->coll.algo, \
                                (d)->coll.proto, (d)->coll.seq_number, (d)->coll.count,     \
                                (d)->coll.root, (d)->coll.n_channels, (d)->parent);          \
        break;                                                                               \
      case NW_EV_P2P:                                                                        \
        *(handle) = nw_op_start(ctx, true, (d)->p2p.func, (d)->p2p.datatype, "", "", 0,     \
                                (d)->p2p.count, (d)->p2p.peer, (d)->p2p.n_channels,          \
                                (d)->parent);                                                \
        break;                                                                               \
      case NW_EV_KERNEL_CH:                                                                  \
        *(handle) = nw_kch_start(ctx, (d)->parent, (d)->kernel_ch.channel_id,                \
                                 (d)->kernel_ch.p_timer);                                    \
        break;                                                                               \
      case NW_EV_COLL_API:                                                                   \
        *(handle) = nw_api_start(ctx, (d)->coll_api.graph_captured, (d)->coll_api.func,      \
                                 (d)->coll_api.count);                                       \
        break;                                                                               \
      case NW_EV_P2P_API:                                                                    \
        *(handle) = nw_api_start(ctx, (d)->p2p_api.graph_captured, (d)->p2p_api.func,        \
                                 (d)->p2p_api.count);                                        \
        break;                                                                               \
      case NW_EV_GROUP_API:                                                                  \
        nw_sampler_group_start((d)->group_api.graph_captured);                               \
        *(handle) = &nw_group_api;                                                           \
        break;                                                                               \
      default: /* Group, proxy, net, kernel launch, CE events: nothing to keep */          \
        break;                                                                               \
    }                                                                                        \
    return NW_NCCL_SUCCESS;                                                                  \
  } while (0)

static nw_nccl_result nw_start_v5(void* context, void** handle, struct nw_descr_v5* d) {
  NW_START_V5_BODY((struct nw_ctx*)context, handle, d);
}

static nw_nccl_result nw_start_v6(void* context, void** handle, struct nw_descr_v6* d) {
  NW_START_V5_BODY((struct nw_ctx*)context, handle, d);
}

static nw_nccl_result nw_start_v4(void* context, void** handle, struct nw_descr_v4* d) {
  struct nw_ctx* ctx = context;
  *handle = NULL;
  if (!ctx || !d) return NW_NCCL_SUCCESS;
  switch (d->type) {
    case NW_EV_COLL:
      *handle = nw_op_start(ctx, false, d->coll.func, d->coll.datatype, d->coll.algo,
                            d->coll.proto, d->coll.seq_number, d->coll.count, d->coll.root,
                            d->coll.n_channels, d->parent);
      break;
    case NW_EV_P2P:
      *handle = nw_op_start(ctx, true, d->p2p.func, d->p2p.datatype, "", "", 0, d->p2p.count,
                            d->p2p.peer, d->p2p.n_channels, d->parent);
      break;
    case NW_EV_KERNEL_CH:
      *handle = nw_kch_start(ctx, d->parent, d->kernel_ch.channel_id, d->kernel_ch.p_timer);
      break;
    default:
      break;
  }
  return NW_NCCL_SUCCESS;
}

static nw_nccl_result nw_stop(void* handle) {
  struct nw_hdr* h = handle;
  if (!h) return NW_NCCL_SUCCESS;
  if (h->kind == NW_KIND_OP) {
    /* "Enqueued", not finished: the op stays open until its channels report. */
    struct nw_op* op = handle;
    /* Only the reaper reads it, against thresholds of a second and more: the coarse clock
     * does, and an op expecting no channel completes right here. */
    if (op->expect_kch) atomic_store_explicit(&op->stopped_ns, nw_coarse_now_ns(), memory_order_relaxed);
    nw_op_release(op, atomic_load_explicit(&op->hdr.generation, memory_order_relaxed));
  } else if (h->kind == NW_KIND_KCH) {
    struct nw_kch* k = handle;
    nw_op_release(k->op, atomic_load_explicit(&k->hdr.generation, memory_order_relaxed));
  } else if (h->kind == NW_KIND_GROUP) {
    /* The outermost group ended, its kernels launched: the one safe switching point. */
    nw_sampler_group_stop();
  }
  return NW_NCCL_SUCCESS;
}

static nw_nccl_result nw_record(void* handle, int state, union nw_state_args* args) {
  struct nw_hdr* h = handle;
  if (h && h->kind == NW_KIND_KCH && state == NW_STATE_KERNEL_CH_STOP && args)
    nw_kch_stop_time(handle, args->kernel_ch.p_timer);
  return NW_NCCL_SUCCESS;
}

/* --- lifecycle ------------------------------------------------------------------- */

#define NW_LOG(level, ...)                                                               \
  do {                                                                                   \
    if (nw_g.logfn) nw_g.logfn(level, NW_LOG_INIT | NW_LOG_PROFILE, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

static void nw_at_exit(void* unused);
/* The C runtime's handle of this shared object: handlers registered with it run at exit
 * or at dlclose(), whichever comes first (NCCL dlclose()s the plugin after the last
 * finalize, so a plain exit handler would then point into unmapped code). */
extern void* __dso_handle;
int __cxa_atexit(void (*fn)(void*), void* arg, void* dso);

static int nw_global_start(nw_nccl_logger logfn, int version, const char* gpu, int rank) {
  static bool atexit_done;
  nw_g.logfn = logfn;
  nw_config_load(&nw_g.cfg, logfn);
  nw_g.iface_version = version;
  free(nw_g.job);
  free(nw_g.host);
  char job[NW_NAME_MAX + 1];
  const char* job_source = nw_config_job_id(job, sizeof job);
  nw_g.job = nw_utf8_repair(job, NW_NAME_MAX);
  char hn[256] = "";
  if (gethostname(hn, sizeof hn - 1) != 0) strcpy(hn, "unknown");
  hn[sizeof hn - 1] = '\0';
  nw_g.host = nw_utf8_repair(hn, NW_NAME_MAX);
  if (!nw_g.job || !nw_g.host) return -1;
  nw_safe_filename(nw_g.job, nw_g.job_safe);
  nw_safe_filename(nw_g.host, nw_g.host_safe);
  nw_g.pid = (long)getpid();
  snprintf(nw_g.gpu, sizeof nw_g.gpu, "%s", gpu);
  nw_g.first_rank = rank;
  nw_sampler_start(version);
  if (nw_rings_start() != 0) return -1;
  atomic_fetch_add_explicit(&nw_g.epoch, 1, memory_order_release);
  nw_g.started = true;
  if (nw_writer_start() != 0) {
    nw_g.started = false;
    nw_rings_stop();
    return -1;
  }
  if (!atexit_done) atexit_done = __cxa_atexit(nw_at_exit, NULL, __dso_handle) == 0;
  NW_LOG(NW_LOG_INFO, "ncclwatch: profiler plugin v%d loaded; spool %s/%s, job \"%s\" (from %s)",
         version, nw_g.cfg.spool_dir, nw_g.job_safe, nw_g.job,
         job_source ? job_source : "no variable: fallback");
  static bool job_warned;
  const char* elastic = getenv("TORCHELASTIC_RUN_ID");
  if (!job_source && !job_warned) {
    job_warned = true;
    /* On stderr: NCCL's logger prints nothing unless NCCL_DEBUG is set, and a job labelled
     * "unknown" is silently mixed with every other unlabelled job on the node. */
    fprintf(stderr,
            "ncclwatch: WARNING: no job id in the environment (none of NCCLWATCH_JOB_ID, "
            "SLURM_JOB_ID, PYTORCHJOB_NAME, JOBSET_NAME, VC_JOB_NAME, K8S_JOB_NAME, "
            "TORCHELASTIC_RUN_ID is set%s); records are labelled \"%s\" and mixed with every "
            "other unlabelled job on this node: set NCCLWATCH_JOB_ID\n",
            elastic && !strcmp(elastic, "none") ? "; TORCHELASTIC_RUN_ID=none is torchrun's default"
                                                 : "",
            NW_JOB_FALLBACK);
  }
  return 0;
}

static void nw_global_stop(void) {
  nw_writer_stop(true);
  nw_rings_stop();
  nw_g.started = false;
  atomic_store_explicit(&nw_g.mask_ptr, NULL, memory_order_relaxed);
  struct nw_comm* c = nw_g.comms;
  while (c) {
    struct nw_comm* next = c->next;
    free(c->name);
    free(c->json_fields);
    free(c);
    c = next;
  }
  nw_g.comms = NULL;
  free(nw_g.job);
  free(nw_g.host);
  nw_g.job = nw_g.host = NULL;
}

static struct nw_comm* nw_comm_new(uint64_t hash, const char* name, int n_nodes, int nranks,
                                   int rank, const char* gpu, const char* bare, int ordinal) {
  struct nw_comm* c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->hash = hash;
  snprintf(c->hash_hex, sizeof c->hash_hex, "0x%016llx", (unsigned long long)hash);
  c->name = nw_utf8_repair(name, NW_NAME_MAX);
  c->nranks = nranks < 1 ? 1 : nranks;
  c->nnodes = n_nodes < 1 ? 1 : n_nodes;
  c->rank = rank < 0 ? 0 : rank;
  c->local_ranks = nw_local_ranks(c->nranks, c->nnodes);
  c->transport = nw_transport_class(c->nranks, c->nnodes);
  snprintf(c->gpu, sizeof c->gpu, "%s", gpu);
  snprintf(c->gpu_bare, sizeof c->gpu_bare, "%s", bare);
  c->gpu_ordinal = ordinal;
  c->id_prefix = nw_record_id_prefix(nw_g.job, nw_g.host, nw_g.pid, c->hash_hex, c->rank);
  nw_cal_init(c);
  size_t cap = 6 * NW_NAME_MAX + 512;
  c->json_fields = malloc(cap);
  if (!c->name || !c->json_fields) {
    free(c->name);
    free(c->json_fields);
    free(c);
    return NULL;
  }
  struct nw_buf b;
  nw_buf_init(&b, c->json_fields, cap);
  nw_buf_puts(&b, "\"gpu\":");
  nw_json_str(&b, c->gpu);
  nw_buf_printf(&b, ",\"comm\":\"%s\",\"comm_name\":", c->hash_hex);
  nw_json_str(&b, c->name);
  nw_buf_printf(&b, ",\"rank\":%d,\"nranks\":%d,\"nnodes\":%d,\"local_ranks\":%d,\"transport\":\"%s\"",
                c->rank, c->nranks, c->nnodes, c->local_ranks, c->transport);
  nw_buf_put(&b, "", 1);
  return c;
}

static nw_nccl_result nw_init_common(void** context, int* mask, const char* comm_name,
                                     uint64_t hash, int n_nodes, int nranks, int rank,
                                     nw_nccl_logger logfn, int version) {
  *context = NULL;
  pthread_mutex_lock(&nw_g.life_mu);
  char gpu[NW_GPU_MAX], bare[NW_GPU_MAX];
  int ordinal;
  nw_gpu_current(gpu, bare, &ordinal);
  struct nw_ctx* ctx = NULL;
  struct nw_comm* c = NULL;
  if (nw_g.exited) goto disabled;
  if (!nw_g.started && nw_global_start(logfn, version, gpu, rank) != 0) {
    if (logfn)
      logfn(NW_LOG_WARN, NW_LOG_INIT, __FILE__, __LINE__,
            "ncclwatch: cannot start the profiler plugin (out of memory?); not recording");
    goto disabled;
  }
  c = nw_comm_new(hash, comm_name, n_nodes, nranks, rank, gpu, bare, ordinal);
  ctx = calloc(1, sizeof *ctx);
  if (!c || !ctx || nw_ctx_pool_init(ctx, nw_g.cfg.pool_ops) != 0) goto fail;
  ctx->comm = c;
  ctx->n_p2p_seq = 2 * (uint32_t)c->nranks + 2;
  ctx->p2p_seq = calloc(ctx->n_p2p_seq, sizeof *ctx->p2p_seq);
  if (!ctx->p2p_seq) goto fail;
  c->next = nw_g.comms;
  nw_g.comms = c;
  pthread_mutex_lock(&nw_g.ctx_mu);
  ctx->next = nw_g.ctxs;
  nw_g.ctxs = ctx;
  pthread_mutex_unlock(&nw_g.ctx_mu);
  nw_g.n_ctx++;
  int m = NW_EV_COLL | NW_EV_P2P;
  if (nw_g.cfg.proxy_events) m |= NW_EV_PROXY_OP | NW_EV_PROXY_STEP;
  nw_g.base_mask = m;
  /* KernelCh as the sampler has it now: an init never switches it (sampler.c). */
  if (atomic_load_explicit(&nw_g.timed_now, memory_order_relaxed)) m |= NW_EV_KERNEL_CH;
  atomic_store_explicit(&nw_g.mask_ptr, mask, memory_order_relaxed);
  if (mask) __atomic_store_n(mask, m, __ATOMIC_RELAXED);
  *context = ctx;
  pthread_mutex_unlock(&nw_g.life_mu);
  return NW_NCCL_SUCCESS;
fail:
  if (ctx) {
    nw_ctx_pool_free(ctx);
    free(ctx->p2p_seq);
    free(ctx);
  }
  if (c) {
    free(c->name);
    free(c->json_fields);
    free(c);
  }
  if (nw_g.n_ctx == 0 && nw_g.started) nw_global_stop();
  NW_LOG(NW_LOG_WARN, "ncclwatch: out of memory for communicator 0x%016llx; not recording it",
         (unsigned long long)hash);
disabled:
  /* Never fail init: NCCL would unload the plugin for every communicator. */
  pthread_mutex_unlock(&nw_g.life_mu);
  return NW_NCCL_SUCCESS;
}

static nw_nccl_result nw_init_v5(void** context, uint64_t comm_id, int* mask, const char* comm_name,
                                 int n_nodes, int nranks, int rank, nw_nccl_logger logfn) {
  return nw_init_common(context, mask, comm_name, comm_id, n_nodes, nranks, rank, logfn, 5);
}

static nw_nccl_result nw_init_v6(void** context, uint64_t comm_id, int* mask, const char* comm_name,
                                 int n_nodes, int nranks, int rank, nw_nccl_logger logfn) {
  return nw_init_common(context, mask, comm_name, comm_id, n_nodes, nranks, rank, logfn, 6);
}

static nw_nccl_result nw_init_v4(void** context, int* mask, const char* comm_name,
                                 uint64_t comm_hash, int n_nodes, int nranks, int rank,
                                 nw_nccl_logger logfn) {
  return nw_init_common(context, mask, comm_name, comm_hash, n_nodes, nranks, rank, logfn, 4);
}

static nw_nccl_result nw_finalize(void* context) {
  struct nw_ctx* ctx = context;
  if (!ctx) return NW_NCCL_SUCCESS;
  pthread_mutex_lock(&nw_g.life_mu);
  pthread_mutex_lock(&nw_g.ctx_mu);
  for (struct nw_ctx** p = &nw_g.ctxs; *p; p = &(*p)->next)
    if (*p == ctx) {
      *p = ctx->next;
      break;
    }
  pthread_mutex_unlock(&nw_g.ctx_mu);
  uint64_t untrusted = atomic_load_explicit(&ctx->untrusted_ops, memory_order_relaxed);
  if (untrusted)
    NW_LOG(NW_LOG_INFO, "ncclwatch: communicator %s: %llu ops recorded host-timed, their channel timestamps "
           "being another op's", ctx->comm->hash_hex, (unsigned long long)untrusted);
  if (!nw_g.exited) {
    /* Ops still open here never got all their channel events: record them host-timed. */
    size_t n = nw_ctx_reap(ctx, nw_now_ns(), 0, true);
    if (n)
      NW_LOG(NW_LOG_INFO, "ncclwatch: communicator %s finalized with %zu open ops (recorded host-timed)",
             ctx->comm->hash_hex, n);
  }
  nw_ctx_pool_free(ctx);
  free(ctx->p2p_seq);
  free(ctx);
  nw_g.n_ctx--;
  if (!nw_g.exited && nw_g.started) {
    if (nw_g.n_ctx == 0) {
      uint64_t stale = atomic_load_explicit(&nw_g.stale_events, memory_order_relaxed);
      if (stale)
        NW_LOG(NW_LOG_INFO, "ncclwatch: %llu channel events arrived for ops already recorded",
               (unsigned long long)stale);
      if (nw_g.cfg.timing_sample > 1)
        NW_LOG(NW_LOG_INFO, "ncclwatch: sampled GPU timing: %llu groups chosen for GPU timing, "
               "%llu ops recorded without it",
               (unsigned long long)atomic_load_explicit(&nw_g.groups_timed, memory_order_relaxed),
               (unsigned long long)atomic_load_explicit(&nw_g.ops_sampled_out, memory_order_relaxed));
      nw_global_stop();
    } else {
      nw_writer_request_stats();
    }
  }
  pthread_mutex_unlock(&nw_g.life_mu);
  return NW_NCCL_SUCCESS;
}

/* Process exit without ncclCommDestroy (common in training scripts): record what is open,
 * drain the rings, write the final plugin_stats. Nothing is freed, as NCCL's threads may
 * still be running; and we never wait long for a lock at exit. */
static void nw_at_exit(void* unused) {
  (void)unused;
  int tries = 0;
  while (pthread_mutex_trylock(&nw_g.life_mu) != 0) {
    if (++tries > 1000) return;
    usleep(1000);
  }
  if (nw_g.started && !nw_g.exited) {
    pthread_mutex_lock(&nw_g.ctx_mu);
    int64_t now = nw_now_ns();
    for (struct nw_ctx* c = nw_g.ctxs; c; c = c->next) nw_ctx_reap(c, now, 0, true);
    pthread_mutex_unlock(&nw_g.ctx_mu);
    nw_writer_stop(false);
    nw_g.exited = true;
  }
  pthread_mutex_unlock(&nw_g.life_mu);
}

NW_EXPORT struct nw_profiler_v6 ncclProfiler_v6 = {
    .name = "ncclwatch",
    .init = nw_init_v6,
    .start_event = nw_start_v6,
    .stop_event = nw_stop,
    .record_event_state = nw_record,
    .finalize = nw_finalize,
};

NW_EXPORT struct nw_profiler_v5 ncclProfiler_v5 = {
    .name = "ncclwatch",
    .init = nw_init_v5,
    .start_event = nw_start_v5,
    .stop_event = nw_stop,
    .record_event_state = nw_record,
    .finalize = nw_finalize,
};

NW_EXPORT struct nw_profiler_v4 ncclProfiler_v4 = {
    .name = "ncclwatch",
    .init = nw_init_v4,
    .start_event = nw_start_v4,
    .stop_event = nw_stop,
    .record_event_state = nw_record,
    .finalize = nw_finalize,
};
