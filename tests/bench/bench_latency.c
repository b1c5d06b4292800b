/* SPDX-License-Identifier: Apache-2.0 */
/* Round-trip latency of an empty job through the rings, and the rate of
 * empty jobs with the ring kept full. Starts its own mokd (cpu engine)
 * unless MOK_SOCKET names a running one.
 *
 *   build/bench/bench_latency [jobs]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mok.h"

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static pid_t start_mokd(const char *sock) {
  const char *b = getenv("MOK_BUILD");
  char bin[256];
  snprintf(bin, sizeof bin, "%s/bin/mokd", b && *b ? b : "build");
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    execl(bin, "mokd", "--socket", sock, "--engine", "cpu", "--log-level", "warn", (char *)NULL);
    perror("exec mokd");
    _exit(127);
  }
  return pid;
}

int main(int argc, char **argv) {
  int n = argc > 1 ? atoi(argv[1]) : 20000;
  if (n < 100) n = 100;
  const char *sock = getenv("MOK_SOCKET");
  char own[64] = "";
  pid_t pid = 0;
  if (!sock || !*sock) {
    snprintf(own, sizeof own, "/tmp/mok-bench-%d.sock", (int)getpid());
    pid = start_mokd(own);
    sock = own;
  }
  mok_client *c = NULL;
  for (int i = 0; i < 200 && mok_connect(sock, "bench_latency", &c) != MOK_OK; i++) usleep(10000);
  if (!c) {
    fprintf(stderr, "bench_latency: %s\n", mok_last_error());
    return 1;
  }
  uint64_t *lat = malloc(sizeof *lat * (size_t)n);
  for (int i = 0; i < 1000; i++) { /* warm up */
    uint64_t t;
    if (mok_submit_nop(c, &t) != MOK_OK || mok_wait(c, t, 5000) != MOK_OK) return 1;
  }
  for (int i = 0; i < n; i++) {
    uint64_t t, t0 = now_ns();
    if (mok_submit_nop(c, &t) != MOK_OK || mok_wait(c, t, 5000) != MOK_OK) {
      fprintf(stderr, "bench_latency: %s\n", mok_last_error());
      return 1;
    }
    lat[i] = now_ns() - t0;
  }
  qsort(lat, (size_t)n, sizeof *lat, cmp_u64);
  /* pipelined: keep 32 jobs in flight */
  enum { DEPTH = 32 };
  uint64_t tk[DEPTH];
  uint64_t t0 = now_ns();
  for (int i = 0; i < DEPTH; i++) mok_submit_nop(c, &tk[i]);
  for (int i = DEPTH; i < n; i++) {
    if (mok_wait(c, tk[i % DEPTH], 5000) != MOK_OK) return 1;
    mok_submit_nop(c, &tk[i % DEPTH]);
  }
  for (int i = 0; i < DEPTH; i++) mok_wait(c, tk[(n + i) % DEPTH], 5000);
  double rate = (double)n / ((double)(now_ns() - t0) / 1e9);
  printf("empty job round trip through the rings (%d jobs, engine %s):\n", n, mok_client_engine(c));
  printf("  median %.2f us   p99 %.2f us   p99.9 %.2f us   min %.2f us\n", lat[n / 2] / 1e3,
         lat[(size_t)n * 99 / 100] / 1e3, lat[(size_t)n * 999 / 1000] / 1e3, lat[0] / 1e3);
  printf("  pipelined (%d in flight): %.0f jobs/s\n", DEPTH, rate);
  mok_close(c);
  if (pid) {
    kill(pid, SIGTERM);
    waitpid(pid, NULL, 0);
  }
  free(lat);
  return 0;
}
