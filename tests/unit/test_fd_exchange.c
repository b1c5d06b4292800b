/* SPDX-License-Identifier: Apache-2.0 */
/* fd_exchange: a group member's buffer fd reaches a peer of the same uid
 * that names the right server pid, and nobody else. */
#include <pwd.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "ep/fd_exchange.h"
#include "mok_status.h"

static int make_memfd(const char *text) {
  int fd = memfd_create("fdx-test", MFD_CLOEXEC);
  CHECK(fd >= 0);
  CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
  return fd;
}

static void unique_name(char *buf, size_t n) {
  uint64_t serial = ((uint64_t)getpid() << 32) ^ (uint64_t)time(NULL) ^ (uint64_t)rand();
  mok_fdx_name(buf, n, geteuid(), 3, serial | 1);
}

static void test_fetch_gets_the_same_file(void) {
  char name[MOK_FDX_NAME_MAX], err[160];
  unique_name(name, sizeof name);
  CHECK(strstr(name, "mok-ep/") == name);
  int fd = make_memfd("buffer of rank 3");
  mok_fdx_server *s;
  CHECK_EQ_INT(mok_fdx_serve(name, fd, 12345, &s, err, sizeof err), MOK_OK);
  for (int i = 0; i < 3; i++) { /* served again and again */
    int got = -1;
    uint64_t payload = 0;
    CHECK_EQ_INT(mok_fdx_fetch(name, getpid(), 1000, &got, &payload, err, sizeof err), MOK_OK);
    CHECK(got >= 0 && got != fd);
    CHECK(payload == 12345);
    char buf[32] = {0};
    CHECK(pread(got, buf, sizeof buf - 1, 0) == 16);
    CHECK(strcmp(buf, "buffer of rank 3") == 0);
    close(got);
  }
  /* a second server cannot take the same name */
  mok_fdx_server *s2;
  CHECK(mok_fdx_serve(name, fd, 1, &s2, err, sizeof err) != MOK_OK);
  CHECK(strstr(err, "bind") != NULL);
  mok_fdx_stop(s);
  close(fd);
}

static void test_wrong_server_pid_is_refused(void) {
  char name[MOK_FDX_NAME_MAX], err[160];
  unique_name(name, sizeof name);
  int fd = make_memfd("x");
  mok_fdx_server *s;
  CHECK_EQ_INT(mok_fdx_serve(name, fd, 1, &s, err, sizeof err), MOK_OK);
  int got = -1;
  uint64_t payload = 0;
  CHECK_EQ_INT(mok_fdx_fetch(name, getpid() + 1, 1000, &got, &payload, err, sizeof err),
               MOK_EACCES);
  CHECK(got == -1);
  CHECK(strstr(err, "not served by mokd pid") != NULL);
  mok_fdx_stop(s);
  close(fd);
}

static void test_missing_server_times_out(void) {
  char name[MOK_FDX_NAME_MAX], err[160];
  unique_name(name, sizeof name);
  int got = -1;
  uint64_t payload = 0;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  CHECK_EQ_INT(mok_fdx_fetch(name, getpid(), 200, &got, &payload, err, sizeof err), MOK_ETIMEOUT);
  clock_gettime(CLOCK_MONOTONIC, &b);
  double s = (double)(b.tv_sec - a.tv_sec) + 1e-9 * (double)(b.tv_nsec - a.tv_nsec);
  CHECK_MSG(s >= 0.19 && s < 2.0, "waited %.3f s for a 200 ms timeout", s);
  CHECK(got == -1);
}

/* A client of another uid gets no fd (only when we can become another uid). */
static void test_other_uid_gets_nothing(void) {
  if (geteuid() != 0) {
    printf("# not root: the other-uid case needs setuid; skipped\n");
    return;
  }
  struct passwd *pw = getpwnam("nobody");
  if (!pw) {
    printf("# no user nobody: skipped\n");
    return;
  }
  char name[MOK_FDX_NAME_MAX], err[160];
  unique_name(name, sizeof name);
  int fd = make_memfd("secret");
  mok_fdx_server *s;
  CHECK_EQ_INT(mok_fdx_serve(name, fd, 1, &s, err, sizeof err), MOK_OK);
  pid_t server = getpid();
  pid_t pid = fork();
  CHECK(pid >= 0);
  if (pid == 0) {
    if (setgid(pw->pw_gid) != 0 || setuid(pw->pw_uid) != 0) _exit(2);
    int got = -1;
    uint64_t payload = 0;
    /* the server's uid is not ours: refused on this side already */
    int r = mok_fdx_fetch(name, server, 500, &got, &payload, err, sizeof err);
    _exit(r != MOK_OK && got == -1 ? 0 : 1);
  }
  int st;
  CHECK(waitpid(pid, &st, 0) == pid);
  CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "a client of another uid got the fd");
  mok_fdx_stop(s);
  close(fd);
}

static const check_case cases[] = {
    {"test_fetch_gets_the_same_file", test_fetch_gets_the_same_file},
    {"test_wrong_server_pid_is_refused", test_wrong_server_pid_is_refused},
    {"test_missing_server_times_out", test_missing_server_times_out},
    {"test_other_uid_gets_nothing", test_other_uid_gets_nothing},
    {NULL, NULL},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
