/* SPDX-License-Identifier: Apache-2.0 */
/* Layers: validating a client's layer description. */
#ifndef MOK_LAYER_H
#define MOK_LAYER_H

#include <stddef.h>

#include "engine.h"

#define MOK_LAYER_MAX_DIM 65536u     /* H, I, I_s */
#define MOK_LAYER_MAX_EXPERTS 4096u
#define MOK_LAYER_MAX_TOPK 64u
#define MOK_LAYER_MAX_TOKENS (1u << 20)

/* Check the client-provided fields of cfg (everything but row_align, which
 * the engine fills) and set local_experts/first_expert for a layer without
 * a group. Returns a mok_status and fills err with what to change. */
int mok_layer_validate(mok_layer_config *cfg, char *err, size_t errlen);
/* An fp8 layer's dimensions are whole FP8 blocks (H, I and I_s multiples of
 * MOK_FP8_BLOCK; I_s may be 0): MOK_OK, or MOK_EINVAL naming the dimension;
 * MOK_ELIMIT when a packed weight (routed or shared; both orientations
 * and the scales, mok_fp8_weight_bytes) would pass 4 GiB (one wire
 * dimension).
 * mok_layer_validate checks it for a layer without a group; the engines'
 * prepare_layer check it (again) with the layer's local experts, which for
 * a layer on a group are its rank's. */
int mok_layer_check_fp8_blocks(const mok_layer_config *cfg, char *err, size_t errlen);

#endif
