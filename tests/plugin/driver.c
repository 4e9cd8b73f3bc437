/* Plays NCCL against the plugin: dlopen()s the .so, looks up ncclProfiler_v5/_v4/_v6 and
 * calls them the way NCCL 2.27-2.30 does (API events, Coll/P2p start and "enqueued" stop,
 * KernelCh start/record/stop from another thread, graph replays, sampling by the
 * activation mask, several communicators, process exit without finalize), then reads the
 * spool back and checks every record.
 *
 * Usage: driver <plugin.so> <outdir> <stress_events>
 * Every scenario writes under <outdir>/<scenario>/; tests/test_plugin_output.py validates
 * all those lines against the record contract afterwards. NW_TEST_ONLY=a,b runs only the
 * scenarios named (tests/test_plugin_progress.py runs the progress-* ones that way).
 */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "minijson.h"
#include "nw_profiler_abi.h"
#include "rules.h"

/* --- harness ---------------------------------------------------------------------- */

static int failures;
#define CHECK(cond, ...)                                                 \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "FAIL [%s] %s:%d: ", scenario, __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                                      \
      fputc('\n', stderr);                                               \
      failures++;                                                        \
    }                                                                    \
  } while (0)
#define REQUIRE(cond, ...)          \
  do {                              \
    if (!(cond)) {                  \
      CHECK(cond, __VA_ARGS__);     \
      exit(1);                      \
    }                               \
  } while (0)

static const char* scenario = "setup";
static const char* outdir;
static const char* self_path;
static const char* lib_path;
static struct nw_profiler_v5* P5;
static struct nw_profiler_v4* P4;
static struct nw_profiler_v6* P6;
static int g_mask; /* NCCL's one process-wide activation mask */
static char g_host[256];

static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static char log_text[16384];
static int log_warnings;

static void logger(int level, unsigned long flags, const char* file, int line, const char* fmt, ...) {
  (void)flags, (void)file, (void)line;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&log_mu);
  if (level == NW_LOG_WARN) log_warnings++;
  size_t used = strlen(log_text);
  snprintf(log_text + used, sizeof log_text - used, "%s\n", msg);
  pthread_mutex_unlock(&log_mu);
  if (getenv("NW_TEST_VERBOSE")) fprintf(stderr, "[plugin %d] %s\n", level, msg);
}

static void log_reset(void) {
  pthread_mutex_lock(&log_mu);
  log_text[0] = '\0';
  log_warnings = 0;
  pthread_mutex_unlock(&log_mu);
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static const char* const all_env[] = {
    "NCCLWATCH_SPOOL_DIR", "NCCLWATCH_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID",
    "NCCLWATCH_SEGMENT_BYTES", "NCCLWATCH_SPOOL_MAX_BYTES", "NCCLWATCH_POOL_OPS",
    "NCCLWATCH_RING_RECORDS", "NCCLWATCH_MAX_THREADS", "NCCLWATCH_FLUSH_MS",
    "NCCLWATCH_OP_TIMEOUT_MS", "NCCLWATCH_TIMING_SAMPLE", "NCCLWATCH_TIMING_KEY_MS",
    "NCCLWATCH_REQUIRE_GPU_TIMING",
    "NCCLWATCH_PROXY_EVENTS", "NCCLWATCH_INSPECTOR_JSON_DIR", "NCCLWATCH_INSPECTOR_PROM_DIR",
    "NCCLWATCH_INSPECTOR_PROM_INTERVAL_MS", "NCCLWATCH_TEST_WRITER_DELAY_US",
    "NCCLWATCH_PROGRESS_MS",
};

static char spool_root[PATH_MAX];

static const char* only; /* NW_TEST_ONLY: comma-separated scenario names, NULL: all */

static bool selected(const char* name) {
  if (!only) return true;
  size_t n = strlen(name);
  for (const char* p = only; p; p = strchr(p, ',') ? strchr(p, ',') + 1 : NULL)
    if (!strncmp(p, name, n) && (p[n] == ',' || p[n] == '\0')) return true;
  return false;
}

/* Fresh environment for one scenario: its own spool directory under outdir. */
static void begin(const char* name, const char* job) {
  scenario = name;
  for (size_t i = 0; i < sizeof all_env / sizeof all_env[0]; i++) unsetenv(all_env[i]);
  snprintf(spool_root, sizeof spool_root, "%s/%s/spool", outdir, name);
  setenv("NCCLWATCH_SPOOL_DIR", spool_root, 1);
  if (job) setenv("NCCLWATCH_JOB_ID", job, 1);
  log_reset();
  fprintf(stderr, "scenario %s\n", name);
}

/* --- reading the spool ------------------------------------------------------------ */

struct spool {
  struct mj** recs; /* every line, in file order, files sorted by name */
  size_t n;
  char files[64][PATH_MAX];
  size_t n_files;
};

static int cmp_str(const void* a, const void* b) { return strcmp(*(char* const*)a, *(char* const*)b); }

static void spool_read_file(struct spool* s, const char* path) {
  FILE* f = fopen(path, "rb");
  REQUIRE(f, "open %s", path);
  char* line = NULL;
  size_t cap = 0;
  ssize_t len;
  while ((len = getline(&line, &cap, f)) > 0) {
    CHECK(line[len - 1] == '\n', "%s: line without newline at the end", path);
    char err[200];
    struct mj* v = mj_parse(line, (size_t)len, err, sizeof err);
    REQUIRE(v && v->type == MJ_OBJ, "%s: bad JSON line (%s): %s", path, v ? "not object" : err, line);
    s->recs = realloc(s->recs, (s->n + 1) * sizeof *s->recs);
    s->recs[s->n++] = v;
  }
  free(line);
  fclose(f);
}

/* All *.jsonl under dir/<one job dir>/ (the spool has one directory per job). */
static void spool_read(struct spool* s, const char* dir) {
  memset(s, 0, sizeof *s);
  DIR* d = opendir(dir);
  if (!d) return;
  char* names[256];
  size_t n = 0;
  struct dirent* e;
  while ((e = readdir(d)) && n < 256) {
    if (e->d_name[0] == '.') continue;
    char sub[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/%s", dir, e->d_name);
    DIR* d2 = opendir(sub);
    if (!d2) continue;
    struct dirent* e2;
    while ((e2 = readdir(d2)) && n < 256) {
      size_t l = strlen(e2->d_name);
      if (l > 6 && !strcmp(e2->d_name + l - 6, ".jsonl")) {
        names[n] = malloc(PATH_MAX);
        snprintf(names[n++], PATH_MAX, "%s/%s", sub, e2->d_name);
      }
    }
    closedir(d2);
  }
  closedir(d);
  qsort(names, n, sizeof *names, cmp_str);
  for (size_t i = 0; i < n; i++) {
    if (s->n_files < 64) snprintf(s->files[s->n_files++], PATH_MAX, "%s", names[i]);
    spool_read_file(s, names[i]);
    free(names[i]);
  }
}

static void spool_free(struct spool* s) {
  for (size_t i = 0; i < s->n; i++) mj_free(s->recs[i]);
  free(s->recs);
  memset(s, 0, sizeof *s);
}

static bool is_kind(const struct mj* v, const char* kind) { return !strcmp(mj_str(v, "kind"), kind); }

static size_t count_kind(const struct spool* s, const char* kind) {
  size_t n = 0;
  for (size_t i = 0; i < s->n; i++) n += is_kind(s->recs[i], kind);
  return n;
}

static const struct mj* last_stats(const struct spool* s) {
  for (size_t i = s->n; i-- > 0;)
    if (is_kind(s->recs[i], "plugin_stats")) return s->recs[i];
  return NULL;
}

static const char* const reasons[7] = {"pool_full", "ring_full",   "disk_full", "write_error",
                                       "untimed",   "quarantined", "other"};

/* plugin_stats counters are per process ("since the process started") and the driver runs
 * every scenario in one process: each scenario counts from the previous one's final stats
 * (the exit scenario's child process starts from zero). */
static int64_t g_base_recorded, g_base_dropped[7];
static bool g_child;

static int64_t base_dropped(int j) { return g_child ? 0 : g_base_dropped[j]; }

static int64_t dropped(const struct spool* s, const char* reason) {
  for (int j = 0; j < 7; j++)
    if (!strcmp(reasons[j], reason)) return mj_int(mj_get(last_stats(s), "dropped"), reason) - base_dropped(j);
  abort();
}

static int64_t dropped_total(const struct spool* s) {
  int64_t t = 0;
  for (int j = 0; j < 7; j++) t += dropped(s, reasons[j]);
  return t;
}

static int64_t recorded(const struct spool* s) {
  return mj_int(last_stats(s), "recorded") - (g_child ? 0 : g_base_recorded);
}

static void spool_free(struct spool* s);

/* A scenario's last look at its spool: the next scenario counts from here. */
static void end_scenario(struct spool* s) {
  const struct mj* st = last_stats(s);
  if (st && !g_child) {
    g_base_recorded = mj_int(st, "recorded");
    for (int j = 0; j < 7; j++) g_base_dropped[j] = mj_int(mj_get(st, "dropped"), reasons[j]);
  }
  spool_free(s);
}

static const struct mj* find_op(const struct spool* s, const char* comm, const char* op, int peer,
                                int64_t seq) {
  const struct mj* found = NULL;
  for (size_t i = 0; i < s->n; i++) {
    const struct mj* v = s->recs[i];
    if (!is_kind(v, "op") || strcmp(mj_str(v, "comm"), comm) || strcmp(mj_str(v, "op"), op) ||
        mj_int(v, "peer") != peer || mj_int(v, "seq") != seq)
      continue;
    CHECK(!found, "op %s %s peer %d seq %lld recorded twice", comm, op, peer, (long long)seq);
    found = v;
  }
  CHECK(found, "op %s %s peer %d seq %lld not recorded", comm, op, peer, (long long)seq);
  return found;
}

/* Checks that hold for every spool: contract fields, ids, bandwidth arithmetic, each
 * segment opening with plugin_stats of its own index, drop totals adding up. */
static void check_spool_common(const struct spool* s) {
  int64_t last_total[8] = {0};
  REQUIRE(last_stats(s), "the spool has plugin_stats");
  for (int j = 0; j < 7; j++) last_total[j] = base_dropped(j);
  for (size_t i = 0; i < s->n; i++) {
    const struct mj* v = s->recs[i];
    CHECK(mj_int(v, "v") == 1, "v == 1");
    const char* kind = mj_str(v, "kind");
    CHECK(!strcmp(mj_str(v, "host"), g_host), "host %s", mj_str(v, "host"));
    CHECK(mj_int(v, "pid") > 0, "pid");
    if (!strcmp(kind, "op")) {
      CHECK(v->n == 29, "op record has %zu fields, want 29", v->n);
      char id[17];
      nw_record_id(mj_str(v, "job"), mj_str(v, "host"), (long)mj_int(v, "pid"), mj_str(v, "comm"),
                   (int)mj_int(v, "rank"), mj_str(v, "op"), (int)mj_int(v, "peer"),
                   (uint64_t)mj_int(v, "seq"), id);
      CHECK(!strcmp(id, mj_str(v, "id")), "id %s want %s", mj_str(v, "id"), id);
      int64_t bytes = mj_int(v, "bytes");
      CHECK(bytes == mj_int(v, "count") * nw_dtype_bytes(mj_str(v, "dtype")), "bytes = count*size");
      double alg, bus;
      nw_bandwidths_gbs(mj_str(v, "op"), (uint64_t)bytes, (int)mj_int(v, "nranks"),
                        mj_int(v, "exec_ns"), &alg, &bus);
      CHECK(alg == mj_num(v, "algbw_gbs") && bus == mj_num(v, "busbw_gbs"),
            "bandwidth of %s: %.17g/%.17g want %.17g/%.17g", mj_str(v, "id"), mj_num(v, "algbw_gbs"),
            mj_num(v, "busbw_gbs"), alg, bus);
      const char* t = nw_transport_class((int)mj_int(v, "nranks"), (int)mj_int(v, "nnodes"));
      CHECK(t && !strcmp(t, mj_str(v, "transport")), "transport");
      CHECK(mj_int(v, "local_ranks") == nw_local_ranks((int)mj_int(v, "nranks"), (int)mj_int(v, "nnodes")),
            "local_ranks");
      const char* timing = mj_str(v, "timing");
      CHECK(!strcmp(timing, "kernel_gpu") || !strcmp(timing, "host") || !strcmp(timing, "sampled_out"),
            "timing %s", timing);
      if (strcmp(timing, "kernel_gpu")) {
        CHECK(mj_int(v, "exec_ns") == 0, "%s exec_ns is 0", timing);
        CHECK(mj_int(v, "start_ns") > 1600000000000000000LL, "%s start_ns is the launch time", timing);
      }
      (void)mj_bool(v, "graph");
      CHECK(strlen(mj_str(v, "comm")) == 18 && !strncmp(mj_str(v, "comm"), "0x", 2), "comm hex");
    } else if (!strcmp(kind, "drop")) {
      CHECK(v->n == 11, "drop record has %zu fields", v->n);
      const char* r = mj_str(v, "reason");
      int k = -1;
      for (int j = 0; j < 7; j++)
        if (!strcmp(r, reasons[j])) k = j;
      REQUIRE(k >= 0, "drop reason %s", r);
      CHECK(mj_int(v, "count") >= 1, "drop count >= 1");
      CHECK(mj_int(v, "total") == last_total[k] + mj_int(v, "count"),
            "drop %s: total %lld = previous %lld + count %lld", r, (long long)mj_int(v, "total"),
            (long long)last_total[k], (long long)mj_int(v, "count"));
      last_total[k] = mj_int(v, "total");
    } else if (!strcmp(kind, "plugin_stats")) {
      CHECK(v->n == 10, "plugin_stats has %zu fields", v->n);
      CHECK(mj_get(v, "dropped")->n == 7, "all 7 drop reasons listed");
    } else if (!strcmp(kind, "progress")) {
      static const char* const keys[17] = {"v", "kind", "job", "host", "pid", "gpu", "comm", "comm_name",
                                           "rank", "nranks", "ts_ns", "issued", "colls", "done",
                                           "in_flight", "waiting_since_ns", "last_done_ns"};
      CHECK(v->n == 17, "progress record has %zu fields", v->n);
      for (size_t k = 0; k < 17 && k < v->n; k++)
        CHECK(!strcmp(v->keys[k], keys[k]), "progress field %zu is %s, want %s", k, v->keys[k], keys[k]);
      int64_t issued = mj_int(v, "issued"), done = mj_int(v, "done"), in_flight = mj_int(v, "in_flight");
      int64_t ts = mj_int(v, "ts_ns"), since = mj_int(v, "waiting_since_ns"), last = mj_int(v, "last_done_ns");
      CHECK(done >= 0 && in_flight >= 0 && in_flight == issued - done, "in_flight = issued - done");
      CHECK(mj_int(v, "colls") >= 0 && mj_int(v, "colls") <= issued, "colls <= issued");
      CHECK(ts > 1600000000000000000LL, "progress ts_ns is wall-clock");
      CHECK(in_flight ? since > 1600000000000000000LL && since <= ts : since == 0, "waiting_since_ns %lld",
            (long long)since);
      CHECK(last == 0 ? done == 0 : last > 1600000000000000000LL && last <= ts, "last_done_ns %lld",
            (long long)last);
      CHECK(strlen(mj_str(v, "comm")) == 18 && !strncmp(mj_str(v, "comm"), "0x", 2), "comm hex");
    } else {
      CHECK(0, "unexpected kind %s", kind);
    }
  }
  /* Each segment starts with plugin_stats naming its own index. */
  for (size_t f = 0; f < s->n_files; f++) {
    FILE* fp = fopen(s->files[f], "rb");
    if (!fp) continue;
    char* line = NULL;
    size_t cap = 0;
    ssize_t len = getline(&line, &cap, fp);
    fclose(fp);
    if (len <= 0) {
      free(line);
      continue;
    }
    struct mj* v = mj_parse(line, (size_t)len, NULL, 0);
    const char* base = strrchr(s->files[f], '/') + 1;
    const char* idx = strrchr(base, '.') - 6;
    CHECK(v && is_kind(v, "plugin_stats") && mj_int(v, "segment") == strtoll(idx, NULL, 10),
          "%s starts with its plugin_stats", base);
    mj_free(v);
    free(line);
  }
  /* After the final stats, every drop has been told in a drop record. */
  const struct mj* st = last_stats(s);
  for (int j = 0; st && j < 7; j++) {
    int64_t want = mj_int(mj_get(st, "dropped"), reasons[j]);
    CHECK(last_total[j] == want, "drop records of %s add up to %lld, stats say %lld", reasons[j],
          (long long)last_total[j], (long long)want);
  }
}

/* --- playing NCCL ----------------------------------------------------------------- */

struct comm {
  void* ctx;
  uint64_t hash;
  char hex[19];
  int nranks, nnodes, rank;
};

static void comm_init5(struct comm* c, uint64_t hash, const char* name, int nnodes, int nranks, int rank) {
  memset(c, 0, sizeof *c);
  c->hash = hash;
  c->nranks = nranks;
  c->nnodes = nnodes;
  c->rank = rank;
  snprintf(c->hex, sizeof c->hex, "0x%016llx", (unsigned long long)hash);
  REQUIRE(P5->init(&c->ctx, hash, &g_mask, name, nnodes, nranks, rank, logger) == 0, "init");
  REQUIRE(c->ctx, "init gave a context");
}

static void* ev(void* ctx, struct nw_descr_v5* d) {
  void* h = (void*)0x1; /* the plugin must always set it */
  REQUIRE(P5->start_event(ctx, &h, d) == 0, "startEvent");
  REQUIRE(h != (void*)0x1, "startEvent set the handle");
  return h;
}

static void* ev_api(void* ctx, int type, bool graph) {
  struct nw_descr_v5 d = {0};
  d.type = (uint64_t)type;
  if (type == NW_EV_COLL_API) d.coll_api.graph_captured = graph;
  else if (type == NW_EV_P2P_API) d.p2p_api.graph_captured = graph;
  return ev(ctx, &d);
}

static void stop(void* h) {
  if (h) REQUIRE(P5->stop_event(h) == 0, "stopEvent");
}

static void* ev_coll(void* ctx, void* parent, const char* func, const char* dtype, size_t count,
                     int root, int nch, uint64_t seq) {
  struct nw_descr_v5 d = {0};
  d.type = NW_EV_COLL;
  d.parent = parent;
  d.coll.func = func;
  d.coll.datatype = dtype;
  d.coll.count = count;
  d.coll.root = root;
  d.coll.n_channels = (uint8_t)nch;
  d.coll.seq_number = seq;
  d.coll.algo = "RING";
  d.coll.proto = "SIMPLE";
  return ev(ctx, &d);
}

static void* ev_p2p(void* ctx, void* parent, const char* func, const char* dtype, size_t count,
                    int peer, int nch) {
  struct nw_descr_v5 d = {0};
  d.type = NW_EV_P2P;
  d.parent = parent;
  d.p2p.func = func;
  d.p2p.datatype = dtype;
  d.p2p.count = count;
  d.p2p.peer = peer;
  d.p2p.n_channels = (uint8_t)nch;
  return ev(ctx, &d);
}

static void* kch_start(void* ctx, void* parent, int ch, uint64_t t) {
  struct nw_descr_v5 d = {0};
  d.type = NW_EV_KERNEL_CH;
  d.parent = parent;
  d.kernel_ch.channel_id = (uint8_t)ch;
  d.kernel_ch.p_timer = t;
  return ev(ctx, &d);
}

static void kch_stop(void* h, uint64_t t) {
  if (!h) return;
  union nw_state_args a = {.kernel_ch = {t}};
  REQUIRE(P5->record_event_state(h, NW_STATE_KERNEL_CH_STOP, &a) == 0, "recordEventState");
  stop(h);
}

/* One op as NCCL 2.28 plays it on one thread: API event, Coll/P2p start, API stop,
 * Coll/P2p stop ("enqueued"), then each channel's start/record/stop with GPU times
 * [t0 + ch*spread, t0 + exec - ch*spread]. */
struct op {
  const char* func;
  const char* dtype;
  size_t count;
  int peer; /* root for colls */
  int nch;
  uint64_t seq;
  bool p2p, graph;
  uint64_t t0, exec;
};

static uint64_t gpu_now(void);

/* t0 == 0: the op ran on the GPU and ended 1 us before its channels report. GPU times in
 * these tests are always in the past when reported, as on a real GPU: the plugin's clock
 * calibration relies on it. */
static void play(void* ctx, struct op* o) {
  void* api = ev_api(ctx, o->p2p ? NW_EV_P2P_API : NW_EV_COLL_API, o->graph);
  void* h = o->p2p ? ev_p2p(ctx, api, o->func, o->dtype, o->count, o->peer, o->nch)
                   : ev_coll(ctx, api, o->func, o->dtype, o->count, o->peer, o->nch, o->seq);
  stop(api);
  stop(h);
  if (!o->t0 && o->nch) o->t0 = gpu_now() - o->exec - 1000;
  for (int ch = 0; ch < o->nch; ch++) {
    void* k = kch_start(ctx, h, ch, o->t0 + (uint64_t)ch * 100);
    kch_stop(k, o->t0 + o->exec - (uint64_t)ch * 100);
  }
}

/* GPU clock of the tests: the host clock minus a skew, as if the GPU's globaltimer were
 * not epoch-aligned. The plugin must undo it. */
#define GPU_SKEW_NS 123456789000LL
static uint64_t gpu_now(void) { return (uint64_t)(now_ns() - GPU_SKEW_NS); }

/* --- scenarios -------------------------------------------------------------------- */

static void check_op(const struct mj* r, const struct op* o, const char* timing, int64_t exec,
                     double algbw, double busbw) {
  if (!r) return;
  CHECK(!strcmp(mj_str(r, "timing"), timing), "%s seq %llu timing %s want %s", o->func,
        (unsigned long long)o->seq, mj_str(r, "timing"), timing);
  CHECK(mj_int(r, "exec_ns") == exec, "%s exec_ns %lld want %lld", o->func,
        (long long)mj_int(r, "exec_ns"), (long long)exec);
  CHECK(mj_num(r, "algbw_gbs") == algbw && mj_num(r, "busbw_gbs") == busbw,
        "%s bandwidth %.17g/%.17g want %.17g/%.17g", o->func, mj_num(r, "algbw_gbs"),
        mj_num(r, "busbw_gbs"), algbw, busbw);
  CHECK(mj_int(r, "count") == (int64_t)o->count, "count");
  CHECK(!strcmp(mj_str(r, "dtype"), o->dtype), "dtype");
  CHECK(mj_int(r, "channels") == o->nch, "channels");
  CHECK(mj_bool(r, "graph") == o->graph, "graph flag of %s seq %llu", o->func, (unsigned long long)o->seq);
  if (!strcmp(timing, "kernel_gpu")) {
    /* Converted to wall clock, never early, late by at most the callback latency. */
    int64_t truth = (int64_t)o->t0 + GPU_SKEW_NS;
    int64_t late = mj_int(r, "start_ns") - truth;
    CHECK(late >= 0 && late < 2000000000LL, "%s start_ns off by %lld ns", o->func, (long long)late);
  }
}

static void scenario_basic(void) {
  /* A job id and communicator name that need every kind of escaping. */
  begin("basic", "job \"7\"/\\\x01\xc3\xa9\xff");
  struct comm c;
  comm_init5(&c, 0xdeadbeefULL, "tp\"0\\\n\x01\xc3\xa9\xff", 1, 2, 0);
  CHECK(g_mask == (NW_EV_COLL | NW_EV_P2P | NW_EV_KERNEL_CH), "activation mask %#x", g_mask);

  struct op ar = {"AllReduce", "ncclFloat32", 262144, -1, 2, 0, false, false, 0, 10000};
  struct op ag = {"AllGather", "ncclInt8", 1000000, -1, 1, 0, false, false, 0, 2000};
  struct op bc = {"Broadcast", "ncclInt8", 4096, 1, 1, 0, false, false, 0, 4096};
  struct op s0 = {"Send", "ncclInt8", 3000, 1, 1, 0, true, false, 0, 1500};
  struct op s1 = {"Send", "ncclInt8", 3000, 1, 1, 1, true, false, 0, 1500};
  struct op r0 = {"Recv", "ncclInt8", 3000, 1, 1, 0, true, false, 0, 3000};
  struct op a2a = {"AlltoAll", "ncclFloat32", 1024, -1, 1, 0, false, false, 0, 4096};
  struct op unk = {"AllReduce", "Unknown", 77, -1, 1, 9, false, false, 0, 1000};
  struct op* ops[] = {&ar, &ag, &bc, &s0, &s1, &r0, &a2a, &unk};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) play(c.ctx, ops[i]);

  /* A channel timestamp 10 ms before NCCL launched the op is another op's: this op is
   * host-timed, the next one is not affected. */
  struct op early = {"Reduce", "ncclFloat32", 64, 0, 1, 0, false, false, gpu_now() - 10000000, 1000};
  play(c.ctx, &early);

  /* Host timing: a Coll with no channels reports no KernelCh. */
  int64_t before = now_ns();
  struct op host = {"ReduceScatter", "ncclFloat32", 100, -1, 0, 0, false, false, 0, 0};
  play(c.ctx, &host);
  int64_t after = now_ns();

  /* CUDA graph: captured once (API event with graphCaptured), replayed three times:
   * each replay is a fresh Coll event whose parent is the capture-time API handle. */
  void* gapi = ev_api(c.ctx, NW_EV_COLL_API, true);
  stop(gapi);
  for (uint64_t seq = 5; seq < 8; seq++) {
    struct op g = {"AllReduce", "ncclFloat32", 262144, -1, 2, seq, false, true, gpu_now() - 30000, 20000};
    void* h = ev_coll(c.ctx, gapi, g.func, g.dtype, g.count, -1, g.nch, seq);
    stop(h);
    for (int ch = 0; ch < 2; ch++) kch_stop(kch_start(c.ctx, h, ch, g.t0 + (uint64_t)ch), g.t0 + g.exec);
  }

  /* Out of order: X starts first, Y's channels finish first, X's Coll stop comes last,
   * after its own channels. */
  uint64_t tx = gpu_now() - 40000;
  void* apix = ev_api(c.ctx, NW_EV_COLL_API, false);
  void* x = ev_coll(c.ctx, apix, "AllReduce", "ncclFloat32", 1024, -1, 2, 1);
  stop(apix);
  void* apiy = ev_api(c.ctx, NW_EV_COLL_API, false);
  void* y = ev_coll(c.ctx, apiy, "AllReduce", "ncclFloat32", 1024, -1, 1, 2);
  stop(apiy);
  stop(y);
  void* x0 = kch_start(c.ctx, x, 0, tx);
  void* y0 = kch_start(c.ctx, y, 0, tx + 100);
  void* x1 = kch_start(c.ctx, x, 1, tx + 50);
  kch_stop(y0, tx + 700);
  kch_stop(x1, tx + 9000);
  kch_stop(x0, tx + 8000);
  stop(x);

  /* Send/Recv to self: NCCL reports channels but makes no proxy op, so no KernelCh
   * comes: recorded at its stop, host-timed. And NCCL's GPU-side channel counters now run
   * ahead of the host's, so the plugin stops trusting this communicator's GPU timings. */
  void* self = ev_p2p(c.ctx, NULL, "Send", "ncclInt8", 64, 0, 2);
  stop(self);
  struct op post = {"AllReduce", "ncclFloat32", 64, -1, 1, 20, false, false, 0, 1000};
  play(c.ctx, &post);
  pthread_mutex_lock(&log_mu);
  bool warned = strstr(log_text, "a Send/Recv to self") != NULL;
  pthread_mutex_unlock(&log_mu);
  CHECK(warned, "the counter desync is reported through NCCL's logger");

  REQUIRE(P5->finalize(c.ctx) == 0, "finalize");

  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 17, "17 ops recorded, got %zu", count_kind(&s, "op"));
  CHECK(count_kind(&s, "drop") == 0, "no drops");
  const struct mj* st = last_stats(&s);
  REQUIRE(st, "final plugin_stats");
  CHECK(recorded(&s) == 17 && dropped_total(&s) == 0, "stats: 17 recorded, 0 dropped");
  const struct mj* e = find_op(&s, c.hex, "Reduce", 0, 0);
  CHECK(e && !strcmp(mj_str(e, "timing"), "host"), "a channel start long before launch is not trusted");
  const struct mj* af = find_op(&s, c.hex, "AllReduce", -1, 20);
  CHECK(af && !strcmp(mj_str(af, "timing"), "host"), "after a self copy, GPU timings are not trusted");
  const struct mj* selfrec = find_op(&s, c.hex, "Send", 0, 0);
  CHECK(selfrec && !strcmp(mj_str(selfrec, "timing"), "host") && mj_int(selfrec, "channels") == 2,
        "send to self: recorded at its stop, host-timed");

  check_op(find_op(&s, c.hex, "AllReduce", -1, 0), &ar, "kernel_gpu", 10000, 104.8576, 104.8576);
  check_op(find_op(&s, c.hex, "AllGather", -1, 0), &ag, "kernel_gpu", 2000, 1000.0, 500.0);
  check_op(find_op(&s, c.hex, "Broadcast", 1, 0), &bc, "kernel_gpu", 4096, 1.0, 1.0);
  check_op(find_op(&s, c.hex, "Send", 1, 0), &s0, "kernel_gpu", 1500, 2.0, 2.0);
  check_op(find_op(&s, c.hex, "Send", 1, 1), &s1, "kernel_gpu", 1500, 2.0, 2.0);
  check_op(find_op(&s, c.hex, "Recv", 1, 0), &r0, "kernel_gpu", 3000, 1.0, 1.0);
  check_op(find_op(&s, c.hex, "AllToAll", -1, 0), &a2a, "kernel_gpu", 4096, 1.0, 0.5);
  check_op(find_op(&s, c.hex, "AllReduce", -1, 9), &unk, "kernel_gpu", 1000, 0.0, 0.0);
  const struct mj* h = find_op(&s, c.hex, "ReduceScatter", -1, 0);
  check_op(h, &host, "host", 0, 0.0, 0.0);
  CHECK(h && mj_int(h, "start_ns") >= before && mj_int(h, "start_ns") <= after,
        "host-timed start_ns is the launch time");
  for (int seq = 5; seq < 8; seq++) {
    const struct mj* g = find_op(&s, c.hex, "AllReduce", -1, seq);
    CHECK(g && mj_bool(g, "graph") && mj_int(g, "exec_ns") == 20000, "graph replay seq %d", seq);
  }
  const struct mj* rx = find_op(&s, c.hex, "AllReduce", -1, 1);
  const struct mj* ry = find_op(&s, c.hex, "AllReduce", -1, 2);
  CHECK(rx && mj_int(rx, "exec_ns") == 9000 && !strcmp(mj_str(rx, "timing"), "kernel_gpu"),
        "out-of-order X: first start to last stop");
  CHECK(ry && mj_int(ry, "exec_ns") == 600, "out-of-order Y");
  /* 100 ns apart on the GPU; the clock offset may have moved by a little between the
   * two conversions (they happen when each record is written). */
  CHECK(rx && ry && llabs(mj_int(ry, "start_ns") - mj_int(rx, "start_ns") - 100) < 2000,
        "start_ns keep GPU order");

  const struct mj* any = find_op(&s, c.hex, "AllReduce", -1, 0);
  if (any) {
    /* User strings: repaired to valid UTF-8, then JSON-escaped; the parser gives back: */
    CHECK(!strcmp(mj_str(any, "job"), "job \"7\"/\\\x01\xc3\xa9\xef\xbf\xbd"), "job round trip");
    CHECK(!strcmp(mj_str(any, "comm_name"), "tp\"0\\\n\x01\xc3\xa9\xef\xbf\xbd"), "comm_name round trip");
    CHECK(!strcmp(mj_str(any, "transport"), "nvlink") && mj_int(any, "nranks") == 2 &&
              mj_int(any, "rank") == 0 && mj_int(any, "local_ranks") == 2,
          "communicator fields");
    CHECK(!strcmp(mj_str(any, "algo"), "RING") && !strcmp(mj_str(any, "proto"), "SIMPLE"), "algo/proto");
    const char* gpu = mj_str(any, "gpu");
    CHECK(!strcmp(gpu, "unknown") || !strncmp(gpu, "GPU-", 4), "gpu %s", gpu);
    /* File name: <spool>/<safe job>/<safe host>-<gpu>-<pid>.000000.jsonl */
    char safe_job[NW_SAFE_NAME_MAX + 1], safe_host[NW_SAFE_NAME_MAX + 1], want[PATH_MAX];
    nw_safe_filename(mj_str(any, "job"), safe_job);
    nw_safe_filename(g_host, safe_host);
    snprintf(want, sizeof want, "%s/%s/%s-%s-%ld.000000.jsonl", spool_root, safe_job, safe_host,
             gpu, (long)getpid());
    CHECK(s.n_files == 1 && !strcmp(s.files[0], want), "segment name %s, want %s",
          s.n_files ? s.files[0] : "(none)", want);
  }
  const struct mj* p = find_op(&s, c.hex, "Send", 1, 0);
  CHECK(p && !strcmp(mj_str(p, "algo"), "") && !strcmp(mj_str(p, "proto"), ""), "p2p has no algo/proto");
  end_scenario(&s);
}

/* Several communicators (a split one with its own hash), app threads issuing ops, and a
 * "proxy" thread delivering KernelCh events in scrambled order. */
/* Ops per app thread in the threads scenario (NW_TEST_THREAD_OPS overrides). */
static uint64_t THR_OPS = 3000;
#define MAX_OUTSTANDING 512

struct work {
  void* ctx;
  void* h;
  int nch;
  uint64_t t0, exec;
};
static struct {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct work items[MAX_OUTSTANDING];
  int n;
  int producers_left;
} q = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {{0}}, 0, 0};

static void q_push(struct work w) {
  pthread_mutex_lock(&q.mu);
  while (q.n == MAX_OUTSTANDING) pthread_cond_wait(&q.cv, &q.mu);
  q.items[q.n++] = w;
  pthread_cond_broadcast(&q.cv);
  pthread_mutex_unlock(&q.mu);
}

static void* proxy_main(void* arg) {
  (void)arg;
  struct work batch[8];
  for (;;) {
    pthread_mutex_lock(&q.mu);
    while (q.n == 0 && q.producers_left > 0) pthread_cond_wait(&q.cv, &q.mu);
    if (q.n == 0) {
      pthread_mutex_unlock(&q.mu);
      return NULL;
    }
    int k = q.n < 8 ? q.n : 8;
    for (int i = 0; i < k; i++) batch[i] = q.items[--q.n];
    pthread_cond_broadcast(&q.cv);
    pthread_mutex_unlock(&q.mu);
    /* Start every channel of the batch first, then stop them newest-op-first. */
    void* kh[8][4];
    for (int i = 0; i < k; i++)
      for (int ch = 0; ch < batch[i].nch; ch++)
        kh[i][ch] = kch_start(batch[i].ctx, batch[i].h, ch, batch[i].t0 + (uint64_t)ch * 10);
    for (int i = k; i-- > 0;)
      for (int ch = batch[i].nch; ch-- > 0;) kch_stop(kh[i][ch], batch[i].t0 + batch[i].exec);
  }
}

struct app {
  struct comm* c;
  const char* coll; /* collective this thread issues */
  bool p2p;         /* and Send/Recv to every peer */
};

static uint64_t expected_exec(uint64_t seq, int salt) { return 1000 + (seq * 7 + (uint64_t)salt) % 5000; }

static void* app_main(void* arg) {
  struct app* a = arg;
  for (uint64_t i = 0; i < THR_OPS; i++) {
    bool p2p = a->p2p && (i % 3 == 2);
    const char* func = p2p ? ((i / 3) % 2 ? "Recv" : "Send") : a->coll;
    /* Never to self: that would (correctly) stop the plugin trusting GPU timings here. */
    int peer = p2p ? (a->c->rank + 1 + (int)((i / 6) % (uint64_t)(a->c->nranks - 1))) % a->c->nranks : -1;
    int nch = 1 + (int)(i % 4);
    void* api = ev_api(a->c->ctx, p2p ? NW_EV_P2P_API : NW_EV_COLL_API, false);
    /* p2p seq is the plugin's own count per (comm, direction, peer): derive it here. */
    uint64_t seq = p2p ? i / (6 * (uint64_t)(a->c->nranks - 1)) : i;
    void* h = p2p ? ev_p2p(a->c->ctx, api, func, "ncclInt8", 1000 + i, peer, nch)
                  : ev_coll(a->c->ctx, api, func, "ncclFloat32", 1000 + i, -1, nch, seq);
    stop(api);
    struct work w = {a->c->ctx, h, nch, gpu_now() - 10000, expected_exec(seq, p2p ? peer : 0)};
    if (p2p && peer == a->c->rank) {
      stop(h); /* to self: NCCL makes no proxy op, so no channel events */
      continue;
    }
    if (i % 2) {
      q_push(w); /* channels may finish before the "enqueued" stop below */
      stop(h);
    } else {
      stop(h);
      q_push(w);
    }
  }
  pthread_mutex_lock(&q.mu);
  q.producers_left--;
  pthread_cond_broadcast(&q.cv);
  pthread_mutex_unlock(&q.mu);
  return NULL;
}

static void scenario_threads(void) {
  begin("threads", "threads-job");
  /* Rings big enough that no drop is expected here: this checks attribution and order. */
  setenv("NCCLWATCH_RING_RECORDS", "65536", 1);
  struct comm ca, cb, cc;
  comm_init5(&ca, 0x1111, "world", 2, 4, 1);      /* mixed */
  comm_init5(&cb, 0x2222, "world.split", 2, 2, 0); /* split child: net */
  comm_init5(&cc, 0x3333, NULL, 1, 8, 5);          /* no name: nvlink */
  struct app apps[4] = {{&ca, "AllReduce", true}, {&cb, "AllGather", true},
                        {&cc, "Broadcast", false}, {&ca, "ReduceScatter", false}};
  q.producers_left = 4;
  pthread_t th[4], px;
  pthread_create(&px, NULL, proxy_main, NULL);
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, app_main, &apps[i]);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  pthread_join(px, NULL);
  P5->finalize(cb.ctx);
  P5->finalize(cc.ctx);
  P5->finalize(ca.ctx);

  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 4 * THR_OPS, "%llu ops, got %zu", (unsigned long long)(4 * THR_OPS),
        count_kind(&s, "op"));
  const struct mj* st = last_stats(&s);
  CHECK(st && recorded(&s) == (int64_t)(4 * THR_OPS) && dropped_total(&s) == 0,
        "stats: recorded %lld, pool_full %lld, ring_full %lld", st ? (long long)recorded(&s) : -1,
        st ? (long long)dropped(&s, "pool_full") : -1, st ? (long long)dropped(&s, "ring_full") : -1);
  size_t bad = 0;
  for (size_t i = 0; i < s.n; i++) {
    const struct mj* v = s.recs[i];
    if (!is_kind(v, "op")) continue;
    const char* op = mj_str(v, "op");
    int p2p = !strcmp(op, "Send") || !strcmp(op, "Recv");
    uint64_t want = expected_exec((uint64_t)mj_int(v, "seq"), p2p ? (int)mj_int(v, "peer") : 0);
    bool self = p2p && mj_int(v, "peer") == mj_int(v, "rank");
    if (self ? strcmp(mj_str(v, "timing"), "host") != 0
             : strcmp(mj_str(v, "timing"), "kernel_gpu") || mj_int(v, "exec_ns") != (int64_t)want)
      bad++;
  }
  CHECK(bad == 0, "%zu ops with the wrong exec time or timing", bad);
  const struct mj* r = find_op(&s, cb.hex, "Send", 1, 0);
  CHECK(r && !strcmp(mj_str(r, "transport"), "net") && !strcmp(mj_str(r, "comm_name"), "world.split"),
        "split communicator keeps its own hash and name");
  r = find_op(&s, ca.hex, "ReduceScatter", -1, 17);
  CHECK(r && !strcmp(mj_str(r, "transport"), "mixed") && mj_int(r, "local_ranks") == 2 &&
            mj_int(r, "rank") == 1,
        "mixed communicator fields");
  r = find_op(&s, cc.hex, "Broadcast", -1, 3);
  CHECK(r && !strcmp(mj_str(r, "comm_name"), "") && mj_int(r, "peer") == -1, "unnamed communicator");
  end_scenario(&s);
}

/* Many events against a slow writer and small rings/pools: drops happen, and every op is
 * either recorded or counted as dropped, exactly. */
struct stress_arg {
  struct comm* c;
  long events;
  long issued, pool_nulls, callbacks;
  unsigned seed;
};

#define STRESS_WINDOW 160
static void* stress_main(void* arg) {
  struct stress_arg* a = arg;
  struct {
    void* h;
    uint64_t t0;
  } open[STRESS_WINDOW];
  int n_open = 0;
  uint64_t seq = 0;
  unsigned x = a->seed;
  while (a->callbacks < a->events || n_open) {
    bool issue = a->callbacks < a->events && n_open < STRESS_WINDOW;
    if (issue) {
      void* api = ev_api(a->c->ctx, NW_EV_COLL_API, false);
      void* h = ev_coll(a->c->ctx, api, "AllReduce", "ncclBfloat16", 4096, -1, 2, seq++);
      stop(api);
      a->callbacks += 3;
      a->issued++;
      if (!h) a->pool_nulls++;
      stop(h);
      a->callbacks += h != NULL;
      open[n_open].h = h;
      open[n_open].t0 = gpu_now() - 10000;
      n_open++;
      continue;
    }
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    int i = (int)(x % (unsigned)n_open);
    for (int ch = 0; ch < 2; ch++) {
      /* NCCL still starts KernelCh for a Coll the plugin gave no handle (parent NULL). */
      void* k = kch_start(a->c->ctx, open[i].h, ch, open[i].t0);
      kch_stop(k, open[i].t0 + 5000);
      a->callbacks += k ? 3 : 1;
    }
    open[i] = open[--n_open];
  }
  return NULL;
}

static void scenario_stress(long events) {
  begin("stress", "stress-job");
  setenv("NCCLWATCH_RING_RECORDS", "1024", 1);
  setenv("NCCLWATCH_POOL_OPS", "128", 1);
  setenv("NCCLWATCH_TEST_WRITER_DELAY_US", "100", 1);
  setenv("NCCLWATCH_FLUSH_MS", "5", 1);
  enum { T = 4 };
  struct comm cs[T];
  struct stress_arg args[T];
  pthread_t th[T];
  for (int i = 0; i < T; i++) {
    char name[32];
    snprintf(name, sizeof name, "stress-%d", i);
    comm_init5(&cs[i], 0xabc000 + (uint64_t)i, name, 1, 8, i);
    args[i] = (struct stress_arg){&cs[i], events / T, 0, 0, 0, 12345u + (unsigned)i};
  }
  int64_t t0 = now_ns();
  for (int i = 0; i < T; i++) pthread_create(&th[i], NULL, stress_main, &args[i]);
  long issued = 0, nulls = 0, callbacks = 0;
  for (int i = 0; i < T; i++) {
    pthread_join(th[i], NULL);
    issued += args[i].issued;
    nulls += args[i].pool_nulls;
    callbacks += args[i].callbacks;
  }
  int64_t t1 = now_ns();
  for (int i = 0; i < T; i++) P5->finalize(cs[i].ctx);
  int64_t t2 = now_ns();

  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* st = last_stats(&s);
  REQUIRE(st, "final stats");
  int64_t ops = (int64_t)count_kind(&s, "op");
  CHECK(recorded(&s) == ops, "stats.recorded %lld == op lines %lld", (long long)recorded(&s),
        (long long)ops);
  CHECK(dropped(&s, "pool_full") == nulls, "pool_full %lld == NULL handles %ld",
        (long long)dropped(&s, "pool_full"), nulls);
  CHECK(ops + dropped_total(&s) == issued, "recorded %lld + dropped %lld == issued %ld",
        (long long)ops, (long long)dropped_total(&s), issued);
  CHECK(callbacks >= events, "played %ld callbacks", callbacks);
  fprintf(stderr,
          "  stress: %ld callbacks, %ld ops issued in %.2f s (%.0f callbacks/s); recorded %lld, "
          "pool_full %lld, ring_full %lld; finalize drained in %.2f s\n",
          callbacks, issued, (double)(t1 - t0) / 1e9, (double)callbacks * 1e9 / (double)(t1 - t0),
          (long long)ops, (long long)dropped(&s, "pool_full"), (long long)dropped(&s, "ring_full"),
          (double)(t2 - t1) / 1e9);
  end_scenario(&s);
}

static void scenario_pool_full(void) {
  begin("pool_full", "pool-job");
  setenv("NCCLWATCH_POOL_OPS", "4", 1);
  struct comm c;
  comm_init5(&c, 0x4444, "small", 1, 2, 0);
  void* hs[10];
  int nulls = 0;
  for (int i = 0; i < 10; i++) {
    hs[i] = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 10, -1, 1, (uint64_t)i);
    nulls += hs[i] == NULL;
  }
  CHECK(nulls == 6, "4 slots: 6 of 10 starts get no handle, got %d", nulls);
  uint64_t t = gpu_now() - 1000;
  for (int i = 0; i < 10; i++) {
    stop(hs[i]);
    kch_stop(kch_start(c.ctx, hs[i], 0, t), t + 100);
  }
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* st = last_stats(&s);
  CHECK(count_kind(&s, "op") == 4 && st && recorded(&s) == 4 && dropped(&s, "pool_full") == 6 &&
            dropped_total(&s) == 6,
        "4 recorded, 6 pool_full");
  size_t drops = 0;
  for (size_t i = 0; i < s.n; i++)
    if (is_kind(s.recs[i], "drop")) {
      drops++;
      CHECK(!strcmp(mj_str(s.recs[i], "reason"), "pool_full") && mj_int(s.recs[i], "count") == 6 &&
                mj_int(s.recs[i], "rank") == 0,
            "one drop record: pool_full 6");
    }
  CHECK(drops == 1, "one drop record, got %zu", drops);
  end_scenario(&s);
}

static size_t count_ops_in_file(const char* path) {
  struct spool s;
  memset(&s, 0, sizeof s);
  spool_read_file(&s, path);
  size_t n = count_kind(&s, "op");
  spool_free(&s);
  return n;
}

static void play_simple(struct comm* c, int n, uint64_t* seq) {
  for (int i = 0; i < n; i++) {
    struct op o = {"AllReduce", "ncclFloat32", 1024, -1, 1, (*seq)++, false, false, 0, 1000};
    play(c->ctx, &o);
  }
}

static int cmp_path(const void* a, const void* b) { return strcmp(a, b); }

static void list_segments(const char* dir, char names[][PATH_MAX], size_t* n, uint64_t* total) {
  *n = 0;
  *total = 0;
  DIR* d = opendir(dir);
  if (!d) return;
  struct dirent* e;
  while ((e = readdir(d)))
    if (strstr(e->d_name, ".jsonl") && *n < 64) {
      snprintf(names[*n], PATH_MAX, "%s/%s", dir, e->d_name);
      struct stat st;
      if (stat(names[*n], &st) == 0) *total += (uint64_t)st.st_size;
      (*n)++;
    }
  closedir(d);
  qsort(names, *n, PATH_MAX, cmp_path);
}

/* The spool bound: segments rotate at NCCLWATCH_SEGMENT_BYTES, no more than
 * NCCLWATCH_SPOOL_MAX_BYTES of them exist, records are counted as disk_full meanwhile,
 * and writing resumes (with new names) once the forwarder deletes segments. */
static void scenario_disk(void) {
  begin("disk", "disk-job");
  setenv("NCCLWATCH_SEGMENT_BYTES", "16384", 1);
  setenv("NCCLWATCH_SPOOL_MAX_BYTES", "49152", 1);
  setenv("NCCLWATCH_FLUSH_MS", "5", 1);
  struct comm c;
  comm_init5(&c, 0x5555, "disk", 1, 2, 0);
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/disk-job", spool_root);
  uint64_t seq = 0;
  static char names[64][PATH_MAX];
  size_t n;
  uint64_t total;
  play_simple(&c, 200, &seq);
  sleep_ms(300);
  list_segments(dir, names, &n, &total);
  CHECK(n == 3 && total <= 49152, "bound reached: %zu segments, %llu bytes", n, (unsigned long long)total);
  long first_index = n ? strtol(strrchr(names[0], '.') - 6, NULL, 10) : -1;
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    CHECK(stat(names[i], &st) == 0 && st.st_size <= 16384, "segment %s within 16384 bytes", names[i]);
  }
  /* The forwarder acknowledges and deletes the first two segments. */
  size_t deleted_ops = 0;
  for (size_t i = 0; i < 2 && i < n; i++) {
    deleted_ops += count_ops_in_file(names[i]);
    unlink(names[i]);
  }
  play_simple(&c, 100, &seq);
  sleep_ms(300);
  list_segments(dir, names, &n, &total);
  CHECK(n == 3 && total <= 49152, "after deletion: %zu segments, %llu bytes", n, (unsigned long long)total);
  for (size_t i = 0; i < n; i++)
    CHECK(strtol(strrchr(names[i], '.') - 6, NULL, 10) == first_index + 2 + (long)i,
          "new segments continue the numbering: %s", names[i]);
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* st = last_stats(&s);
  REQUIRE(st, "final stats written even though the spool is full");
  int64_t ops = (int64_t)(count_kind(&s, "op") + deleted_ops);
  CHECK(recorded(&s) == ops, "recorded %lld == op lines %lld", (long long)recorded(&s), (long long)ops);
  CHECK(dropped(&s, "disk_full") > 0 && ops + dropped_total(&s) == 300, "recorded %lld + disk_full %lld == 300",
        (long long)ops, (long long)dropped(&s, "disk_full"));
  list_segments(dir, names, &n, &total);
  CHECK(total <= 49152, "bound holds at the end: %llu", (unsigned long long)total);
  end_scenario(&s);
}

/* A job directory that is not ours (here: writable by every user) gets no segment; its
 * ops are counted as write_error and reach the spool once the directory is fixed. */
static void scenario_foreign_dir(void) {
  begin("foreign_dir", "foreign-job");
  setenv("NCCLWATCH_FLUSH_MS", "5", 1);
  char dir[PATH_MAX];
  snprintf(dir, sizeof dir, "%s/foreign-job", spool_root);
  mkdir(outdir, 0755);
  char parent[PATH_MAX];
  snprintf(parent, sizeof parent, "%s/%s", outdir, scenario);
  mkdir(parent, 0755);
  mkdir(spool_root, 0755);
  REQUIRE(mkdir(dir, 0700) == 0 && chmod(dir, 0777) == 0, "mkdir %s", dir);
  struct comm c;
  uint64_t seq = 0;
  comm_init5(&c, 0x7777, "foreign", 1, 2, 0);
  play_simple(&c, 4, &seq);
  sleep_ms(100);
  P5->finalize(c.ctx);
  static char names[64][PATH_MAX];
  size_t n;
  uint64_t total;
  list_segments(dir, names, &n, &total);
  CHECK(n == 0, "nothing written into a world-writable job directory: %zu segments", n);
  CHECK(strstr(log_text, "is writable by every user") != NULL, "the refusal is logged");
  REQUIRE(chmod(dir, 0755) == 0, "chmod %s", dir);
  sleep_ms(1100); /* the writer retries a refused directory once a second */
  comm_init5(&c, 0x8888, "fixed", 1, 2, 0);
  play_simple(&c, 3, &seq);
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 3 && recorded(&s) == 3, "ops recorded once the directory is ours");
  CHECK(dropped(&s, "write_error") == 4, "the refused ops counted as write_error: %lld",
        (long long)dropped(&s, "write_error"));
  end_scenario(&s);
}

/* An op whose second channel never reports is recorded host-timed after
 * NCCLWATCH_OP_TIMEOUT_MS; the late stop of its first channel changes nothing. */
static void scenario_reaper(void) {
  begin("reaper", "reaper-job");
  setenv("NCCLWATCH_OP_TIMEOUT_MS", "50", 1);
  setenv("NCCLWATCH_FLUSH_MS", "10", 1);
  struct comm c;
  comm_init5(&c, 0x6666, "reaper", 1, 2, 0);
  uint64_t t = gpu_now();
  void* h = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 64, -1, 2, 0);
  void* k0 = kch_start(c.ctx, h, 0, t);
  stop(h);
  struct spool s;
  int64_t deadline = now_ns() + 5000000000LL;
  do {
    sleep_ms(50);
    spool_read(&s, spool_root);
    if (count_kind(&s, "op") == 1) break;
    spool_free(&s);
  } while (now_ns() < deadline);
  CHECK(count_kind(&s, "op") == 1, "reaped op written before finalize");
  for (size_t i = 0; i < s.n; i++)
    if (is_kind(s.recs[i], "op"))
      CHECK(!strcmp(mj_str(s.recs[i], "timing"), "host") && mj_int(s.recs[i], "exec_ns") == 0,
            "reaped op is host-timed");
  spool_free(&s);
  kch_stop(k0, t + 100); /* late: must be ignored */
  play_simple(&c, 1, &(uint64_t){1});
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 2, "2 ops, got %zu", count_kind(&s, "op"));
  const struct mj* r = find_op(&s, c.hex, "AllReduce", -1, 1);
  CHECK(r && !strcmp(mj_str(r, "timing"), "kernel_gpu"), "next op unaffected");
  end_scenario(&s);

  /* Orphans: with the timeout far away, an op whose channels never start is still
   * recorded (host-timed) about a second after a later op of its communicator started. */
  begin("orphan", "orphan-job");
  setenv("NCCLWATCH_FLUSH_MS", "10", 1);
  /* The orphan waits about a second in flight: its progress lines would race the reaper. */
  setenv("NCCLWATCH_PROGRESS_MS", "0", 1);
  comm_init5(&c, 0x6667, "orphan", 1, 2, 0);
  void* lost = ev_coll(c.ctx, NULL, "Reduce", "ncclFloat32", 64, 0, 1, 0);
  stop(lost);
  play_simple(&c, 1, &(uint64_t){0});
  deadline = now_ns() + 10000000000LL;
  do {
    sleep_ms(100);
    spool_read(&s, spool_root);
    if (count_kind(&s, "op") == 2) break;
    spool_free(&s);
  } while (now_ns() < deadline);
  r = find_op(&s, c.hex, "Reduce", 0, 0);
  CHECK(r && !strcmp(mj_str(r, "timing"), "host"), "orphan recorded before finalize, host-timed");
  spool_free(&s);
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 2, "orphan scenario: 2 ops");
  end_scenario(&s);
}

static void scenario_v4_v6(void) {
  begin("v4", "v4-job");
  void* ctx = NULL;
  REQUIRE(P4->init(&ctx, &g_mask, "v4comm", 0x4004, 1, 2, 1, logger) == 0 && ctx, "v4 init");
  uint64_t t = gpu_now() - 20000;
  struct nw_descr_v4 d = {0};
  d.type = NW_EV_COLL;
  d.coll.func = "AllReduce";
  d.coll.datatype = "ncclFloat64";
  d.coll.count = 1000;
  d.coll.n_channels = 1;
  d.coll.seq_number = 3;
  d.coll.algo = "TREE";
  d.coll.proto = "LL";
  void* h = NULL;
  P4->start_event(ctx, &h, &d);
  CHECK(h, "v4 coll handle");
  P4->stop_event(h);
  struct nw_descr_v4 k = {0};
  k.type = NW_EV_KERNEL_CH;
  k.parent = h;
  k.kernel_ch.p_timer = t;
  void* kh = NULL;
  P4->start_event(ctx, &kh, &k);
  union nw_state_args a = {.kernel_ch = {t + 8000}};
  P4->record_event_state(kh, NW_STATE_KERNEL_CH_STOP, &a);
  P4->stop_event(kh);
  struct nw_descr_v4 pd = {0};
  pd.type = NW_EV_P2P;
  pd.p2p.func = "Recv";
  pd.p2p.datatype = "ncclInt8";
  pd.p2p.count = 500;
  pd.p2p.peer = 0;
  pd.p2p.n_channels = 0;
  P4->start_event(ctx, &h, &pd);
  P4->stop_event(h);
  P4->finalize(ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* r = find_op(&s, "0x0000000000004004", "AllReduce", -1, 3);
  CHECK(r && mj_int(r, "exec_ns") == 8000 && mj_int(r, "bytes") == 8000 && mj_int(r, "rank") == 1 &&
            !strcmp(mj_str(r, "algo"), "TREE") && !mj_bool(r, "graph"),
        "v4 op");
  r = find_op(&s, "0x0000000000004004", "Recv", 0, 0);
  CHECK(r && !strcmp(mj_str(r, "timing"), "host"), "v4 p2p with no channels is host-timed");
  end_scenario(&s);

  begin("v6", "v6-job");
  t = gpu_now() - 5000;
  REQUIRE(P6->init(&ctx, 0x6006, &g_mask, "v6comm", 1, 4, 2, logger) == 0 && ctx, "v6 init");
  struct nw_descr_v6 d6 = {0};
  d6.type = NW_EV_COLL_API;
  d6.coll_api.graph_captured = true;
  void* api = NULL;
  P6->start_event(ctx, &api, &d6);
  memset(&d6, 0, sizeof d6);
  d6.type = NW_EV_COLL;
  d6.parent = api;
  d6.coll.func = "ReduceScatter";
  d6.coll.datatype = "ncclFloat16";
  d6.coll.count = 500;
  d6.coll.n_channels = 1;
  d6.coll.seq_number = 11;
  d6.coll.algo = "RING";
  d6.coll.proto = "LL128";
  P6->start_event(ctx, &h, &d6);
  P6->stop_event(api);
  P6->stop_event(h);
  memset(&d6, 0, sizeof d6);
  d6.type = NW_EV_KERNEL_CH;
  d6.parent = h;
  d6.kernel_ch.p_timer = t;
  P6->start_event(ctx, &kh, &d6);
  a.kernel_ch.p_timer = t + 1000;
  P6->record_event_state(kh, NW_STATE_KERNEL_CH_STOP, &a);
  P6->stop_event(kh);
  memset(&d6, 0, sizeof d6);
  d6.type = NW_EV_CE_COLL; /* asked for by nobody: must be ignored safely */
  void* ce = (void*)0x1;
  P6->start_event(ctx, &ce, &d6);
  CHECK(ce == NULL, "CE events get no handle");
  P6->finalize(ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  r = find_op(&s, "0x0000000000006006", "ReduceScatter", -1, 11);
  /* 500 halfs = 1000 B per rank, 4 ranks: traffic 4000 B in 1000 ns = 4 GB/s, x 3/4. */
  CHECK(r && mj_bool(r, "graph") && mj_num(r, "algbw_gbs") == 4.0 && mj_num(r, "busbw_gbs") == 3.0,
        "v6 op");
  end_scenario(&s);
}

static void scenario_config(void) {
  begin("config", "config-job");
  setenv("NCCLWATCH_SEGMENT_BYTES", "64MiB", 1);
  setenv("NCCLWATCH_RING_RECORDS", "1000", 1);
  setenv("NCCLWATCH_REQUIRE_GPU_TIMING", "maybe", 1);
  setenv("NCCLWATCH_POOL_OPS", "-5", 1);
  struct comm c;
  comm_init5(&c, 0x7777, "cfg", 1, 2, 0);
  pthread_mutex_lock(&log_mu);
  int warnings = log_warnings;
  bool named = strstr(log_text, "NCCLWATCH_SEGMENT_BYTES") && strstr(log_text, "NCCLWATCH_RING_RECORDS") &&
               strstr(log_text, "NCCLWATCH_REQUIRE_GPU_TIMING") && strstr(log_text, "NCCLWATCH_POOL_OPS");
  pthread_mutex_unlock(&log_mu);
  CHECK(warnings == 4 && named, "4 bad values reported through NCCL's logger, got %d:\n%s", warnings, log_text);
  uint64_t seq = 0;
  play_simple(&c, 3, &seq);
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "op") == 3, "defaults used, ops recorded");
  end_scenario(&s);
}

static char* slurp(const char* path, size_t* len) {
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  char* buf = NULL;
  size_t cap = 0, n = 0, k;
  char tmp[4096];
  while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) {
    if (n + k + 1 > cap) {
      cap = (n + k + 1) * 2;
      buf = realloc(buf, cap);
    }
    memcpy(buf + n, tmp, k);
    n += k;
  }
  fclose(f);
  if (!buf) buf = calloc(1, 1);
  buf[n] = '\0';
  *len = n;
  return buf;
}

static void scenario_inspector(void) {
  begin("inspector", "insp-job");
  char jdir[PATH_MAX], pdir[PATH_MAX];
  snprintf(jdir, sizeof jdir, "%s/inspector/json", outdir);
  snprintf(pdir, sizeof pdir, "%s/inspector/prom", outdir);
  setenv("NCCLWATCH_INSPECTOR_JSON_DIR", jdir, 1);
  setenv("NCCLWATCH_INSPECTOR_PROM_DIR", pdir, 1);
  setenv("NCCLWATCH_INSPECTOR_PROM_INTERVAL_MS", "60000", 1);
  struct comm c;
  comm_init5(&c, 0x8888, "dp \"0\"\n\\", 1, 2, 0);
  for (uint64_t i = 0; i < 10; i++) {
    struct op o = {"AllReduce", "ncclFloat32", 262144, -1, 2, i, false, false, 0, 10000 + 1000 * i};
    play(c.ctx, &o);
  }
  for (uint64_t i = 0; i < 5; i++) {
    struct op o = {"Send", "ncclInt8", 3000, 1, 1, i, true, false, 0, 1500};
    play(c.ctx, &o);
  }
  struct op host = {"AllReduce", "ncclFloat32", 262144, -1, 0, 10, false, false, 0, 0};
  play(c.ctx, &host);
  P5->finalize(c.ctx);

  char path[PATH_MAX];
  snprintf(path, sizeof path, "%s/%s-pid%ld.log", jdir, g_host, (long)getpid());
  size_t len;
  char* text = slurp(path, &len);
  REQUIRE(text, "Inspector JSON file %s", path);
  int lines = 0, coll = 0, p2p = 0;
  for (char *p = text, *nl; (nl = strchr(p, '\n')); p = nl + 1) {
    struct mj* v = mj_parse(p, (size_t)(nl - p), NULL, 0);
    REQUIRE(v, "Inspector JSON line parses");
    lines++;
    const struct mj* hdr = mj_get(v, "header");
    CHECK(hdr && !strcmp(mj_str(hdr, "id"), "0x8888") && !strcmp(mj_str(hdr, "comm_name"), "dp \"0\"\n\\") &&
              mj_int(hdr, "n_ranks") == 2 && mj_int(hdr, "nnodes") == 1,
          "Inspector header");
    const struct mj* md = mj_get(v, "metadata");
    CHECK(md && !strcmp(mj_str(md, "rec_mechanism"), "nccl_profiler_interface") &&
              mj_int(md, "pid") == getpid() && mj_int(md, "dump_timestamp_us") > 0,
          "Inspector metadata");
    const struct mj* cp = mj_get(v, "coll_perf");
    const struct mj* pp = mj_get(v, "p2p_perf");
    if (cp) {
      coll++;
      int64_t sn = mj_int(cp, "coll_sn");
      CHECK(!strcmp(mj_str(cp, "coll"), "AllReduce") && mj_int(cp, "coll_msg_size_bytes") == 1048576,
            "coll_perf fields");
      if (sn < 10)
        CHECK(mj_int(cp, "coll_exec_time_us") == 10 + sn && !strcmp(mj_str(cp, "coll_timing_source"), "kernel_gpu") &&
                  mj_num(cp, "coll_busbw_gbs") > 0,
              "coll_perf exec/timing");
      else
        CHECK(!strcmp(mj_str(cp, "coll_timing_source"), "collective_cpu"), "host-timed op");
    }
    if (pp) {
      p2p++;
      CHECK(!strcmp(mj_str(pp, "p2p"), "Send") && mj_int(pp, "p2p_peer") == 1 &&
                mj_num(pp, "p2p_algobw_gbs") == 2.0,
            "p2p_perf fields");
    }
    mj_free(v);
  }
  CHECK(lines == 16 && coll == 11 && p2p == 5, "Inspector JSON: %d lines (%d coll, %d p2p)", lines, coll, p2p);
  free(text);

  snprintf(path, sizeof path, "%s/nccl_inspector_metrics_unknown.prom", pdir);
  text = slurp(path, &len);
  REQUIRE(text, "Prometheus file %s", path);
  const char* labels = "{version=\"v5.1\",slurm_job_id=\"insp-job\",node=\"";
  CHECK(strstr(text, labels), "labels start like Inspector's");
  CHECK(strstr(text, "comm_name=\"dp \\\"0\\\"\\n\\\\\",n_nodes=\"1\",nranks=\"2\",collective=\"AllReduce\","
                     "message_size=\"1-2MB\",algo_proto=\"RING_SIMPLE\"} 10\n"),
        "escaped labels and _count 10 (host-timed op excluded):\n%s", text);
  CHECK(strstr(text, "# TYPE nccl_collective_exec_time_microseconds_max gauge\n") &&
            strstr(text, "algo_proto=\"RING_SIMPLE\"} 19\n") && strstr(text, "algo_proto=\"RING_SIMPLE\"} 14.5\n"),
        "max 19 us and mean 14.5 us");
  CHECK(strstr(text, "nccl_p2p_exec_time_microseconds{") && strstr(text, "p2p_operation=\"Send\",message_size=\"2-3KB\"} 1.5\n"),
        "p2p series");
  for (const char* m = text; (m = strstr(m, "# TYPE ")); m++) {
    char name[128];
    sscanf(m, "# TYPE %127s", name);
    int dup = 0;
    for (const char* o = text; (o = strstr(o, "# TYPE ")); o++) {
      char n2[128];
      sscanf(o, "# TYPE %127s", n2);
      dup += !strcmp(name, n2);
    }
    CHECK(dup == 1, "one TYPE line per family (%s)", name);
  }
  free(text);
}

/* NCCL as the sampler sees it (sampler.c): every API call copies the process-wide mask
 * *before* the GroupApi start callback; the task keeps its copy; channel events come only
 * for tasks whose copy had KernelCh. One "group" here: an AllReduce plus a Send/Recv pair
 * to the same peer, the pair whose copies must never differ. */
struct sgroup {
  uint64_t seq;
  const char* key; /* the AllReduce's function name: the sampler's per-key signature */
  size_t count;
  bool graph;
  bool hold; /* keep the channel events: the caller delivers them with release_group */
  int timed; /* out: 1 if the group's copies had KernelCh */
  void* h[3];
};

static void release_group(struct comm* c, struct sgroup* g) {
  uint64_t t = gpu_now() - 2000;
  for (int i = 0; i < 3; i++)
    for (int ch = 0; ch < (i == 0 ? 2 : 1); ch++) kch_stop(kch_start(c->ctx, g->h[i], ch, t), t + 700);
}

static void* ev_api_call(void* ctx, int type, bool graph, const char* func, size_t count) {
  struct nw_descr_v5 d = {0};
  d.type = (uint64_t)type;
  if (type == NW_EV_COLL_API) d.coll_api = (__typeof__(d.coll_api)){.func = func, .count = count, .graph_captured = graph};
  if (type == NW_EV_P2P_API) d.p2p_api = (__typeof__(d.p2p_api)){.func = func, .count = count, .graph_captured = graph};
  if (type == NW_EV_GROUP_API) d.group_api.graph_captured = graph;
  return ev(ctx, &d);
}

static void play_group(struct comm* c, struct sgroup* g) {
  int copies[3];
  void* api[3];
  void* group = NULL;
  const char* funcs[3] = {g->key, "Send", "Recv"};
  for (int i = 0; i < 3; i++) {
    copies[i] = __atomic_load_n(&g_mask, __ATOMIC_RELAXED); /* ncclProfilerStartGroupApiEvent */
    if (i == 0) group = ev_api_call(c->ctx, NW_EV_GROUP_API, g->graph, NULL, 0);
    api[i] = ev_api_call(c->ctx, i == 0 ? NW_EV_COLL_API : NW_EV_P2P_API, g->graph, funcs[i], g->count);
    stop(api[i]);
  }
  CHECK(copies[0] == copies[1] && copies[1] == copies[2], "one group saw one mask: %#x %#x %#x",
        copies[0], copies[1], copies[2]);
  g->timed = (copies[0] & NW_EV_KERNEL_CH) != 0;
  /* Kernels launched inside the group end, before its GroupApi stop. */
  void** h = g->h;
  h[0] = ev_coll(c->ctx, api[0], g->key, "ncclFloat32", g->count, -1, 2, g->seq);
  h[1] = ev_p2p(c->ctx, api[1], "Send", "ncclFloat32", g->count, 1, 1);
  h[2] = ev_p2p(c->ctx, api[2], "Recv", "ncclFloat32", g->count, 1, 1);
  for (int i = 0; i < 3; i++) stop(h[i]);
  stop(group);
  if (g->timed && !g->hold) release_group(c, g);
}

struct timing_count {
  int64_t gpu, sampled_out, host;
};

static struct timing_count count_timing(const struct spool* s, const char* op) {
  struct timing_count n = {0};
  for (size_t i = 0; i < s->n; i++) {
    const struct mj* v = s->recs[i];
    if (!is_kind(v, "op") || (op && strcmp(mj_str(v, "op"), op))) continue;
    const char* t = mj_str(v, "timing");
    n.gpu += !strcmp(t, "kernel_gpu");
    n.sampled_out += !strcmp(t, "sampled_out");
    n.host += !strcmp(t, "host");
  }
  return n;
}

/* NCCLWATCH_TIMING_SAMPLE: KernelCh switched only at an outermost group's stop, never
 * inside a group; each op says how it was timed; every op is recorded. */
static void scenario_sampling(void) {
  begin("sampling", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "4", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "0", 1);
  setenv("NCCLWATCH_RING_RECORDS", "65536", 1); /* 12,000 ops faster than any writer wakes */
  struct comm c;
  comm_init5(&c, 0x9999, "sampled", 1, 2, 0);
  const int n = 4000;
  int timed_groups = 0, switches = 0, last = 1;
  for (int i = 0; i < n; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 1024};
    play_group(&c, &g);
    timed_groups += g.timed;
    switches += g.timed != last;
    last = g.timed;
  }
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  struct timing_count t = count_timing(&s, NULL);
  CHECK(t.gpu + t.sampled_out == 3 * n && t.host == 0,
        "every op recorded, timed or sampled out: %lld + %lld of %d (%lld host)", (long long)t.gpu,
        (long long)t.sampled_out, 3 * n, (long long)t.host);
  CHECK(t.gpu == 3 * timed_groups, "GPU-timed ops are exactly the timed groups' (%lld, %d groups)",
        (long long)t.gpu, timed_groups);
  /* 1 in 4 drawn, but never right after a timed group (its channel events come after its
   * stop here): p / (1 + p) = 1 in 5. */
  CHECK(timed_groups > n / 5 - n / 20 && timed_groups < n / 5 + n / 20,
        "about 1 group in 5 timed: %d of %d", timed_groups, n);
  CHECK(switches > 100, "the mask switched (%d times)", switches);
  CHECK(dropped_total(&s) == 0, "nothing dropped: %lld", (long long)dropped_total(&s));
  pthread_mutex_lock(&log_mu);
  CHECK(strstr(log_text, "ops recorded without it") != NULL, "finalize reports the sampling");
  pthread_mutex_unlock(&log_mu);
  end_scenario(&s);

  /* Ranks that issue the same groups time the same ones: a second "rank" in a fresh
   * start gets the same choices. */
  begin("sampling-ranks", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "4", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "0", 1);
  setenv("NCCLWATCH_RING_RECORDS", "65536", 1);
  comm_init5(&c, 0x9999, "sampled", 1, 2, 1);
  int timed2 = 0;
  for (int i = 0; i < n; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 1024};
    play_group(&c, &g);
    timed2 += g.timed;
  }
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(timed2 == timed_groups, "the same groups timed on both ranks: %d vs %d", timed2, timed_groups);
  end_scenario(&s);

  /* Every recurring key keeps fresh GPU timings however rare the random sample is: three
   * keys in a loop, one in 10^6 at random, each key re-timed after 20 ms. */
  begin("sampling-keys", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "1000000", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "20", 1);
  comm_init5(&c, 0x9999, "sampled", 1, 2, 0);
  const char* keys[3] = {"AllReduce", "AllGather", "ReduceScatter"};
  int64_t t_end = now_ns() + 300 * 1000000LL;
  int groups = 0;
  for (int i = 0; now_ns() < t_end; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = keys[i % 3], .count = 4096};
    play_group(&c, &g);
    groups++;
    sleep_ms(1);
  }
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  for (int k = 0; k < 3; k++) {
    struct timing_count tk = count_timing(&s, keys[k]);
    /* 300 ms / 20 ms: ~15 refreshes; the first two groups are timed before any successor is known. */
    CHECK(tk.gpu >= 8 && tk.gpu <= 40, "%s GPU-timed %lld times in 300 ms", keys[k], (long long)tk.gpu);
  }
  struct timing_count all = count_timing(&s, NULL);
  CHECK(all.gpu + all.sampled_out == 3 * groups && all.sampled_out > all.gpu,
        "mostly sampled out: %lld timed, %lld not", (long long)all.gpu, (long long)all.sampled_out);
  end_scenario(&s);

  /* No timed group while a timed op still waits for its channel events: NCCL's proxy would
   * read a later timed op's timestamps from the reused slot. */
  begin("sampling-in-flight", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "2", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "1", 1);
  comm_init5(&c, 0x9999, "sampled", 1, 2, 0);
  struct sgroup held = {.seq = 0, .key = "AllReduce", .count = 64, .hold = true};
  play_group(&c, &held);
  CHECK(held.timed, "the first group is timed");
  int while_held = 0;
  for (int i = 1; i < 200; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
    while_held += g.timed;
  }
  CHECK(while_held == 0, "no group timed while one waits for its channels: %d", while_held);
  release_group(&c, &held);
  int after_release = 0;
  for (int i = 200; i < 400; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
    after_release += g.timed;
  }
  CHECK(after_release > 20, "timing resumes once they came: %d of 200", after_release);
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  end_scenario(&s);

  /* A captured group freezes its tasks' copies: full GPU timing from the next group on,
   * so graph replays keep reporting. */
  begin("sampling-graph", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "1000000", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "0", 1);
  comm_init5(&c, 0x9999, "sampled", 1, 2, 0);
  for (int i = 0; i < 5; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
  }
  CHECK(!(g_mask & NW_EV_KERNEL_CH), "sampled out before the capture");
  struct sgroup cap = {.seq = 5, .key = "AllReduce", .count = 64, .graph = true};
  play_group(&c, &cap);
  CHECK(g_mask & NW_EV_KERNEL_CH, "KernelCh on after a captured group");
  int after = 0;
  for (int i = 6; i < 50; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
    after += g.timed;
  }
  CHECK(after == 44, "every group after the capture asks for GPU timing: %d of 44", after);
  P5->finalize(c.ctx);
  spool_read(&s, spool_root);
  check_spool_common(&s);
  /* The captured group ran without KernelCh: NCCL's counters are out of step from its
   * replays on, so the communicator's later ops are host-timed, not given foreign times. */
  int64_t host_after = 0;
  for (size_t i = 0; i < s.n; i++)
    if (is_kind(s.recs[i], "op") && mj_int(s.recs[i], "seq") >= 6 && !strcmp(mj_str(s.recs[i], "op"), "AllReduce"))
      host_after += !strcmp(mj_str(s.recs[i], "timing"), "host");
  CHECK(host_after == 44, "AllReduces after a capture without GPU timing host-timed: %lld of 44",
        (long long)host_after);
  pthread_mutex_lock(&log_mu);
  CHECK(strstr(log_text, "a CUDA graph is being captured") != NULL, "the switch to full timing is logged");
  CHECK(strstr(log_text, "captured without GPU timing") != NULL, "the distrust is logged");
  pthread_mutex_unlock(&log_mu);
  end_scenario(&s);

  /* v4 (NCCL 2.27) has no GroupApi event: no safe point, every op GPU-timed. */
  begin("sampling-v4", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "4", 1);
  void* ctx4 = NULL;
  g_mask = 0;
  REQUIRE(P4->init(&ctx4, &g_mask, "v4", 0x4444, 1, 2, 0, logger) == 0 && ctx4, "v4 init");
  CHECK(g_mask & NW_EV_KERNEL_CH, "v4: KernelCh asked for");
  P4->finalize(ctx4);
  pthread_mutex_lock(&log_mu);
  CHECK(strstr(log_text, "needs the v5 interface") != NULL, "v4: sampling refused with a reason");
  pthread_mutex_unlock(&log_mu);
  spool_read(&s, spool_root);
  end_scenario(&s);
}

struct sampling_thread_arg {
  struct comm* c;
  int groups;
};

static void* sampling_second_thread(void* p) {
  struct sampling_thread_arg* a = p;
  for (int i = 0; i < a->groups; i++) {
    struct sgroup g = {.seq = 100000 + (uint64_t)i, .key = "AllGather", .count = 256};
    play_group(a->c, &g);
  }
  return NULL;
}

/* A second thread issuing NCCL calls ends sampling: KernelCh comes back on at a group stop
 * with no group open, and no group ever sees two masks. */
static void scenario_sampling_threads(void) {
  begin("sampling-threads", "sampling-job");
  setenv("NCCLWATCH_TIMING_SAMPLE", "1000000", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "0", 1);
  struct comm c;
  comm_init5(&c, 0x9999, "sampled", 1, 2, 0);
  for (int i = 0; i < 10; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
  }
  CHECK(!(g_mask & NW_EV_KERNEL_CH), "sampled out before the second thread");
  pthread_t t;
  struct sampling_thread_arg a = {&c, 200};
  pthread_create(&t, NULL, sampling_second_thread, &a);
  pthread_join(t, NULL);
  CHECK(g_mask & NW_EV_KERNEL_CH, "KernelCh on after the second thread's group");
  for (int i = 10; i < 20; i++) {
    struct sgroup g = {.seq = (uint64_t)i, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
    CHECK(g.timed, "owner's group %d GPU-timed after sampling stopped", i);
  }
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  pthread_mutex_lock(&log_mu);
  CHECK(strstr(log_text, "more than one thread") != NULL, "the reason is logged");
  pthread_mutex_unlock(&log_mu);
  end_scenario(&s);
}

static void scenario_untimed(void) {
  begin("untimed", "untimed-job");
  setenv("NCCLWATCH_REQUIRE_GPU_TIMING", "1", 1);
  struct comm c;
  comm_init5(&c, 0xaaaa, "untimed", 1, 2, 0);
  struct op host = {"AllReduce", "ncclFloat32", 8, -1, 0, 0, false, false, 0, 0};
  play(c.ctx, &host);
  uint64_t seq = 1;
  play_simple(&c, 1, &seq);
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* st = last_stats(&s);
  CHECK(count_kind(&s, "op") == 1 && st && dropped(&s, "untimed") == 1 && dropped_total(&s) == 1,
        "host-timed op dropped as untimed");
  end_scenario(&s);
}

static void scenario_restart(void) {
  begin("restart", "restart-job");
  struct comm c;
  uint64_t seq = 0;
  comm_init5(&c, 0xbbbb, "first", 1, 2, 0);
  play_simple(&c, 2, &seq);
  P5->finalize(c.ctx); /* last communicator: the writer stops */
  comm_init5(&c, 0xcccc, "second", 1, 2, 0);
  play_simple(&c, 3, &seq);
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(s.n_files == 2 && strtol(strrchr(s.files[1], '.') - 6, NULL, 10) ==
                              strtol(strrchr(s.files[0], '.') - 6, NULL, 10) + 1,
        "a second segment, never the first reused");
  const struct mj* st = last_stats(&s);
  CHECK(count_kind(&s, "op") == 5 && st && recorded(&s) == 5, "recorded counts across restarts");
  end_scenario(&s);
}

/* Child process: with a fake libcuda, no finalize, exit() with ops open. */
static int exit_child(void) {
  struct comm c;
  comm_init5(&c, 0xeeee, "exit", 1, 2, 1);
  uint64_t seq = 0;
  play_simple(&c, 5, &seq);
  void* h1 = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 16, -1, 1, seq++);
  void* h2 = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 16, -1, 2, seq++);
  stop(h2);
  (void)kch_start(c.ctx, h2, 0, gpu_now());
  (void)h1;
  exit(0); /* the plugin's atexit handler must write everything */
}

static void scenario_exit(void) {
  begin("exit", "exit-job");
  char pdir[PATH_MAX];
  snprintf(pdir, sizeof pdir, "%s/exit/prom", outdir);
  setenv("NCCLWATCH_INSPECTOR_PROM_DIR", pdir, 1);
  const char* cuda = getenv("NW_TEST_CUDA_DIR");
  pid_t pid = fork();
  REQUIRE(pid >= 0, "fork");
  if (pid == 0) {
    if (cuda) setenv("LD_LIBRARY_PATH", cuda, 1);
    /* The plugin leaves its memory in place at exit on purpose (NCCL threads may run). */
    setenv("ASAN_OPTIONS", "detect_leaks=0", 1);
    execl(self_path, self_path, "--exit-child", lib_path, (char*)NULL);
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  g_child = true;
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child exited cleanly (status %d)", status);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* st = last_stats(&s);
  CHECK(count_kind(&s, "op") == 7 && st && mj_int(st, "recorded") == 7 && dropped_total(&s) == 0,
        "7 ops written at exit, got %zu",
        count_kind(&s, "op"));
  int host = 0;
  for (size_t i = 0; i < s.n; i++)
    if (is_kind(s.recs[i], "op")) host += !strcmp(mj_str(s.recs[i], "timing"), "host");
  CHECK(host == 2, "the 2 open ops are host-timed, got %d", host);
  if (cuda) {
    const char* uuid = "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f";
    CHECK(s.n > 0 && !strcmp(mj_str(s.recs[0], "gpu"), uuid), "GPU UUID from the driver");
    char tail[128];
    snprintf(tail, sizeof tail, "-%s-%d.000000.jsonl", uuid, (int)pid);
    CHECK(s.n_files == 1 && strstr(s.files[0], tail), "segment named with the UUID: %s",
          s.n_files ? s.files[0] : "");
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/nccl_inspector_metrics_10111213-1415-1617-1819-1a1b1c1d1e1f.prom", pdir);
    size_t len;
    char* text = slurp(path, &len);
    CHECK(text && strstr(text, "gpu=\"GPU3\""), "Inspector file named by bare UUID, gpu label GPU3");
    free(text);
  }
  end_scenario(&s);
  g_child = false;
}

/* --- progress records ------------------------------------------------------------- */

/* The progress lines of one communicator (comm NULL: of all), in file order. */
static size_t progress_of(const struct spool* s, const char* comm, const struct mj** out, size_t max) {
  size_t n = 0;
  for (size_t i = 0; i < s->n; i++)
    if (is_kind(s->recs[i], "progress") && (!comm || !strcmp(mj_str(s->recs[i], "comm"), comm)) && n < max)
      out[n++] = s->recs[i];
  return n;
}

/* A collective enqueued whose only channel started on the GPU and never stops: NCCL's view
 * of a hung collective. Returns the channel's handle, to stop it with kch_stop. */
static void* start_stuck(struct comm* c, uint64_t seq) {
  void* api = ev_api(c->ctx, NW_EV_COLL_API, false);
  void* h = ev_coll(c->ctx, api, "AllReduce", "ncclFloat32", 1024, -1, 1, seq);
  stop(api);
  stop(h);
  REQUIRE(h, "the stuck op has a slot");
  return kch_start(c->ctx, h, 0, gpu_now());
}

/* A hung AllReduce on one communicator, another one idle: every interval, a progress line
 * for both, the stuck one in flight since the AllReduce's launch; none once it completed. */
static void scenario_progress_hang(void) {
  begin("progress-hang", "progress-job");
  setenv("NCCLWATCH_PROGRESS_MS", "500", 1);
  struct comm a, b;
  comm_init5(&a, 0xd00d, "stuck", 1, 2, 0);
  comm_init5(&b, 0xd00e, "idle", 1, 2, 1);
  uint64_t seq = 0, seq_b = 0;
  play_simple(&a, 3, &seq);
  struct op send = {"Send", "ncclInt8", 64, 1, 1, 0, true, false, 0, 500};
  play(a.ctx, &send); /* counted in issued, not in colls */
  play_simple(&b, 2, &seq_b);
  int64_t t_start = now_ns();
  void* k = start_stuck(&a, seq++);
  sleep_ms(2500);
  kch_stop(k, gpu_now());
  int64_t t_done = now_ns();
  play_simple(&a, 3, &seq);
  play_simple(&b, 1, &seq_b);
  sleep_ms(700); /* more than an interval with nothing stuck: nothing may be written */
  P5->finalize(b.ctx);
  P5->finalize(a.ctx);

  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* pa[64];
  const struct mj* pb[64];
  size_t na = progress_of(&s, a.hex, pa, 64), nb = progress_of(&s, b.hex, pb, 64);
  CHECK(na >= 2 && na <= 6 && nb == na, "2 to 6 progress lines per communicator in 2.5 s: %zu and %zu", na, nb);
  for (size_t i = 0; i < na; i++) {
    const struct mj* v = pa[i];
    int64_t ts = mj_int(v, "ts_ns"), since = mj_int(v, "waiting_since_ns");
    CHECK(mj_int(v, "in_flight") == 1 && mj_int(v, "issued") == 5 && mj_int(v, "colls") == 4 &&
              mj_int(v, "done") == 4,
          "stuck comm: issued %lld colls %lld done %lld in_flight %lld", (long long)mj_int(v, "issued"),
          (long long)mj_int(v, "colls"), (long long)mj_int(v, "done"), (long long)mj_int(v, "in_flight"));
    CHECK(since >= t_start && since - t_start < 1000000000LL, "waiting since the launch: %lld ns after",
          (long long)(since - t_start));
    CHECK(mj_int(v, "last_done_ns") > 0 && mj_int(v, "last_done_ns") <= t_start, "last completion before the hang");
    CHECK(ts - since >= 500000000LL && ts < t_done, "written while stuck, after the interval");
    CHECK(i == 0 || ts - mj_int(pa[i - 1], "ts_ns") >= 450000000LL, "at most one line per interval");
    CHECK(!strcmp(mj_str(v, "comm_name"), "stuck") && mj_int(v, "rank") == 0 && mj_int(v, "nranks") == 2 &&
              !strcmp(mj_str(v, "job"), "progress-job"),
          "the communicator's fields");
    if (i < nb) {
      const struct mj* w = pb[i];
      CHECK(mj_int(w, "ts_ns") == ts, "both communicators in the same pass");
      CHECK(mj_int(w, "in_flight") == 0 && mj_int(w, "waiting_since_ns") == 0 && mj_int(w, "issued") == 2 &&
                mj_int(w, "colls") == 2 && mj_int(w, "done") == 2 && mj_int(w, "rank") == 1,
            "idle comm: nothing in flight");
    }
  }
  const struct mj* r = find_op(&s, a.hex, "AllReduce", -1, 3);
  CHECK(r && !strcmp(mj_str(r, "timing"), "kernel_gpu") && mj_int(r, "exec_ns") >= 2400000000LL,
        "the stuck op is recorded once it completes");
  CHECK(count_kind(&s, "op") == 11, "11 ops, got %zu", count_kind(&s, "op"));
  end_scenario(&s);
}

/* Back-to-back ops, idle gaps, an op held shorter than the interval: never a progress line. */
static void scenario_progress_normal(void) {
  begin("progress-normal", "progress-job");
  setenv("NCCLWATCH_PROGRESS_MS", "100", 1);
  struct comm a, b;
  comm_init5(&a, 0xd10d, "busy", 1, 2, 0);
  comm_init5(&b, 0xd10e, "busy2", 1, 2, 0);
  uint64_t seq = 0, seq_b = 0;
  int64_t end = now_ns() + 600000000LL;
  for (int round = 0; now_ns() < end; round++) {
    play_simple(&a, 20, &seq);
    struct op send = {"Send", "ncclInt8", 64, 1, 1, (uint64_t)round, true, false, 0, 500};
    play(b.ctx, &send);
    play_simple(&b, 5, &seq_b);
    if (round % 4 == 1) sleep_ms(150); /* idle: nothing in flight is not a hang */
    if (round % 4 == 3) {
      void* k = start_stuck(&a, seq++);
      play_simple(&b, 5, &seq_b);
      sleep_ms(40);
      kch_stop(k, gpu_now());
    }
  }
  P5->finalize(a.ctx);
  P5->finalize(b.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "progress") == 0, "no progress line while ops complete: %zu", count_kind(&s, "progress"));
  CHECK(count_kind(&s, "op") > 100 && dropped_total(&s) == 0, "ops recorded");
  end_scenario(&s);
}

/* Every way an op can leave its slot counts as done (dropped untimed, host-timed, sampled
 * out, reaped, pool_full never counted): a quiet communicator writes nothing, and a stuck
 * op later shows exactly the ops issued. */
static void scenario_progress_balance(void) {
  begin("progress-balance", "progress-job");
  setenv("NCCLWATCH_PROGRESS_MS", "100", 1);
  setenv("NCCLWATCH_POOL_OPS", "4", 1);
  setenv("NCCLWATCH_REQUIRE_GPU_TIMING", "1", 1);
  setenv("NCCLWATCH_OP_TIMEOUT_MS", "50", 1);
  setenv("NCCLWATCH_TIMING_SAMPLE", "1000000", 1);
  setenv("NCCLWATCH_TIMING_KEY_MS", "0", 1);
  struct comm c;
  comm_init5(&c, 0xba1a, "balance", 1, 2, 0);
  int64_t issued = 0, colls = 0;
  uint64_t seq = 0;
  play_simple(&c, 3, &seq); /* GPU-timed, recorded */
  issued += 3, colls += 3;
  struct op host = {"ReduceScatter", "ncclFloat32", 100, -1, 0, 0, false, false, 0, 0};
  play(c.ctx, &host); /* host-timed: dropped as untimed */
  issued++, colls++;
  void* hs[6]; /* 4 slots: 2 starts get none and are never issued (pool_full) */
  uint64_t t = gpu_now() - 1000;
  for (int i = 0; i < 6; i++) {
    hs[i] = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 10, -1, 1, seq++);
    issued += hs[i] != NULL, colls += hs[i] != NULL;
  }
  for (int i = 0; i < 6; i++) {
    stop(hs[i]);
    kch_stop(kch_start(c.ctx, hs[i], 0, t), t + 100);
  }
  /* Reaped after NCCLWATCH_OP_TIMEOUT_MS, host-timed, dropped as untimed. */
  void* h = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 64, -1, 2, seq++);
  void* k0 = kch_start(c.ctx, h, 0, gpu_now());
  stop(h);
  issued++, colls++;
  sleep_ms(600);
  kch_stop(k0, gpu_now()); /* late: ignored */
  void* self = ev_p2p(c.ctx, NULL, "Send", "ncclInt8", 64, 0, 2); /* to self */
  stop(self);
  issued++;
  for (int i = 0; i < 5; i++) { /* the first group GPU-timed, the others sampled out */
    struct sgroup g = {.seq = seq++, .key = "AllReduce", .count = 64};
    play_group(&c, &g);
    for (int j = 0; j < 3; j++) issued += g.h[j] != NULL, colls += j == 0 && g.h[j];
  }
  int64_t t_quiet = now_ns();
  sleep_ms(350);
  int64_t t_stuck = now_ns();
  /* Stuck before even its "enqueued" stop, which the reaper's 50 ms count from. No API
   * event: the sampler left KernelCh off, and a sampled-out op completes at that stop. */
  h = ev_coll(c.ctx, NULL, "AllReduce", "ncclFloat32", 1024, -1, 1, seq++);
  REQUIRE(h, "the stuck op has a slot");
  issued++, colls++;
  sleep_ms(350);
  stop(h);
  t = gpu_now() - 1000;
  kch_stop(kch_start(c.ctx, h, 0, t), t + 100);
  P5->finalize(c.ctx);

  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* p[64];
  size_t n = progress_of(&s, NULL, p, 64), quiet = 0, stuck = 0;
  for (size_t i = 0; i < n; i++) {
    int64_t ts = mj_int(p[i], "ts_ns");
    quiet += ts >= t_quiet && ts < t_stuck;
    if (ts < t_stuck) continue;
    stuck++;
    CHECK(mj_int(p[i], "in_flight") == 1 && mj_int(p[i], "issued") == issued && mj_int(p[i], "colls") == colls,
          "issued %lld (want %lld), colls %lld (want %lld), in_flight %lld", (long long)mj_int(p[i], "issued"),
          (long long)issued, (long long)mj_int(p[i], "colls"), (long long)colls,
          (long long)mj_int(p[i], "in_flight"));
  }
  CHECK(quiet == 0, "nothing in flight after every kind of completion: %zu progress lines", quiet);
  CHECK(stuck >= 1, "the stuck op is reported");
  CHECK(dropped(&s, "pool_full") == 2 && dropped(&s, "untimed") >= 3, "pool_full %lld, untimed %lld",
        (long long)dropped(&s, "pool_full"), (long long)dropped(&s, "untimed"));
  end_scenario(&s);
}

/* NCCLWATCH_PROGRESS_MS=0: a stuck op past the default interval writes nothing. */
static void scenario_progress_off(void) {
  begin("progress-off", "progress-job");
  setenv("NCCLWATCH_PROGRESS_MS", "0", 1);
  struct comm c;
  comm_init5(&c, 0xd20d, "off", 1, 2, 0);
  uint64_t seq = 0;
  play_simple(&c, 2, &seq);
  void* k = start_stuck(&c, seq++);
  sleep_ms(1400);
  kch_stop(k, gpu_now());
  P5->finalize(c.ctx);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  CHECK(count_kind(&s, "progress") == 0 && count_kind(&s, "op") == 3, "off: no progress line");
  CHECK(log_warnings == 0, "0 is a valid value");
  end_scenario(&s);
}

/* A bad value is reported like every knob's and the default (1000 ms) is used. */
static void scenario_progress_config(void) {
  begin("progress-config", "progress-job");
  setenv("NCCLWATCH_PROGRESS_MS", "abc", 1);
  struct comm c;
  comm_init5(&c, 0xd30d, "cfg", 1, 2, 0);
  pthread_mutex_lock(&log_mu);
  CHECK(log_warnings == 1 && strstr(log_text, "ignoring NCCLWATCH_PROGRESS_MS=\"abc\"") &&
            strstr(log_text, "using 1000"),
        "the bad value reported through NCCL's logger:\n%s", log_text);
  pthread_mutex_unlock(&log_mu);
  uint64_t seq = 0;
  void* k = start_stuck(&c, seq++);
  sleep_ms(1800); /* a line after 1.0-1.2 s, the next one not before 2.0 s */
  kch_stop(k, gpu_now());
  P5->finalize(c.ctx);
  /* Out of range, below: the same. */
  log_reset();
  setenv("NCCLWATCH_PROGRESS_MS", "50", 1);
  comm_init5(&c, 0xd30e, "cfg2", 1, 2, 0);
  P5->finalize(c.ctx);
  pthread_mutex_lock(&log_mu);
  CHECK(log_warnings == 1 && strstr(log_text, "ignoring NCCLWATCH_PROGRESS_MS=\"50\": expected an integer in "
                                              "[100, 600000]; using 1000"),
        "out of range reported:\n%s", log_text);
  pthread_mutex_unlock(&log_mu);
  struct spool s;
  spool_read(&s, spool_root);
  check_spool_common(&s);
  const struct mj* p[16];
  size_t n = progress_of(&s, NULL, p, 16);
  CHECK(n == 1, "one progress line in 1.8 s at the default interval, got %zu", n);
  for (size_t i = 0; i < n; i++)
    CHECK(mj_int(p[i], "ts_ns") - mj_int(p[i], "waiting_since_ns") >= 1000000000LL, "after 1000 ms");
  end_scenario(&s);
}

int main(int argc, char** argv) {
  self_path = argv[0];
  gethostname(g_host, sizeof g_host - 1);
  if (argc == 3 && !strcmp(argv[1], "--exit-child")) {
    lib_path = argv[2];
  } else if (argc != 4) {
    fprintf(stderr, "usage: %s <plugin.so> <outdir> <stress_events>\n", argv[0]);
    return 2;
  } else {
    lib_path = argv[1];
    outdir = argv[2];
  }
  void* lib = dlopen(lib_path, RTLD_NOW | RTLD_LOCAL);
  REQUIRE(lib, "dlopen %s: %s", lib_path, dlerror());
  P5 = dlsym(lib, "ncclProfiler_v5");
  P4 = dlsym(lib, "ncclProfiler_v4");
  P6 = dlsym(lib, "ncclProfiler_v6");
  REQUIRE(P5 && P4 && P6 && !strcmp(P5->name, "ncclwatch"), "ncclProfiler_v4/_v5/_v6 exported");
  REQUIRE(!dlsym(lib, "nw_op_alloc") && !dlsym(lib, "nw_g"), "internals are hidden");
  if (argc == 3) return exit_child();

  long stress_events = strtol(argv[3], NULL, 10);
  if (getenv("NW_TEST_THREAD_OPS")) THR_OPS = strtoull(getenv("NW_TEST_THREAD_OPS"), NULL, 10);
  mkdir(outdir, 0755);
  /* NW_TEST_ONLY=name runs one scenario (debugging). */
  only = getenv("NW_TEST_ONLY");
#define RUN(name, call) \
  if (selected(name)) call
  RUN("basic", scenario_basic());
  RUN("threads", scenario_threads());
  RUN("pool_full", scenario_pool_full());
  RUN("disk", scenario_disk());
  RUN("foreign_dir", scenario_foreign_dir());
  RUN("reaper", scenario_reaper());
  RUN("v4", scenario_v4_v6());
  RUN("config", scenario_config());
  RUN("inspector", scenario_inspector());
  RUN("sampling", scenario_sampling());
  RUN("sampling-threads", scenario_sampling_threads());
  RUN("untimed", scenario_untimed());
  RUN("restart", scenario_restart());
  RUN("exit", scenario_exit());
  RUN("progress-hang", scenario_progress_hang());
  RUN("progress-normal", scenario_progress_normal());
  RUN("progress-balance", scenario_progress_balance());
  RUN("progress-off", scenario_progress_off());
  RUN("progress-config", scenario_progress_config());
  RUN("stress", scenario_stress(stress_events));
  dlclose(lib);
  if (failures) {
    fprintf(stderr, "driver: %d failure(s)\n", failures);
    return 1;
  }
  fprintf(stderr, "driver: all scenarios passed\n");
  return 0;
}
