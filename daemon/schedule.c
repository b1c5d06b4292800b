/* SPDX-License-Identifier: Apache-2.0 */
/* Routing schedules: built from prefix sums (never arrival order) and
 * validated before an engine trusts one it did not write. */
#include "schedule.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#define SCHED_ERR(status, ...)                                                 \
  do {                                                                         \
    if (msg && msglen) snprintf(msg, msglen, __VA_ARGS__);                     \
    return (status);                                                           \
  } while (0)

static inline uint64_t round_up(uint64_t v, uint64_t align) {
  return (v + align - 1) / align * align;
}

mok_status mok_schedule_shape_check(const mok_sched_shape *s, char *msg, size_t msglen) {
  const mok_layout_dims *d = &s->dims;
  if (d->row_align < 1 || d->row_align > INT32_MAX)
    SCHED_ERR(MOK_EINVAL, "schedule row_align %" PRIu64 " must be in [1, 2^31)", d->row_align);
  if (d->topk < 1 || d->local_experts < 1)
    SCHED_ERR(MOK_EINVAL, "schedule topk and local experts must be at least 1");
  if ((uint64_t)s->first_expert + d->local_experts > s->experts)
    SCHED_ERR(MOK_EINVAL, "schedule local experts %" PRIu32 "..%" PRIu64 " exceed E=%" PRIu32,
              s->first_expert, s->first_expert + d->local_experts - 1, s->experts);
  if (s->experts > INT32_MAX || d->tokens > INT32_MAX || d->topk > INT32_MAX ||
      d->local_experts > INT32_MAX / 2 || d->tokens * d->topk > INT32_MAX ||
      mok_rows_capacity(d) > INT32_MAX || mok_schedule_ints(d) > INT32_MAX)
    SCHED_ERR(MOK_EINVAL, "schedule T=%" PRIu64 " K=%" PRIu64 " E_loc=%" PRIu64
              " is too large for an int32 schedule", d->tokens, d->topk, d->local_experts);
  return MOK_OK;
}

mok_sched_view mok_schedule_view(const mok_sched_shape *s, const int32_t *sched) {
  const mok_layout_dims *d = &s->dims;
  mok_sched_view v;
  v.tokens = (uint32_t)d->tokens;
  v.topk = (uint32_t)d->topk;
  v.local_experts = (uint32_t)d->local_experts;
  v.row_align = (uint32_t)d->row_align;
  v.rows_capacity = (uint32_t)mok_rows_capacity(d);
  v.rows_used = (uint32_t)sched[MOK_SCHED_H_ROWS_USED];
  v.first_expert = s->first_expert;
  v.counts = sched + MOK_SCHED_HEADER_INTS;
  v.offsets = v.counts + d->local_experts;
  v.row_slot = v.offsets + d->local_experts + 1;
  v.slot_row = v.row_slot + v.rows_capacity;
  return v;
}

mok_status mok_routing_check(const mok_sched_shape *s, const int32_t *topk_ids, char *msg,
                             size_t msglen) {
  size_t n = (size_t)(s->dims.tokens * s->dims.topk);
  for (size_t i = 0; i < n; i++) {
    int32_t id = topk_ids[i];
    if (id == -1 || (id >= 0 && (uint32_t)id < s->experts)) continue;
    SCHED_ERR(MOK_EROUTE,
              "topk_ids[t=%zu, k=%zu] = %" PRId32 " is outside [0, E=%" PRIu32 ") and not -1",
              i / (size_t)s->dims.topk, i % (size_t)s->dims.topk, id, s->experts);
  }
  return MOK_OK;
}

/* Local expert of a routing id, or -1 (dropped or another rank's expert). */
static inline int64_t local_expert_of(const mok_sched_shape *s, int32_t id) {
  int64_t e = (int64_t)id - s->first_expert;
  return (id >= 0 && e >= 0 && (uint64_t)e < s->dims.local_experts) ? e : -1;
}

mok_status mok_schedule_build(const mok_sched_shape *s, const int32_t *topk_ids, int32_t *sched,
                              size_t sched_ints, char *msg, size_t msglen) {
  mok_status st = mok_schedule_shape_check(s, msg, msglen);
  if (st != MOK_OK) return st;
  const mok_layout_dims *d = &s->dims;
  if (sched_ints < mok_schedule_ints(d))
    SCHED_ERR(MOK_EINVAL, "schedule buffer holds %zu ints, the layout needs %" PRIu64, sched_ints,
              mok_schedule_ints(d));
  st = mok_routing_check(s, topk_ids, msg, msglen);
  if (st != MOK_OK) return st;

  const size_t n_slots = (size_t)(d->tokens * d->topk), n_exp = (size_t)d->local_experts;
  const size_t capacity = (size_t)mok_rows_capacity(d);
  int32_t *counts = sched + MOK_SCHED_HEADER_INTS;
  int32_t *offsets = counts + n_exp;
  int32_t *row_slot = offsets + n_exp + 1;
  int32_t *slot_row = row_slot + capacity;

  memset(counts, 0, n_exp * sizeof *counts);
  for (size_t i = 0; i < n_slots; i++) {
    int64_t e = local_expert_of(s, topk_ids[i]);
    if (e >= 0) counts[e]++;
  }
  offsets[0] = 0;
  uint64_t padded = 0;
  for (size_t e = 0; e < n_exp; e++) padded += round_up((uint64_t)counts[e], d->row_align);
  if (padded > capacity) /* only below the worst case: a group's capacity multiplier */
    SCHED_ERR(MOK_EOVERFLOW,
              "capacity %zu < %" PRIu64 " routed rows: raise the group's capacity", capacity,
              padded);
  for (size_t e = 0; e < n_exp; e++)
    offsets[e + 1] = offsets[e] + (int32_t)round_up((uint64_t)counts[e], d->row_align);

  for (size_t r = 0; r < capacity; r++) row_slot[r] = -1;
  /* Second pass places slots in ascending t*K+k; counts are rebuilt as the
   * fill cursor of each group. */
  memset(counts, 0, n_exp * sizeof *counts);
  for (size_t i = 0; i < n_slots; i++) {
    int64_t e = local_expert_of(s, topk_ids[i]);
    if (e < 0) {
      slot_row[i] = -1;
      continue;
    }
    int32_t r = offsets[e] + counts[e]++;
    row_slot[r] = (int32_t)i;
    slot_row[i] = r;
  }

  sched[MOK_SCHED_H_MAGIC] = (int32_t)MOK_SCHED_MAGIC;
  sched[MOK_SCHED_H_TOKENS] = (int32_t)d->tokens;
  sched[MOK_SCHED_H_TOPK] = (int32_t)d->topk;
  sched[MOK_SCHED_H_LOCAL_EXPERTS] = (int32_t)n_exp;
  sched[MOK_SCHED_H_ROW_ALIGN] = (int32_t)d->row_align;
  sched[MOK_SCHED_H_ROWS_CAPACITY] = (int32_t)capacity;
  sched[MOK_SCHED_H_ROWS_USED] = offsets[n_exp];
  sched[MOK_SCHED_H_FIRST_EXPERT] = (int32_t)s->first_expert;
  return MOK_OK;
}

static mok_status validate_header(const mok_sched_shape *s, const int32_t *h, char *msg,
                                  size_t msglen) {
  const mok_layout_dims *d = &s->dims;
  static const char *const names[MOK_SCHED_HEADER_INTS] = {
      "magic",         "T",         "K",           "local experts",
      "row_align",     "rows_capacity", "rows_used", "first_expert"};
  const int64_t want[MOK_SCHED_HEADER_INTS] = {
      (int32_t)MOK_SCHED_MAGIC, (int64_t)d->tokens, (int64_t)d->topk, (int64_t)d->local_experts,
      (int64_t)d->row_align, (int64_t)mok_rows_capacity(d), -1, s->first_expert};
  for (int i = 0; i < (int)MOK_SCHED_HEADER_INTS; i++) {
    if (i == MOK_SCHED_H_ROWS_USED) continue;
    if (h[i] != want[i])
      SCHED_ERR(MOK_EINVAL, "schedule header %s is %" PRId32 ", the job needs %" PRId64, names[i],
                h[i], want[i]);
  }
  int32_t used = h[MOK_SCHED_H_ROWS_USED];
  if (used < 0 || (int64_t)used > (int64_t)mok_rows_capacity(d))
    SCHED_ERR(MOK_EINVAL, "schedule rows_used %" PRId32 " outside [0, %" PRIu64 "]", used,
              mok_rows_capacity(d));
  return MOK_OK;
}

static mok_status validate_offsets(const mok_sched_shape *s, const int32_t *sched, char *msg,
                                   size_t msglen) {
  const mok_layout_dims *d = &s->dims;
  const size_t n_exp = (size_t)d->local_experts;
  const int64_t capacity = (int64_t)mok_rows_capacity(d);
  const int32_t *counts = sched + MOK_SCHED_HEADER_INTS, *offsets = counts + n_exp;
  if (offsets[0] != 0)
    SCHED_ERR(MOK_EINVAL, "schedule offsets[0] is %" PRId32 ", not 0", offsets[0]);
  for (size_t e = 0; e < n_exp; e++) {
    if (counts[e] < 0 || counts[e] > capacity)
      SCHED_ERR(MOK_EINVAL, "schedule counts[%zu] = %" PRId32 " outside [0, %" PRId64 "]", e,
                counts[e], capacity);
    int64_t next = (int64_t)offsets[e] + (int64_t)round_up((uint64_t)counts[e], d->row_align);
    if (offsets[e + 1] != next || next > capacity)
      SCHED_ERR(MOK_EINVAL, "schedule offsets[%zu] = %" PRId32 ", expected %" PRId64
                " (capacity %" PRId64 ")", e + 1, offsets[e + 1], next, capacity);
  }
  if (offsets[n_exp] != sched[MOK_SCHED_H_ROWS_USED])
    SCHED_ERR(MOK_EINVAL, "schedule rows_used %" PRId32 " is not the end of the last group %"
              PRId32, sched[MOK_SCHED_H_ROWS_USED], offsets[n_exp]);
  return MOK_OK;
}

/* Each used row names a slot that names it back, ascending within a group;
 * every padding row is -1. */
static mok_status validate_rows(const mok_sched_view *v, char *msg, size_t msglen) {
  const int64_t n_slots = (int64_t)v->tokens * v->topk;
  for (uint32_t e = 0; e < v->local_experts; e++) {
    int64_t begin = v->offsets[e], used_end = begin + v->counts[e], end = v->offsets[e + 1];
    int64_t prev = -1;
    for (int64_t r = begin; r < end; r++) {
      int32_t slot = v->row_slot[r];
      if (r >= used_end) {
        if (slot != -1)
          SCHED_ERR(MOK_EINVAL, "schedule padding row %" PRId64 " of expert %" PRIu32
                    " has row_slot %" PRId32 ", not -1", r, e, slot);
        continue;
      }
      if (slot < 0 || slot >= n_slots)
        SCHED_ERR(MOK_EINVAL, "schedule row_slot[%" PRId64 "] = %" PRId32 " outside [0, T*K=%"
                  PRId64 ")", r, slot, n_slots);
      if (slot <= prev)
        SCHED_ERR(MOK_EINVAL, "schedule rows of expert %" PRIu32 " are not in ascending slot order"
                  " at row %" PRId64, e, r);
      if (v->slot_row[slot] != r)
        SCHED_ERR(MOK_EINVAL, "schedule row_slot[%" PRId64 "] = %" PRId32 " but slot_row[%"
                  PRId32 "] = %" PRId32, r, slot, slot, v->slot_row[slot]);
      prev = slot;
    }
  }
  for (int64_t r = v->rows_used; r < v->rows_capacity; r++)
    if (v->row_slot[r] != -1)
      SCHED_ERR(MOK_EINVAL, "schedule row %" PRId64 " beyond rows_used has row_slot %" PRId32
                ", not -1", r, v->row_slot[r]);
  return MOK_OK;
}

static mok_status validate_slots(const mok_sched_view *v, char *msg, size_t msglen) {
  const int64_t n_slots = (int64_t)v->tokens * v->topk;
  for (int64_t i = 0; i < n_slots; i++) {
    int32_t r = v->slot_row[i];
    if (r == -1) continue;
    if (r < 0 || (uint32_t)r >= v->rows_used)
      SCHED_ERR(MOK_EINVAL, "schedule slot_row[%" PRId64 "] = %" PRId32 " outside [0, rows_used=%"
                PRIu32 ") and not -1", i, r, v->rows_used);
    if (v->row_slot[r] != i)
      SCHED_ERR(MOK_EINVAL, "schedule slot_row[%" PRId64 "] = %" PRId32 " but row_slot[%" PRId32
                "] = %" PRId32, i, r, r, v->row_slot[r]);
  }
  return MOK_OK;
}

mok_status mok_schedule_validate(const mok_sched_shape *s, const int32_t *sched, size_t sched_ints,
                                 char *msg, size_t msglen) {
  mok_status st = mok_schedule_shape_check(s, msg, msglen);
  if (st != MOK_OK) return st;
  if (!sched) SCHED_ERR(MOK_EINVAL, "schedule is missing");
  if (sched_ints < mok_schedule_ints(&s->dims))
    SCHED_ERR(MOK_EINVAL, "schedule has %zu ints, the layout needs %" PRIu64, sched_ints,
              mok_schedule_ints(&s->dims));
  st = validate_header(s, sched, msg, msglen);
  if (st == MOK_OK) st = validate_offsets(s, sched, msg, msglen);
  if (st != MOK_OK) return st;
  mok_sched_view v = mok_schedule_view(s, sched);
  st = validate_rows(&v, msg, msglen);
  if (st == MOK_OK) st = validate_slots(&v, msg, msglen);
  return st;
}
