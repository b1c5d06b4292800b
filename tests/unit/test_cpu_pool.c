/* SPDX-License-Identifier: Apache-2.0 */
/* cpu_pool: every item runs exactly once, chunks are contiguous and never
 * empty, the pool is reusable, concurrent callers are never wait for each other (a
 * short run beside a long one finishes long before it), and (under TSan)
 * race-free. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>

#include "check.h"
#include "cpu/pool.h"

typedef struct count_arg {
  unsigned char *hits; /* each item written by exactly one chunk */
  _Atomic size_t chunks;
  _Atomic int empty_chunks;
} count_arg;

static void mark(void *p, size_t begin, size_t end) {
  count_arg *a = p;
  if (begin >= end) atomic_fetch_add(&a->empty_chunks, 1);
  for (size_t i = begin; i < end; i++) a->hits[i]++;
  atomic_fetch_add(&a->chunks, 1);
}

static void run_and_check(cpu_pool *pool, size_t n) {
  count_arg a = {calloc(n ? n : 1, 1), 0, 0};
  CHECK(a.hits);
  mok__cpu_pool_run(pool, n, mark, &a);
  for (size_t i = 0; i < n; i++)
    CHECK_MSG(a.hits[i] == 1, "item %zu of %zu ran %d times", i, n, a.hits[i]);
  CHECK_EQ_INT(atomic_load(&a.empty_chunks), 0);
  /* at least one chunk per thread that had an item; slices may add more */
  size_t least = n < (size_t)mok__cpu_pool_threads(pool) ? n : (size_t)mok__cpu_pool_threads(pool);
  CHECK(atomic_load(&a.chunks) >= (n > 1 ? least : n));
  CHECK(atomic_load(&a.chunks) <= n);
  free(a.hits);
}

static void test_items_run_once(void) {
  for (int threads = 1; threads <= 5; threads++) {
    cpu_pool *pool = NULL;
    CHECK_EQ_INT(mok__cpu_pool_create(threads, &pool), 0);
    CHECK_EQ_INT(mok__cpu_pool_threads(pool), threads);
    const size_t sizes[] = {0, 1, 2, 3, 4, 5, 7, 64, 1000, 4099};
    for (int rep = 0; rep < 50; rep++)
      for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) run_and_check(pool, sizes[i]);
    mok__cpu_pool_destroy(pool);
  }
}

static void test_default_threads(void) {
  cpu_pool *pool = NULL;
  CHECK_EQ_INT(mok__cpu_pool_create(0, &pool), 0);
  CHECK(mok__cpu_pool_threads(pool) >= 1);
  run_and_check(pool, 100);
  mok__cpu_pool_destroy(pool);
  mok__cpu_pool_destroy(NULL);
  CHECK(mok__cpu_pool_create(-1, &pool) != 0);
  CHECK(pool == NULL);
}

/* Results written by workers are visible to the caller after run returns. */
typedef struct sum_arg {
  const uint32_t *in;
  uint64_t *partial; /* one per item block */
} sum_arg;

static void sum_blocks(void *p, size_t b0, size_t b1) {
  sum_arg *a = p;
  for (size_t b = b0; b < b1; b++) {
    uint64_t s = 0;
    for (size_t i = 0; i < 256; i++) s += a->in[b * 256 + i];
    a->partial[b] = s;
  }
}

static void test_results_visible(void) {
  cpu_pool *pool = NULL;
  CHECK_EQ_INT(mok__cpu_pool_create(3, &pool), 0);
  enum { BLOCKS = 97 };
  uint32_t *in = malloc(BLOCKS * 256 * sizeof *in);
  uint64_t *partial = malloc(BLOCKS * sizeof *partial);
  CHECK(in && partial);
  for (int iter = 0; iter < 200; iter++) {
    uint64_t want = 0;
    for (size_t i = 0; i < BLOCKS * 256; i++)
      want += in[i] = (uint32_t)(i * 2654435761u + (size_t)iter);
    sum_arg a = {in, partial};
    mok__cpu_pool_run(pool, BLOCKS, sum_blocks, &a);
    uint64_t got = 0;
    for (int b = 0; b < BLOCKS; b++) got += partial[b];
    CHECK(got == want);
  }
  free(in);
  free(partial);
  mok__cpu_pool_destroy(pool);
}

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Items that each take about 1 ms, marking themselves. */
typedef struct slow_arg {
  unsigned char *hits;
  _Atomic size_t done;
} slow_arg;

static void slow_items(void *p, size_t begin, size_t end) {
  slow_arg *a = p;
  for (size_t i = begin; i < end; i++) {
    uint64_t t = now_ns();
    while (now_ns() - t < 1000000ull) {}
    a->hits[i]++;
    atomic_fetch_add(&a->done, 1);
  }
}

typedef struct caller {
  cpu_pool *pool;
  size_t n;
  slow_arg a;
  uint64_t ns; /* how long its run took */
} caller;

static void *caller_main(void *p) {
  caller *c = p;
  uint64_t t = now_ns();
  mok__cpu_pool_run(c->pool, c->n, slow_items, &c->a);
  c->ns = now_ns() - t;
  return NULL;
}

/* A long run (1200 items of 1 ms on 2 threads: ~0.6 s) and, once it is under
 * way, a short one (8 items): every item of both runs exactly once, and the
 * short run ends within a few slices, not after the long one. */
static void test_concurrent_callers(void) {
  cpu_pool *pool = NULL;
  CHECK_EQ_INT(mok__cpu_pool_create(2, &pool), 0);
  caller big = {pool, 1200, {calloc(1200, 1), 0}, 0};
  caller small = {pool, 8, {calloc(8, 1), 0}, 0};
  CHECK(big.a.hits && small.a.hits);
  pthread_t tb, ts;
  CHECK(pthread_create(&tb, NULL, caller_main, &big) == 0);
  while (atomic_load(&big.a.done) < 100) {} /* well into its run, slices grown */
  CHECK(pthread_create(&ts, NULL, caller_main, &small) == 0);
  pthread_join(ts, NULL);
  size_t big_done_when_small_ended = atomic_load(&big.a.done);
  pthread_join(tb, NULL);
  for (size_t i = 0; i < big.n; i++) CHECK_MSG(big.a.hits[i] == 1, "big item %zu", i);
  for (size_t i = 0; i < small.n; i++) CHECK_MSG(small.a.hits[i] == 1, "small item %zu", i);
  printf("  short run beside a long one: %.1f ms (the long one: %.1f ms, %zu of its %zu items "
         "done when the short one ended)\n",
         (double)small.ns / 1e6, (double)big.ns / 1e6, big_done_when_small_ended, big.n);
  /* alone the short run takes ~4 ms; beside the long one it runs on its own
   * thread while the long one has the workers. Waiting for the long run it
   * would end after it: it must end while most of that is still to do (a
   * bound that holds on a loaded or sanitized machine too). */
  CHECK_MSG(big_done_when_small_ended < big.n / 2,
            "the short run ended only after %zu of the long run's %zu items (%.1f ms)",
            big_done_when_small_ended, big.n, (double)small.ns / 1e6);
  free(big.a.hits);
  free(small.a.hits);
  mok__cpu_pool_destroy(pool);
}

static const check_case cases[] = {
    CHECK_CASE(test_concurrent_callers),
    CHECK_CASE(test_items_run_once),
    CHECK_CASE(test_default_threads),
    CHECK_CASE(test_results_visible),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
