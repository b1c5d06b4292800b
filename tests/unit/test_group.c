/* group.c in one process: two "daemons" (two tables) join two ranks of a
 * group; the engine-state hook, the peer record, breaking a group, and the
 * state freed exactly once when the daemon leaves. */
#include <dirent.h>
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
  static bool made;
  if (!made) CHECK(mkdtemp(dir) != NULL);
  made = true;
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

/* A group formed through NCCL has no segment: its members' view is local.
 * The same id re-joins cheaply; a new id (or a broken group) re-forms it:
 * the engine's state goes, the sequence restarts; the two ways of forming
 * a group never mix under one key. */
static void test_nccl_group_rejoin_and_reform(void) {
  set_dir();
  static _Atomic bool no_abort;
  mok_ep_group_table *t = mok_ep_group_table_create(&no_abort);
  CHECK(t);
  char err[200], key[64];
  snprintf(key, sizeof key, "nccl-%d", (int)getpid());
  mok_ep_group_join_args a = args(1, key);
  a.nccl = true;
  memset(a.nccl_id, 0x11, sizeof a.nccl_id);
  mok_ep_group *g, *again;
  bool rejoined = true;
  freed = 0;
  CHECK_EQ_INT(mok_ep_group_join(t, &a, &g, &rejoined, err, sizeof err), MOK_OK);
  CHECK(!rejoined && mok_ep_group_is_nccl(g));
  CHECK(memcmp(mok_ep_group_nccl_id(g), a.nccl_id, MOK_GROUP_NCCL_ID_BYTES) == 0);
  /* no segment was made for it */
  char path[512];
  snprintf(path, sizeof path, "%s", getenv("MOK_GROUP_DIR"));
  DIR *seg_dir = opendir(path);
  CHECK(seg_dir);
  for (struct dirent *e; (e = readdir(seg_dir));) CHECK(strncmp(e->d_name, "mok-ep-", 7) != 0);
  closedir(seg_dir);
  mok_ep_group_set_engine_state(g, &freed, count_free, 1);
  uint64_t gen = mok_ep_group_generation(g);
  /* jobs: the sequence counts here; the posts are compared on the device */
  mok_ep_group_post post = mok_ep_group_post_for(NULL, MOK_OP_FORWARD, 0, 4);
  CHECK_EQ_INT(mok_ep_group_job_start(g, err, sizeof err), MOK_OK);
  CHECK_EQ_INT(mok_ep_group_job_post(g, &post, err, sizeof err), MOK_OK);
  CHECK(mok_ep_group_sequence(g) == 1 && post.seq == 1);
  /* the same id: cheap, nothing changes */
  CHECK_EQ_INT(mok_ep_group_join(t, &a, &again, &rejoined, err, sizeof err), MOK_OK);
  CHECK(again == g && rejoined && freed == 0 && mok_ep_group_sequence(g) == 1);
  mok_ep_group_unref(t, again, false);
  /* joined the other way under the same key: refused */
  mok_ep_group_join_args plain = args(1, key);
  CHECK_EQ_INT(mok_ep_group_join(t, &plain, &again, &rejoined, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "formed through NCCL");
  /* broken: jobs stop until a re-join with a new id */
  mok_ep_group_mark_broken(g, "job 1: a device barrier timed out");
  CHECK_EQ_INT(mok_ep_group_job_start(g, err, sizeof err), MOK_ECLOSED);
  CHECK_STR_CONTAINS(err, "new NCCL id");
  memset(a.nccl_id, 0x22, sizeof a.nccl_id);
  CHECK_EQ_INT(mok_ep_group_join(t, &a, &again, &rejoined, err, sizeof err), MOK_OK);
  CHECK(again == g && !rejoined && freed == 1 && mok_ep_group_engine_state(g) == NULL);
  CHECK(mok_ep_group_generation(g) == gen + 1 && mok_ep_group_sequence(g) == 0);
  CHECK_EQ_INT(mok_ep_group_job_start(g, err, sizeof err), MOK_OK);
  /* a new id on a healthy group re-forms it too */
  mok_ep_group_set_engine_state(g, &freed, count_free, 1);
  memset(a.nccl_id, 0x33, sizeof a.nccl_id);
  CHECK_EQ_INT(mok_ep_group_join(t, &a, &again, &rejoined, err, sizeof err), MOK_OK);
  CHECK(!rejoined && freed == 2);
  mok_ep_group_table_destroy(t);
  CHECK_EQ_INT(freed, 2); /* no state was attached after the last re-form */
}

static const check_case cases[] = {
    CHECK_CASE(test_engine_state_and_peers),
    CHECK_CASE(test_nccl_group_rejoin_and_reform),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
