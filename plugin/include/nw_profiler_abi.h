/* The NCCL profiler plugin interface, versions 4, 5 and 6, as ncclwatch uses it.
 *
 * Written by this project from docs (shared/reference/nccl-profiler-abi.md) and checked
 * field by field against NVIDIA/nccl's src/include/plugin/profiler/profiler_v{4,5,6}.h
 * and src/include/plugin/nccl_profiler.h at v2.27.3-1 .. v2.30.7-1 (v6 is unchanged
 * from v2.29.2-1 to v2.30.7-1; v5 from v2.28.3-1). The _Static_asserts pin the LP64
 * offsets we read, so a layout mistake fails the build instead of misreading events.
 *
 * Names are ours (nw_ prefix, snake_case); only the exported table symbols
 * (ncclProfiler_v4/_v5/_v6) must carry NCCL's names.
 */
#ifndef NW_PROFILER_ABI_H
#define NW_PROFILER_ABI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* ncclResult_t and ncclDebugLogLevel are C enums: int-sized in the ABI. */
typedef int nw_nccl_result;
enum {
  NW_NCCL_SUCCESS = 0,
  NW_NCCL_SYSTEM_ERROR = 2,
  NW_NCCL_INTERNAL_ERROR = 3,
  NW_NCCL_INVALID_ARGUMENT = 4,
};

enum { NW_LOG_WARN = 2, NW_LOG_INFO = 3 };           /* ncclDebugLogLevel */
enum { NW_LOG_INIT = 0x1, NW_LOG_ENV = 0x80, NW_LOG_PROFILE = 0x4000 }; /* subsystem flags */

typedef void (*nw_nccl_logger)(int level, unsigned long flags, const char* file, int line,
                               const char* fmt, ...);

/* Event type bits (ncclProfileGroup ...). Enabling a child type makes NCCL create its
 * parents too, so asking for KernelCh also yields Coll/P2p events. */
enum {
  NW_EV_GROUP = 1 << 0,
  NW_EV_COLL = 1 << 1,
  NW_EV_P2P = 1 << 2,
  NW_EV_PROXY_OP = 1 << 3,
  NW_EV_PROXY_STEP = 1 << 4,
  NW_EV_PROXY_CTRL = 1 << 5,
  NW_EV_KERNEL_CH = 1 << 6,
  NW_EV_NET_PLUGIN = 1 << 7,
  NW_EV_GROUP_API = 1 << 8,     /* v5 */
  NW_EV_COLL_API = 1 << 9,      /* v5 */
  NW_EV_P2P_API = 1 << 10,      /* v5 */
  NW_EV_KERNEL_LAUNCH = 1 << 11, /* v5 */
  NW_EV_CE_COLL = 1 << 12,      /* v6 */
  NW_EV_CE_SYNC = 1 << 13,      /* v6 */
  NW_EV_CE_BATCH = 1 << 14,     /* v6 */
};

/* Event states (ncclProfilerEventState_t); only the one we act on is named. */
enum { NW_STATE_KERNEL_CH_STOP = 22 };

/* Union members shared by v4, v5 and v6 descriptors. */
struct nw_ev_proxy_op {
  pid_t pid; /* ncclPid_t */
  uint8_t channel_id;
  int peer;
  int n_steps;
  int chunk_size;
  int is_send;
};
struct nw_ev_proxy_step { int step; };
struct nw_ev_kernel_ch {
  uint8_t channel_id;
  uint64_t p_timer; /* GPU globaltimer (ns) at the channel's work start */
};
struct nw_ev_net_plugin { int64_t id; void* data; };

/* --- v4 (NCCL 2.27) ------------------------------------------------------------ */
struct nw_descr_v4 {
  uint8_t type; /* uint8_t in v4, uint64_t from v5 */
  void* parent;
  int rank;
  union {
    struct {
      uint64_t seq_number;
      const char* func;
      const void* send_buff;
      void* recv_buff;
      size_t count;
      int root;
      const char* datatype;
      uint8_t n_channels;
      uint8_t n_warps;
      const char* algo;
      const char* proto;
    } coll;
    struct {
      const char* func;
      void* buff;
      const char* datatype; /* datatype before count in p2p */
      size_t count;
      int peer;
      uint8_t n_channels;
    } p2p;
    struct nw_ev_proxy_op proxy_op;
    struct nw_ev_proxy_step proxy_step;
    struct nw_ev_kernel_ch kernel_ch;
    struct nw_ev_net_plugin net_plugin;
  };
};

/* --- v5 (NCCL 2.28) ------------------------------------------------------------ */
#define NW_DESCR_V5_MEMBERS                                                        \
  struct {                                                                         \
    bool graph_captured;                                                           \
    int group_depth;                                                               \
  } group_api;                                                                     \
  struct {                                                                         \
    const char* func;                                                              \
    size_t count;                                                                  \
    const char* datatype;                                                          \
    int root;                                                                      \
    void* stream;                                                                  \
    bool graph_captured;                                                           \
  } coll_api;                                                                      \
  struct {                                                                         \
    const char* func;                                                              \
    size_t count;                                                                  \
    const char* datatype;                                                          \
    void* stream;                                                                  \
    bool graph_captured;                                                           \
  } p2p_api;                                                                       \
  struct {                                                                         \
    void* stream;                                                                  \
  } kernel_launch;                                                                 \
  struct {                                                                         \
    uint64_t seq_number;                                                           \
    const char* func;                                                              \
    const void* send_buff;                                                         \
    void* recv_buff;                                                               \
    size_t count;                                                                  \
    int root;                                                                      \
    const char* datatype;                                                          \
    uint8_t n_channels;                                                            \
    uint8_t n_warps;                                                               \
    const char* algo;                                                              \
    const char* proto;                                                             \
    void* parent_group;                                                            \
  } coll;                                                                          \
  struct {                                                                         \
    const char* func;                                                              \
    void* buff;                                                                    \
    const char* datatype;                                                          \
    size_t count;                                                                  \
    int peer;                                                                      \
    uint8_t n_channels;                                                            \
    void* parent_group;                                                            \
  } p2p;                                                                           \
  struct nw_ev_proxy_op proxy_op;                                                  \
  struct nw_ev_proxy_step proxy_step;                                              \
  struct nw_ev_kernel_ch kernel_ch;                                                \
  struct nw_ev_net_plugin net_plugin;

struct nw_descr_v5 {
  uint64_t type;
  void* parent; /* Coll/P2p: its CollApi/P2pApi handle; KernelCh: its Coll/P2p handle */
  int rank;
  union {
    NW_DESCR_V5_MEMBERS
  };
};

/* --- v6 (NCCL 2.29, 2.30): v5's members plus copy-engine ones, same offsets ------- */
struct nw_descr_v6 {
  uint64_t type;
  void* parent;
  int rank;
  union {
    NW_DESCR_V5_MEMBERS
    struct {
      uint64_t seq_number;
      const char* func;
      const void* send_buff;
      void* recv_buff;
      size_t count;
      int root;
      const char* datatype;
      const char* sync_strategy;
      bool intra_batch_sync;
      uint32_t batch_size;
      uint32_t num_batches;
      uint32_t ce_seq_num;
      void* stream;
    } ce_coll;
    struct {
      bool is_complete;
      int n_ranks;
    } ce_coll_sync;
    struct {
      int num_ops;
      size_t total_bytes;
      bool use_intra_sync;
    } ce_coll_batch;
  };
};

/* State arguments, identical in v4, v5, v6. */
union nw_state_args {
  struct { size_t trans_size; } proxy_step;
  struct { int appended_proxy_ops; } proxy_ctrl;
  struct { void* data; } net_plugin;
  struct { uint64_t p_timer; } kernel_ch; /* GPU globaltimer (ns) at the channel's work end */
};

/* Function tables: NCCL dlsym()s these data symbols, newest first. */
struct nw_profiler_v4 {
  const char* name;
  nw_nccl_result (*init)(void** context, int* activation_mask, const char* comm_name,
                         uint64_t comm_hash, int n_nodes, int nranks, int rank,
                         nw_nccl_logger logfn);
  nw_nccl_result (*start_event)(void* context, void** handle, struct nw_descr_v4* descr);
  nw_nccl_result (*stop_event)(void* handle);
  nw_nccl_result (*record_event_state)(void* handle, int state, union nw_state_args* args);
  nw_nccl_result (*finalize)(void* context);
};

struct nw_profiler_v5 {
  const char* name;
  nw_nccl_result (*init)(void** context, uint64_t comm_id, int* activation_mask,
                         const char* comm_name, int n_nodes, int nranks, int rank,
                         nw_nccl_logger logfn);
  nw_nccl_result (*start_event)(void* context, void** handle, struct nw_descr_v5* descr);
  nw_nccl_result (*stop_event)(void* handle);
  nw_nccl_result (*record_event_state)(void* handle, int state, union nw_state_args* args);
  nw_nccl_result (*finalize)(void* context);
};

struct nw_profiler_v6 {
  const char* name;
  nw_nccl_result (*init)(void** context, uint64_t comm_id, int* activation_mask,
                         const char* comm_name, int n_nodes, int nranks, int rank,
                         nw_nccl_logger logfn);
  nw_nccl_result (*start_event)(void* context, void** handle, struct nw_descr_v6* descr);
  nw_nccl_result (*stop_event)(void* handle);
  nw_nccl_result (*record_event_state)(void* handle, int state, union nw_state_args* args);
  nw_nccl_result (*finalize)(void* context);
};

/* LP64 offsets as found in NCCL's headers (x86_64 and aarch64 Linux). */
#if defined(__LP64__)
_Static_assert(offsetof(struct nw_descr_v4, parent) == 8, "v4 parentObj");
_Static_assert(offsetof(struct nw_descr_v4, rank) == 16, "v4 rank");
_Static_assert(offsetof(struct nw_descr_v4, coll) == 24, "v4 union");
_Static_assert(offsetof(struct nw_descr_v4, coll.datatype) == 24 + 48, "v4 coll.datatype");
_Static_assert(offsetof(struct nw_descr_v4, coll.n_channels) == 24 + 56, "v4 coll.nChannels");
_Static_assert(offsetof(struct nw_descr_v4, coll.proto) == 24 + 72, "v4 coll.proto");
_Static_assert(offsetof(struct nw_descr_v4, p2p.count) == 24 + 24, "v4 p2p.count");
_Static_assert(offsetof(struct nw_descr_v4, p2p.n_channels) == 24 + 36, "v4 p2p.nChannels");
_Static_assert(offsetof(struct nw_descr_v4, kernel_ch.p_timer) == 24 + 8, "v4 kernelCh.pTimer");

_Static_assert(offsetof(struct nw_descr_v5, coll) == 24, "v5 union");
_Static_assert(offsetof(struct nw_descr_v5, coll_api.graph_captured) == 24 + 40, "v5 collApi");
_Static_assert(offsetof(struct nw_descr_v5, p2p_api.graph_captured) == 24 + 32, "v5 p2pApi");
_Static_assert(offsetof(struct nw_descr_v5, coll.seq_number) == 24 + 0, "v5 coll.seqNumber");
_Static_assert(offsetof(struct nw_descr_v5, coll.count) == 24 + 32, "v5 coll.count");
_Static_assert(offsetof(struct nw_descr_v5, coll.root) == 24 + 40, "v5 coll.root");
_Static_assert(offsetof(struct nw_descr_v5, coll.n_channels) == 24 + 56, "v5 coll.nChannels");
_Static_assert(offsetof(struct nw_descr_v5, coll.algo) == 24 + 64, "v5 coll.algo");
_Static_assert(offsetof(struct nw_descr_v5, coll.parent_group) == 24 + 80, "v5 coll.parentGroup");
_Static_assert(offsetof(struct nw_descr_v5, p2p.datatype) == 24 + 16, "v5 p2p.datatype");
_Static_assert(offsetof(struct nw_descr_v5, p2p.peer) == 24 + 32, "v5 p2p.peer");
_Static_assert(offsetof(struct nw_descr_v5, kernel_ch.p_timer) == 24 + 8, "v5 kernelCh.pTimer");
_Static_assert(offsetof(struct nw_descr_v6, coll.n_channels) ==
                   offsetof(struct nw_descr_v5, coll.n_channels), "v6 extends v5");
_Static_assert(offsetof(struct nw_descr_v6, p2p.n_channels) ==
                   offsetof(struct nw_descr_v5, p2p.n_channels), "v6 extends v5");
_Static_assert(offsetof(struct nw_descr_v6, kernel_ch.p_timer) ==
                   offsetof(struct nw_descr_v5, kernel_ch.p_timer), "v6 extends v5");
_Static_assert(sizeof(union nw_state_args) == 8, "state args");
#endif

#endif /* NW_PROFILER_ABI_H */
