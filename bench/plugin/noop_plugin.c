/* A do-nothing NCCL profiler plugin (interface v5) asking for the same events as ncclwatch.
 *
 * It answers every callback at once with a static handle, so NCCL makes the same calls it
 * makes for ncclwatch (and does the same work for them: KernelCh proxy ops, timestamps),
 * but nothing is recorded. The cost of ncclwatch itself is its latency minus this plugin's;
 * this plugin's minus no plugin's is NCCL's own cost of profiling (the floor).
 *
 *   gcc -std=c11 -O2 -fPIC -shared -DNOOP_MASK=0x46 -o libnoop-kch.so noop_plugin.c
 *   NOOP_MASK: 0x46 = Coll|P2p|KernelCh (ncclwatch's mask), 0x06 = Coll|P2p only.
 */
#include <stdint.h>

#ifndef NOOP_MASK
#define NOOP_MASK 0x46
#endif

typedef void (*logger_t)(int, unsigned long, const char*, int, const char*, ...);

static int noop_handle;

static int noop_init(void** ctx, uint64_t comm_id, int* mask, const char* name, int n_nodes,
                     int nranks, int rank, logger_t log) {
  (void)comm_id, (void)name, (void)n_nodes, (void)nranks, (void)rank, (void)log;
  *ctx = &noop_handle;
  *mask = NOOP_MASK;
  return 0;
}

static int noop_start(void* ctx, void** handle, void* descr) {
  (void)ctx, (void)descr;
  *handle = &noop_handle;
  return 0;
}

static int noop_stop(void* handle) {
  (void)handle;
  return 0;
}

static int noop_record(void* handle, int state, void* args) {
  (void)handle, (void)state, (void)args;
  return 0;
}

static int noop_finalize(void* ctx) {
  (void)ctx;
  return 0;
}

struct noop_v5 {
  const char* name;
  int (*init)(void**, uint64_t, int*, const char*, int, int, int, logger_t);
  int (*start)(void*, void**, void*);
  int (*stop)(void*);
  int (*record)(void*, int, void*);
  int (*finalize)(void*);
};

__attribute__((visibility("default"))) struct noop_v5 ncclProfiler_v5 = {
    "noop", noop_init, noop_start, noop_stop, noop_record, noop_finalize,
};
