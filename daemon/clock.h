/* SPDX-License-Identifier: Apache-2.0 */
/* The daemon's one clock: CLOCK_MONOTONIC, in ns and in ms (deadlines,
 * timeouts, latencies; never the wall clock, which can jump). */
#ifndef MOK_CLOCK_H
#define MOK_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t mok_clock_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t mok_clock_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#endif
