/* SPDX-License-Identifier: Apache-2.0 */
/* The grouped GEMMs on Hopper (sm_90a): TMA + wgmma, warp specialised,
 * persistent. The five products of common/gemm_params.cuh, forward (v1)
 * and backward (v2), from the parameters mok_gemm.cu builds for both
 * backends; B multicast in 2-CTA clusters (v3, a variant).
 *
 * One CTA per SM (384 threads): warpgroup 0 is the producer (one thread
 * issues TMA loads of 128x64 A and 256x64 B tiles into a 4-stage ring,
 * completion on "full" mbarriers); warpgroups 1 and 2 are consumers, each
 * owning 64 rows of the 128x256 output tile (wgmma m64n256k16, f32
 * accumulators in registers), releasing stages on "empty" mbarriers.
 * GATE_UP's 256 B rows are 128 gate rows then 128 up rows of the same
 * intermediate columns, so silu(g)*u is thread-local in the epilogue.
 * An operand stored MN-major (M or N contiguous) is loaded as boxes of 64
 * MN elements x 64 k rows and read with the wgmma transpose bit.
 *
 * Row modes: every 128-row block of the routed buffer times every column
 * tile, walked by CTA c as c, c+G, c+2G, ... in the order of
 * common/tile_locator.cuh (row blocks, bands, or expert by expert); a
 * block's expert comes from the schedule's offsets on the device, exactly
 * as the mma.sync kernel finds it. Blocks past the last group and padding
 * rows are written as zeros; a consumer whose 64 rows are all padding
 * skips its wgmmas.
 * WGRAD: every (expert, M tile, N tile), each reducing over all the
 * expert's rows in ascending 64-row blocks (the rows past the expert's
 * count in the last block are zeroed in shared memory, as the mma.sync
 * kernel zero-fills them): no split-K, no atomics. Its tiles have short k
 * loops, so its epilogue goes through shared memory and TMA stores that
 * overlap the next tile (3 stages to make room).
 *
 * Cluster variant (GATE_UP, DOWN, GU_DGRAD): CTAs run in pairs (a 2-CTA cluster) on the
 * row blocks 2p and 2p+1 of the same column tile. When both blocks belong
 * to one expert, each CTA loads its own A tile and half of the B (weight)
 * tile, multicast into both CTAs' rings, so B is read from L2 once for two
 * row blocks; otherwise each loads its own B. A consumer releases a stage
 * in both CTAs (either producer may write it next), so the two rings move
 * in lockstep: every pair runs the full k loop in both CTAs, whatever its
 * rows. Every decision a pair must agree on comes from one copy of the
 * schedule's offsets that the first CTA takes and the second reads from it
 * (a client that rewrites its schedule while the kernel runs gets garbage
 * rows, never a CTA waiting on a peer that decided otherwise).
 *
 * Each output element is computed by one CTA with K in ascending k16 steps
 * at the same positions as the mma.sync kernel's (plus steps over zeros),
 * and every epilogue repeats the mma.sync epilogue's arithmetic
 * (common/swiglu.cuh), so results equal that kernel's bit for bit, do not
 * depend on the grid size, the tile order or the variant, and a row's
 * result depends only on its own input row.
 *
 * GATE_UP in the cluster variant can read A's rows from x itself (the
 * producer gathers them with cp.async; mok_k_sm90_set_gather_a, off by
 * default: measured slower than the routed copy, kernels/PERF.md).
 *
 * Bench knobs (mok_k_sm90_set_tuning; defaults measured best or equal, see
 * kernels/PERF.md v1): a pipelined consumer loop (one wgmma batch in
 * flight; forward only, not clustered), banded tile order, L2 eviction
 * hints on the TMA loads.
 */
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "common/gemm_params.cuh"
#include "common/ptx_sm90.cuh"
#include "common/swiglu.cuh"
#include "common/tile_locator.cuh"
#include "common/tile_trace.cuh"
#include "cutlass_gemm/launch.h"
#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"

#define S9_BM MOK_TILE_M
#define S9_BN 256 /* B rows per tile (GATE_UP: 128 gate + 128 up) */
#define S9_BK 64  /* one 128-byte swizzle row of bf16 */
#define S9_STAGES 4
#define S9_THREADS 384
#define S9_CONSUMER_WARPS 8
#define S9_A_BYTES (S9_BM * S9_BK * 2)
#define S9_B_BYTES (S9_BN * S9_BK * 2)
#define S9_STAGE_BYTES (S9_A_BYTES + S9_B_BYTES)
/* WGRAD: 3 stages and a 64x256 bf16 staging tile per consumer warpgroup
 * for the TMA-store epilogue (its short k loops leave the epilogue exposed) */
#define S9_STAGES_W 3
#define S9_STAGE_OUT (64 * S9_BN * 2)
#define S9_NST(MODE) ((MODE) == MOK_GM_WGRAD ? S9_STAGES_W : S9_STAGES)
/* WGRAD's copy of the schedule's offsets and counts, after its ring's
 * barriers: the consumers' lookup at each tile start is then a shared-memory
 * read, not an L2 round trip while the tensor cores wait (its tiles are
 * short: 4-8 k blocks at T=2048) */
#define S9_W_TABLE_AT (S9_STAGES_W * S9_STAGE_BYTES + 2 * S9_STAGE_OUT + 2 * S9_STAGES_W * 8)
#define S9_W_TABLE_INTS 2048
#define S9_SMEM_BYTES (S9_W_TABLE_AT + 4 * S9_W_TABLE_INTS + 1024)
/* Ping-pong kernel (the down dgrad): 128x128 tiles, one consumer
 * warpgroup a tile, a 6-stage ring of A 128x64 + B 64x128. */
#define S9P_BN 128
#define S9P_STAGES 6
#define S9P_STAGE_BYTES (S9_A_BYTES + S9P_BN * S9_BK * 2)
/* row modes: the schedule's offsets, then its counts, after the ring's
 * barriers of either kernel (one copy per CTA, taken at the start: see s9_sched) */
#define S9_RING_END(stages, bytes) ((stages) * (bytes) + 2 * (stages) * 8)
/* the ping-pong kernel's ring, then its two turn barriers */
#define S9P_BARS_END (S9_RING_END(S9P_STAGES, S9P_STAGE_BYTES) + 2 * 8)
#define S9_TABLE_AT                                                \
  (S9_RING_END(S9_STAGES, S9_STAGE_BYTES) > S9P_BARS_END           \
       ? S9_RING_END(S9_STAGES, S9_STAGE_BYTES)                    \
       : S9P_BARS_END)
#define S9_TABLE_INTS ((S9_SMEM_BYTES - 1024 - S9_TABLE_AT) / 4)
static_assert(S9_TABLE_INTS >= 2 * 1023 + 1, "room for the offsets and counts of 1023 experts");
/* the table holds a schedule of E_loc groups */
#define S9_TABLE_FITS(E_loc) (2 * (long long)(E_loc) + 1 <= S9_TABLE_INTS)
static_assert(S9_W_TABLE_INTS >= 2 * 1023 + 1, "WGRAD: room for the offsets and counts of 1023 experts");
static_assert(S9_SMEM_BYTES <= 227 * 1024, "one CTA's shared memory on sm_90");

#define S9_SLAB 8192 /* one MN-major box: 64 k rows of 128 B */
#define S9_HALF_B (S9_B_BYTES / 2)

/* Operand layouts per mode: A M-major only in WGRAD; B N-major in backward. */
#define S9_TA(MODE) ((MODE) == MOK_GM_WGRAD ? 1 : 0)
#define S9_TB(MODE) ((MODE) >= MOK_GM_DOWN_DGRAD ? 1 : 0)
/* The cluster variant's modes. Not WGRAD (its tiles reduce over one
 * expert's rows, not row blocks) nor DOWN_DGRAD (its SwiGLU-backward
 * epilogue, which dominates that mode, leaves no registers for the pair's
 * bookkeeping: ptxas spills). */
#define S9_PAIRS_MODE(MODE) \
  ((MODE) == MOK_GM_GATE_UP || (MODE) == MOK_GM_DOWN || (MODE) == MOK_GM_GU_DGRAD)

typedef mok_gemm_params s9_params;

/* ---- the device-side tile scheduler ------------------------------------------- */

/* Rows [row0, store_end) of the tile are written; [row0, used_end) hold real
 * rows. e = -1: past the last group (zeros only). in_use: the block lies
 * within the groups (from the offsets alone; the producer loads it).
 * WGRAD: row0 is the output row, [k_begin, k_end) the expert's rows. */
typedef struct s9_tile {
  int e, row0, used_end, store_end, n0;
  int k_begin, k_end;
  int in_use;
  int skip; /* nothing to load or store (no_tail past the end; WGRAD outside e_range) */
} s9_tile;

/* The schedule a kernel places its tiles by: the CTA's copy of
 * the offsets and counts in shared memory (s9_sched_copy), or the global
 * arrays when they do not fit; offsets NULL for one group. Producer and
 * consumers read the same copy, so they agree on every tile even if the
 * global arrays change while the kernel runs, and the consumers' lookup
 * at the start of each tile (a binary search: ~9 dependent loads) costs
 * shared-memory latency, not L2 latency, while the tensor cores wait. */
typedef struct s9_sched {
  const int32_t *offsets, *counts;
} s9_sched;

__device__ static inline s9_sched s9_sched_global(const s9_params &p) {
  s9_sched sc;
  sc.offsets = p.offsets;
  sc.counts = p.counts;
  return sc;
}

/* Every thread of the CTA (or of rank 0, for a cluster) takes part; the
 * caller synchronises before the table is read. */
__device__ static inline s9_sched s9_sched_copy(const s9_params &p, int32_t *table, bool copy,
                                                int table_ints = S9_TABLE_INTS) {
  if (!p.offsets || 2 * (long long)p.E_loc + 1 > table_ints) return s9_sched_global(p);
  if (copy) {
    for (int i = threadIdx.x; i <= p.E_loc; i += blockDim.x) table[i] = p.offsets[i];
    for (int i = threadIdx.x; i < p.E_loc; i += blockDim.x) table[p.E_loc + 1 + i] = p.counts[i];
  }
  s9_sched sc;
  sc.offsets = table;
  sc.counts = table + p.E_loc + 1;
  return sc;
}

/* WGRAD tile t: expert-major, then M tiles, then N tiles. */
__device__ static inline s9_tile s9_locate_w(const s9_params &p, const s9_sched &sc, int t) {
  s9_tile tl;
  const int per = p.m_tiles * p.n_tiles;
  tl.e = t / per;
  const int idx = t - tl.e * per, mb = idx / p.n_tiles;
  tl.row0 = mb * S9_BM;
  tl.n0 = (idx - mb * p.n_tiles) * p.tile_n;
  tl.used_end = tl.store_end = min(tl.row0 + S9_BM, p.M);
  tl.in_use = 1;
  tl.skip = p.e_range && (tl.e < p.e_range[0] || tl.e >= p.e_range[1]);
  mok_group_rows(sc.offsets, sc.counts, tl.e, p.K, &tl.k_begin, &tl.k_end);
  return tl;
}

/* Row block mb, column tile nb. */
__device__ static inline s9_tile s9_tile_rows(const s9_params &p, const s9_sched &sc, int mb,
                                              int nb) {
  s9_tile tl;
  const mok_row_block b = mok_locate_rows(sc.offsets, sc.counts, p.E_loc, p.M, mb * S9_BM);
  tl.e = b.e;
  tl.row0 = b.row0;
  tl.used_end = b.used_end;
  tl.store_end = b.store_end;
  tl.n0 = nb * p.tile_n;
  tl.k_begin = tl.k_end = 0;
  tl.in_use = b.e >= 0 && b.row0 < p.M;
  tl.skip = b.e < 0 && p.no_tail;
  return tl;
}

__device__ static inline s9_tile s9_locate(const s9_params &p, const s9_sched &sc, int t) {
  int mb, nb;
  mok_tile_at(t, p.order, p.band, p.m_tiles, p.n_tiles, sc.offsets, p.E_loc, p.M, &mb, &nb);
  return s9_tile_rows(p, sc, mb, nb);
}

/* k blocks of every row-mode tile */
template <int MODE> __device__ static inline int s9_full_nk(const s9_params &p) {
  return MODE == MOK_GM_GU_DGRAD ? 2 * p.nk_split : (p.K + S9_BK - 1) / S9_BK;
}

/* k blocks of a tile (0: nothing to load, zeros are written) */
template <int MODE> __device__ static inline int s9_tile_nk(const s9_params &p, const s9_tile &tl) {
  if (MODE == MOK_GM_WGRAD) return (tl.k_end - tl.k_begin + S9_BK - 1) / S9_BK;
  return tl.used_end > tl.row0 ? s9_full_nk<MODE>(p) : 0;
}

/* Cluster pair q: row blocks 2*(q / n_tiles) + {0, 1}, column tile
 * q % n_tiles; `mine` is this CTA's (rank's) block. Both CTAs compute the
 * same pair from the same offsets. */
typedef struct s9_pair {
  s9_tile mine;
  int multicast; /* both blocks in one expert: B shared */
  int skip;      /* neither block has anything to store */
} s9_pair;

__device__ static inline s9_pair s9_locate_pair(const s9_params &p, const s9_sched &sc, int q,
                                                int rank) {
  const int pp = q / p.n_tiles, nb = q - pp * p.n_tiles;
  const s9_tile t0 = s9_tile_rows(p, sc, 2 * pp, nb);
  const s9_tile t1 = s9_tile_rows(p, sc, 2 * pp + 1, nb);
  s9_pair r;
  r.mine = rank ? t1 : t0;
  r.multicast = t0.in_use && t1.in_use && t0.e == t1.e;
  r.skip = t0.skip && t1.skip;
  return r;
}

/* ---- producer: one thread streams A and B tiles into the ring ----------------- */

/* 64-column boxes of an N-major B operand, 64 k rows each, one slab per 64
 * output columns; boxes wholly past column N are not loaded (the slab's
 * stale columns reach only output columns that are never stored). */
__device__ static inline int s9_b_slabs(int N, int n0) { return min(S9_BN / 64, (N - n0 + 63) / 64); }

/* Slabs [j0, j1) of an N-major B tile; cta_mask != 0: multicast to it. */
__device__ static inline void s9_load_b_mn(uint32_t sb, const CUtensorMap *m, int n0, int k, int e,
                                           int rank, int j0, int j1, uint32_t full, uint64_t pol,
                                           uint16_t cta_mask) {
#pragma unroll
  for (int j = 0; j < S9_BN / 64; j++) {
    if (j < j0 || j >= j1) continue;
    if (cta_mask)
      tma_load_3d_mc(sb + j * S9_SLAB, m, n0 + 64 * j, k, e, full, cta_mask, pol);
    else if (rank == 3)
      tma_load_3d_hint(sb + j * S9_SLAB, m, n0 + 64 * j, k, e, full, pol);
    else
      tma_load_2d_hint(sb + j * S9_SLAB, m, n0 + 64 * j, k, full, pol);
  }
}

/* One k block of a row-mode tile into stage (sa, sb): A, then the B halves
 * [h0, h1) of 2 (K-major: the 128-row boxes; N-major: slabs 0-1, 2-3),
 * multicast to cta_mask when it is nonzero. b_box: rows of mb0's boxes
 * (DOWN: 256 in one box or 128 in two). */
template <int MODE>
__device__ static inline void s9_load_rows(const s9_params &p, const s9_tile &tl, int kb,
                                           const CUtensorMap *ma, const CUtensorMap *ma2,
                                           const CUtensorMap *mb0, const CUtensorMap *mb1,
                                           uint32_t sa, uint32_t full, uint64_t pa, uint64_t pb,
                                           int h0, int h1, uint16_t cta_mask, int b_box) {
  const uint32_t sb = sa + S9_A_BYTES;
  const int e = tl.e;
  if (MODE == MOK_GM_GATE_UP) { /* half 0: the gate rows, half 1: the up rows */
    tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
    for (int h = h0; h < h1; h++) {
      const CUtensorMap *m = h ? mb1 : mb0;
      if (cta_mask)
        tma_load_3d_mc(sb + h * S9_HALF_B, m, kb * S9_BK, tl.n0, e, full, cta_mask, pb);
      else
        tma_load_3d_hint(sb + h * S9_HALF_B, m, kb * S9_BK, tl.n0, e, full, pb);
    }
  } else if (MODE == MOK_GM_DOWN) {
    tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
    if (b_box == S9_BN) {
      tma_load_3d_hint(sb, mb0, kb * S9_BK, tl.n0, e, full, pb);
    } else {
      for (int h = h0; h < h1; h++) {
        if (cta_mask)
          tma_load_3d_mc(sb + h * S9_HALF_B, mb0, kb * S9_BK, tl.n0 + 128 * h, e, full, cta_mask,
                         pb);
        else
          tma_load_3d_hint(sb + h * S9_HALF_B, mb0, kb * S9_BK, tl.n0 + 128 * h, e, full, pb);
      }
    }
  } else {
    const int slabs = s9_b_slabs(p.N, tl.n0);
    const int j0 = 2 * h0, j1 = min(2 * h1, slabs);
    if (MODE == MOK_GM_DOWN_DGRAD) {
      tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
      s9_load_b_mn(sb, mb0, tl.n0, kb * S9_BK, e, 3, j0, j1, full, pb, cta_mask);
    } else { /* GU_DGRAD, k < I: dg with W_g, then du with W_u */
      const bool up = kb >= p.nk_split;
      const int k = (up ? kb - p.nk_split : kb) * S9_BK;
      tma_load_2d_hint(sa, up ? ma2 : ma, k, tl.row0, full, pa);
      s9_load_b_mn(sb, up ? mb1 : mb0, tl.n0, k, e, 3, j0, j1, full, pb, cta_mask);
    }
  }
}

/* the bytes one k block of a row-mode tile delivers into a stage */
template <int MODE> __device__ static inline uint32_t s9_row_bytes(const s9_params &p, const s9_tile &tl) {
  if (MODE == MOK_GM_GATE_UP || MODE == MOK_GM_DOWN) return S9_STAGE_BYTES;
  return S9_A_BYTES + s9_b_slabs(p.N, tl.n0) * S9_SLAB; /* whole boxes, OOB parts zero-filled */
}

template <int MODE>
__device__ static void s9_produce(const s9_params &p, const s9_sched &sc, const CUtensorMap *ma,
                                  const CUtensorMap *ma2, const CUtensorMap *mb0,
                                  const CUtensorMap *mb1, uint32_t base, uint32_t bars) {
  const int total = MODE == MOK_GM_WGRAD ? p.groups * p.m_tiles * p.n_tiles : p.m_tiles * p.n_tiles;
  const uint64_t pa = l2_policy(p.pol_a), pb = l2_policy(p.pol_b);
  constexpr int NST = S9_NST(MODE);
  int s = 0, ph = 0, ti = 0; /* ti: tiles done (the trace's index) */
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const s9_tile tl = MODE == MOK_GM_WGRAD ? s9_locate_w(p, sc, t) : s9_locate(p, sc, t);
    if (tl.skip) continue; /* the consumers skip it too */
    tile_trace_stamp(ti, 5);
    const int nk = s9_tile_nk<MODE>(p, tl);
    for (int kb = 0; kb < nk; kb++) { /* nk = 0: zeros only, the consumers need no data */
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (NST + s);
      const uint32_t sa = base + s * S9_STAGE_BYTES, sb = sa + S9_A_BYTES;
      mbar_wait(empty, ph ^ 1); /* the consumers released this stage */
      if (kb == 0) tile_trace_stamp(ti, 6);
      if (MODE == MOK_GM_WGRAD) { /* A M-major, two 64-row slabs (the second when its rows exist) */
        const int slabs = s9_b_slabs(p.N, tl.n0);
        mbar_arrive_expect_tx(full, (tl.row0 + 64 < p.M ? 2 : 1) * S9_SLAB + slabs * S9_SLAB);
        const int k = tl.k_begin + kb * S9_BK;
        tma_load_2d_hint(sa, ma, tl.row0, k, full, pa);
        if (tl.row0 + 64 < p.M) tma_load_2d_hint(sa + S9_SLAB, ma, tl.row0 + 64, k, full, pa);
        s9_load_b_mn(sb, mb0, tl.n0, k, 0, 2, 0, slabs, full, pb, 0);
      } else {
        mbar_arrive_expect_tx(full, s9_row_bytes<MODE>(p, tl));
        s9_load_rows<MODE>(p, tl, kb, ma, ma2, mb0, mb1, sa, full, pa, pb, 0, 2, 0, S9_BN);
      }
      if (++s == NST) {
        s = 0;
        ph ^= 1;
      }
    }
    tile_trace_stamp(ti++, 7);
  }
}

/* ---- quad variant: 2x2 clusters (GATE_UP, DOWN, GU_DGRAD) ------------------------
 *
 * Four CTAs on two row blocks (mi = 0, 1) times two column tiles (ni = 0,
 * 1); rank = 2 * ni + mi. The two CTAs of a row block share its A tile:
 * each loads the 64 rows of half ni, multicast into both (A is read once
 * for two column tiles, whatever the experts). The two CTAs of a column
 * tile share B as the pairs kernel's do, when both row blocks belong to one
 * expert. A CTA pulls 8 KB of A and 16 KB of B from L2 a k block, against
 * 16 + 16 in pairs. The four rings move in lockstep (a stage is released to
 * all four producers; every quad runs the full k loop in every CTA), and
 * every decision comes from rank 0's copy of the schedule. Column tiles
 * come in pairs: the launcher takes quads only for an even count. */

/* Quad qd: row blocks 2 * (qd / (n_tiles / 2)) + {0, 1}, column tiles
 * 2 * (qd % (n_tiles / 2)) + {0, 1}. */
__device__ static inline s9_pair s9_locate_quad(const s9_params &p, const s9_sched &sc, int qd,
                                                int rank) {
  const int nq = p.n_tiles / 2, pp = qd / nq, np = qd - pp * nq;
  const int mi = rank & 1, ni = rank >> 1;
  const s9_tile t0 = s9_tile_rows(p, sc, 2 * pp, 2 * np + ni);
  const s9_tile t1 = s9_tile_rows(p, sc, 2 * pp + 1, 2 * np + ni);
  s9_pair r;
  r.mine = mi ? t1 : t0;
  r.multicast = t0.in_use && t1.in_use && t0.e == t1.e;
  r.skip = t0.skip && t1.skip;
  return r;
}

/* One k block of a quad's tile: this CTA's half of A (rows 64 * ni ..) to
 * both CTAs of its row block (a_mask), then B: half mi to both CTAs of its
 * column tile (b_mask) when they share an expert, else all of it here. */
template <int MODE>
__device__ static inline void s9_load_quad(const s9_params &p, const s9_tile &tl, int kb,
                                           const CUtensorMap *ma, const CUtensorMap *ma2,
                                           const CUtensorMap *mb0, const CUtensorMap *mb1,
                                           uint32_t sa, uint32_t full, uint64_t pa, uint64_t pb,
                                           int mi, int ni, bool multicast) {
  const uint16_t a_mask = (uint16_t)((1u << mi) | (1u << (2 + mi)));
  const uint16_t b_mask = (uint16_t)(3u << (2 * ni));
  const uint32_t sb = sa + S9_A_BYTES;
  const int h0 = multicast ? mi : 0, h1 = multicast ? mi + 1 : 2;
  const uint16_t bm = multicast ? b_mask : 0;
  const int e = tl.e;
  if (MODE == MOK_GM_GU_DGRAD) { /* k < I: dg with W_g, then du with W_u */
    const bool up = kb >= p.nk_split;
    const int k = (up ? kb - p.nk_split : kb) * S9_BK;
    tma_load_2d_mc(sa + ni * 64 * 128, up ? ma2 : ma, k, tl.row0 + 64 * ni, full, a_mask, pa);
    const int slabs = s9_b_slabs(p.N, tl.n0);
    s9_load_b_mn(sb, up ? mb1 : mb0, tl.n0, k, e, 3, 2 * h0, min(2 * h1, slabs), full, pb, bm);
    return;
  }
  tma_load_2d_mc(sa + ni * 64 * 128, ma, kb * S9_BK, tl.row0 + 64 * ni, full, a_mask, pa);
  for (int h = h0; h < h1; h++) { /* GATE_UP: half 0 gate, 1 up; DOWN: columns 128 * h .. */
    const CUtensorMap *m = MODE == MOK_GM_GATE_UP && h ? mb1 : mb0;
    const int n = MODE == MOK_GM_GATE_UP ? tl.n0 : tl.n0 + 128 * h;
    if (bm)
      tma_load_3d_mc(sb + h * S9_HALF_B, m, kb * S9_BK, n, e, full, bm, pb);
    else
      tma_load_3d_hint(sb + h * S9_HALF_B, m, kb * S9_BK, n, e, full, pb);
  }
}

template <int CN>
__device__ static inline s9_pair s9_locate_unit(const s9_params &p, const s9_sched &sc, int q,
                                                int rank) {
  return CN == 4 ? s9_locate_quad(p, sc, q, rank) : s9_locate_pair(p, sc, q, rank);
}

/* The cluster kernels' tiles: CN = 2, pairs of row blocks (s9_locate_pair);
 * CN = 4, 2x2 quads (s9_locate_quad). */
template <int CN> __device__ static inline int s9_cluster_units(const s9_params &p) {
  return CN == 4 ? (p.m_tiles + 1) / 2 * (p.n_tiles / 2) : (p.m_tiles + 1) / 2 * p.n_tiles;
}

/* The cluster variants' producer: unit by unit (a pair, or a quad with
 * CN = 4), every unit the full k loop. A stage is written only after every
 * CTA's consumers have released it (the empty barrier counts them all). */
template <int MODE, int CN>
__device__ static void s9_produce_pairs(const s9_params &p, const s9_sched &sc,
                                        const CUtensorMap *ma, const CUtensorMap *ma2,
                                        const CUtensorMap *mb0, const CUtensorMap *mb1,
                                        uint32_t base, uint32_t bars, int rank) {
  const int units = s9_cluster_units<CN>(p), clusters = gridDim.x / CN;
  const uint64_t pa = l2_policy(p.pol_a), pb = l2_policy(p.pol_b);
  const int nk = s9_full_nk<MODE>(p);
  int s = 0, ph = 0;
  for (int q = blockIdx.x / CN; q < units; q += clusters) {
    const s9_pair pr = s9_locate_unit<CN>(p, sc, q, rank);
    if (pr.skip) continue; /* the others skip it too */
    const s9_tile &tl = pr.mine;
    for (int kb = 0; kb < nk; kb++) {
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (S9_STAGES + s);
      const uint32_t sa = base + s * S9_STAGE_BYTES;
      mbar_wait(empty, ph ^ 1);
      if (!tl.in_use) { /* nothing to compute: the consumers only follow the ring */
        mbar_arrive_if(full, true);
      } else if (CN == 4) { /* a row block in use: both its CTAs load and expect all */
        mbar_arrive_expect_tx(full, s9_row_bytes<MODE>(p, tl));
        s9_load_quad<MODE>(p, tl, kb, ma, ma2, mb0, mb1, sa, full, pa, pb, rank & 1, rank >> 1,
                           pr.multicast);
      } else if (pr.multicast) { /* own A, own half of B to both; the peer sends the other half */
        mbar_arrive_expect_tx(full, s9_row_bytes<MODE>(p, tl));
        s9_load_rows<MODE>(p, tl, kb, ma, ma2, mb0, mb1, sa, full, pa, pb, rank, rank + 1, 3, 128);
      } else {
        mbar_arrive_expect_tx(full, s9_row_bytes<MODE>(p, tl));
        s9_load_rows<MODE>(p, tl, kb, ma, ma2, mb0, mb1, sa, full, pa, pb, 0, 2, 0, 128);
      }
      if (++s == S9_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

/* ---- consumers: wgmma over the ring, then the epilogue ------------------------ */

/* DOWN_DGRAD: a = acc; SwiGLU backward as the mma.sync kernel (dg|du to C0
 * with ldc = 2N, h to C1); the d_rw partial of each 128-column half equals
 * that kernel's: per thread over its columns (8-column groups ascending,
 * the pair's two in order), then the quad ((q0+q1)+(q2+q3)), then its four
 * 32-column warp slices in order. The thread holds all four slices here.
 * The saved g and u are loaded S9_DG_BATCH column pairs at once before
 * any of their stores: loads placed after a store the compiler cannot prove
 * apart wait for each other, and 32 such rounds of memory latency a tile
 * left the tensor cores idle. Same arithmetic, same order. The ping-pong
 * kernel runs the same code on its m64n128 accumulators. */
#ifndef S9_DG_BATCH
#define S9_DG_BATCH 8 /* column pairs of g and u loaded at once (4, 8 or 16: registers) */
#endif
/* The router weights of a thread's two rows (rbase, rbase + 8): both
 * loads in flight together (two rounds of latency, not four). */
__device__ static inline void s9_dgrad_weights(const s9_params &p, const s9_tile &tl, int rbase,
                                               float (&wt)[2]) {
  int slot[2] = {-1, -1};
#pragma unroll
  for (int hh = 0; hh < 2; hh++)
    if (p.rw && rbase + 8 * hh < tl.used_end) slot[hh] = p.row_slot[rbase + 8 * hh];
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    wt[hh] = 1.0f;
    if (rbase + 8 * hh < tl.used_end && p.rw)
      wt[hh] = (slot[hh] >= 0 && slot[hh] < p.n_slots) ? p.rw[slot[hh]] : 0.0f;
  }
}

/* One row r's 128 columns from n0 (the thread's 16 column pairs) of the
 * down dgrad's epilogue: the SwiGLU backward of each element, dg, du and h
 * stored, the d_rw partial pt. The accumulators of column group j are
 * acc[4 * (jbase + j) + 2 * hh + c] (hh: which of the thread's two rows). */
template <int NACC>
__device__ __forceinline__ void s9_dgrad_half(const s9_params &p, const float (&acc)[NACC],
                                              int jbase, int hh, int r, bool stored, bool used,
                                              float w, int n0, int pt) {
  const int q = threadIdx.x & 3, cq = 2 * q;
  float v = 0.0f;
  __nv_bfloat162 gq[S9_DG_BATCH], uq[S9_DG_BATCH];
#pragma unroll
  for (int wn = 0; wn < 4; wn++) {
    if ((4 * wn) % S9_DG_BATCH == 0) /* the next S9_DG_BATCH column pairs, all in flight */
#pragma unroll
      for (int i = 0; i < S9_DG_BATCH; i++) {
        const int n = n0 + 8 * (4 * wn + i) + cq;
        gq[i] = uq[i] = __floats2bfloat162_rn(0.0f, 0.0f);
        if (used && stored && n < p.N) {
          const long long at = (long long)r * p.N + n;
          gq[i] = *(const __nv_bfloat162 *)(p.G + at);
          uq[i] = *(const __nv_bfloat162 *)(p.U + at);
        }
      }
    float rowsum = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
      const int jj = 4 * wn + j, n = n0 + 8 * jj + cq;
      if (!stored || n >= p.N) continue;
      const long long at = (long long)r * p.N + n;
      float dg[2] = {0.0f, 0.0f}, du[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
      if (used) {
        const float2 gp = __bfloat1622float2(gq[jj % S9_DG_BATCH]);
        const float2 up = __bfloat1622float2(uq[jj % S9_DG_BATCH]);
        const float gin[2] = {gp.x, gp.y}, uin[2] = {up.x, up.y};
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const float a = acc[4 * (jbase + jj) + 2 * hh + c];
          const swiglu_grad sg = swiglu_backward(gin[c], uin[c], a, w, p.has_limit, p.limit);
          hv[c] = sg.h;
          rowsum = __fadd_rn(rowsum, __fmul_rn(a, hv[c]));
          dg[c] = sg.dg;
          du[c] = sg.du;
        }
      }
      store_bf16x2(p.C0 + (long long)r * p.ldc + n, dg[0], dg[1]);
      store_bf16x2(p.C0 + (long long)r * p.ldc + p.N + n, du[0], du[1]);
      store_bf16x2(p.C1 + at, swiglu_h_weighted(hv[0], w), swiglu_h_weighted(hv[1], w));
    }
    /* every lane reaches the shuffles (skipped columns add nothing) */
    rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 1));
    rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 2));
    v = wn == 0 ? rowsum : __fadd_rn(v, rowsum);
  }
  if (p.partial && q == 0 && stored && pt < p.n_partial) p.partial[(long long)r * p.n_partial + pt] = v;
}

__device__ static inline void s9_epilogue_dgrad(const s9_params &p, const s9_tile &tl,
                                                const float (&acc)[128], int cw) {
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int rbase = tl.row0 + 64 * cw + 16 * warp + (lane >> 2);
  float wt[2];
  s9_dgrad_weights(p, tl, rbase, wt);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rbase + 8 * hh;
#pragma unroll
    for (int half = 0; half < 2; half++)
      s9_dgrad_half(p, acc, 16 * half, hh, r, r < tl.store_end, r < tl.used_end, wt[hh],
                    tl.n0 + 128 * half, 2 * (tl.n0 / S9_BN) + half);
  }
}

/* Accumulator register i of m64n256 holds row 16*warp + lane/4 + 8*((i>>1)&1),
 * column 8*(i>>2) + 2*(lane%4) + (i&1) of the warpgroup's 64x256 block.
 * have: the tile's accumulators were computed (else zeros are written). */
template <int MODE>
__device__ static inline void s9_epilogue(const s9_params &p, const s9_tile &tl, const float (&acc)[128],
                                          int cw, bool have) {
  if (MODE == MOK_GM_DOWN_DGRAD) {
    s9_epilogue_dgrad(p, tl, acc, cw);
    return;
  }
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int rbase = tl.row0 + 64 * cw + 16 * warp + (lane >> 2), cq = 2 * (lane & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rbase + 8 * hh;
    if (r >= tl.store_end) continue;
    const bool used = r < tl.used_end && have;
    if (MODE == MOK_GM_WGRAD) { /* output row r of expert e's gradient */
      const long long cb = (long long)tl.e * p.c_expert_stride;
      bf16 *row = r < p.c_split ? p.C0 + cb + (long long)r * p.ldc
                                : p.C1 + cb + (long long)(r - p.c_split) * p.ldc;
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        store_bf16x2(row + n, used ? acc[4 * j + 2 * hh] : 0.0f, used ? acc[4 * j + 2 * hh + 1] : 0.0f);
      }
      continue;
    }
    const long long row = (long long)r * p.ldc;
    if (MODE == MOK_GM_GATE_UP) {
#pragma unroll
      for (int j = 0; j < 16; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        float gv[2] = {0.0f, 0.0f}, uv[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
        if (used)
#pragma unroll
          for (int c = 0; c < 2; c++)
            swiglu_forward(acc[4 * j + 2 * hh + c], acc[64 + 4 * j + 2 * hh + c], p.has_limit,
                           p.limit, &gv[c], &uv[c], &hv[c]);
        store_bf16x2(p.C0 + row + n, gv[0], gv[1]);
        store_bf16x2(p.C1 + row + n, uv[0], uv[1]);
        store_bf16x2(p.C2 + row + n, hv[0], hv[1]);
      }
    } else { /* DOWN, GU_DGRAD */
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        store_bf16x2(p.C0 + row + n, used ? acc[4 * j + 2 * hh] : 0.0f,
                     used ? acc[4 * j + 2 * hh + 1] : 0.0f);
      }
    }
  }
}

/* WGRAD epilogue through shared memory and TMA stores: the warpgroup's
 * 64x256 block as bf16 (the same roundings as the direct stores) in four
 * 64x64 boxes with the 128-byte swizzle, stored while the next tile's
 * wgmmas run (the tile's k loop is short: a direct store would leave the
 * tensor cores idle). Rows past M and columns past N are clipped by TMA. A
 * block straddling c_split is stored directly. so: the staging tile. */
__device__ static inline void s9_epilogue_wstore(const s9_params &p, const s9_tile &tl,
                                                 const float (&acc)[128], int cw, bool have,
                                                 uint32_t so, const CUtensorMap *mc0,
                                                 const CUtensorMap *mc1) {
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int r0 = tl.row0 + 64 * cw;
  if (r0 >= p.M) return; /* uniform over the warpgroup */
  const bool to0 = r0 < p.c_split, to1 = r0 + 64 > p.c_split;
  if (!p.wstore || (to0 && to1)) {
    s9_epilogue<MOK_GM_WGRAD>(p, tl, acc, cw, have);
    return;
  }
  if (lt == 0) bulk_wait_read0(); /* the previous store has read the staging tile */
  named_bar_sync(2 + cw, 128);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = 16 * warp + (lane >> 2) + 8 * hh;
    const uint32_t rowa = so + r * 128 + 4 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 32; j++) {
      __nv_bfloat162 v = __floats2bfloat162_rn(have ? acc[4 * j + 2 * hh] : 0.0f,
                                               have ? acc[4 * j + 2 * hh + 1] : 0.0f);
      /* box j/8, 16-byte chunk j%8 swizzled by the row within its 8-row group */
      st_shared_u32(rowa + (j >> 3) * S9_SLAB + (((j & 7) ^ (r & 7)) << 4), *(uint32_t *)&v);
    }
  }
  fence_proxy_async_smem();
  named_bar_sync(2 + cw, 128);
  if (lt == 0) {
    const int slabs = s9_b_slabs(p.N, tl.n0);
    for (int j = 0; j < slabs; j++)
      tma_store_3d(to0 ? mc0 : mc1, so + j * S9_SLAB, tl.n0 + 64 * j, to0 ? r0 : r0 - p.c_split,
                   tl.e);
    bulk_commit();
  }
}

/* WGRAD, last k block: the expert's rows end at row kv of the block. The
 * rows after it (padding rows, which may hold anything) are zeroed in this
 * warpgroup's A slab and half of the B slabs, as the mma.sync kernel
 * zero-fills them; both consumer warpgroups then meet before any wgmma
 * reads the stage. */
__device__ static inline void s9_zero_tail(uint32_t sa, int cw, int kv) {
  const int lt = threadIdx.x & 127, per = (S9_BK - kv) * 8; /* 16-byte chunks a slab */
  const uint32_t sb = sa + S9_A_BYTES;
  for (int i = lt; i < 3 * per; i += 128) {
    const int sl = i / per, c = i - sl * per;
    const uint32_t slab = sl == 0 ? sa + cw * S9_SLAB : sb + (2 * cw + sl - 1) * S9_SLAB;
    st_shared_zero16(slab + kv * 128 + c * 16); /* whole 128-byte rows: swizzle-proof */
  }
  fence_proxy_async_smem();
  named_bar_sync(1, 256);
}

/* A consumer warp's release of ring stage `bar` (one arrival a warp) in
 * every CTA of its cluster of CL (1: this CTA alone): any of their
 * producers may write the stage next. */
template <int CL> __device__ static inline void s9_release(uint32_t bar, bool lead) {
  if (CL > 1) {
#pragma unroll
    for (int r = 0; r < CL; r++) mbar_arrive_cluster_if(bar, (uint32_t)r, lead);
  } else {
    mbar_arrive_if(bar, lead);
  }
}

/* The consumer warpgroup's k loop over one tile. PIPE = 1 keeps one wgmma
 * batch in flight and releases the previous stage once it is known
 * complete; PIPE = 0 waits for each batch. s, ph: the ring position.
 * kv: valid k rows of the last block (WGRAD; 64 when whole). GATHER: A was
 * written by the producers' cp.async (generic proxy), so each thread
 * fences before its wgmmas (async proxy) read the stage. */
template <int MODE, int PIPE, int CL, int GATHER = 0>
__device__ static inline void s9_mma_loop(const s9_params &p, float (&acc)[128], uint32_t base,
                                          uint32_t bars, int cw, int nk, int kv, int &s, int &ph) {
  constexpr int TA = S9_TA(MODE), TB = S9_TB(MODE), NST = S9_NST(MODE);
  /* k16 step in the descriptor's address field (16 B units): K-major +32 B,
   * MN-major +16 rows of 128 B */
  constexpr int step_a = TA ? 128 : 2, step_b = TB ? 128 : 2;
  const bool lead = (threadIdx.x & 31) == 0; /* one arrival per warp */
  int prev = -1;
  /* Accumulate onto +0 as mma.sync does (not scale_d = 0): the sum is then
   * never -0, so the extra k16 steps over zeros (K tails past mma.sync's
   * 32-wide blocks) leave it unchanged bit for bit. */
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    if (GATHER) fence_proxy_async_smem();
    const uint32_t sa = base + s * S9_STAGE_BYTES;
    if (MODE == MOK_GM_WGRAD && kv < S9_BK && kb == nk - 1) s9_zero_tail(sa, cw, kv);
    const uint64_t da = TA ? wgmma_desc_mn128(sa + cw * S9_SLAB)
                           : wgmma_desc_k128(sa + cw * 64 * 128);
    const uint64_t db = TB ? wgmma_desc_mn128(sa + S9_A_BYTES)
                           : wgmma_desc_k128(sa + S9_A_BYTES);
    acc_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < S9_BK / 16; k++)
      wgmma_m64n256k16<TA, TB>(acc, da + step_a * k, db + step_b * k, 1);
    wgmma_commit();
    if (PIPE) {
      wgmma_wait<1>();
      acc_fence(acc);
      s9_release<CL>(bars + 8 * (NST + prev), lead && prev >= 0);
      prev = s;
    } else {
      wgmma_wait<0>();
      acc_fence(acc);
      s9_release<CL>(bars + 8 * (NST + s), lead);
    }
    if (++s == NST) {
      s = 0;
      ph ^= 1;
    }
  }
  if (PIPE) {
    wgmma_wait<0>();
    acc_fence(acc);
    s9_release<CL>(bars + 8 * (NST + prev), lead && prev >= 0);
  }
}

/* A warpgroup with nothing to compute: follow the ring of NST stages, no
 * math (row modes: S9_STAGES; the ping-pong kernel: S9P_STAGES). */
template <int CL, int NST = S9_STAGES>
__device__ static inline void s9_skip_loop(uint32_t bars, int nk, int &s, int &ph) {
  const bool lead = (threadIdx.x & 31) == 0;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    s9_release<CL>(bars + 8 * (NST + s), lead);
    if (++s == NST) {
      s = 0;
      ph ^= 1;
    }
  }
}

template <int MODE, int PIPE>
__device__ static void s9_consume(const s9_params &p, const s9_sched &sc, uint32_t base,
                                  uint32_t bars, const CUtensorMap *mc0, const CUtensorMap *mc1) {
  const int cw = threadIdx.x / 128 - 1; /* rows 64*cw .. of the tile */
  const int total = MODE == MOK_GM_WGRAD ? p.groups * p.m_tiles * p.n_tiles : p.m_tiles * p.n_tiles;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  int s = 0, ph = 0, ti = 0;
  /* the trace: consumer thread 0 stamps 0-4 of each tile, the producer 5-7 */
  const bool stamps = MOK_TILE_TRACE && threadIdx.x == 128;
  if (stamps) tile_trace_edge(true, 0);
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    if (stamps) tile_trace_stamp(ti, 0);
    const s9_tile tl = MODE == MOK_GM_WGRAD ? s9_locate_w(p, sc, t) : s9_locate(p, sc, t);
    if (tl.skip) continue; /* as the producer */
    const int nk = s9_tile_nk<MODE>(p, tl);
    if (stamps) {
      tile_trace_stamp(ti, 1);
      if (nk > 0) mbar_wait(bars + 8 * s, ph); /* the first block's data: the k loop's first wait */
      tile_trace_stamp(ti, 2);
    }
    if (MODE == MOK_GM_WGRAD) { /* both warpgroups take every block (s9_zero_tail meets them) */
      const int kv = tl.k_end - tl.k_begin - (nk - 1) * S9_BK;
      s9_mma_loop<MODE, PIPE, 1>(p, acc, base, bars, cw, nk, kv, s, ph);
    } else if (nk > 0) {
      if (tl.row0 + 64 * cw < tl.used_end)
        s9_mma_loop<MODE, PIPE, 1>(p, acc, base, bars, cw, nk, S9_BK, s, ph);
      else /* all padding: the epilogue writes zeros */
        s9_skip_loop<1>(bars, nk, s, ph);
    }
    if (stamps) tile_trace_stamp(ti, 3);
    if (MODE == MOK_GM_WGRAD)
      s9_epilogue_wstore(p, tl, acc, cw, nk > 0, base + S9_STAGES_W * S9_STAGE_BYTES + cw * S9_STAGE_OUT,
                         mc0, mc1);
    else
      s9_epilogue<MODE>(p, tl, acc, cw, nk > 0);
    if (stamps) tile_trace_stamp(ti, 4);
    ti++;
  }
  if (stamps) tile_trace_edge(false, ti);
  if (MODE == MOK_GM_WGRAD && (threadIdx.x & 127) == 0) bulk_wait0(); /* before the CTA's smem goes */
}

/* GATE_UP in 2-CTA clusters with A's rows gathered by the producer
 * (p.a_x): all 128 producer threads copy the stage's 128 rows x 64
 * columns of A from x with cp.async, 16 bytes a copy, into the layout a
 * TMA box with the 128-byte swizzle gives (row r at 128 r, its 16-byte
 * chunk c at (c ^ (r & 7)) 16), each thread announcing its copies on the
 * stage's full barrier when they land (noinc: the barrier expects 1 + 128
 * arrivals); one thread also loads the B tile by TMA as s9_produce_pairs
 * does, in turn from each warp (the copies of the warp that issues it
 * start later; kernels/PERF.md measured the turn 5 % faster).
 * Thread t copies chunk t % 8 of rows t / 8 + 16 i (i < 8): it looks up
 * its rows' tokens once a unit, in the schedule's validated row -> slot
 * map, and keeps a pointer per row. The copies are on the critical path
 * (their instructions measured: each one fewer is time), so a block of
 * whole rows inside K takes one plain cp.async a row from those pointers;
 * only a tile with rows past the block's real rows or slots out of range,
 * and the block past K, take the zero-filling copy. */
__device__ static void s9_produce_pairs_gather(const s9_params &p, const s9_sched &sc,
                                               const CUtensorMap *mb0, const CUtensorMap *mb1,
                                               uint32_t base, uint32_t bars, int rank) {
  const int units = s9_cluster_units<2>(p), clusters = gridDim.x / 2;
  const uint64_t pb = l2_policy(p.pol_b);
  const int nk = s9_full_nk<MOK_GM_GATE_UP>(p);
  const int t = (int)threadIdx.x, c = t & 7, r0 = t >> 3;
  const uint32_t dst0 = (uint32_t)(r0 * 128 + ((c ^ (r0 & 7)) << 4));
  const int vecs = p.K / 8;             /* 16-byte vectors a row of x (the launcher checks K % 8) */
  const int nk_whole = p.K / S9_BK;     /* blocks with all 64 columns inside K */
  const uint4 *x = (const uint4 *)p.a_x;
  int s = 0, ph = 0;
  for (int q = blockIdx.x / 2; q < units; q += clusters) {
    const s9_pair pr = s9_locate_pair(p, sc, q, rank);
    if (pr.skip) continue; /* the others skip it too */
    const s9_tile &tl = pr.mine;
    const uint4 *src[8]; /* chunk c of each of this thread's rows in x; NULL: zeros */
    bool all_real = true;
#pragma unroll
    for (int i = 0; i < 8; i++) {
      const int r = tl.row0 + r0 + 16 * i;
      const int slot = tl.in_use && r < tl.used_end ? __ldg(p.row_slot + r) : -1;
      const bool real = slot >= 0 && slot < p.n_slots;
      src[i] = real ? x + (size_t)(slot / p.a_k) * vecs + c : nullptr;
      all_real = all_real && real;
    }
    for (int kb = 0; kb < nk; kb++) {
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (S9_STAGES + s);
      const uint32_t sa = base + s * S9_STAGE_BYTES, sb = sa + S9_A_BYTES;
      mbar_wait(empty, ph ^ 1);
      if (t == 32 * (kb & 3)) {
        if (!tl.in_use) { /* nothing to compute: the consumers only follow the ring */
          mbar_arrive_if(full, true);
        } else {
          mbar_arrive_expect_tx(full, S9_B_BYTES);
          /* multicast: own half of B to both CTAs, the peer sends the other */
          const int h0 = pr.multicast ? rank : 0, h1 = pr.multicast ? rank + 1 : 2;
          for (int h = h0; h < h1; h++) {
            const CUtensorMap *m = h ? mb1 : mb0;
            if (pr.multicast)
              tma_load_3d_mc(sb + h * S9_HALF_B, m, kb * S9_BK, tl.n0, tl.e, full, 3, pb);
            else
              tma_load_3d_hint(sb + h * S9_HALF_B, m, kb * S9_BK, tl.n0, tl.e, full, pb);
          }
        }
      }
      if (tl.in_use) {
        const int kv = kb * (S9_BK / 8); /* this block's first vector in a row */
        if (all_real && kb < nk_whole) {
#pragma unroll
          for (int i = 0; i < 8; i++) cp_async16(sa + dst0 + 2048u * i, src[i] + kv);
        } else {
          const bool col = kv + c < vecs;
#pragma unroll
          for (int i = 0; i < 8; i++) {
            const bool real = col && src[i];
            cp_async16_zfill(sa + dst0 + 2048u * i, real ? src[i] + kv : x, real ? 16u : 0u);
          }
        }
      }
      cp_async_mbar_arrive_noinc(full);
      if (++s == S9_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

/* The cluster variants' consumers: the producer's units, the full k loop
 * each (math only where this CTA's block has rows). */
template <int MODE, int PIPE, int CN, int GATHER = 0>
__device__ static void s9_consume_pairs(const s9_params &p, const s9_sched &sc, uint32_t base,
                                        uint32_t bars, int rank) {
  const int cw = threadIdx.x / 128 - 1;
  const int units = s9_cluster_units<CN>(p), clusters = gridDim.x / CN;
  const int nk = s9_full_nk<MODE>(p);
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  int s = 0, ph = 0;
  for (int q = blockIdx.x / CN; q < units; q += clusters) {
    s9_tile tl;
    {
      const s9_pair pr = s9_locate_unit<CN>(p, sc, q, rank);
      if (pr.skip) continue;
      tl = pr.mine;
    }
    const bool have = tl.in_use && tl.used_end > tl.row0;
    if (have && tl.row0 + 64 * cw < tl.used_end)
      s9_mma_loop<MODE, PIPE, CN, GATHER>(p, acc, base, bars, cw, nk, S9_BK, s, ph);
    else
      s9_skip_loop<CN>(bars, nk, s, ph);
    if (!tl.skip) s9_epilogue<MODE>(p, tl, acc, cw, have);
  }
}

/* ---- the gather beside the product -------------------------------------------
 *
 * Warps 1-3 of the producer warpgroup have nothing to do in any of these
 * kernels. Given p.gather_dst they copy routed rows (gather_rows's result:
 * the row of the slot's token, or zeros) while the product keeps the tensor
 * cores busy, so the copy's memory traffic overlaps compute instead of
 * taking a kernel of its own. Rows are dealt warp by warp over the grid;
 * each lane keeps LOADS 16-byte loads in flight (within the warpgroup's
 * 40 registers). The rows it writes are read by no product of this launch;
 * the backward's later kernels see them by stream order. Measured against
 * the gather kernel and each host: kernels/PERF.md, "v4 step 8". */
#define S9_GATHER_WARPS 3
/* 16-byte loads a lane keeps in flight: 4, or 2 in WGRAD, whose producer
 * would spill with 4 */
#define S9_GATHER_LOADS(MODE) ((MODE) == MOK_GM_WGRAD ? 2 : 4)
template <int LOADS> __device__ static inline void s9_gather_beside(const s9_params &p) {
  const int warp = (int)(threadIdx.x >> 5) - 1, lane = (int)(threadIdx.x & 31);
  if (!p.gather_dst || warp < 0 || warp >= S9_GATHER_WARPS) return;
  constexpr int CHUNK = 32 * LOADS; /* vectors a warp moves per step */
  const int vecs = p.gather_vecs, full = vecs - vecs % CHUNK;
  const int workers = (int)gridDim.x * S9_GATHER_WARPS;
  for (int r = p.gather_row0 + (int)blockIdx.x * S9_GATHER_WARPS + warp; r < p.gather_rows;
       r += workers) {
    const int s = __ldg(p.gather_row_slot + r);
    const bool used = s >= 0 && s < p.gather_slots;
    /* one address a lane, the loads at immediate offsets from it (the
     * warpgroup's 40 registers hold the loads in flight without spilling) */
    const uint4 *src = (const uint4 *)p.gather_src + (used ? (size_t)(s / p.gather_k) * vecs : 0) + lane;
    uint4 *dst = (uint4 *)p.gather_dst + (size_t)r * vecs + lane;
    int c = 0;
    for (; c < full; c += CHUNK) {
      uint4 v[LOADS];
#pragma unroll
      for (int j = 0; j < LOADS; j++)
        v[j] = used ? __ldg(src + c + 32 * j) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int j = 0; j < LOADS; j++) __stcs(dst + c + 32 * j, v[j]);
    }
    for (; c + lane < vecs; c += 32)
      __stcs(dst + c, used ? __ldg(src + c) : make_uint4(0, 0, 0, 0));
  }
}

template <int MODE, int PIPE>
__global__ void __launch_bounds__(S9_THREADS, 1)
    s9_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_a2,
                   const __grid_constant__ CUtensorMap map_b0,
                   const __grid_constant__ CUtensorMap map_b1, const s9_params p) {
  extern __shared__ __align__(1024) unsigned char s9_smem_raw[];
  __shared__ int s_failed;
  /* the 128-byte swizzle is computed from address bits: stages 1024-aligned */
  const uint32_t base = (smem_u32(s9_smem_raw) + 1023u) & ~1023u;
  constexpr int NST = S9_NST(MODE);
  /* the stages, WGRAD's staging tiles, then full[NST] and empty[NST] */
  const uint32_t bars = base + NST * S9_STAGE_BYTES + (MODE == MOK_GM_WGRAD ? 2 * S9_STAGE_OUT : 0);
  /* the schedule in shared memory: row modes after the 4-stage ring, WGRAD after its
   * staging tiles and barriers */
  int32_t *table = (int32_t *)(s9_smem_raw + (base - smem_u32(s9_smem_raw)) +
                               (MODE == MOK_GM_WGRAD ? S9_W_TABLE_AT : S9_TABLE_AT));
  const s9_sched sc = MODE == MOK_GM_WGRAD ? s9_sched_copy(p, table, true, S9_W_TABLE_INTS)
                                           : s9_sched_copy(p, table, true);
  if (threadIdx.x == 0) {
    s_failed = job_failed(p.status);
    if (!s_failed) {
      for (int i = 0; i < NST; i++) {
        mbar_init(bars + 8 * i, 1);
        mbar_init(bars + 8 * (NST + i), S9_CONSUMER_WARPS);
      }
      mbar_fence_init();
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b0);
      if (MODE == MOK_GM_GU_DGRAD || MODE == MOK_GM_WGRAD) tma_prefetch_map(&map_a2);
      if (MODE != MOK_GM_DOWN && MODE != MOK_GM_DOWN_DGRAD) tma_prefetch_map(&map_b1);
    }
  }
  __syncthreads();
  if (s_failed) return; /* one decision for the whole CTA */
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) s9_produce<MODE>(p, sc, &map_a, &map_a2, &map_b0, &map_b1, base, bars);
    else s9_gather_beside<S9_GATHER_LOADS(MODE)>(p);
  } else {
    regs_inc<232>();
    s9_consume<MODE, PIPE>(p, sc, base, bars, &map_a2, &map_b1);
  }
}

/* A cluster's start, after thread 0 of each CTA initialised its barriers
 * and rank 0's wrote *failed: rank 0 copies the schedule into its table,
 * every other rank copies rank 0's table and failure word (the launcher keeps
 * the schedule within the table, S9_TABLE_FITS), so both CTAs decide from
 * one reading. Every thread of both CTAs calls it. */
__device__ static inline s9_sched s9_cluster_sched(const s9_params &p, int32_t *table, int *failed,
                                                   int rank) {
  const int n_tab = p.offsets ? 2 * p.E_loc + 1 : 0;
  const s9_sched sc = s9_sched_copy(p, table, rank == 0);
  cluster_sync(); /* barriers ready in both CTAs; rank 0's copies written */
  if (rank != 0) {
    const uint32_t t0 = cluster_map(smem_u32(table), 0);
    for (int i = threadIdx.x; i < n_tab; i += blockDim.x)
      table[i] = (int32_t)ld_cluster_u32(t0 + 4u * (uint32_t)i);
    if (threadIdx.x == 0) *failed = (int)ld_cluster_u32(cluster_map(smem_u32(failed), 0));
  }
  cluster_sync(); /* the others done reading rank 0's shared memory */
  return sc;
}

/* The cluster variants (S9_PAIRS_MODE; launched with clusters of CN CTAs:
 * pairs, or quads with A in boxes of 64 rows). Every CTA takes every
 * decision from rank 0's reading: the job's status word and the schedule's
 * offsets and counts (copied into shared memory, the others copy rank 0's
 * table). */
template <int MODE, int PIPE, int CN, int GATHER = 0>
__global__ void __launch_bounds__(S9_THREADS, 1)
    s9_gemm_pairs_kernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_a2,
                         const __grid_constant__ CUtensorMap map_b0,
                         const __grid_constant__ CUtensorMap map_b1, const s9_params p) {
  extern __shared__ __align__(1024) unsigned char s9_smem_raw[];
  __shared__ int s_failed;
  const uint32_t base = (smem_u32(s9_smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + S9_STAGES * S9_STAGE_BYTES;
  int32_t *table = (int32_t *)(s9_smem_raw + (base - smem_u32(s9_smem_raw)) + S9_TABLE_AT);
  const int rank = (int)cluster_ctarank();
  if (threadIdx.x == 0) {
    for (int i = 0; i < S9_STAGES; i++) {
      mbar_init(bars + 8 * i, GATHER ? 1 + 128 : 1); /* GATHER: every producer thread's copies */
      mbar_init(bars + 8 * (S9_STAGES + i), CN * S9_CONSUMER_WARPS); /* every CTA's warps */
    }
    mbar_fence_init();
    if (rank == 0) s_failed = job_failed(p.status);
  }
  const s9_sched sc = s9_cluster_sched(p, table, &s_failed, rank);
  if (s_failed) return; /* the same value in every CTA */
  static_assert(!GATHER || (MODE == MOK_GM_GATE_UP && CN == 2 && PIPE == 0),
                "the gathering producer: GATE_UP in 2-CTA clusters");
  if (GATHER && threadIdx.x < 128) {
    regs_dec<56>(); /* the row lookups stay in registers (the consumers keep 224) */
    if (threadIdx.x == 0) {
      tma_prefetch_map(&map_b0);
      tma_prefetch_map(&map_b1);
    }
    s9_produce_pairs_gather(p, sc, &map_b0, &map_b1, base, bars, rank);
  } else if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b0);
      if (MODE == MOK_GM_GU_DGRAD) tma_prefetch_map(&map_a2);
      if (MODE == MOK_GM_GATE_UP || MODE == MOK_GM_GU_DGRAD) tma_prefetch_map(&map_b1);
      s9_produce_pairs<MODE, CN>(p, sc, &map_a, &map_a2, &map_b0, &map_b1, base, bars, rank);
    } else {
      s9_gather_beside<4>(p);
    }
  } else {
    if (GATHER)
      regs_inc<224>();
    else
      regs_inc<232>();
    s9_consume_pairs<MODE, PIPE, CN, GATHER>(p, sc, base, bars, rank);
  }
  /* no CTA leaves while another may still write into its shared memory or
   * arrive on its barriers */
  cluster_sync();
}

/* ---- ping-pong consumers: the down dgrad ---------------------------------------
 *
 * The down dgrad's epilogue (the SwiGLU backward of every element, the
 * saved g and u read, dg, du and h written, the d_rw partials) is as long
 * as a good part of its k loop, and with both consumer warpgroups on one
 * tile the tensor cores wait for all of it (v3: 39% busy). Here each
 * consumer warpgroup owns whole 128x128 tiles, the CTA's tiles taken in
 * turn (local tile i by warpgroup i % 2), so one warpgroup's epilogue runs
 * while the other's wgmmas do. The ring is in tile order, and the k loops
 * take turns on two mbarriers: a warpgroup starts waiting for its tile's
 * stages only once the other has waited for all of the tile before. That
 * is also what keeps the ring's parity waits sound: a warpgroup that
 * passed over the other's stages would otherwise wait for a stage many
 * phases ahead of the barrier and take an old phase of the same parity
 * for its own (a tile is ~18 laps of the ring). Each tile is two m64n128 halves (rows 0-63,
 * 64-127; a half of padding rows issues no wgmma). The products, the
 * epilogue's arithmetic and the d_rw partials' summation order are those
 * of the cooperative kernel (the partial of a 128-column tile is the
 * cooperative kernel's partial of that half), so results are bitwise equal
 * to it and to mma.sync. */

/* The ring position after n stages more. */
__device__ static inline void s9_ring_advance(int &s, int &ph, int n, int nst) {
  s += n;
  while (s >= nst) {
    s -= nst;
    ph ^= 1;
  }
}

/* bytes of one k block of a 128-column tile: A and the B slabs inside N */
__device__ static inline uint32_t s9p_row_bytes(const s9_params &p, const s9_tile &tl) {
  return S9_A_BYTES + min(S9P_BN / 64, (p.N - tl.n0 + 63) / 64) * S9_SLAB;
}

/* The ping-pong kernel's unit of work: one tile on plain CTAs (CN = 1), or
 * a pair of row blocks of one 128-column tile in a 2-CTA cluster (CN = 2):
 * the pairs of the forward GEMMs (s9_locate_pair), the weight slabs
 * multicast when both row blocks belong to one expert. */
template <int CN>
__device__ static inline s9_pair s9p_unit(const s9_params &p, const s9_sched &sc, int q, int rank) {
  if (CN == 2) return s9_locate_pair(p, sc, q, rank);
  s9_pair u;
  u.mine = s9_locate(p, sc, q);
  u.multicast = 0;
  u.skip = u.mine.skip;
  return u;
}

/* k blocks of a unit: a tile's own (zero when it has no rows); a pair runs
 * the full k loop in both CTAs, as in the pairs kernel */
template <int CN> __device__ static inline int s9p_unit_nk(const s9_params &p, const s9_tile &tl) {
  return CN == 2 ? s9_full_nk<MOK_GM_DOWN_DGRAD>(p) : s9_tile_nk<MOK_GM_DOWN_DGRAD>(p, tl);
}

template <int CN>
__device__ static void s9p_produce(const s9_params &p, const s9_sched &sc, const CUtensorMap *ma,
                                   const CUtensorMap *mb0, uint32_t base, uint32_t bars, int rank) {
  const int units = CN == 2 ? (p.m_tiles + 1) / 2 * p.n_tiles : p.m_tiles * p.n_tiles;
  const int clusters = gridDim.x / CN;
  const uint64_t pa = l2_policy(p.pol_a), pb = l2_policy(p.pol_b);
  int s = 0, ph = 0;
  for (int q = blockIdx.x / CN; q < units; q += clusters) {
    const s9_pair pr = s9p_unit<CN>(p, sc, q, rank);
    if (pr.skip) continue; /* the consumers (and a peer) skip it too */
    const s9_tile &tl = pr.mine;
    const int nk = s9p_unit_nk<CN>(p, tl);
    const int slabs = min(S9P_BN / 64, (p.N - tl.n0 + 63) / 64);
    for (int kb = 0; kb < nk; kb++) {
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (S9P_STAGES + s);
      const uint32_t sa = base + s * S9P_STAGE_BYTES, sb = sa + S9_A_BYTES;
      mbar_wait(empty, ph ^ 1);
      if (!tl.in_use) { /* a pair's block without rows: its consumers only follow the ring */
        mbar_arrive_if(full, true);
      } else {
        mbar_arrive_expect_tx(full, s9p_row_bytes(p, tl));
        tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
        if (pr.multicast) /* own slab to both CTAs; the peer sends the other */
          s9_load_b_mn(sb, mb0, tl.n0, kb * S9_BK, tl.e, 3, rank, min(rank + 1, slabs), full, pb, 3);
        else
          s9_load_b_mn(sb, mb0, tl.n0, kb * S9_BK, tl.e, 3, 0, slabs, full, pb, 0);
      }
      if (++s == S9P_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

/* One tile's k loop: the halves of rows 0-63 (acc0) and, with SECOND
 * (its rows 64-127 hold real rows), 64-127 (acc1), B shared. One k block's
 * wgmmas stay in flight while the next are issued (the stage before is
 * released once they are known complete): with one warpgroup issuing,
 * waiting for each batch would leave the tensor cores a gap every k block.
 * Accumulates onto +0 as the other loops. SECOND is a template argument:
 * a wgmma under a branch inside the loop makes ptxas serialise them all
 * (C7520). */
template <bool SECOND, int CL>
__device__ static inline void s9p_mma_loop(float (&acc0)[64], float (&acc1)[64], uint32_t base,
                                           uint32_t bars, int nk, int &s, int &ph) {
  const bool lead = (threadIdx.x & 31) == 0;
  int prev = -1;
#pragma unroll
  for (int i = 0; i < 64; i++) acc0[i] = acc1[i] = 0.0f;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    const uint32_t sa = base + s * S9P_STAGE_BYTES;
    const uint64_t da0 = wgmma_desc_k128(sa), da1 = wgmma_desc_k128(sa + 64 * 128);
    const uint64_t db = wgmma_desc_mn128(sa + S9_A_BYTES);
    acc_fence(acc0);
    acc_fence(acc1);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < S9_BK / 16; k++) {
      wgmma_m64n128k16<0, 1>(acc0, da0 + 2 * k, db + 128 * k, 1);
      if (SECOND) wgmma_m64n128k16<0, 1>(acc1, da1 + 2 * k, db + 128 * k, 1);
    }
    wgmma_commit();
    wgmma_wait<1>();
    acc_fence(acc0);
    acc_fence(acc1);
    s9_release<CL>(bars + 8 * (S9P_STAGES + prev), lead && prev >= 0);
    prev = s;
    if (++s == S9P_STAGES) {
      s = 0;
      ph ^= 1;
    }
  }
  wgmma_wait<0>();
  acc_fence(acc0);
  acc_fence(acc1);
  s9_release<CL>(bars + 8 * (S9P_STAGES + prev), lead && prev >= 0);
}

/* The epilogue of one 64-row half (rows row0h ..): the cooperative
 * kernel's code for one 128-column half (s9_dgrad_half), the accumulators
 * in m64n128 order (acc[4 * j + 2 * hh + c], the same registers as that
 * half's in m64n256 order). */
__device__ static inline void s9p_epilogue_half(const s9_params &p, const s9_tile &tl,
                                                const float (&acc)[64], int row0h) {
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int rbase = row0h + 16 * warp + (lane >> 2);
  float wt[2];
  s9_dgrad_weights(p, tl, rbase, wt);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rbase + 8 * hh;
    s9_dgrad_half(p, acc, 0, hh, r, r < tl.store_end, r < tl.used_end, wt[hh], tl.n0,
                  tl.n0 / S9P_BN);
  }
}

/* Both halves through one copy of the epilogue's code (it is long: the
 * instruction cache holds one copy better than two). acc0 is overwritten. */
__device__ static inline void s9p_epilogue(const s9_params &p, const s9_tile &tl, float (&acc0)[64],
                                           const float (&acc1)[64]) {
#pragma unroll 1
  for (int mh = 0; mh < 2; mh++) {
    s9p_epilogue_half(p, tl, acc0, tl.row0 + 64 * mh);
    if (mh == 0)
#pragma unroll
      for (int k = 0; k < 64; k++) acc0[k] = acc1[k];
  }
}

template <int CN>
__device__ static void s9p_consume(const s9_params &p, const s9_sched &sc, uint32_t base,
                                   uint32_t bars, int rank) {
  const int cw = threadIdx.x / 128 - 1;
  const int units = CN == 2 ? (p.m_tiles + 1) / 2 * p.n_tiles : p.m_tiles * p.n_tiles;
  const int clusters = gridDim.x / CN;
  const uint32_t turn = bars + 8 * 2 * S9P_STAGES; /* turn[w]: warpgroup w may start */
  const bool lead = (threadIdx.x & 31) == 0;
  float acc0[64], acc1[64];
#pragma unroll
  for (int i = 0; i < 64; i++) acc0[i] = acc1[i] = 0.0f;
  /* warpgroup 0 has the first turn: its first wait is for the phase
   * before the barrier's first, which a fresh mbarrier reports complete */
  int s = 0, ph = 0, i = 0, tp = cw == 0 ? 1 : 0;
  for (int q = blockIdx.x / CN; q < units; q += clusters, i++) {
    const bool mine = (i & 1) == cw;
    s9_tile tl;
    {
      const s9_pair pr = s9p_unit<CN>(p, sc, q, rank);
      if (pr.skip) { /* not loaded: no stages, but its owner's turn passes */
        if (mine) {
          mbar_wait(turn + 8 * cw, tp);
          tp ^= 1;
          mbar_arrive_if(turn + 8 * (1 - cw), lead);
        }
        continue;
      }
      tl = pr.mine;
    }
    const int nk = s9p_unit_nk<CN>(p, tl);
    if (!mine) { /* the other warpgroup's unit: pass over its stages */
      s9_ring_advance(s, ph, nk, S9P_STAGES);
      continue;
    }
    mbar_wait(turn + 8 * cw, tp); /* the other has waited for every stage before ours */
    tp ^= 1;
    const bool have = tl.in_use && tl.used_end > tl.row0;
    if (have && tl.row0 + 64 < tl.used_end) {
      s9p_mma_loop<true, CN>(acc0, acc1, base, bars, nk, s, ph);
    } else if (have) {
      s9p_mma_loop<false, CN>(acc0, acc1, base, bars, nk, s, ph);
    } else { /* no rows (a tile's nk is then 0; a pair's block follows the ring) */
      s9_skip_loop<CN, S9P_STAGES>(bars, nk, s, ph);
    }
    mbar_arrive_if(turn + 8 * (1 - cw), lead); /* even for a unit with nothing to compute */
    s9p_epilogue(p, tl, acc0, acc1);
  }
}

/* The ping-pong down dgrad: on plain CTAs (CN = 1) or in 2-CTA clusters
 * (CN = 2; every decision from rank 0's copy of the schedule). */
template <int CN>
__global__ void __launch_bounds__(S9_THREADS, 1)
    s9_gemm_pp_kernel(const __grid_constant__ CUtensorMap map_a,
                      const __grid_constant__ CUtensorMap map_b0, const s9_params p) {
  extern __shared__ __align__(1024) unsigned char s9_smem_raw[];
  __shared__ int s_failed;
  const uint32_t base = (smem_u32(s9_smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + S9P_STAGES * S9P_STAGE_BYTES;
  int32_t *table = (int32_t *)(s9_smem_raw + (base - smem_u32(s9_smem_raw)) + S9_TABLE_AT);
  const int rank = CN == 2 ? (int)cluster_ctarank() : 0;
  if (threadIdx.x == 0) {
    for (int i = 0; i < S9P_STAGES; i++) {
      mbar_init(bars + 8 * i, 1);
      /* one warpgroup a stage, in every CTA of the cluster */
      mbar_init(bars + 8 * (S9P_STAGES + i), CN * S9_CONSUMER_WARPS / 2);
    }
    mbar_init(bars + 8 * 2 * S9P_STAGES, S9_CONSUMER_WARPS / 2);       /* turn[0] */
    mbar_init(bars + 8 * (2 * S9P_STAGES + 1), S9_CONSUMER_WARPS / 2); /* turn[1] */
    mbar_fence_init();
    if (rank == 0) s_failed = job_failed(p.status);
  }
  s9_sched sc;
  if (CN == 2) {
    sc = s9_cluster_sched(p, table, &s_failed, rank);
  } else {
    sc = s9_sched_copy(p, table, true);
    __syncthreads();
  }
  if (s_failed) return; /* one decision for the CTA (the cluster) */
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) {
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b0);
      s9p_produce<CN>(p, sc, &map_a, &map_b0, base, bars, rank);
    } else {
      s9_gather_beside<4>(p);
    }
  } else {
    regs_inc<232>();
    s9p_consume<CN>(p, sc, base, bars, rank);
  }
  if (CN == 2) cluster_sync(); /* neither CTA leaves while the other may still write into it */
}

/* ---- host side ------------------------------------------------------------------ */

static int s9_grid_override = 0;
static int s9_pipe = 0, s9_band = 0, s9_pol_a = 0, s9_pol_b = 0;
/* the default: pingpong (2-CTA clusters multicasting the weight tile, PERF.md
 * v3; the ping-pong down dgrad, v4) with the products CUTLASS's launch table
 * takes (kernels/cutlass_gemm/launch.cu; PERF.md "Kernels v3 on CUTLASS":
 * the forward 3-6 % faster at T=8192, bitwise equal); a build without
 * CUTLASS runs pingpong's kernels for all of them. MOK_GEMM_VARIANT picks
 * another */
static int s9_variant = MOK_K_SM90_CUTLASS;
static int s9_pair_clusters = 0; /* co-resident 2-CTA clusters (0: the variant is off) */
static int s9_quad_clusters = 0; /* co-resident 4-CTA clusters (0: quad falls back to pairs) */
/* the ping-pong down dgrad in 2-CTA clusters (bench knob: mok_k_sm90_set_pp_pairs) */
static int s9_pp_pairs = 1;

extern "C" void mok_k_sm90_set_pp_pairs(int on) { s9_pp_pairs = on ? 1 : 0; }

extern "C" void mok_k_sm90_set_grid(int ctas) { s9_grid_override = ctas > 0 ? ctas : 0; }

extern "C" int mok_k_sm90_set_trace(unsigned long long *buf, int tiles_per_cta) {
#if MOK_TILE_TRACE
  if (tiles_per_cta < 0 || (buf && tiles_per_cta == 0)) return MOK_EINVAL;
  cudaError_t err = cudaMemcpyToSymbol(mok_trace_buf, &buf, sizeof buf);
  if (err == cudaSuccess) err = cudaMemcpyToSymbol(mok_trace_tiles, &tiles_per_cta, sizeof(int));
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
#else
  (void)buf;
  (void)tiles_per_cta;
  return MOK_EUNSUPPORTED;
#endif
}

extern "C" void mok_k_sm90_set_tuning(int pipe, int band, int pol_a, int pol_b) {
  s9_pipe = pipe ? 1 : 0;
  s9_band = band > 0 ? band : 0;
  s9_pol_a = pol_a >= 0 && pol_a <= 2 ? pol_a : 0;
  s9_pol_b = pol_b >= 0 && pol_b <= 2 ? pol_b : 0;
}

static const char *const s9_variant_names[MOK_K_SM90_VARIANTS] = {
    "rows", "expert", "cluster", "pingpong", "quad", "cutlass"};

extern "C" const char *mok_k_sm90_variant_name(int variant) {
  return variant >= 0 && variant < MOK_K_SM90_VARIANTS ? s9_variant_names[variant] : "?";
}

extern "C" int mok_k_sm90_variant_parse(const char *name) {
  for (int v = 0; name && v < MOK_K_SM90_VARIANTS; v++)
    if (!strcmp(name, s9_variant_names[v])) return v;
  return -1;
}

extern "C" int mok_k_sm90_set_variant(int variant) {
  if (variant < 0 || variant >= MOK_K_SM90_VARIANTS) return MOK_EINVAL;
  s9_variant = variant;
  return MOK_OK;
}

extern "C" int mok_k_sm90_variant(void) { return s9_variant; }

extern "C" int mok_k_sm90_pair_clusters(void) { return s9_pair_clusters; }

/* cuTensorMapEncodeTiled through the runtime (the library never links
 * libcuda: machines without a GPU have none). */
static PFN_cuTensorMapEncodeTiled_v12000 s9_lookup_encode(void) {
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return (PFN_cuTensorMapEncodeTiled_v12000)fn;
}

static PFN_cuTensorMapEncodeTiled_v12000 s9_encode_fn(void) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = s9_lookup_encode(); /* thread-safe init */
  return fn;
}

extern "C" int mok_k_sm90_usable(void) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major == 9 && minor == 0 && s9_encode_fn() != NULL;
}

static int s9_set_smem(const void *k) {
  const cudaError_t err =
      cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, S9_SMEM_BYTES);
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

/* How many clusters of n CTAs of kernel k fit on the device at once (a
 * property of the device and the kernel: the same every launch). */
static int s9_query_clusters(const void *k, int n) {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = (unsigned)n;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cfg.gridDim = dim3((unsigned)n, 1, 1);
  cfg.blockDim = dim3(S9_THREADS, 1, 1);
  cfg.dynamicSmemBytes = S9_SMEM_BYTES;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  int got = 0;
  if (cudaOccupancyMaxActiveClusters(&got, k, &cfg) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return got;
}

extern "C" int mok_k_sm90_init(void) {
  const void *k[20] = {(const void *)s9_gemm_pp_kernel<1>,
                       (const void *)s9_gemm_pp_kernel<2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 4>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_DOWN, 0, 4>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GU_DGRAD, 0, 4>,
                       (const void *)s9_gemm_kernel<MOK_GM_GATE_UP, 0>,
                       (const void *)s9_gemm_kernel<MOK_GM_GATE_UP, 1>,
                       (const void *)s9_gemm_kernel<MOK_GM_DOWN, 0>,
                       (const void *)s9_gemm_kernel<MOK_GM_DOWN, 1>,
                       (const void *)s9_gemm_kernel<MOK_GM_DOWN_DGRAD, 0>,
                       (const void *)s9_gemm_kernel<MOK_GM_GU_DGRAD, 0>,
                       (const void *)s9_gemm_kernel<MOK_GM_WGRAD, 0>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_DOWN, 0, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GU_DGRAD, 0, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 1, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_DOWN, 1, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GU_DGRAD, 1, 2>,
                       (const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 2, 1>,
                       NULL};
  int st = MOK_OK;
  for (int i = 0; i < 20 && k[i] && st == MOK_OK; i++) st = s9_set_smem(k[i]);
  if (st == MOK_OK) st = mok__sm90_fp8_init();
  if (st == MOK_OK) st = mok__cg_init();
  if (st != MOK_OK) return st;
  s9_pair_clusters = s9_query_clusters((const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 2>, 2);
  s9_quad_clusters = s9_query_clusters((const void *)s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 4>, 4);
  return MOK_OK;
}

/* A bf16 tensor [d2][d1][d0] (d0 contiguous, rows ld elements apart, d2
 * slices s2 elements apart) as a TMA map with boxes of 64 x box1 (x 1),
 * 128-byte swizzle, zero fill out of bounds (also columns d0..ld-1). */
static int s9_map3(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                   long long d2, long long ld, long long s2, int box1) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = s9_encode_fn();
  if (!enc) return MOK_EENGINE;
  cuuint64_t dims[3] = {(cuuint64_t)d0, (cuuint64_t)d1, (cuuint64_t)d2};
  cuuint64_t strides[2] = {(cuuint64_t)ld * 2, (cuuint64_t)s2 * 2};
  cuuint32_t box[3] = {S9_BK, (cuuint32_t)box1, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)ptr, dims, strides,
                   box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? MOK_OK : MOK_EENGINE;
}

/* A map of bytes for the FP8 kernels and the CUTLASS epilogues: [d2][d1][d0]
 * bytes, rows ld and slices s2 bytes apart, boxes of box0 x box1 (x 1),
 * `swizzle` bytes (128 or 64) of swizzle, zero fill out of bounds. */
int mok__sm90_map_bytes(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                        long long d2, long long ld, long long s2, int box0, int box1,
                        int swizzle) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = s9_encode_fn();
  if (!enc || (swizzle != 64 && swizzle != 128)) return MOK_EENGINE;
  cuuint64_t dims[3] = {(cuuint64_t)d0, (cuuint64_t)d1, (cuuint64_t)d2};
  cuuint64_t strides[2] = {(cuuint64_t)ld, (cuuint64_t)s2};
  cuuint32_t box[3] = {(cuuint32_t)box0, (cuuint32_t)box1, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_UINT8, (cuuint32_t)rank, (void *)ptr, dims, strides,
                   box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE,
                   swizzle == 64 ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? MOK_OK : MOK_EENGINE;
}

int mok__sm90_map_u8(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                     long long d2, long long ld, long long s2, int box0, int box1) {
  return mok__sm90_map_bytes(m, ptr, rank, d0, d1, d2, ld, s2, box0, box1, 128);
}

/* 2D: d1 rows of d0 elements, ld apart */
static int s9_map2(CUtensorMap *m, const void *ptr, long long d0, long long d1, long long ld,
                   int box1) {
  return s9_map3(m, ptr, 2, d0, d1, 1, ld, ld * d1, box1);
}

static int s9_sms(void) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    sms = 132;
  }
  return sms;
}

int mok__sm90_sms(void) { return s9_sms(); }
int mok__sm90_grid_override(void) { return s9_grid_override; }

static int s9_grid(int tiles) {
  const int g = s9_grid_override > 0 ? s9_grid_override : s9_sms();
  return g < tiles ? g : tiles;
}

static int s9_bwd_mask = MOK_K_SM90_BWD_DOWN_DGRAD | MOK_K_SM90_BWD_GATE_UP_DGRAD | MOK_K_SM90_BWD_WGRAD;

extern "C" void mok_k_sm90_set_bwd_modes(int mask) { s9_bwd_mask = mask & 7; }
extern "C" int mok_k_sm90_bwd_modes(void) { return s9_bwd_mask; }

/* The pairs kernel takes this product: the cluster variant, one of its
 * modes, the schedule's offsets fit its table, the device runs such
 * clusters. */
static bool s9_use_pairs(int mode, const s9_params &p) {
  return (s9_variant == MOK_K_SM90_CLUSTER || s9_variant == MOK_K_SM90_PINGPONG ||
          s9_variant == MOK_K_SM90_QUAD || s9_variant == MOK_K_SM90_CUTLASS) &&
         S9_PAIRS_MODE(mode) && s9_pair_clusters > 0 &&
         (!p.offsets || S9_TABLE_FITS(p.E_loc));
}

/* ... and the quads kernel instead: the quad variant, an even count of
 * column tiles, the device runs 4-CTA clusters. */
static bool s9_use_quads(int mode, const s9_params &p) {
  return s9_variant == MOK_K_SM90_QUAD && s9_use_pairs(mode, p) && s9_quad_clusters > 0 &&
         p.n_tiles % 2 == 0;
}

/* The launch of a pairs (p.cluster 2) or quads (4) kernel: a grid of whole
 * clusters, as many as fit on the device at once, at most one a cluster of
 * tiles. */
static void s9_pairs_config(cudaLaunchConfig_t *cfg, cudaLaunchAttribute *attr, const s9_params &p,
                            cudaStream_t stream) {
  const int n = p.cluster == 4 ? 4 : 2;
  const int units = n == 4 ? (p.m_tiles + 1) / 2 * (p.n_tiles / 2) : (p.m_tiles + 1) / 2 * p.n_tiles;
  int clusters = s9_grid_override > 0 ? (s9_grid_override + n - 1) / n
                                      : n == 4 ? s9_quad_clusters : s9_pair_clusters;
  if (clusters > units) clusters = units;
  if (clusters < 1) clusters = 1;
  *cfg = cudaLaunchConfig_t{};
  *attr = cudaLaunchAttribute{};
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = (unsigned)n;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg->gridDim = dim3((unsigned)(n * clusters), 1, 1);
  cfg->blockDim = dim3(S9_THREADS, 1, 1);
  cfg->dynamicSmemBytes = S9_SMEM_BYTES;
  cfg->stream = stream;
  cfg->attrs = attr;
  cfg->numAttrs = 1;
}

template <int MODE>
static int s9_launch(const s9_params &p, const CUtensorMap &a, const CUtensorMap &a2,
                     const CUtensorMap &b0, const CUtensorMap &b1, cudaStream_t stream) {
  const int tiles = p.m_tiles * p.n_tiles * (MODE == MOK_GM_WGRAD ? p.groups : 1);
  if (tiles == 0) return MOK_OK;
  s9_params q = p;
  if (S9_PAIRS_MODE(MODE) && q.cluster) {
    /* an even grid: one cluster per co-resident pair of SMs, at most one a pair of tiles */
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    s9_pairs_config(&cfg, &attr, q, stream);
    constexpr int PM = S9_PAIRS_MODE(MODE) ? MODE : MOK_GM_GATE_UP;
    /* s9_pipe: one wgmma batch kept in flight in the pairs' k loops (a bench knob) */
    /* q.a_x: GATE_UP's rows gathered by the producer (mok__sm90_gathers) */
    const cudaError_t err =
        q.a_x ? cudaLaunchKernelEx(&cfg, s9_gemm_pairs_kernel<MOK_GM_GATE_UP, 0, 2, 1>, a, a2, b0,
                                   b1, q)
        : q.cluster == 4 ? cudaLaunchKernelEx(&cfg, s9_gemm_pairs_kernel<PM, 0, 4>, a, a2, b0, b1, q)
        : s9_pipe        ? cudaLaunchKernelEx(&cfg, s9_gemm_pairs_kernel<PM, 1, 2>, a, a2, b0, b1, q)
                         : cudaLaunchKernelEx(&cfg, s9_gemm_pairs_kernel<PM, 0, 2>, a, a2, b0, b1, q);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      mok_k_set_cuda_error((int)err);
      return MOK_EENGINE;
    }
    return MOK_OK;
  }
  if (s9_pipe && (MODE == MOK_GM_GATE_UP || MODE == MOK_GM_DOWN))
    s9_gemm_kernel<MODE, (MODE == MOK_GM_GATE_UP || MODE == MOK_GM_DOWN) ? 1 : 0>
        <<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, a2, b0, b1, q);
  else
    s9_gemm_kernel<MODE, 0><<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, a2, b0, b1, q);
  return mok_k_launch_status();
}

/* The ping-pong down dgrad: in 2-CTA clusters where the device runs them
 * and the schedule fits the table (as the pairs kernel), else on plain CTAs. */
static int s9_launch_pp(const s9_params &p, const CUtensorMap &a, const CUtensorMap &b0,
                        cudaStream_t stream) {
  const int tiles = p.m_tiles * p.n_tiles;
  if (tiles == 0) return MOK_OK;
  if (s9_pp_pairs && s9_pair_clusters > 0 && (!p.offsets || S9_TABLE_FITS(p.E_loc))) {
    cudaLaunchConfig_t cfg;
    cudaLaunchAttribute attr;
    s9_pairs_config(&cfg, &attr, p, stream);
    const cudaError_t err = cudaLaunchKernelEx(&cfg, s9_gemm_pp_kernel<2>, a, b0, p);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      mok_k_set_cuda_error((int)err);
      return MOK_EENGINE;
    }
    return MOK_OK;
  }
  s9_gemm_pp_kernel<1><<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, b0, p);
  return mok_k_launch_status();
}

/* The product p (mok_gemm.cu's parameters) on the Hopper kernels: the
 * tiling, the TMA maps of its operands, the launch. */
int mok__sm90_on_cutlass(int mode, const mok_gemm_params *p) {
  return s9_variant == MOK_K_SM90_CUTLASS && mok__cg_takes(mode, p);
}

/* GATE_UP's rows gathered by the producer (mok_k_sm90_set_gather_a), on
 * the 2-CTA cluster kernel (not quads, not the pipelined bench knob) on a
 * schedule, rows of whole 16-byte vectors from 16-byte aligned x. By
 * default where the expert's intermediate size is at most
 * MOK_K_SM90_GATHER_MAX_I: the copy it saves costs in proportion to T K H,
 * its own cost (its copies keep the tensor cores a little less busy than a
 * TMA box does) in proportion to T K H I, so the gain falls as I grows;
 * measured up to 7 % faster forwards at I = 1024 (0.2 % slower at worst)
 * and up to 4 % slower at I = 2048, T = 2048 and 8192 (kernels/PERF.md "The
 * gathering producer's copies"). -1: that rule; 0: never; 1: wherever the
 * kernel runs. */
static int s9_gather_a = -1;

extern "C" void mok_k_sm90_set_gather_a(int mode) { s9_gather_a = mode < 0 ? -1 : mode ? 1 : 0; }

int mok__sm90_gathers(int mode, const mok_gemm_params *p) {
  s9_params q = *p;
  q.n_tiles = (p->N + S9_BN / 2 - 1) / (S9_BN / 2);
  const int on = s9_gather_a < 0 ? p->N <= MOK_K_SM90_GATHER_MAX_I : s9_gather_a;
  return on && mode == MOK_GM_GATE_UP && p->offsets && p->row_slot && p->a_x &&
         p->a_k > 0 && p->K % 8 == 0 && mok_k_aligned16(p->a_x) && !s9_pipe &&
         s9_use_pairs(mode, q) && !s9_use_quads(mode, q);
}

int mok_k_sm90_run(int mode, const mok_gemm_params *prod, cudaStream_t stream) {
  if (prod->M <= 0 || prod->N <= 0 || prod->groups <= 0) return MOK_OK;
  if (mok__sm90_on_cutlass(mode, prod)) return mok__cg_run(mode, prod, s9_grid_override, stream);
  if (prod->a_x && !mok__sm90_gathers(mode, prod)) return MOK_EINVAL; /* the caller gathers first */
  s9_params p = *prod;
  p.order = s9_variant == MOK_K_SM90_EXPERT ? MOK_ORDER_EXPERT : MOK_ORDER_ROWS;
  p.band = mode == MOK_GM_WGRAD ? 0 : s9_band;
  p.pol_a = s9_pol_a;
  p.pol_b = s9_pol_b;
  const bool pp = mode == MOK_GM_DOWN_DGRAD &&
                  (s9_variant == MOK_K_SM90_PINGPONG || s9_variant == MOK_K_SM90_QUAD ||
                   s9_variant == MOK_K_SM90_CUTLASS);
  p.tile_n = mode == MOK_GM_GATE_UP ? S9_BN / 2 : pp ? S9P_BN : S9_BN;
  p.m_tiles = (p.M + S9_BM - 1) / S9_BM;
  p.n_tiles = (p.N + p.tile_n - 1) / p.tile_n;
  p.cluster = s9_use_quads(mode, p) ? 4 : s9_use_pairs(mode, p) ? 2 : 0;
  /* quads: each CTA loads half a row block of A, in boxes of 64 rows */
  const int a_box = p.cluster == 4 ? S9_BM / 2 : S9_BM;
  const int groups = p.offsets ? p.E_loc : 1; /* the weights' leading dimension */
  CUtensorMap ma, ma2, mb0, mb1;
  int st = MOK_OK;
  switch (mode) {
  case MOK_GM_GATE_UP: /* A [M][H]; B W_g, W_u [groups][N][H], 128-row boxes */
    st = s9_map2(&ma, p.A, p.K, p.M, p.lda, a_box);
    if (st == MOK_OK) st = s9_map3(&mb0, p.B0, 3, p.K, p.N, groups, p.ldb, p.b_expert_stride, S9_BN / 2);
    if (st == MOK_OK) st = s9_map3(&mb1, p.B1, 3, p.K, p.N, groups, p.ldb, p.b_expert_stride, S9_BN / 2);
    if (st != MOK_OK) return st;
    return s9_launch<MOK_GM_GATE_UP>(p, ma, ma, mb0, mb1, stream);
  case MOK_GM_DOWN: /* A h [M][I]; B W_d [groups][H][I]: one 256-row box, or two halves (pairs) */
    st = s9_map2(&ma, p.A, p.K, p.M, p.lda, a_box);
    if (st == MOK_OK)
      st = s9_map3(&mb0, p.B0, 3, p.K, p.N, groups, p.ldb, p.b_expert_stride,
                   p.cluster ? S9_BN / 2 : S9_BN);
    if (st != MOK_OK) return st;
    return s9_launch<MOK_GM_DOWN>(p, ma, ma, mb0, mb0, stream);
  case MOK_GM_DOWN_DGRAD: /* B(k = h, n = i) = W_d[e][h][i]: i contiguous */
    st = s9_map2(&ma, p.A, p.K, p.M, p.lda, S9_BM);
    if (st == MOK_OK) st = s9_map3(&mb0, p.B0, 3, p.N, p.K, groups, p.ldb, p.b_expert_stride, S9_BK);
    if (st != MOK_OK) return st;
    if (pp) return s9_launch_pp(p, ma, mb0, stream);
    return s9_launch<MOK_GM_DOWN_DGRAD>(p, ma, ma, mb0, mb0, stream);
  case MOK_GM_GU_DGRAD: {
    /* K = 2I in two halves from their own maps: the dg and du halves of
     * each dgu row (each zero past I), with B(k, n = h) = W_g/W_u[e][k][h] */
    const int half = p.b_split;
    if (half % 16 || p.K != 2 * half) return MOK_EINVAL; /* k16 steps must not straddle dg and du */
    p.nk_split = (half + S9_BK - 1) / S9_BK;
    st = s9_map2(&ma, p.A, half, p.M, p.lda, a_box);
    if (st == MOK_OK) st = s9_map2(&ma2, p.A + half, half, p.M, p.lda, a_box);
    if (st == MOK_OK) st = s9_map3(&mb0, p.B0, 3, p.N, half, groups, p.ldb, p.b_expert_stride, S9_BK);
    if (st == MOK_OK) st = s9_map3(&mb1, p.B1, 3, p.N, half, groups, p.ldb, p.b_expert_stride, S9_BK);
    if (st != MOK_OK) return st;
    return s9_launch<MOK_GM_GU_DGRAD>(p, ma, ma2, mb0, mb1, stream);
  }
  case MOK_GM_WGRAD: {
    /* A(m, k = row) = a[row][m], B(k = row, n) = b[row][n]: boxes of 64 x 64.
     * No rows: valid maps that are never read (every tile writes zeros). */
    const int rk = p.K > 0 ? p.K : 1;
    if (p.K < 0) p.K = 0;
    CUtensorMap mc0, mc1;
    st = s9_map2(&ma, p.A, p.M, rk, p.lda, S9_BK);
    if (st == MOK_OK) st = s9_map2(&mb0, p.B0, p.N, rk, p.ldb, S9_BK);
    if (st != MOK_OK) return st;
    /* store maps [groups][rows][N] for each output half, where the layout
     * is that plain (else direct stores) */
    const int rows0 = p.c_split < p.M ? p.c_split : p.M, rows1 = p.M - rows0;
    p.wstore = p.c_expert_stride == p.ldc * rows0 &&
               (rows1 == 0 || (p.C1 && p.ldc * rows1 == p.c_expert_stride)) && p.ldc % 8 == 0 &&
               mok_k_aligned16(p.C0) && mok_k_aligned16(p.C1) && rows0 > 0;
    if (p.wstore) {
      p.wstore = s9_map3(&mc0, p.C0, 3, p.N, rows0, p.groups, p.ldc, p.c_expert_stride, 64) == MOK_OK &&
                 (rows1 == 0 ||
                  s9_map3(&mc1, p.C1, 3, p.N, rows1, p.groups, p.ldc, p.c_expert_stride, 64) == MOK_OK);
      if (rows1 == 0) mc1 = mc0;
    }
    if (!p.wstore) mc0 = mc1 = ma; /* unused */
    return s9_launch<MOK_GM_WGRAD>(p, ma, mc0, mb0, mc1, stream);
  }
  default:
    return MOK_EINVAL;
  }
}
