/* SPDX-License-Identifier: Apache-2.0 */
#include "layer.h"

#include <stdio.h>

#include "common/fp8_e4m3.h"
#include "mok_status.h"
#include "mok_wire.h"

static int check_range(const char *what, uint32_t v, uint32_t lo, uint32_t hi, char *err,
                       size_t errlen) {
  if (v >= lo && v <= hi) return MOK_OK;
  snprintf(err, errlen, "%s = %u is out of range [%u, %u]", what, v, lo, hi);
  return MOK_EINVAL;
}

int mok_layer_check_fp8_blocks(const mok_layer_config *cfg, char *err, size_t errlen) {
  const struct {
    const char *name;
    uint32_t v;
  } dims[] = {{"hidden", cfg->hidden},
              {"intermediate", cfg->intermediate},
              {"shared_intermediate", cfg->shared_intermediate}};
  for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++) {
    if (dims[i].v % MOK_FP8_BLOCK == 0) continue; /* 0: no shared expert */
    snprintf(err, errlen,
             "%s = %u is not a multiple of %u: an fp8 layer's GEMMs scale blocks of %u elements "
             "along hidden, intermediate and shared_intermediate",
             dims[i].name, dims[i].v, MOK_FP8_BLOCK, MOK_FP8_BLOCK);
    return MOK_EINVAL;
  }
  /* a packed weight (its e4m3 bytes in both orientations, then its scales)
   * is one u8 dimension, which the wire holds in 32 bits; w_up and w_down
   * are w_gate's size, s_up and s_down s_gate's */
  const struct {
    const char *name, *advice;
    uint64_t bytes;
  } packed[] = {
      {"w_gate", "fewer experts per layer (expert parallelism) or smaller H, I",
       mok_fp8_weight_bytes(cfg->local_experts, cfg->intermediate, cfg->hidden)},
      {"s_gate", "a smaller H or shared_intermediate",
       mok_fp8_weight_bytes(1, cfg->shared_intermediate, cfg->hidden)},
  };
  for (size_t i = 0; i < sizeof packed / sizeof packed[0]; i++) {
    if (packed[i].bytes <= UINT32_MAX) continue;
    snprintf(err, errlen,
             "an fp8 layer's packed %s would be %llu bytes (its e4m3 bytes and their transpose, "
             "then its scales), more than the 4 GiB one tensor dimension holds: use %s",
             packed[i].name, (unsigned long long)packed[i].bytes, packed[i].advice);
    return MOK_ELIMIT;
  }
  return MOK_OK;
}

int mok_layer_validate(mok_layer_config *cfg, char *err, size_t errlen) {
  int r;
  if ((r = check_range("hidden", cfg->hidden, 1, MOK_LAYER_MAX_DIM, err, errlen)) ||
      (r = check_range("intermediate", cfg->intermediate, 1, MOK_LAYER_MAX_DIM, err, errlen)) ||
      (r = check_range("experts", cfg->experts, 1, MOK_LAYER_MAX_EXPERTS, err, errlen)) ||
      (r = check_range("topk", cfg->topk, 1, MOK_LAYER_MAX_TOPK, err, errlen)) ||
      (r = check_range("shared_intermediate", cfg->shared_intermediate, 0, MOK_LAYER_MAX_DIM,
                       err, errlen)) ||
      (r = check_range("max_tokens", cfg->max_tokens, 1, MOK_LAYER_MAX_TOKENS, err, errlen)))
    return r;
  if (cfg->topk > cfg->experts) {
    snprintf(err, errlen, "topk = %u exceeds experts = %u", cfg->topk, cfg->experts);
    return MOK_EINVAL;
  }
  if (cfg->dtype != MOK_DTYPE_F32 && cfg->dtype != MOK_DTYPE_BF16 &&
      cfg->dtype != MOK_DTYPE_FP8_E4M3) {
    snprintf(err, errlen, "dtype must be float32, bfloat16 or fp8 (float8_e4m3fn)");
    return MOK_EINVAL;
  }
  if (cfg->has_limit && !(cfg->swiglu_limit > 0.0f && cfg->swiglu_limit < 1e30f)) {
    snprintf(err, errlen, "swiglu_limit must be a positive finite number");
    return MOK_EINVAL;
  }
  if (!cfg->has_limit) cfg->swiglu_limit = 0.0f;
  cfg->local_experts = cfg->experts;
  cfg->first_expert = 0;
  /* a group layer's packed weights hold its rank's experts, known once the
   * engine thread placed it in its group: the engines' prepare_layer checks
   * it then */
  if (cfg->dtype == MOK_DTYPE_FP8_E4M3 && !cfg->group_id)
    return mok_layer_check_fp8_blocks(cfg, err, errlen);
  return MOK_OK;
}
