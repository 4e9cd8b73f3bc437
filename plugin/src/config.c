#include "config.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NW_LOG(logfn, ...)                                                            \
  do {                                                                                \
    if (logfn) (logfn)(NW_LOG_WARN, NW_LOG_INIT | NW_LOG_ENV, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/* An unsigned integer in [lo, hi]; anything else (empty, junk, sign, overflow) is
 * reported and the default kept. Suffixes are not accepted: bytes are plain numbers. */
static uint64_t nw_env_u64(const char* name, uint64_t def, uint64_t lo, uint64_t hi,
                           nw_nccl_logger logfn) {
  const char* s = getenv(name);
  if (!s) return def;
  char* end = NULL;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (s[0] < '0' || s[0] > '9' || errno != 0 || *end != '\0' || v < lo || v > hi) {
    NW_LOG(logfn, "ncclwatch: ignoring %s=\"%s\": expected an integer in [%llu, %llu]; using %llu",
           name, s, (unsigned long long)lo, (unsigned long long)hi, (unsigned long long)def);
    return def;
  }
  return v;
}

static bool nw_env_bool(const char* name, bool def, nw_nccl_logger logfn) {
  const char* s = getenv(name);
  if (!s) return def;
  if (strcmp(s, "1") == 0) return true;
  if (strcmp(s, "0") == 0) return false;
  NW_LOG(logfn, "ncclwatch: ignoring %s=\"%s\": expected 0 or 1; using %d", name, s, (int)def);
  return def;
}

static void nw_env_path(const char* name, const char* def, char* out, size_t out_len,
                        nw_nccl_logger logfn) {
  const char* s = getenv(name);
  if (s && strlen(s) >= out_len - 64) {
    NW_LOG(logfn, "ncclwatch: ignoring %s: longer than %zu bytes; using \"%s\"", name,
           out_len - 64, def);
    s = NULL;
  }
  if (!s) s = def;
  strncpy(out, s, out_len - 1);
  out[out_len - 1] = '\0';
}

void nw_config_load(struct nw_config* cfg, nw_nccl_logger logfn) {
  memset(cfg, 0, sizeof *cfg);
  nw_env_path("NCCLWATCH_SPOOL_DIR", "/tmp/ncclwatch-spool", cfg->spool_dir,
              sizeof cfg->spool_dir, logfn);
  if (!cfg->spool_dir[0]) {
    NW_LOG(logfn, "ncclwatch: ignoring empty NCCLWATCH_SPOOL_DIR; using /tmp/ncclwatch-spool");
    strcpy(cfg->spool_dir, "/tmp/ncclwatch-spool");
  }
  cfg->segment_bytes = nw_env_u64("NCCLWATCH_SEGMENT_BYTES", 64ULL << 20, 16384, 1ULL << 40, logfn);
  cfg->spool_max_bytes =
      nw_env_u64("NCCLWATCH_SPOOL_MAX_BYTES", 1ULL << 30, 16384, 1ULL << 50, logfn);
  if (cfg->spool_max_bytes < cfg->segment_bytes) {
    NW_LOG(logfn, "ncclwatch: NCCLWATCH_SPOOL_MAX_BYTES (%llu) < NCCLWATCH_SEGMENT_BYTES (%llu); "
           "segments are cut to the spool bound",
           (unsigned long long)cfg->spool_max_bytes, (unsigned long long)cfg->segment_bytes);
    cfg->segment_bytes = cfg->spool_max_bytes;
  }
  cfg->pool_ops = (uint32_t)nw_env_u64("NCCLWATCH_POOL_OPS", 1024, 1, 1 << 20, logfn);
  uint64_t ring = nw_env_u64("NCCLWATCH_RING_RECORDS", 8192, 2, 1 << 24, logfn);
  if (ring & (ring - 1)) {
    NW_LOG(logfn, "ncclwatch: ignoring NCCLWATCH_RING_RECORDS=%llu: not a power of two; using 8192",
           (unsigned long long)ring);
    ring = 8192;
  }
  cfg->ring_records = (uint32_t)ring;
  cfg->max_threads = (uint32_t)nw_env_u64("NCCLWATCH_MAX_THREADS", 64, 1, 4096, logfn);
  cfg->flush_ms = (uint32_t)nw_env_u64("NCCLWATCH_FLUSH_MS", 200, 1, 60000, logfn);
  cfg->op_timeout_ms =
      (uint32_t)nw_env_u64("NCCLWATCH_OP_TIMEOUT_MS", 30000, 1, 24ULL * 3600 * 1000, logfn);
  /* Where the default comes from: plugin/README.md, "Sampled GPU timing". */
  cfg->timing_sample = (uint32_t)nw_env_u64("NCCLWATCH_TIMING_SAMPLE", NW_TIMING_SAMPLE_DEFAULT, 1,
                                            1 << 20, logfn);
  cfg->timing_key_ms = (uint32_t)nw_env_u64("NCCLWATCH_TIMING_KEY_MS", 200, 0, 3600 * 1000, logfn);
  cfg->require_gpu_timing = nw_env_bool("NCCLWATCH_REQUIRE_GPU_TIMING", false, logfn);
  cfg->proxy_events = nw_env_bool("NCCLWATCH_PROXY_EVENTS", false, logfn);
  nw_env_path("NCCLWATCH_INSPECTOR_JSON_DIR", "", cfg->inspector_json_dir,
              sizeof cfg->inspector_json_dir, logfn);
  nw_env_path("NCCLWATCH_INSPECTOR_PROM_DIR", "", cfg->inspector_prom_dir,
              sizeof cfg->inspector_prom_dir, logfn);
  cfg->inspector_prom_interval_ms = (uint32_t)nw_env_u64(
      "NCCLWATCH_INSPECTOR_PROM_INTERVAL_MS", 30000, 10, 24ULL * 3600 * 1000, logfn);
  cfg->debug = nw_env_bool("NCCLWATCH_DEBUG", false, logfn);
  /* "0" turns progress records off; under 100 ms an ordinary slow op would look stuck. */
  const char* progress = getenv("NCCLWATCH_PROGRESS_MS");
  cfg->progress_ms = progress && !strcmp(progress, "0")
                         ? 0
                         : (uint32_t)nw_env_u64("NCCLWATCH_PROGRESS_MS", 1000, 100, 600000, logfn);
  cfg->test_writer_delay_us =
      (uint32_t)nw_env_u64("NCCLWATCH_TEST_WRITER_DELAY_US", 0, 0, 1000000, logfn);
}

/* First match wins; an empty value counts as unset (a downward-API variable whose label the
 * pod lacks is empty). The order is documented in docs/deploy.md, mirrored by
 * ncclwatch.ingest.throughput.job_identity, and both pass tests/vectors/job_id.json. */
static const char* const nw_job_explicit[] = {"NCCLWATCH_JOB_ID", "SLURM_JOB_ID"};
/* Kubernetes workload names, exposed from the pod's labels/annotations by the downward API:
 * Kubeflow Training Operator, JobSet (and Kubeflow Trainer v2), Volcano, a batch/v1 Job. */
static const char* const nw_job_k8s[] = {"PYTORCHJOB_NAME", "JOBSET_NAME", "VC_JOB_NAME",
                                         "K8S_JOB_NAME"};

static const char* nw_env_nonempty(const char* name) {
  const char* v = getenv(name);
  return v && v[0] ? v : NULL;
}

const char* nw_config_job_id(char* out, size_t len) {
  const char* v;
  for (size_t i = 0; i < sizeof nw_job_explicit / sizeof nw_job_explicit[0]; i++) {
    if ((v = nw_env_nonempty(nw_job_explicit[i]))) {
      snprintf(out, len, "%s", v);
      return nw_job_explicit[i];
    }
  }
  for (size_t i = 0; i < sizeof nw_job_k8s / sizeof nw_job_k8s[0]; i++) {
    if ((v = nw_env_nonempty(nw_job_k8s[i]))) {
      /* Names are unique only within a namespace. */
      const char* ns = nw_env_nonempty("POD_NAMESPACE");
      if (ns)
        snprintf(out, len, "%s/%s", ns, v);
      else
        snprintf(out, len, "%s", v);
      return nw_job_k8s[i];
    }
  }
  /* torchrun's --rdzv-id defaults to "none": every job started without one shares it. */
  if ((v = nw_env_nonempty("TORCHELASTIC_RUN_ID")) && strcmp(v, "none") != 0) {
    snprintf(out, len, "%s", v);
    return "TORCHELASTIC_RUN_ID";
  }
  snprintf(out, len, "%s", NW_JOB_FALLBACK);
  return NULL;
}
