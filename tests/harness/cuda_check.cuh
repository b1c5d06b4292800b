/* SPDX-License-Identifier: Apache-2.0 */
/* What the CUDA test and bench programs share: the CUDA and mok status
 * checks that stop the program, the EXPECT counter of failed checks (expect.h), and the
 * device fill of random bf16 (hash of the index: the same bits for the same
 * arguments, never zero), the median of timings. Included by one .cu file of
 * each program. */
#ifndef MOK_TESTS_CUDA_CHECK_CUH
#define MOK_TESTS_CUDA_CHECK_CUH

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime.h>

#include "expect.h"

#define CUDA_CHECK(call)                                                                    \
  do {                                                                                      \
    cudaError_t err_ = (call);                                                              \
    if (err_ != cudaSuccess) {                                                              \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      exit(2);                                                                              \
    }                                                                                       \
  } while (0)

/* a launcher's mok_status (needs mok_kernels.h) */
#define MOK_CHECK(call)                                                                       \
  do {                                                                                        \
    int st_ = (call);                                                                         \
    if (st_ != MOK_OK) {                                                                      \
      fprintf(stderr, "%s:%d: %s: mok status %d (cuda error %d)\n", __FILE__, __LINE__, #call, \
              st_, mok_k_last_cuda_error());                                                  \
      exit(2);                                                                                \
    }                                                                                         \
  } while (0)


/* the median of n samples (sorts v) */
static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}
static __attribute__((unused)) double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_d);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* bf16 uniform in [-scale, scale] from a hash of the index */
__global__ void fill_bf16(uint16_t *p, size_t n, uint32_t seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed ^ (uint32_t)(i >> 32) * 0x85ebca6bu;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    h *= 3266489917u;
    h ^= h >> 16;
    float v = ((float)(h >> 8) * (1.0f / 16777216.0f) * 2.0f - 1.0f) * scale;
    if (v == 0.0f) v = scale * 0.5f;
    uint32_t u = __float_as_uint(v);
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (uint16_t)(u >> 16);
  }
}

#endif /* MOK_TESTS_CUDA_CHECK_CUH */
