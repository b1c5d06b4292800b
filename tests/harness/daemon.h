/* SPDX-License-Identifier: Apache-2.0 */
/* Shared helpers for integration tests that run a real mokd: start one on a
 * private socket with extra configuration, stop it, talk raw frames to it,
 * and measure what it holds (open fds, resident memory) from /proc. */
#ifndef MOK_TESTS_HARNESS_H
#define MOK_TESTS_HARNESS_H

#include <dirent.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>

#include "check.h"
#include "frame.h"
#include "mok.pb-c.h"

typedef struct daemon_proc {
  pid_t pid;
  char dir[64];
  char sock[100];
  char log[100]; /* the daemon's stderr */
} daemon_proc;

static inline const char *harness_build_dir(void) {
  const char *b = getenv("MOK_BUILD");
  return b && *b ? b : "build";
}

static inline int harness_can_connect(const char *path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  int ok = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

/* The engine the daemons run: cpu, or $MOK_TEST_ENGINE (the GPU machine
 * runs some integration tests on the cuda engine). */
static inline const char *harness_engine(void) {
  const char *e = getenv("MOK_TEST_ENGINE");
  return e && *e ? e : "cpu";
}

static inline bool harness_engine_is_cuda(void) { return strcmp(harness_engine(), "cuda") == 0; }

/* Start mokd with extra config lines; its stderr goes to d.log. Returns
 * once it accepts connections, or with pid 0 when it exited first (a
 * configuration it refused). */
static inline daemon_proc harness_try_start(const char *config_text) {
  daemon_proc d;
  memset(&d, 0, sizeof d);
  snprintf(d.dir, sizeof d.dir, "/tmp/mok-test-XXXXXX");
  CHECK(mkdtemp(d.dir) != NULL);
  snprintf(d.sock, sizeof d.sock, "%s/mokd.sock", d.dir);
  snprintf(d.log, sizeof d.log, "%s/mokd.log", d.dir);
  char cfg[128], bin[256];
  snprintf(cfg, sizeof cfg, "%s/mokd.conf", d.dir);
  FILE *f = fopen(cfg, "w");
  CHECK(f != NULL);
  /* MOK_TEST_LOG_LEVEL: the daemons' log level (default warn), to debug a test */
  const char *level = getenv("MOK_TEST_LOG_LEVEL");
  fprintf(f, "threads = 2\nlog-level = %s\n%s", level && *level ? level : "warn",
          config_text ? config_text : "");
  fclose(f);
  snprintf(bin, sizeof bin, "%s/bin/mokd", harness_build_dir());
  d.pid = fork();
  CHECK(d.pid >= 0);
  if (d.pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive a failed test */
    int lfd = open(d.log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (lfd >= 0) dup2(lfd, 2);
    execl(bin, "mokd", "--socket", d.sock, "--engine", harness_engine(), "--config", cfg,
          (char *)NULL);
    perror("exec mokd");
    _exit(127);
  }
  for (int i = 0; i < 1000 && !harness_can_connect(d.sock); i++) {
    int st;
    if (waitpid(d.pid, &st, WNOHANG) == d.pid) {
      d.pid = 0;
      return d;
    }
    usleep(10000);
  }
  CHECK_MSG(harness_can_connect(d.sock), "mokd did not start serving %s", d.sock);
  return d;
}

static inline daemon_proc harness_start(const char *config_text) {
  daemon_proc d = harness_try_start(config_text);
  CHECK_MSG(d.pid > 0, "mokd exited at start-up");
  return d;
}

/* SIGTERM; returns the exit status (or 128+signal). */
static inline int harness_stop(daemon_proc *d) {
  kill(d->pid, SIGTERM);
  int st = 0;
  waitpid(d->pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static inline int harness_alive(const daemon_proc *d) {
  int st;
  return waitpid(d->pid, &st, WNOHANG) == 0;
}

/* The daemon's log so far (static buffer). */
static inline const char *harness_log(const daemon_proc *d) {
  static char buf[1 << 16];
  FILE *f = fopen(d->log, "r");
  size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
  if (f) fclose(f);
  buf[n] = '\0';
  return buf;
}

/* Open fds of a process (entries of /proc/<pid>/fd). */
static inline int harness_fd_count(pid_t pid) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  DIR *dir = opendir(path);
  if (!dir) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(dir);
  return n;
}

/* A "Name: N kB" line of /proc/<pid>/status, in KiB (-1: none). */
static inline long harness_status_kib(pid_t pid, const char *name) {
  char path[64], line[256], want[64];
  snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
  snprintf(want, sizeof want, "%s: %%ld kB", name);
  FILE *f = fopen(path, "r");
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, want, &kib) == 1) break;
  if (f) fclose(f);
  return kib;
}

/* Resident memory in KiB (VmRSS). */
static inline long harness_rss_kib(pid_t pid) { return harness_status_kib(pid, "VmRSS"); }

/* Shared-memory mappings (memfds: session rings, client buffers) of a
 * process. Counted instead of all mappings, which the sanitizers' own
 * allocators change as they please. */
static inline int harness_map_count(pid_t pid) {
  char path[64], line[512];
  snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
  FILE *f = fopen(path, "r");
  int n = 0;
  while (f && fgets(line, sizeof line, f)) n += strstr(line, "/memfd:") != NULL;
  if (f) fclose(f);
  return n;
}

/* How far RSS may end above its baseline (KiB): MOK_RSS_SLACK_KIB, default
 * 8 MiB (sanitizer builds keep freed memory in quarantine: more there). */
static inline long harness_rss_slack_kib(void) {
  const char *v = getenv("MOK_RSS_SLACK_KIB");
  return v && *v ? atol(v) : 8192;
}

/* ---- raw protocol ---- */

static inline int harness_raw_connect(const char *path) {
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  struct sockaddr_un a = {.sun_family = AF_UNIX};
  snprintf(a.sun_path, sizeof a.sun_path, "%s", path);
  CHECK(connect(fd, (struct sockaddr *)&a, sizeof a) == 0);
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  return fd;
}

/* Read one reply: status and message; closes fds it carried. */
static inline int harness_read_reply(int fd, char *msg, size_t msglen) {
  static uint8_t buf[MOK_FRAME_MAX + 1];
  mok_frame f;
  int r = mok_frame_recv(fd, buf, sizeof buf, MOK_FRAME_MAX, 0, &f);
  CHECK_MSG(r == 0, "no reply frame (recv %d)", r);
  mok_frame_close_fds(&f);
  Mok__Reply *rep = mok__reply__unpack(NULL, f.len, f.payload);
  CHECK(rep != NULL);
  int st = rep->status;
  snprintf(msg, msglen, "%s", rep->message);
  mok__reply__free_unpacked(rep, NULL);
  return st;
}

/* Wait until the daemon's fd count drops to want (sessions are released
 * once the engine thread has detached them). Returns the last count. */
static inline int harness_wait_fds(pid_t pid, int want, int timeout_ms) {
  int n = harness_fd_count(pid);
  for (int waited = 0; n > want && waited < timeout_ms; waited += 10) {
    usleep(10000);
    n = harness_fd_count(pid);
  }
  return n;
}

#endif /* MOK_TESTS_HARNESS_H */
