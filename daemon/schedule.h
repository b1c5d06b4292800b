/* SPDX-License-Identifier: Apache-2.0 */
/* Routing schedules (layout in proto/mok_wire.h, rules in docs/math.md).
 *
 * Engine-neutral plain C: the cpu engine uses it for dispatch, the cuda
 * engine for host-side reference and checks, tests for both.
 *
 * A schedule is an int32 array of mok_schedule_ints(dims) entries:
 *   header[8], counts[E_loc], offsets[E_loc+1], row_slot[rows_capacity],
 *   slot_row[T*K].
 */
#ifndef MOK_SCHEDULE_H
#define MOK_SCHEDULE_H

#include <stddef.h>
#include <stdint.h>

#include "mok_wire.h"

/* The header field indices (MOK_SCHED_H_*) are in proto/mok_layout.h. */

/* What a schedule must describe: the job's T and the layer's routing. */
typedef struct mok_sched_shape {
  mok_layout_dims dims;  /* tokens, topk, local_experts, row_align are used */
  uint32_t experts;      /* E, global */
  uint32_t first_expert; /* global id of local expert 0 */
} mok_sched_shape;

/* Pointers into a schedule array (valid once built or validated). */
typedef struct mok_sched_view {
  uint32_t tokens, topk, local_experts, row_align;
  uint32_t rows_capacity, rows_used, first_expert;
  const int32_t *counts;   /* [local_experts] */
  const int32_t *offsets;  /* [local_experts + 1] */
  const int32_t *row_slot; /* [rows_capacity] */
  const int32_t *slot_row; /* [tokens * topk] */
} mok_sched_view;

/* Checks that the shape fits the int32 fields of a schedule. */
mok_status mok_schedule_shape_check(const mok_sched_shape *s, char *msg, size_t msglen);

/* Builds the schedule of topk_ids [T,K] into sched (mok_schedule_ints
 * entries, every entry written). An id outside [0,E) other than -1 fails
 * with MOK_EROUTE naming t, k and the id, and leaves sched unwritten. More
 * padded rows than mok_rows_capacity (a group's capacity below the worst
 * case) fail with MOK_EOVERFLOW. */
mok_status mok_schedule_build(const mok_sched_shape *s, const int32_t *topk_ids, int32_t *sched,
                              size_t sched_ints, char *msg, size_t msglen);

/* Checks a schedule the engine did not write (header against the shape,
 * offsets, row_slot, slot_row) in O(rows) time without reading outside
 * sched[0 .. sched_ints). Returns MOK_OK or MOK_EINVAL with a message. */
mok_status mok_schedule_validate(const mok_sched_shape *s, const int32_t *sched, size_t sched_ints,
                                 char *msg, size_t msglen);

/* Views a built or validated schedule. */
mok_sched_view mok_schedule_view(const mok_sched_shape *s, const int32_t *sched);

/* Validates topk_ids alone (the EROUTE check of build). */
mok_status mok_routing_check(const mok_sched_shape *s, const int32_t *topk_ids, char *msg,
                             size_t msglen);

#endif /* MOK_SCHEDULE_H */
