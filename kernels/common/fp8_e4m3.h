/* SPDX-License-Identifier: Apache-2.0 */
/* FP8 E4M3 ("e4m3fn", OCP FP8) and its power-of-two block scales: the one
 * definition every engine uses (docs/math.md, "FP8 (e4m3, block-scaled)").
 *
 * Plain C11 and CUDA C++ alike: MOK_FP8_FN is `static inline` in C and
 * `__host__ __device__ __forceinline__` under nvcc. Everything is integer
 * arithmetic on the bits of an f32, so every engine gets the same bytes:
 *   - mok_fp8_encode: f32 -> byte, round to nearest, ties to even, finite
 *     values beyond +-448 (and +-inf) saturate to +-448, NaN -> S.1111.111,
 *     subnormals kept (smallest 2^-9): as PTX cvt.rn.satfinite.e4m3x2.f32;
 *   - mok_fp8_decode: byte -> f32 (exact);
 *   - mok_fp8_scale_exp: the block-scale exponent e of a block's amax, the
 *     smallest integer with amax * 2^-e <= 448, in [-126, 127], 0 for 0;
 *   - mok_fp8_pow2: 2^n as an f32, built from bits (no exp2f).
 */
#ifndef MOK_FP8_E4M3_H
#define MOK_FP8_E4M3_H

#include <stdint.h>

#ifdef __CUDACC__
#define MOK_FP8_FN __host__ __device__ __forceinline__
#else
#define MOK_FP8_FN static inline
#endif

#define MOK_FP8_BLOCK 128u         /* elements of a block along each blocked dimension */
#define MOK_FP8_MAX 448.0f         /* largest finite e4m3 value, S.1111.110 */
#define MOK_FP8_NAN 0x7fu          /* S.1111.111 (with the sign bit: 0xff) */
#define MOK_FP8_MAX_BITS 0x7eu     /* 448 */
#define MOK_FP8_SCALE_EXP_MIN (-126)
#define MOK_FP8_SCALE_EXP_MAX 127

/* An f32's bits and back, through a union: defined in C11, and supported
 * by gcc and nvcc in C++ (host and device) as the same reinterpretation. */
typedef union mok_fp8_f32_u {
  float f;
  uint32_t u;
} mok_fp8_f32_u;

MOK_FP8_FN uint32_t mok_fp8_f32_bits(float f) {
  mok_fp8_f32_u v;
  v.f = f;
  return v.u;
}

MOK_FP8_FN float mok_fp8_f32_of_bits(uint32_t u) {
  mok_fp8_f32_u v;
  v.u = u;
  return v.f;
}

/* 2^n for n in [-149, 127] (subnormal below -126), exactly. */
MOK_FP8_FN float mok_fp8_pow2(int n) {
  return n >= -126 ? mok_fp8_f32_of_bits((uint32_t)(n + 127) << 23)
                   : mok_fp8_f32_of_bits(1u << (n + 149));
}

MOK_FP8_FN uint8_t mok_fp8_encode(float f) {
  const uint32_t u = mok_fp8_f32_bits(f);
  const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | MOK_FP8_NAN);
  if (a >= 0x44000000u) return (uint8_t)(sign | MOK_FP8_MAX_BITS); /* >= 2^9, inf too */
  const int exp = (int)(a >> 23) - 127;
  if (exp >= -6) {
    /* normal e4m3: rebias the exponent to 7, round the 23 mantissa bits to 3
     * (a carry runs into the exponent, as it should) */
    const uint32_t t = ((uint32_t)(exp + 7) << 23) | (a & 0x7fffffu);
    const uint32_t r = (t + 0x7ffffu + ((t >> 20) & 1u)) >> 20;
    return (uint8_t)(sign | (r > MOK_FP8_MAX_BITS ? MOK_FP8_MAX_BITS : r));
  }
  /* below 2^-6: the subnormal steps of 2^-9, |f| * 2^9 rounded to an integer
   * (8 is the smallest normal, 0x08, as the byte reads); f32 subnormals are
   * below 2^-126 and round to 0 */
  if ((a >> 23) == 0u) return sign;
  const uint32_t sig = (a & 0x7fffffu) | 0x800000u; /* |f| = sig * 2^(exp-23) */
  const int shift = 14 - exp;                       /* sig * 2^(exp+9-23) */
  if (shift >= 32) return sign;
  const uint32_t q = sig >> shift, rem = sig & ((1u << shift) - 1u), half = 1u << (shift - 1);
  return (uint8_t)(sign | (q + (rem > half || (rem == half && (q & 1u)))));
}

MOK_FP8_FN float mok_fp8_decode(uint8_t b) {
  const uint32_t sign = (uint32_t)(b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15u && m == 7u) return mok_fp8_f32_of_bits(sign | 0x7fc00000u);
  if (e == 0u) /* m * 2^-9: exact in f32 */
    return mok_fp8_f32_of_bits(sign | mok_fp8_f32_bits((float)m * mok_fp8_pow2(-9)));
  return mok_fp8_f32_of_bits(sign | ((e - 7u + 127u) << 23) | (m << 20));
}

/* amax: a block's max of |x| (NaN elements left out, as fmaxf does); +inf
 * gives 127. For a normal amax = 1.f * 2^k: amax * 2^-e <= 448 = 1.75 * 2^8
 * holds from e = k - 8 when 1.f <= 1.75, from k - 7 above. An f32
 * subnormal amax needs e < -126: clamped. */
MOK_FP8_FN int mok_fp8_scale_exp(float amax) {
  const uint32_t a = mok_fp8_f32_bits(amax) & 0x7fffffffu;
  if (a == 0u) return 0;
  if (a >= 0x7f800000u) return MOK_FP8_SCALE_EXP_MAX; /* inf (NaN is never an amax) */
  if (a < 0x00800000u) return MOK_FP8_SCALE_EXP_MIN;
  const int k = (int)(a >> 23) - 127;
  const int e = k - 8 + ((a & 0x7fffffu) > 0x600000u ? 1 : 0);
  return e < MOK_FP8_SCALE_EXP_MIN ? MOK_FP8_SCALE_EXP_MIN
                                   : e > MOK_FP8_SCALE_EXP_MAX ? MOK_FP8_SCALE_EXP_MAX : e;
}

/* The quantised byte of x in a block of scale exponent e: e4m3(x * 2^-e),
 * the product one f32 rounding (exact unless far below e4m3's range). */
MOK_FP8_FN uint8_t mok_fp8_quantize(float x, int e) { return mok_fp8_encode(x * mok_fp8_pow2(-e)); }

#ifdef __CUDACC__
/* Two encodes at once by the hardware's cvt.rn.satfinite.e4m3x2.f32 (byte
 * 0: a, byte 1: b): the same bytes as mok_fp8_encode for every f32, NaN
 * aside (the hardware's NaN has no sign), so NaN keeps the software path.
 * tests/gpu/test_kernels holds the two equal over all 2^32 inputs. */
__device__ __forceinline__ uint16_t mok_fp8_encode2(float a, float b) {
  uint16_t r;
#ifdef __CUDA_ARCH__
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(b), "f"(a));
  if (__builtin_expect(a != a || b != b, 0))
#endif
    r = (uint16_t)(mok_fp8_encode(a) | (uint16_t)mok_fp8_encode(b) << 8);
  return r;
}

/* e4m3(a * 2^-e), e4m3(b * 2^-e): mok_fp8_quantize of each, two at once */
__device__ __forceinline__ uint16_t mok_fp8_quantize2(float a, float b, int e) {
  const float s = mok_fp8_pow2(-e);
  return mok_fp8_encode2(a * s, b * s);
}
#endif

#endif /* MOK_FP8_E4M3_H */
