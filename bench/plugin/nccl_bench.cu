// NCCL called directly, one process driving all local GPUs (ncclCommInitAll + group calls).
//
//   nccl_bench overhead LABEL REP   back-to-back batches, per-call latency (CSV on stdout)
//   nccl_bench accuracy             one call at a time, CUDA events on the NCCL stream
//   nccl_bench graph                a captured CUDA graph of AllReduces, replayed
//   nccl_bench stress               >= BENCH_STRESS_OPS ops of mixed kinds and sizes, groups
//                                   mixing a collective with a Send/Recv ring, then a captured
//                                   graph of such groups replayed: what sampled GPU timing
//                                   must survive without a hang and with exact counts
//
// Which profiler plugin is loaded is up to NCCL_PROFILER_PLUGIN; run_gpu.sh interleaves
// processes with no plugin, a do-nothing plugin and ncclwatch.
//
// Output CSV (stdout):
//   overhead: lat,LABEL,REP,OP,BYTES,BATCH,CALLS,PER_CALL_US
//   accuracy: acc,OP,BYTES,CALL,DEV,EVENT_NS          and  win,OP,BYTES,T0_NS,T1_NS
//   graph:    graph,OP,BYTES,REPLAYS,OPS_PER_GRAPH,T0_NS,T1_NS
//   stress:   stress,EAGER_OPS,GRAPH_REPLAYS,OPS_PER_GRAPH,SECONDS (ops counted per communicator)
// BYTES is the per-rank message size (NCCL count x 4 bytes of float).
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#define CUDACHECK(x)                                                                  \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      fprintf(stderr, "%s:%d CUDA %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)
#define NCCLCHECK(x)                                                                  \
  do {                                                                                \
    ncclResult_t r_ = (x);                                                            \
    if (r_ != ncclSuccess) {                                                          \
      fprintf(stderr, "%s:%d NCCL %s\n", __FILE__, __LINE__, ncclGetErrorString(r_)); \
      exit(1);                                                                        \
    }                                                                                 \
  } while (0)

enum Op { AR, AG, SR };
static const char* op_name(Op op) { return op == AR ? "AllReduce" : op == AG ? "AllGather" : "SendRecv"; }

static int n_dev;
static std::vector<ncclComm_t> comms;
static std::vector<cudaStream_t> streams;
static std::vector<void*> sbuf, rbuf;

static long long wall_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// Keeps the stream busy so the host has queued the NCCL kernel behind the start event:
// the event then brackets the kernel, not the host's launch latency.
__global__ void spin_ns(long long ns) {
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while ((long long)(t - t0) < ns);
}

static void issue(Op op, size_t bytes) {
  size_t count = bytes / sizeof(float);
  NCCLCHECK(ncclGroupStart());
  for (int i = 0; i < n_dev; i++) {
    switch (op) {
      case AR:
        NCCLCHECK(ncclAllReduce(sbuf[i], rbuf[i], count, ncclFloat, ncclSum, comms[i], streams[i]));
        break;
      case AG:
        NCCLCHECK(ncclAllGather(sbuf[i], rbuf[i], count, ncclFloat, comms[i], streams[i]));
        break;
      case SR: {
        int peer = (i + 1) % n_dev, from = (i + n_dev - 1) % n_dev;
        NCCLCHECK(ncclSend(sbuf[i], count, ncclFloat, peer, comms[i], streams[i]));
        NCCLCHECK(ncclRecv(rbuf[i], count, ncclFloat, from, comms[i], streams[i]));
        break;
      }
    }
  }
  NCCLCHECK(ncclGroupEnd());
}

static void sync_all() {
  for (int i = 0; i < n_dev; i++) CUDACHECK(cudaStreamSynchronize(streams[i]));
}

static std::vector<size_t> env_sizes(const char* name, std::vector<size_t> def) {
  const char* s = getenv(name);
  if (!s) return def;
  std::vector<size_t> out;
  for (const char* p = s; *p;) {
    char* end;
    out.push_back(strtoull(p, &end, 10));
    p = *end ? end + 1 : end;
  }
  return out;
}

static int env_int(const char* name, int def) {
  const char* s = getenv(name);
  return s ? atoi(s) : def;
}

static void overhead(const char* label, int rep) {
  std::vector<size_t> sizes = env_sizes("BENCH_SIZES", {1 << 10, 32 << 10, 1 << 20, 32 << 20});
  int batches = env_int("BENCH_BATCHES", 15);
  cudaEvent_t e0, e1;
  CUDACHECK(cudaSetDevice(0));
  CUDACHECK(cudaEventCreate(&e0));
  CUDACHECK(cudaEventCreate(&e1));
  for (Op op : {AR, AG, SR}) {
    for (size_t bytes : sizes) {
      int calls = bytes <= (1 << 20) ? 200 : bytes <= (32 << 20) ? 50 : 10;
      for (int w = 0; w < 20; w++) issue(op, bytes);
      sync_all();
      for (int b = 0; b < batches; b++) {
        CUDACHECK(cudaSetDevice(0));
        CUDACHECK(cudaEventRecord(e0, streams[0]));
        for (int k = 0; k < calls; k++) issue(op, bytes);
        CUDACHECK(cudaSetDevice(0));
        CUDACHECK(cudaEventRecord(e1, streams[0]));
        sync_all();
        float ms;
        CUDACHECK(cudaEventElapsedTime(&ms, e0, e1));
        printf("lat,%s,%d,%s,%zu,%d,%d,%.4f\n", label, rep, op_name(op), bytes, b, calls,
               ms * 1000.0 / calls);
      }
      fflush(stdout);
    }
  }
}

static void accuracy() {
  std::vector<size_t> sizes =
      env_sizes("BENCH_SIZES", {1 << 10, 32 << 10, 1 << 20, 32 << 20, (size_t)1 << 30});
  int calls = env_int("BENCH_CALLS", 200);
  std::vector<cudaEvent_t> st(n_dev), en(n_dev);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaEventCreate(&st[i]));
    CUDACHECK(cudaEventCreate(&en[i]));
  }
  for (Op op : {AR, AG, SR}) {
    for (size_t bytes : sizes) {
      for (int w = 0; w < 5; w++) issue(op, bytes);
      sync_all();
      long long t0 = wall_ns();
      for (int c = 0; c < calls; c++) {
        for (int i = 0; i < n_dev; i++) {
          CUDACHECK(cudaSetDevice(i));
          spin_ns<<<1, 1, 0, streams[i]>>>(100000);
          CUDACHECK(cudaEventRecord(st[i], streams[i]));
        }
        issue(op, bytes);
        for (int i = 0; i < n_dev; i++) {
          CUDACHECK(cudaSetDevice(i));
          CUDACHECK(cudaEventRecord(en[i], streams[i]));
        }
        sync_all();
        for (int i = 0; i < n_dev; i++) {
          float ms;
          CUDACHECK(cudaEventElapsedTime(&ms, st[i], en[i]));
          printf("acc,%s,%zu,%d,%d,%lld\n", op_name(op), bytes, c, i, (long long)(ms * 1e6));
        }
      }
      long long t1 = wall_ns();
      printf("win,%s,%zu,%lld,%lld\n", op_name(op), bytes, t0, t1);
      fflush(stdout);
    }
  }
}

static void graph() {
  const size_t bytes = 1 << 20;
  const int per_graph = 20, replays = 10;
  for (int w = 0; w < 5; w++) issue(AR, bytes);
  sync_all();
  std::vector<cudaGraph_t> g(n_dev);
  std::vector<cudaGraphExec_t> ge(n_dev);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaStreamBeginCapture(streams[i], cudaStreamCaptureModeGlobal));
  }
  for (int k = 0; k < per_graph; k++) issue(AR, bytes);
  // End every capture before instantiating: instantiation is not allowed while another
  // stream is still capturing in global mode.
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaStreamEndCapture(streams[i], &g[i]));
  }
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaGraphInstantiate(&ge[i], g[i], 0));
  }
  long long t0 = wall_ns();
  for (int r = 0; r < replays; r++) {
    for (int i = 0; i < n_dev; i++) {
      CUDACHECK(cudaSetDevice(i));
      CUDACHECK(cudaGraphLaunch(ge[i], streams[i]));
    }
    sync_all();
  }
  long long t1 = wall_ns();
  printf("graph,AllReduce,%zu,%d,%d,%lld,%lld\n", bytes, replays, per_graph, t0, t1);
  fflush(stdout);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaGraphExecDestroy(ge[i]));
    CUDACHECK(cudaGraphDestroy(g[i]));
  }
}

// One group: a collective on every communicator, and (kind 3) a Send/Recv ring in the same
// group. Returns the ops issued (one per call per communicator).
static long issue_mixed(int kind, size_t bytes) {
  if (kind < 3) {
    issue(kind == 0 ? AR : kind == 1 ? AG : SR, bytes);
    return kind == 2 ? 2L * n_dev : n_dev;
  }
  size_t count = bytes / sizeof(float);
  NCCLCHECK(ncclGroupStart());
  for (int i = 0; i < n_dev; i++) {
    int peer = (i + 1) % n_dev, from = (i + n_dev - 1) % n_dev;
    NCCLCHECK(ncclAllReduce(sbuf[i], rbuf[i], count, ncclFloat, ncclSum, comms[i], streams[i]));
    NCCLCHECK(ncclSend(sbuf[i], count, ncclFloat, peer, comms[i], streams[i]));
    NCCLCHECK(ncclRecv(rbuf[i], count, ncclFloat, from, comms[i], streams[i]));
  }
  NCCLCHECK(ncclGroupEnd());
  return 3L * n_dev;
}

static void stress() {
  const size_t sizes[] = {1 << 10, 4 << 10, 32 << 10, 256 << 10, 1 << 20, 4 << 20};
  long target = env_int("BENCH_STRESS_OPS", 1100000);
  long issued = 0;
  unsigned rng = 12345;
  long long t0 = wall_ns();
  for (long g = 0; issued < target; g++) {
    rng = rng * 1103515245u + 12345u;
    int kind = (rng >> 16) % 4;
    size_t bytes = sizes[(rng >> 8) % 6];
    issued += issue_mixed(kind, bytes);
    if (g % 256 == 255) sync_all();
  }
  sync_all();
  // A graph of mixed groups, captured after the eager phase (wherever the sampler is).
  const int per_graph = 8, replays = 50;
  long per_graph_ops = 0;
  std::vector<cudaGraph_t> gr(n_dev);
  std::vector<cudaGraphExec_t> ge(n_dev);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaStreamBeginCapture(streams[i], cudaStreamCaptureModeGlobal));
  }
  for (int k = 0; k < per_graph; k++) per_graph_ops += issue_mixed(k % 4, sizes[k % 6]);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaStreamEndCapture(streams[i], &gr[i]));
  }
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaGraphInstantiate(&ge[i], gr[i], 0));
  }
  for (int r = 0; r < replays; r++) {
    for (int i = 0; i < n_dev; i++) {
      CUDACHECK(cudaSetDevice(i));
      CUDACHECK(cudaGraphLaunch(ge[i], streams[i]));
    }
    sync_all();
  }
  // Eager again after the capture: the sampler has switched to full timing by now.
  for (int g = 0; g < 1000; g++) issued += issue_mixed(g % 4, sizes[g % 6]);
  sync_all();
  printf("stress,%ld,%d,%ld,%.3f\n", issued, replays, per_graph_ops, (wall_ns() - t0) / 1e9);
  fflush(stdout);
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaGraphExecDestroy(ge[i]));
    CUDACHECK(cudaGraphDestroy(gr[i]));
  }
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s overhead LABEL REP | accuracy | graph | stress\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1];
  CUDACHECK(cudaGetDeviceCount(&n_dev));
  n_dev = std::min(n_dev, env_int("BENCH_GPUS", 2));
  size_t max_bytes = 0;
  for (size_t s : env_sizes("BENCH_SIZES", {mode == "accuracy" ? (size_t)1 << 30 : (size_t)32 << 20}))
    max_bytes = std::max(max_bytes, s);
  max_bytes = std::max(max_bytes, (size_t)1 << 20);
  comms.resize(n_dev);
  streams.resize(n_dev);
  sbuf.resize(n_dev);
  rbuf.resize(n_dev);
  std::vector<int> devs(n_dev);
  for (int i = 0; i < n_dev; i++) {
    devs[i] = i;
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking));
    CUDACHECK(cudaMalloc(&sbuf[i], max_bytes));
    CUDACHECK(cudaMalloc(&rbuf[i], max_bytes * n_dev));
    CUDACHECK(cudaMemset(sbuf[i], 0, max_bytes));
  }
  NCCLCHECK(ncclCommInitAll(comms.data(), n_dev, devs.data()));
  if (mode == "overhead" && argc == 4) overhead(argv[2], atoi(argv[3]));
  else if (mode == "accuracy") accuracy();
  else if (mode == "graph") graph();
  else if (mode == "stress") stress();
  else {
    fprintf(stderr, "unknown mode %s\n", mode.c_str());
    return 2;
  }
  for (int i = 0; i < n_dev; i++) NCCLCHECK(ncclCommDestroy(comms[i]));
  for (int i = 0; i < n_dev; i++) {
    CUDACHECK(cudaSetDevice(i));
    CUDACHECK(cudaFree(sbuf[i]));
    CUDACHECK(cudaFree(rbuf[i]));
  }
  return 0;
}
