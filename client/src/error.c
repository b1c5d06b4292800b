/* SPDX-License-Identifier: Apache-2.0 */
#include <stdarg.h>
#include <stdio.h>

#include "internal.h"

/* holds a failed job's whole message (MOK_JOB_MESSAGE_MAX) with room to spare */
static _Thread_local char last_error[1024];

const char *mok_last_error(void) { return last_error; }

const char *mok_version(void) { return MOK_VERSION; }

int mok_set_error(int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return status;
}

const char *mok_status_name(int status) {
  switch (status) {
#define STATUS_CASE_(name, value, desc) case value: return #name;
    MOK_STATUS_MAP(STATUS_CASE_)
#undef STATUS_CASE_
  default: return "UNKNOWN";
  }
}
