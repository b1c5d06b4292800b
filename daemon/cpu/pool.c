/* SPDX-License-Identifier: Apache-2.0 */
/* cpu_pool: fixed worker threads, one generation counter per slice.
 *
 * All shared state is guarded by one mutex; workers sleep on work_cv until
 * the generation changes, the caller sleeps on done_cv until every worker
 * has finished its chunk. Chunks are computed from the worker's index, so no
 * work is ever handed out in arrival order. One caller at a time has the
 * workers, for one slice of its items; a caller that finds them taken runs
 * its slice on its own thread instead of waiting, so no caller ever waits
 * for another's run (the kernel shares the cores among the threads). */
#include "cpu/pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

struct cpu_pool {
  int n_threads; /* including the caller */
  int n_started; /* worker threads actually running */
  pthread_t *workers;
  pthread_mutex_t mu;
  pthread_cond_t work_cv;
  pthread_cond_t done_cv;
  /* guarded by mu */
  bool busy; /* a caller has the workers (one slice at a time) */
  uint64_t generation;
  int pending;
  bool stopping;
  cpu_pool_fn fn;
  void *arg;
  size_t base, n_items; /* the slice being run: items [base, base + n_items) */
  int n_chunks;
};

typedef struct worker_start {
  cpu_pool *pool;
  int index; /* chunk index of this worker: 1 .. n_threads-1 */
} worker_start;

static void chunk_bounds(size_t n, int n_chunks, int index, size_t *begin, size_t *end) {
  /* n * index / n_chunks without overflow for any realistic n */
  size_t q = n / (size_t)n_chunks, r = n % (size_t)n_chunks;
  size_t i = (size_t)index;
  *begin = q * i + (i < r ? i : r);
  *end = *begin + q + (i < r ? 1 : 0);
}

static void *worker_main(void *p) {
  worker_start *ws = p;
  cpu_pool *pool = ws->pool;
  int index = ws->index;
  free(ws);
  uint64_t seen = 0;
  pthread_mutex_lock(&pool->mu);
  for (;;) {
    while (!pool->stopping && pool->generation == seen)
      pthread_cond_wait(&pool->work_cv, &pool->mu);
    if (pool->stopping) break;
    seen = pool->generation;
    cpu_pool_fn fn = pool->fn;
    void *arg = pool->arg;
    size_t base = pool->base, n = pool->n_items;
    int n_chunks = pool->n_chunks;
    pthread_mutex_unlock(&pool->mu);
    if (index < n_chunks) {
      size_t begin, end;
      chunk_bounds(n, n_chunks, index, &begin, &end);
      if (begin < end) fn(arg, base + begin, base + end);
    }
    pthread_mutex_lock(&pool->mu);
    if (--pool->pending == 0) pthread_cond_signal(&pool->done_cv);
  }
  pthread_mutex_unlock(&pool->mu);
  return NULL;
}

static int online_cores(void) {
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 1) return 1;
  if (n > 1024) return 1024;
  return (int)n;
}

int mok__cpu_pool_create(int threads, cpu_pool **ret_pool) {
  if (!ret_pool) return EINVAL;
  *ret_pool = NULL;
  if (threads < 0) return EINVAL;
  if (threads == 0) threads = online_cores();
  cpu_pool *pool = calloc(1, sizeof *pool);
  if (!pool) return ENOMEM;
  pool->n_threads = threads;
  int rc = pthread_mutex_init(&pool->mu, NULL);
  if (rc) goto fail_mu;
  rc = pthread_cond_init(&pool->work_cv, NULL);
  if (rc) goto fail_work_cv;
  rc = pthread_cond_init(&pool->done_cv, NULL);
  if (rc) goto fail_done_cv;
  if (threads > 1) {
    pool->workers = calloc((size_t)threads - 1, sizeof *pool->workers);
    if (!pool->workers) {
      rc = ENOMEM;
      goto fail_workers;
    }
  }
  for (int i = 1; i < threads; i++) {
    worker_start *ws = malloc(sizeof *ws);
    if (!ws) {
      rc = ENOMEM;
      goto fail_threads;
    }
    ws->pool = pool;
    ws->index = i;
    rc = pthread_create(&pool->workers[i - 1], NULL, worker_main, ws);
    if (rc) {
      free(ws);
      goto fail_threads;
    }
    pool->n_started++;
  }
  *ret_pool = pool;
  return 0;

fail_threads:
  mok__cpu_pool_destroy(pool); /* joins the started workers and frees everything */
  return rc;
fail_workers:
  pthread_cond_destroy(&pool->done_cv);
fail_done_cv:
  pthread_cond_destroy(&pool->work_cv);
fail_work_cv:
  pthread_mutex_destroy(&pool->mu);
fail_mu:
  free(pool);
  return rc;
}

void mok__cpu_pool_destroy(cpu_pool *pool) {
  if (!pool) return;
  pthread_mutex_lock(&pool->mu);
  pool->stopping = true;
  pthread_cond_broadcast(&pool->work_cv);
  pthread_mutex_unlock(&pool->mu);
  for (int i = 0; i < pool->n_started; i++) pthread_join(pool->workers[i], NULL);
  free(pool->workers);
  pthread_cond_destroy(&pool->done_cv);
  pthread_cond_destroy(&pool->work_cv);
  pthread_mutex_destroy(&pool->mu);
  free(pool);
}

int mok__cpu_pool_threads(const cpu_pool *pool) { return pool ? pool->n_threads : 1; }

/* Items [base, base + n) on the workers and the caller, a chunk each.
 * Called with mu held and busy set by this caller; returns with mu held. */
static void run_slice(cpu_pool *pool, size_t base, size_t n, cpu_pool_fn fn, void *arg) {
  int n_chunks = pool->n_threads;
  if ((size_t)n_chunks > n) n_chunks = (int)n;
  pool->fn = fn;
  pool->arg = arg;
  pool->base = base;
  pool->n_items = n;
  pool->n_chunks = n_chunks;
  pool->pending = pool->n_started;
  pool->generation++;
  pthread_cond_broadcast(&pool->work_cv);
  pthread_mutex_unlock(&pool->mu);

  size_t begin, end;
  chunk_bounds(n, n_chunks, 0, &begin, &end);
  fn(arg, base + begin, base + end);

  pthread_mutex_lock(&pool->mu);
  while (pool->pending > 0) pthread_cond_wait(&pool->done_cv, &pool->mu);
}

void mok__cpu_pool_run(cpu_pool *pool, size_t n_items, cpu_pool_fn fn, void *arg) {
  if (n_items == 0) return;
  int threads = pool ? pool->n_threads : 1;
  if (threads <= 1 || n_items == 1) { /* nothing to share: skip the hand-off */
    fn(arg, 0, n_items);
    return;
  }
  /* Slice by slice: with the workers when nobody else has them, else on
   * this thread alone. The slice grows while slices are short and shrinks
   * when one overran, so that the workers are free again within about
   * CPU_POOL_SLICE_NS whatever an item costs. */
  size_t slice = (size_t)threads, done = 0;
  pthread_mutex_lock(&pool->mu);
  while (done < n_items) {
    size_t n = n_items - done < slice ? n_items - done : slice;
    bool mine = !pool->busy;
    uint64_t t0 = mok_clock_ns();
    if (mine) {
      pool->busy = true;
      run_slice(pool, done, n, fn, arg);
      pool->busy = false;
    } else {
      pthread_mutex_unlock(&pool->mu);
      fn(arg, done, done + n);
      pthread_mutex_lock(&pool->mu);
    }
    uint64_t dt = mok_clock_ns() - t0;
    done += n;
    if (dt < CPU_POOL_SLICE_NS / 2 && slice < SIZE_MAX / 2) slice *= 2;
    else if (dt > 2 * CPU_POOL_SLICE_NS && slice / 2 >= (size_t)threads) slice /= 2;
  }
  pthread_mutex_unlock(&pool->mu);
}
