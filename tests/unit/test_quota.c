/* SPDX-License-Identifier: Apache-2.0 */
/* The client limits' bookkeeping (daemon/quota.c): reservations, refusals
 * that name their setting, groups that linger after their session and go
 * when left, and users forgotten once they hold nothing. */
#include "harness/check.h"
#include "mok_status.h"
#include "quota.h"

static mok_quota quota_with(mok_quota_limits lim) {
  mok_quota q;
  memset(&q, 0, sizeof q);
  q.lim = lim;
  return q;
}

static void expect_limit(const mok_quota *q, const mok_uid_usage *u, uint32_t regions,
                         uint64_t bytes, uint32_t layers, const char *needle) {
  char msg[320] = "";
  CHECK_EQ_INT(mok_quota_check(q, u, regions, bytes, layers, msg, sizeof msg), MOK_ELIMIT);
  CHECK_STR_CONTAINS(msg, needle);
}

static void test_regions_bytes_and_layers(void) {
  mok_quota q = quota_with((mok_quota_limits){.max_regions_total = 5, .max_regions_per_uid = 3,
                                              .max_region_bytes_per_uid = 1000,
                                              .max_layers_per_uid = 2});
  mok_uid_usage *a = mok_quota_user(&q, 1000, true), *b = mok_quota_user(&q, 1001, true);
  CHECK(a && b && a != b && mok_quota_user(&q, 1000, false) == a);
  char msg[320];
  for (int i = 0; i < 3; i++) {
    CHECK_EQ_INT(mok_quota_check(&q, a, 1, 100, 0, msg, sizeof msg), MOK_OK);
    mok_quota_region(&q, a, +1, 100);
  }
  expect_limit(&q, a, 1, 100, 0, "uid 1000 already has 3 regions across its sessions (max-regions-per-uid 3)");
  CHECK_EQ_INT(mok_quota_check(&q, b, 1, 900, 0, msg, sizeof msg), MOK_OK);
  mok_quota_region(&q, b, +1, 900);
  expect_limit(&q, b, 1, 101, 0, "max-region-bytes-per-uid 1000"); /* 900 + 101 */
  CHECK_EQ_INT(mok_quota_check(&q, b, 1, 100, 0, msg, sizeof msg), MOK_OK); /* exactly full */
  mok_quota_region(&q, b, +1, 100);
  /* five regions in all: the daemon's cap, whoever asks */
  mok_uid_usage *c = mok_quota_user(&q, 1002, true);
  expect_limit(&q, c, 1, 1, 0, "mokd holds 5 regions across all sessions (max-regions-total 5)");
  mok_quota_region(&q, a, -1, 100); /* given back */
  CHECK_EQ_INT(mok_quota_check(&q, c, 1, 1, 0, msg, sizeof msg), MOK_OK);
  CHECK_EQ_INT(q.regions_total, 4);
  /* bytes overflow-safe: a huge request never wraps below the limit */
  expect_limit(&q, c, 1, UINT64_MAX, 0, "max-region-bytes-per-uid");
  /* layers */
  mok_quota_layer(a, +1);
  mok_quota_layer(a, +1);
  expect_limit(&q, a, 0, 0, 1, "max-layers-per-uid 2");
  CHECK_EQ_INT(mok_quota_check(&q, b, 0, 0, 1, msg, sizeof msg), MOK_OK);
  /* 0: no limit */
  mok_quota none = quota_with((mok_quota_limits){0});
  mok_uid_usage *z = mok_quota_user(&none, 7, true);
  for (int i = 0; i < 100000; i++) mok_quota_region(&none, z, +1, 1ull << 40);
  CHECK_EQ_INT(mok_quota_check(&none, z, 1, 1ull << 40, 1, msg, sizeof msg), MOK_OK);
  mok_quota_free(&none);
  mok_quota_free(&q);
}

static void test_users_are_forgotten_when_they_hold_nothing(void) {
  mok_quota q = quota_with((mok_quota_limits){.group_linger_ms = 100});
  mok_uid_usage *a = mok_quota_user(&q, 5, true);
  a->sessions = 1;
  mok_quota_prune(&q, 0);
  CHECK(mok_quota_user(&q, 5, false) == a); /* a session: kept */
  a->sessions = 0;
  mok_quota_group *g;
  char msg[320];
  CHECK_EQ_INT(mok_quota_group_reserve(&q, a, "k", 10, 0, &g, msg, sizeof msg), MOK_OK);
  mok_quota_group_settle(g, true);
  mok_quota_group_drop(&q, g, false, 1000); /* its session ended: lingers */
  mok_quota_prune(&q, 1000);
  CHECK(mok_quota_user(&q, 5, false) == a); /* a lingering group: kept */
  mok_quota_prune(&q, 1000 + 100 + 2000);   /* linger (and margin) over */
  CHECK(mok_quota_user(&q, 5, false) == NULL);
  mok_quota_free(&q);
}

static void test_groups_count_while_held_joining_or_lingering(void) {
  mok_quota q = quota_with((mok_quota_limits){.max_groups_per_uid = 2,
                                              .max_group_bytes_per_uid = 1000,
                                              .group_linger_ms = 500});
  mok_uid_usage *u = mok_quota_user(&q, 42, true);
  char msg[320];
  mok_quota_group *g1, *g2, *g3, *again;
  uint64_t t = 10000;
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "one", 400, t, &g1, msg, sizeof msg), MOK_OK);
  /* a second join of a key in flight is the same group: no second count */
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "one", 400, t, &again, msg, sizeof msg), MOK_OK);
  CHECK(again == g1 && g1->pending == 2);
  uint64_t bytes;
  CHECK_EQ_INT(mok_quota_groups(u, t, &bytes), 1);
  CHECK_EQ_INT(bytes, 400);
  mok_quota_group_settle(g1, false); /* one refused */
  mok_quota_group_settle(g1, true);  /* one joined */
  CHECK(g1->holders == 1 && g1->pending == 0);
  /* bytes: 400 + 700 > 1000 */
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "big", 700, t, &g2, msg, sizeof msg), MOK_ELIMIT);
  CHECK_STR_CONTAINS(msg, "group 'big' needs 700 bytes");
  CHECK_STR_CONTAINS(msg, "max-group-bytes-per-uid 1000");
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "two", 600, t, &g2, msg, sizeof msg), MOK_OK);
  mok_quota_group_settle(g2, true);
  /* count: two held */
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 0, t, &g3, msg, sizeof msg), MOK_ELIMIT);
  CHECK_STR_CONTAINS(msg, "uid 42 already holds 2 expert-parallel groups");
  CHECK_STR_CONTAINS(msg, "max-groups-per-uid 2");
  /* "one"'s session ends without leaving: it lingers, and counts */
  mok_quota_group_drop(&q, g1, false, t);
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 0, t + 400, &g3, msg, sizeof msg),
               MOK_ELIMIT);
  CHECK_STR_CONTAINS(msg, "kept for a re-join");
  /* a re-join of the lingering group costs nothing and holds it again */
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "one", 400, t + 400, &again, msg, sizeof msg), MOK_OK);
  CHECK(again == g1);
  mok_quota_group_settle(g1, true);
  CHECK(g1->linger_until_ms == 0);
  mok_quota_group_drop(&q, g1, false, t + 400);
  /* once the engine has released it (linger, and a margin), it counts no more */
  CHECK_EQ_INT(mok_quota_groups(u, t + 400 + 500 + 1000 - 1, NULL), 2);
  CHECK_EQ_INT(mok_quota_groups(u, t + 400 + 500 + 1000, NULL), 1);
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 0, t + 2000, &g3, msg, sizeof msg), MOK_OK);
  mok_quota_group_settle(g3, true);
  /* left on purpose (LeaveGroup): gone at once */
  mok_quota_group_drop(&q, g2, true, t + 2000);
  CHECK_EQ_INT(mok_quota_groups(u, t + 2000, &bytes), 1);
  CHECK_EQ_INT(bytes, 0);
  /* a held group's second holder leaving keeps it */
  mok_quota_group *h;
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 0, t + 2000, &h, msg, sizeof msg), MOK_OK);
  mok_quota_group_settle(h, true);
  mok_quota_group_drop(&q, h, true, t + 2000);
  CHECK_EQ_INT(mok_quota_groups(u, t + 2000, NULL), 1);
  /* a re-join with a larger sizing counts the extra bytes */
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 1001, t + 2000, &h, msg, sizeof msg),
               MOK_ELIMIT);
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "three", 900, t + 2000, &h, msg, sizeof msg), MOK_OK);
  CHECK_EQ_INT(h->bytes, 900);
  mok_quota_free(&q);
}

static const check_case cases[] = {
    CHECK_CASE(test_regions_bytes_and_layers),
    CHECK_CASE(test_users_are_forgotten_when_they_hold_nothing),
    CHECK_CASE(test_groups_count_while_held_joining_or_lingering),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
