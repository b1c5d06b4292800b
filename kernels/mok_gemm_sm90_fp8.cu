/* SPDX-License-Identifier: Apache-2.0 */
/* The block-scaled e4m3 grouped GEMMs on Hopper (docs/math.md, "FP8"): every
 * product of an fp8 layer's forward and dgrad, in three epilogues.
 *
 *   C[r][n] = sum_k (A[r][k] sa[r][k/128]) (B[e][n][k] sb(e, n/128, k/128))
 *
 * for the routed rows r of each expert e (the schedule's row blocks of 128,
 * as the bf16 kernels; no schedule: one group of M rows, the shared
 * expert), A and B e4m3 bytes, K-major (e4m3 wgmma has no transposed
 * operands, so a weight used transposed is read from its packed form's
 * transposed bytes), the scales powers of two (kernels/common/fp8_e4m3.h).
 * Within each 128 of K the tensor cores accumulate the e4m3 products (their
 * accumulator is not a full f32); each such partial is then scaled by
 * sa * sb and added into f32 registers (the recipe's promotion), in k
 * order, so results are bitwise repeatable.
 *
 * Modes:
 *  - F8_PLAIN: C bf16. B's k blocks come from b0 below k_split and from b1
 *    above it (the gate/up dgrad: [dg | du] times [W_gate; W_up]).
 *  - F8_GATE_UP: a unit is 128 rows x 128 columns of I, run as two tiles on
 *    one CTA, the gate's then the up's. The gate tile's epilogue stores g
 *    and keeps it in registers; the up tile's stores u, forms h = silu(g') u'
 *    and quantises it per row per 128 (the unit's 128 columns are one
 *    scale block), so h never travels through memory in bf16.
 *  - F8_DOWN_DGRAD: a = d_out W_d (K = H), the SwiGLU backward from the
 *    saved g, u and the router weight: dg | du and h in bf16 (the weight
 *    gradients' operands), d_rw's partial of the tile's 128 columns, and
 *    dg, du quantised per row per 128 (one tile = one scale block).
 *
 * Structure: the bf16 kernels' (mok_gemm_sm90.cu): a persistent grid,
 * warpgroup 0's thread 0 streams A and B tiles through TMA into a ring of
 * stages, warpgroups 1 and 2 each own 64 rows of a 128 x 128 tile. A tile's
 * 128 columns are one weight-scale block, so B's scale is one number per k
 * block. Two accumulators of 64 registers a thread (the partial and the
 * promoted sum) fit where one 64 x 256 bf16 accumulator does. */
#include <cudaTypedefs.h>
#include <string.h>

#include "common/fp8_e4m3.h"
#include "common/ptx_sm90.cuh"
#include "common/swiglu.cuh"
#include "common/tile_locator.cuh"
#include "cutlass_gemm/launch.h"
#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"

#define F8_BM 128
#define F8_BN 128
#define F8_BK 128 /* bytes of a row per stage: one 128-byte swizzle row, one scale block */
#define F8_STAGES 6
#define F8_A_BYTES (F8_BM * F8_BK)
#define F8_B_BYTES (F8_BN * F8_BK)
#define F8_STAGE_BYTES (F8_A_BYTES + F8_B_BYTES)
#define F8_THREADS 384
#define F8_CONSUMER_WARPS 8
#define F8_SMEM_BYTES (F8_STAGES * F8_STAGE_BYTES + 2 * F8_STAGES * 8 + 1024)

enum { F8_PLAIN = 0, F8_GATE_UP = 1, F8_DOWN_DGRAD = 2, F8_MODES = 3 };

typedef struct f8_params {
  const int32_t *offsets, *counts; /* the schedule's groups; NULL: one group of M rows */
  const int32_t *row_slot;         /* DOWN_DGRAD: each row's slot, for its router weight */
  int n_slots;
  int E_loc, M, N, K, m_tiles, n_tiles;
  int k_split;     /* PLAIN: k blocks read from b0; the rest from b1 */
  const float *sa; /* [M][K/128] */
  mok__f8_b b0, b1;
  __nv_bfloat16 *C0, *C1;
  long long ldc;
  /* DOWN_DGRAD: the saved g, u [M][N] (pre-clamp), router weights (NULL: 1) */
  const __nv_bfloat16 *G, *U;
  const float *rw;
  float *partial; /* [M][n_partial], column tile nb's d_rw term (NULL: none) */
  int n_partial;
  uint8_t *Q;     /* GATE_UP: h's bytes [M][N]; DOWN_DGRAD: dg | du's [M][2N] */
  float *QS;      /* their scales, [M][N/128] and [M][2N/128] */
  long long ldq, ldqs;
  int has_limit;
  float limit;
  int32_t *status;
} f8_params;

__device__ static inline mok_row_block f8_locate(const f8_params &p, int t, int *nb) {
  const int mb = t / p.n_tiles;
  *nb = t - mb * p.n_tiles;
  return mok_locate_rows(p.offsets, p.counts, p.E_loc, p.M, mb * F8_BM);
}

/* k blocks a tile loads: none when it holds no real row */
__device__ static inline int f8_tile_nk(const f8_params &p, const mok_row_block &b) {
  return b.e >= 0 && b.used_end > b.row0 ? p.K / F8_BK : 0;
}

/* GATE_UP runs each unit as two tiles (gate, then up) */
template <int MODE> __device__ static inline int f8_halves(void) { return MODE == F8_GATE_UP ? 2 : 1; }

/* Which weight a k block of tile half hf reads, and at which of its k blocks */
template <int MODE>
__device__ static inline bool f8_second(const f8_params &p, int hf, int kb, int *kk) {
  const bool second = MODE == F8_GATE_UP ? hf != 0 : MODE == F8_PLAIN && kb >= p.k_split;
  *kk = MODE == F8_PLAIN && second ? kb - p.k_split : kb;
  return second;
}

template <int MODE>
__device__ static void f8_produce(const f8_params &p, const CUtensorMap *ma, const CUtensorMap *mb0,
                                  const CUtensorMap *mb1, uint32_t base, uint32_t bars) {
  const int total = p.m_tiles * p.n_tiles;
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int nb;
    const mok_row_block b = f8_locate(p, t, &nb);
    const int nk = f8_tile_nk(p, b);
    for (int hf = 0; hf < f8_halves<MODE>(); hf++)
      for (int kb = 0; kb < nk; kb++) {
        const uint32_t full = bars + 8 * s, empty = bars + 8 * (F8_STAGES + s);
        const uint32_t sa = base + s * F8_STAGE_BYTES;
        int kk;
        const CUtensorMap *mb = f8_second<MODE>(p, hf, kb, &kk) ? mb1 : mb0;
        mbar_wait(empty, ph ^ 1);
        mbar_arrive_expect_tx(full, F8_STAGE_BYTES);
        tma_load_2d(sa, ma, kb * F8_BK, b.row0, full);
        tma_load_3d(sa + F8_A_BYTES, mb, kk * F8_BK, nb * F8_BN, b.e, full);
        if (++s == F8_STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
  }
}

/* ---- epilogues ----------------------------------------------------------------
 * Accumulator register i of m64n128 holds row 16*warp + lane/4 + 8*((i>>1)&1),
 * column 8*(i>>2) + 2*(lane%4) + (i&1) of the warpgroup's 64 x 128 block:
 * a row's 128 columns lie in the four lanes of a quad. */

/* The largest of a row's 128 values: the quad's four lanes */
__device__ static inline float f8_quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

/* One row's 32 values of this thread (bf16 pairs, column pairs 8j + cq),
 * quantised with the row block's scale: bytes at q + 8j + cq, the scale at
 * *qs from lane 0 of the quad. used false: zeros and scale 0, as the cpu
 * engine leaves padding rows. Every lane of the quad must call it. */
__device__ static inline void f8_quantize_row(const __nv_bfloat162 (&v)[16], bool used, bool stored,
                                              uint8_t *q, float *qs) {
  const int cq = 2 * (threadIdx.x & 3);
  float amax = 0.0f;
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const float2 f = __bfloat1622float2(v[j]);
    amax = fmaxf(amax, fmaxf(fabsf(f.x), fabsf(f.y)));
  }
  amax = f8_quad_max(amax);
  if (!stored) return;
  const int ex = mok_fp8_scale_exp(amax);
#pragma unroll
  for (int j = 0; j < 16; j++) {
    const float2 f = __bfloat1622float2(v[j]);
    const uint16_t b = used ? mok_fp8_quantize2(f.x, f.y, ex) : (uint16_t)0;
    *(uint16_t *)(q + 8 * j + cq) = b;
  }
  if ((threadIdx.x & 3) == 0) *qs = used ? mok_fp8_pow2(ex) : 0.0f;
}

__device__ static inline void f8_epilogue_plain(const f8_params &p, const mok_row_block &b, int nb,
                                                const float (&sum)[64], int r0, bool have) {
  const int cq = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = r0 + 8 * hh;
    if (r >= b.store_end) continue;
    const bool used = r < b.used_end && have;
    __nv_bfloat16 *row = p.C0 + (long long)r * p.ldc + nb * F8_BN;
#pragma unroll
    for (int j = 0; j < 16; j++)
      store_bf16x2(row + 8 * j + cq, used ? sum[4 * j + 2 * hh] : 0.0f,
                   used ? sum[4 * j + 2 * hh + 1] : 0.0f);
  }
}

/* GATE_UP, the gate tile: g = rnd(acc) stored and kept in gk */
__device__ static inline void f8_epilogue_gate(const f8_params &p, const mok_row_block &b, int nb,
                                               const float (&sum)[64], int r0, bool have,
                                               __nv_bfloat162 (&gk)[2][16]) {
  const int cq = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = r0 + 8 * hh;
    const bool used = r < b.used_end && have;
#pragma unroll
    for (int j = 0; j < 16; j++)
      gk[hh][j] = used ? __floats2bfloat162_rn(sum[4 * j + 2 * hh], sum[4 * j + 2 * hh + 1])
                       : __floats2bfloat162_rn(0.0f, 0.0f);
    if (r >= b.store_end) continue;
    __nv_bfloat16 *row = p.C0 + (long long)r * p.ldc + nb * F8_BN;
#pragma unroll
    for (int j = 0; j < 16; j++) *(__nv_bfloat162 *)(row + 8 * j + cq) = gk[hh][j];
  }
}

/* GATE_UP, the up tile: u stored, h = rnd(silu(g') u') quantised */
__device__ static inline void f8_epilogue_up(const f8_params &p, const mok_row_block &b, int nb,
                                             const float (&sum)[64], int r0, bool have,
                                             const __nv_bfloat162 (&gk)[2][16]) {
  const int cq = 2 * (threadIdx.x & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = r0 + 8 * hh;
    const bool stored = r < b.store_end, used = r < b.used_end && have;
    __nv_bfloat162 hv[16];
    __nv_bfloat16 *urow = p.C1 + (long long)r * p.ldc + nb * F8_BN;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const float2 g = __bfloat1622float2(gk[hh][j]);
      float gv[2], uv[2] = {0.0f, 0.0f}, h[2] = {0.0f, 0.0f};
      if (used) {
        swiglu_forward(g.x, sum[4 * j + 2 * hh], p.has_limit, p.limit, &gv[0], &uv[0], &h[0]);
        swiglu_forward(g.y, sum[4 * j + 2 * hh + 1], p.has_limit, p.limit, &gv[1], &uv[1], &h[1]);
      }
      hv[j] = __floats2bfloat162_rn(h[0], h[1]);
      if (stored) store_bf16x2(urow + 8 * j + cq, uv[0], uv[1]);
    }
    f8_quantize_row(hv, used, stored, p.Q + (long long)r * p.ldq + nb * F8_BN,
                    p.QS + (long long)r * p.ldqs + nb);
  }
}

/* DOWN_DGRAD: the SwiGLU backward of each element of the tile's rows */
__device__ static inline void f8_epilogue_dgrad(const f8_params &p, const mok_row_block &b, int nb,
                                                const float (&sum)[64], int r0, bool have) {
  const int q = threadIdx.x & 3, cq = 2 * q;
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = r0 + 8 * hh;
    const bool stored = r < b.store_end, used = r < b.used_end && have;
    float w = 1.0f;
    if (used && p.rw) {
      const int slot = p.row_slot[r];
      w = slot >= 0 && slot < p.n_slots ? p.rw[slot] : 0.0f;
    }
    /* every g and u of the row in flight before any store */
    __nv_bfloat162 gq[16], uq[16];
    const long long at = (long long)r * p.N + nb * F8_BN + cq;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      gq[j] = uq[j] = __floats2bfloat162_rn(0.0f, 0.0f);
      if (used) {
        gq[j] = *(const __nv_bfloat162 *)(p.G + at + 8 * j);
        uq[j] = *(const __nv_bfloat162 *)(p.U + at + 8 * j);
      }
    }
    __nv_bfloat162 dg[16], du[16];
    float rowsum = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; j++) {
      const float2 g = __bfloat1622float2(gq[j]), u = __bfloat1622float2(uq[j]);
      float h[2] = {0.0f, 0.0f}, dgv[2] = {0.0f, 0.0f}, duv[2] = {0.0f, 0.0f};
      if (used) {
        const float gin[2] = {g.x, g.y}, uin[2] = {u.x, u.y};
#pragma unroll
        for (int c = 0; c < 2; c++) {
          const float a = sum[4 * j + 2 * hh + c];
          const swiglu_grad sg = swiglu_backward(gin[c], uin[c], a, w, p.has_limit, p.limit);
          h[c] = sg.h;
          rowsum = __fadd_rn(rowsum, __fmul_rn(a, sg.h));
          dgv[c] = sg.dg;
          duv[c] = sg.du;
        }
      }
      dg[j] = __floats2bfloat162_rn(dgv[0], dgv[1]);
      du[j] = __floats2bfloat162_rn(duv[0], duv[1]);
      if (stored) {
        __nv_bfloat16 *dgu = p.C0 + (long long)r * p.ldc + nb * F8_BN + 8 * j + cq;
        *(__nv_bfloat162 *)dgu = dg[j];
        *(__nv_bfloat162 *)(dgu + p.N) = du[j];
        store_bf16x2(p.C1 + at + 8 * j, swiglu_h_weighted(h[0], w), swiglu_h_weighted(h[1], w));
      }
    }
    /* the row's d_rw term: this thread's columns ascending, then the quad */
    rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 1));
    rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 2));
    if (p.partial && q == 0 && stored && nb < p.n_partial)
      p.partial[(long long)r * p.n_partial + nb] = used ? rowsum : 0.0f;
    uint8_t *qrow = p.Q + (long long)r * p.ldq + nb * F8_BN;
    float *srow = p.QS + (long long)r * p.ldqs;
    f8_quantize_row(dg, used, stored, qrow, srow + nb);
    f8_quantize_row(du, used, stored, qrow + p.N, srow + p.N / F8_BN + nb);
  }
}

template <int MODE>
__device__ static void f8_consume(const f8_params &p, uint32_t base, uint32_t bars) {
  const int cw = threadIdx.x / 128 - 1; /* rows 64*cw .. of the tile */
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const bool lead = lane == 0;
  const int total = p.m_tiles * p.n_tiles, kblocks = p.K / F8_BK;
  float part[64], sum[64];
  __nv_bfloat162 gk[2][16]; /* GATE_UP: the gate tile's g, for the up tile */
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int nb;
    const mok_row_block b = f8_locate(p, t, &nb);
    const int nk = f8_tile_nk(p, b);
    const int r0 = b.row0 + 64 * cw + 16 * warp + (lane >> 2), r1 = r0 + 8;
    /* rows past the group's real rows (padding: their bytes may be anything)
     * get scale 0 here and zeros in the epilogue */
    const bool u0 = r0 < b.used_end, u1 = r1 < b.used_end;
    const float *sa0 = p.sa + (long long)r0 * kblocks, *sa1 = p.sa + (long long)r1 * kblocks;
    const long long eb = b.e < 0 ? 0 : b.e;
    /* k block kb's scales, loaded a block ahead: their latency (L2) never
     * waits between the stage's arrival and the products (measured: no
     * change at the bench shapes, kernels/PERF.md "FP8 layer") */
    float na0 = 0.0f, na1 = 0.0f, nsb = 0.0f;
    auto load_scales = [&](int hf, int kb) {
      int kk;
      const mok__f8_b &bw = f8_second<MODE>(p, hf, kb, &kk) ? p.b1 : p.b0;
      nsb = bw.scales[eb * bw.se + nb * bw.sn + kk * bw.sk];
      na0 = u0 ? sa0[kb] : 0.0f;
      na1 = u1 ? sa1[kb] : 0.0f;
    };
    for (int hf = 0; hf < f8_halves<MODE>(); hf++) {
#pragma unroll
      for (int i = 0; i < 64; i++) sum[i] = 0.0f;
      if (nk > 0) load_scales(hf, 0);
      for (int kb = 0; kb < nk; kb++) {
        const float s0 = na0 * nsb, s1 = na1 * nsb;
        if (kb + 1 < nk) load_scales(hf, kb + 1);
        mbar_wait(bars + 8 * s, ph);
        const uint32_t st = base + s * F8_STAGE_BYTES;
        const uint64_t da = wgmma_desc_k128(st + cw * 64 * 128), db = wgmma_desc_k128(st + F8_A_BYTES);
        acc_fence(part);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < F8_BK / 32; k++) /* +32 bytes a step: 2 in the descriptor's 16-byte units */
          wgmma_m64n128k32_e4m3(part, da + 2 * k, db + 2 * k, k > 0);
        wgmma_commit();
        wgmma_wait<0>();
        acc_fence(part);
        mbar_arrive_if(bars + 8 * (F8_STAGES + s), lead);
        /* the promotion: register i's row is r0 or r1 by bit 1 of i */
#pragma unroll
        for (int i = 0; i < 64; i++) sum[i] = fmaf(part[i], (i & 2) ? s1 : s0, sum[i]);
        if (++s == F8_STAGES) {
          s = 0;
          ph ^= 1;
        }
      }
      const bool have = nk > 0;
      if (MODE == F8_PLAIN) f8_epilogue_plain(p, b, nb, sum, r0, have);
      if (MODE == F8_DOWN_DGRAD) f8_epilogue_dgrad(p, b, nb, sum, r0, have);
      if (MODE == F8_GATE_UP) {
        if (hf == 0)
          f8_epilogue_gate(p, b, nb, sum, r0, have, gk);
        else
          f8_epilogue_up(p, b, nb, sum, r0, have, gk);
      }
    }
  }
}

template <int MODE>
__global__ void __launch_bounds__(F8_THREADS, 1)
    f8_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                   const __grid_constant__ CUtensorMap map_b0,
                   const __grid_constant__ CUtensorMap map_b1, const f8_params p) {
  extern __shared__ __align__(1024) unsigned char f8_smem_raw[];
  __shared__ int s_failed;
  const uint32_t base = (smem_u32(f8_smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + F8_STAGES * F8_STAGE_BYTES;
  if (threadIdx.x == 0) {
    s_failed = job_failed(p.status);
    if (!s_failed) {
      for (int i = 0; i < F8_STAGES; i++) {
        mbar_init(bars + 8 * i, 1);
        mbar_init(bars + 8 * (F8_STAGES + i), F8_CONSUMER_WARPS);
      }
      mbar_fence_init();
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b0);
      tma_prefetch_map(&map_b1);
    }
  }
  __syncthreads();
  if (s_failed) return;
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) f8_produce<MODE>(p, &map_a, &map_b0, &map_b1, base, bars);
  } else {
    regs_inc<232>();
    f8_consume<MODE>(p, base, bars);
  }
}

/* Their shared-memory limits, once, with the bf16 kernels' (mok_k_sm90_init). */
int mok__sm90_fp8_init(void) {
  const void *fns[F8_MODES] = {(const void *)f8_gemm_kernel<F8_PLAIN>,
                               (const void *)f8_gemm_kernel<F8_GATE_UP>,
                               (const void *)f8_gemm_kernel<F8_DOWN_DGRAD>};
  for (int m = 0; m < F8_MODES; m++) {
    const cudaError_t err =
        cudaFuncSetAttribute(fns[m], cudaFuncAttributeMaxDynamicSharedMemorySize, F8_SMEM_BYTES);
    if (err != cudaSuccess) {
      mok_k_set_cuda_error((int)err);
      return MOK_EENGINE;
    }
  }
  return MOK_OK;
}

/* ---- launchers ------------------------------------------------------------------ */

mok__f8_b mok__f8_b_of(const void *packed, int E, int N, int K, int transposed) {
  mok__f8_b b;
  const uint64_t e = (uint64_t)E, n = (uint64_t)N, k = (uint64_t)K;
  const long long nbs = N / F8_BN, kbs = K / F8_BK;
  b.scales = (const float *)((const char *)packed + mok_fp8_scales_offset(e, n, k));
  b.se = nbs * kbs;
  if (!transposed) { /* the matrix [E][N][K] */
    b.bytes = packed;
    b.sn = kbs;
    b.sk = 1;
  } else { /* its transpose [E][K][N]: block (kb, nb) of it is the weight's (nb, kb) */
    b.bytes = (const char *)packed + mok_fp8_transposed_offset(e, n, k);
    b.sn = 1;
    b.sk = kbs;
  }
  return b;
}

/* The parameters every mode shares: the groups (schedule NULL: one of M rows), A */
static f8_params f8_base(const mok_k_dims *d, const int32_t *schedule, int M, int N, int K,
                         const float *sa, int32_t *status) {
  f8_params p;
  memset(&p, 0, sizeof p);
  if (schedule) {
    const sched_ptrs sv = sched_view(d, schedule);
    p.offsets = sv.offsets;
    p.counts = sv.counts;
    p.row_slot = sv.row_slot;
    p.n_slots = sv.n_slots;
    p.E_loc = d->E_loc;
  } else {
    p.E_loc = 1;
  }
  p.M = M;
  p.N = N;
  p.K = K;
  p.m_tiles = (M + F8_BM - 1) / F8_BM; /* rows past M: TMA's zeros, never stored */
  p.n_tiles = N / F8_BN;
  p.k_split = K / F8_BK;
  p.sa = sa;
  p.has_limit = d->has_limit;
  p.limit = d->limit;
  p.status = status;
  return p;
}

template <int MODE>
static int f8_launch(const f8_params &p, const uint8_t *a, long long lda, int experts,
                     cudaStream_t stream) {
  /* B's maps: [experts][N][kb0 blocks] of b0, [experts][N][K - kb0] of b1 */
  const long long k0 = MODE == F8_PLAIN ? (long long)p.k_split * F8_BK : p.K;
  const long long k1 = MODE == F8_PLAIN ? p.K - k0 : p.K;
  CUtensorMap ma, mb0, mb1;
  int st = mok__sm90_map_u8(&ma, a, 2, p.K, p.M, 1, lda, lda * p.M, F8_BK, F8_BM);
  if (st == MOK_OK)
    st = mok__sm90_map_u8(&mb0, p.b0.bytes, 3, k0, p.N, experts, k0, k0 * p.N, F8_BK, F8_BN);
  const bool two = MODE == F8_GATE_UP || (MODE == F8_PLAIN && k1 > 0);
  if (st == MOK_OK)
    st = two ? mok__sm90_map_u8(&mb1, p.b1.bytes, 3, k1, p.N, experts, k1, k1 * p.N, F8_BK, F8_BN)
             : (mb1 = mb0, MOK_OK);
  if (st != MOK_OK) return st;
  const int sms = mok__sm90_sms();
  const int tiles = p.m_tiles * p.n_tiles;
  f8_gemm_kernel<MODE><<<tiles < sms ? tiles : sms, F8_THREADS, F8_SMEM_BYTES, stream>>>(ma, mb0,
                                                                                          mb1, p);
  return mok_k_launch_status();
}

static bool f8_blocks(int N, int K) { return N > 0 && K > 0 && N % F8_BN == 0 && K % F8_BK == 0; }

/* B as CUTLASS's FP8 products read it: one weight's bytes [E][N][K] with
 * its scales [E][N/128][K/128] (a packed weight's first section), or
 * (transposed: the down dgrad's) [E][K/128][N/128] */
static bool f8_b_layout(const mok__f8_b &b, int N, int K, bool transposed) {
  const long long kbs = K / F8_BK, nbs = N / F8_BN;
  return b.se == nbs * kbs && (transposed ? b.sn == 1 && b.sk == nbs : b.sk == 1 && b.sn == kbs);
}

/* The product on CUTLASS (kernels/cutlass_gemm/: the cutlass variant, where
 * the launch table sends it) when it can take p: 1 and *st its status,
 * else 0 (mok's kernel runs it). A as its K-long rows, one weight a set. */
static int f8_on_cutlass(int mode, const f8_params &p, const uint8_t *a, long long lda,
                         cudaStream_t stream, int *st) {
  const bool dgrad = mode == MOK_CG_F8_DOWN_DGRAD;
  if (mok_k_sm90_variant() != MOK_K_SM90_CUTLASS || lda != p.K ||
      !f8_b_layout(p.b0, p.N, p.K, dgrad) ||
      (mode == MOK_CG_F8_GATE_UP && !f8_b_layout(p.b1, p.N, p.K, false)))
    return 0;
  mok__cg_f8 q;
  memset(&q, 0, sizeof q);
  q.offsets = p.offsets;
  q.counts = p.counts;
  q.groups = p.E_loc;
  q.M = p.M;
  q.N = p.N;
  q.K = p.K;
  q.a = a;
  q.sa = p.sa;
  q.sets = mode == MOK_CG_F8_GATE_UP ? 2 : 1;
  q.b[0] = (const uint8_t *)p.b0.bytes;
  q.sb[0] = p.b0.scales;
  q.c[0] = p.C0;
  if (q.sets == 2) {
    q.b[1] = (const uint8_t *)p.b1.bytes;
    q.sb[1] = p.b1.scales;
    q.c[1] = p.C1;
    q.hq = p.Q;
    q.hs = p.QS;
  }
  if (dgrad) {
    q.g = p.G;
    q.u = p.U;
    q.row_slot = p.row_slot;
    q.rw = p.rw;
    q.n_slots = p.n_slots;
    q.dgu = p.C0;
    q.h = p.C1;
    q.partial = p.partial;
    q.n_partial = p.n_partial;
    q.hq = p.Q;
    q.hs = p.QS;
  }
  q.has_limit = p.has_limit;
  q.limit = p.limit;
  q.status = p.status;
  if (!mok__cg_f8_takes(mode, &q)) return 0;
  *st = mok__cg_f8_run(mode, &q, mok__sm90_grid_override(), stream);
  return 1;
}

int mok__f8_rows_gemm(const mok_k_dims *d, const int32_t *schedule, int M, int N, int K,
                      const uint8_t *a, long long lda, const float *sa, const mok__f8_b *b0,
                      const mok__f8_b *b1, int k_split, mok_k_bf16 *c, int32_t *status,
                      cudaStream_t stream) {
  if (!d || !status || M < 0 || !f8_blocks(N, K) || k_split < 0 || k_split > K / F8_BK ||
      (k_split < K / F8_BK && !b1) ||
      (M > 0 && (!a || !sa || !b0 || !b0->bytes || !c || (b1 && !b1->bytes))))
    return MOK_EINVAL;
  if (!mok_k_sm90_usable()) return MOK_EUNSUPPORTED;
  if (M == 0) return MOK_OK;
  f8_params p = f8_base(d, schedule, M, N, K, sa, status);
  p.k_split = k_split;
  p.b0 = *b0;
  p.b1 = b1 ? *b1 : *b0;
  p.C0 = (__nv_bfloat16 *)c;
  p.ldc = N;
  int st;
  if (k_split == K / F8_BK && f8_on_cutlass(MOK_CG_F8_PLAIN, p, a, lda, stream, &st)) return st;
  return f8_launch<F8_PLAIN>(p, a, lda, p.E_loc, stream);
}

int mok__f8_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                    const uint8_t *a, const float *sa, const mok__f8_b *bg, const mok__f8_b *bu,
                    mok_k_bf16 *g, mok_k_bf16 *u, uint8_t *hq, float *hs, int32_t *status,
                    cudaStream_t stream) {
  if (!d || !status || M < 0 || !f8_blocks(n_inter, d->H) ||
      (M > 0 && (!a || !sa || !bg || !bu || !g || !u || !hq || !hs)))
    return MOK_EINVAL;
  if (!mok_k_sm90_usable()) return MOK_EUNSUPPORTED;
  if (M == 0) return MOK_OK;
  f8_params p = f8_base(d, schedule, M, n_inter, d->H, sa, status);
  p.b0 = *bg;
  p.b1 = *bu;
  p.C0 = (__nv_bfloat16 *)g;
  p.C1 = (__nv_bfloat16 *)u;
  p.ldc = n_inter;
  p.Q = hq;
  p.QS = hs;
  p.ldq = n_inter;
  p.ldqs = n_inter / F8_BN;
  int st;
  if (f8_on_cutlass(MOK_CG_F8_GATE_UP, p, a, d->H, stream, &st)) return st;
  return f8_launch<F8_GATE_UP>(p, a, d->H, p.E_loc, stream);
}

int mok__f8_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                       const uint8_t *a, const float *sa, const mok__f8_b *bd_t,
                       const mok_k_bf16 *g, const mok_k_bf16 *u, const float *rw,
                       mok_k_bf16 *dgu, mok_k_bf16 *h, float *partial, int n_partial,
                       uint8_t *dguq, float *dgus, int32_t *status, cudaStream_t stream) {
  if (!d || !status || M < 0 || !f8_blocks(n_inter, d->H) ||
      (M > 0 && (!a || !sa || !bd_t || !g || !u || !dgu || !h || !dguq || !dgus)) ||
      (rw && !schedule))
    return MOK_EINVAL;
  if (!mok_k_sm90_usable()) return MOK_EUNSUPPORTED;
  if (M == 0) return MOK_OK;
  f8_params p = f8_base(d, schedule, M, n_inter, d->H, sa, status);
  p.b0 = p.b1 = *bd_t;
  p.G = (const __nv_bfloat16 *)g;
  p.U = (const __nv_bfloat16 *)u;
  p.rw = rw;
  p.C0 = (__nv_bfloat16 *)dgu;
  p.ldc = 2LL * n_inter;
  p.C1 = (__nv_bfloat16 *)h;
  p.partial = partial;
  p.n_partial = n_partial;
  p.Q = dguq;
  p.QS = dgus;
  p.ldq = 2LL * n_inter;
  p.ldqs = 2 * n_inter / F8_BN;
  int st;
  if (f8_on_cutlass(MOK_CG_F8_DOWN_DGRAD, p, a, d->H, stream, &st)) return st;
  return f8_launch<F8_DOWN_DGRAD>(p, a, d->H, p.E_loc, stream);
}

extern "C" int mok_k_sm90_fp8_rows_gemm(const mok_k_dims *d, const int32_t *schedule, int M, int N,
                                        int K, const uint8_t *a, const float *a_scales,
                                        const void *b_packed, mok_k_bf16 *c, int32_t *status,
                                        mok_k_stream stream) {
  if (!d || !schedule || !status || M < 0 || !f8_blocks(N, K) ||
      (M > 0 && (!a || !a_scales || !b_packed || !c)))
    return MOK_EINVAL;
  const mok__f8_b b = mok__f8_b_of(b_packed, d->E_loc, N, K, 0);
  return mok__f8_rows_gemm(d, schedule, M, N, K, a, K, a_scales, &b, NULL, K / F8_BK, c, status,
                           stream);
}
