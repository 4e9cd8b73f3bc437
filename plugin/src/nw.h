/* Internal types shared by the plugin's files. Nothing here is exported: the build uses
 * -fvisibility=hidden and only the ncclProfiler_vN tables in plugin.c are visible. */
#ifndef NW_H
#define NW_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "config.h"
#include "nw_profiler_abi.h"
#include "record.h"

/* Every handle given to NCCL starts with this header, so stopEvent/recordEventState
 * dispatch on `kind` without a lookup, and a KernelCh handle can tell whether its op slot
 * still belongs to the op it was started for (`generation`). */
struct nw_hdr {
  uint32_t kind;
  _Atomic uint32_t generation;
};
enum {
  NW_KIND_OP = 0x6e770001,     /* struct nw_op: a Coll or P2p event */
  NW_KIND_KCH = 0x6e770002,    /* struct nw_kch: a KernelCh event */
  NW_KIND_STATIC = 0x6e770003, /* static sentinels for API events: nothing to do */
  NW_KIND_GROUP = 0x6e770004,  /* the static GroupApi handle: its stop may switch sampling */
};

#define NW_MAX_CHANNELS 64 /* MAXCHANNELS in NCCL 2.27 .. 2.30 */
#define NW_NAME_MAX 1024   /* user strings (comm names, job ids, hosts) are cut here */
#define NW_GPU_MAX 48

/* Per-communicator metadata: written once in init, read by the writer until the last
 * finalize. Records point at it, so it outlives its communicator's context. */
struct nw_comm {
  struct nw_comm* next;
  uint64_t hash;
  char hash_hex[19]; /* "0x" + 16 hex digits, the contract's `comm` */
  char* name;        /* repaired UTF-8, "" when NCCL gave none */
  int rank, nranks, nnodes, local_ranks;
  const char* transport;
  char gpu[NW_GPU_MAX]; /* "GPU-<uuid>" or "unknown" */
  char gpu_bare[NW_GPU_MAX]; /* uuid without "GPU-" (Inspector's .prom file name) */
  int gpu_ordinal;      /* CUDA device ordinal, -1 when unknown */
  uint64_t id_prefix;   /* FNV-1a state after job␟host␟pid␟comm␟rank␟ */
  char* json_fields;    /* pre-escaped "gpu":..,"comm":..,...,"transport":.. for op lines */
  /* GPU clock calibration (pool.c): offset = host - globaltimer, the minimum over a sliding
   * window. Here rather than in the context so the writer can convert an op's GPU start
   * when it writes the record, with every sample taken since (records outlive contexts). */
  _Atomic int64_t cal_cur, cal_prev, cal_window_start;
};

struct nw_op;
struct nw_kch {
  struct nw_hdr hdr; /* generation: the op's generation when this channel started */
  struct nw_op* op;
};

/* One open Coll/P2p op. `life` packs the slot generation (high 32 bits) with the number
 * of outstanding stops (low 32): 1 for the Coll/P2p stop plus one per expected KernelCh.
 * Whoever moves it to 0 with a CAS owns the completion; the generation in the same word
 * makes a late stop aimed at a recycled slot fail instead of corrupting the new op. */
struct nw_op {
  struct nw_hdr hdr;
  _Atomic uint32_t state; /* NW_OP_FREE / NW_OP_OPEN */
  _Atomic uint64_t life;
  struct nw_ctx* ctx;
  struct nw_op_rec rec; /* descriptor fields, filled at start */
  uint8_t expect_kch;
  bool sampled_out; /* its group ran without KernelCh: no channel will report */
  bool in_flight;   /* counted in nw_g.timed_in_flight until it completes (sampler.c) */
  int64_t launch_ns;
  _Atomic int64_t stopped_ns; /* host time of the Coll/P2p stop; 0 before */
  _Atomic uint64_t gpu_start; /* min channel start pTimer; UINT64_MAX before any */
  _Atomic uint64_t gpu_stop;  /* max channel stop pTimer; 0 before any */
  _Atomic uint32_t kch_started; /* channels that reported a start */
  _Atomic uint32_t kch_timed;   /* channels that reported a stop pTimer */
  struct nw_kch kch[NW_MAX_CHANNELS];
};
enum { NW_OP_FREE = 0, NW_OP_OPEN = 1 };

/* Per-communicator context, handed to NCCL as `context`. */
struct nw_ctx {
  struct nw_ctx* next; /* g.ctxs, under g.ctx_mu */
  struct nw_comm* comm;
  struct nw_op* ops;
  uint32_t n_ops;
  _Atomic uint32_t cursor;
  _Atomic uint64_t* p2p_seq; /* [send/recv][peer], plus one overflow pair */
  uint32_t n_p2p_seq;
  /* Launch time of the newest op that has seen a channel start: an op launched before it
   * that has seen none long after its stop never will (see nw_op_reap). */
  _Atomic int64_t newest_started_launch_ns;
  /* NCCL's per-channel profiler counters of this communicator went out of step (see
   * nw_ctx_desync): GPU timings of ops launched from this time on are not trusted. */
  _Atomic int64_t desync_since_ns; /* INT64_MAX: never */
  _Atomic uint64_t untrusted_ops;  /* ops recorded host-timed because of that */
  /* Progress, for the writer's `progress` records (nw_prog_*, writer.c): relaxed counters,
   * a heuristic snapshot. Side by side: a start or a completion touches one cache line (two
   * at worst). The comm has waited without finishing anything since
   * max(busy_since_ns, last_done_ns): a completion's time doubles as the restart of the
   * wait, which saves it a store. */
  _Atomic uint64_t issued;        /* Coll/P2p ops given a slot, hence sure to complete */
  _Atomic uint64_t colls;         /* of which collectives */
  _Atomic uint64_t done;          /* completed: recorded or dropped, whatever the path */
  _Atomic int64_t last_done_ns;   /* CLOCK_REALTIME(_COARSE) of the last completion, 0: none */
  _Atomic int64_t busy_since_ns;  /* launch of the last op that found nothing in flight */
};

struct nw_ring;
struct nw_writer;

struct nw_global {
  pthread_mutex_t life_mu; /* init/finalize/exit: the plugin's lifecycle */
  pthread_mutex_t ctx_mu;  /* the ctx list, shared with the writer's reaper */
  int n_ctx;
  bool started;
  bool exited; /* the atexit flush ran: the writer is gone for good */
  _Atomic uint64_t epoch; /* bumped at each start so threads drop stale ring pointers */
  struct nw_config cfg;
  nw_nccl_logger logfn;
  int iface_version; /* 4, 5 or 6: the table NCCL loaded us through */
  int* _Atomic mask_ptr; /* NCCL's process-wide activation mask; set by every init */
  int base_mask; /* the mask without KernelCh, which the sampler adds or not */
  /* sampler.c: GPU timing switched per group (NCCLWATCH_TIMING_SAMPLE > 1) */
  _Atomic bool sampling;            /* still switching; false for good once unsafe */
  _Atomic uintptr_t sampler_owner;  /* the one thread that has started groups */
  _Atomic bool timed_now;           /* the mask has KernelCh now */
  _Atomic uint64_t groups_timed;    /* groups the sampler chose to GPU-time */
  _Atomic uint64_t ops_sampled_out; /* ops recorded without GPU timing by sampling */
  _Atomic int64_t timed_in_flight;  /* GPU-timed ops still waiting for channel events */
  char* job;
  char* host;
  char job_safe[129];
  char host_safe[129];
  long pid;
  char gpu[NW_GPU_MAX]; /* the first communicator's GPU: names this process's segments */
  int first_rank;
  struct nw_comm* comms;
  struct nw_ctx* ctxs;
  _Atomic(struct nw_ring*)* rings;
  uint32_t n_rings;
  pthread_key_t ring_key;
  bool ring_key_ok;
  _Atomic uint64_t dropped[NW_DROP_N];
  _Atomic uint64_t stale_events;
  struct nw_writer* writer;
  /* Writer counters, kept across a stop/start within one process so totals stay "since
   * the process started" and segment names are never reused (writer thread only). */
  uint64_t seg_next_index;
  uint64_t recorded;
  uint64_t drops_reported[NW_DROP_N];
};
extern struct nw_global nw_g;

int64_t nw_now_ns(void);        /* CLOCK_REALTIME */
int64_t nw_coarse_now_ns(void); /* CLOCK_REALTIME_COARSE: a tick's resolution, for timeouts */
void nw_count_drop(enum nw_drop_reason reason);

/* pool.c */
int nw_ctx_pool_init(struct nw_ctx* ctx, uint32_t n_ops);
void nw_ctx_pool_free(struct nw_ctx* ctx);
struct nw_op* nw_op_alloc(struct nw_ctx* ctx);
/* Drop one outstanding stop of `op` (generation `gen`); completes the op at the last. */
void nw_op_release(struct nw_op* op, uint32_t gen);
/* Complete an open op now (timing "host") if its stop came more than timeout_ns ago, or
 * unconditionally when force. Returns true when this call completed it. */
/* Stop trusting the GPU timings of this communicator's ops launched from since_ns on. */
void nw_ctx_desync(struct nw_ctx* ctx, int64_t since_ns, const char* why);
bool nw_op_reap(struct nw_op* op, int64_t now_ns, int64_t timeout_ns, bool force);
size_t nw_ctx_reap(struct nw_ctx* ctx, int64_t now_ns, int64_t timeout_ns, bool force);
void nw_cal_init(struct nw_comm* comm);
void nw_cal_sample(struct nw_comm* comm, int64_t host_ns, uint64_t gpu_ns);
/* INT64_MAX while there is no sample. */
int64_t nw_cal_offset(const struct nw_comm* comm);

/* Progress counters (struct nw_ctx), on the hot path. An op took a slot, launched at
 * launch_ns: called before the slot is published, so the op's done++ comes after this. */
static inline void nw_prog_start(struct nw_ctx* ctx, bool p2p, int64_t launch_ns) {
  uint64_t before = atomic_fetch_add_explicit(&ctx->issued, 1, memory_order_relaxed);
  if (!p2p) atomic_fetch_add_explicit(&ctx->colls, 1, memory_order_relaxed);
  /* Nothing was in flight: the wait starts now. A completion racing with this load is
   * harmless: its last_done_ns is about now as well. */
  if (atomic_load_explicit(&ctx->done, memory_order_relaxed) == before)
    atomic_store_explicit(&ctx->busy_since_ns, launch_ns, memory_order_relaxed);
}
/* An op left its slot: recorded, or dropped, whichever path got it there. Release, so a
 * writer that sees this done++ (acquire) also sees the op's issued++: done <= issued.
 * (On x86 a release RMW is the same instruction as a relaxed one.) */
static inline void nw_prog_done(struct nw_ctx* ctx) {
  atomic_fetch_add_explicit(&ctx->done, 1, memory_order_release);
  atomic_store_explicit(&ctx->last_done_ns, nw_coarse_now_ns(), memory_order_relaxed);
}

/* ring.c */
int nw_rings_start(void);
void nw_rings_stop(void); /* after the writer is joined */
/* Push from the calling thread's ring; counts a ring_full drop when it cannot. */
void nw_ring_push(const struct nw_op_rec* rec);
/* Writer side: call fn for every record in every ring; frees rings of exited threads. */
size_t nw_rings_drain(void (*fn)(const struct nw_op_rec*, void*), void* arg, size_t max_per_ring);

/* writer.c */
int nw_writer_start(void);
void nw_writer_wake(void);
void nw_writer_request_stats(void);
/* Final drain, stats, join. release=false at process exit: memory is left in place. */
void nw_writer_stop(bool release);

/* sampler.c: all but nw_sampler_start are called from NCCL's callbacks */
void nw_sampler_start(int iface_version);
void nw_sampler_group_start(bool graph_captured);
void nw_sampler_api(const struct nw_ctx* ctx, const char* func, size_t count);
void nw_sampler_group_stop(void);

/* gpu.c */
void nw_gpu_current(char gpu[NW_GPU_MAX], char bare[NW_GPU_MAX], int* ordinal);

#endif
