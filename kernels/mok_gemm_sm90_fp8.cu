/* SPDX-License-Identifier: Apache-2.0 */
/* The block-scaled e4m3 grouped GEMM on Hopper (docs/math.md, "FP8"): the
 * first FP8 product, the one the layer's down projection and the dgrads
 * are made of.
 *
 *   C[r][n] = sum_k (A[r][k] sa[r][k/128]) (B[e][n][k] sb[e][n/128][k/128])
 *
 * for the routed rows r of each expert e (the schedule's row blocks of 128,
 * as the bf16 kernels), A and B e4m3 bytes, K-major (e4m3 wgmma has no
 * transposed operands), the scales powers of two (kernels/common/fp8_e4m3.h),
 * C bf16. Within each 128 of K the tensor cores accumulate the e4m3
 * products (their accumulator is not a full f32); each such partial is then
 * scaled by sa * sb and added into f32 registers (the recipe's promotion),
 * in k order, so results are bitwise repeatable.
 *
 * Structure: the bf16 kernels' (mok_gemm_sm90.cu): a persistent grid,
 * warpgroup 0's thread 0 streams A and B tiles through TMA into a ring of
 * stages, warpgroups 1 and 2 each own 64 rows of a 128 x 128 tile. A tile's
 * 128 columns are one weight-scale block, so B's scale is one number per k
 * block. Two accumulators of 64 registers a thread (the partial and the
 * promoted sum) fit where one 64 x 256 bf16 accumulator does.
 *
 * Status: a tested kernel with its launcher; no layer op calls it yet. */
#include <cudaTypedefs.h>
#include <string.h>

#include "common/ptx_sm90.cuh"
#include "common/tile_locator.cuh"
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

typedef struct f8_params {
  const int32_t *offsets, *counts; /* the schedule's groups (row blocks of 128) */
  int E_loc, M, N, K, m_tiles, n_tiles;
  const float *sa; /* [M][K/128] */
  const float *sb; /* [E_loc][N/128][K/128] */
  __nv_bfloat16 *C;
  long long ldc;
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

__device__ static void f8_produce(const f8_params &p, const CUtensorMap *ma, const CUtensorMap *mb,
                                  uint32_t base, uint32_t bars) {
  const int total = p.m_tiles * p.n_tiles;
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    int nb;
    const mok_row_block b = f8_locate(p, t, &nb);
    const int nk = f8_tile_nk(p, b);
    for (int kb = 0; kb < nk; kb++) {
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (F8_STAGES + s);
      const uint32_t sa = base + s * F8_STAGE_BYTES;
      mbar_wait(empty, ph ^ 1);
      mbar_arrive_expect_tx(full, F8_STAGE_BYTES);
      tma_load_2d(sa, ma, kb * F8_BK, b.row0, full);
      tma_load_3d(sa + F8_A_BYTES, mb, kb * F8_BK, nb * F8_BN, b.e, full);
      if (++s == F8_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

__device__ static void f8_consume(const f8_params &p, uint32_t base, uint32_t bars) {
  const int cw = threadIdx.x / 128 - 1; /* rows 64*cw .. of the tile */
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const bool lead = lane == 0;
  const int total = p.m_tiles * p.n_tiles, kblocks = p.K / F8_BK;
  float part[64], sum[64];
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
    const float *sbe = p.sb + ((long long)(b.e < 0 ? 0 : b.e) * (p.N / F8_BN) + nb) * kblocks;
#pragma unroll
    for (int i = 0; i < 64; i++) sum[i] = 0.0f;
    for (int kb = 0; kb < nk; kb++) {
      /* this block's scales: issued before the wait, used after the products */
      const float sb = sbe[kb];
      const float s0 = u0 ? sa0[kb] * sb : 0.0f, s1 = u1 ? sa1[kb] * sb : 0.0f;
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
    /* the epilogue: bf16 rows, zeros for padding rows */
    const int cq = 2 * (lane & 3);
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      const int r = hh ? r1 : r0;
      if (r >= b.store_end) continue;
      const bool used = (hh ? u1 : u0) && nk > 0;
      __nv_bfloat16 *row = p.C + (long long)r * p.ldc + nb * F8_BN;
#pragma unroll
      for (int j = 0; j < 16; j++)
        store_bf16x2(row + 8 * j + cq, used ? sum[4 * j + 2 * hh] : 0.0f,
                     used ? sum[4 * j + 2 * hh + 1] : 0.0f);
    }
  }
}

__global__ void __launch_bounds__(F8_THREADS, 1)
    f8_gemm_kernel(const __grid_constant__ CUtensorMap map_a,
                   const __grid_constant__ CUtensorMap map_b, const f8_params p) {
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
      tma_prefetch_map(&map_b);
    }
  }
  __syncthreads();
  if (s_failed) return;
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) f8_produce(p, &map_a, &map_b, base, bars);
  } else {
    regs_inc<232>();
    f8_consume(p, base, bars);
  }
}

/* Its shared-memory limit, once, with the bf16 kernels' (mok_k_sm90_init). */
int mok__sm90_fp8_init(void) {
  const cudaError_t err =
      cudaFuncSetAttribute(f8_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, F8_SMEM_BYTES);
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

extern "C" int mok_k_sm90_fp8_rows_gemm(const mok_k_dims *d, const int32_t *schedule, int M, int N,
                                        int K, const uint8_t *a, const float *a_scales,
                                        const void *b_packed, mok_k_bf16 *c, int32_t *status,
                                        mok_k_stream stream) {
  if (!d || !schedule || !status || M < 0 || N <= 0 || K <= 0 || N % F8_BN || K % F8_BK ||
      (M > 0 && (!a || !a_scales || !b_packed || !c)))
    return MOK_EINVAL;
  if (!mok_k_sm90_usable()) return MOK_EUNSUPPORTED;
  if (M == 0) return MOK_OK;
  const sched_ptrs sv = sched_view(d, schedule);
  f8_params p;
  memset(&p, 0, sizeof p);
  p.offsets = sv.offsets;
  p.counts = sv.counts;
  p.E_loc = d->E_loc;
  p.M = M;
  p.N = N;
  p.K = K;
  p.m_tiles = (M + F8_BM - 1) / F8_BM; /* rows past M: TMA's zeros, never stored */
  p.n_tiles = N / F8_BN;
  p.sa = a_scales;
  p.sb = (const float *)((const char *)b_packed +
                         mok_fp8_scales_offset((uint64_t)d->E_loc, (uint64_t)N, (uint64_t)K));
  p.C = (__nv_bfloat16 *)c;
  p.ldc = N;
  p.status = status;
  CUtensorMap ma, mb;
  int st = mok__sm90_map_u8(&ma, a, 2, K, M, 1, K, (long long)K * M, F8_BK, F8_BM);
  if (st == MOK_OK)
    st = mok__sm90_map_u8(&mb, b_packed, 3, K, N, d->E_loc, K, (long long)K * N, F8_BK, F8_BN);
  if (st != MOK_OK) return st;
  const int sms = mok__sm90_sms();
  const int tiles = p.m_tiles * p.n_tiles;
  f8_gemm_kernel<<<tiles < sms ? tiles : sms, F8_THREADS, F8_SMEM_BYTES, stream>>>(ma, mb, p);
  return mok_k_launch_status();
}
