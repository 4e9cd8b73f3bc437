#include "rules.h"

#include <stdio.h>
#include <string.h>

#define NW_FNV_PRIME 0x100000001b3ULL

uint64_t nw_fnv1a64_update(uint64_t h, const void* data, size_t len) {
  const unsigned char* p = data;
  for (size_t i = 0; i < len; i++) {
    h ^= p[i];
    h *= NW_FNV_PRIME;
  }
  return h;
}

uint64_t nw_fnv1a64_str(uint64_t h, const char* s) { return nw_fnv1a64_update(h, s, strlen(s)); }

static const char nw_unit_sep = 0x1f;

uint64_t nw_record_id_prefix(const char* job, const char* host, long pid, const char* comm,
                             int rank) {
  char num[32];
  uint64_t h = NW_FNV_OFFSET;
  h = nw_fnv1a64_str(h, job);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  h = nw_fnv1a64_str(h, host);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  snprintf(num, sizeof num, "%ld", pid);
  h = nw_fnv1a64_str(h, num);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  h = nw_fnv1a64_str(h, comm);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  snprintf(num, sizeof num, "%d", rank);
  h = nw_fnv1a64_str(h, num);
  return nw_fnv1a64_update(h, &nw_unit_sep, 1);
}

void nw_record_id_finish(uint64_t prefix, const char* op, int peer, uint64_t seq, char out[17]) {
  char num[32];
  uint64_t h = nw_fnv1a64_str(prefix, op);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  snprintf(num, sizeof num, "%d", peer);
  h = nw_fnv1a64_str(h, num);
  h = nw_fnv1a64_update(h, &nw_unit_sep, 1);
  snprintf(num, sizeof num, "%llu", (unsigned long long)seq);
  h = nw_fnv1a64_str(h, num);
  snprintf(out, 17, "%016llx", (unsigned long long)h);
}

void nw_record_id(const char* job, const char* host, long pid, const char* comm, int rank,
                  const char* op, int peer, uint64_t seq, char out[17]) {
  nw_record_id_finish(nw_record_id_prefix(job, host, pid, comm, rank), op, peer, seq, out);
}

const char* nw_transport_class(int nranks, int nnodes) {
  if (nranks < 1 || nnodes < 1) return NULL;
  if (nranks == 1) return "single";
  if (nnodes == 1) return "nvlink";
  if (nnodes >= nranks) return "net";
  return "mixed";
}

int nw_local_ranks(int nranks, int nnodes) {
  if (nnodes < 1) nnodes = 1;
  return (nranks + nnodes - 1) / nnodes;
}

static const struct {
  const char* name;
  int bytes;
} nw_dtypes[] = {
    {"ncclInt8", 1},    {"ncclChar", 1},       {"ncclUint8", 1},      {"ncclInt32", 4},
    {"ncclInt", 4},     {"ncclUint32", 4},     {"ncclInt64", 8},      {"ncclUint64", 8},
    {"ncclFloat16", 2}, {"ncclHalf", 2},       {"ncclFloat32", 4},    {"ncclFloat", 4},
    {"ncclFloat64", 8}, {"ncclDouble", 8},     {"ncclBfloat16", 2},   {"ncclFloat8e4m3", 1},
    {"ncclFloat8e5m2", 1},
};

int nw_dtype_bytes(const char* dtype) {
  for (size_t i = 0; i < sizeof nw_dtypes / sizeof nw_dtypes[0]; i++)
    if (strcmp(dtype, nw_dtypes[i].name) == 0) return nw_dtypes[i].bytes;
  return 0;
}

/* Described by the per-rank count (ncclwatch/rules.py GATHERS). */
static int nw_is_gather(const char* op) {
  return strcmp(op, "AllGather") == 0 || strcmp(op, "AllGatherV") == 0 ||
         strcmp(op, "ReduceScatter") == 0;
}

uint64_t nw_traffic_bytes(const char* op, uint64_t msg_bytes, int nranks) {
  if (nw_is_gather(op)) return msg_bytes * (uint64_t)nranks;
  return msg_bytes;
}

double nw_bus_factor(const char* op, int nranks) {
  int all = strcmp(op, "AllReduce") == 0;
  int gather = nw_is_gather(op) || strcmp(op, "AllToAll") == 0;
  if (nranks <= 1) return (all || gather) ? 0.0 : 1.0;
  /* Same evaluation order as Python's 2.0 * (n - 1) / n, so results are bit-identical. */
  if (all) return 2.0 * (nranks - 1) / nranks;
  if (gather) return (double)(nranks - 1) / nranks;
  return 1.0;
}

void nw_bandwidths_gbs(const char* op, uint64_t msg_bytes, int nranks, int64_t exec_ns,
                       double* algbw_gbs, double* busbw_gbs) {
  if (exec_ns <= 0) {
    *algbw_gbs = 0.0;
    *busbw_gbs = 0.0;
    return;
  }
  /* bytes per ns == GB/s; int / int in Python is one correctly rounded division. */
  double algbw = (double)nw_traffic_bytes(op, msg_bytes, nranks) / (double)exec_ns;
  *algbw_gbs = algbw;
  *busbw_gbs = algbw * nw_bus_factor(op, nranks);
}

static const char* const nw_bucket_units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};

void nw_size_bucket(uint64_t nbytes, char* out, size_t out_len) {
  if (nbytes == 0) {
    snprintf(out, out_len, "0B");
    return;
  }
  int e = 63 - __builtin_clzll(nbytes);
  int unit = e / 10;
  if (unit > 5) unit = 5;
  snprintf(out, out_len, "%llu%s", 1ULL << (e - 10 * unit), nw_bucket_units[unit]);
}

void nw_inspector_size_label(uint64_t nbytes, char* out, size_t out_len) {
  static const char* const units[] = {"B", "KB", "MB", "GB", "TB"};
  if (nbytes == 0) { /* Inspector labels empty ops "0B", not "0-1B" */
    snprintf(out, out_len, "0B");
    return;
  }
  double value = (double)nbytes;
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    unit++;
  }
  unsigned long long n = (unsigned long long)value;
  snprintf(out, out_len, "%llu-%llu%s", n, n + 1, units[unit]);
}

void nw_safe_filename(const char* name, char out[NW_SAFE_NAME_MAX + 1]) {
  static const char hex[] = "0123456789ABCDEF";
  size_t o = 0;
  if (!name[0]) {
    memcpy(out, "%00", 4);
    return;
  }
  for (const unsigned char* p = (const unsigned char*)name; *p && o < NW_SAFE_NAME_MAX; p++) {
    unsigned char c = *p;
    if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
        c == '-') {
      out[o++] = (char)c;
    } else {
      /* Python cuts the escaped text at max_len characters, possibly inside a %XX. */
      const char esc[3] = {'%', hex[c >> 4], hex[c & 15]};
      for (int i = 0; i < 3 && o < NW_SAFE_NAME_MAX; i++) out[o++] = esc[i];
    }
  }
  out[o] = '\0';
}
