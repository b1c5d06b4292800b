/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: tenants of one mokd, as real uids.
 *
 * An attacking uid takes all it is allowed (sessions, regions, bytes,
 * layers, jobs in flight, groups); each refusal is ELIMIT naming the
 * setting, and a second uid is still served: it connects, registers, runs a
 * job. Stats (and so mokctl) show a tenant only its own uid's sessions and
 * groups; root and admin-uids/admin-gids see all.
 *
 * The tenants are children of this test that drop to throwaway uids (no
 * passwd entry needed: SO_PEERCRED reports the number), so every case
 * needs root and is skipped otherwise.
 */
#include <ftw.h>
#include <grp.h>
#include <sys/mman.h>

#include "ep/group.h"
#include "harness.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

#define UID_A 4301u /* the attacker */
#define UID_B 4302u /* the victim */
#define UID_C 4303u /* a third tenant */
#define GID_TENANT 4310u
#define GID_ADMIN 4311u /* B's supplementary group in the admin-gids case */

/* What a tenant reports back (shared memory across fork). */
typedef struct report {
  int count;  /* how many it got before the refusal */
  int status; /* the refusal's (or the failing step's) status */
  int step;   /* 0: all done; else the step that failed */
  char msg[512];
  char text[8192]; /* e.g. mokctl's output */
  uint64_t n_sessions, n_groups, own_only, others_seen;
} report;

static report *reports; /* [4]: A, B, C, spare */

/* Remove dir and all in it (never following links). */
static int remove_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  (void)st, (void)flag, (void)ftw;
  return remove(path) < 0 && errno != ENOENT ? -1 : 0;
}
static void remove_dir(const char *path) { nftw(path, remove_entry, 16, FTW_DEPTH | FTW_PHYS); }

static bool need_root(void) {
  if (geteuid() == 0) return true;
  printf("# skipped: needs root to run tenants as other uids\n");
  return false;
}

static void become(uid_t uid, gid_t supp) {
  gid_t groups[1] = {supp};
  if (setgroups(1, groups) < 0 || setresgid(GID_TENANT, GID_TENANT, GID_TENANT) < 0 ||
      setresuid(uid, uid, uid) < 0)
    _exit(100);
}

typedef void (*tenant_fn)(const char *sock, report *r);

/* A tenant that does fn and then holds what it got until released. */
typedef struct holder {
  pid_t pid;
  int ready_r, go_w;
} holder;

static holder hold_as(uid_t uid, tenant_fn fn, const char *sock, report *r) {
  int ready[2], go[2];
  CHECK(pipe(ready) == 0 && pipe(go) == 0);
  holder h;
  h.pid = fork();
  CHECK(h.pid >= 0);
  if (h.pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    close(ready[0]);
    close(go[1]);
    become(uid, GID_TENANT);
    fn(sock, r);
    char b = 1;
    if (write(ready[1], &b, 1) != 1) _exit(101);
    if (read(go[0], &b, 1) < 0) _exit(102); /* released (or the test died) */
    _exit(0);
  }
  close(ready[1]);
  close(go[0]);
  h.ready_r = ready[0];
  h.go_w = go[1];
  char b;
  CHECK_MSG(read(h.ready_r, &b, 1) == 1, "a tenant died before it was ready");
  return h;
}

static void release(holder *h) {
  char b = 1; /* a byte, not EOF: later holders hold copies of this pipe */
  CHECK(write(h->go_w, &b, 1) == 1);
  close(h->go_w);
  int st;
  CHECK(waitpid(h->pid, &st, 0) == h->pid);
  close(h->ready_r);
}

/* A tenant that does fn and exits; returns its report's step (0: all done). */
static int run_as(uid_t uid, gid_t supp, tenant_fn fn, const char *sock, report *r) {
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    become(uid, supp);
    fn(sock, r);
    _exit(0);
  }
  int st;
  CHECK(waitpid(pid, &st, 0) == pid);
  CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "tenant exited with %d", WEXITSTATUS(st));
  return r->step;
}

static void fail_step(report *r, int step, int status) {
  r->step = step;
  r->status = status;
  snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
}

static daemon_proc start_shared(const char *extra) {
  char conf[1024];
  snprintf(conf, sizeof conf, "socket-mode = 0666\n%s", extra);
  daemon_proc d = harness_start(conf);
  CHECK(chmod(d.dir, 0755) == 0); /* mkdtemp made it 0700 */
  memset(reports, 0, 4 * sizeof *reports);
  return d;
}

/* ---- the victim: everything a tenant does, on a small layer ---- */

enum { T = 8, H = 32, I = 16, E = 4, K = 2 };

static int small_forward(mok_client *c) {
  mok_layer_desc ld = {.hidden = H, .intermediate = I, .experts = E, .topk = K, .max_tokens = T,
                       .dtype = MOK_DTYPE_F32};
  mok_layer *l;
  int r = mok_layer_create(c, &ld, &l);
  if (r != MOK_OK) return r;
  size_t bytes = 4u * (2 * T * H + 2 * T * K + 3 * E * I * H);
  char *m = mok_host_alloc(c, bytes);
  if (!m) return MOK_ENOMEM;
  memset(m, 0, bytes);
  int32_t *ids = (int32_t *)(m + 8u * T * H);
  for (int i = 0; i < T * K; i++) ids[i] = i % E;
  float *w = (float *)(ids + 2 * T * K);
  mok_forward_args fa = {.x = m, .out = m + 4u * T * H, .topk_ids = ids,
                         .router_weights = (float *)(ids + T * K), .w_gate = w,
                         .w_up = w + E * I * H, .w_down = w + 2 * E * I * H};
  uint64_t ticket;
  r = mok_forward(l, T, &fa, &ticket);
  if (r == MOK_OK) r = mok_wait(c, ticket, 30000);
  mok_layer_destroy(l);
  mok_host_free(c, m);
  return r;
}

static void victim(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "victim", &c)) != MOK_OK) return fail_step(r, 1, st);
  if (!mok_host_alloc(c, 64 * 1024)) return fail_step(r, 2, MOK_ENOMEM);
  if ((st = small_forward(c)) != MOK_OK) return fail_step(r, 3, st);
  mok_close(c);
}

static void victim_ok(const char *sock, uid_t uid) {
  report *r = &reports[1];
  memset(r, 0, sizeof *r);
  CHECK_MSG(run_as(uid, GID_TENANT, victim, sock, r) == 0, "uid %u was not served: step %d: %s",
            (unsigned)uid, r->step, r->msg);
}

/* ---- sessions ---- */

static void take_sessions(const char *sock, report *r) {
  static mok_client *held[64];
  for (r->count = 0; r->count < 64; r->count++) {
    int st = mok_connect(sock, "hog", &held[r->count]);
    if (st != MOK_OK) {
      r->status = st;
      snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
      return;
    }
  }
}

static void test_sessions_keep_a_reserve_for_other_uids(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-sessions = 12\nsession-reserve = 4\n"
                               "max-sessions-per-uid = 64\n");
  usleep(200000); /* the start-up probe's connection is gone */
  report *a = &reports[0];
  holder h = hold_as(UID_A, take_sessions, d.sock, a);
  CHECK_EQ_INT(a->count, 8); /* 12 - the reserve of 4 */
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "session-reserve");
  CHECK_STR_CONTAINS(a->msg, "uid 4301 has 8");
  victim_ok(d.sock, UID_B); /* from the reserve */
  victim_ok(d.sock, UID_C);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_sessions_per_uid(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-sessions-per-uid = 3\n");
  report *a = &reports[0];
  holder h = hold_as(UID_A, take_sessions, d.sock, a);
  CHECK_EQ_INT(a->count, 3);
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "max-sessions-per-uid 3");
  victim_ok(d.sock, UID_B);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* ---- regions, bytes, layers ---- */

static size_t hog_bytes; /* each allocation of take_regions */

static void take_regions(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "hog", &c)) != MOK_OK) return fail_step(r, 1, st);
  for (r->count = 0; r->count < 100000; r->count++) {
    if (!mok_host_alloc(c, hog_bytes)) {
      r->status = MOK_ELIMIT;
      snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
      return; /* c stays open: the holder keeps it */
    }
  }
}

static void test_regions_per_uid_and_in_all(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-regions-per-uid = 40\nmax-regions-total = 60\n");
  report *a = &reports[0], *c = &reports[2];
  hog_bytes = 4096;
  holder ha = hold_as(UID_A, take_regions, d.sock, a);
  CHECK_EQ_INT(a->count, 40);
  CHECK_STR_CONTAINS(a->msg, "max-regions-per-uid 40");
  victim_ok(d.sock, UID_B);
  /* a second attacking uid takes what is left of the daemon's regions */
  holder hc = hold_as(UID_C, take_regions, d.sock, c);
  CHECK_EQ_INT(c->count, 20);
  CHECK_STR_CONTAINS(c->msg, "max-regions-total 60");
  /* the regions' mappings go with the attackers, so the victim is served again */
  int maps = harness_map_count(d.pid);
  CHECK(maps >= 60);
  release(&ha);
  release(&hc);
  for (int i = 0; i < 200 && harness_map_count(d.pid) > 0; i++) usleep(10000);
  CHECK_EQ_INT(harness_map_count(d.pid), 0);
  victim_ok(d.sock, UID_B);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_region_bytes_per_uid(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-region-bytes-per-uid = 1048576\n");
  report *a = &reports[0];
  hog_bytes = 256 * 1024;
  holder h = hold_as(UID_A, take_regions, d.sock, a);
  CHECK_EQ_INT(a->count, 4);
  CHECK_STR_CONTAINS(a->msg, "max-region-bytes-per-uid 1048576");
  victim_ok(d.sock, UID_B);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void take_layers(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "hog", &c)) != MOK_OK) return fail_step(r, 1, st);
  mok_layer_desc ld = {.hidden = H, .intermediate = I, .experts = E, .topk = K, .max_tokens = T,
                       .dtype = MOK_DTYPE_F32};
  for (r->count = 0; r->count < 1000; r->count++) {
    mok_layer *l;
    if ((st = mok_layer_create(c, &ld, &l)) != MOK_OK) {
      r->status = st;
      snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
      return;
    }
  }
}

static void test_layers_per_uid(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-layers-per-uid = 5\n");
  report *a = &reports[0];
  holder h = hold_as(UID_A, take_layers, d.sock, a);
  CHECK_EQ_INT(a->count, 5);
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "max-layers-per-uid 5");
  victim_ok(d.sock, UID_B);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* ---- jobs in flight ---- */

static void flood_jobs(const char *sock, report *r) {
  enum { BH = 512, BI = 512, BT = 256, JOBS = 40 };
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "flood", &c)) != MOK_OK) return fail_step(r, 1, st);
  mok_layer_desc ld = {.hidden = BH, .intermediate = BI, .experts = E, .topk = K,
                       .max_tokens = BT, .dtype = MOK_DTYPE_F32};
  mok_layer *l;
  if ((st = mok_layer_create(c, &ld, &l)) != MOK_OK) return fail_step(r, 2, st);
  size_t bytes = 4ull * (2 * BT * BH + 2 * BT * K + 3ull * E * BI * BH);
  char *m = mok_host_alloc(c, bytes);
  if (!m) return fail_step(r, 3, MOK_ENOMEM);
  memset(m, 0, bytes);
  int32_t *ids = (int32_t *)(m + 8ull * BT * BH);
  for (int i = 0; i < BT * K; i++) ids[i] = i % E;
  float *w = (float *)(ids + 2 * BT * K);
  mok_forward_args fa = {.x = m, .out = m + 4ull * BT * BH, .topk_ids = ids,
                         .router_weights = (float *)(ids + BT * K), .w_gate = w,
                         .w_up = w + E * BI * BH, .w_down = w + 2ull * E * BI * BH};
  uint64_t tickets[JOBS];
  for (int i = 0; i < JOBS; i++)
    if ((st = mok_forward(l, BT, &fa, &tickets[i])) != MOK_OK) return fail_step(r, 4, st);
  for (int i = 0; i < JOBS; i++) {
    st = mok_wait(c, tickets[i], 120000);
    if (st == MOK_OK) {
      r->count++;
    } else if (st == MOK_ELIMIT) {
      r->status = st;
      snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
    } else {
      return fail_step(r, 5, st);
    }
  }
}

static void test_jobs_in_flight_per_uid(void) {
  if (!need_root()) return;
  daemon_proc d = start_shared("max-jobs-per-uid = 6\n");
  report *a = &reports[0];
  /* the flood runs in the background while the victim is served */
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    become(UID_A, GID_TENANT);
    flood_jobs(d.sock, a);
    _exit(0);
  }
  usleep(200000);
  victim_ok(d.sock, UID_B);
  int st;
  CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 0);
  CHECK_MSG(a->step == 0, "step %d: %s", a->step, a->msg);
  CHECK_MSG(a->count > 0 && a->count < 40, "%d of 40 ran", a->count);
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "max-jobs-per-uid 6");
  CHECK_STR_CONTAINS(a->msg, "uid 4301");
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* ---- groups ---- */

static uint32_t group_tokens = 8; /* the sizing of take_groups' groups */
static bool leave_groups;

static void take_groups(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "groups", &c)) != MOK_OK) return fail_step(r, 1, st);
  mok_group_sizing sz = {.max_tokens = group_tokens, .hidden = H, .topk = K, .experts = E,
                         .dtype = MOK_DTYPE_F32, .timeout_ms = 1000};
  for (r->count = 0; r->count < 100; r->count++) {
    char key[32];
    snprintf(key, sizeof key, "hog-%d", r->count);
    mok_group *g;
    if ((st = mok_group_join(c, key, 0, 1, &sz, &g)) != MOK_OK) {
      r->status = st;
      snprintf(r->msg, sizeof r->msg, "%s", mok_last_error());
      break;
    }
    if (leave_groups) mok_group_leave(g);
  }
  /* re-joining a group it holds costs nothing */
  mok_group *again;
  if (r->count > 0 && !leave_groups && (st = mok_group_join(c, "hog-0", 0, 1, &sz, &again)) != MOK_OK)
    return fail_step(r, 2, st);
}

static void join_one(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "joiner", &c)) != MOK_OK) return fail_step(r, 1, st);
  mok_group_sizing sz = {.max_tokens = 8, .hidden = H, .topk = K, .experts = E,
                         .dtype = MOK_DTYPE_F32, .timeout_ms = 1000};
  mok_group *g;
  if ((st = mok_group_join(c, "victim-group", 0, 1, &sz, &g)) != MOK_OK) return fail_step(r, 2, st);
  snprintf(r->msg, sizeof r->msg, "joined");
  mok_close(c);
}

static void test_groups_per_uid_count_lingering_ones(void) {
  if (!need_root()) return;
  char gdir[] = "/tmp/mok-test-tenant-groups-XXXXXX", conf[512];
  CHECK(mkdtemp(gdir) != NULL);
  snprintf(conf, sizeof conf, "group-dir = %s\nmax-groups-per-uid = 3\ngroup-linger-ms = 1500\n",
           gdir);
  daemon_proc d = start_shared(conf);
  report *a = &reports[0], *b = &reports[1];
  leave_groups = false;
  group_tokens = 8;
  holder h = hold_as(UID_A, take_groups, d.sock, a);
  CHECK_MSG(a->step == 0, "step %d: %s", a->step, a->msg);
  CHECK_EQ_INT(a->count, 3);
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "max-groups-per-uid 3");
  CHECK(run_as(UID_B, GID_TENANT, join_one, d.sock, b) == 0);
  victim_ok(d.sock, UID_B);
  /* the attacker goes without leaving: its groups linger, and still count */
  release(&h);
  memset(a, 0, sizeof *a);
  CHECK(run_as(UID_A, GID_TENANT, join_one, d.sock, a) == 2);
  CHECK_EQ_INT(a->status, MOK_ELIMIT);
  CHECK_STR_CONTAINS(a->msg, "kept for a re-join");
  /* once the daemon released them (linger over), the uid may join again */
  usleep(3000000);
  memset(a, 0, sizeof *a);
  CHECK_MSG(run_as(UID_A, GID_TENANT, join_one, d.sock, a) == 0, "%s", a->msg);
  /* groups left on purpose go at once: any number, one at a time */
  leave_groups = true;
  memset(a, 0, sizeof *a);
  holder h2 = hold_as(UID_C, take_groups, d.sock, a);
  CHECK_EQ_INT(a->count, 100);
  release(&h2);
  CHECK_EQ_INT(harness_stop(&d), 0);
  remove_dir(gdir);
}

static void test_group_bytes_per_uid(void) {
  if (!need_root()) return;
  char gdir[] = "/tmp/mok-test-tenant-groups-XXXXXX", conf[512];
  CHECK(mkdtemp(gdir) != NULL);
  /* two groups of 512-token sizing fit, not three */
  mok_ep_group_sizing z = {1, 512, H, K, E, MOK_DTYPE_F32, 0, 0};
  uint64_t one = mok_ep_group_segment_bytes(&z);
  CHECK(one > 0);
  snprintf(conf, sizeof conf, "group-dir = %s\nmax-group-bytes-per-uid = %llu\n", gdir,
           (unsigned long long)(2 * one + one / 2));
  daemon_proc d = start_shared(conf);
  report *a = &reports[0], *b = &reports[1];
  leave_groups = false;
  group_tokens = 512;
  holder h = hold_as(UID_A, take_groups, d.sock, a);
  CHECK_MSG(a->step == 0, "step %d: %s", a->step, a->msg);
  CHECK_EQ_INT(a->count, 2);
  CHECK_STR_CONTAINS(a->msg, "max-group-bytes-per-uid");
  CHECK(run_as(UID_B, GID_TENANT, join_one, d.sock, b) == 0);
  victim_ok(d.sock, UID_B);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
  remove_dir(gdir);
}

/* ---- what Stats show ---- */

static void secret_tenant(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "secret-client-A", &c)) != MOK_OK) return fail_step(r, 1, st);
  if (!mok_host_alloc(c, 13 * 4096)) return fail_step(r, 2, MOK_ENOMEM);
  mok_group_sizing sz = {.max_tokens = 8, .hidden = H, .topk = K, .experts = E,
                         .dtype = MOK_DTYPE_F32, .timeout_ms = 1000};
  mok_group *g;
  if ((st = mok_group_join(c, "secret-key-A", 0, 1, &sz, &g)) != MOK_OK) return fail_step(r, 3, st);
  if ((st = small_forward(c)) != MOK_OK) return fail_step(r, 4, st);
  r->count = (int)getpid();
}

static void look_at_stats(const char *sock, report *r) {
  mok_client *c;
  int st;
  if ((st = mok_connect(sock, "looker", &c)) != MOK_OK) return fail_step(r, 1, st);
  if ((st = small_forward(c)) != MOK_OK) return fail_step(r, 2, st);
  Mok__Stats s = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &s;
  Mok__Reply *rep = NULL;
  pthread_mutex_lock(&c->lock);
  st = mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (st != MOK_OK) return fail_step(r, 3, st);
  const Mok__StatsReply *sr = rep->stats;
  r->n_sessions = sr->n_sessions;
  r->n_groups = sr->n_groups;
  r->own_only = sr->own_uid_only;
  r->status = (int)sr->jobs_done;
  for (size_t i = 0; i < sr->n_sessions; i++)
    if (sr->sessions[i]->uid != getuid() || strstr(sr->sessions[i]->client_name, "secret"))
      r->others_seen++;
  for (size_t i = 0; i < sr->n_groups; i++)
    if (sr->groups[i]->uid != getuid() || strstr(sr->groups[i]->key, "secret")) r->others_seen++;
  mok__reply__free_unpacked(rep, NULL);
  /* and mokctl, as this uid: text, JSON, metrics */
  size_t n = 0;
  const char *cmds[] = {"status", "status --json", "metrics"};
  for (int k = 0; k < 3; k++) {
    char cmd[512];
    snprintf(cmd, sizeof cmd, "%s/bin/mokctl --socket %s %s", harness_build_dir(), sock, cmds[k]);
    FILE *f = popen(cmd, "r");
    if (!f) return fail_step(r, 4, MOK_EIO);
    n += fread(r->text + n, 1, sizeof r->text - 1 - n, f);
    if (pclose(f) != 0) return fail_step(r, 5, MOK_EIO);
  }
  r->text[n] = '\0';
  mok_close(c);
}

static void check_private_view(const report *b, const report *a) {
  CHECK_MSG(b->step == 0, "step %d: %s", b->step, b->msg);
  CHECK_EQ_INT(b->own_only, 1);
  CHECK_EQ_INT(b->others_seen, 0);
  CHECK_EQ_INT(b->n_sessions, 1); /* its own, asking */
  CHECK_EQ_INT(b->n_groups, 0);
  CHECK_EQ_INT(b->status, 1); /* jobs_done: its own one job, not A's */
  char pid[32], json_pid[40];
  snprintf(pid, sizeof pid, " %d ", a->count);
  snprintf(json_pid, sizeof json_pid, "\"pid\": %d,", a->count);
  const char *leaks[] = {"secret-client-A", "secret-key-A", "4301", "53248", pid, json_pid};
  for (size_t i = 0; i < sizeof leaks / sizeof leaks[0]; i++)
    CHECK_MSG(!strstr(b->text, leaks[i]), "mokctl shows uid 4302 \"%s\":\n%s", leaks[i], b->text);
  CHECK_STR_CONTAINS(b->text, "uid 4302's sessions and groups only");
  CHECK_STR_CONTAINS(b->text, "\"own_uid_only\": true");
  CHECK_STR_CONTAINS(b->text, "mok_stats_scope_own_uid{uid=\"4302\"} 1");
}

static void check_full_view(const report *b) {
  CHECK_MSG(b->step == 0, "step %d: %s", b->step, b->msg);
  CHECK_EQ_INT(b->own_only, 0);
  CHECK(b->n_sessions == 2 && b->n_groups == 1 && b->others_seen == 2);
  CHECK_STR_CONTAINS(b->text, "secret-client-A");
  CHECK_STR_CONTAINS(b->text, "secret-key-A");
}

static void test_stats_show_a_tenant_only_itself(void) {
  if (!need_root()) return;
  char gdir[] = "/tmp/mok-test-tenant-groups-XXXXXX", conf[512];
  CHECK(mkdtemp(gdir) != NULL);
  snprintf(conf, sizeof conf, "group-dir = %s\n", gdir);
  daemon_proc d = start_shared(conf);
  report *a = &reports[0], *b = &reports[1];
  holder h = hold_as(UID_A, secret_tenant, d.sock, a);
  CHECK_MSG(a->step == 0, "step %d: %s", a->step, a->msg);
  CHECK(run_as(UID_B, GID_TENANT, look_at_stats, d.sock, b) == 0);
  check_private_view(b, a);
  /* root sees everyone */
  mok_client *c;
  CHECK(mok_connect(d.sock, "root", &c) == MOK_OK);
  Mok__Stats s = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &s;
  Mok__Reply *rep = NULL;
  CHECK(mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL) == MOK_OK);
  CHECK(!rep->stats->own_uid_only && rep->stats->n_sessions == 2 && rep->stats->n_groups == 1);
  CHECK(strcmp(rep->stats->groups[0]->key, "secret-key-A") == 0);
  mok__reply__free_unpacked(rep, NULL);
  mok_close(c);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);

  /* admin-uids and admin-gids (a supplementary group) see everyone */
  const char *admin[] = {"admin-uids = 4302\n", "admin-gids = 4311\n"};
  for (int k = 0; k < 2; k++) {
    snprintf(conf, sizeof conf, "group-dir = %s\n%s", gdir, admin[k]);
    d = start_shared(conf);
    h = hold_as(UID_A, secret_tenant, d.sock, a);
    CHECK(run_as(UID_B, GID_ADMIN, look_at_stats, d.sock, b) == 0);
    check_full_view(b);
    release(&h);
    CHECK_EQ_INT(harness_stop(&d), 0);
  }
  /* a gid that is not listed is no admin */
  snprintf(conf, sizeof conf, "group-dir = %s\nadmin-gids = 4399\nadmin-uids = 4399\n", gdir);
  d = start_shared(conf);
  h = hold_as(UID_A, secret_tenant, d.sock, a);
  CHECK(run_as(UID_B, GID_ADMIN, look_at_stats, d.sock, b) == 0);
  check_private_view(b, a);
  release(&h);
  CHECK_EQ_INT(harness_stop(&d), 0);
  remove_dir(gdir);
}

static const check_case cases[] = {
    CHECK_CASE(test_sessions_keep_a_reserve_for_other_uids),
    CHECK_CASE(test_sessions_per_uid),
    CHECK_CASE(test_regions_per_uid_and_in_all),
    CHECK_CASE(test_region_bytes_per_uid),
    CHECK_CASE(test_layers_per_uid),
    CHECK_CASE(test_jobs_in_flight_per_uid),
    CHECK_CASE(test_groups_per_uid_count_lingering_ones),
    CHECK_CASE(test_group_bytes_per_uid),
    CHECK_CASE(test_stats_show_a_tenant_only_itself),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  reports = mmap(NULL, 4 * sizeof *reports, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS,
                 -1, 0);
  if (reports == MAP_FAILED) return 1;
  return check_main(argc, argv, cases);
}
