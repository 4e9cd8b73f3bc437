/* NCCL Inspector-compatible outputs, written by the writer thread (optional, by env):
 *
 * - NCCLWATCH_INSPECTOR_JSON_DIR: Inspector's JSON mode, one object per op per line in
 *   <dir>/<host>-pid<pid>.log with Inspector's header/metadata/coll_perf|p2p_perf fields.
 * - NCCLWATCH_INSPECTOR_PROM_DIR: Inspector's Prometheus textfile
 *   <dir>/nccl_inspector_metrics_<uuid>.prom per GPU, same metric names and labels, plus
 *   per-bucket _count, _p50, _p95, _max exec time and the minimum bus bandwidth, rewritten
 *   atomically (tmp file + rename) every NCCLWATCH_INSPECTOR_PROM_INTERVAL_MS.
 */
#ifndef NW_INSPECTOR_H
#define NW_INSPECTOR_H

#include <stdbool.h>
#include <stdint.h>

#include "record.h"

void nw_insp_start(void);
void nw_insp_op(const struct nw_op_rec* rec, uint64_t bytes, double algbw_gbs, double busbw_gbs);
/* Flush JSON lines; write the .prom files when the interval passed (or when final). */
void nw_insp_tick(bool final);
void nw_insp_stop(void);

#endif
