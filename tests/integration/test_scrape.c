/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: mokd's /metrics endpoint (docs/metrics.md) scraped over TCP
 * and its Unix socket while a client runs jobs (one of them failing), and
 * hostile scrapers: oversized and malformed requests, other methods, a
 * slowloris, a flood of connections, a non-admin on the Unix socket, a
 * non-loopback address without leave. The loop must keep serving the
 * control plane and other scrapers throughout, with bounded fds and memory.
 */
#include <arpa/inet.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>

#include "harness/check.h"
#include "harness/daemon.h"
#include "mok.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- an HTTP client, as small as can be -------------------------------------- */

static int free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  CHECK(bind(fd, (struct sockaddr *)&a, sizeof a) == 0);
  socklen_t len = sizeof a;
  CHECK(getsockname(fd, (struct sockaddr *)&a, &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

static void set_timeout(int fd, int ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static int tcp_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  CHECK_MSG(connect(fd, (struct sockaddr *)&a, sizeof a) == 0, "connect: %s", strerror(errno));
  set_timeout(fd, 5000);
  return fd;
}

static int unix_connect(const char *path) {
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
    close(fd);
    return -1;
  }
  set_timeout(fd, 5000);
  return fd;
}

/* Send req (n bytes), read to EOF into resp. Returns the status, 0 when the
 * connection closed with no response, -1 on a timeout. */
static int exchange(int fd, const char *req, size_t n, char *resp, size_t cap) {
  size_t off = 0;
  while (off < n) {
    ssize_t w = send(fd, req + off, n - off, MSG_NOSIGNAL);
    if (w <= 0) break; /* the server may close before taking it all */
    off += (size_t)w;
  }
  size_t got = 0;
  for (;;) {
    ssize_t r = recv(fd, resp + got, cap - 1 - got, 0);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      close(fd);
      return -1;
    }
    if (r <= 0) break; /* EOF (or a reset after the response) */
    got += (size_t)r;
    CHECK_MSG(got < cap - 1, "response larger than %zu bytes", cap);
  }
  close(fd);
  resp[got] = '\0';
  int status = 0;
  if (got) CHECK_MSG(sscanf(resp, "HTTP/1.1 %d ", &status) == 1, "not a response: %.80s", resp);
  return status;
}

static char page_buf[1 << 20];

/* GET /metrics; returns the body (page_buf) after checking 200 and the type. */
static const char *scrape_fd(int fd) {
  const char *req = "GET /metrics HTTP/1.1\r\nHost: test\r\nUser-Agent: test_scrape\r\n\r\n";
  int st = exchange(fd, req, strlen(req), page_buf, sizeof page_buf);
  CHECK_MSG(st == 200, "scrape: status %d: %.200s", st, page_buf);
  CHECK_STR_CONTAINS(page_buf, "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n");
  const char *body = strstr(page_buf, "\r\n\r\n");
  CHECK(body != NULL);
  size_t clen = 0;
  const char *cl = strstr(page_buf, "Content-Length: ");
  CHECK(cl && sscanf(cl, "Content-Length: %zu", &clen) == 1);
  CHECK_EQ_INT(strlen(body + 4), clen);
  return body + 4;
}

static const char *scrape(int port) { return scrape_fd(tcp_connect(port)); }

static double sample(const char *page, const char *series) {
  size_t n = strlen(series);
  for (const char *l = page; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
    if (strncmp(l, series, n) == 0 && l[n] == ' ') return strtod(l + n + 1, NULL);
  return NAN;
}

#define CHECK_SAMPLE(page, series, want)                                                   \
  do {                                                                                     \
    double v_ = sample(page, series);                                                      \
    CHECK_MSG(v_ == (double)(want), "%s is %g, expected %g", series, v_, (double)(want)); \
  } while (0)

/* mokd with the endpoint on a free loopback port (another process may take
 * the port between our look and mokd's bind: then try another). */
static daemon_proc start_metrics(const char *extra, int *port) {
  for (int attempt = 0; attempt < 10; attempt++) {
    *port = free_port();
    char cfg[2048];
    snprintf(cfg, sizeof cfg, "metrics-listen = 127.0.0.1:%d\n%s", *port, extra ? extra : "");
    daemon_proc d = harness_try_start(cfg);
    if (d.pid > 0) return d;
    CHECK_MSG(strstr(harness_log(&d), "cannot listen there"), "mokd did not start: %s",
              harness_log(&d));
  }
  CHECK_MSG(0, "no free port for the metrics endpoint");
  return (daemon_proc){0};
}

/* ---- a client's jobs -------------------------------------------------------------- */

#define H 32u
#define I 16u
#define E 6u
#define K 2u
#define T 16u

typedef struct job_bufs {
  float *x, *rw, *wg, *wu, *wd, *out;
  int32_t *ids;
  void *ctx;
  size_t bytes; /* all registered (whole pages) */
} job_bufs;

static void *alloc_in(mok_client *c, size_t bytes, job_bufs *b) {
  void *p = mok_host_alloc(c, bytes);
  CHECK_MSG(p != NULL, "mok_host_alloc: %s", mok_last_error());
  size_t page = (size_t)sysconf(_SC_PAGESIZE); /* what mok_host_alloc registers */
  b->bytes += (bytes + page - 1) / page * page;
  return p;
}

static void bufs_init(mok_client *c, job_bufs *b, uint32_t experts) {
  memset(b, 0, sizeof *b);
  b->x = alloc_in(c, 4ull * T * H, b);
  b->ids = alloc_in(c, 4ull * T * K, b);
  b->rw = alloc_in(c, 4ull * T * K, b);
  b->wg = alloc_in(c, 4ull * experts * I * H, b);
  b->wu = alloc_in(c, 4ull * experts * I * H, b);
  b->wd = alloc_in(c, 4ull * experts * H * I, b);
  b->out = alloc_in(c, 4ull * T * H, b);
  for (uint32_t i = 0; i < T * H; i++) b->x[i] = (float)(i % 7) * 0.1f;
  for (uint32_t i = 0; i < experts * I * H; i++) b->wg[i] = b->wu[i] = b->wd[i] = 0.01f;
  for (uint32_t t = 0; t < T; t++) {
    b->ids[t * K] = (int32_t)(t % E);
    b->ids[t * K + 1] = (int32_t)((t + 1) % E);
    b->rw[t * K] = 0.6f, b->rw[t * K + 1] = 0.4f;
  }
}

static int forward(mok_client *c, mok_layer *l, job_bufs *b) {
  mok_forward_args fa = {.x = b->x, .w_gate = b->wg, .w_up = b->wu, .w_down = b->wd,
                         .topk_ids = b->ids, .router_weights = b->rw, .out = b->out};
  uint64_t t;
  CHECK_MSG(mok_forward(l, T, &fa, &t) == MOK_OK, "%s", mok_last_error());
  return mok_wait(c, t, 10000);
}

/* The float32 layers here run on the cpu engine (the cuda engine runs bf16
 * layers only); the HTTP tests use nops and run on either. */
static bool cpu_engine_only(void) {
  if (!harness_engine_is_cuda()) return true;
  printf("# skipped: float32 layers (cpu engine)\n");
  return false;
}

/* ---- tests -------------------------------------------------------------------------- */

static void test_a_scrape_counts_what_the_client_did(void) {
  if (!cpu_engine_only()) return;
  char dir[] = "/tmp/mok-scrape-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  char msock[128], extra[512];
  snprintf(msock, sizeof msock, "%s/metrics.sock", dir);
  snprintf(extra, sizeof extra, "metrics-socket = %s\nmetrics-per-uid = yes\nmax-layers = 1\n",
           msock);
  int port;
  daemon_proc d = start_metrics(extra, &port);
  /* before any client: zeros, every family there */
  const char *p = scrape(port);
  CHECK_SAMPLE(p, "mokd_sessions", 0);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"forward\"}", 0);
  CHECK_SAMPLE(p, "mokd_metrics_per_uid", 1);
  CHECK_STR_CONTAINS(p, "# TYPE mokd_job_duration_seconds histogram\n");

  mok_client *c;
  CHECK(mok_connect(d.sock, "scrape-test", &c) == MOK_OK);
  job_bufs b;
  bufs_init(c, &b, E);
  mok_layer_desc desc = {.hidden = H, .intermediate = I, .experts = E, .topk = K,
                         .max_tokens = T, .dtype = MOK_DTYPE_F32};
  mok_layer *l, *l2;
  CHECK_MSG(mok_layer_create(c, &desc, &l) == MOK_OK, "%s", mok_last_error());
  CHECK_EQ_INT(mok_layer_create(c, &desc, &l2), MOK_ELIMIT); /* max-layers = 1 */
  for (int i = 0; i < 3; i++) CHECK_MSG(forward(c, l, &b) == MOK_OK, "%s", mok_last_error());
  b.ids[3] = (int32_t)E; /* an expert that does not exist */
  CHECK_EQ_INT(forward(c, l, &b), MOK_EROUTE);
  b.ids[3] = 1;
  for (int i = 0; i < 5; i++) {
    uint64_t t;
    CHECK(mok_submit_nop(c, &t) == MOK_OK);
    CHECK(mok_wait(c, t, 10000) == MOK_OK);
  }

  p = scrape(port);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"forward\"}", 3);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"nop\"}", 5);
  CHECK_SAMPLE(p, "mokd_jobs_failed_total{op=\"forward\",status=\"EROUTE\"}", 1);
  CHECK_SAMPLE(p, "mokd_job_duration_seconds_count{op=\"forward\"}", 4);
  CHECK_SAMPLE(p, "mokd_job_duration_seconds_bucket{op=\"forward\",le=\"+Inf\"}", 4);
  CHECK_SAMPLE(p, "mokd_job_duration_seconds_count{op=\"nop\"}", 5);
  CHECK(sample(p, "mokd_job_duration_seconds_sum{op=\"forward\"}") > 0);
  CHECK_SAMPLE(p, "mokd_sessions", 1);
  CHECK_SAMPLE(p, "mokd_sessions_opened_total", 1);
  CHECK_SAMPLE(p, "mokd_connections", 1);
  CHECK_SAMPLE(p, "mokd_regions", 7);
  CHECK_SAMPLE(p, "mokd_region_bytes", b.bytes);
  CHECK_SAMPLE(p, "mokd_regions_registered_total", 7);
  CHECK_SAMPLE(p, "mokd_region_bytes_registered_total", b.bytes);
  CHECK_SAMPLE(p, "mokd_layers", 1);
  CHECK_SAMPLE(p, "mokd_layers_created_total", 1);
  CHECK_SAMPLE(p, "mokd_jobs_in_flight", 0);
  CHECK_SAMPLE(p, "mokd_refusals_total{reason=\"max-layers\"}", 1);
  CHECK_SAMPLE(p, "mokd_refusals_total{reason=\"max-regions\"}", 0);
  CHECK(sample(p, "mokd_uptime_seconds") > 0);
  CHECK_STR_CONTAINS(p, "mokd_build_info{version=\"");
  /* by tenant: this uid and client name */
  char series[160];
  snprintf(series, sizeof series, "mokd_tenant_jobs_completed_total{uid=\"%u\",client=\"scrape-test\"}",
           (unsigned)getuid());
  CHECK_SAMPLE(p, series, 8);
  snprintf(series, sizeof series, "mokd_tenant_jobs_failed_total{uid=\"%u\",client=\"scrape-test\"}",
           (unsigned)getuid());
  CHECK_SAMPLE(p, series, 1);
  snprintf(series, sizeof series, "mokd_tenant_region_bytes{uid=\"%u\",client=\"scrape-test\"}",
           (unsigned)getuid());
  CHECK_SAMPLE(p, series, b.bytes);
  CHECK(strstr(p, "session=") == NULL); /* never a session id */
  /* the daemon's own Stats agree */
  mok_daemon_stats st;
  CHECK(mok_stats(c, &st) == MOK_OK);
  CHECK_EQ_INT(st.jobs_done, 8);
  CHECK_EQ_INT(st.jobs_failed, 1);
  /* the Unix socket serves the same page to an admin (root, or mokd's uid: us) */
  int fd = unix_connect(msock);
  CHECK(fd >= 0);
  p = scrape_fd(fd);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"forward\"}", 3);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"200\"}", 2); /* the two scrapes before */

  mok_layer_destroy(l);
  mok_close(c);
  /* the session's gauges go back once it is gone; counters stay */
  for (int i = 0; i < 200; i++) {
    p = scrape(port);
    if (sample(p, "mokd_sessions") == 0) break;
    usleep(10000);
  }
  CHECK_SAMPLE(p, "mokd_sessions", 0);
  CHECK_SAMPLE(p, "mokd_regions", 0);
  CHECK_SAMPLE(p, "mokd_layers", 0);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"forward\"}", 3);
  CHECK_SAMPLE(p, "mokd_region_bytes_registered_total", b.bytes);
  CHECK_EQ_INT(harness_stop(&d), 0);
  struct stat sst;
  CHECK_MSG(stat(msock, &sst) < 0 && errno == ENOENT, "the metrics socket was left behind");
  rmdir(dir);
}

static void test_no_uid_or_client_labels_unless_per_uid(void) {
  int port;
  daemon_proc d = start_metrics(NULL, &port);
  mok_client *c;
  CHECK(mok_connect(d.sock, "private-name", &c) == MOK_OK);
  uint64_t t;
  CHECK(mok_submit_nop(c, &t) == MOK_OK && mok_wait(c, t, 10000) == MOK_OK);
  const char *p = scrape(port);
  CHECK_SAMPLE(p, "mokd_metrics_per_uid", 0);
  CHECK_SAMPLE(p, "mokd_jobs_completed_total{op=\"nop\"}", 1);
  CHECK(strstr(p, "private-name") == NULL);
  CHECK(strstr(p, "uid=") == NULL && strstr(p, "client=") == NULL);
  CHECK(strstr(p, "mokd_tenant_") == NULL);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* One request on a fresh connection: the status, and how long it took. */
static int ask(int port, const char *req, size_t n, double *took) {
  static char resp[1 << 16];
  double t0 = now_s();
  int st = exchange(tcp_connect(port), req, n, resp, sizeof resp);
  if (took) *took = now_s() - t0;
  return st;
}

static void test_bad_requests_get_their_status_and_close(void) {
  int port;
  daemon_proc d = start_metrics("metrics-timeout-ms = 3000\n", &port);
  struct { const char *req; int status; } cases[] = {
      {"POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi", 405},
      {"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405},
      {"GET /nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404},
      {"GET / HTTP/1.0\r\n\r\n", 404},
      {"GET /metrics HTTP/2.0\r\n\r\n", 505},
      {"GET /metrics HTTP/1.1\r\n\r\n", 400}, /* no Host */
      {"GET /metrics HTTP/1.1\nHost: x\n\n", 400},
      {"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03", 400}, /* TLS */
      {"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400},
      {"garbage garbage garbage\r\n", 400},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    double took;
    size_t n = i == 7 ? 11 : strlen(cases[i].req);
    int st = ask(port, cases[i].req, n, &took);
    CHECK_MSG(st == cases[i].status, "case %zu: %d, expected %d", i, st, cases[i].status);
    CHECK_MSG(took < 1.0, "case %zu took %.2f s (judged at once, not at the timeout)", i, took);
  }
  /* oversized: a 64 KiB header is refused after 4 KiB */
  size_t big = 64 << 10;
  char *req = malloc(big);
  int n = snprintf(req, big, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: ");
  memset(req + n, 'a', big - (size_t)n);
  double took;
  CHECK_EQ_INT(ask(port, req, big, &took), 413);
  CHECK(took < 2.0);
  /* a long target */
  memset(req, 'a', 2000);
  memcpy(req, "GET /", 5);
  CHECK_EQ_INT(ask(port, req, 2000, NULL), 414);
  free(req);
  /* the endpoint counted each */
  const char *p = scrape(port);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"400\"}", 5);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"404\"}", 2);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"405\"}", 2);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"413\"}", 1);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"414\"}", 1);
  CHECK_SAMPLE(p, "mokd_http_responses_total{code=\"505\"}", 1);
  /* a 405 says what is allowed */
  static char resp[4096];
  const char *post = "POST /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  CHECK_EQ_INT(exchange(tcp_connect(port), post, strlen(post), resp, sizeof resp), 405);
  CHECK_STR_CONTAINS(resp, "Allow: GET\r\n");
  CHECK_STR_CONTAINS(resp, "Connection: close\r\n");
  CHECK(harness_alive(&d));
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_a_slowloris_is_closed_and_stalls_nobody(void) {
  int port;
  daemon_proc d = start_metrics("metrics-timeout-ms = 1000\n", &port);
  mok_client *c;
  CHECK(mok_connect(d.sock, "beside", &c) == MOK_OK);
  int slow = tcp_connect(port);
  const char *start = "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: ";
  CHECK(send(slow, start, strlen(start), MSG_NOSIGNAL) == (ssize_t)strlen(start));
  double t0 = now_s(), closed_at = 0;
  bool others_checked = false;
  char buf[4096];
  while (now_s() - t0 < 5.0) {
    /* one byte every 50 ms: never a whole request */
    if (send(slow, "a", 1, MSG_NOSIGNAL) != 1) {
      closed_at = now_s() - t0;
      break;
    }
    struct pollfd pf = {.fd = slow, .events = POLLIN};
    if (poll(&pf, 1, 50) == 1) {
      ssize_t r = recv(slow, buf, sizeof buf - 1, 0);
      if (r > 0) {
        buf[r] = '\0';
        CHECK_STR_CONTAINS(buf, "HTTP/1.1 408 ");
        while (recv(slow, buf, sizeof buf, 0) > 0) {}
      }
      closed_at = now_s() - t0;
      break;
    }
    if (!others_checked && now_s() - t0 > 0.3) {
      /* meanwhile: another scrape and the control plane are served at once */
      double s0 = now_s();
      const char *p = scrape(port);
      CHECK(sample(p, "mokd_http_connections") >= 2);
      uint64_t t;
      CHECK(mok_submit_nop(c, &t) == MOK_OK && mok_wait(c, t, 2000) == MOK_OK);
      CHECK_MSG(now_s() - s0 < 0.5, "served in %.2f s beside the slowloris", now_s() - s0);
      others_checked = true;
    }
  }
  close(slow);
  CHECK(others_checked);
  CHECK_MSG(closed_at > 0.8 && closed_at < 2.5, "the slow connection closed after %.2f s "
            "(metrics-timeout-ms 1000)", closed_at);
  /* one that sends nothing at all: a 408 and EOF at the timeout */
  int idle = tcp_connect(port);
  t0 = now_s();
  ssize_t r = recv(idle, buf, sizeof buf - 1, 0);
  CHECK(r > 0);
  buf[r] = '\0';
  CHECK_STR_CONTAINS(buf, "HTTP/1.1 408 ");
  while ((r = recv(idle, buf, sizeof buf, 0)) > 0) {}
  CHECK_EQ_INT(r, 0);
  CHECK_MSG(now_s() - t0 > 0.8 && now_s() - t0 < 2.5, "closed after %.2f s", now_s() - t0);
  close(idle);
  /* one that sends its request but never reads nor closes: dropped at the timeout */
  int deaf = tcp_connect(port);
  const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
  CHECK(send(deaf, req, strlen(req), MSG_NOSIGNAL) == (ssize_t)strlen(req));
  usleep(300000);
  const char *p = scrape(port);
  CHECK_SAMPLE(p, "mokd_http_connections", 2);
  usleep(1200000);
  p = scrape(port);
  CHECK_SAMPLE(p, "mokd_http_connections", 1);
  close(deaf);
  CHECK(sample(p, "mokd_http_timeouts_total") >= 3);
  CHECK(sample(p, "mokd_http_responses_total{code=\"408\"}") >= 2);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_a_flood_of_connections_is_bounded(void) {
  int port;
  daemon_proc d = start_metrics("metrics-timeout-ms = 4000\nmetrics-max-connections = 4\n", &port);
  mok_client *c;
  CHECK(mok_connect(d.sock, "beside", &c) == MOK_OK);
  /* the baseline after a first scrape and job: the engine's first stats and
   * job allocate once (the cuda engine's driver state: ~15 MiB), which is not
   * what the flood below is about */
  uint64_t t_warm;
  CHECK(mok_submit_nop(c, &t_warm) == MOK_OK && mok_wait(c, t_warm, 2000) == MOK_OK);
  CHECK(scrape(port) != NULL);
  int base_fds = harness_fd_count(d.pid);
  long base_rss = harness_rss_kib(d.pid);
  enum { FLOOD = 100 };
  int fds[FLOOD];
  for (int i = 0; i < FLOOD; i++) fds[i] = tcp_connect(port);
  usleep(200000);
  /* mokd holds at most the cap (and closed the rest at once) */
  int held = harness_fd_count(d.pid) - base_fds;
  CHECK_MSG(held <= 4, "mokd holds %d more fds with %d connections open", held, FLOOD);
  /* the rest were closed at once (well before the 4 s timeout) */
  int closed = 0;
  bool done[FLOOD] = {false};
  for (double t_end = now_s() + 2.0; closed < FLOOD - 4 && now_s() < t_end; usleep(10000))
    for (int i = 0; i < FLOOD; i++) {
      struct pollfd pf = {.fd = fds[i], .events = POLLIN};
      char b;
      if (!done[i] && poll(&pf, 1, 0) == 1 && recv(fds[i], &b, 1, MSG_DONTWAIT) <= 0)
        done[i] = true, closed++;
    }
  CHECK_MSG(closed >= FLOOD - 4, "only %d of %d connections over the cap were closed", closed,
            FLOOD);
  /* the control plane does not notice */
  double t0 = now_s();
  uint64_t t;
  CHECK(mok_submit_nop(c, &t) == MOK_OK && mok_wait(c, t, 2000) == MOK_OK);
  CHECK(now_s() - t0 < 0.5);
  for (int i = 0; i < FLOOD; i++) close(fds[i]);
  /* many short hostile connections: fds and memory come back */
  for (int i = 0; i < 300; i++) {
    char junk[64];
    for (size_t k = 0; k < sizeof junk; k++) junk[k] = (char)(i * 31 + k * 7);
    junk[sizeof junk - 1] = '\n'; /* a verdict comes by the last byte at the latest */
    static char resp[4096];
    int st = exchange(tcp_connect(port), junk, sizeof junk, resp, sizeof resp);
    CHECK_MSG(st == 400 || st == 0 || st == 405 || st == 414, "junk %d: status %d", i, st);
  }
  const char *p = NULL;
  for (int i = 0; i < 100; i++) { /* the flood's idle connections close when the peer does */
    p = scrape(port);
    if (sample(p, "mokd_http_connections") == 1) break;
    usleep(20000);
  }
  CHECK_SAMPLE(p, "mokd_http_connections", 1);
  CHECK(sample(p, "mokd_http_refused_connections_total") >= FLOOD - 4);
  int fds_after = harness_wait_fds(d.pid, base_fds, 2000);
  CHECK_MSG(fds_after <= base_fds, "fds %d after the flood, %d before", fds_after, base_fds);
  long grown = harness_rss_kib(d.pid) - base_rss;
  CHECK_MSG(grown < harness_rss_slack_kib(), "RSS grew %ld KiB", grown);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_the_unix_socket_serves_admins_only(void) {
  if (geteuid() != 0) {
    printf("# skipped: needs root to scrape as another uid\n");
    return;
  }
  char dir[] = "/tmp/mok-scrape-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  CHECK(chmod(dir, 0755) == 0);
  char msock[128], extra[512];
  snprintf(msock, sizeof msock, "%s/metrics.sock", dir);
  snprintf(extra, sizeof extra, "metrics-socket = %s\nmetrics-socket-mode = 0666\nadmin-uids = 4243\n",
           msock);
  daemon_proc d = harness_start(extra);
  struct stat st;
  CHECK(stat(msock, &st) == 0 && S_ISSOCK(st.st_mode) && (st.st_mode & 0777) == 0666);
  int want[] = {403, 200}; /* uid 4242: a tenant; uid 4243: in admin-uids */
  for (int k = 0; k < 2; k++) {
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
      uid_t uid = (uid_t)(4242 + k);
      if (setresgid(uid, uid, uid) < 0 || setresuid(uid, uid, uid) < 0) _exit(100);
      int fd = unix_connect(msock);
      if (fd < 0) _exit(101);
      static char resp[1 << 20];
      const char *req = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
      int s = exchange(fd, req, strlen(req), resp, sizeof resp);
      if (s == 403 && !strstr(resp, "admin-uids")) _exit(102);
      _exit(s == want[k] ? 0 : s > 0 && s < 100 ? s : 103);
    }
    int wst;
    CHECK(waitpid(pid, &wst, 0) == pid);
    CHECK_MSG(WIFEXITED(wst) && WEXITSTATUS(wst) == 0, "uid %d: exit %d, wanted status %d",
              4242 + k, WEXITSTATUS(wst), want[k]);
  }
  CHECK_EQ_INT(harness_stop(&d), 0);
  rmdir(dir);
}

static void test_the_endpoint_is_refused_where_it_should_not_be(void) {
  /* not a loopback address: refused at start, saying why */
  daemon_proc d = harness_try_start("metrics-listen = 0.0.0.0:9\n");
  CHECK_EQ_INT(d.pid, 0);
  CHECK_STR_CONTAINS(harness_log(&d), "not a loopback address");
  CHECK_STR_CONTAINS(harness_log(&d), "metrics-allow-nonlocal");
  /* with leave it starts (port from the kernel's free ones: any will do) */
  int port = free_port();
  char cfg[256];
  snprintf(cfg, sizeof cfg, "metrics-listen = 0.0.0.0:%d\nmetrics-allow-nonlocal = yes\n", port);
  d = harness_try_start(cfg);
  if (d.pid > 0) {
    const char *p = scrape(port);
    CHECK_SAMPLE(p, "mokd_sessions", 0);
    CHECK_EQ_INT(harness_stop(&d), 0);
  }
  /* a bad address is a configuration error */
  d = harness_try_start("metrics-listen = localhost:9464\n");
  CHECK_EQ_INT(d.pid, 0);
  CHECK_STR_CONTAINS(harness_log(&d), "numeric ADDRESS:PORT");
  /* a metrics-socket path that is not a socket is never replaced */
  char path[] = "/tmp/mok-scrape-file-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  close(fd);
  snprintf(cfg, sizeof cfg, "metrics-socket = %s\n", path);
  d = harness_try_start(cfg);
  CHECK_EQ_INT(d.pid, 0);
  CHECK_STR_CONTAINS(harness_log(&d), "is not a socket");
  struct stat st;
  CHECK(stat(path, &st) == 0 && S_ISREG(st.st_mode));
  unlink(path);
}

/* Rank 0 of a world-2 group runs a forward alone: the barrier times out,
 * the group breaks, and the health series say which rank was missing. */
static void test_group_timeouts_and_missing_ranks(void) {
  if (!cpu_engine_only()) return; /* and the host barriers */
  int port;
  daemon_proc d = start_metrics(NULL, &port);
  mok_client *c;
  CHECK(mok_connect(d.sock, "ep-alone", &c) == MOK_OK);
  char key[64];
  snprintf(key, sizeof key, "scrape-%d-%ld", (int)getpid(), (long)time(NULL));
  mok_group_sizing sz = {.max_tokens = T, .hidden = H, .topk = K, .experts = E + 2,
                         .dtype = MOK_DTYPE_F32, .timeout_ms = 300};
  mok_group *g;
  CHECK_MSG(mok_group_join(c, key, 0, 2, &sz, &g) == MOK_OK, "%s", mok_last_error());
  mok_layer_desc desc = {.hidden = H, .intermediate = I, .experts = E + 2, .topk = K,
                         .max_tokens = T, .dtype = MOK_DTYPE_F32, .group = g};
  mok_layer *l;
  CHECK_MSG(mok_layer_create(c, &desc, &l) == MOK_OK, "%s", mok_last_error());
  job_bufs b;
  bufs_init(c, &b, (E + 2) / 2);
  CHECK_EQ_INT(forward(c, l, &b), MOK_ETIMEOUT);
  CHECK_STR_CONTAINS(mok_last_error(), "did not arrive");
  const char *p = scrape(port);
  char gid[32] = "";
  const char *info = strstr(p, "mokd_group_info{group=\"");
  CHECK_MSG(info && sscanf(info, "mokd_group_info{group=\"%31[0-9]\"", gid) == 1, "%s", p);
  char s[160];
  snprintf(s, sizeof s, "mokd_group_info{group=\"%s\",rank=\"0\",world=\"2\",transport=\"host\"}", gid);
  CHECK_SAMPLE(p, s, 1);
  snprintf(s, sizeof s, "mokd_group_timeouts_total{group=\"%s\"}", gid);
  CHECK_SAMPLE(p, s, 1);
  snprintf(s, sizeof s, "mokd_group_rank_missed_total{group=\"%s\",rank=\"1\"}", gid);
  CHECK_SAMPLE(p, s, 1);
  snprintf(s, sizeof s, "mokd_group_broken{group=\"%s\"}", gid);
  CHECK_SAMPLE(p, s, 1);
  CHECK_SAMPLE(p, "mokd_groups{state=\"broken\"}", 1);
  CHECK_SAMPLE(p, "mokd_groups{state=\"held\"}", 1);
  CHECK_SAMPLE(p, "mokd_jobs_failed_total{op=\"forward\",status=\"ETIMEOUT\"}", 1);
  CHECK(strstr(p, key) == NULL); /* the group's key is the tenant's */
  mok_layer_destroy(l);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {CHECK_CASE(test_a_scrape_counts_what_the_client_did),
                                   CHECK_CASE(test_no_uid_or_client_labels_unless_per_uid),
                                   CHECK_CASE(test_bad_requests_get_their_status_and_close),
                                   CHECK_CASE(test_a_slowloris_is_closed_and_stalls_nobody),
                                   CHECK_CASE(test_a_flood_of_connections_is_bounded),
                                   CHECK_CASE(test_the_unix_socket_serves_admins_only),
                                   CHECK_CASE(test_the_endpoint_is_refused_where_it_should_not_be),
                                   CHECK_CASE(test_group_timeouts_and_missing_ranks),
                                   {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
