/* SPDX-License-Identifier: Apache-2.0 */
/* daemon/ep/group.c in one process: two "daemons" (two tables) join two ranks of a
 * group; the engine-state hook, the peer record, breaking a group, and the
 * state freed exactly once when the daemon leaves. The segments' directory:
 * only the daemon's uid may write it; segments are made exclusively, and
 * what lies at a segment's path that no live mokd uses is reclaimed. */
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "ep/group.h"
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
  CHECK(rmdir(dir) == 0);
}

/* ---- the segments' directory ---------------------------------------------- */

/* Remove dir and all in it (never following links). */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path) < 0 && errno != ENOENT ? -1 : 0;
}
static void remove_dir(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

static _Atomic bool never;

static void make_tmp_dir(char *buf, size_t len) {
  snprintf(buf, len, "/tmp/mok-test-gdir-XXXXXX");
  CHECK(mkdtemp(buf) != NULL);
}

static void expect_dir_refused(const char *d, bool create, const char *needle) {
  char err[512] = "";
  CHECK_EQ_INT(mok_ep_group_dir_check(d, create, err, sizeof err), MOK_EACCES);
  CHECK_STR_CONTAINS(err, needle);
}

static void test_the_group_dir_must_be_the_daemons_alone(void) {
  char base[64], d[128], err[512] = "";
  make_tmp_dir(base, sizeof base);
  /* missing: made 0700 (its missing parent too), or refused when not asked to */
  snprintf(d, sizeof d, "%s/run/groups", base);
  CHECK(mok_ep_group_dir_check(d, false, err, sizeof err) != MOK_OK);
  CHECK_STR_CONTAINS(err, "create it owned by uid");
  CHECK_MSG(mok_ep_group_dir_check(d, true, err, sizeof err) == MOK_OK, "%s", err);
  struct stat st;
  CHECK(lstat(d, &st) == 0 && S_ISDIR(st.st_mode));
  CHECK_EQ_INT(st.st_mode & 077, 0);
  CHECK_EQ_INT(st.st_uid, geteuid());
  CHECK_MSG(mok_ep_group_dir_check(d, false, err, sizeof err) == MOK_OK, "%s", err);
  /* writable by others or the group: squattable */
  CHECK(chmod(d, 01777) == 0);
  expect_dir_refused(d, true, "writable by everyone (mode 1777)");
  CHECK(chmod(d, 0770) == 0);
  expect_dir_refused(d, true, "writable by its group");
  CHECK(chmod(d, 0700) == 0);
  /* a link to a good directory is still a link */
  char link[160];
  snprintf(link, sizeof link, "%s/link", base);
  CHECK(symlink(d, link) == 0);
  expect_dir_refused(link, true, "is a symbolic link");
  /* a file */
  char file[160];
  snprintf(file, sizeof file, "%s/file", base);
  int fd = open(file, O_CREAT | O_WRONLY, 0600);
  CHECK(fd >= 0);
  close(fd);
  expect_dir_refused(file, true, "is not a directory");
  /* in a parent anyone can write without the sticky bit: replaceable */
  char open_parent[160], in_open[200];
  snprintf(open_parent, sizeof open_parent, "%s/open", base);
  CHECK(mkdir(open_parent, 0700) == 0 && chmod(open_parent, 0777) == 0);
  snprintf(in_open, sizeof in_open, "%s/groups", open_parent);
  expect_dir_refused(in_open, true, "without the sticky bit");
  CHECK(chmod(open_parent, 01777) == 0); /* like /tmp: fine */
  CHECK_MSG(mok_ep_group_dir_check(in_open, true, err, sizeof err) == MOK_OK, "%s", err);
  if (geteuid() == 0) { /* another uid's directory */
    CHECK(chown(d, 4242, 4242) == 0);
    expect_dir_refused(d, true, "belongs to uid 4242");
    CHECK(chown(d, 0, 0) == 0);
  } else {
    printf("# skipped: another uid's directory (needs root)\n");
  }
  char rel[] = "relative/dir";
  CHECK(mok_ep_group_dir_check(rel, true, err, sizeof err) == MOK_EINVAL);
  remove_dir(base);
}

static mok_ep_group_join_args args_world(uint32_t world, uint32_t rank, const char *key) {
  mok_ep_group_join_args a = args(rank, key);
  a.sizing.world = world;
  return a;
}

/* A table using dir d, as a mokd configured with group-dir = d. */
static mok_ep_group_table *table_in(const char *d) {
  mok_ep_group_table *t = mok_ep_group_table_create(&never);
  CHECK(t);
  mok_ep_group_set_dir(t, d);
  return t;
}

static void seg_path(const char *d, const char *key, char *buf, size_t len) {
  CHECK_EQ_INT(mok_ep_group_segment_path(d, getuid(), key, buf, len), MOK_OK);
}

static void plant_file(const char *path, mode_t mode, size_t bytes) {
  int fd = open(path, O_CREAT | O_EXCL | O_WRONLY, mode);
  CHECK_MSG(fd >= 0, "plant %s: %s", path, strerror(errno));
  CHECK(fchmod(fd, mode) == 0 && ftruncate(fd, (off_t)bytes) == 0);
  CHECK(write(fd, "garbage", 7) == 7);
  close(fd);
}

static void join_ok(mok_ep_group_table *t, const mok_ep_group_join_args *a, mok_ep_group **g) {
  char err[256] = "";
  bool rejoined;
  CHECK_MSG(mok_ep_group_join(t, a, g, &rejoined, err, sizeof err) == MOK_OK, "%s", err);
}

static void test_planted_paths_are_reclaimed_and_never_followed(void) {
  char d[64], target[128], path[256], err[256];
  make_tmp_dir(d, sizeof d);
  mok_ep_group_table *t = table_in(d);
  mok_ep_group *g;
  /* a link at a key's path (to a file of the daemon's that must stay intact) */
  snprintf(target, sizeof target, "%s.target", d);
  plant_file(target, 0600, 0);
  mok_ep_group_join_args a = args_world(1, 0, "linked");
  seg_path(d, a.key, path, sizeof path);
  CHECK(symlink(target, path) == 0);
  join_ok(t, &a, &g);
  struct stat st;
  CHECK(lstat(path, &st) == 0 && S_ISREG(st.st_mode)); /* a real segment now */
  CHECK_EQ_INT(st.st_mode & 07777, 0600);
  CHECK(stat(target, &st) == 0 && st.st_size == 7); /* untouched */
  CHECK_EQ_INT((long long)mok_ep_group_segment_bytes(&a.sizing),
               (long long)(lstat(path, &st) == 0 ? st.st_size : -1));
  /* a file of the daemon's uid with another mode, and garbage in it */
  mok_ep_group_join_args b = args_world(1, 0, "wrong-mode");
  seg_path(d, b.key, path, sizeof path);
  plant_file(path, 0644, 1 << 20);
  join_ok(t, &b, &g);
  CHECK(lstat(path, &st) == 0 && (st.st_mode & 07777) == 0600);
  /* a mode-0600 file that is no segment */
  mok_ep_group_join_args c = args_world(1, 0, "garbage");
  seg_path(d, c.key, path, sizeof path);
  plant_file(path, 0600, 1 << 20);
  join_ok(t, &c, &g);
  /* empty, as a mokd killed between making and sizing it leaves it */
  mok_ep_group_join_args z = args_world(1, 0, "empty");
  seg_path(d, z.key, path, sizeof path);
  int zfd = open(path, O_CREAT | O_EXCL | O_WRONLY, 0600);
  CHECK(zfd >= 0);
  close(zfd);
  join_ok(t, &z, &g);
  CHECK(lstat(path, &st) == 0 && st.st_size > 0);
  /* an empty directory goes; a full one cannot, and the join says so */
  mok_ep_group_join_args e = args_world(1, 0, "dir");
  seg_path(d, e.key, path, sizeof path);
  CHECK(mkdir(path, 0700) == 0);
  join_ok(t, &e, &g);
  mok_ep_group_join_args f = args_world(1, 0, "full-dir");
  seg_path(d, f.key, path, sizeof path);
  CHECK(mkdir(path, 0700) == 0);
  char inner[300];
  snprintf(inner, sizeof inner, "%s/x", path);
  plant_file(inner, 0600, 0);
  bool rejoined;
  CHECK_EQ_INT(mok_ep_group_join(t, &f, &g, &rejoined, err, sizeof err), MOK_EIO);
  CHECK_STR_CONTAINS(err, "is a directory, and mokd cannot remove it");
  if (geteuid() == 0) { /* another owner's file: root may plant one */
    mok_ep_group_join_args o = args_world(1, 0, "owner");
    seg_path(d, o.key, path, sizeof path);
    plant_file(path, 0600, 1 << 20);
    CHECK(chown(path, 4242, 4242) == 0);
    join_ok(t, &o, &g);
    CHECK(lstat(path, &st) == 0 && st.st_uid == 0);
  }
  /* the directory itself turned unsafe: refused before anything is made */
  CHECK(chmod(d, 0777) == 0);
  mok_ep_group_join_args u = args_world(1, 0, "unsafe");
  CHECK_EQ_INT(mok_ep_group_join(t, &u, &g, &rejoined, err, sizeof err), MOK_EACCES);
  CHECK_STR_CONTAINS(err, "writable by everyone");
  seg_path(d, u.key, path, sizeof path);
  CHECK(lstat(path, &st) < 0 && errno == ENOENT);
  CHECK(chmod(d, 0700) == 0);
  mok_ep_group_table_destroy(t);
  unlink(target);
  remove_dir(d);
}

/* In a child: join key (world 2, rank 0) in d and exit without leaving,
 * as a mokd killed with SIGKILL would. */
static void join_and_die(const char *d, const char *key, uint32_t max_tokens) {
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    mok_ep_group_table *t = table_in(d);
    mok_ep_group_join_args a = args_world(2, 0, key);
    a.sizing.max_tokens = max_tokens;
    mok_ep_group *g;
    char err[256];
    bool rejoined;
    _exit(mok_ep_group_join(t, &a, &g, &rejoined, err, sizeof err) == MOK_OK ? 0 : 1);
  }
  int st;
  CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

static void test_a_dead_daemons_segment_is_reclaimed(void) {
  char d[64], path[256], err[256];
  make_tmp_dir(d, sizeof d);
  join_and_die(d, "dead", 16);
  seg_path(d, "dead", path, sizeof path);
  struct stat before, after;
  CHECK(lstat(path, &before) == 0);
  /* another sizing: a live segment's would be refused; a dead one goes */
  mok_ep_group_table *t = table_in(d);
  mok_ep_group_join_args a = args_world(2, 1, "dead");
  a.sizing.max_tokens = 32;
  mok_ep_group *g;
  join_ok(t, &a, &g);
  CHECK(lstat(path, &after) == 0);
  CHECK_EQ_INT(after.st_size, (long long)mok_ep_group_segment_bytes(&a.sizing));
  CHECK(after.st_size != before.st_size);
  /* while this table holds it, it is live: a third member of other sizing is refused */
  mok_ep_group_table *t2 = table_in(d);
  mok_ep_group_join_args b = args_world(2, 0, "dead");
  b.sizing.max_tokens = 16;
  bool rejoined;
  CHECK_EQ_INT(mok_ep_group_join(t2, &b, &g, &rejoined, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "max_tokens = 32");
  mok_ep_group_table_destroy(t2);
  mok_ep_group_table_destroy(t);
  CHECK(lstat(path, &after) < 0 && errno == ENOENT); /* the last member out removed it */
  remove_dir(d);
}

static void test_another_versions_segment_is_refused_not_removed(void) {
  char d[64], path[256], err[256];
  make_tmp_dir(d, sizeof d);
  mok_ep_group_join_args a = args_world(1, 0, "old");
  seg_path(d, a.key, path, sizeof path);
  int fd = open(path, O_CREAT | O_EXCL | O_RDWR, 0600);
  CHECK(fd >= 0);
  uint32_t head[2] = {0x5045474bu, 3u}; /* the segment magic, version 3 */
  CHECK(ftruncate(fd, 1 << 20) == 0 && pwrite(fd, head, sizeof head, 0) == sizeof head);
  close(fd);
  mok_ep_group_table *t = table_in(d);
  mok_ep_group *g;
  bool rejoined;
  CHECK_EQ_INT(mok_ep_group_join(t, &a, &g, &rejoined, err, sizeof err), MOK_EIO);
  CHECK_STR_CONTAINS(err, "made by a mokd of another version");
  struct stat st;
  CHECK(lstat(path, &st) == 0);
  mok_ep_group_table_destroy(t);
  remove_dir(d);
}

static void test_the_sweep_removes_only_what_nobody_uses(void) {
  char d[64], path[256], err[256];
  make_tmp_dir(d, sizeof d);
  join_and_die(d, "dead-1", 16);
  join_and_die(d, "dead-2", 16);
  mok_ep_group_table *t = table_in(d);
  mok_ep_group *g;
  mok_ep_group_join_args a = args_world(2, 0, "live");
  join_ok(t, &a, &g);
  char link[300], other[300];
  snprintf(link, sizeof link, "%s/mok-ep-0-linked", d);
  CHECK(symlink("/etc/passwd", link) == 0);
  snprintf(other, sizeof other, "%s/not-a-segment", d);
  plant_file(other, 0644, 0);
  unsigned removed = 99;
  CHECK_MSG(mok_ep_group_dir_sweep(d, &removed, err, sizeof err) == MOK_OK, "%s", err);
  CHECK_EQ_INT(removed, 3);
  struct stat st;
  seg_path(d, "live", path, sizeof path);
  CHECK(lstat(path, &st) == 0); /* in use */
  seg_path(d, "dead-1", path, sizeof path);
  CHECK(lstat(path, &st) < 0);
  CHECK(lstat(link, &st) < 0);
  CHECK(lstat(other, &st) == 0); /* not under a segment's name: not ours to judge */
  CHECK_EQ_INT(mok_ep_group_job_start(g, err, sizeof err), MOK_OK);
  /* an unsafe directory is refused by the sweep too */
  CHECK(chmod(d, 0755) == 0 && chmod(d, 0775) == 0);
  CHECK_EQ_INT(mok_ep_group_dir_sweep(d, &removed, err, sizeof err), MOK_EACCES);
  CHECK(chmod(d, 0700) == 0);
  mok_ep_group_table_destroy(t);
  remove_dir(d);
}

static void test_segment_bytes_follow_the_sizing(void) {
  mok_ep_group_join_args a = args_world(2, 0, "bytes");
  uint64_t one = mok_ep_group_segment_bytes(&a.sizing);
  CHECK(one > 0 && one % 4096 == 0);
  a.sizing.max_tokens *= 2;
  CHECK(mok_ep_group_segment_bytes(&a.sizing) > one);
  a.sizing.world = 0; /* invalid: the join would be refused */
  CHECK_EQ_INT(mok_ep_group_segment_bytes(&a.sizing), 0);
  a.sizing.world = 2;
  a.sizing.max_tokens = 1u << 31; /* past MOK_LAYER_MAX_TOKENS */
  CHECK_EQ_INT(mok_ep_group_segment_bytes(&a.sizing), 0);
  /* the default directory, and its test-only override */
  unsetenv("MOK_GROUP_DIR");
  CHECK(strcmp(mok_ep_group_dir_of(NULL), MOK_GROUP_DIR_DEFAULT) == 0);
  CHECK(strcmp(mok_ep_group_dir_of("/x"), "/x") == 0);
  setenv("MOK_GROUP_DIR", "/y", 1);
  CHECK(strcmp(mok_ep_group_dir_of(""), "/y") == 0);
  CHECK(strcmp(mok_ep_group_dir_of("/x"), "/x") == 0); /* configuration wins */
}

static const check_case cases[] = {
    CHECK_CASE(test_engine_state_and_peers),
    CHECK_CASE(test_nccl_group_rejoin_and_reform),
    CHECK_CASE(test_the_group_dir_must_be_the_daemons_alone),
    CHECK_CASE(test_planted_paths_are_reclaimed_and_never_followed),
    CHECK_CASE(test_a_dead_daemons_segment_is_reclaimed),
    CHECK_CASE(test_another_versions_segment_is_refused_not_removed),
    CHECK_CASE(test_the_sweep_removes_only_what_nobody_uses),
    CHECK_CASE(test_segment_bytes_follow_the_sizing),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
