/* The plugin's own cost on the launching thread, on the CPU: the callbacks NCCL 2.28+ makes
 * for one group of one AllReduce (GroupApi start, CollApi start/stop, Coll start/stop,
 * GroupApi stop), timed per group, with a plugin loaded by path.
 *
 *   gcc -std=c11 -O2 -Iplugin/include -o callbacks bench/plugin/callbacks.c -ldl
 *   ./callbacks plugin/build/libncclwatch-profiler.so GROUPS [REPEATS]
 *
 * NCCLWATCH_TIMING_SAMPLE picks the mode; with a large N nearly every group is sampled out,
 * which is the path whose cost sampling leaves. Timed groups get no channel events here
 * (there is no GPU), so they stay open until finalize: use sampled-out groups.
 * Prints one line per repeat: ns per group (wall clock, one thread).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "nw_profiler_abi.h"

static int g_mask;

static void quiet(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s plugin.so GROUPS [REPEATS]\n", argv[0]);
    return 2;
  }
  long groups = atol(argv[2]);
  int repeats = argc > 3 ? atoi(argv[3]) : 5;
  void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "dlopen: %s\n", dlerror());
    return 1;
  }
  struct nw_profiler_v5* p = dlsym(lib, "ncclProfiler_v5");
  if (!p) return 1;
  void* ctx = NULL;
  if (p->init(&ctx, 0x1234, &g_mask, "bench", 1, 2, 0, quiet) != 0 || !ctx) return 1;
  struct nw_descr_v5 group = {.type = NW_EV_GROUP_API};
  struct nw_descr_v5 api = {.type = NW_EV_COLL_API};
  api.coll_api.func = "AllReduce";
  api.coll_api.count = 256;
  api.coll_api.datatype = "ncclFloat32";
  struct nw_descr_v5 coll = {.type = NW_EV_COLL};
  coll.coll.func = "AllReduce";
  coll.coll.count = 256;
  coll.coll.datatype = "ncclFloat32";
  coll.coll.algo = "RING";
  coll.coll.proto = "LL";
  coll.coll.n_channels = 2;
  for (int r = 0; r < repeats; r++) {
    double t0 = now_s();
    for (long i = 0; i < groups; i++) {
      void *g, *a, *c;
      p->start_event(ctx, &g, &group);
      p->start_event(ctx, &a, &api);
      p->stop_event(a);
      coll.parent = a;
      coll.coll.seq_number = (uint64_t)(r * groups + i);
      p->start_event(ctx, &c, &coll);
      p->stop_event(c);
      p->stop_event(g);
    }
    double dt = now_s() - t0;
    printf("%.1f ns/group\n", dt * 1e9 / groups);
    fflush(stdout);
  }
  p->finalize(ctx);
  return 0;
}
