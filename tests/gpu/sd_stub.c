/* SPDX-License-Identifier: Apache-2.0 */
/* No-op stand-ins for the libsystemd calls mokd makes, for builds that run
 * where libsystemd.so.0 is missing (the GPU test machine): link this object
 * with SD_LIBS=... instead of -lsystemd. Not for production builds. */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

int sd_notify(int unset_environment, const char *state);
int sd_notifyf(int unset_environment, const char *format, ...);
int sd_listen_fds(int unset_environment);
int sd_is_socket_unix(int fd, int type, int listening, const char *path, size_t length);
int sd_watchdog_enabled(int unset_environment, uint64_t *usec);
int sd_journal_send(const char *format, ...);

int sd_notify(int unset_environment, const char *state) { (void)unset_environment; (void)state; return 0; }
int sd_notifyf(int unset_environment, const char *format, ...) { (void)unset_environment; (void)format; return 0; }
int sd_listen_fds(int unset_environment) { (void)unset_environment; return 0; }
int sd_is_socket_unix(int fd, int type, int listening, const char *path, size_t length) {
  (void)fd; (void)type; (void)listening; (void)path; (void)length;
  return 0;
}
int sd_watchdog_enabled(int unset_environment, uint64_t *usec) { (void)unset_environment; if (usec) *usec = 0; return 0; }
int sd_journal_send(const char *format, ...) { (void)format; return 0; }
int sd_journal_send_with_location(const char *file, const char *line, const char *func,
                                  const char *format, ...);
int sd_journal_send_with_location(const char *file, const char *line, const char *func,
                                  const char *format, ...) {
  (void)file; (void)line; (void)func; (void)format;
  return 0;
}
