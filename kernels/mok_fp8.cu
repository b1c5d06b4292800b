/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 (e4m3, block-scaled) quantisers: a weight into its packed form (one
 * scale per 128 x 128 block) and activation rows (one scale per 128 of a
 * row). The arithmetic is kernels/common/fp8_e4m3.h, the one the cpu engine
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

/* One 128 x 128 block (blockIdx: k block, n block, expert) of w [E][N][K]:
 * thread t takes row t / 2, columns 64 * (t % 2) .. +63. */
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_weight_kernel(const __nv_bfloat16 *__restrict__ w, int N, int K, uint8_t *__restrict__ q,
                      float *__restrict__ scales) {
  const int kb = blockIdx.x, nb = blockIdx.y, e = blockIdx.z;
  const int row = nb * 128 + (threadIdx.x >> 1), col = kb * 128 + 64 * (threadIdx.x & 1);
  const size_t at = ((size_t)e * N + row) * K + col;
  float v[64], amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 64; i++) {
    v[i] = __bfloat162float(w[at + i]);
    amax = fmaxf(amax, fabsf(v[i]));
  }
  const int ex = mok_fp8_scale_exp(warps_amax(amax, 0, FP8_THREADS / 32));
#pragma unroll
  for (int i = 0; i < 64; i++) q[at + i] = mok_fp8_quantize(v[i], ex);
  if (threadIdx.x == 0)
    scales[((size_t)e * (N / 128) + nb) * (K / 128) + kb] = mok_fp8_pow2(ex);
}

/* The bytes between the e4m3 bytes and the scales are zero, as the layout says. */
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
  const size_t at = (size_t)mok_fp8_scales_offset((uint64_t)experts, (uint64_t)n, (uint64_t)k);
  if (at > used) fp8_zero_kernel<<<1, 256, 0, stream>>>(q + used, at - used);
  fp8_weight_kernel<<<dim3((unsigned)(k / 128), (unsigned)(n / 128), (unsigned)experts),
                      FP8_THREADS, 0, stream>>>((const __nv_bfloat16 *)w, n, k, q,
                                                (float *)(q + at));
  return mok_k_launch_status();
}

/* Rows of x [rows][K], two 128-element blocks a CTA (blockIdx.x: a pair of
 * blocks; rows from blockIdx.y in steps of gridDim.y); each thread takes one
 * element. */
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_rows_kernel(const __nv_bfloat16 *__restrict__ x, int rows, int K,
                    uint8_t *__restrict__ q, float *__restrict__ scales) {
  const int half = threadIdx.x >> 7, kb = 2 * blockIdx.x + half;
  const bool in = kb < K / 128;
  for (int row = blockIdx.y; row < rows; row += gridDim.y) {
    const size_t at = (size_t)row * K + (size_t)kb * 128 + (threadIdx.x & 127);
    const float v = in ? __bfloat162float(x[at]) : 0.0f;
    /* the amax of this thread's 128-element half: warps 0-3 or 4-7 */
    const float amax = warps_amax(fabsf(v), 4 * half, 4);
    __syncthreads(); /* warps_amax's table is written again for the next row */
    if (in) {
      const int ex = mok_fp8_scale_exp(amax);
      q[at] = mok_fp8_quantize(v, ex);
      if ((threadIdx.x & 127) == 0) scales[(size_t)row * (K / 128) + kb] = mok_fp8_pow2(ex);
    }
  }
}

extern "C" int mok_k_fp8_quantize_rows(const mok_k_bf16 *x, int rows, int k, uint8_t *q,
                                       float *scales, mok_k_stream stream) {
  if (rows < 0 || k < 128 || k % 128 || (rows > 0 && (!x || !q || !scales))) return MOK_EINVAL;
  if (rows == 0) return MOK_OK;
  fp8_rows_kernel<<<dim3((unsigned)((k / 128 + 1) / 2), (unsigned)(rows < 65535 ? rows : 65535)),
                    FP8_THREADS, 0, stream>>>((const __nv_bfloat16 *)x, rows, k, q, scales);
  return mok_k_launch_status();
}
