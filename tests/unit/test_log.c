/* SPDX-License-Identifier: Apache-2.0 */
/* mokd's log lines: UTC timestamps on plain stderr, none for the journal. */
#include <regex.h>
#include <sys/stat.h>
#include <time.h>

#include "harness/check.h"
#include "log.h"

static void test_stamp_is_iso8601_utc_with_milliseconds(void) {
  char buf[MOK_LOG_STAMP_BYTES];
  struct timespec t = {.tv_sec = 1796133302, .tv_nsec = 123456789}; /* 2026-12-01 13:55:02 UTC */
  CHECK_EQ_INT(mok_log_stamp(buf, sizeof buf, &t), 24);
  CHECK_MSG(strcmp(buf, "2026-12-01T13:55:02.123Z") == 0, "got %s", buf);
  t.tv_nsec = 999999999; /* cut, never rounded into the next second */
  mok_log_stamp(buf, sizeof buf, &t);
  CHECK_MSG(strcmp(buf, "2026-12-01T13:55:02.999Z") == 0, "got %s", buf);
  t = (struct timespec){.tv_sec = 0, .tv_nsec = 7000000};
  mok_log_stamp(buf, sizeof buf, &t);
  CHECK_MSG(strcmp(buf, "1970-01-01T00:00:00.007Z") == 0, "got %s", buf);
  char small[8] = "x";
  CHECK_EQ_INT(mok_log_stamp(small, sizeof small, &t), 0);
  CHECK_EQ_INT(small[0], '\0');
}

/* Point fd 2 at a fresh file; returns its fd (for reading back).
 * restore_stderr() before any CHECK, so that failures are seen. */
static int saved_stderr = -1;
static int capture_stderr(void) {
  char path[] = "/tmp/mok-test-log-XXXXXX";
  int fd = mkstemp(path);
  CHECK(fd >= 0);
  unlink(path);
  saved_stderr = dup(2);
  CHECK(saved_stderr >= 0 && dup2(fd, 2) == 2);
  return fd;
}
static void restore_stderr(void) { CHECK(dup2(saved_stderr, 2) == 2); }

static void read_back(int fd, char *buf, size_t len) {
  ssize_t n = pread(fd, buf, len - 1, 0);
  CHECK(n >= 0);
  buf[n] = '\0';
}

static time_t realtime_seconds(void) {
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  return now.tv_sec;
}

static void test_plain_stderr_lines_carry_a_utc_stamp_and_the_pid(void) {
  unsetenv("JOURNAL_STREAM");
  int fd = capture_stderr();
  mok_log_set_level(MOK_LOG_INFO);
  /* the logger's clock: time() reads a coarser one that can still be in
   * the last second when the line's stamp is in the next */
  time_t before = realtime_seconds();
  log_warn("disk %d is %s", 7, "slow");
  log_debug("not shown at info");
  time_t after = realtime_seconds();
  restore_stderr();
  char text[512];
  read_back(fd, text, sizeof text);
  char want[128];
  snprintf(want, sizeof want,
           "^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\\.[0-9]{3}Z mokd\\[%ld\\]: "
           "warn: disk 7 is slow\n$",
           (long)getpid());
  regex_t re;
  CHECK(regcomp(&re, want, REG_EXTENDED | REG_NOSUB) == 0);
  CHECK_MSG(regexec(&re, text, 0, NULL, 0) == 0, "line \"%s\" is not %s", text, want);
  regfree(&re);
  /* the stamp is now, in UTC */
  struct tm tm = {0};
  CHECK(strptime(text, "%Y-%m-%dT%H:%M:%S", &tm) != NULL);
  time_t stamped = timegm(&tm);
  CHECK_MSG(stamped >= before && stamped <= after, "stamped %lld, logged in [%lld, %lld]",
            (long long)stamped, (long long)before, (long long)after);
}

static void test_journal_stream_lines_carry_no_stamp(void) {
  int fd = capture_stderr();
  struct stat st;
  int fst = fstat(2, &st);
  if (fst != 0) restore_stderr();
  CHECK(fst == 0);
  char js[64];
  snprintf(js, sizeof js, "%llu:%llu", (unsigned long long)st.st_dev,
           (unsigned long long)st.st_ino);
  setenv("JOURNAL_STREAM", js, 1); /* stderr is "the journal stream" */
  mok_log_set_level(MOK_LOG_INFO);
  log_error("engine %s failed", "cuda");
  restore_stderr();
  char text[512];
  read_back(fd, text, sizeof text);
  /* a structured entry went to journald (nothing on the stream), or, with
   * no journald to take it, the stream has the line with its priority and
   * no time (the journal stamps it) */
  CHECK_MSG(text[0] == '\0' || strcmp(text, "<3>error: engine cuda failed\n") == 0,
            "journal stream got \"%s\"", text);
}

static const check_case cases[] = {
    CHECK_CASE(test_stamp_is_iso8601_utc_with_milliseconds),
    CHECK_CASE(test_plain_stderr_lines_carry_a_utc_stamp_and_the_pid),
    CHECK_CASE(test_journal_stream_lines_carry_no_stamp),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
