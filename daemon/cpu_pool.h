/* cpu_pool: a small fixed pool of worker threads for data-parallel loops.
 *
 * cpu_pool_run() splits the items [0, n) into one contiguous chunk per
 * thread (the calling thread takes the first chunk), runs fn on each chunk
 * and returns when all chunks are done. Which thread runs which chunk never
 * changes what a chunk computes, so callers that give every output element
 * one owner with a fixed summation order get the same bits at any thread
 * count.
 *
 * One pool serves one caller at a time (the engine thread); concurrent
 * cpu_pool_run() calls on the same pool are serialised. fn must not call
 * cpu_pool_run() on the same pool.
 */
#ifndef MOK_CPU_POOL_H
#define MOK_CPU_POOL_H

#include <stddef.h>

typedef struct cpu_pool cpu_pool;

typedef void (*cpu_pool_fn)(void *arg, size_t begin, size_t end);

/* threads: total threads including the caller; 0 = one per online core.
 * Returns 0 or an errno value (EINVAL for threads < 0). */
int cpu_pool_create(int threads, cpu_pool **ret_pool);

/* Stops and joins the workers; accepts NULL. */
void cpu_pool_destroy(cpu_pool *pool);

/* Number of threads that share the work (including the caller). */
int cpu_pool_threads(const cpu_pool *pool);

/* Runs fn over [0, n_items) in contiguous chunks and waits for all of them.
 * Chunks are never empty; with n_items == 0 fn is not called. */
void cpu_pool_run(cpu_pool *pool, size_t n_items, cpu_pool_fn fn, void *arg);

#endif /* MOK_CPU_POOL_H */
