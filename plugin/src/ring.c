/* Per-thread single-producer/single-consumer rings of op records.
 *
 * Callbacks arrive on the application thread, CUDA's host-callback thread and NCCL's
 * proxy threads. Each thread that completes an op gets its own ring on first use (the
 * only allocation after init, once per thread), so a push is two atomic loads, a copy and
 * a release store: no lock, no syscall. The writer thread is the single consumer. A
 * thread-exit destructor marks the ring orphaned; the writer frees it once drained.
 */
#include <stdlib.h>
#include <string.h>

#include "nw.h"

struct nw_ring {
  _Atomic uint64_t head; /* next record the writer reads */
  char pad0[56];
  _Atomic uint64_t tail; /* next slot the producer writes */
  char pad1[56];
  _Atomic int orphaned;
  _Atomic int wake_sent;
  uint64_t epoch;
  uint32_t mask;
  struct nw_op_rec slots[];
};

static _Thread_local struct nw_ring* nw_tl_ring;
static _Thread_local uint64_t nw_tl_epoch;

static void nw_ring_orphan(void* p) {
  struct nw_ring* r = p;
  atomic_store_explicit(&r->orphaned, 1, memory_order_release);
}

int nw_rings_start(void) {
  nw_g.n_rings = nw_g.cfg.max_threads;
  nw_g.rings = calloc(nw_g.n_rings, sizeof *nw_g.rings);
  if (!nw_g.rings) return -1;
  for (uint32_t i = 0; i < nw_g.n_rings; i++) atomic_init(&nw_g.rings[i], NULL);
  nw_g.ring_key_ok = pthread_key_create(&nw_g.ring_key, nw_ring_orphan) == 0;
  return 0;
}

void nw_rings_stop(void) {
  /* Delete the key first: a destructor must never run after the library is unloaded. */
  if (nw_g.ring_key_ok) pthread_key_delete(nw_g.ring_key);
  nw_g.ring_key_ok = false;
  for (uint32_t i = 0; nw_g.rings && i < nw_g.n_rings; i++)
    free(atomic_load_explicit(&nw_g.rings[i], memory_order_acquire));
  free(nw_g.rings);
  nw_g.rings = NULL;
  nw_g.n_rings = 0;
}

static struct nw_ring* nw_ring_acquire(uint64_t epoch) {
  uint32_t cap = nw_g.cfg.ring_records;
  struct nw_ring* r = calloc(1, sizeof *r + (size_t)cap * sizeof(struct nw_op_rec));
  if (!r) return NULL;
  r->mask = cap - 1;
  r->epoch = epoch;
  for (uint32_t i = 0; i < nw_g.n_rings; i++) {
    struct nw_ring* expected = NULL;
    if (atomic_compare_exchange_strong_explicit(&nw_g.rings[i], &expected, r,
                                                memory_order_release, memory_order_relaxed)) {
      if (nw_g.ring_key_ok) pthread_setspecific(nw_g.ring_key, r);
      return r;
    }
  }
  free(r); /* more reporting threads than NCCLWATCH_MAX_THREADS */
  return NULL;
}

void nw_ring_push(const struct nw_op_rec* rec) {
  uint64_t epoch = atomic_load_explicit(&nw_g.epoch, memory_order_acquire);
  struct nw_ring* r = nw_tl_ring;
  if (!r || nw_tl_epoch != epoch) {
    /* nw_g.rings is NULL between the last finalize and the next init. */
    if (!nw_g.rings) {
      nw_count_drop(NW_DROP_OTHER);
      return;
    }
    r = nw_ring_acquire(epoch);
    nw_tl_ring = r;
    nw_tl_epoch = epoch;
    if (!r) {
      nw_count_drop(NW_DROP_RING_FULL);
      return;
    }
  }
  uint64_t t = atomic_load_explicit(&r->tail, memory_order_relaxed);
  uint64_t h = atomic_load_explicit(&r->head, memory_order_acquire);
  if (t - h > r->mask) {
    nw_count_drop(NW_DROP_RING_FULL);
    nw_writer_wake();
    return;
  }
  r->slots[t & r->mask] = *rec;
  atomic_store_explicit(&r->tail, t + 1, memory_order_release);
  /* Wake the writer early only when half full, and once per drain: the usual wake-up is
   * its NCCLWATCH_FLUSH_MS timeout, so the hot path normally makes no syscall. */
  if (t + 1 - h > (r->mask >> 1) &&
      !atomic_exchange_explicit(&r->wake_sent, 1, memory_order_relaxed))
    nw_writer_wake();
}

size_t nw_rings_drain(void (*fn)(const struct nw_op_rec*, void*), void* arg, size_t max_per_ring) {
  size_t n = 0;
  for (uint32_t i = 0; i < nw_g.n_rings; i++) {
    struct nw_ring* r = atomic_load_explicit(&nw_g.rings[i], memory_order_acquire);
    if (!r) continue;
    /* Read `orphaned` before the tail: a ring seen orphaned has had its last push. */
    int orphaned = atomic_load_explicit(&r->orphaned, memory_order_acquire);
    uint64_t t = atomic_load_explicit(&r->tail, memory_order_acquire);
    uint64_t h = atomic_load_explicit(&r->head, memory_order_relaxed);
    if (max_per_ring && t - h > max_per_ring) t = h + max_per_ring;
    for (; h < t; h++) {
      fn(&r->slots[h & r->mask], arg);
      n++;
      if ((n & 255) == 0) atomic_store_explicit(&r->head, h + 1, memory_order_release);
    }
    atomic_store_explicit(&r->head, h, memory_order_release);
    atomic_store_explicit(&r->wake_sent, 0, memory_order_relaxed);
    if (orphaned && h == atomic_load_explicit(&r->tail, memory_order_acquire)) {
      atomic_store_explicit(&nw_g.rings[i], NULL, memory_order_release);
      free(r);
    }
  }
  return n;
}
