#include "log.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

static _Atomic int current_level = MOK_LOG_INFO;

void mok_log_set_level(mok_log_level level) { atomic_store(&current_level, (int)level); }

int mok_log_parse_level(const char *s) {
  static const char *names[] = {"error", "warn", "info", "debug"};
  for (int i = 0; i < 4; i++)
    if (strcmp(s, names[i]) == 0) return i;
  return -1;
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
  fprintf(stderr, "<%d>mokd %s: %s\n", prio[level], tag[level], line);
}
