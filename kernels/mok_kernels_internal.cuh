/* Helpers shared by the kernel files (not part of the C API). */
#ifndef MOK_KERNELS_INTERNAL_CUH
#define MOK_KERNELS_INTERNAL_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "../proto/mok_status.h"
#include "mok_kernels.h"

typedef __nv_bfloat16 bf16;

/* The GEMM M tile; routed groups start at multiples of it, so no tile
 * straddles two experts. */
#define MOK_K_ROW_ALIGN 128

/* Schedule layout (proto/mok_wire.h; mok_wire.h itself is C11-only, so its
 * numbers are repeated here and checked by tests/gpu against it). */
#define MOK_K_SCHED_MAGIC 0x5343484b
#define MOK_K_SCHED_HEADER 8
enum {
  SCHED_H_MAGIC = 0,
  SCHED_H_T = 1,
  SCHED_H_K = 2,
  SCHED_H_ELOC = 3,
  SCHED_H_ROW_ALIGN = 4,
  SCHED_H_CAPACITY = 5,
  SCHED_H_ROWS_USED = 6,
  SCHED_H_FIRST_EXPERT = 7,
};

/* Pointers into a schedule array, computed on the host from the job's dims
 * (never from the header, which may be a client's). */
typedef struct sched_ptrs {
  int32_t *header, *counts, *offsets, *row_slot, *slot_row;
  int T, K, E_loc, n_slots, capacity;
} sched_ptrs;

static inline sched_ptrs sched_view(const mok_k_dims *d, const int32_t *schedule) {
  sched_ptrs s;
  int32_t *base = (int32_t *)schedule;
  s.T = d->T;
  s.K = d->K;
  s.E_loc = d->E_loc;
  s.n_slots = d->T * d->K;
  s.capacity = (int)mok_k_rows_capacity(d);
  s.header = base;
  s.counts = base + MOK_K_SCHED_HEADER;
  s.offsets = s.counts + d->E_loc;
  s.row_slot = s.offsets + d->E_loc + 1;
  s.slot_row = s.row_slot + s.capacity;
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

/* Largest e in [0, n) with offsets[e] <= r (offsets non-decreasing when
 * valid; any array gives an in-range answer). */
__device__ static inline int find_group(const int32_t *offsets, int n, int r) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (offsets[mid] <= r)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__device__ static inline float bf2f(bf16 v) { return __bfloat162float(v); }
__device__ static inline bf16 f2bf(float v) { return __float2bfloat16_rn(v); }

/* Host side: remembering the last launch error, checking arguments. */
void mok_k_set_cuda_error(int err);
int mok_k_launch_status(void); /* cudaGetLastError -> mok_status */

static inline bool mok_k_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

static inline size_t mok_k_align256(size_t v) { return (v + 255u) & ~(size_t)255u; }

/* Workspace pieces (byte offsets from the workspace start). */
typedef struct ws_layout {
  size_t hist;                           /* schedule build: int32 [chunks, E_loc] */
  size_t h;                              /* routed fwd/bwd: bf16 [R, I] */
  size_t dgu;                            /* routed bwd: bf16 [R, 2I] */
  size_t dy;                             /* routed bwd: bf16 [R, H] */
  size_t partial;                        /* routed bwd: f32 [R, n_partial] */
  size_t hs, dgus;                       /* shared: bf16 [T, I_s], [T, 2 I_s] */
  size_t total;
} ws_layout;

ws_layout mok_k_ws_layout(const mok_k_dims *d);
int mok_k_partial_tiles(const mok_k_dims *d); /* column tiles of the down dgrad */
int mok_k_sched_chunk(void);                  /* slots per schedule-build chunk */
/* out[t] = rnd(base[t] + sum_k (rw *) routed[slot_row[t*K+k]]) (mok_routing.cu) */
int mok_k_ksum_rows(const mok_k_dims *d, const int32_t *slot_row, int capacity,
                    const mok_k_bf16 *routed, const float *rw, const mok_k_bf16 *base,
                    mok_k_bf16 *out, int32_t *status, cudaStream_t stream);

#endif /* MOK_KERNELS_INTERNAL_CUH */
