/* The shared rules of ncclwatch/rules.py, mirrored in C.
 *
 * tests/plugin/test_rules.c checks every function here against tests/vectors/rules.json,
 * the same vectors tests/test_rules.py runs against the Python side.
 */
#ifndef NW_RULES_H
#define NW_RULES_H

#include <stddef.h>
#include <stdint.h>

#define NW_FNV_OFFSET 0xcbf29ce484222325ULL

uint64_t nw_fnv1a64_update(uint64_t h, const void* data, size_t len);
/* FNV-1a over a NUL-terminated string, from state h. */
uint64_t nw_fnv1a64_str(uint64_t h, const char* s);

/* rules.record_id: FNV-1a 64 of job␟host␟pid␟comm␟rank␟op␟peer␟seq, as 16 hex digits. */
void nw_record_id(const char* job, const char* host, long pid, const char* comm, int rank,
                  const char* op, int peer, uint64_t seq, char out[17]);
/* The same in two steps: the per-communicator prefix hash, then the per-op suffix. */
uint64_t nw_record_id_prefix(const char* job, const char* host, long pid, const char* comm,
                             int rank);
void nw_record_id_finish(uint64_t prefix, const char* op, int peer, uint64_t seq, char out[17]);

/* rules.transport_class; NULL when nranks or nnodes < 1. */
const char* nw_transport_class(int nranks, int nnodes);
int nw_local_ranks(int nranks, int nnodes);

/* Bytes per element of an NCCL datatype name; 0 when unknown. */
int nw_dtype_bytes(const char* dtype);

uint64_t nw_traffic_bytes(const char* op, uint64_t msg_bytes, int nranks);
double nw_bus_factor(const char* op, int nranks);
/* rules.bandwidths_gbs: both 0 when exec_ns <= 0. */
void nw_bandwidths_gbs(const char* op, uint64_t msg_bytes, int nranks, int64_t exec_ns,
                       double* algbw_gbs, double* busbw_gbs);

/* rules.size_bucket ("1MiB") and rules.inspector_size_label ("1-2MB"). */
void nw_size_bucket(uint64_t nbytes, char* out, size_t out_len);
void nw_inspector_size_label(uint64_t nbytes, char* out, size_t out_len);

/* rules.safe_filename with max_len 128: out needs 129 bytes. */
#define NW_SAFE_NAME_MAX 128
void nw_safe_filename(const char* name, char out[NW_SAFE_NAME_MAX + 1]);

#endif
