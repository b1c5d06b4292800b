/* SPDX-License-Identifier: Apache-2.0 */
/* Helpers shared by the kernel files (not part of the C API). */
#ifndef MOK_KERNELS_INTERNAL_CUH
#define MOK_KERNELS_INTERNAL_CUH

#include <cuda.h> /* CUtensorMap (type only) */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../proto/mok_status.h"
#include "mok_kernels.h"

#include "../proto/mok_layout.h"
#include "common/tile_locator.cuh"

typedef __nv_bfloat16 bf16;

/* The routed-row group alignment (the GEMM M tile): groups start at
 * multiples of it, so no tile straddles two experts. */
#define MOK_K_ROW_ALIGN MOK_TILE_M

/* The layout dims of proto/mok_layout.h for kernel dims (negative fields,
 * which mok_k_check_dims refuses, count as 0). */
static inline mok_layout_dims mok_k_layout_dims(const mok_k_dims *d) {
  mok_layout_dims l;
  l.tokens = d->T > 0 ? (uint64_t)d->T : 0u;
  l.topk = d->K > 0 ? (uint64_t)d->K : 0u;
  l.local_experts = d->E_loc > 0 ? (uint64_t)d->E_loc : 0u;
  l.row_align = d->row_align > 0 ? (uint64_t)d->row_align : 1u;
  l.intermediate = d->I > 0 ? (uint64_t)d->I : 0u;
  l.shared_intermediate = d->I_s > 0 ? (uint64_t)d->I_s : 0u;
  l.elem_size = 2u;
  l.rows_limit = d->rows_limit > 0 ? (uint64_t)d->rows_limit : 0u;
  return l;
}

/* Pointers into a schedule array, computed on the host from the job's dims
 * (never from the header, which may be a client's). */
typedef struct sched_ptrs {
  int32_t *header, *counts, *offsets, *row_slot, *slot_row;
  int T, K, E_loc, n_slots, capacity;
} sched_ptrs;

static inline sched_ptrs sched_view(const mok_k_dims *d, const int32_t *schedule) {
  const mok_layout_dims l = mok_k_layout_dims(d);
  sched_ptrs s;
  int32_t *base = (int32_t *)schedule;
  s.T = d->T;
  s.K = d->K;
  s.E_loc = d->E_loc;
  s.n_slots = d->T * d->K;
  s.capacity = (int)mok_rows_capacity(&l);
  s.header = base;
  s.counts = base + mok_sched_counts_at(&l);
  s.offsets = base + mok_sched_offsets_at(&l);
  s.row_slot = base + mok_sched_row_slot_at(&l);
  s.slot_row = base + mok_sched_slot_row_at(&l);
  return s;
}

/* Raise the job's status; the largest code wins, so the final value does
 * not depend on which thread got there first. */
__device__ static inline void raise_status(int32_t *status, int code) {
  atomicMax((int *)status, code);
}

__device__ static inline bool job_failed(const int32_t *status) {
  return *(const volatile int32_t *)status != 0;
}

__device__ static inline float bf2f(bf16 v) { return __bfloat162float(v); }
__device__ static inline bf16 f2bf(float v) { return __float2bfloat16_rn(v); }
__device__ static inline void store_bf16x2(bf16 *dst, float a, float b) {
  *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}

/* Host side: remembering the last launch error, checking arguments. */
void mok_k_set_cuda_error(int err);
int mok_k_launch_status(void); /* cudaGetLastError -> mok_status */

static inline bool mok_k_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static inline size_t mok_k_align256(size_t v) { return (v + 255u) & ~(size_t)255u; }

/* Workspace pieces (byte offsets from the workspace start). */
typedef struct ws_layout {
  size_t hist;                           /* schedule build: int32 [chunks, E_loc] */
  size_t h;                              /* routed fwd: h; bwd: rw h; bf16 [R, I] */
  size_t dgu;                            /* routed bwd: bf16 [R, 2I] */
  size_t partial;                        /* routed bwd: f32 [R, n_partial] */
  size_t hs, dgus;                       /* shared: bf16 [T, I_s], [T, 2 I_s] */
  size_t total;
} ws_layout;

ws_layout mok_k_ws_layout(const mok_k_dims *d);
int mok_k_partial_tiles(const mok_k_dims *d); /* column tiles of the down dgrad */
int mok_k_sched_chunk(void);                  /* slots per schedule-build chunk */
/* the FP8 kernels' shared-memory limits (mok_gemm_sm90_fp8.cu; mok_k_sm90_init calls it) */
int mok__sm90_fp8_init(void);

/* ---- the FP8 products (mok_gemm_sm90_fp8.cu; docs/math.md "FP8") ----
 * A weight operand: e4m3 bytes [E][N][K] (K contiguous) and the scale of
 * block (e, n/128, k/128) at scales[e*se + nb*sn + kb*sk]. */
typedef struct mok__f8_b {
  const void *bytes;
  const float *scales;
  long long se, sn, sk;
} mok__f8_b;
/* A packed weight [E][N][K] as the operand of a product whose B is W
 * (transposed 0: its bytes) or W^T (1: its transposed bytes, [E][K][N]). */
mok__f8_b mok__f8_b_of(const void *packed, int E, int N, int K, int transposed);
/* C [M][N] bf16 = A [M][K] (bytes, ld lda; scales sa [M][K/128]) times B^T,
 * B's k blocks below k_split from b0, the rest from b1 (its own k from 0).
 * schedule NULL: one group of M rows (the shared expert). */
int mok__f8_rows_gemm(const mok_k_dims *d, const int32_t *schedule, int M, int N, int K,
                      const uint8_t *a, long long lda, const float *sa, const mok__f8_b *b0,
                      const mok__f8_b *b1, int k_split, mok_k_bf16 *c, int32_t *status,
                      cudaStream_t stream);
/* g, u [M][n] (bf16, pre-clamp) = x W_g^T, x W_u^T (K = H), and h's bytes
 * hq [M][n] and scales hs [M][n/128], h = rnd(silu(g') u') */
int mok__f8_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                    const uint8_t *a, const float *sa, const mok__f8_b *bg, const mok__f8_b *bu,
                    mok_k_bf16 *g, mok_k_bf16 *u, uint8_t *hq, float *hs, int32_t *status,
                    cudaStream_t stream);
/* a = d_out W_d (K = H; bd_t: W_d's transposed view), the SwiGLU backward:
 * dgu [M][2n] (dg | du, bf16), h [M][n], d_rw partials [M][n_partial]
 * (NULL: none), dg | du quantised: dguq [M][2n], dgus [M][2n/128]; rw NULL: 1 */
int mok__f8_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                       const uint8_t *a, const float *sa, const mok__f8_b *bd_t,
                       const mok_k_bf16 *g, const mok_k_bf16 *u, const float *rw,
                       mok_k_bf16 *dgu, mok_k_bf16 *h, float *partial, int n_partial,
                       uint8_t *dguq, float *dgus, int32_t *status, cudaStream_t stream);
/* helpers from mok_gemm_sm90.cu for the FP8 kernels and the CUTLASS
 * products: the device's SMs, a TMA map of bytes (128-byte swizzle; or
 * `swizzle` 64 or 128) */
int mok__sm90_sms(void);
int mok__sm90_grid_override(void); /* mok_k_sm90_set_grid's CTAs; 0: one per SM */
int mok__sm90_map_u8(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                     long long d2, long long ld, long long s2, int box0, int box1);
int mok__sm90_map_bytes(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                        long long d2, long long ld, long long s2, int box0, int box1,
                        int swizzle);
/* out[t] = rnd(base[t] + sum_k (rw *) routed[slot_row[t*K+k]]) (mok_routing.cu) */
int mok_k_ksum_rows(const mok_k_dims *d, const int32_t *slot_row, int capacity,
                    const mok_k_bf16 *routed, const float *rw, const mok_k_bf16 *base,
                    mok_k_bf16 *out, int32_t *status, cudaStream_t stream);
/* d_x[t] = rnd(base[t] + sum_k routed[slot_row[t*K+k]]) as dispatch_backward,
 * then routed's rows as gather_rows(x) writes them, in one pass (mok_routing.cu);
 * base may be NULL or d_x itself */
int mok_k_ksum_regather(const mok_k_dims *d, const int32_t *schedule, mok_k_bf16 *routed,
                        const mok_k_bf16 *base, const mok_k_bf16 *x, mok_k_bf16 *d_x,
                        int32_t *status, cudaStream_t stream);

#endif /* MOK_KERNELS_INTERNAL_CUH */
