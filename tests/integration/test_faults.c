/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: clients dying at any moment cost the daemon nothing.
 *
 * Clients are SIGKILLed at random moments (mid-registration, mid-job, with
 * jobs queued, before Hello, between Hello and the first request) many
 * times; afterwards the daemon's open fds and mappings are back at their
 * baseline and its RSS within a small margin, and a new client is served.
 *
 * Job deadlines: the cpu engine runs each job synchronously to completion
 * in time bounded by the layer limits, so a job-timeout would only be a
 * post-hoc label there; deadlines matter for the cuda engine's GPU waits
 * (its fence timeout) and are tested on the device (tests/gpu).
 */
#include "harness/daemon.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

static unsigned rng(unsigned *s) {
  *s ^= *s << 13, *s ^= *s >> 17, *s ^= *s << 5;
  return *s;
}

/* A client that works until it is killed: registers buffers one by one,
 * creates layers, queues forwards and waits for some. */
static void doomed_client(const char *sock, unsigned seed) {
  unsigned s = seed;
  mok_client *c;
  if (mok_connect(sock, "doomed", &c) != MOK_OK) _exit(2);
  mok_layer_desc d = {.hidden = 32, .intermediate = 16, .experts = 6, .topk = 2,
                      .max_tokens = 64, .dtype = rng(&s) % 2 ? MOK_DTYPE_BF16 : MOK_DTYPE_F32};
  mok_layer *l;
  if (mok_layer_create(c, &d, &l) != MOK_OK) _exit(3);
  void *p[MOK_SLOT_COUNT_] = {0};
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    if (mok_job_slot_need(&l->cfg, MOK_OP_FORWARD, 0, slot) != MOK_NEED_REQUIRED) continue;
    uint32_t dt, nd;
    uint64_t shape[MOK_MAX_DIMS], b;
    mok_job_slot_shape(&l->cfg, 64, slot, &dt, &nd, shape);
    b = mok_dtype_size(dt);
    for (uint32_t i = 0; i < nd; i++) b *= shape[i];
    if (!(p[slot] = mok_host_alloc(c, b))) _exit(4);
    memset(p[slot], 0, b); /* routing ids 0: valid */
  }
  for (;;) {
    mok_tensor t[MOK_SLOT_COUNT_];
    memset(t, 0, sizeof t);
    for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
      if (p[slot]) t[slot] = mok_tensor_for(l, 64, slot, p[slot]);
    uint64_t tk[32];
    int n = 1 + (int)(rng(&s) % 32);
    for (int i = 0; i < n; i++)
      if (mok_submit(l, MOK_OP_FORWARD, 0, 64, t, &tk[i]) != MOK_OK) n = i;
    void *extra = mok_host_alloc(c, 4096u << (rng(&s) % 6));
    mok_layer *l2;
    if (mok_layer_create(c, &d, &l2) == MOK_OK) mok_layer_destroy(l2);
    if (extra) mok_host_free(c, extra);
    for (int i = 0; i < n; i++) (void)mok_wait(c, tk[i], 1000);
  }
}

/* A raw peer that dies before or right after Hello. */
static void half_open_client(const char *sock, int hello) {
  int fd = harness_raw_connect(sock);
  if (hello) {
    Mok__Hello h = MOK__HELLO__INIT;
    h.protocol_version = MOK_PROTOCOL_VERSION;
    Mok__Request req = MOK__REQUEST__INIT;
    req.body_case = MOK__REQUEST__BODY_HELLO;
    req.hello = &h;
    uint8_t buf[256];
    size_t n = mok__request__pack(&req, buf);
    (void)mok_frame_send(fd, 1, buf, n, NULL, 0);
  }
  pause();
}

static void test_random_kills_leave_no_fds_or_memory_behind(void) {
  daemon_proc d = harness_start(NULL);
  /* baseline after one client came and went (allocator pools warmed) */
  pid_t w = fork();
  if (w == 0) doomed_client(d.sock, 1);
  usleep(50000);
  kill(w, SIGKILL);
  int st;
  waitpid(w, &st, 0);
  usleep(200000);
  int base_fds = harness_fd_count(d.pid), base_maps = harness_map_count(d.pid);
  long base_rss = harness_rss_kib(d.pid);
  unsigned s = 4242;
  enum { ROUNDS = 150, BATCH = 4 };
  int kinds[3] = {0};
  for (int round = 0; round < ROUNDS; round++) {
    pid_t kids[BATCH];
    for (int k = 0; k < BATCH; k++) {
      int kind = (int)(rng(&s) % 8); /* mostly working clients */
      kinds[kind < 6 ? 0 : kind - 5]++;
      kids[k] = fork();
      CHECK(kids[k] >= 0);
      if (kids[k] == 0) {
        if (kind < 6) doomed_client(d.sock, 100u + (unsigned)(round * BATCH + k));
        half_open_client(d.sock, kind == 7);
      }
    }
    usleep(rng(&s) % 30000); /* a random moment: connecting, registering, mid-job */
    for (int k = 0; k < BATCH; k++) kill(kids[k], SIGKILL);
    for (int k = 0; k < BATCH; k++) waitpid(kids[k], &st, 0);
  }
  CHECK(harness_alive(&d));
  int fds = harness_wait_fds(d.pid, base_fds, 5000);
  usleep(100000);
  int maps = harness_map_count(d.pid);
  long rss = harness_rss_kib(d.pid);
  printf("# %d clients killed (%d working, %d before Hello, %d after Hello); daemon fds %d -> "
         "%d, memfd mappings %d -> %d, RSS %ld -> %ld KiB\n", ROUNDS * BATCH, kinds[0], kinds[1],
         kinds[2], base_fds, fds, base_maps, maps, base_rss, rss);
  CHECK_EQ_INT(fds, base_fds);
  CHECK_EQ_INT(maps, base_maps);
  CHECK_MSG(rss <= base_rss + harness_rss_slack_kib(), "RSS %ld KiB, baseline %ld KiB", rss,
            base_rss);
  mok_client *c;
  CHECK(mok_connect(d.sock, "survivor", &c) == MOK_OK);
  mok_daemon_stats stats;
  CHECK(mok_stats(c, &stats) == MOK_OK);
  CHECK_EQ_INT(stats.sessions_now, 1);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* Regression (LeakSanitizer, 13b3bd4): SIGTERM while sessions are closing
 * with their detach still queued freed them never. Under ASan a leak makes
 * mokd exit non-zero. */
static void test_sigterm_while_sessions_close(void) {
  for (int round = 0; round < 20; round++) {
    daemon_proc d = harness_start(NULL);
    int fds[8];
    for (int i = 0; i < 8; i++) {
      fds[i] = harness_raw_connect(d.sock);
      Mok__Hello h = MOK__HELLO__INIT;
      h.protocol_version = MOK_PROTOCOL_VERSION;
      Mok__Request req = MOK__REQUEST__INIT;
      req.body_case = MOK__REQUEST__BODY_HELLO;
      req.hello = &h;
      uint8_t buf[256];
      size_t n = mok__request__pack(&req, buf);
      CHECK_EQ_INT(mok_frame_send(fds[i], 1, buf, n, NULL, 0), 0);
      char msg[256];
      CHECK_EQ_INT(harness_read_reply(fds[i], msg, sizeof msg), MOK_OK);
      CHECK_EQ_INT(mok_frame_send(fds[i], 2, buf, n, NULL, 0), 0); /* Hello twice */
    }
    /* the EPROTO reply comes once the session is closing, its detach queued */
    char msg[256];
    CHECK_EQ_INT(harness_read_reply(fds[7], msg, sizeof msg), MOK_EPROTO);
    CHECK_EQ_INT(harness_stop(&d), 0);
    for (int i = 0; i < 8; i++) close(fds[i]);
  }
}

static const check_case cases[] = {
    CHECK_CASE(test_random_kills_leave_no_fds_or_memory_behind),
    CHECK_CASE(test_sigterm_while_sessions_close),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
