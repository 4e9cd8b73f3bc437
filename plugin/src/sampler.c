/* GPU timing for a sample of groups: switching KernelCh in NCCL's activation mask only
 * where NCCL cannot see two values inside one group.
 *
 * Why here and nowhere else (plugin/README.md, "Sampled GPU timing", cites NCCL's source):
 * NCCL copies the process-wide mask into a thread-local at every API call
 * (ncclProfilerStartGroupApiEvent) and each task keeps its copy; a Send/Recv pair whose two
 * tasks disagree makes the proxy wait for GPU timestamps the kernel never writes. The only
 * callback that runs after a group's last API call and before the next group's first one,
 * on the thread that makes them, is the GroupApi stop of the outermost group. So:
 *
 * - the mask changes only there, and only while exactly one thread has ever started a group
 *   (a second thread could be inside a group when the first one switches). When a second
 *   thread shows up, sampling stops and KernelCh is switched on for good at the first group
 *   stop that leaves no group open in the process;
 * - a group captured into a CUDA graph freezes its tasks' copy for every replay, and a
 *   replay without KernelCh produces no event at all: at the first captured group the
 *   process keeps full timing (from the next group on; the current one cannot be changed);
 * - which groups are timed: the group predicted to come next (the successor last seen after
 *   this group's first call) when its key was not timed for NCCLWATCH_TIMING_KEY_MS, so
 *   every recurring key keeps fresh GPU timings whatever the sampling rate; plus one group
 *   in NCCLWATCH_TIMING_SAMPLE at random, from a hash of the group's index, so ranks that
 *   issue the same groups time the same ones and periodic loops cannot alias with it.
 *
 * - and never while a GPU-timed op still waits for its channel events. NCCL's proxy reads a
 *   channel's timestamp slot `counter % 64` and accepts any counter >= its own
 *   (src/transport/profiler.cc): with every op timed the proxy never sleeps and keeps up, but
 *   a sampled-out stretch lets it sleep, and a later timed op reusing the slot before it woke
 *   would hand over its timestamps. A guard read from the code, not an observed failure; it
 *   also bounds the timed rate by what the proxy completes.
 *
 * The per-op consequence is decided by the API handle (plugin.c): the Coll/P2p event's
 * parent is the CollApi/P2pApi handle returned at the call, right after NCCL copied the
 * mask, so it says whether this op's channels will report, even when the Coll/P2p event
 * comes later from a CUDA host callback or a graph replay.
 */
#include <stdio.h>
#include <string.h>

#include "nw.h"

#define NW_SAMPLER_KEYS 256 /* direct-mapped successor table, a power of two */

struct nw_sampler_key {
  uint64_t sig;      /* the group's signature: communicator, function, count of its first call */
  uint64_t next_sig; /* the signature of the group that followed it last time */
  int64_t timed_ns;  /* when a group with this signature was last GPU-timed */
};

/* Owner-thread state: only the thread that owns sampling reads or writes it. */
static struct {
  uint64_t group_index;
  uint64_t sig;       /* the open group's signature, 0 before its first API call */
  uint64_t prev_sig;  /* the previous group's signature */
  bool freeze;        /* switch to full timing at this group's stop */
  struct nw_sampler_key keys[NW_SAMPLER_KEYS];
} nw_s;

static _Atomic int nw_open_groups; /* outermost groups between GroupApi start and stop */
static _Atomic bool nw_want_full;  /* sampling stopped: switch KernelCh on when safe */

static _Thread_local char nw_thread_tag; /* its address names the calling thread */

static uint64_t nw_mix(uint64_t x) { /* splitmix64's finaliser */
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static void nw_set_mask(bool timed) {
  int* mask = atomic_load_explicit(&nw_g.mask_ptr, memory_order_relaxed);
  atomic_store_explicit(&nw_g.timed_now, timed, memory_order_relaxed);
  if (mask) __atomic_store_n(mask, nw_g.base_mask | (timed ? NW_EV_KERNEL_CH : 0), __ATOMIC_RELAXED);
}

void nw_sampler_start(int iface_version) {
  memset(&nw_s, 0, sizeof nw_s);
  atomic_store_explicit(&nw_g.sampler_owner, 0, memory_order_relaxed);
  atomic_store_explicit(&nw_open_groups, 0, memory_order_relaxed);
  atomic_store_explicit(&nw_want_full, false, memory_order_relaxed);
  atomic_store_explicit(&nw_g.timed_in_flight, 0, memory_order_relaxed);
  atomic_store_explicit(&nw_g.timed_now, true, memory_order_relaxed);
  bool want = nw_g.cfg.timing_sample > 1;
  /* v4 (NCCL 2.27) has no GroupApi events: nowhere safe to switch. */
  atomic_store_explicit(&nw_g.sampling, want && iface_version >= 5, memory_order_relaxed);
  if (want && iface_version < 5 && nw_g.logfn)
    nw_g.logfn(NW_LOG_INFO, NW_LOG_INIT, __FILE__, __LINE__,
               "ncclwatch: NCCLWATCH_TIMING_SAMPLE=%u needs the v5 interface (NCCL 2.28) or newer; "
               "every op is GPU-timed", nw_g.cfg.timing_sample);
}

static void nw_sampler_stop(const char* why) {
  if (!atomic_exchange_explicit(&nw_g.sampling, false, memory_order_relaxed)) return;
  atomic_store_explicit(&nw_want_full, true, memory_order_relaxed);
  if (nw_g.logfn)
    nw_g.logfn(NW_LOG_INFO, NW_LOG_INIT, __FILE__, __LINE__,
               "ncclwatch: %s; every op is GPU-timed from now on", why);
}

void nw_sampler_group_start(bool graph_captured) {
  atomic_fetch_add_explicit(&nw_open_groups, 1, memory_order_relaxed);
  if (!atomic_load_explicit(&nw_g.sampling, memory_order_relaxed)) return;
  uintptr_t self = (uintptr_t)&nw_thread_tag, owner = 0;
  if (!atomic_compare_exchange_strong_explicit(&nw_g.sampler_owner, &owner, self,
                                               memory_order_relaxed, memory_order_relaxed) &&
      owner != self) {
    /* Not the owner: the owner may be inside a group right now, so nobody may switch. The
     * mask is left as it is: switching here could split this thread's own group. */
    nw_sampler_stop("NCCL is called from more than one thread");
    return;
  }
  nw_s.sig = 0;
  if (graph_captured) nw_s.freeze = true;
}

void nw_sampler_api(const struct nw_ctx* ctx, const char* func, size_t count) {
  if (nw_s.sig || !atomic_load_explicit(&nw_g.sampling, memory_order_relaxed) ||
      atomic_load_explicit(&nw_g.sampler_owner, memory_order_relaxed) != (uintptr_t)&nw_thread_tag)
    return;
  uint64_t h = ctx->comm->hash ^ nw_mix(count);
  for (const char* p = func; p && *p; p++) h = (h ^ (unsigned char)*p) * 0x100000001b3ULL;
  nw_s.sig = h | 1; /* never 0 */
}

void nw_sampler_group_stop(void) {
  int open = atomic_fetch_sub_explicit(&nw_open_groups, 1, memory_order_relaxed) - 1;
  if (atomic_load_explicit(&nw_want_full, memory_order_relaxed)) {
    /* A thread that loaded the old mask but has not reached its GroupApi start yet is the
     * one case this cannot see: a window of a few instructions, once per process. */
    if (open <= 0 && atomic_exchange_explicit(&nw_want_full, false, memory_order_relaxed))
      nw_set_mask(true);
    return;
  }
  if (!atomic_load_explicit(&nw_g.sampling, memory_order_relaxed) ||
      atomic_load_explicit(&nw_g.sampler_owner, memory_order_relaxed) != (uintptr_t)&nw_thread_tag)
    return;
  if (nw_s.freeze) {
    nw_sampler_stop("a CUDA graph is being captured (its replays are recorded only with GPU timing)");
    if (open <= 0 && atomic_exchange_explicit(&nw_want_full, false, memory_order_relaxed))
      nw_set_mask(true);
    return;
  }
  int64_t now = nw_coarse_now_ns(); /* against NCCLWATCH_TIMING_KEY_MS: a tick is enough */
  bool was_timed = atomic_load_explicit(&nw_g.timed_now, memory_order_relaxed);
  uint64_t sig = nw_s.sig;
  if (sig) {
    struct nw_sampler_key* k = &nw_s.keys[sig & (NW_SAMPLER_KEYS - 1)];
    if (k->sig != sig) *k = (struct nw_sampler_key){.sig = sig};
    if (was_timed) k->timed_ns = now;
    if (nw_s.prev_sig) {
      struct nw_sampler_key* p = &nw_s.keys[nw_s.prev_sig & (NW_SAMPLER_KEYS - 1)];
      if (p->sig == nw_s.prev_sig) p->next_sig = sig;
    }
    nw_s.prev_sig = sig;
  }
  uint64_t g = ++nw_s.group_index;
  bool timed = nw_mix(g) < UINT64_MAX / nw_g.cfg.timing_sample;
  int64_t every_ns = (int64_t)nw_g.cfg.timing_key_ms * 1000000;
  if (!timed && every_ns > 0 && sig) {
    const struct nw_sampler_key* k = &nw_s.keys[sig & (NW_SAMPLER_KEYS - 1)];
    uint64_t next = k->next_sig;
    if (next) {
      const struct nw_sampler_key* n = &nw_s.keys[next & (NW_SAMPLER_KEYS - 1)];
      timed = n->sig != next || now - n->timed_ns >= every_ns;
    }
  }
  if (timed && atomic_load_explicit(&nw_g.timed_in_flight, memory_order_relaxed) > 0) timed = false;
  if (timed) atomic_fetch_add_explicit(&nw_g.groups_timed, 1, memory_order_relaxed);
  if (timed != was_timed) nw_set_mask(timed);
}
