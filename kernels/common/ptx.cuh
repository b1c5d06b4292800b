/* SPDX-License-Identifier: Apache-2.0 */
/* PTX helpers every kernel generation uses: shared-memory addresses and
 * named barriers. */
#ifndef MOK_COMMON_PTX_CUH
#define MOK_COMMON_PTX_CUH

#include <stdint.h>

/* The 32-bit shared-window address of a shared-memory pointer (what
 * ldmatrix, cp.async, mbarrier, TMA and wgmma descriptors take). */
__device__ static inline uint32_t smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* Named barrier over `count` threads (barrier 0 is __syncthreads). */
__device__ static inline void named_bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}

#endif /* MOK_COMMON_PTX_CUH */
