/* SPDX-License-Identifier: Apache-2.0 */
/* Host helpers the GPU tests share: bf16 <-> float (round to nearest even,
 * NaN kept quiet) and a seeded splitmix64 generator of test data. Each test
 * program gets its own copy of the state (static), so runs are repeatable. */
#ifndef MOK_TESTS_HOST_BF16_RNG_H
#define MOK_TESTS_HOST_BF16_RNG_H

#include <stdint.h>
#include <string.h>

static inline uint16_t host_f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline double host_bf2d(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static inline uint64_t rng_next(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/* uniform in [0, 1) */
static inline double rng_unit(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }

/* bf16 uniform in [-scale, scale], never zero */
static inline uint16_t rand_bf16(double scale) {
  for (;;) {
    uint16_t b = host_f2bf((float)((2.0 * rng_unit() - 1.0) * scale));
    if ((b & 0x7fff) != 0) return b;
  }
}

#endif
