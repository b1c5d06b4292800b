/* SPDX-License-Identifier: Apache-2.0 */
/* bf16 <-> f32 conversion helpers (bf16 is the top half of an IEEE f32).
 *
 * f32 -> bf16 rounds to nearest, ties to even; a NaN stays a NaN (made
 * quiet, sign kept) instead of rounding into an infinity. Overflowing finite
 * values round to +-Inf as IEEE rounding requires. */
#ifndef MOK_BF16_H
#define MOK_BF16_H

#include <stdint.h>
#include <string.h>

typedef uint16_t mok_bf16;

static inline uint32_t mok_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float mok_f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline float mok_bf16_to_f32(mok_bf16 b) { return mok_f32_from_bits((uint32_t)b << 16); }

static inline mok_bf16 mok_f32_to_bf16(float f) {
  uint32_t u = mok_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) /* NaN: keep sign and top payload, set quiet bit */
    return (mok_bf16)((u >> 16) | 0x0040u);
  uint32_t round = 0x7fffu + ((u >> 16) & 1u); /* ties go to the even result */
  return (mok_bf16)((u + round) >> 16);
}

/* Round an f32 to the nearest bf16 value, kept as f32. */
static inline float mok_round_bf16(float f) { return mok_bf16_to_f32(mok_f32_to_bf16(f)); }

#endif /* MOK_BF16_H */
