/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer: schedules a client hands back (daemon/schedule.c).
 *
 * Mode 0: arbitrary schedule ints through mok_schedule_validate; an
 * accepted one must satisfy, by an independent check, everything the
 * engines index with (offsets, row_slot and slot_row in range and
 * mutually consistent). Mode 1: routing ids through mok_schedule_build;
 * what build writes must validate (build and validate agree).
 * Input: byte 0 mode, bytes 1-6 shape (T, K, E_loc, row_align, E extra,
 * first expert), then int32 data.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "schedule.h"

static void check_view(const mok_sched_shape *s, const int32_t *sched) {
  mok_sched_view v = mok_schedule_view(s, sched);
  int64_t cap = (int64_t)mok_rows_capacity(&s->dims), n_slots = (int64_t)v.tokens * v.topk;
  if (v.rows_used > cap || v.offsets[0] != 0 || v.offsets[v.local_experts] != (int32_t)v.rows_used)
    abort();
  for (uint32_t e = 0; e < v.local_experts; e++)
    if (v.counts[e] < 0 || v.offsets[e + 1] < v.offsets[e] ||
        v.offsets[e] + v.counts[e] > v.offsets[e + 1] || v.offsets[e + 1] > cap)
      abort();
  for (int64_t r = 0; r < cap; r++) {
    int32_t slot = v.row_slot[r];
    if (slot == -1) continue;
    if (slot < 0 || slot >= n_slots || r >= v.rows_used || v.slot_row[slot] != r) abort();
  }
  for (int64_t i = 0; i < n_slots; i++) {
    int32_t r = v.slot_row[i];
    if (r == -1) continue;
    if (r < 0 || r >= (int64_t)v.rows_used || v.row_slot[r] != i) abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 7) return 0;
  mok_sched_shape s;
  memset(&s, 0, sizeof s);
  s.dims.tokens = data[1] % 64;
  s.dims.topk = 1 + data[2] % 8;
  s.dims.local_experts = 1 + data[3] % 16;
  s.dims.row_align = 1 + data[4] % 16;
  s.first_expert = data[6] % 4;
  s.experts = (uint32_t)(s.first_expert + s.dims.local_experts + data[5] % 4);
  const size_t n_in = (size - 7) / 4;
  int32_t *in = malloc((n_in ? n_in : 1) * sizeof *in);
  if (!in) return 0;
  memcpy(in, data + 7, n_in * 4);
  char msg[256];
  if ((data[0] & 1) == 0) {
    if (mok_schedule_validate(&s, in, n_in, msg, sizeof msg) == MOK_OK) check_view(&s, in);
  } else {
    size_t n_ids = (size_t)(s.dims.tokens * s.dims.topk);
    int32_t *ids = calloc(n_ids ? n_ids : 1, sizeof *ids);
    size_t n_sched = (size_t)mok_schedule_ints(&s.dims);
    int32_t *sched = malloc(n_sched * sizeof *sched);
    if (ids && sched) {
      /* ids mostly in range, so builds succeed often */
      for (size_t i = 0; i < n_ids; i++)
        ids[i] = i < n_in ? (in[i] % (int32_t)(s.experts + 2)) - 1 : -1;
      if (mok_schedule_build(&s, ids, sched, n_sched, msg, sizeof msg) == MOK_OK) {
        if (mok_schedule_validate(&s, sched, n_sched, msg, sizeof msg) != MOK_OK) abort();
        check_view(&s, sched);
      }
    }
    free(ids);
    free(sched);
  }
  free(in);
  return 0;
}
