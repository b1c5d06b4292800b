/* SPDX-License-Identifier: Apache-2.0 */
/* Leveled logging. Under systemd (stderr is the journal stream that
 * JOURNAL_STREAM names) each line is a structured journal entry, stamped by
 * the journal; elsewhere a plain stderr line stamped in UTC:
 *   2026-12-01T13:55:02.123Z mokd[4242]: warn: the message
 * Library-style code returns statuses; only the daemon's edges log. */
#ifndef MOK_LOG_H
#define MOK_LOG_H

#include <stddef.h>
#include <time.h>

typedef enum mok_log_level {
  MOK_LOG_ERROR = 0,
  MOK_LOG_WARN = 1,
  MOK_LOG_INFO = 2,
  MOK_LOG_DEBUG = 3,
} mok_log_level;

void mok_log_set_level(mok_log_level level);
/* Parse "error", "warn", "info" or "debug"; returns -1 if unknown. */
int mok_log_parse_level(const char *s);
/* "2026-12-01T13:55:02.123Z" (ISO 8601, UTC, milliseconds) into buf of at
 * least MOK_LOG_STAMP_BYTES; returns its length (0, buf "", if it cannot). */
#define MOK_LOG_STAMP_BYTES 32
int mok_log_stamp(char *buf, size_t len, const struct timespec *when);

void mok_log(mok_log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_error(...) mok_log(MOK_LOG_ERROR, __VA_ARGS__)
#define log_warn(...) mok_log(MOK_LOG_WARN, __VA_ARGS__)
#define log_info(...) mok_log(MOK_LOG_INFO, __VA_ARGS__)
#define log_debug(...) mok_log(MOK_LOG_DEBUG, __VA_ARGS__)

#endif
