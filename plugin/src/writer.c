/* The writer thread: drains the rings into JSONL spool segments.
 *
 * Segments are $NCCLWATCH_SPOOL_DIR/<safe job>/<safe host>-<gpu>-<pid>.<NNNNNN>.jsonl,
 * created with O_EXCL (never overwritten), rotated at NCCLWATCH_SEGMENT_BYTES, and only
 * opened while this process's existing segments (re-listed at each rotation, since the
 * forwarder deletes acknowledged ones) plus one more fit in NCCLWATCH_SPOOL_MAX_BYTES.
 * When nothing can be written, op records are counted as dropped (disk_full or
 * write_error); the counts reach the spool as `drop` records once there is room, and in
 * every `plugin_stats` record (first line of each segment, each finalize, exit).
 * A partial line left by a failed write is cut off, so readers only ever see whole lines.
 *
 * While some communicator of the process has had an op in flight for NCCLWATCH_PROGRESS_MS
 * without completing anything, the writer also writes a `progress` line per communicator,
 * at most once per interval, so a hung job says which rank holds the others up.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "inspector.h"
#include "json.h"
#include "nw.h"
#include "rules.h"

#define NW_STATS_RESERVE 4096 /* bytes kept free at a segment's end for drop/stats lines */
#define NW_BATCH_BYTES (1u << 20)
#define NW_LINE_BYTES (32u * 1024)
#define NW_BATCH_LINES 8192
#define NW_PROC_FIELDS (2 * 6 * NW_NAME_MAX + 128) /* two escaped names + pid */
#define NW_REAP_PERIOD_NS (200LL * 1000 * 1000)

/* else: a drop line for that reason */
enum { NW_LINE_OP = -1, NW_LINE_STATS = -2, NW_LINE_PROGRESS = -3 };

/* One communicator's progress counters, copied under ctx_mu and written after it. */
struct nw_prog_snap {
  const struct nw_comm* comm; /* outlives its context: freed only after the writer stops */
  uint64_t issued, colls, done;
  int64_t waiting_since_ns, last_done_ns;
};

struct nw_writer {
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool stop, stats_req; /* under mu */

  int fd;
  bool seg_open;
  uint64_t seg_index;
  uint64_t seg_flushed; /* bytes of the open segment already written */
  int64_t retry_after_ns; /* after an open/write error */
  uint64_t pass, full_pass; /* the spool bound is re-checked at most once per pass */
  enum nw_drop_reason closed_reason; /* why no segment is open */
  bool warned_full, warned_error;

  char dir[1400];
  char prefix[400]; /* "<safe host>-<gpu>-<pid>." */
  char proc_fields[NW_PROC_FIELDS]; /* "job":..,"host":..,"pid":.. */
  char drop_fields[NW_PROC_FIELDS + 2 * NW_GPU_MAX]; /* + "gpu":.. */

  struct nw_buf batch;
  int16_t line_tag[NW_BATCH_LINES];
  uint32_t line_end[NW_BATCH_LINES];
  uint64_t line_count[NW_BATCH_LINES];
  size_t n_lines;
  struct nw_buf line;
  struct nw_buf line_aux; /* the stats line a segment opens with, while `line` is pending */

  int64_t last_reap_ns;
  uint64_t delay_counter;

  struct nw_prog_snap* prog;
  size_t prog_cap;
  int64_t last_progress_ns; /* monotonic; 0: none yet */
};

static struct nw_writer* _Atomic nw_w;

static int64_t nw_mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

#define NW_WLOG(level, ...)                                                             \
  do {                                                                                  \
    if (nw_g.logfn) nw_g.logfn(level, NW_LOG_PROFILE, __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

static void nw_mkdir_p(const char* path) {
  char tmp[sizeof nw_w->dir];
  snprintf(tmp, sizeof tmp, "%s", path);
  for (char* p = tmp + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    mkdir(tmp, 0755);
    *p = '/';
  }
  mkdir(tmp, 0755);
}

/* Sum of this process's segment sizes in the spool directory, and the highest index. */
static uint64_t nw_w_existing_bytes(struct nw_writer* w, uint64_t* max_index, bool* any) {
  uint64_t total = 0;
  *any = false;
  DIR* d = opendir(w->dir);
  if (!d) return 0;
  size_t plen = strlen(w->prefix);
  struct dirent* e;
  while ((e = readdir(d))) {
    const char* n = e->d_name;
    size_t len = strlen(n);
    if (len <= plen + 6 || strncmp(n, w->prefix, plen) != 0 || strcmp(n + len - 6, ".jsonl") != 0)
      continue;
    char* end = NULL;
    unsigned long long idx = strtoull(n + plen, &end, 10);
    if (end != n + len - 6) continue;
    struct stat st;
    if (fstatat(dirfd(d), n, &st, 0) != 0) continue;
    total += (uint64_t)st.st_size;
    if (!*any || idx > *max_index) *max_index = idx;
    *any = true;
  }
  closedir(d);
  return total;
}

static void nw_w_put_line(struct nw_writer* w, const struct nw_buf* line, int tag, uint64_t count) {
  nw_buf_put(&w->batch, line->data, line->len);
  w->line_tag[w->n_lines] = (int16_t)tag;
  w->line_end[w->n_lines] = (uint32_t)w->batch.len;
  w->line_count[w->n_lines] = count;
  w->n_lines++;
}

static void nw_w_close(struct nw_writer* w, enum nw_drop_reason why) {
  if (w->seg_open) close(w->fd);
  w->fd = -1;
  w->seg_open = false;
  w->closed_reason = why;
}

/* Write the batch. On failure, keep the complete lines that made it, cut a partial one,
 * count the lost op lines as drops and un-report lost drop lines. */
static void nw_w_flush(struct nw_writer* w) {
  if (w->batch.len == 0) return;
  size_t off = 0;
  int err = 0;
  while (off < w->batch.len) {
    ssize_t k = write(w->fd, w->batch.data + off, w->batch.len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      err = k < 0 ? errno : EIO;
      break;
    }
    off += (size_t)k;
  }
  size_t keep = 0;
  for (size_t i = 0; i < w->n_lines; i++) {
    if (w->line_end[i] <= off) {
      keep = w->line_end[i];
      if (w->line_tag[i] == NW_LINE_OP) nw_g.recorded++;
      continue;
    }
    enum nw_drop_reason why = (err == ENOSPC || err == EDQUOT) ? NW_DROP_DISK_FULL : NW_DROP_WRITE_ERROR;
    /* A progress line lost is no op lost: the next interval writes a fresh one. */
    if (w->line_tag[i] == NW_LINE_OP) nw_count_drop(why);
    else if (w->line_tag[i] >= 0) nw_g.drops_reported[w->line_tag[i]] -= w->line_count[i];
  }
  if (err) {
    if (off > keep && ftruncate(w->fd, (off_t)(w->seg_flushed + keep)) != 0) {
      /* Cannot cut the partial line: leave this segment for good, it ends in garbage
       * the reader will see as an unfinished line. */
    }
    if (!w->warned_error) {
      NW_WLOG(NW_LOG_WARN, "ncclwatch: writing spool segment %llu failed: %s; dropping until it works",
              (unsigned long long)w->seg_index, strerror(err));
      w->warned_error = true;
    }
    nw_w_close(w, (err == ENOSPC || err == EDQUOT) ? NW_DROP_DISK_FULL : NW_DROP_WRITE_ERROR);
    w->retry_after_ns = nw_mono_ns() + 1000LL * 1000 * 1000;
  } else {
    w->seg_flushed += off;
  }
  nw_buf_reset(&w->batch);
  w->n_lines = 0;
}

static void nw_w_format_stats(struct nw_writer* w, struct nw_buf* b, uint64_t segment) {
  nw_buf_reset(b);
  nw_buf_puts(b, "{\"v\":1,\"kind\":\"plugin_stats\",");
  nw_buf_puts(b, w->drop_fields); /* job, host, pid, gpu */
  nw_buf_puts(b, ",\"ts_ns\":");
  nw_buf_i64(b, nw_now_ns());
  nw_buf_puts(b, ",\"recorded\":");
  nw_buf_u64(b, nw_g.recorded);
  nw_buf_puts(b, ",\"dropped\":{");
  for (int r = 0; r < NW_DROP_N; r++) {
    nw_buf_printf(b, "%s\"%s\":", r ? "," : "", nw_drop_reason_names[r]);
    nw_buf_u64(b, atomic_load_explicit(&nw_g.dropped[r], memory_order_relaxed));
  }
  nw_buf_puts(b, "},\"segment\":");
  nw_buf_u64(b, segment);
  nw_buf_puts(b, "}\n");
}

/* Is the job directory ours? On a node shared by several users the spool is sticky and
 * world-writable like /tmp: a directory someone else created (or made writable by others)
 * could be theirs to read, replace or fill, and a forwarder with spool_trust=owner would
 * not believe our segments in it anyway. Then nothing is written there (write_error). */
static bool nw_w_dir_ours(struct nw_writer* w) {
  struct stat st;
  const char* why = NULL;
  if (lstat(w->dir, &st) != 0) return true; /* not there: the open reports why */
  if (!S_ISDIR(st.st_mode))
    why = "is not a directory";
  else if (st.st_uid != geteuid())
    why = "belongs to another user";
  else if (st.st_mode & S_IWOTH)
    why = "is writable by every user";
  if (!why) return true;
  if (!w->warned_error) {
    NW_WLOG(NW_LOG_WARN, "ncclwatch: spool directory %s %s (uid %u): not writing there, "
            "records are counted as dropped (write_error)", w->dir, why, (unsigned)st.st_uid);
    w->warned_error = true;
  }
  w->closed_reason = NW_DROP_WRITE_ERROR;
  w->retry_after_ns = nw_mono_ns() + 1000LL * 1000 * 1000;
  return false;
}

/* Is there room in the spool bound for one more segment? Re-lists the directory, since
 * the forwarder deletes acknowledged segments; throttled while the answer is no. */
static bool nw_w_room(struct nw_writer* w) {
  int64_t now = nw_mono_ns();
  if (now < w->retry_after_ns || w->full_pass == w->pass) return false;
  nw_mkdir_p(w->dir);
  if (!nw_w_dir_ours(w)) return false;
  uint64_t max_index = 0;
  bool any = false;
  uint64_t total = nw_w_existing_bytes(w, &max_index, &any);
  if (any && max_index + 1 > nw_g.seg_next_index) nw_g.seg_next_index = max_index + 1;
  if (total + nw_g.cfg.segment_bytes <= nw_g.cfg.spool_max_bytes) {
    w->warned_full = false;
    return true;
  }
  if (!w->warned_full) {
    NW_WLOG(NW_LOG_WARN,
            "ncclwatch: spool %s holds %llu bytes of this process (bound %llu): dropping "
            "records until the forwarder frees space",
            w->dir, (unsigned long long)total, (unsigned long long)nw_g.cfg.spool_max_bytes);
    w->warned_full = true;
  }
  w->closed_reason = NW_DROP_DISK_FULL;
  w->full_pass = w->pass;
  return false;
}

/* Open the next segment (after nw_w_room said yes); its first line is a plugin_stats. */
static bool nw_w_open(struct nw_writer* w) {
  char path[sizeof w->dir + sizeof w->prefix + 32];
  for (int tries = 0; tries < 1000; tries++) {
    snprintf(path, sizeof path, "%s/%s%06llu.jsonl", w->dir, w->prefix,
             (unsigned long long)nw_g.seg_next_index);
    w->fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (w->fd >= 0 || errno != EEXIST) break;
    nw_g.seg_next_index++; /* never overwrite: someone else's or an older segment */
  }
  if (w->fd < 0) {
    int err = errno;
    if (!w->warned_error) {
      NW_WLOG(NW_LOG_WARN, "ncclwatch: cannot create spool segment %s: %s", path, strerror(err));
      w->warned_error = true;
    }
    w->closed_reason = (err == ENOSPC || err == EDQUOT) ? NW_DROP_DISK_FULL : NW_DROP_WRITE_ERROR;
    w->retry_after_ns = nw_mono_ns() + 1000LL * 1000 * 1000;
    return false;
  }
  w->seg_open = true;
  w->seg_index = nw_g.seg_next_index++;
  w->seg_flushed = 0;
  w->warned_error = false;
  nw_w_format_stats(w, &w->line_aux, w->seg_index);
  nw_w_put_line(w, &w->line_aux, NW_LINE_STATS, 0);
  return true;
}

/* Append the line in `b` to the current segment, rotating or opening as needed. Op lines
 * (and routine drop/stats lines) stop NW_STATS_RESERVE short of the segment size; the
 * last drop/stats lines at shutdown may use the reserve (`final`), so they are written
 * even when the spool bound keeps a full segment from rotating. Returns false when the
 * line could not be placed. */
static bool nw_w_append(struct nw_writer* w, const struct nw_buf* b, int tag, uint64_t count,
                        bool final) {
  if (b->overflow) return false;
  uint64_t limit = nw_g.cfg.segment_bytes - (final ? 0 : NW_STATS_RESERVE);
  if (w->seg_open && w->seg_flushed + w->batch.len + b->len > limit) {
    nw_w_flush(w);
    if (w->seg_open && !nw_w_room(w)) return false; /* keep it open for the final lines */
    nw_w_close(w, NW_DROP_DISK_FULL);
  }
  if (!w->seg_open && (!nw_w_room(w) || !nw_w_open(w))) return false;
  if (w->seg_flushed + w->batch.len + b->len > nw_g.cfg.segment_bytes) return false;
  if (w->batch.len + b->len > w->batch.cap || w->n_lines >= NW_BATCH_LINES) {
    nw_w_flush(w);
    if (!w->seg_open) return false;
  }
  nw_w_put_line(w, b, tag, count);
  return true;
}

static void nw_w_op(const struct nw_op_rec* r, void* arg) {
  struct nw_writer* w = arg;
  const struct nw_comm* c = r->comm;
  uint64_t bytes = (uint64_t)nw_dtype_bytes(r->dtype) * r->count;
  double algbw, busbw;
  nw_bandwidths_gbs(r->op, bytes, c->nranks, r->exec_ns, &algbw, &busbw);
  char id[17];
  nw_record_id_finish(c->id_prefix, r->op, r->peer, r->seq, id);

  struct nw_buf* b = &w->line;
  nw_buf_reset(b);
  nw_buf_puts(b, "{\"v\":1,\"kind\":\"op\",\"id\":\"");
  nw_buf_puts(b, id);
  nw_buf_puts(b, "\",");
  nw_buf_puts(b, w->proc_fields);
  nw_buf_puts(b, ",");
  nw_buf_puts(b, c->json_fields);
  nw_buf_puts(b, ",\"op\":");
  nw_json_str(b, r->op);
  nw_buf_puts(b, ",\"seq\":");
  nw_buf_u64(b, r->seq);
  nw_buf_puts(b, ",\"count\":");
  nw_buf_u64(b, r->count);
  nw_buf_puts(b, ",\"dtype\":");
  nw_json_str(b, r->dtype);
  nw_buf_puts(b, ",\"bytes\":");
  nw_buf_u64(b, bytes);
  nw_buf_puts(b, ",\"peer\":");
  nw_buf_i64(b, r->peer);
  nw_buf_puts(b, ",\"algo\":");
  nw_json_str(b, r->algo);
  nw_buf_puts(b, ",\"proto\":");
  nw_json_str(b, r->proto);
  nw_buf_puts(b, ",\"channels\":");
  nw_buf_u64(b, r->channels);
  int64_t start_ns = r->start_ns;
  if (r->timing == NW_TIMING_KERNEL_GPU) {
    int64_t off = nw_cal_offset(c);
    start_ns = off == INT64_MAX ? 0 : r->start_ns + off; /* no sample cannot happen: a start had one */
  }
  nw_buf_puts(b, ",\"start_ns\":");
  nw_buf_i64(b, start_ns);
  nw_buf_puts(b, ",\"exec_ns\":");
  nw_buf_i64(b, r->exec_ns);
  nw_buf_puts(b, r->timing == NW_TIMING_KERNEL_GPU ? ",\"timing\":\"kernel_gpu\""
                 : r->timing == NW_TIMING_SAMPLED_OUT ? ",\"timing\":\"sampled_out\""
                                                      : ",\"timing\":\"host\"");
  nw_buf_puts(b, ",\"algbw_gbs\":");
  nw_json_double(b, algbw);
  nw_buf_puts(b, ",\"busbw_gbs\":");
  nw_json_double(b, busbw);
  nw_buf_puts(b, r->graph ? ",\"graph\":true}\n" : ",\"graph\":false}\n");

  if (!nw_w_append(w, b, NW_LINE_OP, 1, false))
    nw_count_drop(b->overflow ? NW_DROP_OTHER : w->closed_reason);
  nw_insp_op(r, bytes, algbw, busbw);

  if (nw_g.cfg.test_writer_delay_us && (++w->delay_counter & 63) == 0)
    usleep(nw_g.cfg.test_writer_delay_us);
}

static void nw_w_drops(struct nw_writer* w, bool final) {
  for (int r = 0; r < NW_DROP_N; r++) {
    uint64_t total = atomic_load_explicit(&nw_g.dropped[r], memory_order_relaxed);
    if (total <= nw_g.drops_reported[r]) continue;
    uint64_t count = total - nw_g.drops_reported[r];
    struct nw_buf* b = &w->line;
    nw_buf_reset(b);
    nw_buf_puts(b, "{\"v\":1,\"kind\":\"drop\",");
    nw_buf_puts(b, w->drop_fields);
    nw_buf_printf(b, ",\"rank\":%d,\"ts_ns\":", nw_g.first_rank);
    nw_buf_i64(b, nw_now_ns());
    nw_buf_printf(b, ",\"reason\":\"%s\",\"count\":", nw_drop_reason_names[r]);
    nw_buf_u64(b, count);
    nw_buf_puts(b, ",\"total\":");
    nw_buf_u64(b, total);
    nw_buf_puts(b, "}\n");
    if (nw_w_append(w, b, r, count, final)) nw_g.drops_reported[r] = total;
  }
}

static void nw_w_stats(struct nw_writer* w, bool final) {
  nw_w_flush(w); /* so `recorded` counts everything before this line */
  if (!w->seg_open && !final) return; /* the next segment starts with one anyway */
  nw_w_format_stats(w, &w->line, w->seg_index);
  nw_w_append(w, &w->line, NW_LINE_STATS, 0, final);
  nw_w_flush(w);
}

/* Copy every live communicator's counters; true when one of them has had work in flight,
 * with nothing completed, for the progress interval. */
static bool nw_w_prog_snapshot(struct nw_writer* w, int64_t now, int64_t interval_ns, size_t* n) {
  bool stuck = false;
  *n = 0;
  pthread_mutex_lock(&nw_g.ctx_mu);
  size_t live = 0;
  for (struct nw_ctx* c = nw_g.ctxs; c; c = c->next) live++;
  if (live > w->prog_cap) {
    struct nw_prog_snap* p = realloc(w->prog, live * sizeof *p);
    if (p) {
      w->prog = p;
      w->prog_cap = live;
    }
  }
  for (struct nw_ctx* c = nw_g.ctxs; c && *n < w->prog_cap; c = c->next) { /* OOM: the first */
    struct nw_prog_snap* p = &w->prog[(*n)++];
    p->comm = c->comm;
    /* done first, with acquire: every op it counts has its issued++ visible below. */
    p->done = atomic_load_explicit(&c->done, memory_order_acquire);
    p->issued = atomic_load_explicit(&c->issued, memory_order_relaxed);
    p->colls = atomic_load_explicit(&c->colls, memory_order_relaxed);
    p->last_done_ns = atomic_load_explicit(&c->last_done_ns, memory_order_relaxed);
    int64_t busy = atomic_load_explicit(&c->busy_since_ns, memory_order_relaxed);
    if (p->issued < p->done) p->issued = p->done; /* cannot happen (see nw_prog_done) */
    p->waiting_since_ns = 0;
    if (p->issued > p->done) {
      p->waiting_since_ns = busy > p->last_done_ns ? busy : p->last_done_ns;
      if (now - p->waiting_since_ns >= interval_ns) stuck = true;
    }
  }
  pthread_mutex_unlock(&nw_g.ctx_mu);
  return stuck;
}

/* Progress records: only while some communicator is stuck, then one line for every
 * communicator (an idle one shows where this rank is not waiting), once per interval. A
 * healthy job completes ops all the time and never writes one. */
static void nw_w_progress(struct nw_writer* w) {
  int64_t interval_ns = (int64_t)nw_g.cfg.progress_ms * 1000000LL;
  int64_t mono = nw_mono_ns();
  if (!interval_ns || (w->last_progress_ns && mono - w->last_progress_ns < interval_ns)) return;
  int64_t now = nw_now_ns();
  size_t n;
  if (!nw_w_prog_snapshot(w, now, interval_ns, &n)) return;
  w->last_progress_ns = mono;
  for (size_t i = 0; i < n; i++) {
    const struct nw_prog_snap* p = &w->prog[i];
    const struct nw_comm* c = p->comm;
    struct nw_buf* b = &w->line;
    nw_buf_reset(b);
    nw_buf_puts(b, "{\"v\":1,\"kind\":\"progress\",");
    nw_buf_puts(b, w->proc_fields); /* job, host, pid */
    nw_buf_puts(b, ",\"gpu\":");
    nw_json_str(b, c->gpu);
    nw_buf_printf(b, ",\"comm\":\"%s\",\"comm_name\":", c->hash_hex);
    nw_json_str(b, c->name);
    nw_buf_printf(b, ",\"rank\":%d,\"nranks\":%d,\"ts_ns\":", c->rank, c->nranks);
    nw_buf_i64(b, now);
    nw_buf_puts(b, ",\"issued\":");
    nw_buf_u64(b, p->issued);
    nw_buf_puts(b, ",\"colls\":");
    nw_buf_u64(b, p->colls);
    nw_buf_puts(b, ",\"done\":");
    nw_buf_u64(b, p->done);
    nw_buf_puts(b, ",\"in_flight\":");
    nw_buf_u64(b, p->issued - p->done);
    nw_buf_puts(b, ",\"waiting_since_ns\":");
    nw_buf_i64(b, p->waiting_since_ns);
    nw_buf_puts(b, ",\"last_done_ns\":");
    nw_buf_i64(b, p->last_done_ns);
    nw_buf_puts(b, "}\n");
    /* Not written (no room, a line over 32 KiB): the next interval writes a fresh one; the
     * drop counters are ops', and `recorded + dropped` stays the ops NCCL reported. */
    (void)nw_w_append(w, b, NW_LINE_PROGRESS, 1, false);
  }
}

static void nw_w_pass(struct nw_writer* w, bool final) {
  w->pass++;
  nw_rings_drain(nw_w_op, w, (size_t)nw_g.cfg.ring_records);
  int64_t now = nw_mono_ns();
  if (final || now - w->last_reap_ns >= NW_REAP_PERIOD_NS) {
    w->last_reap_ns = now;
    int64_t wall = nw_now_ns();
    pthread_mutex_lock(&nw_g.ctx_mu);
    size_t reaped = 0;
    for (struct nw_ctx* c = nw_g.ctxs; c; c = c->next)
      reaped += nw_ctx_reap(c, wall, (int64_t)nw_g.cfg.op_timeout_ms * 1000000LL, false);
    pthread_mutex_unlock(&nw_g.ctx_mu);
    if (reaped) nw_rings_drain(nw_w_op, w, 0);
  }
  /* After the reaper, so an op it just gave up on no longer counts as stuck. At the end
   * every open op has been recorded already: nothing to say. */
  if (!final) nw_w_progress(w);
  nw_w_drops(w, final);
  nw_w_flush(w);
  nw_insp_tick(final);
}

static void* nw_writer_main(void* arg) {
  struct nw_writer* w = arg;
  /* Open the first segment at once: the forwarder sees the process even before its
   * first op, through the segment's plugin_stats line. */
  w->pass = 1;
  if (nw_w_room(w) && nw_w_open(w)) nw_w_drops(w, false);
  nw_w_flush(w);
  for (;;) {
    pthread_mutex_lock(&w->mu);
    if (!w->stop && !w->stats_req) {
      struct timespec ts;
      clock_gettime(CLOCK_MONOTONIC, &ts);
      /* Progress is checked at every pass: wake at least twice per progress interval. */
      uint64_t ms = nw_g.cfg.flush_ms;
      if (nw_g.cfg.progress_ms && nw_g.cfg.progress_ms / 2 < ms) ms = nw_g.cfg.progress_ms / 2;
      uint64_t ns = (uint64_t)ts.tv_nsec + ms * 1000000ULL;
      ts.tv_sec += (time_t)(ns / 1000000000ULL);
      ts.tv_nsec = (long)(ns % 1000000000ULL);
      pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    bool stopping = w->stop, stats = w->stats_req;
    w->stats_req = false;
    pthread_mutex_unlock(&w->mu);

    nw_w_pass(w, false);
    if (stopping) break;
    if (stats) nw_w_stats(w, false);
  }
  /* Final pass: everything pushed before nw_writer_stop() is in the rings now (a few
   * rounds, in case other threads still push at process exit). */
  for (int i = 0; i < 4 && nw_rings_drain(nw_w_op, w, 0); i++) {
  }
  nw_w_pass(w, true);
  nw_w_stats(w, true);
  nw_w_close(w, NW_DROP_OTHER);
  return NULL;
}

static void nw_w_build_fields(struct nw_writer* w) {
  struct nw_buf b;
  nw_buf_init(&b, w->proc_fields, sizeof w->proc_fields);
  nw_buf_puts(&b, "\"job\":");
  nw_json_str(&b, nw_g.job);
  nw_buf_puts(&b, ",\"host\":");
  nw_json_str(&b, nw_g.host);
  nw_buf_printf(&b, ",\"pid\":%ld", nw_g.pid);
  nw_buf_put(&b, "", 1);
  nw_buf_init(&b, w->drop_fields, sizeof w->drop_fields);
  nw_buf_puts(&b, w->proc_fields);
  nw_buf_puts(&b, ",\"gpu\":");
  nw_json_str(&b, nw_g.gpu);
  nw_buf_put(&b, "", 1);
}

int nw_writer_start(void) {
  struct nw_writer* w = calloc(1, sizeof *w);
  char* batch = malloc(NW_BATCH_BYTES);
  char* line = malloc(NW_LINE_BYTES);
  char* aux = malloc(NW_LINE_BYTES);
  if (!w || !batch || !line || !aux) {
    free(w);
    free(batch);
    free(line);
    free(aux);
    return -1;
  }
  nw_buf_init(&w->batch, batch, NW_BATCH_BYTES);
  nw_buf_init(&w->line, line, NW_LINE_BYTES);
  nw_buf_init(&w->line_aux, aux, NW_LINE_BYTES);
  w->fd = -1;
  w->closed_reason = NW_DROP_WRITE_ERROR;
  snprintf(w->dir, sizeof w->dir, "%s/%s", nw_g.cfg.spool_dir, nw_g.job_safe);
  snprintf(w->prefix, sizeof w->prefix, "%s-%s-%ld.", nw_g.host_safe, nw_g.gpu, nw_g.pid);
  nw_w_build_fields(w);
  pthread_mutex_init(&w->mu, NULL);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_cond_init(&w->cv, &ca);
  pthread_condattr_destroy(&ca);
  nw_insp_start();
  nw_w = w;
  if (pthread_create(&w->th, NULL, nw_writer_main, w) != 0) {
    nw_w = NULL;
    nw_insp_stop();
    pthread_cond_destroy(&w->cv);
    pthread_mutex_destroy(&w->mu);
    free(batch);
    free(line);
    free(aux);
    free(w);
    return -1;
  }
  nw_g.writer = w;
  return 0;
}

void nw_writer_wake(void) {
  struct nw_writer* w = nw_w;
  if (!w) return;
  /* No lock: a lost wake-up only delays the writer to its next timeout. */
  pthread_cond_signal(&w->cv);
}

void nw_writer_request_stats(void) {
  struct nw_writer* w = nw_w;
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->stats_req = true;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
}

void nw_writer_stop(bool release) {
  struct nw_writer* w = nw_w;
  if (!w) return;
  pthread_mutex_lock(&w->mu);
  w->stop = true;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->th, NULL);
  nw_w = NULL;
  nw_g.writer = NULL;
  /* At process exit other threads may still call nw_writer_wake() on it: keep it. */
  if (!release) return;
  nw_insp_stop();
  pthread_cond_destroy(&w->cv);
  pthread_mutex_destroy(&w->mu);
  free(w->batch.data);
  free(w->line.data);
  free(w->line_aux.data);
  free(w->prog);
  free(w);
}
