/* SPDX-License-Identifier: Apache-2.0 */
/* PTX wrappers of the mma.sync kernel (sm_80 instructions, run on sm_90):
 * cp.async copies into shared memory, ldmatrix, mma.sync m16n8k16 bf16. */
#ifndef MOK_COMMON_PTX_MMA_SYNC_CUH
#define MOK_COMMON_PTX_MMA_SYNC_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "ptx.cuh"

/* 16-byte async copy; with valid == false the destination is zero-filled
 * and nothing is read. */
__device__ static inline void cp_async16(__nv_bfloat16 *dst, const __nv_bfloat16 *src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ static inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ static inline void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ static inline void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}
__device__ static inline void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16 *p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(p)));
}

/* C[16x8] += A[16x16] B[16x8], bf16 in, f32 accumulate */
__device__ static inline void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                       uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif /* MOK_COMMON_PTX_MMA_SYNC_CUH */
