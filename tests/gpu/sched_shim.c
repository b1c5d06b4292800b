/* SPDX-License-Identifier: Apache-2.0 */
/* C11 side of the GPU kernel tests: proto/mok_wire.h and daemon/schedule.c
 * are C11-only (atomics), so the C++ test reaches them through these. */
#include <stdint.h>
#include <string.h>

#include "mok_wire.h"
#include "schedule.h"

static mok_sched_shape shim_shape(int T, int K, int E, int E_loc, int first, int row_align) {
  mok_sched_shape s;
  memset(&s, 0, sizeof s); /* rows_limit 0: the worst-case capacity */
  s.dims.tokens = (uint64_t)T;
  s.dims.topk = (uint64_t)K;
  s.dims.local_experts = (uint64_t)E_loc;
  s.dims.row_align = (uint64_t)row_align;
  s.dims.intermediate = 0;
  s.dims.shared_intermediate = 0;
  s.dims.elem_size = 2;
  s.experts = (uint32_t)E;
  s.first_expert = (uint32_t)first;
  return s;
}

long long shim_rows_capacity(int T, int K, int E_loc, int row_align) {
  mok_sched_shape s = shim_shape(T, K, E_loc, E_loc, 0, row_align);
  return (long long)mok_rows_capacity(&s.dims);
}

long long shim_schedule_ints(int T, int K, int E_loc, int row_align) {
  mok_sched_shape s = shim_shape(T, K, E_loc, E_loc, 0, row_align);
  return (long long)mok_schedule_ints(&s.dims);
}

unsigned shim_sched_magic(void) { return MOK_SCHED_MAGIC; }

int shim_schedule_build(int T, int K, int E, int E_loc, int first, int row_align,
                        const int32_t *ids, int32_t *sched, size_t ints) {
  mok_sched_shape s = shim_shape(T, K, E, E_loc, first, row_align);
  return (int)mok_schedule_build(&s, ids, sched, ints, 0, 0);
}

/* The same with a routed-row capacity below the worst case (a group's):
 * MOK_EOVERFLOW when the padded rows do not fit. */
int shim_schedule_build_limit(int T, int K, int E, int E_loc, int first, int row_align,
                              int rows_limit, const int32_t *ids, int32_t *sched, size_t ints) {
  mok_sched_shape s = shim_shape(T, K, E, E_loc, first, row_align);
  s.dims.rows_limit = (uint64_t)rows_limit;
  return (int)mok_schedule_build(&s, ids, sched, ints, 0, 0);
}

int shim_schedule_validate(int T, int K, int E, int E_loc, int first, int row_align,
                           const int32_t *sched, size_t ints) {
  mok_sched_shape s = shim_shape(T, K, E, E_loc, first, row_align);
  return (int)mok_schedule_validate(&s, sched, ints, 0, 0);
}
