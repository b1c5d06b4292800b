/* SPDX-License-Identifier: Apache-2.0 */
/* Where a GEMM tile lies in the routed buffer, and the order in which the
 * persistent kernel walks its tiles; one copy for both GEMM kernels.
 *
 * Row modes cut the routed buffer into blocks of MOK_TILE_M rows. Groups
 * (experts) start at multiples of MOK_TILE_M (the row_align), so a block
 * belongs to one expert, found from the schedule's offsets on the device.
 * Everything read from a schedule is clamped, so an unchecked one still
 * keeps every index in bounds (its results are then garbage, never an
 * out-of-bounds access). */
#ifndef MOK_COMMON_TILE_LOCATOR_CUH
#define MOK_COMMON_TILE_LOCATOR_CUH

#include <stdint.h>

/* The GEMM M tile; the schedule's row_align (mok_k_row_align). */
#define MOK_TILE_M 128

/* Largest e in [0, n) with offsets[e] <= r (offsets non-decreasing when
 * valid; any array gives an in-range answer). */
__device__ static inline int find_group(const int32_t *offsets, int n, int r) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

/* A block of rows [row0, row0 + MOK_TILE_M): rows [row0, store_end) are
 * written, [row0, used_end) hold real rows (the rest get zeros). e = -1:
 * past the last group (zeros only; nothing at all with no_tail). */
typedef struct mok_row_block {
  int e, row0, used_end, store_end;
} mok_row_block;

/* offsets == NULL: one group of M rows. */
__device__ static inline mok_row_block mok_locate_rows(const int32_t *offsets,
                                                       const int32_t *counts, int E_loc, int M,
                                                       int row0) {
  mok_row_block b;
  b.row0 = row0;
  b.e = 0;
  if (!offsets) {
    b.used_end = b.store_end = min(row0 + MOK_TILE_M, M);
    return b;
  }
  const int rows_used = min(max(offsets[E_loc], 0), M);
  if (row0 >= rows_used) {
    b.e = -1;
    b.used_end = row0;
    b.store_end = min(row0 + MOK_TILE_M, M);
    return b;
  }
  b.e = find_group(offsets, E_loc, row0);
  const int group_end = min(max(offsets[b.e + 1], row0), M);
  b.store_end = min(row0 + MOK_TILE_M, group_end);
  const long long used = (long long)offsets[b.e] + max(counts[b.e], 0);
  b.used_end = (int)min(max(used, (long long)row0), (long long)b.store_end);
  return b;
}

/* WGRAD: the rows [*begin, *end) of group e in a buffer of `rows` rows
 * (offsets == NULL: all of them). */
__device__ static inline void mok_group_rows(const int32_t *offsets, const int32_t *counts, int e,
                                             int rows, int *begin, int *end) {
  if (!offsets) {
    *begin = 0;
    *end = rows;
    return;
  }
  const int off = min(max(offsets[e], 0), rows);
  *begin = off;
  *end = off + min(max(counts[e], 0), rows - off);
}

/* ---- the persistent kernel's tile order ---------------------------------------
 *
 * Row-mode tile t of m_tiles x n_tiles (row block mb, column tile nb); the
 * order decides which tiles run at the same time, so which A rows and B
 * (weight) tiles they share in L2. Results never depend on it. */
enum mok_tile_order {
  MOK_ORDER_ROWS = 0,   /* row block by row block (band > 0: bands of `band`
                           row blocks, column tiles outer within a band) */
  MOK_ORDER_EXPERT = 1, /* expert by expert; within one, column tile outer and
                           its row blocks inner: one weight tile is read by all
                           of the expert's row blocks back to back */
};

__device__ static inline void mok_tile_at(int t, int order, int band, int m_tiles, int n_tiles,
                                          const int32_t *offsets, int E_loc, int M, int *mb,
                                          int *nb) {
  if (order == MOK_ORDER_EXPERT && offsets) {
    const int blk = t / n_tiles;
    const int rows_used = min(max(offsets[E_loc], 0), M);
    if (blk * MOK_TILE_M < rows_used) {
      const int e = find_group(offsets, E_loc, blk * MOK_TILE_M);
      const int b0 = min(max(offsets[e], 0) / MOK_TILE_M, blk);
      const int b1 = min(max((min(offsets[e + 1], rows_used) + MOK_TILE_M - 1) / MOK_TILE_M,
                             blk + 1),
                         m_tiles);
      const int nblk = b1 - b0, idx = t - b0 * n_tiles;
      *nb = min(idx / nblk, n_tiles - 1);
      *mb = b0 + idx % nblk;
      return;
    } /* past the last group: row-major */
  } else if (band > 0) { /* the CTAs at work share fewer A and B tiles (L2) */
    const int per = band * n_tiles, b = t / per, idx = t - b * per;
    const int bm = min(band, m_tiles - b * band);
    *nb = idx / bm;
    *mb = b * band + (idx - *nb * bm);
    return;
  }
  *mb = t / n_tiles;
  *nb = t - *mb * n_tiles;
}

#endif /* MOK_COMMON_TILE_LOCATOR_CUH */
