/* SPDX-License-Identifier: Apache-2.0 */
/* Schedules: build follows docs/math.md (prefix sums, ascending t*K+k per
 * expert, alignment padding), validate accepts what build writes and rejects
 * every kind of corruption without reading out of bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness/check.h"
#include "schedule.h"

static mok_sched_shape make_shape(uint64_t T, uint64_t K, uint64_t E, uint64_t E_loc,
                                  uint64_t first, uint64_t align) {
  mok_sched_shape s;
  memset(&s, 0, sizeof s);
  s.dims.tokens = T;
  s.dims.topk = K;
  s.dims.local_experts = E_loc;
  s.dims.row_align = align;
  s.dims.intermediate = 1;
  s.dims.elem_size = 4;
  s.experts = (uint32_t)E;
  s.first_expert = (uint32_t)first;
  return s;
}

static int32_t *build_ok(const mok_sched_shape *s, const int32_t *ids, size_t *ret_n) {
  size_t n = (size_t)mok_schedule_ints(&s->dims);
  int32_t *sched = malloc(n * sizeof *sched);
  CHECK(sched);
  char msg[128];
  mok_status st = mok_schedule_build(s, ids, sched, n, msg, sizeof msg);
  CHECK_MSG(st == MOK_OK, "build: %s", msg);
  st = mok_schedule_validate(s, sched, n, msg, sizeof msg);
  CHECK_MSG(st == MOK_OK, "validate of a built schedule: %s", msg);
  *ret_n = n;
  return sched;
}

/* T=4, K=2, E=4, local experts 1..3 (E_loc=3), row_align 2. */
static void test_build_layout(void) {
  const int32_t ids[8] = {1, 3, /* t0 */ 0, 1, /* t1: expert 0 not local */
                          -1, 3, /* t2 */ 1, 1 /* t3: same expert twice */};
  mok_sched_shape s = make_shape(4, 2, 4, 3, 1, 2);
  size_t n;
  int32_t *sc = build_ok(&s, ids, &n);
  mok_sched_view v = mok_schedule_view(&s, sc);
  CHECK_EQ_INT(sc[0], (int32_t)MOK_SCHED_MAGIC);
  CHECK_EQ_INT(v.rows_capacity, 8 + 3);
  /* expert 1 (local 0): slots 0, 3, 6, 7; local 1 (id 2): none; local 2 (id 3): 1, 5 */
  CHECK_EQ_INT(v.counts[0], 4);
  CHECK_EQ_INT(v.counts[1], 0);
  CHECK_EQ_INT(v.counts[2], 2);
  CHECK_EQ_INT(v.offsets[0], 0);
  CHECK_EQ_INT(v.offsets[1], 4);
  CHECK_EQ_INT(v.offsets[2], 4);
  CHECK_EQ_INT(v.offsets[3], 6);
  CHECK_EQ_INT(v.rows_used, 6);
  const int32_t want_rows[11] = {0, 3, 6, 7, 1, 5, -1, -1, -1, -1, -1};
  for (int r = 0; r < 11; r++) CHECK_EQ_INT(v.row_slot[r], want_rows[r]);
  const int32_t want_slots[8] = {0, 4, -1, 1, -1, 5, 2, 3};
  for (int i = 0; i < 8; i++) CHECK_EQ_INT(v.slot_row[i], want_slots[i]);
  free(sc);
}

static void test_build_padding(void) {
  /* row_align 4: groups start at multiples of 4, padding rows are -1 */
  const int32_t ids[6] = {0, 1, 0, 2, 1, 0};
  mok_sched_shape s = make_shape(3, 2, 3, 3, 0, 4);
  size_t n;
  int32_t *sc = build_ok(&s, ids, &n);
  mok_sched_view v = mok_schedule_view(&s, sc);
  CHECK_EQ_INT(v.offsets[1], 4);
  CHECK_EQ_INT(v.offsets[2], 8);
  CHECK_EQ_INT(v.offsets[3], 12);
  CHECK_EQ_INT(v.row_slot[3], -1);
  CHECK_EQ_INT(v.row_slot[4], 1);
  CHECK_EQ_INT(v.row_slot[5], 4);
  CHECK_EQ_INT(v.row_slot[6], -1);
  free(sc);
}

static void test_route_errors(void) {
  mok_sched_shape s = make_shape(3, 2, 4, 4, 0, 1);
  size_t n = (size_t)mok_schedule_ints(&s.dims);
  int32_t *sc = malloc(n * sizeof *sc);
  CHECK(sc);
  char msg[128];
  int32_t ids[6] = {0, 1, 2, 3, 4, 0};
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sc, n, msg, sizeof msg), MOK_EROUTE);
  CHECK_STR_CONTAINS(msg, "t=2, k=0");
  CHECK_STR_CONTAINS(msg, "= 4");
  ids[4] = -2;
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sc, n, msg, sizeof msg), MOK_EROUTE);
  CHECK_STR_CONTAINS(msg, "-2");
  ids[4] = INT32_MIN;
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sc, n, msg, sizeof msg), MOK_EROUTE);
  ids[4] = -1;
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sc, n, msg, sizeof msg), MOK_OK);
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sc, n - 1, msg, sizeof msg), MOK_EINVAL);
  free(sc);
}

typedef void (*corrupt_fn)(int32_t *sc, const mok_sched_view *v);

static void expect_rejected(const mok_sched_shape *s, const int32_t *good, size_t n, corrupt_fn fn,
                            const char *what) {
  int32_t *bad = malloc(n * sizeof *bad);
  CHECK(bad);
  memcpy(bad, good, n * sizeof *bad);
  mok_sched_view v = mok_schedule_view(s, bad);
  fn(bad, &v);
  char msg[128] = "";
  mok_status st = mok_schedule_validate(s, bad, n, msg, sizeof msg);
  CHECK_MSG(st == MOK_EINVAL, "corruption '%s' was accepted", what);
  CHECK_STR_CONTAINS(msg, "schedule");
  free(bad);
}

#define MUT(name, body)                                                        \
  static void name(int32_t *sc, const mok_sched_view *v) {                     \
    (void)sc;                                                                  \
    (void)v;                                                                   \
    body;                                                                      \
  }
MUT(c_magic, sc[0] ^= 1)
MUT(c_tokens, sc[1] += 1)
MUT(c_topk, sc[2] -= 1)
MUT(c_experts, sc[3] += 1)
MUT(c_align, sc[4] += 1)
MUT(c_capacity, sc[5] -= 1)
MUT(c_used_plus, sc[6] += 1)
MUT(c_used_neg, sc[6] = -7)
MUT(c_used_huge, sc[6] = INT32_MAX)
MUT(c_first, sc[7] += 1)
MUT(c_count_neg, ((int32_t *)v->counts)[0] = -1)
MUT(c_count_huge, ((int32_t *)v->counts)[1] = INT32_MAX)
MUT(c_count_plus, ((int32_t *)v->counts)[0] += 1)
MUT(c_offset0, ((int32_t *)v->offsets)[0] = 1)
MUT(c_offset_mid, ((int32_t *)v->offsets)[1] += 1)
MUT(c_offset_back, ((int32_t *)v->offsets)[2] = -3)
MUT(c_offset_end, ((int32_t *)v->offsets)[v->local_experts] = (int32_t)v->rows_capacity + 1)
MUT(c_rowslot_big, ((int32_t *)v->row_slot)[0] = (int32_t)(v->tokens * v->topk))
MUT(c_rowslot_neg, ((int32_t *)v->row_slot)[1] = -2)
MUT(c_rowslot_pad, ((int32_t *)v->row_slot)[0] = -1)
MUT(c_rowslot_order,
    {
      int32_t *rs = (int32_t *)v->row_slot;
      int32_t t = rs[0];
      rs[0] = rs[1];
      rs[1] = t;
      ((int32_t *)v->slot_row)[rs[0]] = 0;
      ((int32_t *)v->slot_row)[rs[1]] = 1;
    })
MUT(c_rowslot_tail, ((int32_t *)v->row_slot)[v->rows_capacity - 1] = 0)
MUT(c_slotrow_big, ((int32_t *)v->slot_row)[0] = (int32_t)v->rows_capacity)
MUT(c_slotrow_neg, ((int32_t *)v->slot_row)[0] = -2)
MUT(c_slotrow_drop, ((int32_t *)v->slot_row)[0] = -1)
MUT(c_slotrow_other, ((int32_t *)v->slot_row)[0] = ((int32_t *)v->slot_row)[1])
MUT(c_slotrow_min, ((int32_t *)v->slot_row)[2] = INT32_MIN)

static void test_validate_rejects(void) {
  /* 5 tokens, K=2, 3 local experts of 3; slot 0 -> expert 0 so row 0 is slot 0;
   * token 4 fully dropped so rows_used < capacity. */
  const int32_t ids[10] = {0, 1, 0, 2, 1, 0, 2, 1, -1, -1};
  mok_sched_shape s = make_shape(5, 2, 3, 3, 0, 1);
  size_t n;
  int32_t *good = build_ok(&s, ids, &n);
  static const struct {
    corrupt_fn fn;
    const char *what;
  } cases[] = {
      {c_magic, "magic"}, {c_tokens, "T"}, {c_topk, "K"}, {c_experts, "E_loc"},
      {c_align, "row_align"}, {c_capacity, "capacity"}, {c_used_plus, "rows_used+1"},
      {c_used_neg, "rows_used<0"}, {c_used_huge, "rows_used huge"}, {c_first, "first_expert"},
      {c_count_neg, "count<0"}, {c_count_huge, "count huge"}, {c_count_plus, "count+1"},
      {c_offset0, "offsets[0]"}, {c_offset_mid, "offsets[1]"}, {c_offset_back, "offsets<0"},
      {c_offset_end, "offsets end"}, {c_rowslot_big, "row_slot >= T*K"},
      {c_rowslot_neg, "row_slot -2"}, {c_rowslot_pad, "used row marked -1"},
      {c_rowslot_order, "rows out of order"}, {c_rowslot_tail, "row beyond rows_used"},
      {c_slotrow_big, "slot_row >= capacity"}, {c_slotrow_neg, "slot_row -2"},
      {c_slotrow_drop, "slot_row -1 for a used row"}, {c_slotrow_other, "slot_row duplicate"},
      {c_slotrow_min, "slot_row INT32_MIN"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    expect_rejected(&s, good, n, cases[i].fn, cases[i].what);
  /* too short a buffer */
  char msg[128];
  CHECK_EQ_INT(mok_schedule_validate(&s, good, n - 1, msg, sizeof msg), MOK_EINVAL);
  /* a schedule of another T */
  mok_sched_shape other = make_shape(4, 2, 3, 3, 0, 1);
  CHECK_EQ_INT(mok_schedule_validate(&other, good, n, msg, sizeof msg), MOK_EINVAL);
  free(good);
}

/* Random corruption of random entries never crashes (run under ASan). */
static void test_validate_random_garbage(void) {
  const int32_t ids[12] = {0, 1, 2, 3, 3, 3, -1, 0, 1, 1, 2, -1};
  mok_sched_shape s = make_shape(4, 3, 4, 4, 0, 1);
  size_t n;
  int32_t *good = build_ok(&s, ids, &n);
  int32_t *bad = malloc(n * sizeof *bad);
  CHECK(bad);
  uint32_t rng = 12345;
  char msg[128];
  int rejected = 0;
  for (int iter = 0; iter < 20000; iter++) {
    memcpy(bad, good, n * sizeof *bad);
    for (int m = 0; m < 1 + iter % 3; m++) {
      rng = rng * 1664525u + 1013904223u;
      size_t at = (rng >> 8) % n;
      rng = rng * 1664525u + 1013904223u;
      int32_t val = (int32_t)(rng >> 16) % 40 - 20;
      if (iter % 7 == 0) val = (int32_t)rng;
      bad[at] = val;
    }
    mok_status st = mok_schedule_validate(&s, bad, n, msg, sizeof msg);
    if (st != MOK_OK) {
      rejected++;
      continue;
    }
    /* accepted: it must be a consistent schedule (rebuild from it and compare) */
    mok_sched_view v = mok_schedule_view(&s, bad);
    for (uint32_t i = 0; i < v.tokens * v.topk; i++)
      if (v.slot_row[i] >= 0) CHECK(v.row_slot[v.slot_row[i]] == (int32_t)i);
  }
  CHECK(rejected > 10000);
  free(bad);
  free(good);
}

static void test_shape_limits(void) {
  char msg[128];
  mok_sched_shape s = make_shape(1u << 30, 4, 8, 8, 0, 1);
  CHECK_EQ_INT(mok_schedule_shape_check(&s, msg, sizeof msg), MOK_EINVAL);
  s = make_shape(8, 2, 4, 4, 1, 1); /* local experts beyond E */
  CHECK_EQ_INT(mok_schedule_shape_check(&s, msg, sizeof msg), MOK_EINVAL);
  s = make_shape(8, 2, 4, 4, 0, 0);
  CHECK_EQ_INT(mok_schedule_shape_check(&s, msg, sizeof msg), MOK_EINVAL);
}

static void test_empty(void) {
  mok_sched_shape s = make_shape(0, 2, 4, 4, 0, 1);
  size_t n;
  int32_t *sc = build_ok(&s, NULL, &n);
  CHECK_EQ_INT(sc[MOK_SCHED_H_ROWS_USED], 0);
  free(sc);
}

/* A capacity below the worst case (a group's capacity multiplier): a
 * schedule that fits is the same as without the limit, only shorter; one
 * row more fails with EOVERFLOW, saying by how much. */
static void test_capacity_limit(void) {
  const int32_t ids[8] = {1, 3, 0, 1, -1, 3, 1, 1}; /* 6 local rows; padded (align 2): 6 */
  mok_sched_shape s = make_shape(4, 2, 4, 3, 1, 2);
  size_t n_full;
  int32_t *full = build_ok(&s, ids, &n_full);
  s.dims.rows_limit = 6;
  CHECK_EQ_INT(mok_rows_capacity(&s.dims), 6);
  size_t n;
  int32_t *lim = build_ok(&s, ids, &n);
  CHECK(n == n_full - 5); /* row_slot holds 6 rows instead of 11 */
  mok_sched_view a = mok_schedule_view(&s, lim);
  CHECK_EQ_INT(a.rows_capacity, 6);
  CHECK_EQ_INT(a.rows_used, 6);
  CHECK(memcmp(lim + MOK_SCHED_HEADER_INTS, full + MOK_SCHED_HEADER_INTS, (3 + 4) * 4) == 0);
  s.dims.rows_limit = 5;
  int32_t *sched = malloc(n * sizeof *sched);
  CHECK(sched);
  char msg[128];
  CHECK_EQ_INT(mok_schedule_build(&s, ids, sched, n, msg, sizeof msg), MOK_EOVERFLOW);
  CHECK_STR_CONTAINS(msg, "capacity 5 < 6 routed rows");
  /* a limit at or above the worst case is no limit */
  s.dims.rows_limit = 1000;
  CHECK_EQ_INT(mok_rows_capacity(&s.dims), 11);
  free(sched);
  free(lim);
  free(full);
}

static const check_case cases[] = {
    CHECK_CASE(test_build_layout),
    CHECK_CASE(test_build_padding),
    CHECK_CASE(test_route_errors),
    CHECK_CASE(test_validate_rejects),
    CHECK_CASE(test_validate_random_garbage),
    CHECK_CASE(test_shape_limits),
    CHECK_CASE(test_empty),
    CHECK_CASE(test_capacity_limit),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
