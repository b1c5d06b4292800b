#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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
  if (stderr_is_journal()) {
    sd_journal_send("MESSAGE=%s", line, "PRIORITY=%d", prio[level], "SYSLOG_IDENTIFIER=mokd",
                    "MOK_LEVEL=%s", tag[level], NULL);
    return;
  }
  /* one write per line so lines from the loop and engine threads never interleave */
  fprintf(stderr, "mokd %s: %s\n", tag[level], line);
}
