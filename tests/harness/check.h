/* SPDX-License-Identifier: Apache-2.0 */
/* A small test harness for mok's C tests.
 *
 * Each test is a function registered in a table; the runner runs each in a
 * forked child with a timeout (so a crash or hang fails only that test),
 * prints one TAP-like line per test, then "<binary>: N passed, N failed".
 * tests/run_tests.sh adds the counts of all binaries.
 *
 *   static void test_foo(void) { CHECK(1 + 1 == 2); CHECK_EQ_INT(f(), 3); }
 *   static const check_case cases[] = { CHECK_CASE(test_foo), {0} };
 *   int main(int argc, char **argv) { return check_main(argc, argv, cases); }
 *
 * A failed CHECK prints the expression, file and line, and ends the test.
 * Environment: CHECK_TIMEOUT (seconds per test, default 120),
 * CHECK_FILTER (run only tests whose name contains it).
 */
#ifndef MOK_TESTS_CHECK_H
#define MOK_TESTS_CHECK_H

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef struct check_case {
  const char *name;
  void (*fn)(void);
} check_case;

#define CHECK_CASE(fn) {#fn, fn}

#define CHECK_FAIL_(...)                                                       \
  do {                                                                         \
    fprintf(stderr, "  FAIL %s:%d: ", __FILE__, __LINE__);                     \
    fprintf(stderr, __VA_ARGS__);                                              \
    fprintf(stderr, "\n");                                                     \
    fflush(stderr);                                                            \
    _exit(1);                                                                  \
  } while (0)

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) CHECK_FAIL_("CHECK(%s)", #cond);                              \
  } while (0)

#define CHECK_MSG(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) CHECK_FAIL_(__VA_ARGS__);                                     \
  } while (0)

#define CHECK_EQ_INT(a, b)                                                     \
  do {                                                                         \
    long long check_a_ = (long long)(a), check_b_ = (long long)(b);            \
    if (check_a_ != check_b_)                                                  \
      CHECK_FAIL_("%s == %s: %lld != %lld", #a, #b, check_a_, check_b_);       \
  } while (0)

#define CHECK_STR_CONTAINS(hay, needle)                                        \
  do {                                                                         \
    const char *check_h_ = (hay), *check_n_ = (needle);                        \
    if (!check_h_ || !strstr(check_h_, check_n_))                              \
      CHECK_FAIL_("\"%s\" does not contain \"%s\"", check_h_ ? check_h_ : "(null)", check_n_); \
  } while (0)

static inline int check_main(int argc, char **argv, const check_case *cases) {
  const char *filter = getenv("CHECK_FILTER");
  const char *tenv = getenv("CHECK_TIMEOUT");
  int timeout = tenv ? atoi(tenv) : 120;
  int passed = 0, failed = 0;
  const char *prog = strrchr(argv[0], '/') ? strrchr(argv[0], '/') + 1 : argv[0];
  (void)argc;
  for (const check_case *c = cases; c->name; c++) {
    if (filter && !strstr(c->name, filter)) continue;
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "fork: %s\n", strerror(errno));
      return 2;
    }
    if (pid == 0) {
      alarm((unsigned)timeout);
      c->fn();
      fflush(stdout);
      _exit(0);
    }
    int st = 0;
    while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(st) && WEXITSTATUS(st) == 0) {
      printf("ok - %s\n", c->name);
      passed++;
    } else if (WIFSIGNALED(st)) {
      printf("not ok - %s (signal %d%s)\n", c->name, WTERMSIG(st),
             WTERMSIG(st) == SIGALRM ? ": timed out" : "");
      failed++;
    } else {
      printf("not ok - %s\n", c->name);
      failed++;
    }
    fflush(stdout);
  }
  printf("%s: %d passed, %d failed\n", prog, passed, failed);
  return failed ? 1 : 0;
}

#endif /* MOK_TESTS_CHECK_H */
