/* SPDX-License-Identifier: Apache-2.0 */
/* Validating a job descriptor before any engine work.
 *
 * Works on a private copy of the descriptor (never on shared memory, so the
 * client cannot change it after the check). Every tensor reference must name
 * a region of the job's own session, lie inside it (overflow-safe), carry
 * the dtype and shape the layer and op demand, and outputs must not overlap
 * any other tensor. The result is a mok_job_args the engine can run.
 */
#ifndef MOK_JOB_CHECK_H
#define MOK_JOB_CHECK_H

#include <stddef.h>

#include "engine.h"
#include "mok_slots.h"
#include "region.h"

/* Validate desc against the session's regions and layer (layer may be NULL
 * when the descriptor names none; NOP needs none). On success fills ret.
 * Returns a mok_status and a message naming the offending tensor. */
int mok_job_check(const mok_job_desc *desc, mok_region_table *regions,
                  const mok_layer_config *layer, mok_job_args *ret, char *err, size_t errlen);

#endif
