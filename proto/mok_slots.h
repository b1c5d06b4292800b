/* SPDX-License-Identifier: Apache-2.0 */
/* Which tensors each job takes, and their shapes: one table that mokd
 * validates against and libmok fills descriptors from. */
#ifndef MOK_SLOTS_H
#define MOK_SLOTS_H

#include "mok_wire.h"

/* What each op needs in each slot. */
typedef enum mok_slot_need {
  MOK_NEED_NONE = 0,     /* must be absent */
  MOK_NEED_REQUIRED = 1, /* must be present */
  MOK_NEED_OPTIONAL = 2, /* may be present */
} mok_slot_need;

/* An op's slots as bit masks (1 << slot) for a layer and job flags: the
 * required ones, and the optional ones; every other slot must be absent. */
typedef struct mok_job_slots {
  uint64_t required;
  uint64_t optional;
} mok_job_slots;

mok_job_slots mok_job_slot_sets(const mok_layer_config *layer, uint32_t op, uint32_t flags);
/* One slot of those sets. */
mok_slot_need mok_job_slot_need(const mok_layer_config *layer, uint32_t op, uint32_t flags,
                                uint32_t slot);
/* The expected dtype and shape of slot for the layer at T tokens. */
void mok_job_slot_shape(const mok_layer_config *layer, uint32_t tokens, uint32_t slot,
                        uint32_t *ret_dtype, uint32_t *ret_ndim, uint64_t ret_shape[MOK_MAX_DIMS]);
/* As mok_job_slot_shape, for a job of op: quantize_weight reads its source
 * (the weight slot it names) as the bf16 weight and writes PACKED_WEIGHT,
 * the source's packed form (source is ignored for the other ops). */
void mok_job_slot_shape_op(const mok_layer_config *layer, uint32_t op, uint32_t source,
                           uint32_t tokens, uint32_t slot, uint32_t *ret_dtype, uint32_t *ret_ndim,
                           uint64_t ret_shape[MOK_MAX_DIMS]);
/* As mok_job_slot_shape_op, for a job with these flags: a forward with
 * MOK_JOB_QUANTIZE_WEIGHTS on an fp8 layer reads the bf16 masters in the
 * weight slots and writes PACKED_WEIGHT, every weight's packed form
 * (mok_packed_weights_bytes). */
void mok_job_slot_shape_job(const mok_layer_config *layer, uint32_t op, uint32_t flags,
                            uint32_t source, uint32_t tokens, uint32_t slot, uint32_t *ret_dtype,
                            uint32_t *ret_ndim, uint64_t ret_shape[MOK_MAX_DIMS]);
/* A weight slot's matrices [E, N, K] (w_gate: [E_loc, I, H], ..., the
 * shared expert's with E = 1); 0 for any other slot. */
int mok_slot_weight_dims(const mok_layer_config *layer, uint32_t slot, uint64_t dims[3]);
/* The bytes of a weight slot's packed form on an fp8 layer (mok_fp8_weight_bytes);
 * 0 for any other layer or slot. */
uint64_t mok_slot_packed_bytes(const mok_layer_config *layer, uint32_t slot);
/* The packed_weight tensor of a quantising forward (MOK_JOB_QUANTIZE_WEIGHTS)
 * on an fp8 layer: the packed form of each weight the layer has, in the
 * order w_gate, w_up, w_down, s_gate, s_up, s_down, each from a 256-byte
 * boundary of the tensor. Its bytes (0 for another layer), and where
 * weight slot's form starts (UINT64_MAX: the layer has no such weight). */
uint64_t mok_packed_weights_bytes(const mok_layer_config *layer);
uint64_t mok_packed_weights_offset(const mok_layer_config *layer, uint32_t weight_slot);
/* quantize_weight's source among the slots present (a mask, 1 << slot): the
 * one weight slot, or MOK_SLOT_COUNT_ when there is none or more than one. */
uint32_t mok_quantize_source(uint64_t present);
/* A quantize_weight job on this layer: an fp8 layer, exactly one source.
 * MOK_OK with *ret_source, or MOK_EINVAL with the reason in err. */
int mok_quantize_check(const mok_layer_config *layer, uint64_t present, uint32_t *ret_source,
                       char *err, size_t errlen);
/* Is this slot written by the op? */
int mok_job_slot_is_output(uint32_t op, uint32_t flags, uint32_t slot);

/* Slots that exist only with a shared expert. */
int mok_slot_is_shared(uint32_t slot);

const char *mok_op_name(uint32_t op);
const char *mok_slot_name(uint32_t slot);
/* "float32", "bfloat16", "fp8", ... (the names the Python binding takes) */
const char *mok_dtype_name(uint32_t dtype);

#endif
