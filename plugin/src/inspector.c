/* NCCL Inspector-compatible JSON and Prometheus outputs (see inspector.h).
 *
 * Everything here runs on the writer thread only, so it allocates freely and takes no
 * locks. Differences from Inspector, on purpose:
 * - every op is written (Inspector 2.30 keeps a per-communicator ring that overwrites,
 *   skips < 8 KiB messages by default, and loses what is queued at destroy);
 * - exec time is first channel start to last channel stop on the GPU timer (Inspector takes
 *   the longest single channel) and bandwidths use nanoseconds, not whole microseconds;
 * - the .prom mean/geometric-mean series are joined by _count, _p50, _p95, _max and
 *   bus-bandwidth _min series, so one slow op in a bucket stays visible;
 * - host-timed ops (no GPU timestamps) go to the JSON file with timing source
 *   "collective_cpu" but are left out of the .prom aggregates (their exec time is 0).
 */
#include "inspector.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "json.h"
#include "nw.h"
#include "rules.h"

#define NW_INSP_JSON_BUF (256u * 1024)
#define NW_PROM_BUCKETS 256
#define NW_PROM_MAX_SAMPLES (1u << 16)

struct nw_pe { /* one Prometheus bucket (one label set) of the current interval */
  struct nw_pe* next;
  uint64_t hash;
  const struct nw_comm* comm; /* labels come from it, plus: */
  bool p2p;
  char op[24];
  char size[32];
  char algo_proto[40];
  uint64_t count;
  double exec_sum_us;
  double bus_log_sum;
  uint64_t bus_n;
  double bus_min;
  double* exec_us; /* samples for quantiles; a reservoir past NW_PROM_MAX_SAMPLES */
  uint32_t n_exec, cap_exec;
};

static struct {
  bool json_on, prom_on;
  int json_fd;
  bool json_warned, prom_warned;
  char json_path[1400];
  struct nw_buf json;
  struct nw_buf line;
  struct nw_pe* buckets[NW_PROM_BUCKETS];
  size_t n_entries;
  int64_t last_dump_ns;
  uint64_t rng;
} nw_i;

static int64_t nw_i_mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void nw_i_mkdir_p(const char* path) {
  char tmp[1400];
  snprintf(tmp, sizeof tmp, "%s", path);
  for (char* p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    mkdir(tmp, 0755);
    *p = '/';
  }
  mkdir(tmp, 0755);
}

void nw_insp_start(void) {
  memset(&nw_i, 0, sizeof nw_i);
  nw_i.json_fd = -1;
  nw_i.rng = 0x9e3779b97f4a7c15ULL;
  nw_i.last_dump_ns = nw_i_mono_ns();
  nw_i.line.data = malloc(32 * 1024);
  if (nw_i.line.data) nw_buf_init(&nw_i.line, nw_i.line.data, 32 * 1024);
  if (nw_g.cfg.inspector_json_dir[0] && nw_i.line.data) {
    char* buf = malloc(NW_INSP_JSON_BUF);
    if (buf) {
      nw_buf_init(&nw_i.json, buf, NW_INSP_JSON_BUF);
      nw_i_mkdir_p(nw_g.cfg.inspector_json_dir);
      /* Inspector names the file after the raw host name; a '/' cannot be in a path
       * component, so such a name falls back to the escaped one. */
      const char* host = strchr(nw_g.host, '/') ? nw_g.host_safe : nw_g.host;
      snprintf(nw_i.json_path, sizeof nw_i.json_path, "%s/%s-pid%ld.log",
               nw_g.cfg.inspector_json_dir, host, nw_g.pid);
      nw_i.json_fd = open(nw_i.json_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (nw_i.json_fd >= 0) nw_i.json_on = true;
      else if (nw_g.logfn)
        nw_g.logfn(NW_LOG_WARN, NW_LOG_PROFILE, __FILE__, __LINE__,
                   "ncclwatch: cannot open Inspector JSON file %s: %s", nw_i.json_path,
                   strerror(errno));
      if (!nw_i.json_on) free(buf);
    }
  }
  nw_i.prom_on = nw_g.cfg.inspector_prom_dir[0] != '\0' && nw_i.line.data;
  if (nw_i.prom_on) nw_i_mkdir_p(nw_g.cfg.inspector_prom_dir);
}

static void nw_i_json_flush(void) {
  if (!nw_i.json_on || nw_i.json.len == 0) return;
  size_t off = 0;
  while (off < nw_i.json.len) {
    ssize_t k = write(nw_i.json_fd, nw_i.json.data + off, nw_i.json.len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      if (!nw_i.json_warned && nw_g.logfn)
        nw_g.logfn(NW_LOG_WARN, NW_LOG_PROFILE, __FILE__, __LINE__,
                   "ncclwatch: writing Inspector JSON file %s failed", nw_i.json_path);
      nw_i.json_warned = true;
      break;
    }
    off += (size_t)k;
  }
  nw_buf_reset(&nw_i.json);
}

static void nw_i_json_op(const struct nw_op_rec* r, uint64_t bytes, double algbw, double busbw) {
  const struct nw_comm* c = r->comm;
  const char* p = r->p2p ? "p2p" : "coll";
  struct nw_buf* b = &nw_i.line;
  nw_buf_reset(b);
  nw_buf_printf(b, "{\"header\":{\"id\":\"0x%llx\",\"comm_name\":", (unsigned long long)c->hash);
  nw_json_str(b, c->name[0] ? c->name : "unknown");
  nw_buf_printf(b, ",\"rank\":%d,\"n_ranks\":%d,\"nnodes\":%d},", c->rank, c->nranks, c->nnodes);
  nw_buf_puts(b, "\"metadata\":{\"inspector_output_format_version\":\"v4.0\",\"git_rev\":\"ncclwatch\","
                 "\"rec_mechanism\":\"nccl_profiler_interface\",\"dump_timestamp_us\":");
  nw_buf_i64(b, nw_now_ns() / 1000);
  nw_buf_puts(b, ",\"hostname\":");
  nw_json_str(b, nw_g.host);
  nw_buf_printf(b, ",\"pid\":%ld},", nw_g.pid);
  nw_buf_printf(b, "\"%s_perf\":{\"%s\":", p, p);
  nw_json_str(b, r->op);
  nw_buf_printf(b, ",\"%s_sn\":%llu,", p, (unsigned long long)r->seq);
  if (r->p2p) nw_buf_printf(b, "\"p2p_peer\":%d,", r->peer);
  nw_buf_printf(b, "\"%s_msg_size_bytes\":%llu,\"%s_exec_time_us\":%lld,\"%s_timing_source\":\"%s\",",
                p, (unsigned long long)bytes, p, (long long)(r->exec_ns / 1000), p,
                r->timing == NW_TIMING_KERNEL_GPU ? "kernel_gpu" : "collective_cpu");
  nw_buf_printf(b, "\"%s_algobw_gbs\":", p);
  nw_json_double(b, algbw);
  nw_buf_printf(b, ",\"%s_busbw_gbs\":", p);
  nw_json_double(b, busbw);
  nw_buf_puts(b, "}}\n");
  if (b->overflow) return;
  if (nw_i.json.len + b->len > nw_i.json.cap) nw_i_json_flush();
  nw_buf_put(&nw_i.json, b->data, b->len);
}

static void nw_i_prom_op(const struct nw_op_rec* r, uint64_t bytes, double busbw) {
  if (r->timing != NW_TIMING_KERNEL_GPU) return;
  char size[32], algo_proto[40];
  nw_inspector_size_label(bytes, size, sizeof size);
  snprintf(algo_proto, sizeof algo_proto, "%s_%s", r->algo[0] ? r->algo : "unknown",
           r->proto[0] ? r->proto : "unknown");
  /* Inspector's bucket key: communicator (name, nranks, nnodes, device), op, size range,
   * algo_proto (collectives only). One nw_comm is one such communicator on one device. */
  uint64_t h = nw_fnv1a64_update(NW_FNV_OFFSET, &r->comm, sizeof r->comm);
  h = nw_fnv1a64_str(h, r->op);
  h = nw_fnv1a64_str(h, size);
  if (!r->p2p) h = nw_fnv1a64_str(h, algo_proto);
  struct nw_pe** head = &nw_i.buckets[h % NW_PROM_BUCKETS];
  struct nw_pe* e = *head;
  for (; e; e = e->next)
    if (e->hash == h && e->comm == r->comm && e->p2p == r->p2p && !strcmp(e->op, r->op) &&
        !strcmp(e->size, size) && (r->p2p || !strcmp(e->algo_proto, algo_proto)))
      break;
  if (!e) {
    e = calloc(1, sizeof *e);
    if (!e) return;
    e->hash = h;
    e->comm = r->comm;
    e->p2p = r->p2p;
    snprintf(e->op, sizeof e->op, "%s", r->op);
    snprintf(e->size, sizeof e->size, "%s", size);
    snprintf(e->algo_proto, sizeof e->algo_proto, "%s", algo_proto);
    e->bus_min = INFINITY;
    e->next = *head;
    *head = e;
    nw_i.n_entries++;
  }
  double exec_us = (double)r->exec_ns / 1000.0;
  e->count++;
  e->exec_sum_us += exec_us;
  if (busbw > 0) {
    e->bus_log_sum += log(busbw);
    e->bus_n++;
    if (busbw < e->bus_min) e->bus_min = busbw;
  }
  if (e->n_exec < NW_PROM_MAX_SAMPLES) {
    if (e->n_exec == e->cap_exec) {
      uint32_t cap = e->cap_exec ? e->cap_exec * 2 : 64;
      double* p = realloc(e->exec_us, cap * sizeof *p);
      if (!p) return;
      e->exec_us = p;
      e->cap_exec = cap;
    }
    e->exec_us[e->n_exec++] = exec_us;
  } else {
    /* Reservoir sampling keeps a uniform sample of the interval's exec times. */
    nw_i.rng ^= nw_i.rng << 13;
    nw_i.rng ^= nw_i.rng >> 7;
    nw_i.rng ^= nw_i.rng << 17;
    uint64_t j = nw_i.rng % e->count;
    if (j < NW_PROM_MAX_SAMPLES) e->exec_us[j] = exec_us;
  }
}

void nw_insp_op(const struct nw_op_rec* rec, uint64_t bytes, double algbw_gbs, double busbw_gbs) {
  if (nw_i.json_on) nw_i_json_op(rec, bytes, algbw_gbs, busbw_gbs);
  if (nw_i.prom_on) nw_i_prom_op(rec, bytes, busbw_gbs);
}

static int nw_i_cmp_double(const void* a, const void* b) {
  double x = *(const double*)a, y = *(const double*)b;
  return (x > y) - (x < y);
}

/* Nearest-rank quantile of sorted samples, as the window records use. */
static double nw_i_quantile(const double* v, uint32_t n, double q) {
  if (n == 0) return 0.0;
  uint32_t k = (uint32_t)ceil(q * n);
  if (k < 1) k = 1;
  return v[k - 1];
}

static void nw_i_labels(struct nw_buf* b, const struct nw_pe* e) {
  const struct nw_comm* c = e->comm;
  nw_buf_printf(b, "{version=\"v%d.1\",slurm_job_id=\"", nw_g.iface_version);
  nw_prom_label(b, nw_g.job);
  nw_buf_puts(b, "\",node=\"");
  nw_prom_label(b, nw_g.host);
  if (c->gpu_ordinal >= 0) nw_buf_printf(b, "\",gpu=\"GPU%d\",comm_name=\"", c->gpu_ordinal);
  else nw_buf_puts(b, "\",gpu=\"unknown\",comm_name=\"");
  nw_prom_label(b, c->name[0] ? c->name : "unknown");
  nw_buf_printf(b, "\",n_nodes=\"%d\",nranks=\"%d\",%s=\"", c->nnodes, c->nranks,
                e->p2p ? "p2p_operation" : "collective");
  nw_prom_label(b, e->op);
  nw_buf_puts(b, "\",message_size=\"");
  nw_prom_label(b, e->size);
  if (!e->p2p) {
    nw_buf_puts(b, "\",algo_proto=\"");
    nw_prom_label(b, e->algo_proto);
  }
  nw_buf_puts(b, "\"}");
}

enum { NW_M_BUS, NW_M_EXEC, NW_M_COUNT, NW_M_P50, NW_M_P95, NW_M_MAX, NW_M_BUS_MIN, NW_M_N };

static const char* nw_i_metric_name(int m, bool p2p) {
  static const char* const coll[NW_M_N] = {
      "nccl_bus_bandwidth_gbs",
      "nccl_collective_exec_time_microseconds",
      "nccl_collective_exec_time_microseconds_count",
      "nccl_collective_exec_time_microseconds_p50",
      "nccl_collective_exec_time_microseconds_p95",
      "nccl_collective_exec_time_microseconds_max",
      "nccl_bus_bandwidth_gbs_min",
  };
  static const char* const p2pn[NW_M_N] = {
      "nccl_p2p_bus_bandwidth_gbs",
      "nccl_p2p_exec_time_microseconds",
      "nccl_p2p_exec_time_microseconds_count",
      "nccl_p2p_exec_time_microseconds_p50",
      "nccl_p2p_exec_time_microseconds_p95",
      "nccl_p2p_exec_time_microseconds_max",
      "nccl_p2p_bus_bandwidth_gbs_min",
  };
  return p2p ? p2pn[m] : coll[m];
}

static double nw_i_value(const struct nw_pe* e, int m) {
  switch (m) {
    case NW_M_BUS: return e->bus_n ? exp(e->bus_log_sum / (double)e->bus_n) : 0.0;
    case NW_M_EXEC: return e->count ? e->exec_sum_us / (double)e->count : 0.0;
    case NW_M_COUNT: return (double)e->count;
    case NW_M_P50: return nw_i_quantile(e->exec_us, e->n_exec, 0.5);
    case NW_M_P95: return nw_i_quantile(e->exec_us, e->n_exec, 0.95);
    case NW_M_MAX: return e->n_exec ? e->exec_us[e->n_exec - 1] : 0.0;
    default: return e->bus_n ? e->bus_min : 0.0;
  }
}

/* Write one device's file: grouped by metric family (one TYPE line each), atomically. */
static void nw_i_prom_write_device(const char* bare, struct nw_pe** list, size_t n) {
  size_t cap = 4096 + n * NW_M_N * 1024;
  char* text = malloc(cap);
  if (!text) return;
  struct nw_buf b;
  nw_buf_init(&b, text, cap);
  for (int p2p = 0; p2p < 2; p2p++) {
    for (int m = 0; m < NW_M_N; m++) {
      bool typed = false;
      for (size_t i = 0; i < n; i++) {
        if (list[i]->p2p != (bool)p2p) continue;
        const char* name = nw_i_metric_name(m, p2p);
        if (!typed) {
          nw_buf_printf(&b, "# TYPE %s gauge\n", name);
          typed = true;
        }
        nw_buf_puts(&b, name);
        nw_i_labels(&b, list[i]);
        if (m == NW_M_COUNT) nw_buf_printf(&b, " %llu\n", (unsigned long long)list[i]->count);
        else nw_buf_printf(&b, " %.6g\n", nw_i_value(list[i], m));
      }
    }
  }
  char path[1400], tmp[1400];
  snprintf(path, sizeof path, "%s/nccl_inspector_metrics_%s.prom", nw_g.cfg.inspector_prom_dir, bare);
  snprintf(tmp, sizeof tmp, "%s/.nccl_inspector_metrics_%s.prom.%ld.tmp",
           nw_g.cfg.inspector_prom_dir, bare, nw_g.pid);
  bool ok = !b.overflow;
  int fd = ok ? open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644) : -1;
  size_t off = 0;
  while (fd >= 0 && off < b.len) {
    ssize_t k = write(fd, b.data + off, b.len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) break;
    off += (size_t)k;
  }
  ok = fd >= 0 && off == b.len;
  if (fd >= 0 && close(fd) != 0) ok = false;
  /* rename() is atomic: the node exporter sees the old file or the new one, never half. */
  if (ok && rename(tmp, path) != 0) ok = false;
  if (!ok) {
    if (fd >= 0) unlink(tmp);
    if (!nw_i.prom_warned && nw_g.logfn)
      nw_g.logfn(NW_LOG_WARN, NW_LOG_PROFILE, __FILE__, __LINE__,
                 "ncclwatch: cannot write Prometheus file %s", path);
    nw_i.prom_warned = true;
  }
  free(text);
}

/* Every aggregated (communicator, op, size) entry freed: after a dump, and at stop. */
static void nw_i_free_buckets(void) {
  for (int i = 0; i < NW_PROM_BUCKETS; i++) {
    struct nw_pe* e = nw_i.buckets[i];
    while (e) {
      struct nw_pe* next = e->next;
      free(e->exec_us);
      free(e);
      e = next;
    }
    nw_i.buckets[i] = NULL;
  }
  nw_i.n_entries = 0;
}

static void nw_i_prom_dump(void) {
  if (nw_i.n_entries == 0) return;
  struct nw_pe** all = malloc(nw_i.n_entries * sizeof *all);
  struct nw_pe** dev = malloc(nw_i.n_entries * sizeof *dev);
  size_t n = 0;
  if (all && dev) {
    for (int i = 0; i < NW_PROM_BUCKETS; i++)
      for (struct nw_pe* e = nw_i.buckets[i]; e; e = e->next) {
        qsort(e->exec_us, e->n_exec, sizeof *e->exec_us, nw_i_cmp_double);
        all[n++] = e;
      }
    /* One file per GPU (communicators of one process can sit on several GPUs). */
    for (size_t i = 0; i < n; i++) {
      if (!all[i]) continue;
      const char* bare = all[i]->comm->gpu_bare;
      size_t k = 0;
      for (size_t j = i; j < n; j++)
        if (all[j] && !strcmp(all[j]->comm->gpu_bare, bare)) {
          dev[k++] = all[j];
          if (j != i) all[j] = NULL;
        }
      nw_i_prom_write_device(bare, dev, k);
    }
  }
  free(all);
  free(dev);
  nw_i_free_buckets();
}

void nw_insp_tick(bool final) {
  nw_i_json_flush();
  if (!nw_i.prom_on) return;
  int64_t now = nw_i_mono_ns();
  if (final || now - nw_i.last_dump_ns >= (int64_t)nw_g.cfg.inspector_prom_interval_ms * 1000000LL) {
    nw_i.last_dump_ns = now;
    nw_i_prom_dump();
  }
}

void nw_insp_stop(void) {
  nw_i_json_flush();
  if (nw_i.json_fd >= 0) close(nw_i.json_fd);
  nw_i.json_fd = -1;
  nw_i.json_on = false;
  if (nw_i.json.data) free(nw_i.json.data);
  nw_i.json.data = NULL;
  nw_i_free_buckets();
  free(nw_i.line.data);
  nw_i.line.data = NULL;
  nw_i.prom_on = false;
}
