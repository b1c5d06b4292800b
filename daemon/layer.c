/* SPDX-License-Identifier: Apache-2.0 */
#include "layer.h"

#include <stdio.h>

#include "mok_status.h"

static int check_range(const char *what, uint32_t v, uint32_t lo, uint32_t hi, char *err,
                       size_t errlen) {
  if (v >= lo && v <= hi) return MOK_OK;
  snprintf(err, errlen, "%s = %u is out of range [%u, %u]", what, v, lo, hi);
  return MOK_EINVAL;
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
  if (cfg->dtype != MOK_DTYPE_F32 && cfg->dtype != MOK_DTYPE_BF16) {
    snprintf(err, errlen, "dtype must be float32 or bfloat16");
    return MOK_EINVAL;
  }
  if (cfg->has_limit && !(cfg->swiglu_limit > 0.0f && cfg->swiglu_limit < 1e30f)) {
    snprintf(err, errlen, "swiglu_limit must be a positive finite number");
    return MOK_EINVAL;
  }
  if (!cfg->has_limit) cfg->swiglu_limit = 0.0f;
  cfg->local_experts = cfg->experts;
  cfg->first_expert = 0;
  return MOK_OK;
}
