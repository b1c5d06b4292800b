/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine's e4m3 side of fp8 layers (docs/math.md, "FP8 (e4m3,
 * block-scaled)"): quantize_weight, the 1x128 quantisation of activation
 * rows, and the decoding of packed weights into the f32 operands the FP8
 * GEMMs (cpu/steps.c) read. Every byte and scale comes from
 * kernels/common/fp8_e4m3.h, the definition the cuda engine shares.
 *
 * A packed weight is client memory: written by quantize_weight (never read
 * back), read by forward and backward as plain values (its scales copied
 * out with memcpy: the tensor may start at any byte). */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "common/fp8_e4m3.h"
#include "cpu/steps.h"
#include "mok_slots.h"

_Static_assert(MOK_FP8_BLOCK == 128u, "mok_wire.h's packed layout is in blocks of 128");
#define BLOCK ((size_t)MOK_FP8_BLOCK)

/* ---- quantize_weight -------------------------------------------------------- */

typedef struct quantize_weight_arg {
  const mok_bf16 *w; /* [E, N, K] */
  size_t N, K;
  uint8_t *bytes;    /* [E, N, K] */
  uint8_t *t_bytes;  /* [E, K, N]: the transpose of bytes */
  char *scales;      /* [E, N/128, K/128] f32, any alignment */
} quantize_weight_arg;

/* Items: block rows (e, nb), 128 rows of one matrix each (and 128 columns
 * of its transpose). */
static void quantize_block_rows(void *p, size_t i0, size_t i1) {
  const quantize_weight_arg *a = p;
  const size_t nbs = a->N / BLOCK, kbs = a->K / BLOCK;
  uint8_t q[BLOCK * BLOCK]; /* one block's bytes, [n][k] */
  for (size_t item = i0; item < i1; item++) {
    const size_t e = item / nbs, nb = item % nbs;
    const size_t row0 = e * a->N + nb * BLOCK;
    for (size_t kb = 0; kb < kbs; kb++) {
      float amax = 0.0f;
      for (size_t n = 0; n < BLOCK; n++) {
        const mok_bf16 *w = a->w + (row0 + n) * a->K + kb * BLOCK;
        for (size_t k = 0; k < BLOCK; k++) amax = fmaxf(amax, fabsf(mok_bf16_to_f32(w[k])));
      }
      const int ex = mok_fp8_scale_exp(amax);
      for (size_t n = 0; n < BLOCK; n++) {
        const size_t at = (row0 + n) * a->K + kb * BLOCK;
        for (size_t k = 0; k < BLOCK; k++)
          q[n * BLOCK + k] = mok_fp8_quantize(mok_bf16_to_f32(a->w[at + k]), ex);
        memcpy(a->bytes + at, q + n * BLOCK, BLOCK);
      }
      /* the transpose: row kb*128 + k of matrix e, columns nb*128 .. +127 */
      for (size_t k = 0; k < BLOCK; k++) {
        uint8_t *t = a->t_bytes + (e * a->K + kb * BLOCK + k) * a->N + nb * BLOCK;
        for (size_t n = 0; n < BLOCK; n++) t[n] = q[n * BLOCK + k];
      }
      const float s = mok_fp8_pow2(ex);
      memcpy(a->scales + ((e * nbs + nb) * kbs + kb) * sizeof s, &s, sizeof s);
    }
  }
}

/* The bf16 weight src of weight slot `slot` into its packed form at packed. */
static mok_status quantize_weight(job_env *env, uint32_t slot, const void *src, uint8_t *packed) {
  uint64_t w[3];
  if (!mok_slot_weight_dims(env->cfg, slot, w))
    return mok__cpu_job_fail(env, MOK_EINVAL, "no source weight");
  const size_t used = (size_t)(w[0] * w[1] * w[2]);
  const size_t t_at = (size_t)mok_fp8_transposed_offset(w[0], w[1], w[2]);
  const size_t s_at = (size_t)mok_fp8_scales_offset(w[0], w[1], w[2]);
  quantize_weight_arg a = {src, (size_t)w[1], (size_t)w[2], packed, packed + t_at,
                           (char *)packed + s_at};
  /* the bytes after each e4m3 section, up to the next: zero, as the layout says */
  memset(packed + used, 0, t_at - used);
  memset(packed + t_at + used, 0, s_at - t_at - used);
  mok__cpu_par_for(env, (size_t)w[0] * a.N / BLOCK, quantize_block_rows, &a);
  return MOK_OK;
}

mok_status mok__cpu_op_quantize_weight(job_env *env) {
  return quantize_weight(env, env->quant_source, env->tensors[env->quant_source],
                         env->tensors[MOK_SLOT_PACKED_WEIGHT]);
}

mok_status mok__cpu_fp8_quantize_weights(job_env *env) {
  uint8_t *packed = env->tensors[MOK_SLOT_PACKED_WEIGHT];
  static const uint32_t weights[] = {MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN,
                                     MOK_SLOT_S_GATE, MOK_SLOT_S_UP, MOK_SLOT_S_DOWN};
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++) {
    const uint64_t at = mok_packed_weights_offset(env->cfg, weights[i]);
    if (at == UINT64_MAX) continue; /* the layer has no such weight (no shared expert) */
    mok_status st = quantize_weight(env, weights[i], env->tensors[weights[i]], packed + at);
    if (st != MOK_OK) return st;
    env->tensors[weights[i]] = packed + at; /* the rest of the job reads the packed form */
  }
  /* the padding between the forms: zero, like every gap of the layout */
  uint64_t end = 0;
  for (size_t i = 0; i < sizeof weights / sizeof weights[0]; i++) {
    const uint64_t at = mok_packed_weights_offset(env->cfg, weights[i]);
    if (at == UINT64_MAX) continue;
    if (at > end) memset(packed + end, 0, (size_t)(at - end));
    end = at + mok_slot_packed_bytes(env->cfg, weights[i]);
  }
  const uint64_t total = mok_packed_weights_bytes(env->cfg);
  if (total > end) memset(packed + end, 0, (size_t)(total - end));
  return MOK_OK;
}

/* ---- activation rows: 1x128 blocks ---------------------------------------- */

typedef struct quantize_rows_arg {
  const ffn_set *set;
  const float *src;
  size_t K;
  float *q, *s;
  size_t ld_q, ld_s;
} quantize_rows_arg;

static void quantize_rows_fn(void *p, size_t r0, size_t r1) {
  const quantize_rows_arg *a = p;
  for (size_t r = r0; r < r1; r++) {
    float *q = a->q + r * a->ld_q, *s = a->s + r * a->ld_s;
    if (a->set && a->set->row_slot && a->set->row_slot[r] < 0) {
      memset(q, 0, a->K * sizeof *q);
      memset(s, 0, a->K / BLOCK * sizeof *s);
      continue;
    }
    const float *x = a->src + r * a->K;
    for (size_t kb = 0; kb < a->K / BLOCK; kb++) {
      float amax = 0.0f;
      for (size_t k = kb * BLOCK; k < (kb + 1) * BLOCK; k++) amax = fmaxf(amax, fabsf(x[k]));
      const int ex = mok_fp8_scale_exp(amax);
      for (size_t k = kb * BLOCK; k < (kb + 1) * BLOCK; k++)
        q[k] = mok_fp8_decode(mok_fp8_quantize(x[k], ex));
      s[kb] = mok_fp8_pow2(ex);
    }
  }
}

void mok__cpu_fp8_quantize_rows(job_env *env, const ffn_set *set, const float *src, size_t rows,
                                size_t K, float *q, size_t ld_q, float *s, size_t ld_s) {
  quantize_rows_arg a = {set, src, K, q, s, ld_q, ld_s};
  mok__cpu_par_for(env, rows, quantize_rows_fn, &a);
}

/* ---- packed weights -> f32 operands ----------------------------------------
 *
 * Each GEMM reads the section of the packed form that the cuda engine's
 * e4m3 tensor cores take as its K-major operand: the forward the first
 * ([N, K], K its contraction), the dgrads the transposed one ([K, N], N
 * their contraction). Never one section rebuilt from the other, so both
 * engines read the same bytes even of a packed form whose sections disagree. */

typedef struct unpack_arg {
  const ffn_group *groups;
  const uint8_t *bytes; /* one section: [n_w, rows, cols] */
  size_t rows, cols;
  float *dst;
  size_t w_stride, n0, k0, ld;
} unpack_arg;

/* Items: section rows (w, r), each one output column of the GEMM. */
static void unpack_rows(void *p, size_t i0, size_t i1) {
  const unpack_arg *a = p;
  for (size_t item = i0; item < i1; item++) {
    const size_t w = item / a->rows, r = item % a->rows;
    if (a->groups[w].rows == 0) continue; /* idle expert: never read */
    const uint8_t *b = a->bytes + item * a->cols;
    float *d = a->dst + w * a->w_stride + a->k0 * a->ld + a->n0 + r;
    for (size_t c = 0; c < a->cols; c++) d[c * a->ld] = mok_fp8_decode(b[c]);
  }
}

void mok__cpu_fp8_unpack(job_env *env, const ffn_group *groups, size_t n_w, const void *packed,
                         size_t N, size_t K, bool transposed, float *dst, size_t w_stride,
                         size_t n0, size_t k0, size_t ld, float *scales, size_t s_stride,
                         size_t s_row0) {
  const uint8_t *section = (const uint8_t *)packed +
                           (transposed ? (size_t)mok_fp8_transposed_offset(n_w, N, K) : 0);
  unpack_arg a = {groups, section, transposed ? K : N, transposed ? N : K, dst, w_stride,
                  n0, k0, ld};
  mok__cpu_par_for(env, n_w * a.rows, unpack_rows, &a);
  const char *src = (const char *)packed + mok_fp8_scales_offset(n_w, N, K);
  const size_t per_w = (N / BLOCK) * (K / BLOCK);
  for (size_t w = 0; w < n_w; w++)
    memcpy(scales + w * s_stride + s_row0 * (K / BLOCK), src + w * per_w * sizeof(float),
           per_w * sizeof(float));
}
