/* cpu_pool: every item runs exactly once, chunks are contiguous and never
 * empty, the pool is reusable, and (under TSan) race-free. */
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "cpu_pool.h"

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
  cpu_pool_run(pool, n, mark, &a);
  for (size_t i = 0; i < n; i++)
    CHECK_MSG(a.hits[i] == 1, "item %zu of %zu ran %d times", i, n, a.hits[i]);
  CHECK_EQ_INT(atomic_load(&a.empty_chunks), 0);
  size_t want = n < (size_t)cpu_pool_threads(pool) ? n : (size_t)cpu_pool_threads(pool);
  CHECK_EQ_INT(atomic_load(&a.chunks), want);
  free(a.hits);
}

static void test_items_run_once(void) {
  for (int threads = 1; threads <= 5; threads++) {
    cpu_pool *pool = NULL;
    CHECK_EQ_INT(cpu_pool_create(threads, &pool), 0);
    CHECK_EQ_INT(cpu_pool_threads(pool), threads);
    const size_t sizes[] = {0, 1, 2, 3, 4, 5, 7, 64, 1000, 4099};
    for (int rep = 0; rep < 50; rep++)
      for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) run_and_check(pool, sizes[i]);
    cpu_pool_destroy(pool);
  }
}

static void test_default_threads(void) {
  cpu_pool *pool = NULL;
  CHECK_EQ_INT(cpu_pool_create(0, &pool), 0);
  CHECK(cpu_pool_threads(pool) >= 1);
  run_and_check(pool, 100);
  cpu_pool_destroy(pool);
  cpu_pool_destroy(NULL);
  CHECK(cpu_pool_create(-1, &pool) != 0);
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
  CHECK_EQ_INT(cpu_pool_create(3, &pool), 0);
  enum { BLOCKS = 97 };
  uint32_t *in = malloc(BLOCKS * 256 * sizeof *in);
  uint64_t *partial = malloc(BLOCKS * sizeof *partial);
  CHECK(in && partial);
  for (int iter = 0; iter < 200; iter++) {
    uint64_t want = 0;
    for (size_t i = 0; i < BLOCKS * 256; i++)
      want += in[i] = (uint32_t)(i * 2654435761u + (size_t)iter);
    sum_arg a = {in, partial};
    cpu_pool_run(pool, BLOCKS, sum_blocks, &a);
    uint64_t got = 0;
    for (int b = 0; b < BLOCKS; b++) got += partial[b];
    CHECK(got == want);
  }
  free(in);
  free(partial);
  cpu_pool_destroy(pool);
}

static const check_case cases[] = {
    CHECK_CASE(test_items_run_once),
    CHECK_CASE(test_default_threads),
    CHECK_CASE(test_results_visible),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
