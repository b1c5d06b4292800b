/* SPDX-License-Identifier: Apache-2.0 */
/* A per-tile timeline of a persistent GEMM kernel, for measurement builds
 * only (nvcc -DMOK_TILE_TRACE=1; every stamp compiles to nothing otherwise).
 *
 * Each CTA owns one row of the trace buffer: a header of MOK_TRACE_STAMPS
 * words (its %globaltimer and clock64 at the start and at the end, so the
 * host can turn cycles into ns), then MOK_TRACE_STAMPS clock64 stamps for
 * each of its first `tiles` tiles, the i-th tile it did not skip. Which
 * thread writes which stamp is the kernel's business (tile_trace_stamp);
 * clock64 is one SM's clock, so stamps of one CTA compare, stamps of two
 * CTAs do not. */
#ifndef MOK_COMMON_TILE_TRACE_CUH
#define MOK_COMMON_TILE_TRACE_CUH

#include <stdint.h>

#ifndef MOK_TILE_TRACE
#define MOK_TILE_TRACE 0
#endif

#define MOK_TRACE_STAMPS 8
/* header words */
#define MOK_TRACE_GT_START 0
#define MOK_TRACE_CLK_START 1
#define MOK_TRACE_GT_END 2
#define MOK_TRACE_CLK_END 3
#define MOK_TRACE_TILES 4

#if MOK_TILE_TRACE
__device__ unsigned long long *mok_trace_buf; /* NULL: no trace */
__device__ int mok_trace_tiles;               /* tiles a CTA row holds */

__device__ static inline unsigned long long *tile_trace_row(void) {
  if (!mok_trace_buf) return nullptr;
  return mok_trace_buf + (size_t)blockIdx.x * MOK_TRACE_STAMPS * (1 + (size_t)mok_trace_tiles);
}

__device__ static inline unsigned long long tile_trace_globaltimer(void) {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* stamp j of the CTA's i-th tile (i < 0: header word j) */
__device__ static inline void tile_trace_stamp(int i, int j) {
  const unsigned long long now = (unsigned long long)clock64(); /* before the row's loads */
  unsigned long long *row = tile_trace_row();
  if (!row || i >= mok_trace_tiles) return;
  if (i < 0) row[j] = now;
  else row[MOK_TRACE_STAMPS * (1 + (size_t)i) + j] = now;
}

/* the header's start (first == true) or end words, and the tile count */
__device__ static inline void tile_trace_edge(bool first, int tiles) {
  unsigned long long *row = tile_trace_row();
  if (!row) return;
  row[first ? MOK_TRACE_GT_START : MOK_TRACE_GT_END] = tile_trace_globaltimer();
  row[first ? MOK_TRACE_CLK_START : MOK_TRACE_CLK_END] = (unsigned long long)clock64();
  if (!first) row[MOK_TRACE_TILES] = (unsigned long long)tiles;
}
#else
__device__ static inline void tile_trace_stamp(int, int) {}
__device__ static inline void tile_trace_edge(bool, int) {}
#endif

#endif /* MOK_COMMON_TILE_TRACE_CUH */
