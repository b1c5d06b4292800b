/* SPDX-License-Identifier: Apache-2.0 */
#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-journal.h>

static _Atomic int current_level = MOK_LOG_INFO;

void mok_log_set_level(mok_log_level level) { atomic_store(&current_level, (int)level); }

int mok_log_parse_level(const char *s) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
}

/* Under systemd, stderr is connected to the journal: JOURNAL_STREAM names
 * its device and inode. Then we send structured entries instead of text. */
static int stderr_is_journal(void) {
  static int cached = -1;
  if (cached >= 0) return cached;
  cached = 0;
  const char *js = getenv("JOURNAL_STREAM");
  unsigned long long dev, ino;
  struct stat st;
  if (js && sscanf(js, "%llu:%llu", &dev, &ino) == 2 && fstat(2, &st) == 0 &&
      (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino)
    cached = 1;
  return cached;
}

int mok_log_stamp(char *buf, size_t len, const struct timespec *when) {
  struct tm tm;
  time_t sec = when->tv_sec;
  if (len < MOK_LOG_STAMP_BYTES || !gmtime_r(&sec, &tm)) {
    if (len) buf[0] = '\0';
    return 0;
  }
  size_t n = strftime(buf, len, "%Y-%m-%dT%H:%M:%S", &tm);
  int m = snprintf(buf + n, len - n, ".%03ldZ", (long)(when->tv_nsec / 1000000) % 1000);
  return m < 0 ? 0 : (int)n + m;
}

void mok_log(mok_log_level level, const char *fmt, ...) {
  /* syslog-style priority prefix: journald reads it, a terminal still reads fine */
  static const int prio[] = {3, 4, 6, 7};
  static const char *tag[] = {"error", "warn", "info", "debug"};
  if ((int)level > atomic_load(&current_level)) return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  /* one write per line so lines from the loop and engine threads never interleave */
  if (stderr_is_journal()) {
    /* the journal stamps its entries itself: no time here */
    if (sd_journal_send("MESSAGE=%s", line, "PRIORITY=%d", prio[level],
                        "SYSLOG_IDENTIFIER=mokd", "MOK_LEVEL=%s", tag[level], NULL) < 0)
      fprintf(stderr, "<%d>%s: %s\n", prio[level], tag[level], line); /* journald is away */
    return;
  }
  struct timespec now;
  char stamp[MOK_LOG_STAMP_BYTES];
  clock_gettime(CLOCK_REALTIME, &now);
  mok_log_stamp(stamp, sizeof stamp, &now);
  fprintf(stderr, "%s mokd[%ld]: %s: %s\n", stamp, (long)getpid(), tag[level], line);
}
