/* The grouped GEMMs on Hopper (sm_90a): TMA + wgmma, warp specialised,
 * persistent. Forward (v1) and backward (v2):
 *
 *   GATE_UP        rows x I (x2), K=H   A routed_x [M,H],  B W_g|W_u [E,I,H]     -> g, u, h (SwiGLU)
 *   DOWN           rows x H,      K=I   A h [M,I],         B W_d [E,H,I]         -> y
 *   DOWN_DGRAD     rows x I,      K=H   A d_out [M,H],     B W_d [E,H,I] (N-major) -> dg|du, h, d_rw partials
 *   GU_DGRAD       rows x H,      K=2I  A dg|du [M,2I],    B W_g;W_u (N-major)    -> d_x
 *   WGRAD          M x N per expert, K = the expert's rows; A dy or dg|du
 *                  (M-major), B h or x (N-major)                                  -> d_W[e]
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
 * tile, m-major, walked by CTA c as c, c+G, c+2G, ...; a block's expert
 * comes from the schedule's offsets on the device (groups start at
 * multiples of 128, so a block has one expert), exactly as the mma.sync
 * kernel finds it. Blocks past the last group and padding rows are written
 * as zeros; a consumer whose 64 rows are all padding skips its wgmmas.
 * WGRAD: every (expert, M tile, N tile), each reducing over all the
 * expert's rows in ascending 64-row blocks (the rows past the expert's
 * count in the last block are zeroed in shared memory, as the mma.sync
 * kernel zero-fills them): no split-K, no atomics. Its tiles have short k
 * loops, so its epilogue goes through shared memory and TMA stores that
 * overlap the next tile (3 stages to make room).
 * Each output element is computed by one CTA with K in ascending k16 steps
 * at the same positions as the mma.sync kernel's (plus steps over zeros),
 * and every epilogue repeats the mma.sync epilogue's arithmetic, so results
 * equal that kernel's bit for bit, do not depend on the grid size, and a
 * row's result depends only on its own input row.
 *
 * Bench knobs (mok_k_sm90_set_tuning; defaults measured best or equal, see
 * kernels/PERF.md v1): a pipelined consumer loop (one wgmma batch in
 * flight; forward only), banded tile order, L2 eviction hints on the TMA
 * loads.
 */
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"
#include "mok_sm90_ptx.cuh"

#define S9_BM 128
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
#define S9_NST(MODE) ((MODE) == S9_WGRAD ? S9_STAGES_W : S9_STAGES)
#define S9_SMEM_BYTES (S9_STAGES_W * S9_STAGE_BYTES + 2 * S9_STAGE_OUT + 1024 + 2 * S9_STAGES * 8)

#define S9_SLAB 8192 /* one MN-major box: 64 k rows of 128 B */

enum s9_mode { S9_GATE_UP = 0, S9_DOWN, S9_DOWN_DGRAD, S9_GU_DGRAD, S9_WGRAD };

/* Operand layouts per mode: A M-major only in WGRAD; B N-major in backward. */
#define S9_TA(MODE) ((MODE) == S9_WGRAD ? 1 : 0)
#define S9_TB(MODE) ((MODE) >= S9_DOWN_DGRAD ? 1 : 0)

typedef struct s9_params {
  int M, N, K;         /* output rows (buffer; WGRAD: per expert), output columns, reduction */
  int tile_n;          /* output columns per tile: 128 (GATE_UP) or 256 */
  int m_tiles, n_tiles;
  int band;            /* > 0: bands of this many row blocks, column tiles outer */
  int pol_a, pol_b;    /* L2 policy of the A and B loads (l2_policy kinds) */
  int E_loc;           /* grouped: schedule's local experts */
  const int32_t *offsets, *counts; /* NULL: one group of M rows (WGRAD: of K rows) */
  bf16 *C0, *C1, *C2;  /* GATE_UP: g, u, h; DOWN, GU_DGRAD: y, d_x; DOWN_DGRAD: dg|du, h;
                          WGRAD: output rows < c_split, the rest */
  long long ldc;
  int has_limit;
  float limit;
  const int32_t *status;
  int nk_split;        /* GU_DGRAD: k blocks from the W_g half (then W_u) */
  int groups;          /* WGRAD: experts (1: ungrouped) */
  int c_split;         /* WGRAD */
  long long c_expert_stride;
  const bf16 *G, *U;   /* DOWN_DGRAD: saved pre-clamp g, u [M, N] */
  const float *rw;     /* DOWN_DGRAD: router weights per slot (NULL: 1) */
  const int32_t *row_slot;
  int n_slots;
  float *partial;      /* DOWN_DGRAD: d_rw partials per 128-column tile (NULL: none) */
  int n_partial;
  int wstore;          /* WGRAD: epilogue through TMA stores (maps: map_a2 C0, map_b1 C1) */
  int no_tail;         /* row modes: tiles past the last group are skipped, not zeroed */
  const int32_t *e_range; /* WGRAD: device [e0, e1); other experts' tiles are skipped and
                             their gradients left as they are (a ring's macrobatch). NULL: all */
} s9_params;

/* ---- SwiGLU (must match mok_gemm.cu bit for bit: explicit roundings) -------- */

__device__ static inline float s9_silu(float v) { return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v))); }
__device__ static inline float s9_sigmoid(float v) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
}

/* ---- the device-side tile scheduler ------------------------------------------- */

/* Rows [row0, store_end) of the tile are written; [row0, used_end) hold real
 * rows. e = -1: past the last group (zeros only). Clamped like the mma.sync
 * kernel, so an unchecked schedule still stays in bounds. */
typedef struct s9_tile {
  int e, row0, used_end, store_end, n0;
  int k_begin, k_end; /* WGRAD: the expert's rows; row0 is the output row */
  int skip;           /* WGRAD: outside p.e_range: no loads, no stores */
} s9_tile;

/* WGRAD tile t: expert-major, then M tiles, then N tiles. The expert's
 * rows are clamped like the mma.sync kernel's. */
__device__ static inline s9_tile s9_locate_w(const s9_params &p, int t) {
  s9_tile tl;
  const int per = p.m_tiles * p.n_tiles;
  tl.e = t / per;
  const int idx = t - tl.e * per, mb = idx / p.n_tiles;
  tl.row0 = mb * S9_BM;
  tl.n0 = (idx - mb * p.n_tiles) * p.tile_n;
  tl.used_end = tl.store_end = min(tl.row0 + S9_BM, p.M);
  tl.k_begin = 0;
  tl.k_end = p.K;
  tl.skip = p.e_range && (tl.e < p.e_range[0] || tl.e >= p.e_range[1]);
  if (p.offsets) {
    const int off = min(max(p.offsets[tl.e], 0), p.K);
    tl.k_begin = off;
    tl.k_end = off + min(max(p.counts[tl.e], 0), p.K - off);
  }
  return tl;
}

/* k blocks of a tile (0: nothing to load, zeros are written) */
__device__ static inline int s9_tile_nk(const s9_params &p, const s9_tile &tl, int mode) {
  if (mode == S9_WGRAD) return (tl.k_end - tl.k_begin + S9_BK - 1) / S9_BK;
  return tl.used_end > tl.row0 ? (p.K + S9_BK - 1) / S9_BK + (mode == S9_GU_DGRAD ? p.nk_split : 0)
                               : 0;
}

__device__ static inline s9_tile s9_locate(const s9_params &p, int t) {
  s9_tile tl;
  int mb, nb;
  if (p.band > 0) { /* the CTAs at work share fewer A and B tiles (L2) */
    const int per = p.band * p.n_tiles, b = t / per, idx = t - b * per;
    const int bm = min(p.band, p.m_tiles - b * p.band);
    nb = idx / bm;
    mb = b * p.band + (idx - nb * bm);
  } else {
    mb = t / p.n_tiles;
    nb = t - mb * p.n_tiles;
  }
  tl.n0 = nb * p.tile_n;
  tl.row0 = mb * S9_BM;
  tl.e = 0;
  tl.k_begin = tl.k_end = 0;
  tl.skip = 0;
  if (!p.offsets) {
    tl.used_end = tl.store_end = min(tl.row0 + S9_BM, p.M);
    return tl;
  }
  const int rows_used = min(max(p.offsets[p.E_loc], 0), p.M);
  if (tl.row0 >= rows_used) {
    tl.e = -1;
    tl.used_end = tl.row0;
    tl.store_end = min(tl.row0 + S9_BM, p.M);
    tl.skip = p.no_tail;
    return tl;
  }
  tl.e = find_group(p.offsets, p.E_loc, tl.row0);
  const int group_end = min(max(p.offsets[tl.e + 1], tl.row0), p.M);
  tl.store_end = min(tl.row0 + S9_BM, group_end);
  const long long used = (long long)p.offsets[tl.e] + max(p.counts[tl.e], 0);
  tl.used_end = (int)min(max(used, (long long)tl.row0), (long long)tl.store_end);
  return tl;
}

/* ---- producer: one thread streams A and B tiles into the ring ----------------- */

/* 64-column boxes of an N-major B operand, 64 k rows each, one slab per 64
 * output columns; boxes wholly past column N are not loaded (the slab's
 * stale columns reach only output columns that are never stored). */
__device__ static inline int s9_b_slabs(int N, int n0) { return min(S9_BN / 64, (N - n0 + 63) / 64); }

__device__ static inline void s9_load_b_mn(uint32_t sb, const CUtensorMap *m, int n0, int k, int e,
                                           int rank, int slabs, uint32_t full, uint64_t pol) {
#pragma unroll
  for (int j = 0; j < S9_BN / 64; j++) {
    if (j >= slabs) break;
    if (rank == 3)
      tma_load_3d_hint(sb + j * S9_SLAB, m, n0 + 64 * j, k, e, full, pol);
    else
      tma_load_2d_hint(sb + j * S9_SLAB, m, n0 + 64 * j, k, full, pol);
  }
}

template <int MODE>
__device__ static void s9_produce(const s9_params &p, const CUtensorMap *ma, const CUtensorMap *ma2,
                                  const CUtensorMap *mb0, const CUtensorMap *mb1, uint32_t base,
                                  uint32_t bars) {
  const int total = MODE == S9_WGRAD ? p.groups * p.m_tiles * p.n_tiles : p.m_tiles * p.n_tiles;
  const uint64_t pa = l2_policy(p.pol_a), pb = l2_policy(p.pol_b);
  constexpr int NST = S9_NST(MODE);
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const s9_tile tl = MODE == S9_WGRAD ? s9_locate_w(p, t) : s9_locate(p, t);
    if (tl.skip) continue; /* the consumers skip it too */
    const int nk = s9_tile_nk(p, tl, MODE);
    const int e = tl.e, slabs = s9_b_slabs(p.N, tl.n0);
    for (int kb = 0; kb < nk; kb++) { /* nk = 0: zeros only, the consumers need no data */
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (NST + s);
      const uint32_t sa = base + s * S9_STAGE_BYTES, sb = sa + S9_A_BYTES;
      mbar_wait(empty, ph ^ 1); /* the consumers released this stage */
      /* whole boxes, out-of-bounds parts zero-filled */
      if (MODE == S9_GATE_UP || MODE == S9_DOWN)
        mbar_arrive_expect_tx(full, S9_STAGE_BYTES);
      else if (MODE == S9_WGRAD) /* the second A slab only when its rows exist */
        mbar_arrive_expect_tx(full, (tl.row0 + 64 < p.M ? 2 : 1) * S9_SLAB + slabs * S9_SLAB);
      else
        mbar_arrive_expect_tx(full, S9_A_BYTES + slabs * S9_SLAB);
      if (MODE == S9_GATE_UP) {
        tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
        tma_load_3d_hint(sb, mb0, kb * S9_BK, tl.n0, e, full, pb);
        tma_load_3d_hint(sb + S9_B_BYTES / 2, mb1, kb * S9_BK, tl.n0, e, full, pb);
      } else if (MODE == S9_DOWN) {
        tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
        tma_load_3d_hint(sb, mb0, kb * S9_BK, tl.n0, e, full, pb);
      } else if (MODE == S9_DOWN_DGRAD) {
        tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
        s9_load_b_mn(sb, mb0, tl.n0, kb * S9_BK, e, 3, slabs, full, pb);
      } else if (MODE == S9_GU_DGRAD) { /* k < I: dg with W_g, then du with W_u */
        const bool up = kb >= p.nk_split;
        const int k = (up ? kb - p.nk_split : kb) * S9_BK;
        tma_load_2d_hint(sa, up ? ma2 : ma, k, tl.row0, full, pa);
        s9_load_b_mn(sb, up ? mb1 : mb0, tl.n0, k, e, 3, slabs, full, pb);
      } else { /* WGRAD: A M-major, two 64-row slabs */
        const int k = tl.k_begin + kb * S9_BK;
        tma_load_2d_hint(sa, ma, tl.row0, k, full, pa);
        if (tl.row0 + 64 < p.M) tma_load_2d_hint(sa + S9_SLAB, ma, tl.row0 + 64, k, full, pa);
        s9_load_b_mn(sb, mb0, tl.n0, k, 0, 2, slabs, full, pb);
      }
      if (++s == NST) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

/* ---- consumers: wgmma over the ring, then the epilogue ------------------------ */

__device__ static inline void s9_store2(bf16 *dst, float a, float b) {
  *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}

/* DOWN_DGRAD: a = acc; SwiGLU backward as the mma.sync kernel (dg|du to C0
 * with ldc = 2N, h to C1); the d_rw partial of each 128-column half equals
 * that kernel's: per thread over its columns (8-column groups ascending,
 * the pair's two in order), then the quad ((q0+q1)+(q2+q3)), then its four
 * 32-column warp slices in order. The thread holds all four slices here. */
__device__ static inline void s9_epilogue_dgrad(const s9_params &p, const s9_tile &tl,
                                                const float (&acc)[128], int cw) {
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31, q = lane & 3;
  const int rbase = tl.row0 + 64 * cw + 16 * warp + (lane >> 2), cq = 2 * q;
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rbase + 8 * hh;
    const bool stored = r < tl.store_end, used = r < tl.used_end;
    float w = 1.0f;
    if (used && p.rw) {
      const int sl = p.row_slot[r];
      w = (sl >= 0 && sl < p.n_slots) ? p.rw[sl] : 0.0f;
    }
#pragma unroll
    for (int half = 0; half < 2; half++) {
      float v = 0.0f;
#pragma unroll
      for (int wn = 0; wn < 4; wn++) {
        float rowsum = 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int jj = 16 * half + 4 * wn + j, n = tl.n0 + 8 * jj + cq;
          if (!stored || n >= p.N) continue;
          const long long at = (long long)r * p.N + n;
          float dg[2] = {0.0f, 0.0f}, du[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
          if (used) {
            const float2 gp = __bfloat1622float2(*(const __nv_bfloat162 *)(p.G + at));
            const float2 up = __bfloat1622float2(*(const __nv_bfloat162 *)(p.U + at));
            const float gin[2] = {gp.x, gp.y}, uin[2] = {up.x, up.y};
#pragma unroll
            for (int c = 0; c < 2; c++) {
              float gc = gin[c], uc = uin[c];
              bool pass_g = true, pass_u = true;
              if (p.has_limit) {
                pass_g = gin[c] <= p.limit;
                pass_u = uin[c] >= -p.limit && uin[c] <= p.limit;
                gc = fminf(gc, p.limit);
                uc = fminf(fmaxf(uc, -p.limit), p.limit);
              }
              const float a = acc[4 * jj + 2 * hh + c];
              const float sig = s9_sigmoid(gc), silu = s9_silu(gc);
              hv[c] = bf2f(f2bf(__fmul_rn(silu, uc)));
              rowsum = __fadd_rn(rowsum, __fmul_rn(a, hv[c]));
              const float dh = __fmul_rn(w, a);
              const float dsilu =
                  __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gc, __fsub_rn(1.0f, sig))));
              dg[c] = pass_g ? __fmul_rn(__fmul_rn(dh, uc), dsilu) : 0.0f;
              du[c] = pass_u ? __fmul_rn(dh, silu) : 0.0f;
            }
          }
          s9_store2(p.C0 + (long long)r * p.ldc + n, dg[0], dg[1]);
          s9_store2(p.C0 + (long long)r * p.ldc + p.N + n, du[0], du[1]);
          s9_store2(p.C1 + at, hv[0], hv[1]);
        }
        /* every lane reaches the shuffles (skipped columns add nothing) */
        rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 1));
        rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 2));
        v = wn == 0 ? rowsum : __fadd_rn(v, rowsum);
      }
      const int pt = 2 * (tl.n0 / S9_BN) + half;
      if (p.partial && q == 0 && stored && pt < p.n_partial)
        p.partial[(long long)r * p.n_partial + pt] = v;
    }
  }
}

/* Accumulator register i of m64n256 holds row 16*warp + lane/4 + 8*((i>>1)&1),
 * column 8*(i>>2) + 2*(lane%4) + (i&1) of the warpgroup's 64x256 block.
 * have: the tile had k blocks (else acc is stale and zeros are written). */
template <int MODE>
__device__ static inline void s9_epilogue(const s9_params &p, const s9_tile &tl, const float (&acc)[128],
                                          int cw, bool have) {
  if (MODE == S9_DOWN_DGRAD) {
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
    if (MODE == S9_WGRAD) { /* output row r of expert e's gradient */
      const long long cb = (long long)tl.e * p.c_expert_stride;
      bf16 *row = r < p.c_split ? p.C0 + cb + (long long)r * p.ldc
                                : p.C1 + cb + (long long)(r - p.c_split) * p.ldc;
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        s9_store2(row + n, used ? acc[4 * j + 2 * hh] : 0.0f, used ? acc[4 * j + 2 * hh + 1] : 0.0f);
      }
      continue;
    }
    const long long row = (long long)r * p.ldc;
    if (MODE == S9_GATE_UP) {
#pragma unroll
      for (int j = 0; j < 16; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        float gv[2] = {0.0f, 0.0f}, uv[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
        if (used) {
#pragma unroll
          for (int c = 0; c < 2; c++) {
            gv[c] = bf2f(f2bf(acc[4 * j + 2 * hh + c]));
            uv[c] = bf2f(f2bf(acc[64 + 4 * j + 2 * hh + c]));
            float gc = gv[c], uc = uv[c];
            if (p.has_limit) {
              gc = fminf(gc, p.limit);
              uc = fminf(fmaxf(uc, -p.limit), p.limit);
            }
            hv[c] = __fmul_rn(s9_silu(gc), uc);
          }
        }
        s9_store2(p.C0 + row + n, gv[0], gv[1]);
        s9_store2(p.C1 + row + n, uv[0], uv[1]);
        s9_store2(p.C2 + row + n, hv[0], hv[1]);
      }
    } else { /* DOWN, GU_DGRAD */
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        s9_store2(p.C0 + row + n, used ? acc[4 * j + 2 * hh] : 0.0f,
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
    s9_epilogue<S9_WGRAD>(p, tl, acc, cw, have);
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

/* The consumer warpgroup's k loop over one tile. PIPE = 1 keeps one wgmma
 * batch in flight and releases the previous stage once it is known
 * complete; PIPE = 0 waits for each batch. s, ph: the ring position.
 * kv: valid k rows of the last block (WGRAD; 64 when whole). */
template <int MODE, int PIPE>
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
    const uint32_t sa = base + s * S9_STAGE_BYTES;
    if (MODE == S9_WGRAD && kv < S9_BK && kb == nk - 1) s9_zero_tail(sa, cw, kv);
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
      mbar_arrive_if(bars + 8 * (NST + prev), lead && prev >= 0);
      prev = s;
    } else {
      wgmma_wait<0>();
      acc_fence(acc);
      mbar_arrive_if(bars + 8 * (NST + s), lead);
    }
    if (++s == NST) {
      s = 0;
      ph ^= 1;
    }
  }
  if (PIPE) {
    wgmma_wait<0>();
    acc_fence(acc);
    mbar_arrive_if(bars + 8 * (NST + prev), lead && prev >= 0);
  }
}

/* A warpgroup whose 64 rows are all padding: follow the ring, no math
 * (row modes: S9_STAGES). */
__device__ static inline void s9_skip_loop(uint32_t bars, int nk, int &s, int &ph) {
  const bool lead = (threadIdx.x & 31) == 0;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    mbar_arrive_if(bars + 8 * (S9_STAGES + s), lead);
    if (++s == S9_STAGES) {
      s = 0;
      ph ^= 1;
    }
  }
}

template <int MODE, int PIPE>
__device__ static void s9_consume(const s9_params &p, uint32_t base, uint32_t bars,
                                  const CUtensorMap *mc0, const CUtensorMap *mc1) {
  const int cw = threadIdx.x / 128 - 1; /* rows 64*cw .. of the tile */
  const int total = MODE == S9_WGRAD ? p.groups * p.m_tiles * p.n_tiles : p.m_tiles * p.n_tiles;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const s9_tile tl = MODE == S9_WGRAD ? s9_locate_w(p, t) : s9_locate(p, t);
    if (tl.skip) continue; /* as the producer */
    const int nk = s9_tile_nk(p, tl, MODE);
    if (MODE == S9_WGRAD) { /* both warpgroups take every block (s9_zero_tail meets them) */
      const int kv = tl.k_end - tl.k_begin - (nk - 1) * S9_BK;
      s9_mma_loop<MODE, PIPE>(p, acc, base, bars, cw, nk, kv, s, ph);
    } else if (nk > 0) {
      if (tl.row0 + 64 * cw < tl.used_end)
        s9_mma_loop<MODE, PIPE>(p, acc, base, bars, cw, nk, S9_BK, s, ph);
      else /* all padding: the epilogue writes zeros */
        s9_skip_loop(bars, nk, s, ph);
    }
    if (MODE == S9_WGRAD)
      s9_epilogue_wstore(p, tl, acc, cw, nk > 0, base + S9_STAGES_W * S9_STAGE_BYTES + cw * S9_STAGE_OUT,
                         mc0, mc1);
    else
      s9_epilogue<MODE>(p, tl, acc, cw, nk > 0);
  }
  if (MODE == S9_WGRAD && (threadIdx.x & 127) == 0) bulk_wait0(); /* before the CTA's smem goes */
}

template <int MODE, int PIPE>
__global__ void __launch_bounds__(S9_THREADS, 1)
    s9_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_a2,
                   const __grid_constant__ CUtensorMap map_b0,
                   const __grid_constant__ CUtensorMap map_b1, const s9_params p) {
  extern __shared__ __align__(1024) unsigned char s9_smem_raw[];
  __shared__ int s_failed;
  /* the 128-byte swizzle is computed from address bits: stages 1024-aligned */
  const uint32_t base = (s9_smem(s9_smem_raw) + 1023u) & ~1023u;
  constexpr int NST = S9_NST(MODE);
  /* the stages, WGRAD's staging tiles, then full[NST] and empty[NST] */
  const uint32_t bars = base + NST * S9_STAGE_BYTES + (MODE == S9_WGRAD ? 2 * S9_STAGE_OUT : 0);
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
      if (MODE == S9_GU_DGRAD || MODE == S9_WGRAD) tma_prefetch_map(&map_a2);
      if (MODE != S9_DOWN && MODE != S9_DOWN_DGRAD) tma_prefetch_map(&map_b1);
    }
  }
  __syncthreads();
  if (s_failed) return; /* one decision for the whole CTA */
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) s9_produce<MODE>(p, &map_a, &map_a2, &map_b0, &map_b1, base, bars);
  } else {
    regs_inc<232>();
    s9_consume<MODE, PIPE>(p, base, bars, &map_a2, &map_b1);
  }
}

/* ---- host side ------------------------------------------------------------------ */

static int s9_grid_override = 0;
static int s9_pipe = 0, s9_band = 0, s9_pol_a = 0, s9_pol_b = 0;

extern "C" void mok_k_sm90_set_grid(int ctas) { s9_grid_override = ctas > 0 ? ctas : 0; }

extern "C" void mok_k_sm90_set_tuning(int pipe, int band, int pol_a, int pol_b) {
  s9_pipe = pipe ? 1 : 0;
  s9_band = band > 0 ? band : 0;
  s9_pol_a = pol_a >= 0 && pol_a <= 2 ? pol_a : 0;
  s9_pol_b = pol_b >= 0 && pol_b <= 2 ? pol_b : 0;
}

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

extern "C" int mok_k_sm90_init(void) {
  const void *k[8] = {(const void *)s9_gemm_kernel<S9_GATE_UP, 0>,
                      (const void *)s9_gemm_kernel<S9_GATE_UP, 1>,
                      (const void *)s9_gemm_kernel<S9_DOWN, 0>,
                      (const void *)s9_gemm_kernel<S9_DOWN, 1>,
                      (const void *)s9_gemm_kernel<S9_DOWN_DGRAD, 0>,
                      (const void *)s9_gemm_kernel<S9_GU_DGRAD, 0>,
                      (const void *)s9_gemm_kernel<S9_WGRAD, 0>,
                      NULL};
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < 8 && k[i] && err == cudaSuccess; i++)
    err = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize, S9_SMEM_BYTES);
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

/* A bf16 tensor [d2][d1][d0] (d0 contiguous, rows of ld elements) as a TMA
 * map with boxes of 64 x box1 (x 1), 128-byte swizzle, zero fill out of
 * bounds (also columns d0..ld-1 of a row). */
static int s9_map_ld(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                     long long d2, long long ld, int box1) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = s9_encode_fn();
  if (!enc) return MOK_EENGINE;
  cuuint64_t dims[3] = {(cuuint64_t)d0, (cuuint64_t)d1, (cuuint64_t)d2};
  cuuint64_t strides[2] = {(cuuint64_t)ld * 2, (cuuint64_t)(ld * d1) * 2};
  cuuint32_t box[3] = {S9_BK, (cuuint32_t)box1, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)ptr, dims, strides,
                   box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? MOK_OK : MOK_EENGINE;
}

static int s9_map(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                  long long d2, int box1) {
  return s9_map_ld(m, ptr, rank, d0, d1, d2, d0, box1);
}

static int s9_grid(int tiles) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    sms = 132;
  }
  int g = s9_grid_override > 0 ? s9_grid_override : sms;
  return g < tiles ? g : tiles;
}

static int s9_bwd_mask = MOK_K_SM90_BWD_DOWN_DGRAD | MOK_K_SM90_BWD_GATE_UP_DGRAD | MOK_K_SM90_BWD_WGRAD;

extern "C" void mok_k_sm90_set_bwd_modes(int mask) { s9_bwd_mask = mask & 7; }
extern "C" int mok_k_sm90_bwd_modes(void) { return s9_bwd_mask; }

static s9_params s9_base(const mok_k_dims *d, const int32_t *schedule, int M, int32_t *status) {
  s9_params p;
  memset(&p, 0, sizeof p);
  p.M = M;
  p.has_limit = d->has_limit;
  p.limit = d->limit;
  p.status = status;
  p.no_tail = d->no_tail;
  if (schedule) {
    sched_ptrs s = sched_view(d, schedule);
    p.E_loc = d->E_loc;
    p.offsets = s.offsets;
    p.counts = s.counts;
    p.row_slot = s.row_slot;
    p.n_slots = s.n_slots;
  }
  return p;
}

template <int MODE>
static int s9_launch(const s9_params &p, const CUtensorMap &a, const CUtensorMap &a2,
                     const CUtensorMap &b0, const CUtensorMap &b1, cudaStream_t stream) {
  const int tiles = p.m_tiles * p.n_tiles * (MODE == S9_WGRAD ? p.groups : 1);
  if (tiles == 0) return MOK_OK;
  s9_params q = p;
  q.band = MODE == S9_WGRAD ? 0 : s9_band;
  q.pol_a = s9_pol_a;
  q.pol_b = s9_pol_b;
  if (s9_pipe && (MODE == S9_GATE_UP || MODE == S9_DOWN))
    s9_gemm_kernel<MODE, (MODE == S9_GATE_UP || MODE == S9_DOWN) ? 1 : 0>
        <<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, a2, b0, b1, q);
  else
    s9_gemm_kernel<MODE, 0><<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, a2, b0, b1, q);
  return mok_k_launch_status();
}

extern "C" int mok_k_sm90_gate_up(const mok_k_dims *d, const int32_t *schedule, int M,
                                  int n_inter, const mok_k_bf16 *x, const mok_k_bf16 *wg,
                                  const mok_k_bf16 *wu, mok_k_bf16 *g, mok_k_bf16 *u,
                                  mok_k_bf16 *h, int32_t *status, mok_k_stream stream) {
  if (M <= 0 || n_inter <= 0) return MOK_OK;
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = n_inter;
  p.K = d->H;
  p.tile_n = S9_BN / 2;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (n_inter + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)g;
  p.C1 = (bf16 *)u;
  p.C2 = (bf16 *)h;
  p.ldc = n_inter;
  CUtensorMap ma, mg, mu;
  int st = s9_map(&ma, x, 2, d->H, M, 1, S9_BM);
  if (st == MOK_OK) st = s9_map(&mg, wg, 3, d->H, n_inter, groups, S9_BN / 2);
  if (st == MOK_OK) st = s9_map(&mu, wu, 3, d->H, n_inter, groups, S9_BN / 2);
  if (st != MOK_OK) return st;
  return s9_launch<S9_GATE_UP>(p, ma, ma, mg, mu, stream);
}

extern "C" int mok_k_sm90_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                               const mok_k_bf16 *h, const mok_k_bf16 *wd, mok_k_bf16 *y,
                               int32_t *status, mok_k_stream stream) {
  if (M <= 0) return MOK_OK;
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = d->H;
  p.K = n_inter;
  p.tile_n = S9_BN;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (d->H + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)y;
  p.ldc = d->H;
  CUtensorMap ma, mb;
  int st = s9_map(&ma, h, 2, n_inter, M, 1, S9_BM);
  if (st == MOK_OK) st = s9_map(&mb, wd, 3, n_inter, d->H, groups, S9_BN);
  if (st != MOK_OK) return st;
  return s9_launch<S9_DOWN>(p, ma, ma, mb, mb, stream);
}

extern "C" int mok_k_sm90_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M,
                                     int n_inter, const mok_k_bf16 *d_out, const mok_k_bf16 *wd,
                                     const mok_k_bf16 *g, const mok_k_bf16 *u, const float *rw,
                                     mok_k_bf16 *dgu, mok_k_bf16 *h, float *partial,
                                     int n_partial, int32_t *status, mok_k_stream stream) {
  if (M <= 0 || n_inter <= 0) return MOK_OK;
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = n_inter;
  p.K = d->H;
  p.tile_n = S9_BN;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (n_inter + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)dgu;
  p.ldc = 2LL * n_inter;
  p.C1 = (bf16 *)h;
  p.G = (const bf16 *)g;
  p.U = (const bf16 *)u;
  p.rw = rw;
  p.partial = partial;
  p.n_partial = n_partial;
  CUtensorMap ma, mb; /* B(k = h, n = i) = W_d[e][h][i]: i contiguous */
  int st = s9_map(&ma, d_out, 2, d->H, M, 1, S9_BM);
  if (st == MOK_OK) st = s9_map(&mb, wd, 3, n_inter, d->H, groups, S9_BK);
  if (st != MOK_OK) return st;
  return s9_launch<S9_DOWN_DGRAD>(p, ma, ma, mb, mb, stream);
}

extern "C" int mok_k_sm90_gate_up_dgrad(const mok_k_dims *d, const int32_t *schedule, int M,
                                        int n_inter, const mok_k_bf16 *dgu,
                                        const mok_k_bf16 *wg, const mok_k_bf16 *wu,
                                        mok_k_bf16 *d_x, int32_t *status, mok_k_stream stream) {
  if (M <= 0) return MOK_OK;
  if (n_inter % 16) return MOK_EINVAL; /* k16 steps must not straddle dg and du */
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = d->H;
  p.K = n_inter; /* per half */
  p.nk_split = (n_inter + S9_BK - 1) / S9_BK;
  p.tile_n = S9_BN;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (d->H + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)d_x;
  p.ldc = d->H;
  /* A: the dg and du halves of each dgu row as two maps (each zero past
   * n_inter); B(k, n = h) = W_g/W_u[e][k][h]: h contiguous */
  CUtensorMap mag, mau, mg, mu;
  int st = s9_map_ld(&mag, dgu, 2, n_inter, M, 1, 2LL * n_inter, S9_BM);
  if (st == MOK_OK) st = s9_map_ld(&mau, dgu + n_inter, 2, n_inter, M, 1, 2LL * n_inter, S9_BM);
  if (st == MOK_OK) st = s9_map(&mg, wg, 3, d->H, n_inter, groups, S9_BK);
  if (st == MOK_OK) st = s9_map(&mu, wu, 3, d->H, n_inter, groups, S9_BK);
  if (st != MOK_OK) return st;
  return s9_launch<S9_GU_DGRAD>(p, mag, mau, mg, mu, stream);
}

extern "C" int mok_k_sm90_wgrad(const mok_k_dims *d, const int32_t *schedule, int groups, int rows,
                                int M, int N, const mok_k_bf16 *a, const mok_k_bf16 *b,
                                mok_k_bf16 *c0, mok_k_bf16 *c1, int c_split, long long ldc,
                                long long c_expert_stride, const int32_t *e_range,
                                int32_t *status, mok_k_stream stream) {
  if (M <= 0 || N <= 0 || groups <= 0) return MOK_OK;
  s9_params p = s9_base(d, schedule, M, status);
  p.e_range = e_range;
  p.N = N;
  p.K = rows > 0 ? rows : 0;
  p.groups = groups;
  p.tile_n = S9_BN;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (N + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)c0;
  p.C1 = (bf16 *)c1;
  p.c_split = c_split;
  p.ldc = ldc;
  p.c_expert_stride = c_expert_stride;
  /* A(m, k = row) = a[row][m], B(k = row, n) = b[row][n]: boxes of 64 x 64.
   * No rows: valid maps that are never read (every tile writes zeros). */
  const int rk = rows > 0 ? rows : 1;
  CUtensorMap ma, mb, mc0, mc1;
  int st = s9_map(&ma, a, 2, M, rk, 1, S9_BK);
  if (st == MOK_OK) st = s9_map(&mb, b, 2, N, rk, 1, S9_BK);
  if (st != MOK_OK) return st;
  /* store maps [groups][rows][N] for each output half, where the layout is
   * that plain (else direct stores) */
  const int rows0 = c_split < M ? c_split : M, rows1 = M - rows0;
  p.wstore = c_expert_stride == ldc * rows0 && (rows1 == 0 || (c1 && ldc * rows1 == c_expert_stride)) &&
             ldc % 8 == 0 &&
             mok_k_aligned16(c0) && mok_k_aligned16(c1) && rows0 > 0;
  if (p.wstore) {
    p.wstore = s9_map_ld(&mc0, c0, 3, N, rows0, groups, ldc, 64) == MOK_OK &&
               (rows1 == 0 || s9_map_ld(&mc1, c1, 3, N, rows1, groups, ldc, 64) == MOK_OK);
    if (rows1 == 0) mc1 = mc0;
  }
  if (!p.wstore) mc0 = mc1 = ma; /* unused */
  return s9_launch<S9_WGRAD>(p, ma, mc0, mb, mc1, stream);
}
