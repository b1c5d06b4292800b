/* SPDX-License-Identifier: Apache-2.0 */
/* The layouts of the buffers a job exchanges: the routing schedule, the
 * saved activations (acts) and the context (ctx), as plain arithmetic.
 *
 * One definition for every side: the daemon and libmok (C11, through
 * mok_wire.h and daemon/schedule.h) and the CUDA kernels (C++17, nvcc).
 * So this header holds only what both languages read the same way: fixed-
 * width integers, an enum of plain constants, a struct of uint64 fields and
 * static inline functions. No atomics, no _Static_assert, no designated
 * initialisers, no bool.
 *
 * Routed rows are grouped by local expert, ascending; within an expert, in
 * ascending flat slot order t*K+k; each expert's group starts at a multiple
 * of row_align (an engine property reported by CreateLayer). Padding rows
 * have row_slot = -1.
 *
 * schedule (int32 array):
 *   [0] magic  [1] T  [2] K  [3] E_loc  [4] row_align  [5] rows_capacity
 *   [6] rows_used (padded end of the last group)  [7] first_expert
 *   counts[E_loc]        rows per local expert
 *   offsets[E_loc + 1]   first row of each group; offsets[E_loc] = rows_used
 *   row_slot[rows_capacity]   t*K+k of each row, -1 for padding
 *   slot_row[T*K]        row of slot t*K+k, -1 when dropped or not local
 *
 * acts (layer dtype; each array starts at a 256-byte boundary):
 *   g_routed[rows_capacity, I], u_routed[rows_capacity, I],
 *   g_shared[T, I_s], u_shared[T, I_s]   (pre-clamp projections)
 *
 * ctx (bytes) = schedule, padded to 256, then acts.
 */
#ifndef MOK_LAYOUT_H
#define MOK_LAYOUT_H

#include <stdint.h>

#define MOK_SCHED_MAGIC 0x5343484bu /* "KHCS" */
#define MOK_SCHED_HEADER_INTS 8u

/* Header field indices */
enum {
  MOK_SCHED_H_MAGIC = 0,
  MOK_SCHED_H_TOKENS = 1,
  MOK_SCHED_H_TOPK = 2,
  MOK_SCHED_H_LOCAL_EXPERTS = 3,
  MOK_SCHED_H_ROW_ALIGN = 4,
  MOK_SCHED_H_ROWS_CAPACITY = 5,
  MOK_SCHED_H_ROWS_USED = 6,
  MOK_SCHED_H_FIRST_EXPERT = 7
};

typedef struct mok_layout_dims {
  uint64_t tokens, topk, local_experts, row_align;
  uint64_t intermediate, shared_intermediate, elem_size;
  uint64_t rows_limit; /* 0, or fewer rows than the worst case (a group's capacity) */
} mok_layout_dims;

static inline uint64_t mok_align256(uint64_t v) { return (v + 255u) & ~(uint64_t)255u; }

/* The worst case (every slot routed here, every group padded) unless the
 * dims carry a smaller limit: a group's capacity multiplier. */
static inline uint64_t mok_rows_capacity(const mok_layout_dims *d) {
  uint64_t worst = d->tokens * d->topk + d->local_experts * (d->row_align - 1u);
  return d->rows_limit && d->rows_limit < worst ? d->rows_limit : worst;
}

/* Where each part of a schedule starts, in int32 entries from its start. */
static inline uint64_t mok_sched_counts_at(const mok_layout_dims *d) {
  (void)d;
  return MOK_SCHED_HEADER_INTS;
}
static inline uint64_t mok_sched_offsets_at(const mok_layout_dims *d) {
  return mok_sched_counts_at(d) + d->local_experts;
}
static inline uint64_t mok_sched_row_slot_at(const mok_layout_dims *d) {
  return mok_sched_offsets_at(d) + d->local_experts + 1u;
}
static inline uint64_t mok_sched_slot_row_at(const mok_layout_dims *d) {
  return mok_sched_row_slot_at(d) + mok_rows_capacity(d);
}

static inline uint64_t mok_schedule_ints(const mok_layout_dims *d) {
  return mok_sched_slot_row_at(d) + d->tokens * d->topk;
}
static inline uint64_t mok_schedule_bytes(const mok_layout_dims *d) {
  return 4u * mok_schedule_ints(d);
}
/* Offsets inside acts */
static inline uint64_t mok_acts_routed_bytes(const mok_layout_dims *d) {
  return mok_align256(mok_rows_capacity(d) * d->intermediate * d->elem_size);
}
static inline uint64_t mok_acts_shared_bytes(const mok_layout_dims *d) {
  return mok_align256(d->tokens * d->shared_intermediate * d->elem_size);
}
static inline uint64_t mok_acts_bytes(const mok_layout_dims *d) {
  return 2u * mok_acts_routed_bytes(d) + 2u * mok_acts_shared_bytes(d);
}
static inline uint64_t mok_ctx_bytes(const mok_layout_dims *d) {
  return mok_align256(mok_schedule_bytes(d)) + mok_acts_bytes(d);
}

/* ---- the packed weight of an fp8 layer (docs/math.md, "FP8") --------------
 *
 * One weight [E, N, K] (w_gate, w_up: [E_loc, I, H]; w_down: [E_loc, H, I];
 * the shared expert's with E = 1 and I_s for I), N and K multiples of 128,
 * in both orientations (the e4m3 tensor-core GEMM takes K-major operands
 * only: the forward reads the first, the backward's dgrads the second):
 *   the e4m3 bytes [E, N, K] row-major,
 *   from the next 256-byte boundary the transposed e4m3 bytes [E, K, N]
 *   (byte (e, k, n) of it is byte (e, n, k) of the first),
 *   from the next 256-byte boundary the f32 block scales [E, N/128, K/128]
 *   (scale of 128x128 block (nb, kb) of matrix e at (e*(N/128) + nb)*(K/128) + kb;
 *   block (kb, nb) of the transpose reads scale (nb, kb)).
 * The bytes between the sections are zero. MOK_OP_QUANTIZE_WEIGHT writes it
 * from the bf16 weight; an fp8 layer's jobs take it (dtype u8, one dimension
 * of mok_fp8_weight_bytes) in the weight's slot. Every side sizes it from
 * these three functions. */
static inline uint64_t mok_fp8_transposed_offset(uint64_t experts, uint64_t n, uint64_t k) {
  return mok_align256(experts * n * k);
}
static inline uint64_t mok_fp8_scales_offset(uint64_t experts, uint64_t n, uint64_t k) {
  return mok_fp8_transposed_offset(experts, n, k) + mok_align256(experts * n * k);
}
static inline uint64_t mok_fp8_weight_bytes(uint64_t experts, uint64_t n, uint64_t k) {
  return mok_fp8_scales_offset(experts, n, k) + 4u * experts * (n / 128u) * (k / 128u);
}

#endif /* MOK_LAYOUT_H */
