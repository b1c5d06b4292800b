/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: who may connect, and what one uid may hold.
 *
 * The socket's group and mode come from the configuration; allow-uids /
 * allow-gids are checked against SO_PEERCRED at accept (a refused peer gets
 * one EACCES reply, the daemon logs its uid and pid); per-uid quotas span
 * all of that uid's sessions and fail with ELIMIT without closing anyone.
 * Parts that need a second uid run only as root (they fork a child that
 * drops to uid 4242) and are skipped otherwise.
 */
#include <grp.h>

#include "harness/daemon.h"
#include "internal.h"
#include "mok.h"

#define OTHER_UID 4242u
#define OTHER_GID 4243u
#define OTHER_SUPP_GID 4244u

/* In a forked child: become uid OTHER_UID (gid OTHER_GID, supplementary
 * OTHER_SUPP_GID), connect, and exit with the status of mok_connect. */
static int connect_as_other(const daemon_proc *d) {
  CHECK(chmod(d->dir, 0755) == 0); /* mkdtemp made it 0700 */
  const char *sock = d->sock;
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    gid_t supp = OTHER_SUPP_GID;
    if (setgroups(1, &supp) < 0 || setgid(OTHER_GID) < 0 || setuid(OTHER_UID) < 0) _exit(100);
    mok_client *c;
    int r = mok_connect(sock, "other-uid", &c);
    if (r == MOK_OK) mok_close(c);
    _exit(r);
  }
  int st;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) != 100);
  return WEXITSTATUS(st);
}

static void test_socket_group_and_mode_come_from_the_config(void) {
  /* root can hand the socket to another group; anyone can name their own */
  const struct group *g = getuid() == 0 ? getgrnam("nogroup") : NULL;
  if (!g) g = getgrgid(getgid());
  CHECK(g != NULL);
  char conf[256];
  snprintf(conf, sizeof conf, "socket-group = %s\nsocket-mode = 0660\n", g->gr_name);
  gid_t want = g->gr_gid;
  daemon_proc d = harness_start(conf);
  struct stat st;
  CHECK(stat(d.sock, &st) == 0);
  CHECK(S_ISSOCK(st.st_mode));
  CHECK_EQ_INT(st.st_gid, want);
  CHECK_EQ_INT(st.st_mode & 07777, 0660);
  CHECK_EQ_INT(harness_stop(&d), 0);

  d = harness_start("socket-mode = 0600\n");
  CHECK(stat(d.sock, &st) == 0);
  CHECK_EQ_INT(st.st_mode & 07777, 0600);
  CHECK_EQ_INT(harness_stop(&d), 0);

  /* a group that does not exist stops start-up, with the reason */
  d = harness_try_start("socket-group = no-such-group-mok\n");
  CHECK_EQ_INT(d.pid, 0);
  CHECK_STR_CONTAINS(harness_log(&d), "socket-group no-such-group-mok");
}

static void test_allow_lists_refuse_other_peers_with_one_reply(void) {
  char conf[256];
  snprintf(conf, sizeof conf, "allow-uids = %u\nallow-gids = %u\n", (unsigned)getuid() + 1,
           (unsigned)getgid() + 1);
  daemon_proc d = harness_start(conf);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "not-listed", &c), MOK_EACCES);
  CHECK_STR_CONTAINS(mok_last_error(), "allow-uids");
  /* raw: exactly one EACCES reply, then the connection is closed */
  int fd = harness_raw_connect(d.sock);
  char msg[512];
  CHECK_EQ_INT(harness_read_reply(fd, msg, sizeof msg), MOK_EACCES);
  uint8_t buf[64];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(fd, buf, sizeof buf, 32, 0, &f), 1);
  close(fd);
  char who[64];
  snprintf(who, sizeof who, "refused a connection from uid %u", (unsigned)getuid());
  CHECK_STR_CONTAINS(harness_log(&d), who);
  CHECK_STR_CONTAINS(harness_log(&d), " pid ");
  CHECK(harness_alive(&d));
  CHECK_EQ_INT(harness_stop(&d), 0);

  /* listed by uid, or by primary gid */
  snprintf(conf, sizeof conf, "allow-uids = %u, %u\n", (unsigned)getuid() + 1, (unsigned)getuid());
  d = harness_start(conf);
  CHECK_MSG(mok_connect(d.sock, "listed", &c) == MOK_OK, "%s", mok_last_error());
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
  snprintf(conf, sizeof conf, "allow-uids = %u\nallow-gids = %u\n", (unsigned)getuid() + 1,
           (unsigned)getgid());
  d = harness_start(conf);
  CHECK_MSG(mok_connect(d.sock, "listed-gid", &c) == MOK_OK, "%s", mok_last_error());
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_supplementary_groups_count_for_allow_gids(void) {
  if (getuid() != 0) {
    printf("# skipped: needs root to connect as a second uid\n");
    return;
  }
  char conf[256];
  snprintf(conf, sizeof conf, "socket-mode = 0666\nallow-uids = 0\nallow-gids = %u\n",
           OTHER_SUPP_GID);
  daemon_proc d = harness_start(conf);
  CHECK_EQ_INT(connect_as_other(&d), MOK_OK);
  CHECK_EQ_INT(harness_stop(&d), 0);
  snprintf(conf, sizeof conf, "socket-mode = 0666\nallow-uids = 0\nallow-gids = %u\n",
           OTHER_SUPP_GID + 1);
  d = harness_start(conf);
  CHECK_EQ_INT(connect_as_other(&d), MOK_EACCES);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static int connect_retry(const char *sock, mok_client **c) {
  int r = MOK_ELIMIT;
  for (int i = 0; i < 200 && r == MOK_ELIMIT; i++) {
    r = mok_connect(sock, "retry", c);
    if (r == MOK_ELIMIT) usleep(10000);
  }
  return r;
}

static void test_sessions_per_uid_are_capped(void) {
  daemon_proc d = harness_start("socket-mode = 0666\nmax-sessions-per-uid = 2\n");
  mok_client *a, *b, *c;
  /* the start-up probe's connection counts until the daemon sees it close */
  CHECK(connect_retry(d.sock, &a) == MOK_OK);
  CHECK(connect_retry(d.sock, &b) == MOK_OK);
  CHECK_EQ_INT(mok_connect(d.sock, "c", &c), MOK_ELIMIT);
  CHECK_STR_CONTAINS(mok_last_error(), "max-sessions-per-uid");
  /* the refused connection cost the others nothing */
  mok_daemon_stats st;
  CHECK(mok_stats(a, &st) == MOK_OK);
  CHECK_EQ_INT(st.sessions_now, 2);
  if (getuid() == 0) CHECK_EQ_INT(connect_as_other(&d), MOK_OK); /* another uid's cap */
  mok_close(a);
  CHECK_MSG(connect_retry(d.sock, &c) == MOK_OK, "%s", mok_last_error());
  mok_close(b);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_region_quotas_span_a_uids_sessions(void) {
  daemon_proc d = harness_start("max-region-bytes-per-uid = 1048576\nmax-regions-per-uid = 5\n");
  mok_client *a, *b;
  CHECK(mok_connect(d.sock, "a", &a) == MOK_OK);
  CHECK(mok_connect(d.sock, "b", &b) == MOK_OK);
  void *pa = mok_host_alloc(a, 600 << 10);
  CHECK_MSG(pa != NULL, "%s", mok_last_error());
  CHECK(mok_host_alloc(b, 600 << 10) == NULL); /* 1.2 MiB across a and b */
  CHECK_STR_CONTAINS(mok_last_error(), "max-region-bytes-per-uid");
  CHECK_STR_CONTAINS(mok_last_error(), "614400 bytes in use");
  void *pb = mok_host_alloc(b, 256 << 10);
  CHECK_MSG(pb != NULL, "%s", mok_last_error()); /* what fits still works */
  CHECK(mok_host_free(a, pa) == MOK_OK);          /* freed bytes come back */
  pa = mok_host_alloc(b, 600 << 10);
  CHECK_MSG(pa != NULL, "%s", mok_last_error());
  /* region count: b holds 2, a may add 3 more */
  for (int i = 0; i < 3; i++) CHECK_MSG(mok_host_alloc(a, 4096) != NULL, "%s", mok_last_error());
  CHECK(mok_host_alloc(a, 4096) == NULL);
  CHECK_STR_CONTAINS(mok_last_error(), "max-regions-per-uid 5");
  /* a dead session's share comes back once its memory is released */
  mok_close(b);
  void *p = NULL;
  for (int i = 0; i < 200 && !p; i++) {
    p = mok_host_alloc(a, 900 << 10);
    if (!p) usleep(10000);
  }
  CHECK_MSG(p != NULL, "%s", mok_last_error());
  mok_close(a);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_killed_sessions_release_their_uid_quota(void) {
  daemon_proc d = harness_start("max-region-bytes-per-uid = 1048576\n");
  for (int round = 0; round < 3; round++) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      mok_client *c;
      if (mok_connect(d.sock, "doomed", &c) != MOK_OK) _exit(2);
      /* the previous round's share comes back once mokd has detached that
       * session, which it does shortly after the kill: wait for it */
      void *p = NULL;
      for (int i = 0; i < 500 && !p; i++)
        if (!(p = mok_host_alloc(c, 900 << 10))) usleep(10000);
      if (!p) _exit(3);
      kill(getpid(), SIGKILL);
    }
    int st;
    waitpid(pid, &st, 0);
    CHECK(WIFSIGNALED(st));
  }
  mok_client *c;
  CHECK(mok_connect(d.sock, "after", &c) == MOK_OK);
  void *p = NULL;
  for (int i = 0; i < 200 && !p; i++) {
    p = mok_host_alloc(c, 900 << 10);
    if (!p) usleep(10000);
  }
  CHECK_MSG(p != NULL, "%s", mok_last_error());
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_layer_quota_spans_a_uids_sessions(void) {
  daemon_proc d = harness_start("max-layers-per-uid = 2\n");
  mok_client *a, *b;
  CHECK(mok_connect(d.sock, "a", &a) == MOK_OK);
  CHECK(mok_connect(d.sock, "b", &b) == MOK_OK);
  mok_layer_desc desc = {.hidden = 16, .intermediate = 8, .experts = 4, .topk = 2,
                         .max_tokens = 8, .dtype = MOK_DTYPE_F32};
  mok_layer *la, *lb, *lx;
  CHECK(mok_layer_create(a, &desc, &la) == MOK_OK);
  CHECK(mok_layer_create(b, &desc, &lb) == MOK_OK);
  CHECK_EQ_INT(mok_layer_create(b, &desc, &lx), MOK_ELIMIT);
  CHECK_STR_CONTAINS(mok_last_error(), "max-layers-per-uid 2");
  desc.topk = 9; /* an invalid layer does not consume quota either */
  CHECK_EQ_INT(mok_layer_create(a, &desc, &lx), MOK_EINVAL);
  desc.topk = 2;
  mok_layer_destroy(la);
  CHECK_MSG(mok_layer_create(b, &desc, &lx) == MOK_OK, "%s", mok_last_error());
  mok_close(a);
  mok_close(b);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_refused_peers_cost_nothing(void) {
  /* a flood of refused connections leaves the daemon's fds where they were */
  char conf[128];
  snprintf(conf, sizeof conf, "allow-uids = %u\n", (unsigned)getuid() + 1);
  daemon_proc d = harness_start(conf);
  usleep(100000); /* the start-up probe's connection is gone by now */
  int base = harness_fd_count(d.pid);
  for (int i = 0; i < 200; i++) {
    int fd = harness_raw_connect(d.sock);
    close(fd);
  }
  int fds = harness_wait_fds(d.pid, base, 2000);
  CHECK_MSG(fds <= base, "daemon fds %d, %d before", fds, base);
  CHECK(harness_alive(&d));
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* Queue many slow jobs from two sessions of one uid: past max-jobs-per-uid
 * the engine fails a job with ELIMIT instead of running it; the others run. */
static void test_jobs_in_flight_are_capped_per_uid(void) {
  daemon_proc d = harness_start("max-jobs-per-uid = 24\n");
  enum { H = 512, I = 512, E = 4, K = 2, T = 256, JOBS = 30 };
  mok_client *c[2];
  mok_layer *l[2];
  mok_forward_args fa[2];
  for (int k = 0; k < 2; k++) {
    CHECK(mok_connect(d.sock, "busy", &c[k]) == MOK_OK);
    mok_layer_desc ld = {.hidden = H, .intermediate = I, .experts = E, .topk = K,
                         .max_tokens = T, .dtype = MOK_DTYPE_F32};
    CHECK(mok_layer_create(c[k], &ld, &l[k]) == MOK_OK);
    char *m = mok_host_alloc(c[k], 4ull * (2 * T * H + 2 * T * K + 3ull * E * I * H));
    CHECK(m != NULL);
    memset(m, 0, 4ull * (2 * T * H + 2 * T * K + 3ull * E * I * H)); /* status only */
    int32_t *ids = (int32_t *)(m + 8ull * T * H);
    for (int i = 0; i < T * K; i++) ids[i] = i % E;
    fa[k] = (mok_forward_args){.x = m, .out = m + 4ull * T * H, .topk_ids = ids,
                               .router_weights = (float *)(ids + T * K),
                               .w_gate = (float *)(ids + 2 * T * K),
                               .w_up = (float *)(ids + 2 * T * K) + E * I * H,
                               .w_down = (float *)(ids + 2 * T * K) + 2ull * E * I * H};
  }
  uint64_t t[2][JOBS];
  for (int i = 0; i < JOBS; i++)
    for (int k = 0; k < 2; k++) CHECK(mok_forward(l[k], T, &fa[k], &t[k][i]) == MOK_OK);
  int ok = 0, limited = 0;
  for (int k = 0; k < 2; k++)
    for (int i = 0; i < JOBS; i++) {
      int r = mok_wait(c[k], t[k][i], 60000);
      if (r == MOK_OK) {
        ok++;
      } else {
        CHECK_EQ_INT(r, MOK_ELIMIT);
        CHECK_STR_CONTAINS(mok_last_error(), "max-jobs-per-uid 24");
        limited++;
      }
    }
  CHECK_MSG(limited > 0 && ok > 0, "%d ran, %d refused", ok, limited);
  /* nothing queued any more: the uid is under its cap again */
  uint64_t t1;
  CHECK(mok_forward(l[0], T, &fa[0], &t1) == MOK_OK);
  CHECK_EQ_INT(mok_wait(c[0], t1, 60000), MOK_OK);
  for (int k = 0; k < 2; k++) mok_close(c[k]);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_socket_group_and_mode_come_from_the_config),
    CHECK_CASE(test_allow_lists_refuse_other_peers_with_one_reply),
    CHECK_CASE(test_supplementary_groups_count_for_allow_gids),
    CHECK_CASE(test_sessions_per_uid_are_capped),
    CHECK_CASE(test_region_quotas_span_a_uids_sessions),
    CHECK_CASE(test_killed_sessions_release_their_uid_quota),
    CHECK_CASE(test_layer_quota_spans_a_uids_sessions),
    CHECK_CASE(test_refused_peers_cost_nothing),
    CHECK_CASE(test_jobs_in_flight_are_capped_per_uid),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
