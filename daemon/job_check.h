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

/* The checks an engine repeats on jobs it is handed directly (mok_engine_run),
 * one definition each; MOK_OK or a status with the reason in err. */

/* Each known flag on the op it applies to (MOK_EINVAL otherwise):
 * MOK_JOB_RECOMPUTE on backward, MOK_JOB_QUANTIZE_WEIGHTS on a forward of an
 * fp8 layer (layer NULL: not checked). Unknown flags are the caller's check. */
int mok_job_check_flags_op(const mok_layer_config *layer, uint32_t op, uint32_t flags,
                           char *err, size_t errlen);

/* tokens in 1..layer->max_tokens, else refusal: the daemon's check returns
 * MOK_EINVAL, the cuda engine's MOK_ELIMIT (the status it has always given). */
int mok_job_check_tokens(const mok_layer_config *layer, uint32_t tokens, int refusal, char *err,
                         size_t errlen);
/* The same for a job of op: quantize_weight takes tokens = 0 (else MOK_EINVAL). */
int mok_job_check_tokens_op(const mok_layer_config *layer, uint32_t op, uint32_t tokens,
                            int refusal, char *err, size_t errlen);

#endif
