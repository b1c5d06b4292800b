/* group.c in one process: two "daemons" (two tables) join two ranks of a
 * group; the engine-state hook, the peer record, breaking a group, and the
 * state freed exactly once when the daemon leaves. */
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "group.h"
#include "mok_status.h"

static int freed;
static void count_free(void *p) {
  CHECK(p == &freed);
  freed++;
}

static char dir[] = "/tmp/mok-test-group-XXXXXX";

static void set_dir(void) {
  CHECK(mkdtemp(dir) != NULL);
  setenv("MOK_GROUP_DIR", dir, 1);
}

static mok_ep_group_join_args args(uint32_t rank, const char *key) {
  mok_ep_group_join_args a;
  memset(&a, 0, sizeof a);
  a.uid = getuid();
  snprintf(a.key, sizeof a.key, "%s", key);
  a.rank = rank;
  a.timeout_ms = 300;
  a.sizing = (mok_ep_group_sizing){2, 16, 64, 2, 4, MOK_DTYPE_BF16, 0, 0};
  return a;
}

static void test_engine_state_and_peers(void) {
  set_dir();
  static _Atomic bool no_abort;
  mok_ep_group_table *t0 = mok_ep_group_table_create(&no_abort);
  mok_ep_group_table *t1 = mok_ep_group_table_create(&no_abort);
  CHECK(t0 && t1);
  char err[160], key[64];
  snprintf(key, sizeof key, "state-%d", (int)getpid());
  mok_ep_group *g0, *g1;
  bool rejoined;
  mok_ep_group_join_args a0 = args(0, key), a1 = args(1, key);
  CHECK_EQ_INT(mok_ep_group_join(t0, &a0, &g0, &rejoined, err, sizeof err), MOK_OK);
  CHECK_EQ_INT(mok_ep_group_join(t1, &a1, &g1, &rejoined, err, sizeof err), MOK_OK);
  /* before rank 0 publishes a buffer its record has no serial */
  mok_ep_group_peer p = mok_ep_group_peer_of(g1, 0);
  CHECK(p.joined && p.pid == (int32_t)getpid() && p.dev_serial == 0);
  CHECK(mok_ep_group_engine_state(g0) == NULL);
  mok_ep_group_set_engine_state(g0, &freed, count_free, 0x1234abcdull);
  CHECK(mok_ep_group_engine_state(g0) == &freed);
  p = mok_ep_group_peer_of(g1, 0);
  CHECK(p.dev_serial == 0x1234abcdull);
  p = mok_ep_group_peer_of(g1, 7); /* beyond the world: empty */
  CHECK(!p.joined && p.pid == 0 && p.dev_serial == 0);
  CHECK_EQ_INT((int)mok_ep_group_timeout_ms(g1), 300);
  /* a re-join keeps the state and republishes the serial */
  mok_ep_group *again;
  CHECK_EQ_INT(mok_ep_group_join(t0, &a0, &again, &rejoined, err, sizeof err), MOK_OK);
  CHECK(again == g0 && rejoined && mok_ep_group_engine_state(g0) == &freed);
  mok_ep_group_unref(t0, again, false);
  CHECK(mok_ep_group_peer_of(g1, 0).dev_serial == 0x1234abcdull);
  /* breaking (a device barrier timed out) stops both members' jobs */
  CHECK_EQ_INT(mok_ep_group_job_start(g1, err, sizeof err), MOK_OK);
  mok_ep_group_mark_broken(g0, "job 3: a device barrier timed out");
  CHECK_EQ_INT(mok_ep_group_job_start(g1, err, sizeof err), MOK_ECLOSED);
  CHECK_STR_CONTAINS(err, "a device barrier timed out");
  CHECK_EQ_INT(mok_ep_group_job_start(g0, err, sizeof err), MOK_ECLOSED);
  /* the daemon leaves: its engine state is freed once, before its rank goes */
  CHECK_EQ_INT(freed, 0);
  mok_ep_group_table_destroy(t0);
  CHECK_EQ_INT(freed, 1);
  CHECK(!mok_ep_group_peer_of(g1, 0).joined);
  mok_ep_group_table_destroy(t1);
  CHECK_EQ_INT(freed, 1);
  CHECK_MSG(rmdir(dir) == 0, "the last member out did not remove the segment");
}

static const check_case cases[] = {
    CHECK_CASE(test_engine_state_and_peers),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
