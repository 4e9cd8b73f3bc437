/* Everything the plugin reads from the environment, read once (at the first init, or the
 * first init after every communicator was finalized) into one struct. */
#ifndef NW_CONFIG_H
#define NW_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "nw_profiler_abi.h"

struct nw_config {
  char spool_dir[1024];         /* NCCLWATCH_SPOOL_DIR */
  uint64_t segment_bytes;       /* NCCLWATCH_SEGMENT_BYTES */
  uint64_t spool_max_bytes;     /* NCCLWATCH_SPOOL_MAX_BYTES */
  uint32_t pool_ops;            /* NCCLWATCH_POOL_OPS: open ops per communicator */
  uint32_t ring_records;        /* NCCLWATCH_RING_RECORDS: per thread, power of two */
  uint32_t max_threads;         /* NCCLWATCH_MAX_THREADS: threads that may report events */
  uint32_t flush_ms;            /* NCCLWATCH_FLUSH_MS: writer wake-up period */
  uint32_t op_timeout_ms;       /* NCCLWATCH_OP_TIMEOUT_MS: give up waiting for KernelCh */
  uint32_t timing_sample;       /* NCCLWATCH_TIMING_SAMPLE: GPU-time 1 group in N at random */
  uint32_t timing_key_ms;       /* NCCLWATCH_TIMING_KEY_MS: and each recurring key this often */
  bool require_gpu_timing;      /* NCCLWATCH_REQUIRE_GPU_TIMING */
  bool proxy_events;            /* NCCLWATCH_PROXY_EVENTS */
  char inspector_json_dir[1024]; /* NCCLWATCH_INSPECTOR_JSON_DIR ("" = off) */
  char inspector_prom_dir[1024]; /* NCCLWATCH_INSPECTOR_PROM_DIR ("" = off) */
  uint32_t inspector_prom_interval_ms; /* NCCLWATCH_INSPECTOR_PROM_INTERVAL_MS */
  bool debug;                   /* NCCLWATCH_DEBUG: log each host-timed op's channel counts */
  uint32_t progress_ms;         /* NCCLWATCH_PROGRESS_MS: progress records after this wait; 0 off */
  uint32_t test_writer_delay_us; /* NCCLWATCH_TEST_WRITER_DELAY_US (test knob) */
};

/* Fill cfg from the environment; each bad value is reported through logfn (may be NULL)
 * and replaced by its default. */
void nw_config_load(struct nw_config* cfg, nw_nccl_logger logfn);

#ifndef NW_TIMING_SAMPLE_DEFAULT
#define NW_TIMING_SAMPLE_DEFAULT 1
#endif

#define NW_JOB_FALLBACK "unknown"

/* The job id, written into out (cut to len - 1 bytes): NCCLWATCH_JOB_ID, SLURM_JOB_ID, a
 * Kubernetes workload name (PYTORCHJOB_NAME, JOBSET_NAME, VC_JOB_NAME, K8S_JOB_NAME; as
 * "<POD_NAMESPACE>/<name>" when POD_NAMESPACE is set), TORCHELASTIC_RUN_ID unless "none",
 * else NW_JOB_FALLBACK. Returns the variable it came from, or NULL for the fallback. */
const char* nw_config_job_id(char* out, size_t len);

#endif
