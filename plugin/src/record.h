/* What the plugin writes, in C.
 *
 * struct nw_op_rec is the fixed-size record a callback pushes into its thread's ring; the
 * writer thread turns it into one `op` line of the record contract (docs/records.md),
 * using the communicator's metadata for the per-communicator fields. Field names follow
 * the contract's spelling. The NW_F_* strings are the contract's field names, shared by
 * the writer and the tests.
 */
#ifndef NW_RECORD_H
#define NW_RECORD_H

#include <stdint.h>

#define NW_CONTRACT_VERSION 1

/* SAMPLED_OUT: NCCL was not asked for this op's GPU timestamps (sampler.c). */
enum nw_timing { NW_TIMING_KERNEL_GPU = 0, NW_TIMING_HOST = 1, NW_TIMING_SAMPLED_OUT = 2 };

/* Drop reasons, in the order of ncclwatch.records.DROP_REASONS. */
enum nw_drop_reason {
  NW_DROP_POOL_FULL,   /* no free op slot in the communicator's pool */
  NW_DROP_RING_FULL,   /* the thread's ring was full (or no ring could be had) */
  NW_DROP_DISK_FULL,   /* the spool bound (or ENOSPC) left no room for the line */
  NW_DROP_WRITE_ERROR, /* open/write failed */
  NW_DROP_UNTIMED,     /* host-timed op dropped because NCCLWATCH_REQUIRE_GPU_TIMING=1 */
  NW_DROP_QUARANTINED, /* never produced by the plugin; listed for the contract */
  NW_DROP_OTHER,
  NW_DROP_N
};
extern const char* const nw_drop_reason_names[NW_DROP_N];

struct nw_comm; /* per-communicator metadata, see nw.h */

struct nw_op_rec {
  const struct nw_comm* comm;
  char op[24];    /* NCCL's func name; "AlltoAll" is spelled "AllToAll" as in the contract */
  char dtype[24];
  char algo[16];  /* "" for p2p */
  char proto[16];
  uint64_t seq;
  uint64_t count;
  int64_t start_ns; /* wall clock, calibrated from the GPU timer, or launch time if host */
  int64_t exec_ns;
  int32_t peer;
  uint8_t channels;
  uint8_t timing; /* enum nw_timing */
  uint8_t graph;
  uint8_t p2p;
};

#endif
