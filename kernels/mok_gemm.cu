/* The expert GEMMs: one tiled bf16 GEMM (mma.sync m16n8k16, f32
 * accumulation, cp.async multi-stage pipeline) instantiated for the five
 * products of the layer, each with its own operand layout and epilogue:
 *
 *   GATE_UP        rows x I,  K=H    A routed_x (K-major), B W_g|W_u (K-major)  -> g, u, h
 *   DOWN           rows x H,  K=I    A h,                  B W_d (K-major)      -> y
 *   DOWN_DGRAD     rows x I,  K=H    A routed_d_out,       B W_d (N-major)      -> dg|du, h, d_rw partials
 *   GATE_UP_DGRAD  rows x H,  K=2I   A dg|du,              B W_g;W_u (N-major)  -> routed_d_x
 *   WGRAD          M x N,  K=rows    A dy or dg|du (M-major), B h or x (N-major) -> d_W (per expert)
 *
 * Row modes walk M tiles of 128 rows over the routed buffer; since groups
 * start at multiples of 128 (the row_align), a tile belongs to one expert,
 * found from the schedule's offsets on the device. Tiles past the last
 * group write zeros. WGRAD gives each (expert, M tile, N tile) to one block
 * that reduces over all the expert's rows in order: no split-K, no atomics.
 * This is the simple, correct version. All five products run on the
 * wgmma/TMA kernels of mok_gemm_sm90.cu (bitwise equal to these) when the
 * device allows it (GATE_UP_DGRAD when I is a multiple of 16);
 * MOK_GEMM=hmma in the environment keeps them all here.
 */
#include <stdlib.h>
#include <string.h>

#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"

#define BM 128
#define BN 128
#define BK 32
#define STAGES 3
#define NTHREADS 256
#define KM_LD (BK + 8) /* K-major tile row pitch (elements): 80 B, ldmatrix conflict-free */
#define MN_LD (BM + 8) /* MN-major tile row pitch: 272 B */

enum gemm_mode { GM_GATE_UP = 0, GM_DOWN, GM_DOWN_DGRAD, GM_GATE_UP_DGRAD, GM_WGRAD };

typedef struct gemm_params {
  int M, N, K;
  const bf16 *A;
  long long lda;
  const bf16 *B0, *B1; /* B1: W_u half of GATE_UP (n) or GATE_UP_DGRAD (k >= b_split) */
  long long ldb, b_expert_stride;
  int b_split;
  bf16 *C0, *C1, *C2;
  long long ldc, c_expert_stride;
  int c_split; /* WGRAD: output rows >= c_split go to C1 */
  /* schedule (grouped) or one group of M rows (shared expert) */
  int grouped, E_loc, n_slots;
  const int32_t *e_range; /* WGRAD: device [e0, e1), other experts' blocks return (NULL: all) */
  int no_tail;            /* row modes: blocks past the last group return instead of zeroing */
  const int32_t *offsets, *counts, *row_slot;
  /* DOWN_DGRAD */
  const float *rw; /* NULL: rw = 1 (shared expert) */
  const bf16 *G, *U;
  float *partial; /* NULL: no d_rw */
  int n_partial;
  int has_limit;
  float limit;
  const int32_t *status;
} gemm_params;

template <int MODE> struct mode_traits {
  static constexpr bool a_kmajor = MODE != GM_WGRAD;
  static constexpr bool b_kmajor = MODE == GM_GATE_UP || MODE == GM_DOWN;
  static constexpr int a_elems = a_kmajor ? BM * KM_LD : BK * MN_LD;
  static constexpr int b_elems = b_kmajor ? BN * KM_LD : BK * MN_LD;
  static constexpr int stage_elems = a_elems + b_elems;
  static constexpr int smem_bytes = STAGES * stage_elems * 2;
};

int mok_k_partial_tiles(const mok_k_dims *d) { return (d->I + BN - 1) / BN; }

/* ---- PTX wrappers ------------------------------------------------------------ */

__device__ static inline uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16-byte async copy; with valid == false the destination is zero-filled
 * and nothing is read. */
__device__ static inline void cp_async16(bf16 *dst, const bf16 *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ static inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ static inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ static inline void ldmatrix_x4(uint32_t (&r)[4], const bf16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ static inline void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ static inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* ---- SwiGLU pieces (docs/math.md; explicit roundings, no contraction) ------- */

__device__ static inline float sigmoid_f(float v) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v)));
}
__device__ static inline float silu_f(float v) { return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v))); }

/* ---- tile loads ---------------------------------------------------------------- */

/* Where the block's tile lies. Row modes: rows [row0, store_end) are
 * written, [row0, used_end) hold real rows (the rest: zeros). WGRAD: the
 * expert's rows [k_begin, k_end) are the reduction. */
typedef struct tile_pos {
  int e;
  int row0, used_end, store_end;
  int m0, k_begin, k_end;
  int n_blk;
} tile_pos;

template <int MODE>
__device__ static inline void load_stage(const gemm_params &p, const tile_pos &tp, bf16 *sA,
                                         bf16 *sB, int kt) {
  const int tid = threadIdx.x;
  const long long e = tp.e < 0 ? 0 : tp.e;
  if constexpr (mode_traits<MODE>::a_kmajor) {
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * NTHREADS, rr = id >> 2, kc = (id & 3) * 8;
      const int grow = tp.row0 + rr, gk = k0 + kc;
      const bool v = grow < tp.used_end && gk < p.K;
      cp_async16(sA + rr * KM_LD + kc, v ? p.A + (long long)grow * p.lda + gk : p.A, v);
    }
  } else { /* M-major A(m, k) = A[k * lda + m] */
    const int k0 = tp.k_begin + kt * BK;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * NTHREADS, kr = id >> 4, mc = (id & 15) * 8;
      const int gk = k0 + kr, gm = tp.m0 + mc;
      const bool v = gk < tp.k_end && gm < p.M;
      cp_async16(sA + kr * MN_LD + mc, v ? p.A + (long long)gk * p.lda + gm : p.A, v);
    }
  }
  if constexpr (mode_traits<MODE>::b_kmajor) { /* B(k, n) = W[n * ldb + k] */
    const int k0 = kt * BK;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * NTHREADS, nr = id >> 2, kc = (id & 3) * 8;
      const int gk = k0 + kc;
      const bf16 *base;
      int n;
      if constexpr (MODE == GM_GATE_UP) { /* rows 0..63 gate, 64..127 up, same columns */
        base = nr < 64 ? p.B0 : p.B1;
        n = tp.n_blk * (BN / 2) + (nr & 63);
      } else {
        base = p.B0;
        n = tp.n_blk * BN + nr;
      }
      const bool v = n < p.N && gk < p.K;
      cp_async16(sB + nr * KM_LD + kc,
                 v ? base + e * p.b_expert_stride + (long long)n * p.ldb + gk : p.B0, v);
    }
  } else { /* N-major B(k, n) = W[k * ldb + n] */
    const int k0 = MODE == GM_WGRAD ? tp.k_begin + kt * BK : kt * BK;
    const int k_lim = MODE == GM_WGRAD ? tp.k_end : p.K;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * NTHREADS, kr = id >> 4, nc = (id & 15) * 8;
      const int gk = k0 + kr, gn = tp.n_blk * BN + nc;
      const bool v = gk < k_lim && gn < p.N;
      const bf16 *src = p.B0;
      if (v) {
        if constexpr (MODE == GM_GATE_UP_DGRAD) {
          src = gk < p.b_split ? p.B0 + e * p.b_expert_stride + (long long)gk * p.ldb
                               : p.B1 + e * p.b_expert_stride + (long long)(gk - p.b_split) * p.ldb;
        } else if constexpr (MODE == GM_WGRAD) {
          src = p.B0 + (long long)gk * p.ldb;
        } else {
          src = p.B0 + e * p.b_expert_stride + (long long)gk * p.ldb;
        }
        src += gn;
      }
      cp_async16(sB + kr * MN_LD + nc, src, v);
    }
  }
}

/* Column (within the B tile) of the warp's n8 tiles 2*jp and 2*jp+1. */
template <int MODE> __device__ static inline int warp_ncol(int wn, int jp) {
  if constexpr (MODE == GM_GATE_UP) return jp * (BN / 2) + wn * 16; /* gate pair, up pair */
  return wn * 32 + jp * 16;
}

template <int MODE>
__device__ static inline void compute_stage(const bf16 *sA, const bf16 *sB,
                                            float (&acc)[4][4][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, wm = warp >> 2, wn = warp & 3;
#pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    uint32_t af[4][4], bfr[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; mi++) {
      const int mbase = wm * 64 + mi * 16;
      if constexpr (mode_traits<MODE>::a_kmajor) {
        ldmatrix_x4(af[mi], sA + (mbase + (lane & 15)) * KM_LD + kk + (lane >> 4) * 8);
      } else {
        const int i = lane >> 3, r = lane & 7;
        ldmatrix_x4_trans(af[mi], sA + (kk + r + (i >> 1) * 8) * MN_LD + mbase + (i & 1) * 8);
      }
    }
#pragma unroll
    for (int jp = 0; jp < 2; jp++) {
      const int nb = warp_ncol<MODE>(wn, jp), i = lane >> 3, r = lane & 7;
      uint32_t t[4];
      if constexpr (mode_traits<MODE>::b_kmajor)
        ldmatrix_x4(t, sB + (nb + r + (i >> 1) * 8) * KM_LD + kk + (i & 1) * 8);
      else
        ldmatrix_x4_trans(t, sB + (kk + r + (i & 1) * 8) * MN_LD + nb + (i >> 1) * 8);
      bfr[2 * jp][0] = t[0];
      bfr[2 * jp][1] = t[1];
      bfr[2 * jp + 1][0] = t[2];
      bfr[2 * jp + 1][1] = t[3];
    }
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
      for (int j = 0; j < 4; j++) mma_bf16(acc[mi][j], af[mi], bfr[j][0], bfr[j][1]);
  }
}

__device__ static inline void store_bf16x2(bf16 *dst, float a, float b) {
  *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}

/* ---- the kernel ------------------------------------------------------------------ */

template <int MODE> __global__ void __launch_bounds__(NTHREADS, 2) gemm_kernel(const gemm_params p) {
  if (job_failed(p.status)) return;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16 *smem = (bf16 *)smem_raw;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wm = warp >> 2, wn = warp & 3;
  const int g = lane >> 2, q = lane & 3;

  tile_pos tp;
  tp.n_blk = blockIdx.y;
  tp.e = 0;
  tp.row0 = tp.used_end = tp.store_end = 0;
  tp.m0 = tp.k_begin = tp.k_end = 0;
  int nk;
  if constexpr (MODE == GM_WGRAD) {
    tp.e = blockIdx.z;
    /* another macrobatch's expert: its gradient is not this launch's to write */
    if (p.e_range && (tp.e < p.e_range[0] || tp.e >= p.e_range[1])) return;
    tp.m0 = blockIdx.x * BM;
    if (p.grouped) { /* clamped, so even an unchecked schedule stays in bounds */
      const int off = min(max(p.offsets[tp.e], 0), p.K);
      tp.k_begin = off;
      tp.k_end = off + min(max(p.counts[tp.e], 0), p.K - off);
    } else {
      tp.k_end = p.K;
    }
    nk = (tp.k_end - tp.k_begin + BK - 1) / BK;
  } else {
    tp.row0 = blockIdx.x * BM;
    if (p.grouped) {
      const int rows_used = min(max(p.offsets[p.E_loc], 0), p.M);
      if (tp.row0 >= rows_used) { /* past the last group: zeros */
        if (p.no_tail) return;    /* (the whole block: nothing to write) */
        tp.e = -1;
        tp.used_end = tp.row0;
        tp.store_end = min(tp.row0 + BM, p.M);
      } else {
        tp.e = find_group(p.offsets, p.E_loc, tp.row0);
        const int group_end = min(max(p.offsets[tp.e + 1], tp.row0), p.M);
        tp.store_end = min(tp.row0 + BM, group_end);
        const long long used = (long long)p.offsets[tp.e] + max(p.counts[tp.e], 0);
        tp.used_end = (int)min(max(used, (long long)tp.row0), (long long)tp.store_end);
      }
    } else {
      tp.used_end = tp.store_end = min(tp.row0 + BM, p.M);
    }
    nk = tp.used_end > tp.row0 ? (p.K + BK - 1) / BK : 0;
  }

  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[mi][j][c] = 0.0f;

  constexpr int a_elems = mode_traits<MODE>::a_elems, stage_elems = mode_traits<MODE>::stage_elems;
  if (nk > 0) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; s++) {
      if (s < nk) load_stage<MODE>(p, tp, smem + s * stage_elems, smem + s * stage_elems + a_elems, s);
      cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
      cp_async_wait<STAGES - 2>();
      __syncthreads(); /* stage kt landed for all; stage kt-1 no longer read */
      const int next = kt + STAGES - 1;
      if (next < nk) {
        bf16 *st = smem + (next % STAGES) * stage_elems;
        load_stage<MODE>(p, tp, st, st + a_elems, next);
      }
      cp_async_commit();
      const bf16 *cur = smem + (kt % STAGES) * stage_elems;
      compute_stage<MODE>(cur, cur + a_elems, acc);
    }
    cp_async_wait<0>();
  }
  __syncthreads(); /* the epilogue may reuse shared memory */

  /* ---- epilogues: thread holds rows (g, g+8) x cols (2q, 2q+1) of each 16x8 tile */
  if constexpr (MODE == GM_WGRAD) {
    const long long cbase = (long long)tp.e * p.c_expert_stride;
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int m = tp.m0 + wm * 64 + mi * 16 + g + 8 * hh;
        if (m >= p.M) continue;
        bf16 *row = m < p.c_split ? p.C0 + cbase + (long long)m * p.ldc
                                  : p.C1 + cbase + (long long)(m - p.c_split) * p.ldc;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int n = tp.n_blk * BN + wn * 32 + j * 8 + 2 * q;
          if (n < p.N) store_bf16x2(row + n, acc[mi][j][2 * hh], acc[mi][j][2 * hh + 1]);
        }
      }
  } else if constexpr (MODE == GM_GATE_UP) {
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int r = tp.row0 + wm * 64 + mi * 16 + g + 8 * hh;
        if (r >= tp.store_end) continue;
        const bool used = r < tp.used_end;
#pragma unroll
        for (int jj = 0; jj < 2; jj++) {
          const int n = tp.n_blk * (BN / 2) + wn * 16 + jj * 8 + 2 * q;
          if (n >= p.N) continue;
          float gv[2], uv[2], hv[2];
#pragma unroll
          for (int c = 0; c < 2; c++) {
            if (!used) {
              gv[c] = uv[c] = hv[c] = 0.0f;
              continue;
            }
            gv[c] = bf2f(f2bf(acc[mi][jj][2 * hh + c]));
            uv[c] = bf2f(f2bf(acc[mi][jj + 2][2 * hh + c]));
            float gc = gv[c], uc = uv[c];
            if (p.has_limit) {
              gc = fminf(gc, p.limit);
              uc = fminf(fmaxf(uc, -p.limit), p.limit);
            }
            hv[c] = __fmul_rn(silu_f(gc), uc);
          }
          const long long at = (long long)r * p.ldc + n;
          store_bf16x2(p.C0 + at, gv[0], gv[1]);
          store_bf16x2(p.C1 + at, uv[0], uv[1]);
          store_bf16x2(p.C2 + at, hv[0], hv[1]);
        }
      }
  } else if constexpr (MODE == GM_DOWN || MODE == GM_GATE_UP_DGRAD) {
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        const int r = tp.row0 + wm * 64 + mi * 16 + g + 8 * hh;
        if (r >= tp.store_end) continue;
        const bool used = r < tp.used_end;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int n = tp.n_blk * BN + wn * 32 + j * 8 + 2 * q;
          if (n >= p.N) continue;
          store_bf16x2(p.C0 + (long long)r * p.ldc + n, used ? acc[mi][j][2 * hh] : 0.0f,
                       used ? acc[mi][j][2 * hh + 1] : 0.0f);
        }
      }
  } else { /* GM_DOWN_DGRAD: a = acc; SwiGLU backward; dg|du to C0 (ldc = 2N), h to C1 (N) */
    float rowsum[4][2];
#pragma unroll
    for (int mi = 0; mi < 4; mi++)
#pragma unroll
      for (int hh = 0; hh < 2; hh++) {
        rowsum[mi][hh] = 0.0f;
        const int r = tp.row0 + wm * 64 + mi * 16 + g + 8 * hh;
        if (r >= tp.store_end) continue;
        const bool used = r < tp.used_end;
        float w = 1.0f;
        if (p.rw) {
          const int s = p.row_slot[r];
          w = (s >= 0 && s < p.n_slots) ? p.rw[s] : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int n = tp.n_blk * BN + wn * 32 + j * 8 + 2 * q;
          if (n >= p.N) continue;
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
              const float a = acc[mi][j][2 * hh + c];
              const float sig = sigmoid_f(gc), silu = silu_f(gc);
              hv[c] = bf2f(f2bf(__fmul_rn(silu, uc)));
              rowsum[mi][hh] = __fadd_rn(rowsum[mi][hh], __fmul_rn(a, hv[c]));
              const float dh = __fmul_rn(w, a);
              const float dsilu =
                  __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gc, __fsub_rn(1.0f, sig))));
              dg[c] = pass_g ? __fmul_rn(__fmul_rn(dh, uc), dsilu) : 0.0f;
              du[c] = pass_u ? __fmul_rn(dh, silu) : 0.0f;
            }
          }
          store_bf16x2(p.C0 + (long long)r * p.ldc + n, dg[0], dg[1]);
          store_bf16x2(p.C0 + (long long)r * p.ldc + p.N + n, du[0], du[1]);
          store_bf16x2(p.C1 + at, hv[0], hv[1]);
        }
      }
    if (p.partial) { /* d_rw partial of this column tile: quad, then warps in order */
      float *red = (float *)smem_raw; /* [4 warp columns][BM rows] */
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          float v = rowsum[mi][hh];
          v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
          v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
          if (q == 0) red[wn * BM + wm * 64 + mi * 16 + g + 8 * hh] = v;
        }
      __syncthreads();
      if (tid < BM) {
        const int r = tp.row0 + tid;
        if (r < tp.store_end) {
          float v = red[tid];
          v = __fadd_rn(v, red[BM + tid]);
          v = __fadd_rn(v, red[2 * BM + tid]);
          v = __fadd_rn(v, red[3 * BM + tid]);
          p.partial[(long long)r * p.n_partial + tp.n_blk] = v;
        }
      }
    }
  }
}

/* ---- launchers ----------------------------------------------------------------- */

int mok_k_scale_rows(const mok_k_dims *d, const int32_t *schedule, const bf16 *src,
                     const float *rw, bf16 *dst, int32_t *status, cudaStream_t stream);
int mok_k_drw_reduce(const mok_k_dims *d, const int32_t *schedule, const float *partial,
                     float *d_rw, int32_t *status, cudaStream_t stream);

template <int MODE> static int launch_gemm(const gemm_params &p, dim3 grid, cudaStream_t stream) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return MOK_OK;
  gemm_kernel<MODE><<<grid, NTHREADS, mode_traits<MODE>::smem_bytes, stream>>>(p);
  return mok_k_launch_status();
}

template <int MODE> static int set_smem_limit(void) {
  cudaError_t err = cudaFuncSetAttribute(gemm_kernel<MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         mode_traits<MODE>::smem_bytes);
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

extern "C" int mok_k_init(void) {
  int st = set_smem_limit<GM_GATE_UP>();
  if (st == MOK_OK) st = set_smem_limit<GM_DOWN>();
  if (st == MOK_OK) st = set_smem_limit<GM_DOWN_DGRAD>();
  if (st == MOK_OK) st = set_smem_limit<GM_GATE_UP_DGRAD>();
  if (st == MOK_OK) st = set_smem_limit<GM_WGRAD>();
  if (st == MOK_OK && mok_k_sm90_usable()) st = mok_k_sm90_init();
  return st;
}

static unsigned cdiv(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

static bool all_aligned(const void *a, const void *b, const void *c, const void *d,
                        const void *e, const void *f) {
  return mok_k_aligned16(a) && mok_k_aligned16(b) && mok_k_aligned16(c) && mok_k_aligned16(d) &&
         mok_k_aligned16(e) && mok_k_aligned16(f);
}

static gemm_params params_base(const mok_k_dims *d, const int32_t *status) {
  gemm_params p;
  memset(&p, 0, sizeof p);
  p.has_limit = d->has_limit;
  p.limit = d->limit;
  p.status = status;
  p.no_tail = d->no_tail;
  return p;
}

static void params_grouped(gemm_params *p, const mok_k_dims *d, const int32_t *schedule) {
  sched_ptrs s = sched_view(d, schedule);
  p->grouped = 1;
  p->E_loc = d->E_loc;
  p->n_slots = s.n_slots;
  p->offsets = s.offsets;
  p->counts = s.counts;
  p->row_slot = s.row_slot;
}

/* The GEMMs go to the Hopper kernels unless MOK_GEMM=hmma (read at every
 * launch, so a test can compare both paths in one process). */
static bool use_sm90(void) {
  const char *v = getenv("MOK_GEMM");
  if (v && !strcmp(v, "hmma")) return false;
  return mok_k_sm90_usable() != 0;
}

/* A backward mode (MOK_K_SM90_BWD_*) on the Hopper kernels */
static bool use_sm90_bwd(int mode_bit) { return (mok_k_sm90_bwd_modes() & mode_bit) && use_sm90(); }

extern "C" int mok_k_backward_on_hopper(const mok_k_dims *d) {
  const int all = MOK_K_SM90_BWD_DOWN_DGRAD | MOK_K_SM90_BWD_GATE_UP_DGRAD | MOK_K_SM90_BWD_WGRAD;
  return d && (mok_k_sm90_bwd_modes() & all) == all && use_sm90() && d->I % 16 == 0 &&
         (d->I_s == 0 || d->I_s % 16 == 0);
}

/* One SwiGLU FFN forward over M rows: gate/up then down. grouped: routed
 * (schedule), else the shared expert (one group of T rows). */
static int ffn_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                       const bf16 *x, const bf16 *wg, const bf16 *wu, bf16 *g, bf16 *u, bf16 *h,
                       int32_t *status, cudaStream_t stream) {
  if (use_sm90())
    return mok_k_sm90_gate_up(d, schedule, M, n_inter, (const mok_k_bf16 *)x,
                              (const mok_k_bf16 *)wg, (const mok_k_bf16 *)wu, (mok_k_bf16 *)g,
                              (mok_k_bf16 *)u, (mok_k_bf16 *)h, status, stream);
  gemm_params p = params_base(d, status);
  if (schedule) params_grouped(&p, d, schedule);
  p.M = M;
  p.N = n_inter;
  p.K = d->H;
  p.A = x;
  p.lda = d->H;
  p.B0 = wg;
  p.B1 = wu;
  p.ldb = d->H;
  p.b_expert_stride = (long long)n_inter * d->H;
  p.C0 = g;
  p.C1 = u;
  p.C2 = h;
  p.ldc = n_inter;
  return launch_gemm<GM_GATE_UP>(p, dim3(cdiv(M, BM), cdiv(n_inter, BN / 2)), stream);
}

static int ffn_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                    const bf16 *h, const bf16 *wd, bf16 *y, int32_t *status, cudaStream_t stream) {
  if (use_sm90())
    return mok_k_sm90_down(d, schedule, M, n_inter, (const mok_k_bf16 *)h, (const mok_k_bf16 *)wd,
                           (mok_k_bf16 *)y, status, stream);
  gemm_params p = params_base(d, status);
  if (schedule) params_grouped(&p, d, schedule);
  p.M = M;
  p.N = d->H;
  p.K = n_inter;
  p.A = h;
  p.lda = n_inter;
  p.B0 = wd;
  p.ldb = n_inter;
  p.b_expert_stride = (long long)d->H * n_inter;
  p.C0 = y;
  p.ldc = d->H;
  return launch_gemm<GM_DOWN>(p, dim3(cdiv(M, BM), cdiv(d->H, BN)), stream);
}

extern "C" int mok_k_gate_up_swiglu(const mok_k_dims *d, const int32_t *schedule,
                                    const mok_k_bf16 *routed_x, const mok_k_bf16 *w_gate,
                                    const mok_k_bf16 *w_up, mok_k_bf16 *acts_g,
                                    mok_k_bf16 *acts_u, mok_k_bf16 *h, int32_t *status,
                                    mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !routed_x || !w_gate ||
      !w_up || !acts_g || !acts_u || !h || !all_aligned(routed_x, w_gate, w_up, acts_g, acts_u, h))
    return MOK_EINVAL;
  return ffn_gate_up(d, schedule, (int)mok_k_rows_capacity(d), d->I, (const bf16 *)routed_x,
                     (const bf16 *)w_gate, (const bf16 *)w_up, (bf16 *)acts_g, (bf16 *)acts_u,
                     (bf16 *)h, status, stream);
}

extern "C" int mok_k_down(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *h,
                          const mok_k_bf16 *w_down, mok_k_bf16 *routed_y, int32_t *status,
                          mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !h || !w_down ||
      !routed_y || !all_aligned(h, w_down, routed_y, NULL, NULL, NULL))
    return MOK_EINVAL;
  return ffn_down(d, schedule, (int)mok_k_rows_capacity(d), d->I, (const bf16 *)h,
                  (const bf16 *)w_down, (bf16 *)routed_y, status, stream);
}

extern "C" int mok_k_expert_forward(const mok_k_dims *d, const int32_t *schedule,
                                    const mok_k_bf16 *routed_x, const mok_k_bf16 *w_gate,
                                    const mok_k_bf16 *w_up, const mok_k_bf16 *w_down,
                                    mok_k_bf16 *acts_g, mok_k_bf16 *acts_u, mok_k_bf16 *routed_y,
                                    void *workspace, int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !workspace || !mok_k_aligned16(workspace))
    return MOK_EINVAL;
  mok_k_bf16 *h = (mok_k_bf16 *)((char *)workspace + mok_k_ws_layout(d).h);
  int st = mok_k_gate_up_swiglu(d, schedule, routed_x, w_gate, w_up, acts_g, acts_u, h, status,
                                stream);
  if (st != MOK_OK) return st;
  return mok_k_down(d, schedule, h, w_down, routed_y, status, stream);
}

extern "C" int mok_k_shared_forward(const mok_k_dims *d, const mok_k_bf16 *x,
                                    const mok_k_bf16 *s_gate, const mok_k_bf16 *s_up,
                                    const mok_k_bf16 *s_down, mok_k_bf16 *acts_gs,
                                    mok_k_bf16 *acts_us, mok_k_bf16 *shared_y, void *workspace,
                                    int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK) return MOK_EINVAL;
  if (d->I_s == 0 || d->T == 0) return MOK_OK;
  if (!status || !x || !s_gate || !s_up || !s_down || !acts_gs || !acts_us || !shared_y ||
      !workspace || !all_aligned(x, s_gate, s_up, s_down, acts_gs, acts_us) ||
      !all_aligned(shared_y, workspace, NULL, NULL, NULL, NULL))
    return MOK_EINVAL;
  bf16 *hs = (bf16 *)((char *)workspace + mok_k_ws_layout(d).hs);
  int st = ffn_gate_up(d, NULL, d->T, d->I_s, (const bf16 *)x, (const bf16 *)s_gate,
                       (const bf16 *)s_up, (bf16 *)acts_gs, (bf16 *)acts_us, hs, status, stream);
  if (st != MOK_OK) return st;
  return ffn_down(d, NULL, d->T, d->I_s, hs, (const bf16 *)s_down, (bf16 *)shared_y, status,
                  stream);
}

/* One SwiGLU FFN backward (routed when schedule != NULL, else shared):
 *   down dgrad + SwiGLU backward -> dgu [M, 2n], h [M, n], d_rw partials
 *   gate/up dgrad -> d_xr [M, H]
 *   wgrads: d_wd = dy^T h, [d_wg; d_wu] = dgu^T x, per expert. */
typedef struct ffn_bwd_args {
  int M, n_inter, groups;
  const bf16 *x, *d_out, *dy, *g, *u, *wg, *wu, *wd;
  const float *rw;
  bf16 *dgu, *h, *d_xr, *d_wg, *d_wu, *d_wd;
  float *partial;
  const int32_t *e_range; /* device [e0, e1): weight gradients of these experts only */
} ffn_bwd_args;

static int ffn_backward(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                        int32_t *status, cudaStream_t stream) {
  const int n = a->n_inter;
  gemm_params p = params_base(d, status);
  if (schedule) params_grouped(&p, d, schedule);
  /* a = d_out W_d, SwiGLU backward */
  p.M = a->M;
  p.N = n;
  p.K = d->H;
  p.A = a->d_out;
  p.lda = d->H;
  p.B0 = a->wd;
  p.ldb = n;
  p.b_expert_stride = (long long)d->H * n;
  p.C0 = a->dgu;
  p.ldc = 2LL * n;
  p.C1 = a->h;
  p.G = a->g;
  p.U = a->u;
  p.rw = a->rw;
  p.partial = a->partial;
  p.n_partial = cdiv(n, BN);
  int st;
  if (use_sm90_bwd(MOK_K_SM90_BWD_DOWN_DGRAD))
    st = mok_k_sm90_down_dgrad(d, schedule, a->M, n, (const mok_k_bf16 *)a->d_out,
                               (const mok_k_bf16 *)a->wd, (const mok_k_bf16 *)a->g,
                               (const mok_k_bf16 *)a->u, a->rw, (mok_k_bf16 *)a->dgu,
                               (mok_k_bf16 *)a->h, a->partial, p.n_partial, status, stream);
  else
    st = launch_gemm<GM_DOWN_DGRAD>(p, dim3(cdiv(a->M, BM), cdiv(n, BN)), stream);
  if (st != MOK_OK) return st;
  /* d_xr = dg W_g + du W_u */
  p.N = d->H;
  p.K = 2 * n;
  p.A = a->dgu;
  p.lda = 2LL * n;
  p.B0 = a->wg;
  p.B1 = a->wu;
  p.ldb = d->H;
  p.b_expert_stride = (long long)n * d->H;
  p.b_split = n;
  p.C0 = a->d_xr;
  p.C1 = NULL;
  p.ldc = d->H;
  p.rw = NULL;
  p.partial = NULL;
  if (use_sm90_bwd(MOK_K_SM90_BWD_GATE_UP_DGRAD) && n % 16 == 0)
    st = mok_k_sm90_gate_up_dgrad(d, schedule, a->M, n, (const mok_k_bf16 *)a->dgu,
                                  (const mok_k_bf16 *)a->wg, (const mok_k_bf16 *)a->wu,
                                  (mok_k_bf16 *)a->d_xr, status, stream);
  else
    st = launch_gemm<GM_GATE_UP_DGRAD>(p, dim3(cdiv(a->M, BM), cdiv(d->H, BN)), stream);
  if (st != MOK_OK) return st;
  /* d_wd[e] = dy^T h over the expert's rows */
  gemm_params w = params_base(d, status);
  if (schedule) params_grouped(&w, d, schedule);
  w.M = d->H;
  w.N = n;
  w.K = a->M;
  w.A = a->dy;
  w.lda = d->H;
  w.B0 = a->h;
  w.ldb = n;
  w.C0 = a->d_wd;
  w.c_split = d->H;
  w.ldc = n;
  w.c_expert_stride = (long long)d->H * n;
  w.e_range = a->e_range;
  const bool wg90 = use_sm90_bwd(MOK_K_SM90_BWD_WGRAD);
  if (wg90)
    st = mok_k_sm90_wgrad(d, schedule, a->groups, w.K, w.M, w.N, (const mok_k_bf16 *)w.A,
                          (const mok_k_bf16 *)w.B0, (mok_k_bf16 *)w.C0, (mok_k_bf16 *)w.C1,
                          w.c_split, w.ldc, w.c_expert_stride, a->e_range, status, stream);
  else
    st = launch_gemm<GM_WGRAD>(w, dim3(cdiv(d->H, BM), cdiv(n, BN), a->groups), stream);
  if (st != MOK_OK) return st;
  /* [d_wg; d_wu][e] = dgu^T x */
  w.M = 2 * n;
  w.N = d->H;
  w.A = a->dgu;
  w.lda = 2LL * n;
  w.B0 = a->x;
  w.ldb = d->H;
  w.C0 = a->d_wg;
  w.C1 = a->d_wu;
  w.c_split = n;
  w.ldc = d->H;
  w.c_expert_stride = (long long)n * d->H;
  if (wg90)
    return mok_k_sm90_wgrad(d, schedule, a->groups, w.K, w.M, w.N, (const mok_k_bf16 *)w.A,
                            (const mok_k_bf16 *)w.B0, (mok_k_bf16 *)w.C0, (mok_k_bf16 *)w.C1,
                            w.c_split, w.ldc, w.c_expert_stride, a->e_range, status, stream);
  return launch_gemm<GM_WGRAD>(w, dim3(cdiv(2LL * n, BM), cdiv(d->H, BN), a->groups), stream);
}

extern "C" int mok_k_expert_backward(const mok_k_dims *d, const int32_t *schedule,
                                     const mok_k_bf16 *acts_g, const mok_k_bf16 *acts_u,
                                     const mok_k_bf16 *routed_x, const mok_k_bf16 *routed_d_out,
                                     const float *router_weights, const mok_k_bf16 *w_gate,
                                     const mok_k_bf16 *w_up, const mok_k_bf16 *w_down,
                                     mok_k_bf16 *routed_d_x, float *d_rw, mok_k_bf16 *d_w_gate,
                                     mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down, void *workspace,
                                     int32_t *status, mok_k_stream stream) {
  return mok_k_expert_backward_experts(d, schedule, acts_g, acts_u, routed_x, routed_d_out,
                                       router_weights, w_gate, w_up, w_down, routed_d_x, d_rw,
                                       d_w_gate, d_w_up, d_w_down, NULL, workspace, status,
                                       stream);
}

extern "C" int mok_k_expert_backward_experts(
    const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *acts_g,
    const mok_k_bf16 *acts_u, const mok_k_bf16 *routed_x, const mok_k_bf16 *routed_d_out,
    const float *router_weights, const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
    const mok_k_bf16 *w_down, mok_k_bf16 *routed_d_x, float *d_rw, mok_k_bf16 *d_w_gate,
    mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down, const int32_t *expert_range, void *workspace,
    int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !acts_g || !acts_u ||
      !routed_x || !routed_d_out || !w_gate || !w_up || !w_down || !routed_d_x || !d_w_gate ||
      !d_w_up || !d_w_down || !workspace || (d->T > 0 && (!router_weights || !d_rw)) ||
      !all_aligned(acts_g, acts_u, routed_x, routed_d_out, w_gate, w_up) ||
      !all_aligned(w_down, routed_d_x, d_w_gate, d_w_up, d_w_down, workspace))
    return MOK_EINVAL;
  const ws_layout L = mok_k_ws_layout(d);
  char *ws = (char *)workspace;
  ffn_bwd_args a;
  a.M = (int)mok_k_rows_capacity(d);
  a.n_inter = d->I;
  a.groups = d->E_loc;
  a.x = (const bf16 *)routed_x;
  a.d_out = (const bf16 *)routed_d_out;
  a.dy = (const bf16 *)(ws + L.dy);
  a.g = (const bf16 *)acts_g;
  a.u = (const bf16 *)acts_u;
  a.wg = (const bf16 *)w_gate;
  a.wu = (const bf16 *)w_up;
  a.wd = (const bf16 *)w_down;
  a.rw = router_weights;
  a.dgu = (bf16 *)(ws + L.dgu);
  a.h = (bf16 *)(ws + L.h);
  a.d_xr = (bf16 *)routed_d_x;
  a.d_wg = (bf16 *)d_w_gate;
  a.d_wu = (bf16 *)d_w_up;
  a.d_wd = (bf16 *)d_w_down;
  a.partial = (float *)(ws + L.partial);
  a.e_range = expert_range;
  /* dy = rnd(rw * routed_d_out), the down-projection wgrad operand */
  int st = mok_k_scale_rows(d, schedule, (const bf16 *)routed_d_out, router_weights,
                            (bf16 *)(ws + L.dy), status, stream);
  if (st == MOK_OK) st = ffn_backward(d, schedule, &a, status, stream);
  if (st == MOK_OK) st = mok_k_drw_reduce(d, schedule, a.partial, d_rw, status, stream);
  return st;
}

extern "C" int mok_k_shared_backward(const mok_k_dims *d, const mok_k_bf16 *x,
                                     const mok_k_bf16 *d_out, const mok_k_bf16 *acts_gs,
                                     const mok_k_bf16 *acts_us, const mok_k_bf16 *s_gate,
                                     const mok_k_bf16 *s_up, const mok_k_bf16 *s_down,
                                     mok_k_bf16 *shared_d_x, mok_k_bf16 *d_s_gate,
                                     mok_k_bf16 *d_s_up, mok_k_bf16 *d_s_down, void *workspace,
                                     int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK) return MOK_EINVAL;
  if (d->I_s == 0) return MOK_OK;
  if (!status || !s_gate || !s_up || !s_down || !d_s_gate || !d_s_up || !d_s_down || !workspace ||
      (d->T > 0 && (!x || !d_out || !acts_gs || !acts_us || !shared_d_x)) ||
      !all_aligned(x, d_out, acts_gs, acts_us, s_gate, s_up) ||
      !all_aligned(s_down, shared_d_x, d_s_gate, d_s_up, d_s_down, workspace))
    return MOK_EINVAL;
  const ws_layout L = mok_k_ws_layout(d);
  char *ws = (char *)workspace;
  ffn_bwd_args a;
  a.M = d->T;
  a.n_inter = d->I_s;
  a.groups = 1;
  a.e_range = NULL;
  a.x = (const bf16 *)x;
  a.d_out = (const bf16 *)d_out;
  a.dy = (const bf16 *)d_out; /* rw = 1: dy = d_out exactly */
  a.g = (const bf16 *)acts_gs;
  a.u = (const bf16 *)acts_us;
  a.wg = (const bf16 *)s_gate;
  a.wu = (const bf16 *)s_up;
  a.wd = (const bf16 *)s_down;
  a.rw = NULL;
  a.dgu = (bf16 *)(ws + L.dgus);
  a.h = (bf16 *)(ws + L.hs);
  a.d_xr = (bf16 *)shared_d_x;
  a.d_wg = (bf16 *)d_s_gate;
  a.d_wu = (bf16 *)d_s_up;
  a.d_wd = (bf16 *)d_s_down;
  a.partial = NULL;
  return ffn_backward(d, NULL, &a, status, stream);
}
