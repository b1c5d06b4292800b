/* SPDX-License-Identifier: Apache-2.0 */
/* The ring token buffer of an expert-parallel group (mok_ep_kernels.h).
 *
 * The routed buffers hold ring_rows rows; a member's schedule (capacity C
 * rows) then runs in macrobatches of whole local experts, in order, each
 * as many as fit the ring. The host never learns the row counts, so it
 * launches every macrobatch the worst case could need; the plan, built on
 * the device from the schedule's offsets, leaves the ones past the last
 * empty (no experts, no rows), and their kernels do nothing.
 *
 * A macrobatch runs the ordinary kernels on a schedule of its own (the
 * "sub-schedule": same T, K and local experts, capacity ring_rows; experts
 * outside the macrobatch have no rows), so its bits equal a one-pass run:
 * each row is computed by the same code, and an expert's weight gradients
 * come from one pass over all its rows (mok_k_expert_backward_experts
 * writes the macrobatch's experts only). */
#include "mok_ep_kernels.h"
#include "mok_kernels_internal.cuh"

#define PLAN_INTS 4 /* e0, e1, base, rows */

extern "C" int mok_k_ring_batches(long long capacity_rows, int ring_rows, int E_loc) {
  if (ring_rows <= 0 || capacity_rows <= ring_rows) return 1;
  /* greedy packing: two neighbours together always exceed the ring */
  long long m = 2 * (capacity_rows / ring_rows) + 1;
  return (int)(m < E_loc ? m : E_loc);
}

/* One thread walks the experts: the schedule is the engine's (built or
 * validated), but its offsets are clamped anyway so that a bad one can only
 * give an empty plan. */
__global__ void ring_plan_kernel(const int32_t *offsets, int E_loc, int capacity, int ring,
                                 int batches, int32_t *plan, int32_t *status) {
  bool over = job_failed(status), bad = false;
  int m = 0, e0 = 0;
  while (!over && e0 < E_loc) {
    const int base = offsets[e0];
    int e1 = e0;
    while (e1 < E_loc) {
      const int end = offsets[e1 + 1];
      bad |= end < offsets[e1] || end > capacity || offsets[e1] < 0;
      if (bad || end - base > ring) break;
      e1++;
    }
    if (bad || e1 == e0 || m == batches) {
      over = true;
      break;
    }
    int32_t *p = plan + PLAN_INTS * m++;
    p[0] = e0;
    p[1] = e1;
    p[2] = base;
    p[3] = offsets[e1] - base;
    e0 = e1;
  }
  if (over) {
    /* an expert past the ring (or a bad schedule): every macrobatch empty */
    if (!bad && !job_failed(status)) raise_status(status, MOK_EOVERFLOW);
    if (bad) raise_status(status, MOK_EINVAL);
    m = 0;
  }
  for (; m < batches; m++) {
    int32_t *p = plan + PLAN_INTS * m;
    p[0] = p[1] = E_loc;
    p[2] = p[3] = 0;
  }
}

extern "C" int mok_k_ring_plan(const mok_k_dims *dv, const int32_t *schedule, int ring_rows,
                               int batches, int32_t *plan, int32_t *status,
                               mok_k_stream stream) {
  if (mok_k_check_dims(dv, NULL, 0) != MOK_OK || !schedule || !plan || !status ||
      ring_rows <= 0 || batches <= 0)
    return MOK_EINVAL;
  sched_ptrs s = sched_view(dv, schedule);
  ring_plan_kernel<<<1, 1, 0, (cudaStream_t)stream>>>(s.offsets, dv->E_loc, s.capacity, ring_rows,
                                                      batches, plan, status);
  return mok_k_launch_status();
}

/* The sub-schedule of macrobatch m (threads over max(ring capacity, slots)). */
__global__ void ring_schedule_kernel(sched_ptrs f, sched_ptrs r, const int32_t *plan, int row_align,
                                     int first_expert) {
  const int e0 = plan[0], e1 = plan[1], base = plan[2], n = plan[3];
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= r.E_loc) {
    const int off = f.offsets[i] - base;
    r.offsets[i] = off < 0 ? 0 : (off > n ? n : off);
    if (i < r.E_loc) r.counts[i] = i >= e0 && i < e1 ? f.counts[i] : 0;
  }
  if (i < r.capacity) r.row_slot[i] = i < n ? f.row_slot[base + i] : -1;
  if (i < r.n_slots) {
    const int row = f.slot_row[i];
    r.slot_row[i] = row >= base && row < base + n ? row - base : -1;
  }
  if (i == 0) {
    r.header[MOK_SCHED_H_MAGIC] = (int32_t)MOK_SCHED_MAGIC;
    r.header[MOK_SCHED_H_TOKENS] = r.T;
    r.header[MOK_SCHED_H_TOPK] = r.K;
    r.header[MOK_SCHED_H_LOCAL_EXPERTS] = r.E_loc;
    r.header[MOK_SCHED_H_ROW_ALIGN] = row_align;
    r.header[MOK_SCHED_H_ROWS_CAPACITY] = r.capacity;
    r.header[MOK_SCHED_H_ROWS_USED] = n;
    r.header[MOK_SCHED_H_FIRST_EXPERT] = first_expert;
  }
}

extern "C" int mok_k_ring_schedule(const mok_k_dims *dv, const int32_t *schedule,
                                   const int32_t *plan, int m, const mok_k_dims *dr, int32_t *sub,
                                   mok_k_stream stream) {
  if (mok_k_check_dims(dv, NULL, 0) != MOK_OK || mok_k_check_dims(dr, NULL, 0) != MOK_OK ||
      dr->T != dv->T || dr->K != dv->K || dr->E_loc != dv->E_loc || !schedule || !plan ||
      !sub || m < 0)
    return MOK_EINVAL;
  sched_ptrs f = sched_view(dv, schedule), r = sched_view(dr, sub);
  int items = r.capacity > r.n_slots ? r.capacity : r.n_slots;
  if (items < r.E_loc + 1) items = r.E_loc + 1;
  ring_schedule_kernel<<<(items + 255) / 256, 256, 0, (cudaStream_t)stream>>>(
      f, r, plan + PLAN_INTS * m, dv->row_align, dv->first_expert);
  return mok_k_launch_status();
}

/* rows [0, n) of the ring's g and u <-> rows [base, base + n) of the ctx's */
__global__ void ring_copy_kernel(const int32_t *plan, int vec_per_row, int ring_rows,
                                 uint4 *ctx_g, uint4 *ctx_u, uint4 *ring_g, uint4 *ring_u,
                                 int to_ctx) {
  const int base = plan[2], n = plan[3];
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const int row = (int)(i / vec_per_row);
  if (row >= n || row >= ring_rows) return;
  const long long c = (long long)base * vec_per_row + i;
  if (to_ctx) {
    ctx_g[c] = ring_g[i];
    ctx_u[c] = ring_u[i];
  } else {
    ring_g[i] = ctx_g[c];
    ring_u[i] = ctx_u[c];
  }
}

extern "C" int mok_k_ring_copy_acts(const int32_t *plan, int m, int ring_rows, int I,
                                    mok_k_bf16 *ctx_g, mok_k_bf16 *ctx_u, mok_k_bf16 *ring_g,
                                    mok_k_bf16 *ring_u, int to_ctx, mok_k_stream stream) {
  if (!plan || m < 0 || ring_rows <= 0 || I <= 0 || I % 8 || !ctx_g || !ctx_u || !ring_g ||
      !ring_u || !mok_k_aligned16(ctx_g) || !mok_k_aligned16(ctx_u) ||
      !mok_k_aligned16(ring_g) || !mok_k_aligned16(ring_u))
    return MOK_EINVAL;
  const int vec = I / 8;
  const long long total = (long long)ring_rows * vec;
  ring_copy_kernel<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      plan + PLAN_INTS * m, vec, ring_rows, (uint4 *)ctx_g, (uint4 *)ctx_u, (uint4 *)ring_g,
      (uint4 *)ring_u, to_ctx);
  return mok_k_launch_status();
}

/* rows [rows_used, capacity) of the ctx's g and u: zero, as a pass without
 * a ring leaves them */
__global__ void acts_zero_tail_kernel(const int32_t *header, int capacity, int vec_per_row,
                                      uint4 *g, uint4 *u) {
  int used = header[MOK_SCHED_H_ROWS_USED];
  used = used < 0 ? 0 : (used > capacity ? capacity : used);
  const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (long long)(capacity - used) * vec_per_row) return;
  const long long c = (long long)used * vec_per_row + i;
  g[c] = make_uint4(0, 0, 0, 0);
  u[c] = make_uint4(0, 0, 0, 0);
}

extern "C" int mok_k_acts_zero_tail(const mok_k_dims *dv, const int32_t *schedule,
                                    mok_k_bf16 *ctx_g, mok_k_bf16 *ctx_u, mok_k_stream stream) {
  if (mok_k_check_dims(dv, NULL, 0) != MOK_OK || !schedule || !ctx_g || !ctx_u ||
      !mok_k_aligned16(ctx_g) || !mok_k_aligned16(ctx_u))
    return MOK_EINVAL;
  const int capacity = (int)mok_k_rows_capacity(dv), vec = dv->I / 8;
  const long long total = (long long)capacity * vec;
  if (total == 0) return MOK_OK;
  acts_zero_tail_kernel<<<(unsigned)((total + 255) / 256), 256, 0, (cudaStream_t)stream>>>(
      schedule, capacity, vec, (uint4 *)ctx_g, (uint4 *)ctx_u);
  return mok_k_launch_status();
}
