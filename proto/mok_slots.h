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
/* Is this slot written by the op? */
int mok_job_slot_is_output(uint32_t op, uint32_t flags, uint32_t slot);

/* Slots that exist only with a shared expert. */
int mok_slot_is_shared(uint32_t slot);

const char *mok_op_name(uint32_t op);
const char *mok_slot_name(uint32_t slot);

#endif
