/* SPDX-License-Identifier: Apache-2.0 */
/* mok's public constants: dtypes, job operations and tensor slots.
 * Plain C (no atomics), so that the public header mok.h can include it.
 * Values travel on the wire: never renumber, only append. */
#ifndef MOK_ENUMS_H
#define MOK_ENUMS_H

#include <stdint.h>

typedef enum mok_dtype {
  MOK_DTYPE_INVALID = 0,
  MOK_DTYPE_F32 = 1,
  MOK_DTYPE_BF16 = 2,
  MOK_DTYPE_I32 = 3,
  MOK_DTYPE_U8 = 4,
  /* a layer dtype: FP8 E4M3 GEMMs, block-scaled (docs/math.md, "FP8"); its
   * activations and gradients are bf16, its weights packed u8 */
  MOK_DTYPE_FP8_E4M3 = 5,
  MOK_DTYPE_COUNT_
} mok_dtype;

static inline uint32_t mok_dtype_size(uint32_t dt) {
  switch (dt) {
  case MOK_DTYPE_F32: return 4;
  case MOK_DTYPE_BF16: return 2;
  case MOK_DTYPE_I32: return 4;
  case MOK_DTYPE_U8: return 1;
  case MOK_DTYPE_FP8_E4M3: return 1;
  default: return 0;
  }
}

#define MOK_OP_MAP(M)                                                          \
  M(NOP, 0, "nop")                                                             \
  M(FORWARD, 1, "forward")                                                     \
  M(BACKWARD, 2, "backward")                                                   \
  M(DISPATCH, 3, "dispatch")                                                   \
  M(COMPUTE, 4, "compute")                                                     \
  M(COMBINE, 5, "combine")                                                     \
  M(COMBINE_BWD, 6, "combine_backward")                                        \
  M(COMPUTE_BWD, 7, "compute_backward")                                        \
  M(DISPATCH_BWD, 8, "dispatch_backward")                                      \
  M(QUANTIZE_WEIGHT, 9, "quantize_weight")

typedef enum mok_op {
#define MOK_OP_ENUM_(name, value, str) MOK_OP_##name = value,
  MOK_OP_MAP(MOK_OP_ENUM_)
#undef MOK_OP_ENUM_
  MOK_OP_COUNT_
} mok_op;

/* Tensor slots: each names one argument of a job. A job names each slot at
 * most once. Shapes are checked against the layer (daemon/job_check.c). */
#define MOK_SLOT_MAP(M)                                                        \
  M(X, 0, "x")                                                                 \
  M(TOPK_IDS, 1, "topk_ids")                                                   \
  M(ROUTER_W, 2, "router_weights")                                             \
  M(W_GATE, 3, "w_gate")                                                       \
  M(W_UP, 4, "w_up")                                                           \
  M(W_DOWN, 5, "w_down")                                                       \
  M(S_GATE, 6, "s_gate")                                                       \
  M(S_UP, 7, "s_up")                                                           \
  M(S_DOWN, 8, "s_down")                                                       \
  M(OUT, 9, "out")                                                             \
  M(CTX, 10, "ctx")                                                            \
  M(D_OUT, 11, "d_out")                                                        \
  M(D_X, 12, "d_x")                                                            \
  M(D_RW, 13, "d_router_weights")                                              \
  M(D_W_GATE, 14, "d_w_gate")                                                  \
  M(D_W_UP, 15, "d_w_up")                                                      \
  M(D_W_DOWN, 16, "d_w_down")                                                  \
  M(D_S_GATE, 17, "d_s_gate")                                                  \
  M(D_S_UP, 18, "d_s_up")                                                      \
  M(D_S_DOWN, 19, "d_s_down")                                                  \
  M(SCHEDULE, 20, "schedule")                                                  \
  M(ACTS, 21, "acts")                                                          \
  M(ROUTED_X, 22, "routed_x")                                                  \
  M(ROUTED_Y, 23, "routed_y")                                                  \
  M(SHARED_Y, 24, "shared_y")                                                  \
  M(ROUTED_DOUT, 25, "routed_d_out")                                           \
  M(ROUTED_DX, 26, "routed_d_x")                                               \
  M(SHARED_DX, 27, "shared_d_x")                                              \
  M(PACKED_WEIGHT, 28, "packed_weight")

typedef enum mok_slot {
#define MOK_SLOT_ENUM_(name, value, str) MOK_SLOT_##name = value,
  MOK_SLOT_MAP(MOK_SLOT_ENUM_)
#undef MOK_SLOT_ENUM_
  MOK_SLOT_COUNT_
} mok_slot;

/* Job flags */
#define MOK_JOB_RECOMPUTE 0x1u /* backward: rebuild CTX from the inputs first */
/* forward of an fp8 layer: the weight slots hold the bf16 masters (as
 * quantize_weight's source); the job first writes their packed forms into
 * PACKED_WEIGHT (all of the layer's weights, mok_layer_packed_offset), as
 * quantize_weight would, then runs the forward on them (docs/cuda.md
 * "Capture and replay": what a replayed fp8 forward runs) */
#define MOK_JOB_QUANTIZE_WEIGHTS 0x2u
#define MOK_JOB_FLAGS_ALL 0x3u

/* Shared by mokd, libmok and mokctl (client/python/mok/_lib.py mirrors them). */
#define MOK_DEFAULT_SOCKET "/run/mok/mokd-0.sock" /* mokd's control socket, GPU 0 */
#define MOK_NCCL_ID_BYTES 128 /* an NCCL unique id (NCCL_UNIQUE_ID_BYTES), as the wire carries it */

#endif /* MOK_ENUMS_H */
