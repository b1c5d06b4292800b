/* SPDX-License-Identifier: Apache-2.0 */
/* The expert GEMMs on mma.sync: one tiled bf16 GEMM (mma.sync m16n8k16, f32
 * accumulation, cp.async multi-stage pipeline) instantiated for the five
 * products of the layer (common/gemm_params.cuh), each with its own
 * operand layout and epilogue; and the launchers of the C API, which build
 * each product's parameters once and run it on the GEMM backend chosen at
 * mok_k_init: the wgmma/TMA kernels of mok_gemm_sm90.cu (bitwise equal to
 * these) when the device allows it (GU_DGRAD when I is a multiple of 16),
 * or these kernels for all (MOK_GEMM=hmma in the environment at init).
 *
 * Row modes walk M tiles of 128 rows over the routed buffer; since groups
 * start at multiples of 128 (the row_align), a tile belongs to one expert,
 * found from the schedule's offsets on the device (common/tile_locator.cuh).
 * Tiles past the last group write zeros. WGRAD gives each (expert, M tile,
 * N tile) to one block that reduces over all the expert's rows in order:
 * no split-K, no atomics. This is the simple, correct version.
 */
#include <atomic>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "common/gemm_params.cuh"
#include "common/ptx_mma_sync.cuh"
#include "common/swiglu.cuh"
#include "common/tile_locator.cuh"
#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"

#define BM MOK_TILE_M
#define BN 128
#define BK 32
#define STAGES 3
#define NTHREADS 256
#define KM_LD (BK + 8) /* K-major tile row pitch (elements): 80 B, ldmatrix conflict-free */
#define MN_LD (BM + 8) /* MN-major tile row pitch: 272 B */

typedef mok_gemm_params gemm_params;

template <int MODE> struct mode_traits {
  static constexpr bool a_kmajor = MODE != MOK_GM_WGRAD;
  static constexpr bool b_kmajor = MODE == MOK_GM_GATE_UP || MODE == MOK_GM_DOWN;
  static constexpr int a_elems = a_kmajor ? BM * KM_LD : BK * MN_LD;
  static constexpr int b_elems = b_kmajor ? BN * KM_LD : BK * MN_LD;
  static constexpr int stage_elems = a_elems + b_elems;
  static constexpr int smem_bytes = STAGES * stage_elems * 2;
};

int mok_k_partial_tiles(const mok_k_dims *d) { return (d->I + BN - 1) / BN; }

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
      if constexpr (MODE == MOK_GM_GATE_UP) { /* rows 0..63 gate, 64..127 up, same columns */
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
    const int k0 = MODE == MOK_GM_WGRAD ? tp.k_begin + kt * BK : kt * BK;
    const int k_lim = MODE == MOK_GM_WGRAD ? tp.k_end : p.K;
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int id = tid + i * NTHREADS, kr = id >> 4, nc = (id & 15) * 8;
      const int gk = k0 + kr, gn = tp.n_blk * BN + nc;
      const bool v = gk < k_lim && gn < p.N;
      const bf16 *src = p.B0;
      if (v) {
        if constexpr (MODE == MOK_GM_GU_DGRAD) {
          src = gk < p.b_split ? p.B0 + e * p.b_expert_stride + (long long)gk * p.ldb
                               : p.B1 + e * p.b_expert_stride + (long long)(gk - p.b_split) * p.ldb;
        } else if constexpr (MODE == MOK_GM_WGRAD) {
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
  if constexpr (MODE == MOK_GM_GATE_UP) return jp * (BN / 2) + wn * 16; /* gate pair, up pair */
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
  if constexpr (MODE == MOK_GM_WGRAD) {
    tp.e = blockIdx.z;
    /* another macrobatch's expert: its gradient is not this launch's to write */
    if (p.e_range && (tp.e < p.e_range[0] || tp.e >= p.e_range[1])) return;
    tp.m0 = blockIdx.x * BM;
    mok_group_rows(p.offsets, p.counts, tp.e, p.K, &tp.k_begin, &tp.k_end);
    nk = (tp.k_end - tp.k_begin + BK - 1) / BK;
  } else {
    const mok_row_block b = mok_locate_rows(p.offsets, p.counts, p.E_loc, p.M, blockIdx.x * BM);
    if (b.e < 0 && p.no_tail) return; /* past the last group: nothing to write */
    tp.e = b.e;
    tp.row0 = b.row0;
    tp.used_end = b.used_end;
    tp.store_end = b.store_end;
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
  if constexpr (MODE == MOK_GM_WGRAD) {
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
  } else if constexpr (MODE == MOK_GM_GATE_UP) {
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
          float gv[2] = {0.0f, 0.0f}, uv[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
          if (used)
#pragma unroll
            for (int c = 0; c < 2; c++)
              swiglu_forward(acc[mi][jj][2 * hh + c], acc[mi][jj + 2][2 * hh + c], p.has_limit,
                             p.limit, &gv[c], &uv[c], &hv[c]);
          const long long at = (long long)r * p.ldc + n;
          store_bf16x2(p.C0 + at, gv[0], gv[1]);
          store_bf16x2(p.C1 + at, uv[0], uv[1]);
          store_bf16x2(p.C2 + at, hv[0], hv[1]);
        }
      }
  } else if constexpr (MODE == MOK_GM_DOWN || MODE == MOK_GM_GU_DGRAD) {
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
  } else { /* MOK_GM_DOWN_DGRAD: a = acc; SwiGLU backward; dg|du to C0 (ldc = 2N), rw h to C1 (N) */
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
              const float a = acc[mi][j][2 * hh + c];
              const swiglu_grad sg = swiglu_backward(gin[c], uin[c], a, w, p.has_limit, p.limit);
              hv[c] = sg.h;
              rowsum[mi][hh] = __fadd_rn(rowsum[mi][hh], __fmul_rn(a, hv[c]));
              dg[c] = sg.dg;
              du[c] = sg.du;
            }
          }
          store_bf16x2(p.C0 + (long long)r * p.ldc + n, dg[0], dg[1]);
          store_bf16x2(p.C0 + (long long)r * p.ldc + p.N + n, du[0], du[1]);
          store_bf16x2(p.C1 + at, swiglu_h_weighted(hv[0], w), swiglu_h_weighted(hv[1], w));
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

/* ---- the mma.sync launch of one product -------------------------------------------- */

int mok_k_drw_reduce(const mok_k_dims *d, const int32_t *schedule, const float *partial,
                     float *d_rw, int32_t *status, cudaStream_t stream);

static unsigned cdiv(long long a, long long b) { return (unsigned)((a + b - 1) / b); }

/* One block per output tile (GATE_UP: 64 gate + 64 up columns), WGRAD one
 * per (tile, group). */
template <int MODE> static int launch_hmma(const gemm_params &p, cudaStream_t stream) {
  const dim3 grid(cdiv(p.M, BM), cdiv(p.N, MODE == MOK_GM_GATE_UP ? BN / 2 : BN),
                  MODE == MOK_GM_WGRAD ? (unsigned)p.groups : 1u);
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

/* ---- the GEMM backend, chosen once --------------------------------------------------- */

/* MOK_K_GEMM_HMMA or MOK_K_GEMM_SM90; -1 until mok_k_init (or the first
 * launch without one) decides. */
static std::atomic<int> gemm_backend{-1};

/* mok_k_init_with's gemm choice: 1 when it kept every product on mma.sync */
static std::atomic<int> gemm_chose_hmma{0};

/* The init's choice: mma.sync when it said so; otherwise the Hopper kernels
 * where the device has them. */
static int backend_chosen(void) {
  if (gemm_chose_hmma.load(std::memory_order_relaxed)) return MOK_K_GEMM_HMMA;
  return mok_k_sm90_usable() ? MOK_K_GEMM_SM90 : MOK_K_GEMM_HMMA;
}

extern "C" int mok_k_gemm_backend(void) {
  int b = gemm_backend.load(std::memory_order_relaxed);
  if (b < 0) { /* no mok_k_init yet: the same choice it makes (every racer computes the same) */
    b = backend_chosen();
    gemm_backend.store(b, std::memory_order_relaxed);
  }
  return b;
}

extern "C" int mok_k_set_gemm_backend(int backend) {
  int b;
  if (backend == MOK_K_GEMM_HMMA)
    b = MOK_K_GEMM_HMMA;
  else if (backend == MOK_K_GEMM_SM90)
    b = mok_k_sm90_usable() ? MOK_K_GEMM_SM90 : MOK_K_GEMM_HMMA;
  else
    b = backend_chosen();
  gemm_backend.store(b, std::memory_order_relaxed);
  return b;
}

static bool on_sm90(void) { return mok_k_gemm_backend() == MOK_K_GEMM_SM90; }

/* A backward mode (MOK_K_SM90_BWD_*) on the Hopper kernels */
static bool on_sm90_bwd(int mode_bit) { return (mok_k_sm90_bwd_modes() & mode_bit) && on_sm90(); }

static char choice_error[160];

extern "C" const char *mok_k_choice_error(void) { return choice_error; }

/* The choices by name, checked before anything changes: MOK_EINVAL names
 * the first unknown one. */
static int take_choices(const mok_k_choices *c) {
  const char *gemm = c && c->gemm && *c->gemm ? c->gemm : NULL;
  const char *var = c && c->variant && *c->variant ? c->variant : NULL;
  const char *gather = c && c->gather_beside && *c->gather_beside ? c->gather_beside : NULL;
  const int v = var ? mok_k_sm90_variant_parse(var) : -1;
  const int host = gather ? mok_k_gather_host_parse(gather) : -1;
  const char *cg = c && c->cutlass && *c->cutlass ? c->cutlass : NULL;
  const int cgc = cg ? mok_k_sm90_cutlass_choice_parse(cg) : -1;
  if (gemm && strcmp(gemm, "hmma") && strcmp(gemm, "sm90"))
    snprintf(choice_error, sizeof choice_error, "MOK_GEMM=%.40s: hmma or sm90", gemm);
  else if (var && v < 0)
    snprintf(choice_error, sizeof choice_error,
             "MOK_GEMM_VARIANT=%.40s: rows, expert, cluster, pingpong, quad or cutlass", var);
  else if (gather && host < 0)
    snprintf(choice_error, sizeof choice_error,
             "MOK_GATHER_BESIDE=%.40s: kernel, down_dgrad, gu_dgrad, down_wgrad, both_dgrads "
             "or three", gather);
  else if (cg && cgc < 0)
    snprintf(choice_error, sizeof choice_error, "MOK_GEMM_CUTLASS=%.40s: table, every or every-pp",
             cg);
  else {
    gemm_chose_hmma.store(gemm && !strcmp(gemm, "hmma"), std::memory_order_relaxed);
    if (v >= 0) (void)mok_k_sm90_set_variant(v);
    if (host >= 0) (void)mok_k_set_gather_host(host);
    if (cgc >= 0) (void)mok_k_sm90_set_cutlass_choice(cgc);
    return MOK_OK;
  }
  return MOK_EINVAL;
}

extern "C" int mok_k_init(void) { return mok_k_init_with(NULL); }

extern "C" int mok_k_init_with(const mok_k_choices *c) {
  if (take_choices(c) != MOK_OK) return MOK_EINVAL;
  int st = set_smem_limit<MOK_GM_GATE_UP>();
  if (st == MOK_OK) st = set_smem_limit<MOK_GM_DOWN>();
  if (st == MOK_OK) st = set_smem_limit<MOK_GM_DOWN_DGRAD>();
  if (st == MOK_OK) st = set_smem_limit<MOK_GM_GU_DGRAD>();
  if (st == MOK_OK) st = set_smem_limit<MOK_GM_WGRAD>();
  const bool sm90 = mok_k_sm90_usable() != 0;
  if (st == MOK_OK && sm90) st = mok_k_sm90_init();
  if (st == MOK_OK) gemm_backend.store(backend_chosen(), std::memory_order_relaxed);
  return st;
}

extern "C" int mok_k_backward_on_hopper(const mok_k_dims *d) {
  const int all = MOK_K_SM90_BWD_DOWN_DGRAD | MOK_K_SM90_BWD_GATE_UP_DGRAD | MOK_K_SM90_BWD_WGRAD;
  return d && (mok_k_sm90_bwd_modes() & all) == all && on_sm90() && d->I % 16 == 0 &&
         (d->I_s == 0 || d->I_s % 16 == 0);
}

/* ---- the products' parameters (one description for both backends) -------------------- */

static bool all_aligned(const void *a, const void *b, const void *c, const void *d,
                        const void *e, const void *f) {
  return mok_k_aligned16(a) && mok_k_aligned16(b) && mok_k_aligned16(c) && mok_k_aligned16(d) &&
         mok_k_aligned16(e) && mok_k_aligned16(f);
}

/* schedule != NULL: the routed rows of its groups; NULL: one group (the
 * shared expert, or one WGRAD group of all rows). */
static gemm_params params_base(const mok_k_dims *d, const int32_t *schedule,
                               const int32_t *status) {
  gemm_params p;
  memset(&p, 0, sizeof p);
  p.has_limit = d->has_limit;
  p.limit = d->limit;
  p.status = status;
  p.no_tail = d->no_tail;
  p.groups = 1;
  if (schedule) {
    const sched_ptrs s = sched_view(d, schedule);
    p.E_loc = d->E_loc;
    p.groups = d->E_loc;
    p.n_slots = s.n_slots;
    p.offsets = s.offsets;
    p.counts = s.counts;
    p.row_slot = s.row_slot;
  }
  return p;
}

/* g, u [M, n] = x W_g[e]^T, x W_u[e]^T (rounded, pre-clamp), h = silu(g') u' */
static gemm_params gemm_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n,
                                const bf16 *x, const bf16 *wg, const bf16 *wu, bf16 *g, bf16 *u,
                                bf16 *h, const int32_t *status) {
  gemm_params p = params_base(d, schedule, status);
  p.M = M;
  p.N = n;
  p.K = d->H;
  p.A = x;
  p.lda = d->H;
  p.B0 = wg;
  p.B1 = wu;
  p.ldb = d->H;
  p.b_expert_stride = (long long)n * d->H;
  p.C0 = g;
  p.C1 = u;
  p.C2 = h;
  p.ldc = n;
  return p;
}

/* y [M, H] = h W_d[e]^T */
static gemm_params gemm_down(const mok_k_dims *d, const int32_t *schedule, int M, int n,
                             const bf16 *h, const bf16 *wd, bf16 *y, const int32_t *status) {
  gemm_params p = params_base(d, schedule, status);
  p.M = M;
  p.N = d->H;
  p.K = n;
  p.A = h;
  p.lda = n;
  p.B0 = wd;
  p.ldb = n;
  p.b_expert_stride = (long long)d->H * n;
  p.C0 = y;
  p.ldc = d->H;
  return p;
}

/* a = d_out W_d[e] per row, SwiGLU backward: dgu [M, 2n] (dg | du), h [M, n],
 * d_rw partials [M, n_partial] (partial NULL: none); rw NULL: rw = 1 */
static gemm_params gemm_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n,
                                   const bf16 *d_out, const bf16 *wd, const bf16 *g,
                                   const bf16 *u, const float *rw, bf16 *dgu, bf16 *h,
                                   float *partial, int n_partial, const int32_t *status) {
  gemm_params p = params_base(d, schedule, status);
  p.M = M;
  p.N = n;
  p.K = d->H;
  p.A = d_out;
  p.lda = d->H;
  p.B0 = wd;
  p.ldb = n;
  p.b_expert_stride = (long long)d->H * n;
  p.C0 = dgu;
  p.ldc = 2LL * n;
  p.C1 = h;
  p.G = g;
  p.U = u;
  p.rw = rw;
  p.partial = partial;
  p.n_partial = n_partial;
  return p;
}

/* d_x [M, H] = dg W_g[e] + du W_u[e] (K = 2n, split at n) */
static gemm_params gemm_gu_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n,
                                 const bf16 *dgu, const bf16 *wg, const bf16 *wu, bf16 *d_x,
                                 const int32_t *status) {
  gemm_params p = params_base(d, schedule, status);
  p.M = M;
  p.N = d->H;
  p.K = 2 * n;
  p.A = dgu;
  p.lda = 2LL * n;
  p.B0 = wg;
  p.B1 = wu;
  p.ldb = d->H;
  p.b_expert_stride = (long long)n * d->H;
  p.b_split = n;
  p.C0 = d_x;
  p.ldc = d->H;
  return p;
}

/* per group e: C[e] [M, N] = a^T b over the group's rows (a [rows, M],
 * b [rows, N]); output rows < c_split to c0 + e * c_stride, the rest to c1 */
static gemm_params gemm_wgrad(const mok_k_dims *d, const int32_t *schedule, int groups, int rows,
                              int M, int N, const bf16 *a, long long lda, const bf16 *b,
                              long long ldb, bf16 *c0, bf16 *c1, int c_split, long long ldc,
                              long long c_stride, const int32_t *e_range,
                              const int32_t *status) {
  gemm_params p = params_base(d, schedule, status);
  p.groups = groups;
  p.M = M;
  p.N = N;
  p.K = rows;
  p.A = a;
  p.lda = lda;
  p.B0 = b;
  p.ldb = ldb;
  p.C0 = c0;
  p.C1 = c1;
  p.c_split = c_split;
  p.ldc = ldc;
  p.c_expert_stride = c_stride;
  p.e_range = e_range;
  return p;
}

template <int MODE> static int run_gemm(const gemm_params &p, bool sm90, cudaStream_t stream) {
  return sm90 ? mok_k_sm90_run(MODE, &p, stream) : launch_hmma<MODE>(p, stream);
}

/* ---- the Hopper kernels alone, one product each (mok_gemm_sm90.h) ----------------------- */

extern "C" int mok_k_sm90_gate_up(const mok_k_dims *d, const int32_t *schedule, int M,
                                  int n_inter, const mok_k_bf16 *x, const mok_k_bf16 *wg,
                                  const mok_k_bf16 *wu, mok_k_bf16 *g, mok_k_bf16 *u,
                                  mok_k_bf16 *h, int32_t *status, mok_k_stream stream) {
  const gemm_params p = gemm_gate_up(d, schedule, M, n_inter, (const bf16 *)x, (const bf16 *)wg,
                                     (const bf16 *)wu, (bf16 *)g, (bf16 *)u, (bf16 *)h, status);
  return mok_k_sm90_run(MOK_GM_GATE_UP, &p, stream);
}

extern "C" int mok_k_sm90_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                               const mok_k_bf16 *h, const mok_k_bf16 *wd, mok_k_bf16 *y,
                               int32_t *status, mok_k_stream stream) {
  const gemm_params p = gemm_down(d, schedule, M, n_inter, (const bf16 *)h, (const bf16 *)wd,
                                  (bf16 *)y, status);
  return mok_k_sm90_run(MOK_GM_DOWN, &p, stream);
}

extern "C" int mok_k_sm90_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M,
                                     int n_inter, const mok_k_bf16 *d_out, const mok_k_bf16 *wd,
                                     const mok_k_bf16 *g, const mok_k_bf16 *u, const float *rw,
                                     mok_k_bf16 *dgu, mok_k_bf16 *h, float *partial,
                                     int n_partial, int32_t *status, mok_k_stream stream) {
  const gemm_params p = gemm_down_dgrad(d, schedule, M, n_inter, (const bf16 *)d_out,
                                        (const bf16 *)wd, (const bf16 *)g, (const bf16 *)u, rw,
                                        (bf16 *)dgu, (bf16 *)h, partial, n_partial, status);
  return mok_k_sm90_run(MOK_GM_DOWN_DGRAD, &p, stream);
}

extern "C" int mok_k_sm90_gate_up_dgrad(const mok_k_dims *d, const int32_t *schedule, int M,
                                        int n_inter, const mok_k_bf16 *dgu,
                                        const mok_k_bf16 *wg, const mok_k_bf16 *wu,
                                        mok_k_bf16 *d_x, int32_t *status, mok_k_stream stream) {
  const gemm_params p = gemm_gu_dgrad(d, schedule, M, n_inter, (const bf16 *)dgu,
                                      (const bf16 *)wg, (const bf16 *)wu, (bf16 *)d_x, status);
  return mok_k_sm90_run(MOK_GM_GU_DGRAD, &p, stream);
}

extern "C" int mok_k_sm90_wgrad(const mok_k_dims *d, const int32_t *schedule, int groups, int rows,
                                int M, int N, const mok_k_bf16 *a, const mok_k_bf16 *b,
                                mok_k_bf16 *c0, mok_k_bf16 *c1, int c_split, long long ldc,
                                long long c_expert_stride, const int32_t *e_range,
                                int32_t *status, mok_k_stream stream) {
  /* a [rows, M] and b [rows, N], rows packed */
  const gemm_params p = gemm_wgrad(d, schedule, groups, rows, M, N, (const bf16 *)a, M,
                                   (const bf16 *)b, N, (bf16 *)c0, (bf16 *)c1, c_split, ldc,
                                   c_expert_stride, e_range, status);
  return mok_k_sm90_run(MOK_GM_WGRAD, &p, stream);
}

/* ---- the layer's launchers (C API) --------------------------------------------------------- */

/* One SwiGLU FFN forward over M rows: gate/up then down. schedule: routed,
 * NULL: the shared expert (one group of T rows). */
static int ffn_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                       const bf16 *x, const bf16 *wg, const bf16 *wu, bf16 *g, bf16 *u, bf16 *h,
                       int32_t *status, cudaStream_t stream) {
  return run_gemm<MOK_GM_GATE_UP>(gemm_gate_up(d, schedule, M, n_inter, x, wg, wu, g, u, h, status),
                                  on_sm90(), stream);
}

static int ffn_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                    const bf16 *h, const bf16 *wd, bf16 *y, int32_t *status, cudaStream_t stream) {
  return run_gemm<MOK_GM_DOWN>(gemm_down(d, schedule, M, n_inter, h, wd, y, status), on_sm90(),
                               stream);
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

extern "C" int mok_k_expert_recompute_acts(const mok_k_dims *d, const int32_t *schedule,
                                           const mok_k_bf16 *routed_x, const mok_k_bf16 *w_gate,
                                           const mok_k_bf16 *w_up, mok_k_bf16 *acts_g,
                                           mok_k_bf16 *acts_u, void *workspace, int32_t *status,
                                           mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !workspace || !mok_k_aligned16(workspace))
    return MOK_EINVAL;
  mok_k_bf16 *h = (mok_k_bf16 *)((char *)workspace + mok_k_ws_layout(d).h);
  return mok_k_gate_up_swiglu(d, schedule, routed_x, w_gate, w_up, acts_g, acts_u, h, status,
                              stream);
}

extern "C" int mok_k_expert_forward_gathering(const mok_k_dims *d, const int32_t *schedule,
                                              const mok_k_bf16 *x, mok_k_bf16 *routed_x,
                                              const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
                                              const mok_k_bf16 *w_down, mok_k_bf16 *acts_g,
                                              mok_k_bf16 *acts_u, mok_k_bf16 *routed_y,
                                              void *workspace, int32_t *status,
                                              mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || (d->T > 0 && !x) ||
      !routed_x || !w_gate || !w_up || !acts_g || !acts_u || !workspace ||
      !all_aligned(x, routed_x, w_gate, w_up, acts_g, acts_u) || !mok_k_aligned16(workspace))
    return MOK_EINVAL;
  mok_k_bf16 *h = (mok_k_bf16 *)((char *)workspace + mok_k_ws_layout(d).h);
  gemm_params p = gemm_gate_up(d, schedule, (int)mok_k_rows_capacity(d), d->I,
                               (const bf16 *)routed_x, (const bf16 *)w_gate, (const bf16 *)w_up,
                               (bf16 *)acts_g, (bf16 *)acts_u, (bf16 *)h, status);
  p.a_x = (const bf16 *)x;
  p.a_k = d->K;
  if (!on_sm90() || !mok__sm90_gathers(MOK_GM_GATE_UP, &p)) { /* the routed copy first */
    const int st = mok_k_gather_rows(d, schedule, x, routed_x, status, stream);
    if (st != MOK_OK) return st;
    return mok_k_expert_forward(d, schedule, routed_x, w_gate, w_up, w_down, acts_g, acts_u,
                                routed_y, workspace, status, stream);
  }
  const int st = mok_k_sm90_run(MOK_GM_GATE_UP, &p, stream);
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
 *   wgrads: d_wd = d_out^T h~ (h~ = rw h, as the down dgrad stores it),
 *   [d_wg; d_wu] = dgu^T x, per expert. */
typedef struct ffn_bwd_args {
  int M, n_inter, groups;
  const bf16 *x, *d_out, *g, *u, *wg, *wu, *wd;
  const float *rw;
  bf16 *dgu, *h, *d_xr, *d_wg, *d_wu, *d_wd;
  float *partial;
  const int32_t *e_range; /* device [e0, e1): weight gradients of these experts only */
  int gathers;             /* x is written from gather_src's rows by the backward itself */
  const bf16 *gather_src;  /* (NULL when there are no tokens: every row is then zeros) */
} ffn_bwd_args;

/* ---- where the backward gathers x (mok_k_set_gather_host) ------------------------------ */

/* a third beside each of the products before the gate/up weight gradient: the
 * copy spread thinnest (PERF.md v4 step 8) */
static std::atomic<int> gather_host{MOK_K_GATHER_THREE};

static const char *const gather_host_names[MOK_K_GATHER_HOSTS] = {
    "kernel", "down_dgrad", "gu_dgrad", "down_wgrad", "both_dgrads", "three"};

extern "C" int mok_k_gather_host_parse(const char *name) {
  for (int h = 0; name && h < MOK_K_GATHER_HOSTS; h++)
    if (!strcmp(name, gather_host_names[h])) return h;
  return -1;
}

extern "C" const char *mok_k_gather_host_name(int host) {
  return host >= 0 && host < MOK_K_GATHER_HOSTS ? gather_host_names[host] : "?";
}

extern "C" int mok_k_set_gather_host(int host) {
  if (host < 0 || host >= MOK_K_GATHER_HOSTS) return MOK_EINVAL;
  gather_host.store(host, std::memory_order_relaxed);
  return MOK_OK;
}

extern "C" int mok_k_gather_host(void) { return gather_host.load(std::memory_order_relaxed); }

/* Where each placement puts the copy of x's rows: a share {part, parts} of
 * the routed rows beside each product that can carry it (the down dgrad,
 * the gate/up dgrad, the down weight gradient; parts 0: none), in the
 * order of the MOK_K_GATHER_* values. */
typedef struct gather_share {
  int part, parts;
} gather_share;
enum { GATHER_ON_DOWN_DGRAD, GATHER_ON_GU_DGRAD, GATHER_ON_DOWN_WGRAD, GATHER_PRODUCTS };
static const gather_share gather_shares[MOK_K_GATHER_HOSTS][GATHER_PRODUCTS] = {
    {{0, 0}, {0, 0}, {0, 0}}, /* MOK_K_GATHER_KERNEL: a kernel of its own */
    {{0, 1}, {0, 0}, {0, 0}}, /* MOK_K_GATHER_DOWN_DGRAD */
    {{0, 0}, {0, 1}, {0, 0}}, /* MOK_K_GATHER_GU_DGRAD */
    {{0, 0}, {0, 0}, {0, 1}}, /* MOK_K_GATHER_DOWN_WGRAD */
    {{0, 2}, {1, 2}, {0, 0}}, /* MOK_K_GATHER_BOTH_DGRADS */
    {{0, 3}, {1, 3}, {2, 3}}, /* MOK_K_GATHER_THREE */
};
static_assert(MOK_K_GATHER_HOSTS == 6 && MOK_K_GATHER_THREE == 5, "one row per placement");

/* The placement that runs: the one wanted when each product of its share
 * runs where a gather can ride (on90), else the first of these that can,
 * else a kernel of its own. */
static int gather_placement(int want, const bool (&on90)[GATHER_PRODUCTS]) {
  const int order[] = {want, MOK_K_GATHER_BOTH_DGRADS, MOK_K_GATHER_GU_DGRAD, MOK_K_GATHER_DOWN_WGRAD,
                       MOK_K_GATHER_DOWN_DGRAD};
  if (want == MOK_K_GATHER_KERNEL) return want;
  for (int h : order) {
    bool fits = true;
    for (int i = 0; i < GATHER_PRODUCTS; i++)
      if (gather_shares[h][i].parts && !on90[i]) fits = false;
    if (fits) return h;
  }
  return MOK_K_GATHER_KERNEL;
}

/* The gather of the routed x (gather_rows's rows) beside product p: its
 * share of the buffer's R rows (none when sh.parts is 0). */
static void attach_gather(gemm_params *p, const mok_k_dims *d, const int32_t *schedule,
                          const ffn_bwd_args *a, gather_share sh) {
  if (sh.parts == 0) return;
  const int part = sh.part, parts = sh.parts;
  const sched_ptrs s = sched_view(d, schedule);
  p->gather_src = a->gather_src;
  p->gather_dst = (bf16 *)a->x;
  p->gather_row_slot = s.row_slot;
  p->gather_row0 = (int)((long long)s.capacity * part / parts);
  p->gather_rows = (int)((long long)s.capacity * (part + 1) / parts);
  p->gather_vecs = d->H / 8;
  p->gather_k = d->K;
  p->gather_slots = s.n_slots;
}

/* The weight gradients of one FFN backward, from d_out, h~, dg | du and x
 * (the share `beside` of x's gather beside the first): d_wd[e] = d_out^T h~, then
 * [d_wg; d_wu][e] = dgu^T x, over each expert's rows. */
static gemm_params down_wgrad(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                              int32_t *status) {
  const int n = a->n_inter;
  return gemm_wgrad(d, schedule, a->groups, a->M, d->H, n, a->d_out, d->H, a->h, n, a->d_wd, NULL,
                    d->H, n, (long long)d->H * n, a->e_range, status);
}

/* a = d_out W_d, SwiGLU backward */
static gemm_params down_dgrad(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                              int32_t *status) {
  const int n = a->n_inter;
  return gemm_down_dgrad(d, schedule, a->M, n, a->d_out, a->wd, a->g, a->u, a->rw, a->dgu, a->h,
                         a->partial, (int)cdiv(n, BN), status);
}

/* d_xr = dg W_g + du W_u */
static gemm_params gate_up_dgrad(const mok_k_dims *d, const int32_t *schedule,
                                 const ffn_bwd_args *a, int32_t *status) {
  return gemm_gu_dgrad(d, schedule, a->M, a->n_inter, a->dgu, a->wg, a->wu, a->d_xr, status);
}

/* Which backward products run on the Hopper kernels; the gate/up dgrad's
 * k16 steps must not straddle dg and du. */
struct bwd_on90 {
  bool dgrad, gu, wg;
};
static bwd_on90 bwd_kernels(int n_inter) {
  return bwd_on90{on_sm90_bwd(MOK_K_SM90_BWD_DOWN_DGRAD),
                  on_sm90_bwd(MOK_K_SM90_BWD_GATE_UP_DGRAD) && n_inter % 16 == 0,
                  on_sm90_bwd(MOK_K_SM90_BWD_WGRAD)};
}

static gemm_params gate_up_wgrad(const mok_k_dims *d, const int32_t *schedule,
                                 const ffn_bwd_args *a, int32_t *status) {
  const int n = a->n_inter;
  return gemm_wgrad(d, schedule, a->groups, a->M, 2 * n, d->H, a->dgu, 2LL * n, a->x, d->H,
                    a->d_wg, a->d_wu, n, d->H, (long long)n * d->H, a->e_range, status);
}

static int ffn_wgrads(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                      gather_share beside, bool wg90, int32_t *status, cudaStream_t stream) {
  gemm_params p = down_wgrad(d, schedule, a, status);
  attach_gather(&p, d, schedule, a, beside);
  int st = run_gemm<MOK_GM_WGRAD>(p, wg90, stream);
  if (st != MOK_OK) return st;
  return run_gemm<MOK_GM_WGRAD>(gate_up_wgrad(d, schedule, a, status), wg90, stream);
}

static int ffn_backward(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                        int32_t *status, cudaStream_t stream) {
  const bwd_on90 k90 = bwd_kernels(a->n_inter);
  gemm_params p = down_dgrad(d, schedule, a, status);
  /* x's gather: beside the chosen products where they run on the
   * hand-written Hopper kernels (their idle producer warps; a product on
   * CUTLASS carries none), else a kernel of its own first */
  int host = MOK_K_GATHER_KERNEL;
  if (a->gathers) {
    const gemm_params pw = down_wgrad(d, schedule, a, status);
    const bool on90[GATHER_PRODUCTS] = {
        k90.dgrad && !mok__sm90_on_cutlass(MOK_GM_DOWN_DGRAD, &p), k90.gu,
        k90.wg && !mok__sm90_on_cutlass(MOK_GM_WGRAD, &pw)};
    host = gather_placement(mok_k_gather_host(), on90);
    if (host == MOK_K_GATHER_KERNEL) {
      const int st = mok_k_gather_rows(d, schedule, (const mok_k_bf16 *)a->gather_src,
                                       (mok_k_bf16 *)a->x, status, stream);
      if (st != MOK_OK) return st;
    }
  }
  attach_gather(&p, d, schedule, a, gather_shares[host][GATHER_ON_DOWN_DGRAD]);
  int st = run_gemm<MOK_GM_DOWN_DGRAD>(p, k90.dgrad, stream);
  if (st != MOK_OK) return st;
  p = gate_up_dgrad(d, schedule, a, status);
  attach_gather(&p, d, schedule, a, gather_shares[host][GATHER_ON_GU_DGRAD]);
  st = run_gemm<MOK_GM_GU_DGRAD>(p, k90.gu, stream);
  if (st != MOK_OK) return st;
  return ffn_wgrads(d, schedule, a, gather_shares[host][GATHER_ON_DOWN_WGRAD], k90.wg, status,
                    stream);
}

/* A routed backward's pieces (schedule's rows, workspace pieces, outputs);
 * the weights (bf16 products only) and the expert range are the caller's. */
static ffn_bwd_args routed_bwd_args(const mok_k_dims *d, void *workspace, const bf16 *acts_g,
                                    const bf16 *acts_u, const bf16 *routed_x,
                                    const bf16 *routed_d_out, const float *router_weights,
                                    bf16 *routed_d_x, bf16 *d_w_gate, bf16 *d_w_up,
                                    bf16 *d_w_down, bool gathers, const bf16 *gather_src) {
  const ws_layout L = mok_k_ws_layout(d);
  char *ws = (char *)workspace;
  ffn_bwd_args a;
  memset(&a, 0, sizeof a);
  a.M = (int)mok_k_rows_capacity(d);
  a.n_inter = d->I;
  a.groups = d->E_loc;
  a.x = routed_x;
  a.d_out = routed_d_out;
  a.g = acts_g;
  a.u = acts_u;
  a.rw = router_weights;
  a.dgu = (bf16 *)(ws + L.dgu);
  a.h = (bf16 *)(ws + L.h);
  a.d_xr = routed_d_x;
  a.d_wg = d_w_gate;
  a.d_wu = d_w_up;
  a.d_wd = d_w_down;
  a.partial = (float *)(ws + L.partial);
  a.gathers = gathers;
  a.gather_src = gather_src;
  return a;
}

/* The shared expert's (rw = 1, rows = tokens, one group, no d_rw); weights the caller's. */
static ffn_bwd_args shared_bwd_args(const mok_k_dims *d, void *workspace, const bf16 *x,
                                    const bf16 *d_out, const bf16 *acts_gs, const bf16 *acts_us,
                                    bf16 *shared_d_x, bf16 *d_s_gate, bf16 *d_s_up,
                                    bf16 *d_s_down) {
  const ws_layout L = mok_k_ws_layout(d);
  char *ws = (char *)workspace;
  ffn_bwd_args a;
  memset(&a, 0, sizeof a);
  a.M = d->T;
  a.n_inter = d->I_s;
  a.groups = 1;
  a.x = x;
  a.d_out = d_out;
  a.g = acts_gs;
  a.u = acts_us;
  a.dgu = (bf16 *)(ws + L.dgus);
  a.h = (bf16 *)(ws + L.hs);
  a.d_xr = shared_d_x;
  a.d_wg = d_s_gate;
  a.d_wu = d_s_up;
  a.d_wd = d_s_down;
  return a;
}

/* The routed backward; gathers: routed_x is written from gather_src by the
 * backward itself (mok_k_expert_backward_gathering). */
static int expert_backward(const mok_k_dims *d, const int32_t *schedule, const bf16 *acts_g,
                           const bf16 *acts_u, bool gathers, const bf16 *gather_src,
                           const bf16 *routed_x,
                           const bf16 *routed_d_out, const float *router_weights,
                           const bf16 *w_gate, const bf16 *w_up, const bf16 *w_down,
                           bf16 *routed_d_x, float *d_rw, bf16 *d_w_gate, bf16 *d_w_up,
                           bf16 *d_w_down, const int32_t *expert_range, void *workspace,
                           int32_t *status, cudaStream_t stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !acts_g || !acts_u ||
      !routed_x || !routed_d_out || !w_gate || !w_up || !w_down || !routed_d_x || !d_w_gate ||
      !d_w_up || !d_w_down || !workspace || (d->T > 0 && (!router_weights || !d_rw)) ||
      !all_aligned(acts_g, acts_u, routed_x, routed_d_out, w_gate, w_up) ||
      !all_aligned(w_down, routed_d_x, d_w_gate, d_w_up, d_w_down, workspace) ||
      !mok_k_aligned16(gather_src))
    return MOK_EINVAL;
  ffn_bwd_args a = routed_bwd_args(d, workspace, acts_g, acts_u, routed_x, routed_d_out,
                                   router_weights, routed_d_x, d_w_gate, d_w_up, d_w_down,
                                   gathers, gather_src);
  a.wg = w_gate;
  a.wu = w_up;
  a.wd = w_down;
  a.e_range = expert_range;
  int st = ffn_backward(d, schedule, &a, status, stream);
  if (st == MOK_OK) st = mok_k_drw_reduce(d, schedule, a.partial, d_rw, status, stream);
  return st;
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
  return expert_backward(d, schedule, (const bf16 *)acts_g, (const bf16 *)acts_u, false, NULL,
                         (const bf16 *)routed_x, (const bf16 *)routed_d_out, router_weights,
                         (const bf16 *)w_gate, (const bf16 *)w_up, (const bf16 *)w_down,
                         (bf16 *)routed_d_x, d_rw, (bf16 *)d_w_gate, (bf16 *)d_w_up,
                         (bf16 *)d_w_down, expert_range, workspace, status, stream);
}

extern "C" int mok_k_expert_backward_gathering(
    const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *acts_g,
    const mok_k_bf16 *acts_u, const mok_k_bf16 *x, mok_k_bf16 *routed_x,
    const mok_k_bf16 *routed_d_out, const float *router_weights, const mok_k_bf16 *w_gate,
    const mok_k_bf16 *w_up, const mok_k_bf16 *w_down, mok_k_bf16 *routed_d_x, float *d_rw,
    mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down, void *workspace,
    int32_t *status, mok_k_stream stream) {
  if (d && d->T > 0 && !x) return MOK_EINVAL;
  return expert_backward(d, schedule, (const bf16 *)acts_g, (const bf16 *)acts_u, true,
                         (const bf16 *)x, (const bf16 *)routed_x, (const bf16 *)routed_d_out,
                         router_weights, (const bf16 *)w_gate, (const bf16 *)w_up,
                         (const bf16 *)w_down, (bf16 *)routed_d_x, d_rw, (bf16 *)d_w_gate,
                         (bf16 *)d_w_up, (bf16 *)d_w_down, NULL, workspace, status, stream);
}

/* The routed backward in one [R, H] buffer (mok_kernels.h): the products
 * in the order that frees each piece before the next writes it. routed
 * holds d_out's rows for the down dgrad and the down weight gradient; the
 * gate/up dgrad writes routed d_x over them; one pass sums each token's
 * rows into d_x and writes x's rows back for the gate/up weight gradient.
 * Each product computes what ffn_backward's does, so the bits are the same. */
extern "C" int mok_k_expert_backward_in_place(
    const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *acts_g,
    const mok_k_bf16 *acts_u, const mok_k_bf16 *x, mok_k_bf16 *routed,
    const float *router_weights, const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
    const mok_k_bf16 *w_down, const mok_k_bf16 *shared_d_x, mok_k_bf16 *d_x, float *d_rw,
    mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down, void *workspace,
    int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !acts_g || !acts_u ||
      !routed || !w_gate || !w_up || !w_down || !d_w_gate || !d_w_up || !d_w_down ||
      !workspace || (d->T > 0 && (!x || !d_x || !router_weights || !d_rw)) ||
      !all_aligned(acts_g, acts_u, x, routed, w_gate, w_up) ||
      !all_aligned(w_down, shared_d_x, d_x, d_w_gate, d_w_up, d_w_down) ||
      !mok_k_aligned16(workspace))
    return MOK_EINVAL;
  ffn_bwd_args a = routed_bwd_args(d, workspace, (const bf16 *)acts_g, (const bf16 *)acts_u,
                                   (const bf16 *)routed, (const bf16 *)routed, router_weights,
                                   (bf16 *)routed, (bf16 *)d_w_gate, (bf16 *)d_w_up,
                                   (bf16 *)d_w_down, false, NULL);
  a.wg = (const bf16 *)w_gate;
  a.wu = (const bf16 *)w_up;
  a.wd = (const bf16 *)w_down;
  const bwd_on90 k90 = bwd_kernels(a.n_inter);
  int st = run_gemm<MOK_GM_DOWN_DGRAD>(down_dgrad(d, schedule, &a, status), k90.dgrad, stream);
  /* the last reader of d_out's rows before the gate/up dgrad overwrites them */
  if (st == MOK_OK)
    st = run_gemm<MOK_GM_WGRAD>(down_wgrad(d, schedule, &a, status), k90.wg, stream);
  if (st == MOK_OK)
    st = run_gemm<MOK_GM_GU_DGRAD>(gate_up_dgrad(d, schedule, &a, status), k90.gu, stream);
  if (st == MOK_OK)
    st = mok_k_ksum_regather(d, schedule, routed, shared_d_x, x, d_x, status, stream);
  if (st == MOK_OK)
    st = run_gemm<MOK_GM_WGRAD>(gate_up_wgrad(d, schedule, &a, status), k90.wg, stream);
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
  ffn_bwd_args a = shared_bwd_args(d, workspace, (const bf16 *)x, (const bf16 *)d_out,
                                   (const bf16 *)acts_gs, (const bf16 *)acts_us,
                                   (bf16 *)shared_d_x, (bf16 *)d_s_gate, (bf16 *)d_s_up,
                                   (bf16 *)d_s_down);
  a.wg = (const bf16 *)s_gate;
  a.wu = (const bf16 *)s_up;
  a.wd = (const bf16 *)s_down;
  return ffn_backward(d, NULL, &a, status, stream);
}

/* ---- fp8 layers (docs/math.md "FP8") ----------------------------------------------------
 * The products in FP8 on the Hopper kernels (mok_gemm_sm90_fp8.cu); the
 * weight gradients the bf16 products above, on the unquantised operands. */

/* The quantised h (forward) or dg | du (backward) after the bf16 pieces:
 * [rows][2n] bytes and [rows][2n/128] scales, routed or shared (one at a time). */
typedef struct f8_ws {
  size_t q, s, total;
} f8_ws;

static f8_ws f8_layout(const mok_k_dims *d) {
  const int64_t R = mok_k_rows_capacity(d);
  int64_t q = R * 2 * d->I;
  if ((int64_t)d->T * 2 * d->I_s > q) q = (int64_t)d->T * 2 * d->I_s;
  f8_ws w;
  w.q = mok_k_align256(mok_k_ws_layout(d).total);
  w.s = w.q + mok_k_align256((size_t)q);
  w.total = w.s + mok_k_align256((size_t)(q / 128 * 4));
  return w;
}

extern "C" size_t mok_k_fp8_workspace_bytes(const mok_k_dims *d) { return f8_layout(d).total; }

static int f8_check(const mok_k_dims *d) {
  if (!d || mok_k_check_dims(d, NULL, 0) != MOK_OK || d->H % 128 || d->I % 128 || d->I_s % 128)
    return MOK_EINVAL;
  return mok_k_sm90_usable() ? MOK_OK : MOK_EUNSUPPORTED;
}

extern "C" int mok_k_fp8_supported(const mok_k_dims *d) { return f8_check(d) == MOK_OK; }

static uint8_t *f8_q(void *ws, const f8_ws &w) { return (uint8_t *)ws + w.q; }
static float *f8_s(void *ws, const f8_ws &w) { return (float *)((char *)ws + w.s); }

/* gate/up of M rows (schedule NULL: the shared expert's T), h quantised into the workspace */
static int f8_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n, int E,
                      const uint8_t *xq, const float *xs, const void *wg, const void *wu,
                      mok_k_bf16 *g, mok_k_bf16 *u, void *workspace, int32_t *status,
                      cudaStream_t stream) {
  const f8_ws w = f8_layout(d);
  const mok__f8_b bg = mok__f8_b_of(wg, E, n, d->H, 0), bu = mok__f8_b_of(wu, E, n, d->H, 0);
  return mok__f8_gate_up(d, schedule, M, n, xq, xs, &bg, &bu, g, u, f8_q(workspace, w),
                         f8_s(workspace, w), status, stream);
}

/* y [M][H] = rnd(h W_d^T) from the quantised h f8_gate_up left */
static int f8_down(const mok_k_dims *d, const int32_t *schedule, int M, int n, int E,
                   const void *wd, mok_k_bf16 *y, void *workspace, int32_t *status,
                   cudaStream_t stream) {
  const f8_ws w = f8_layout(d);
  const mok__f8_b bd = mok__f8_b_of(wd, E, d->H, n, 0);
  return mok__f8_rows_gemm(d, schedule, M, d->H, n, f8_q(workspace, w), n, f8_s(workspace, w), &bd,
                           NULL, n / 128, y, status, stream);
}

extern "C" int mok_k_fp8_gate_up(const mok_k_dims *d, const int32_t *schedule, const uint8_t *xq,
                                 const float *xs, const void *w_gate, const void *w_up,
                                 mok_k_bf16 *acts_g, mok_k_bf16 *acts_u, void *workspace,
                                 int32_t *status, mok_k_stream stream) {
  int st = f8_check(d);
  if (st != MOK_OK) return st;
  if (!schedule || !status || !w_gate || !w_up || !acts_g || !acts_u || !workspace ||
      !all_aligned(xq, w_gate, w_up, acts_g, acts_u, workspace))
    return MOK_EINVAL;
  return f8_gate_up(d, schedule, (int)mok_k_rows_capacity(d), d->I, d->E_loc, xq, xs, w_gate, w_up,
                    acts_g, acts_u, workspace, status, stream);
}

extern "C" int mok_k_fp8_expert_forward(const mok_k_dims *d, const int32_t *schedule,
                                        const uint8_t *xq, const float *xs, const void *w_gate,
                                        const void *w_up, const void *w_down, mok_k_bf16 *acts_g,
                                        mok_k_bf16 *acts_u, mok_k_bf16 *routed_y, void *workspace,
                                        int32_t *status, mok_k_stream stream) {
  int st = mok_k_fp8_gate_up(d, schedule, xq, xs, w_gate, w_up, acts_g, acts_u, workspace, status,
                             stream);
  if (st != MOK_OK) return st;
  if (!w_down || !routed_y || !all_aligned(w_down, routed_y, NULL, NULL, NULL, NULL))
    return MOK_EINVAL;
  return f8_down(d, schedule, (int)mok_k_rows_capacity(d), d->I, d->E_loc, w_down, routed_y,
                 workspace, status, stream);
}

extern "C" int mok_k_fp8_shared_forward(const mok_k_dims *d, const uint8_t *xq, const float *xs,
                                        const void *s_gate, const void *s_up, const void *s_down,
                                        mok_k_bf16 *acts_gs, mok_k_bf16 *acts_us,
                                        mok_k_bf16 *shared_y, void *workspace, int32_t *status,
                                        mok_k_stream stream) {
  int st = f8_check(d);
  if (st != MOK_OK) return st;
  if (d->I_s == 0 || d->T == 0) return MOK_OK;
  if (!status || !xq || !xs || !s_gate || !s_up || !s_down || !acts_gs || !acts_us || !shared_y ||
      !workspace || !all_aligned(xq, s_gate, s_up, s_down, acts_gs, acts_us) ||
      !all_aligned(shared_y, workspace, NULL, NULL, NULL, NULL))
    return MOK_EINVAL;
  st = f8_gate_up(d, NULL, d->T, d->I_s, 1, xq, xs, s_gate, s_up, acts_gs, acts_us, workspace,
                  status, stream);
  if (st != MOK_OK) return st;
  return f8_down(d, NULL, d->T, d->I_s, 1, s_down, shared_y, workspace, status, stream);
}

/* One FFN backward with FP8 dgrads: a's bf16 pieces as ffn_backward's (its
 * wg, wu, wd unused), the quantised d_out rows dq, ds, the packed weights
 * of E matrices. */
static int f8_ffn_backward(const mok_k_dims *d, const int32_t *schedule, const ffn_bwd_args *a,
                           const uint8_t *dq, const float *ds, const void *wg, const void *wu,
                           const void *wd, int E, void *workspace, int32_t *status,
                           cudaStream_t stream) {
  const int n = a->n_inter;
  const bool wg90 = on_sm90_bwd(MOK_K_SM90_BWD_WGRAD);
  /* x's gather: beside the down weight gradient on the Hopper kernels, else first */
  gather_share beside = {0, 0};
  if (a->gathers) {
    if (wg90)
      beside = gather_share{0, 1};
    else {
      const int st = mok_k_gather_rows(d, schedule, (const mok_k_bf16 *)a->gather_src,
                                       (mok_k_bf16 *)a->x, status, stream);
      if (st != MOK_OK) return st;
    }
  }
  const f8_ws w = f8_layout(d);
  uint8_t *q = f8_q(workspace, w);
  float *s = f8_s(workspace, w);
  /* a = d_out W_d (W_d's transposed bytes), the SwiGLU backward, dg | du quantised */
  const mok__f8_b bd = mok__f8_b_of(wd, E, d->H, n, 1);
  int st = mok__f8_down_dgrad(d, schedule, a->M, n, dq, ds, &bd, (const mok_k_bf16 *)a->g,
                              (const mok_k_bf16 *)a->u, a->rw, (mok_k_bf16 *)a->dgu,
                              (mok_k_bf16 *)a->h, a->partial, a->partial ? n / 128 : 0, q, s,
                              status, stream);
  if (st != MOK_OK) return st;
  /* d_xr = [dg | du] [W_g; W_u] (K = 2n: dg's blocks, then du's) */
  const mok__f8_b bg = mok__f8_b_of(wg, E, n, d->H, 1), bu = mok__f8_b_of(wu, E, n, d->H, 1);
  st = mok__f8_rows_gemm(d, schedule, a->M, d->H, 2 * n, q, 2LL * n, s, &bg, &bu, n / 128,
                         (mok_k_bf16 *)a->d_xr, status, stream);
  if (st != MOK_OK) return st;
  return ffn_wgrads(d, schedule, a, beside, wg90, status, stream);
}

extern "C" int mok_k_fp8_expert_backward(
    const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *acts_g,
    const mok_k_bf16 *acts_u, const mok_k_bf16 *x, mok_k_bf16 *routed_x,
    const mok_k_bf16 *routed_d_out, const uint8_t *dq, const float *ds,
    const float *router_weights, const void *w_gate, const void *w_up, const void *w_down,
    mok_k_bf16 *routed_d_x, float *d_rw, mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up,
    mok_k_bf16 *d_w_down, void *workspace, int32_t *status, mok_k_stream stream) {
  int st = f8_check(d);
  if (st != MOK_OK) return st;
  const int R = (int)mok_k_rows_capacity(d);
  if (!schedule || !status || !acts_g || !acts_u || !routed_x || !routed_d_out || !w_gate ||
      !w_up || !w_down || !routed_d_x || !d_w_gate || !d_w_up || !d_w_down || !workspace ||
      (R > 0 && (!dq || !ds)) || (d->T > 0 && (!router_weights || !d_rw)) ||
      !all_aligned(acts_g, acts_u, routed_x, routed_d_out, w_gate, w_up) ||
      !all_aligned(w_down, routed_d_x, d_w_gate, d_w_up, d_w_down, workspace) ||
      !all_aligned(x, dq, NULL, NULL, NULL, NULL))
    return MOK_EINVAL;
  ffn_bwd_args a = routed_bwd_args(d, workspace, (const bf16 *)acts_g, (const bf16 *)acts_u,
                                   (const bf16 *)routed_x, (const bf16 *)routed_d_out,
                                   router_weights, (bf16 *)routed_d_x, (bf16 *)d_w_gate,
                                   (bf16 *)d_w_up, (bf16 *)d_w_down, x != NULL,
                                   (const bf16 *)x);
  st = f8_ffn_backward(d, schedule, &a, dq, ds, w_gate, w_up, w_down, d->E_loc, workspace,
                         status, stream);
  if (st == MOK_OK) st = mok_k_drw_reduce(d, schedule, a.partial, d_rw, status, stream);
  return st;
}

extern "C" int mok_k_fp8_shared_backward(const mok_k_dims *d, const mok_k_bf16 *x,
                                         const mok_k_bf16 *d_out, const uint8_t *dq,
                                         const float *ds, const mok_k_bf16 *acts_gs,
                                         const mok_k_bf16 *acts_us, const void *s_gate,
                                         const void *s_up, const void *s_down,
                                         mok_k_bf16 *shared_d_x, mok_k_bf16 *d_s_gate,
                                         mok_k_bf16 *d_s_up, mok_k_bf16 *d_s_down,
                                         void *workspace, int32_t *status, mok_k_stream stream) {
  int st = f8_check(d);
  if (st != MOK_OK) return st;
  if (d->I_s == 0) return MOK_OK;
  if (!status || !s_gate || !s_up || !s_down || !d_s_gate || !d_s_up || !d_s_down || !workspace ||
      (d->T > 0 && (!x || !d_out || !dq || !ds || !acts_gs || !acts_us || !shared_d_x)) ||
      !all_aligned(x, d_out, acts_gs, acts_us, s_gate, s_up) ||
      !all_aligned(s_down, shared_d_x, d_s_gate, d_s_up, d_s_down, workspace) ||
      !all_aligned(dq, NULL, NULL, NULL, NULL, NULL))
    return MOK_EINVAL;
  ffn_bwd_args a = shared_bwd_args(d, workspace, (const bf16 *)x, (const bf16 *)d_out,
                                   (const bf16 *)acts_gs, (const bf16 *)acts_us,
                                   (bf16 *)shared_d_x, (bf16 *)d_s_gate, (bf16 *)d_s_up,
                                   (bf16 *)d_s_down);
  if (d->T == 0) /* no rows: the weight gradients are zeros, as the bf16 layer's */
    return ffn_wgrads(d, NULL, &a, gather_share{0, 0}, on_sm90_bwd(MOK_K_SM90_BWD_WGRAD), status,
                      stream);
  return f8_ffn_backward(d, NULL, &a, dq, ds, s_gate, s_up, s_down, 1, workspace, status, stream);
}
