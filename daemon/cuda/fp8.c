/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda engine's jobs on fp8 layers (docs/math.md, "FP8 (e4m3,
 * block-scaled)"): the bf16 layer's ops with the GEMMs in FP8 on the
 * Hopper kernels. What differs from the bf16 ops (cuda/engine.c):
 *  - x (forward) and d_out (backward) are quantised once per token into
 *    the job's workspace, and the routed rows copy their token's bytes and
 *    scales; the shared expert reads the token rows. A single step that
 *    brings routed rows (compute, compute_backward) quantises those;
 *  - the weight slots hold packed weights (their dtype u8, checked by the
 *    daemon against mok_fp8_weight_bytes), read in place: every FP8 product
 *    reads its operands through TMA, so nothing is staged;
 *  - quantize_weight writes a packed weight from its bf16 source.
 * Everything else (schedule, dispatch, combine, their backward forms, the
 * weight gradients) is the bf16 layer's, on the same kernels. */
#include <stdint.h>

#include "cuda/internal.h"
#include "mok_kernels.h"
#include "mok_slots.h"

#define PACKED(c, s) ((const void *)T_((c), MOK_SLOT_##s))

/* rows of src [rows, H] quantised into q, s */
static void quantize(job_ctx *c, const uint16_t *src, int rows, uint8_t *q, float *s) {
  LAUNCH(c, mok_k_fp8_quantize_rows(src, rows, c->d.H, q, s, c->st));
}

/* src [T, H] per token, then its routed rows (workspace f8_tq -> f8_rq) */
static void quantize_routed(job_ctx *c, const int32_t *sched, const uint16_t *src) {
  const job_ws *w = &c->w;
  quantize(c, src, c->d.T, w->f8_tq, w->f8_ts);
  LAUNCH(c, mok_k_fp8_gather_rows(&c->d, sched, w->f8_tq, w->f8_ts, w->f8_rq, w->f8_rs, c->status,
                                  c->st));
}

static int rows_of(const job_ctx *c) { return (int)mok_k_rows_capacity(&c->d); }

/* compute: the routed experts from f8_rq, the shared one from f8_tq */
static void compute(job_ctx *c, const int32_t *sched, const acts_ptrs *a, uint16_t *routed_y,
                    uint16_t *shared_y) {
  const job_ws *w = &c->w;
  LAUNCH(c, mok_k_fp8_expert_forward(&c->d, sched, w->f8_rq, w->f8_rs, PACKED(c, W_GATE),
                                     PACKED(c, W_UP), PACKED(c, W_DOWN), a->g, a->u, routed_y,
                                     w->kernels, c->status, c->st));
  if (c->d.I_s)
    LAUNCH(c, mok_k_fp8_shared_forward(&c->d, w->f8_tq, w->f8_ts, PACKED(c, S_GATE),
                                       PACKED(c, S_UP), PACKED(c, S_DOWN), a->gs, a->us, shared_y,
                                       w->kernels, c->status, c->st));
}

/* compute_backward: d_out's quantised rows in f8_rq (routed) and f8_tq
 * (tokens); gather_x non-NULL: routed_x is written from it by the backward */
static void compute_bwd(job_ctx *c, const int32_t *sched, const acts_ptrs *a,
                        const uint16_t *gather_x, uint16_t *routed_x, const uint16_t *routed_dout,
                        uint16_t *routed_dx, uint16_t *shared_dx) {
  const job_ws *w = &c->w;
  LAUNCH(c, mok_k_fp8_expert_backward(
                &c->d, sched, a->g, a->u, gather_x, routed_x, routed_dout, w->f8_rq, w->f8_rs,
                (const float *)T_(c, MOK_SLOT_ROUTER_W), PACKED(c, W_GATE), PACKED(c, W_UP),
                PACKED(c, W_DOWN), routed_dx, (float *)T_(c, MOK_SLOT_D_RW), BF(c, D_W_GATE),
                BF(c, D_W_UP), BF(c, D_W_DOWN), w->kernels, c->status, c->st));
  if (c->d.I_s)
    LAUNCH(c, mok_k_fp8_shared_backward(&c->d, BF(c, X), BF(c, D_OUT), w->f8_tq, w->f8_ts,
                                        a->gs, a->us, PACKED(c, S_GATE), PACKED(c, S_UP),
                                        PACKED(c, S_DOWN), shared_dx, BF(c, D_S_GATE),
                                        BF(c, D_S_UP), BF(c, D_S_DOWN), w->kernels, c->status,
                                        c->st));
}

static void fp8_forward_packed(job_ctx *c);

/* A quantising forward (MOK_JOB_QUANTIZE_WEIGHTS): every weight's bf16 master
 * into its packed form in packed_weight (mok_packed_weights_offset), on the
 * job's stream before its products; q becomes the job's arguments with the
 * weight slots on those forms (the caller points c->a at it). */
static void quantize_weights(job_ctx *c, mok_job_args *q) {
  static const uint32_t weights[] = {MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN,
                                     MOK_SLOT_S_GATE, MOK_SLOT_S_UP, MOK_SLOT_S_DOWN};
  *q = *c->a;
  char *packed = T_(c, MOK_SLOT_PACKED_WEIGHT);
  uint64_t end = 0;
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++) {
    const uint64_t at = mok_packed_weights_offset(c->a->layer, weights[i]);
    uint64_t w[3];
    if (at == UINT64_MAX || !mok_slot_weight_dims(c->a->layer, weights[i], w)) continue;
    if (!T_(c, (int)weights[i]) || !packed) {
      mok__cuda_job_fail(c, MOK_EINVAL, "a quantising forward needs every weight and "
                         "packed_weight");
      return;
    }
    if (at > end) mok__cuda_memset_async(c, packed + end, (size_t)(at - end));
    LAUNCH(c, mok_k_fp8_quantize_weight(T_(c, (int)weights[i]), (int)w[0], (int)w[1], (int)w[2],
                                        packed + at, c->st));
    end = at + mok_slot_packed_bytes(c->a->layer, weights[i]);
    q->t[weights[i]].ptr = packed + at;
    q->t[weights[i]].bytes = mok_slot_packed_bytes(c->a->layer, weights[i]);
    q->t[weights[i]].dtype = MOK_DTYPE_U8;
  }
  const uint64_t total = mok_packed_weights_bytes(c->a->layer);
  if (total > end) mok__cuda_memset_async(c, packed + end, (size_t)(total - end));
}

static void fp8_forward(job_ctx *c) {
  mok_job_args quantized;
  if (c->a->flags & MOK_JOB_QUANTIZE_WEIGHTS) {
    quantize_weights(c, &quantized);
    if (c->failed) return;
    const mok_job_args *given = c->a;
    c->a = &quantized; /* the products read the packed forms */
    fp8_forward_packed(c);
    c->a = given;
    return;
  }
  fp8_forward_packed(c);
}

static void fp8_forward_packed(job_ctx *c) {
  void *ctx = T_(c, MOK_SLOT_CTX);
  const job_ws *w = &c->w;
  acts_ptrs a = ctx ? mok__cuda_ctx_acts(c, ctx) : mok__cuda_acts_split(c, w->acts, false);
  mok__cuda_sched_build(c);
  quantize_routed(c, w->sched, BF(c, X));
  compute(c, w->sched, &a, w->routed_b, w->shared);
  LAUNCH(c, mok_k_combine(&c->d, w->sched, w->routed_b, (const float *)T_(c, MOK_SLOT_ROUTER_W),
                          c->d.I_s ? w->shared : NULL, BF(c, OUT), c->status, c->st));
  if (ctx) mok__cuda_ctx_out(c, ctx);
}

static void fp8_backward(job_ctx *c) {
  void *ctx = T_(c, MOK_SLOT_CTX);
  const job_ws *w = &c->w;
  const int32_t *sched = w->sched;
  acts_ptrs a;
  if (c->a->flags & MOK_JOB_RECOMPUTE) {
    /* the forward's g, u again, bitwise: the same quantisation and kernels */
    a = ctx ? mok__cuda_ctx_acts(c, ctx) : mok__cuda_acts_split(c, w->acts, false);
    mok__cuda_sched_build(c);
    quantize_routed(c, sched, BF(c, X));
    LAUNCH(c, mok_k_fp8_gate_up(&c->d, sched, w->f8_rq, w->f8_rs, PACKED(c, W_GATE),
                                PACKED(c, W_UP), a.g, a.u, w->kernels, c->status, c->st));
    if (c->d.I_s)
      LAUNCH(c, mok_k_fp8_shared_forward(&c->d, w->f8_tq, w->f8_ts, PACKED(c, S_GATE),
                                         PACKED(c, S_UP), PACKED(c, S_DOWN), a.gs, a.us,
                                         w->shared, w->kernels, c->status, c->st));
  } else if (!ctx) {
    mok__cuda_job_fail(c, MOK_EINVAL, "backward needs the forward's ctx, or the recompute flag");
    return;
  } else {
    a = mok__cuda_ctx_acts(c, ctx);
    sched = mok__cuda_sched_in(c, ctx);
  }
  /* the ctx keeps no routed x: the backward gathers it (beside a product) */
  LAUNCH(c, mok_k_gather_rows(&c->d, sched, BF(c, D_OUT), w->routed_b, c->status, c->st));
  quantize_routed(c, sched, BF(c, D_OUT));
  compute_bwd(c, sched, &a, BF(c, X), w->routed_a, w->routed_b, w->routed_c, w->shared);
  LAUNCH(c, mok_k_dispatch_backward(&c->d, sched, w->routed_c, c->d.I_s ? w->shared : NULL,
                                    BF(c, D_X), c->status, c->st));
  if ((c->a->flags & MOK_JOB_RECOMPUTE) && ctx) mok__cuda_ctx_out(c, ctx);
}

/* quantize_weight: the one source weight present (the daemon checked it) */
static void fp8_quantize_weight(job_ctx *c) {
  uint64_t present = 0;
  for (int s = 0; s < MOK_SLOT_COUNT_; s++)
    if (c->a->t[s].ptr) present |= 1ull << s;
  const uint32_t source = mok_quantize_source(present);
  uint64_t w[3];
  if (source == MOK_SLOT_COUNT_ || !mok_slot_weight_dims(c->a->layer, source, w)) {
    mok__cuda_job_fail(c, MOK_EINVAL, "quantize_weight takes exactly one source weight");
    return;
  }
  LAUNCH(c, mok_k_fp8_quantize_weight(T_(c, (int)source), (int)w[0], (int)w[1], (int)w[2],
                                      T_(c, MOK_SLOT_PACKED_WEIGHT), c->st));
}

/* The single steps with products; dispatch, combine and their backward forms
 * are the bf16 layer's (mok__cuda_op_step). */
static void fp8_step(job_ctx *c) {
  const void *client_sched = T_(c, MOK_SLOT_SCHEDULE);
  const job_ws *w = &c->w;
  switch (c->a->op) {
  case MOK_OP_COMPUTE: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    void *acts = T_(c, MOK_SLOT_ACTS);
    acts_ptrs a = mok__cuda_acts_split(c, acts ? acts : w->acts, acts != NULL);
    quantize(c, BF(c, ROUTED_X), rows_of(c), w->f8_rq, w->f8_rs);
    if (c->d.I_s) quantize(c, BF(c, X), c->d.T, w->f8_tq, w->f8_ts);
    compute(c, s, &a, BF(c, ROUTED_Y), BF(c, SHARED_Y));
    break;
  }
  case MOK_OP_COMPUTE_BWD: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    acts_ptrs a = mok__cuda_acts_split(c, T_(c, MOK_SLOT_ACTS), false);
    quantize(c, BF(c, ROUTED_DOUT), rows_of(c), w->f8_rq, w->f8_rs);
    if (c->d.I_s) quantize(c, BF(c, D_OUT), c->d.T, w->f8_tq, w->f8_ts);
    compute_bwd(c, s, &a, NULL, BF(c, ROUTED_X), BF(c, ROUTED_DOUT), BF(c, ROUTED_DX),
                BF(c, SHARED_DX));
    break;
  }
  case MOK_OP_QUANTIZE_WEIGHT:
    fp8_quantize_weight(c);
    break;
  default:
    mok__cuda_op_step(c);
  }
}

void mok__cuda_fp8_job(job_ctx *c) {
  if (c->a->op == MOK_OP_FORWARD)
    fp8_forward(c);
  else if (c->a->op == MOK_OP_BACKWARD)
    fp8_backward(c);
  else
    fp8_step(c);
}
