/* SPDX-License-Identifier: Apache-2.0 */
/* cpu_pool: a small fixed pool of worker threads for data-parallel loops.
 *
 * mok__cpu_pool_run() runs fn over the items [0, n) in contiguous chunks, one
 * per thread (the calling thread takes the first chunk), and returns when
 * all are done. Items are independent: which thread runs which chunk, and
 * how the range is cut, never changes what an item computes, so callers
 * that give every output element one owner with a fixed summation order
 * get the same bits at any thread count.
 *
 * Several threads may call mok__cpu_pool_run() at once (the jobs of different
 * sessions). The range runs in slices sized to take about
 * CPU_POOL_SLICE_NS; one caller at a time has the workers for a slice, and
 * a caller that finds them taken runs its slice on its own thread. No
 * caller ever waits for another's run, however large (mokd: a tenant's
 * huge job cannot hold up another tenant's small one); the cores are
 * shared by the kernel's scheduler among the threads that run. A caller
 * alone takes ever larger slices and pays almost nothing for them.
 * fn must not call mok__cpu_pool_run() on the same pool.
 */
#ifndef MOK_CPU_POOL_H
#define MOK_CPU_POOL_H

#include <stddef.h>

typedef struct cpu_pool cpu_pool;

typedef void (*cpu_pool_fn)(void *arg, size_t begin, size_t end);

#define CPU_POOL_SLICE_NS 2000000ull /* how long a caller holds the workers at a time */

/* threads: total threads including the caller; 0 = one per online core.
 * Returns 0 or an errno value (EINVAL for threads < 0). */
int mok__cpu_pool_create(int threads, cpu_pool **ret_pool);

/* Stops and joins the workers; accepts NULL. */
void mok__cpu_pool_destroy(cpu_pool *pool);

/* Number of threads that share the work (including the caller). */
int mok__cpu_pool_threads(const cpu_pool *pool);

/* Runs fn over [0, n_items) in contiguous chunks and waits for all of them.
 * Chunks are never empty and never overlap; every item runs exactly once;
 * with n_items == 0 fn is not called. */
void mok__cpu_pool_run(cpu_pool *pool, size_t n_items, cpu_pool_fn fn, void *arg);

#endif /* MOK_CPU_POOL_H */
