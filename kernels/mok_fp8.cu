/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 (e4m3, block-scaled) quantisers: a weight into its packed form (its
 * e4m3 bytes, their transpose, one scale per 128 x 128 block:
 * proto/mok_layout.h) and activation rows (one scale per 128 of a row).
 * The arithmetic is kernels/common/fp8_e4m3.h, the one the cpu engine
 * runs, and a block's amax is a max (order-free, NaN ignored as fmaxf does),
 * so every byte and every scale equals the cpu engine's (docs/math.md
 * "FP8"). The GPU GEMMs that consume them are not built yet. */
#include "mok_kernels_internal.cuh"
#include "common/fp8_e4m3.h"

#define FP8_THREADS 256

/* The largest of every thread's `mine` over warps w0 .. w0 + nw - 1 of the
 * block (all threads call it; a caller that calls it again first syncs). */
__device__ static float warps_amax(float mine, int w0, int nw) {
  __shared__ float warp_max[FP8_THREADS / 32];
  for (int o = 16; o > 0; o >>= 1) mine = fmaxf(mine, __shfl_xor_sync(0xffffffffu, mine, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = mine;
  __syncthreads();
  float m = 0.0f;
  for (int w = w0; w < w0 + nw; w++) m = fmaxf(m, warp_max[w]);
  return m;
}

/* Where word w (bytes 4w .. 4w+3) of row n of a staged 128 x 128 block
 * lies in its row: w ^ fp8_swizzle(n). Both passes are free of bank
 * conflicts: a warp storing (16 rows, two 16-word halves a row: the row's
 * low 2 and next 2 bits, and the half, give the 5 bank bits) and a warp
 * reading one column (32 lanes, rows 4l + m: l itself is the bank). */
__device__ __forceinline__ static int fp8_swizzle(int n) {
  return ((n >> 2) ^ ((n & 3) << 2)) & 31;
}

/* One 128 x 128 block (blockIdx: k block, n block, expert) of w [E][N][K]:
 * thread t takes row t / 2, columns 64 * (t % 2) .. +63, and writes their
 * bytes to q [E][N][K] and to shared memory; then the block's transpose
 * goes to qt [E][K][N], one 128-byte row of it a warp at a time (lane l
 * bytes 4l .. 4l+3). q and qt are 4-byte aligned (the launcher's check). */
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_weight_kernel(const __nv_bfloat16 *__restrict__ w, int N, int K, uint8_t *__restrict__ q,
                      uint8_t *__restrict__ qt, float *__restrict__ scales) {
  __shared__ uint32_t tile[128][32]; /* the block's bytes [n][k], words swizzled */
  const int kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z;
  const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
  const int row = nb * 128 + r, col = kb * 128 + 64 * half;
  const size_t at = ((size_t)e * N + row) * K + col;
  float v[64], amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; i++) {
    v[i] = __bfloat162float(w[at + i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const int ex = mok_fp8_scale_exp(warps_amax(amax, 0, FP8_THREADS / 32));
  uint32_t *q4 = (uint32_t *)(q + at); /* at is a multiple of 64 */
#pragma unroll
  for (int j = 0; j < 16; j++) {
    uint32_t word = 0;
#pragma unroll
    for (int b = 0; b < 4; b++) word |= (uint32_t)mok_fp8_quantize(v[4 * j + b], ex) << (8 * b);
    q4[j] = word;
    tile[r][(16 * half + j) ^ fp8_swizzle(r)] = word;
  }
  if (threadIdx.x == 0)
    scales[((size_t)e * (N / 128) + nb) * (K / 128) + kb] = mok_fp8_pow2(ex);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (int k = threadIdx.x >> 5; k < 128; k += FP8_THREADS / 32) {
    uint32_t word = 0;
#pragma unroll
    for (int m = 0; m < 4; m++) {
      const int n = 4 * lane + m;
      word |= (tile[n][(k >> 2) ^ fp8_swizzle(n)] >> (8 * (k & 3)) & 0xffu) << (8 * m);
    }
    *(uint32_t *)(qt + ((size_t)e * K + kb * 128 + k) * N + nb * 128 + 4 * lane) = word;
  }
}

/* The bytes after each e4m3 section, up to the next, are zero, as the layout says. */
__global__ void fp8_zero_kernel(uint8_t *p, size_t n) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    p[i] = 0;
}

extern "C" int mok_k_fp8_quantize_weight(const mok_k_bf16 *w, int experts, int n, int k,
                                         void *packed, mok_k_stream stream) {
  if (experts < 1 || n < 128 || k < 128 || n % 128 || k % 128 || !w || !packed ||
      !mok_k_aligned16(w) || ((uintptr_t)packed & 3u) || n / 128 > 65535 || experts > 65535)
    return MOK_EINVAL;
  uint8_t *q = (uint8_t *)packed;
  const size_t used = (size_t)experts * n * k;
  const uint64_t E64 = (uint64_t)experts, n64 = (uint64_t)n, k64 = (uint64_t)k;
  const size_t t_at = (size_t)mok_fp8_transposed_offset(E64, n64, k64);
  const size_t s_at = (size_t)mok_fp8_scales_offset(E64, n64, k64);
  /* (no gaps while n and k are multiples of 128; the layout allows them) */
  if (t_at > used) fp8_zero_kernel<<<1, 256, 0, stream>>>(q + used, t_at - used);
  if (s_at > t_at + used)
    fp8_zero_kernel<<<1, 256, 0, stream>>>(q + t_at + used, s_at - t_at - used);
  fp8_weight_kernel<<<dim3((unsigned)(k / 128), (unsigned)(n / 128), (unsigned)experts),
                      FP8_THREADS, 0, stream>>>((const __nv_bfloat16 *)w, n, k, q, q + t_at,
                                                (float *)(q + s_at));
  return mok_k_launch_status();
}

/* Rows of x [rows][K]: one warp per 128-element block (lane i: elements
 * 4i .. 4i+3, one 8-byte load and one 4-byte store), the block's amax a
 * warp reduction; blocks in grid-stride order. No shared memory and no
 * block barrier, so the kernel streams at copy speed. */
#define FP8_ROW_WARPS (FP8_THREADS / 32)
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_rows_kernel(const __nv_bfloat16 *__restrict__ x, long long blocks,
                    uint8_t *__restrict__ q, float *__restrict__ scales) {
  const int lane = threadIdx.x & 31;
  for (long long b = (long long)blockIdx.x * FP8_ROW_WARPS + (threadIdx.x >> 5); b < blocks;
       b += (long long)gridDim.x * FP8_ROW_WARPS) {
    const size_t at = (size_t)b * 128 + 4 * lane; /* blocks of a row are contiguous */
    const uint2 raw = *(const uint2 *)(x + at);
    const __nv_bfloat162 *p2 = (const __nv_bfloat162 *)&raw;
    const float2 a = __bfloat1622float2(p2[0]), c = __bfloat1622float2(p2[1]);
    float amax = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(c.x), fabsf(c.y)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int ex = mok_fp8_scale_exp(amax);
    *(uint32_t *)(q + at) =
        (uint32_t)mok_fp8_quantize2(a.x, a.y, ex) | (uint32_t)mok_fp8_quantize2(c.x, c.y, ex) << 16;
    if (lane == 0) scales[b] = mok_fp8_pow2(ex);
  }
}

extern "C" int mok_k_fp8_quantize_rows(const mok_k_bf16 *x, int rows, int k, uint8_t *q,
                                       float *scales, mok_k_stream stream) {
  if (rows < 0 || k < 128 || k % 128 || (rows > 0 && (!x || !q || !scales))) return MOK_EINVAL;
  if (rows == 0) return MOK_OK;
  if (!mok_k_aligned16(x) || ((uintptr_t)q & 3u)) return MOK_EINVAL;
  /* row r's block kb is block r * (k/128) + kb of the whole: scales [rows][k/128] */
  const long long blocks = (long long)rows * (k / 128);
  const long long ctas = (blocks + FP8_ROW_WARPS - 1) / FP8_ROW_WARPS;
  fp8_rows_kernel<<<(unsigned)(ctas < 8192 ? ctas : 8192), FP8_THREADS, 0, stream>>>(
      (const __nv_bfloat16 *)x, blocks, q, scales);
  return mok_k_launch_status();
}
