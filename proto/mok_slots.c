/* SPDX-License-Identifier: Apache-2.0 */
#include "mok_slots.h"

#include <stdio.h>
#include <string.h>

const char *mok_op_name(uint32_t op) {
  switch (op) {
#define OP_CASE_(name, value, str) case value: return str;
    MOK_OP_MAP(OP_CASE_)
#undef OP_CASE_
  default: return "unknown";
  }
}

const char *mok_slot_name(uint32_t slot) {
  switch (slot) {
#define SLOT_CASE_(name, value, str) case value: return str;
    MOK_SLOT_MAP(SLOT_CASE_)
#undef SLOT_CASE_
  default: return "unknown";
  }
}

const char *mok_dtype_name(uint32_t dtype) {
  switch (dtype) {
  case MOK_DTYPE_F32: return "float32";
  case MOK_DTYPE_BF16: return "bfloat16";
  case MOK_DTYPE_I32: return "int32";
  case MOK_DTYPE_U8: return "uint8";
  case MOK_DTYPE_FP8_E4M3: return "fp8";
  default: return "unknown";
  }
}

/* Slots that exist only with a shared expert. */
int mok_slot_is_shared(uint32_t s) {
  return s == MOK_SLOT_S_GATE || s == MOK_SLOT_S_UP || s == MOK_SLOT_S_DOWN ||
         s == MOK_SLOT_D_S_GATE || s == MOK_SLOT_D_S_UP || s == MOK_SLOT_D_S_DOWN ||
         s == MOK_SLOT_SHARED_Y || s == MOK_SLOT_SHARED_DX;
}

#define BIT(s) (1ull << (MOK_SLOT_##s))
#define WEIGHTS (BIT(W_GATE) | BIT(W_UP) | BIT(W_DOWN))
#define SHARED_W (BIT(S_GATE) | BIT(S_UP) | BIT(S_DOWN))
#define D_WEIGHTS (BIT(D_W_GATE) | BIT(D_W_UP) | BIT(D_W_DOWN))
#define D_SHARED_W (BIT(D_S_GATE) | BIT(D_S_UP) | BIT(D_S_DOWN))

typedef struct op_slots {
  uint64_t required;        /* always */
  uint64_t required_shared; /* when the layer has a shared expert */
  uint64_t optional;
  uint64_t outputs;
} op_slots;

static const op_slots op_table[MOK_OP_COUNT_] = {
  [MOK_OP_NOP] = {0, 0, 0, 0},
  [MOK_OP_FORWARD] = {BIT(X) | BIT(TOPK_IDS) | BIT(ROUTER_W) | WEIGHTS | BIT(OUT), SHARED_W,
                      BIT(CTX), BIT(OUT) | BIT(CTX)},
  [MOK_OP_BACKWARD] = {BIT(CTX) | BIT(D_OUT) | BIT(ROUTER_W) | BIT(X) | WEIGHTS | BIT(D_X) |
                           BIT(D_RW) | D_WEIGHTS,
                       SHARED_W | D_SHARED_W, BIT(TOPK_IDS),
                       BIT(D_X) | BIT(D_RW) | D_WEIGHTS | D_SHARED_W},
  [MOK_OP_DISPATCH] = {BIT(X) | BIT(TOPK_IDS) | BIT(SCHEDULE) | BIT(ROUTED_X), 0, 0,
                       BIT(SCHEDULE) | BIT(ROUTED_X)},
  [MOK_OP_COMPUTE] = {BIT(SCHEDULE) | BIT(ROUTED_X) | WEIGHTS | BIT(ROUTED_Y),
                      BIT(X) | SHARED_W | BIT(SHARED_Y), BIT(ACTS),
                      BIT(ROUTED_Y) | BIT(SHARED_Y) | BIT(ACTS)},
  [MOK_OP_COMBINE] = {BIT(SCHEDULE) | BIT(ROUTED_Y) | BIT(ROUTER_W) | BIT(OUT), BIT(SHARED_Y), 0,
                      BIT(OUT)},
  [MOK_OP_COMBINE_BWD] = {BIT(SCHEDULE) | BIT(D_OUT) | BIT(ROUTED_DOUT), 0, 0,
                          BIT(ROUTED_DOUT)},
  [MOK_OP_COMPUTE_BWD] = {BIT(SCHEDULE) | BIT(ACTS) | BIT(ROUTED_X) | BIT(ROUTED_DOUT) |
                              BIT(ROUTER_W) | WEIGHTS | BIT(ROUTED_DX) | BIT(D_RW) | D_WEIGHTS,
                          BIT(X) | BIT(D_OUT) | SHARED_W | BIT(SHARED_DX) | D_SHARED_W, 0,
                          BIT(ROUTED_DX) | BIT(D_RW) | D_WEIGHTS | BIT(SHARED_DX) | D_SHARED_W},
  [MOK_OP_DISPATCH_BWD] = {BIT(SCHEDULE) | BIT(ROUTED_DX) | BIT(D_X), BIT(SHARED_DX), 0,
                           BIT(D_X)},
  /* the source: exactly one of the weights (mok_quantize_source) */
  [MOK_OP_QUANTIZE_WEIGHT] = {BIT(PACKED_WEIGHT), 0, WEIGHTS | SHARED_W, BIT(PACKED_WEIGHT)},
};

mok_job_slots mok_job_slot_sets(const mok_layer_config *layer, uint32_t op, uint32_t flags) {
  mok_job_slots s = {0, 0};
  if (op >= MOK_OP_COUNT_) return s;
  const op_slots *o = &op_table[op];
  int shared = layer && layer->shared_intermediate > 0;
  s.required = o->required;
  s.optional = o->optional;
  if (shared) {
    s.required |= o->required_shared;
  } else {
    /* x and d_out also serve as plain inputs elsewhere; only the shared-expert slots vanish */
    for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
      uint64_t bit = 1ull << slot;
      if ((o->required_shared & bit) && !mok_slot_is_shared(slot)) s.optional |= bit;
    }
  }
  if (op == MOK_OP_BACKWARD && (flags & MOK_JOB_RECOMPUTE)) s.required |= BIT(TOPK_IDS);
  /* a quantising forward writes every weight's packed form there */
  if (op == MOK_OP_FORWARD && (flags & MOK_JOB_QUANTIZE_WEIGHTS)) s.required |= BIT(PACKED_WEIGHT);
  if (!shared) /* quantize_weight's optional sources: the shared expert's are no argument */
    for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
      if (mok_slot_is_shared(slot)) s.optional &= ~(1ull << slot);
  s.optional &= ~s.required;
  return s;
}

mok_slot_need mok_job_slot_need(const mok_layer_config *layer, uint32_t op, uint32_t flags,
                                uint32_t slot) {
  if (op >= MOK_OP_COUNT_ || slot >= MOK_SLOT_COUNT_) return MOK_NEED_NONE;
  mok_job_slots s = mok_job_slot_sets(layer, op, flags);
  uint64_t bit = 1ull << slot;
  if (s.required & bit) return MOK_NEED_REQUIRED;
  if (s.optional & bit) return MOK_NEED_OPTIONAL;
  return MOK_NEED_NONE;
}

int mok_job_slot_is_output(uint32_t op, uint32_t flags, uint32_t slot) {
  if (op >= MOK_OP_COUNT_ || slot >= MOK_SLOT_COUNT_) return 0;
  /* recompute rebuilds ctx in place: it is written */
  if (op == MOK_OP_BACKWARD && slot == MOK_SLOT_CTX) return (flags & MOK_JOB_RECOMPUTE) != 0;
  if (op == MOK_OP_FORWARD && slot == MOK_SLOT_PACKED_WEIGHT)
    return (flags & MOK_JOB_QUANTIZE_WEIGHTS) != 0;
  return (op_table[op].outputs >> slot) & 1u;
}

int mok_slot_weight_dims(const mok_layer_config *l, uint32_t slot, uint64_t dims[3]) {
  uint64_t H = l->hidden, I = l->intermediate, E = l->local_experts, Is = l->shared_intermediate;
  switch (slot) {
  case MOK_SLOT_W_GATE: case MOK_SLOT_W_UP:
    dims[0] = E, dims[1] = I, dims[2] = H;
    return 1;
  case MOK_SLOT_W_DOWN:
    dims[0] = E, dims[1] = H, dims[2] = I;
    return 1;
  case MOK_SLOT_S_GATE: case MOK_SLOT_S_UP:
    dims[0] = 1, dims[1] = Is, dims[2] = H;
    return 1;
  case MOK_SLOT_S_DOWN:
    dims[0] = 1, dims[1] = H, dims[2] = Is;
    return 1;
  default:
    return 0;
  }
}

uint64_t mok_slot_packed_bytes(const mok_layer_config *l, uint32_t slot) {
  uint64_t w[3];
  if (l->dtype != MOK_DTYPE_FP8_E4M3 || !mok_slot_weight_dims(l, slot, w)) return 0;
  return mok_fp8_weight_bytes(w[0], w[1], w[2]);
}

/* The weight slots in the order of their packed forms in a quantising
 * forward's packed_weight tensor. */
static const uint32_t packed_order[] = {MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN,
                                        MOK_SLOT_S_GATE, MOK_SLOT_S_UP, MOK_SLOT_S_DOWN};

uint64_t mok_packed_weights_offset(const mok_layer_config *l, uint32_t slot) {
  uint64_t at = 0;
  for (size_t i = 0; i < sizeof packed_order / sizeof packed_order[0]; i++) {
    uint64_t n = mok_slot_packed_bytes(l, packed_order[i]);
    if (!n || (mok_slot_is_shared(packed_order[i]) && !l->shared_intermediate)) continue;
    if (packed_order[i] == slot) return at;
    at += mok_align256(n);
  }
  return UINT64_MAX;
}

uint64_t mok_packed_weights_bytes(const mok_layer_config *l) {
  uint64_t at = 0;
  for (size_t i = 0; i < sizeof packed_order / sizeof packed_order[0]; i++)
    if (!mok_slot_is_shared(packed_order[i]) || l->shared_intermediate)
      at += mok_align256(mok_slot_packed_bytes(l, packed_order[i]));
  return at;
}

uint32_t mok_quantize_source(uint64_t present) {
  uint32_t source = MOK_SLOT_COUNT_;
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    if (!((present >> slot) & 1u) || !((WEIGHTS | SHARED_W) & (1ull << slot))) continue;
    if (source != MOK_SLOT_COUNT_) return MOK_SLOT_COUNT_;
    source = slot;
  }
  return source;
}

int mok_quantize_check(const mok_layer_config *l, uint64_t present, uint32_t *ret_source,
                       char *err, size_t errlen) {
  if (l->dtype != MOK_DTYPE_FP8_E4M3) {
    snprintf(err, errlen, "quantize_weight runs on fp8 layers only (this layer's weights are "
             "used as they are)");
    return MOK_EINVAL;
  }
  *ret_source = mok_quantize_source(present);
  if (*ret_source == MOK_SLOT_COUNT_) {
    snprintf(err, errlen, "quantize_weight takes exactly one source weight (w_gate, w_up, "
             "w_down%s)", l->shared_intermediate ? ", s_gate, s_up or s_down" : "");
    return MOK_EINVAL;
  }
  return MOK_OK;
}

/* A weight slot's bf16 master, in the shape a bf16 layer takes there. */
static void master_shape(const mok_layer_config *l, uint32_t slot, uint32_t *ret_dtype,
                         uint32_t *ret_ndim, uint64_t s[MOK_MAX_DIMS]) {
  memset(s, 0, sizeof(uint64_t) * MOK_MAX_DIMS);
  uint64_t w[3];
  if (!mok_slot_weight_dims(l, slot, w)) {
    *ret_dtype = MOK_DTYPE_INVALID, *ret_ndim = 0;
    return;
  }
  int shared = slot == MOK_SLOT_S_GATE || slot == MOK_SLOT_S_UP || slot == MOK_SLOT_S_DOWN;
  *ret_dtype = MOK_DTYPE_BF16, *ret_ndim = shared ? 2 : 3;
  for (uint32_t i = 0; i < *ret_ndim; i++) s[i] = w[shared + i];
}

void mok_job_slot_shape_op(const mok_layer_config *l, uint32_t op, uint32_t source,
                           uint32_t tokens, uint32_t slot, uint32_t *ret_dtype, uint32_t *ret_ndim,
                           uint64_t s[MOK_MAX_DIMS]) {
  if (op != MOK_OP_QUANTIZE_WEIGHT || (slot != source && slot != MOK_SLOT_PACKED_WEIGHT)) {
    mok_job_slot_shape(l, tokens, slot, ret_dtype, ret_ndim, s);
    return;
  }
  if (slot == source) {
    master_shape(l, source, ret_dtype, ret_ndim, s);
    return;
  }
  memset(s, 0, sizeof(uint64_t) * MOK_MAX_DIMS);
  uint64_t w[3];
  if (!mok_slot_weight_dims(l, source, w)) {
    *ret_dtype = MOK_DTYPE_INVALID, *ret_ndim = 0;
    return;
  }
  *ret_dtype = MOK_DTYPE_U8, *ret_ndim = 1;
  s[0] = mok_fp8_weight_bytes(w[0], w[1], w[2]);
}

void mok_job_slot_shape_job(const mok_layer_config *l, uint32_t op, uint32_t flags,
                            uint32_t source, uint32_t tokens, uint32_t slot, uint32_t *ret_dtype,
                            uint32_t *ret_ndim, uint64_t s[MOK_MAX_DIMS]) {
  if (op != MOK_OP_FORWARD || !(flags & MOK_JOB_QUANTIZE_WEIGHTS) ||
      l->dtype != MOK_DTYPE_FP8_E4M3) {
    mok_job_slot_shape_op(l, op, source, tokens, slot, ret_dtype, ret_ndim, s);
    return;
  }
  if (slot == MOK_SLOT_PACKED_WEIGHT) { /* every weight's packed form, one tensor */
    memset(s, 0, sizeof(uint64_t) * MOK_MAX_DIMS);
    *ret_dtype = MOK_DTYPE_U8, *ret_ndim = 1;
    s[0] = mok_packed_weights_bytes(l);
    return;
  }
  if (mok_slot_packed_bytes(l, slot)) { /* a weight slot: its bf16 master */
    master_shape(l, slot, ret_dtype, ret_ndim, s);
    return;
  }
  mok_job_slot_shape(l, tokens, slot, ret_dtype, ret_ndim, s);
}

void mok_job_slot_shape(const mok_layer_config *l, uint32_t tokens, uint32_t slot,
                        uint32_t *ret_dtype, uint32_t *ret_ndim, uint64_t s[MOK_MAX_DIMS]) {
  mok_layout_dims d = mok_layer_dims(l, tokens);
  uint64_t T = tokens, H = l->hidden, I = l->intermediate, E = l->local_experts, K = l->topk,
           Is = l->shared_intermediate;
  uint32_t dt = mok_layer_act_dtype(l->dtype), nd = 2;
  memset(s, 0, sizeof(uint64_t) * MOK_MAX_DIMS);
  uint64_t packed = mok_slot_packed_bytes(l, slot);
  if (packed) { /* an fp8 layer's weights: packed (mok_wire.h) */
    *ret_dtype = MOK_DTYPE_U8, *ret_ndim = 1;
    s[0] = packed;
    return;
  }
  switch (slot) {
  case MOK_SLOT_X: case MOK_SLOT_OUT: case MOK_SLOT_D_OUT: case MOK_SLOT_D_X:
  case MOK_SLOT_SHARED_Y: case MOK_SLOT_SHARED_DX:
    s[0] = T, s[1] = H;
    break;
  case MOK_SLOT_TOPK_IDS:
    dt = MOK_DTYPE_I32, s[0] = T, s[1] = K;
    break;
  case MOK_SLOT_ROUTER_W: case MOK_SLOT_D_RW:
    dt = MOK_DTYPE_F32, s[0] = T, s[1] = K;
    break;
  case MOK_SLOT_W_GATE: case MOK_SLOT_W_UP: case MOK_SLOT_D_W_GATE: case MOK_SLOT_D_W_UP:
    nd = 3, s[0] = E, s[1] = I, s[2] = H;
    break;
  case MOK_SLOT_W_DOWN: case MOK_SLOT_D_W_DOWN:
    nd = 3, s[0] = E, s[1] = H, s[2] = I;
    break;
  case MOK_SLOT_S_GATE: case MOK_SLOT_S_UP: case MOK_SLOT_D_S_GATE: case MOK_SLOT_D_S_UP:
    s[0] = Is, s[1] = H;
    break;
  case MOK_SLOT_S_DOWN: case MOK_SLOT_D_S_DOWN:
    s[0] = H, s[1] = Is;
    break;
  case MOK_SLOT_ROUTED_X: case MOK_SLOT_ROUTED_Y: case MOK_SLOT_ROUTED_DOUT:
  case MOK_SLOT_ROUTED_DX:
    s[0] = mok_rows_capacity(&d), s[1] = H;
    break;
  case MOK_SLOT_SCHEDULE:
    dt = MOK_DTYPE_I32, nd = 1, s[0] = mok_schedule_ints(&d);
    break;
  case MOK_SLOT_ACTS:
    dt = MOK_DTYPE_U8, nd = 1, s[0] = mok_acts_bytes(&d);
    break;
  case MOK_SLOT_CTX:
    dt = MOK_DTYPE_U8, nd = 1;
    s[0] = l->group_id ? mok_group_ctx_bytes(l, tokens) : mok_ctx_bytes(&d);
    break;
  default:
    dt = MOK_DTYPE_INVALID, nd = 0;
  }
  *ret_dtype = dt;
  *ret_ndim = nd;
}

