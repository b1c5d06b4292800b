/* SPDX-License-Identifier: Apache-2.0 */
/* kernels/common/fp8_e4m3.h against the format's definition, built here
 * independently in double: every byte's value from sign, exponent (bias 7)
 * and mantissa; encoding as "the nearest value, ties to the even code, then
 * saturate" by search over that table; the block-scale exponent as "the
 * smallest e with amax * 2^-e <= 448" by stepping e. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/fp8_e4m3.h"
#include "harness/check.h"

/* The value of byte b by the definition (NaN for S.1111.111). */
static double def_value(unsigned b) {
  unsigned s = b >> 7, e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15 && m == 7) return NAN;
  double v = e == 0 ? ldexp((double)m / 8.0, -6) : ldexp(1.0 + (double)m / 8.0, (int)e - 7);
  return s ? -v : v;
}

/* Encoding by the definition: the nearest of the magnitudes of codes
 * 0..0x7f (0x7f taken as 480, the next step up, so that rounding sees it),
 * ties to the even code, then saturation to 448; NaN to 0x7f. */
static unsigned def_encode(float f) {
  if (isnan(f)) return signbit(f) ? 0xffu : 0x7fu;
  unsigned sign = signbit(f) ? 0x80u : 0u;
  double a = fabs((double)f), best_d = INFINITY;
  unsigned best = 0;
  for (unsigned c = 0; c <= 0x7f; c++) {
    double v = c == 0x7f ? 480.0 : def_value(c);
    double d = fabs(a - v);
    if (d < best_d || (d == best_d && (c & 1u) == 0)) best_d = d, best = c;
  }
  if (best > 0x7e) best = 0x7e;
  return sign | best;
}

static float bits_f(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint32_t f_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static void check_encode(float f) {
  unsigned want = def_encode(f), got = mok_fp8_encode(f);
  CHECK_MSG(got == want, "encode(%a) (bits 0x%08x) = 0x%02x, the definition gives 0x%02x",
            (double)f, f_bits(f), got, want);
}

static void test_every_byte_decodes_to_its_defined_value(void) {
  for (unsigned b = 0; b < 256; b++) {
    double want = def_value(b);
    float got = mok_fp8_decode((uint8_t)b);
    if (isnan(want)) {
      CHECK_MSG(isnan(got) && !signbit(got) == !(b & 0x80u), "byte 0x%02x must decode to NaN", b);
      continue;
    }
    CHECK_MSG((double)got == want && !signbit(got) == !(b & 0x80u),
              "byte 0x%02x decodes to %a, defined %a", b, (double)got, want);
  }
  CHECK(mok_fp8_decode(0x7e) == 448.0f && mok_fp8_decode(0xfe) == -448.0f);
  CHECK(mok_fp8_decode(0x01) == 0x1p-9f && mok_fp8_decode(0x08) == 0x1p-6f);
}

static void test_encode_of_decode_is_the_byte(void) {
  for (unsigned b = 0; b < 256; b++) {
    if ((b & 0x7fu) == 0x7fu) continue;
    CHECK_EQ_INT(mok_fp8_encode(mok_fp8_decode((uint8_t)b)), b);
  }
}

/* Midpoints between neighbours (exact in f32: five significant bits) go to
 * the even code; one f32 step either side goes to the nearer. */
static void test_ties_and_midpoints(void) {
  for (unsigned c = 0; c < 0x7e; c++) {
    for (int neg = 0; neg < 2; neg++) {
      float lo = mok_fp8_decode((uint8_t)c), hi = mok_fp8_decode((uint8_t)(c + 1));
      float mid = (float)(((double)lo + (double)hi) / 2.0);
      CHECK((double)mid == ((double)lo + (double)hi) / 2.0);
      if (neg) mid = -mid;
      unsigned s = neg ? 0x80u : 0u;
      CHECK_EQ_INT(mok_fp8_encode(mid), s | ((c & 1u) ? c + 1 : c));
      CHECK_EQ_INT(mok_fp8_encode(nextafterf(mid, 0.0f)), s | c);
      CHECK_EQ_INT(mok_fp8_encode(nextafterf(mid, neg ? -INFINITY : INFINITY)), s | (c + 1));
      check_encode(mid);
    }
  }
}

/* [448, 464] and past it: every f32 there saturates to +-448, 464 being
 * the tie between 448 (even code) and the 480 step that does not exist. */
static void test_saturation_boundary(void) {
  for (uint32_t u = f_bits(448.0f); u <= f_bits(480.0f); u++) {
    CHECK_EQ_INT(mok_fp8_encode(bits_f(u)), 0x7e);
    CHECK_EQ_INT(mok_fp8_encode(-bits_f(u)), 0xfe);
  }
  CHECK_EQ_INT(mok_fp8_encode(nextafterf(448.0f, 0.0f)), 0x7e); /* rounds to 448 */
  CHECK_EQ_INT(mok_fp8_encode(432.0f), 0x7e);                   /* tie 416|448: even is 448 */
  CHECK_EQ_INT(mok_fp8_encode(nextafterf(432.0f, 0.0f)), 0x7d);
  const float big[] = {464.0f, 465.0f, 1e6f, 0x1p127f, FLT_MAX, INFINITY};
  for (size_t i = 0; i < sizeof big / sizeof big[0]; i++) {
    CHECK_EQ_INT(mok_fp8_encode(big[i]), 0x7e);
    CHECK_EQ_INT(mok_fp8_encode(-big[i]), 0xfe);
  }
}

static void test_subnormals_zero_and_nan(void) {
  for (unsigned m = 0; m < 8; m++) CHECK_EQ_INT(mok_fp8_encode((float)m * 0x1p-9f), m);
  CHECK_EQ_INT(mok_fp8_encode(0x1p-10f), 0x00);         /* tie 0|2^-9: even is 0 */
  CHECK_EQ_INT(mok_fp8_encode(nextafterf(0x1p-10f, 1.0f)), 0x01);
  CHECK_EQ_INT(mok_fp8_encode(3.0f * 0x1p-10f), 0x02);  /* tie 1|2: even is 2 */
  CHECK_EQ_INT(mok_fp8_encode(15.0f * 0x1p-10f), 0x08); /* tie 7|8 goes to 2^-6, normal */
  CHECK_EQ_INT(mok_fp8_encode(-0x1p-9f), 0x81);
  CHECK_EQ_INT(mok_fp8_encode(0x1p-149f), 0x00); /* f32 subnormals */
  CHECK_EQ_INT(mok_fp8_encode(-0x1p-149f), 0x80);
  CHECK_EQ_INT(mok_fp8_encode(0x1p-126f), 0x00);
  CHECK_EQ_INT(mok_fp8_encode(0.0f), 0x00);
  CHECK_EQ_INT(mok_fp8_encode(-0.0f), 0x80);
  CHECK_EQ_INT(mok_fp8_encode(NAN), 0x7f);
  CHECK_EQ_INT(mok_fp8_encode(-NAN), 0xff);
  CHECK_EQ_INT(mok_fp8_encode(bits_f(0x7f800001u)), 0x7f); /* a signalling NaN */
}

/* A million f32 bit patterns, every exponent, against the search. */
static void test_random_f32_against_the_definition(void) {
  uint64_t s = 0x9e3779b97f4a7c15ull;
  for (int i = 0; i < 1000000; i++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    uint32_t u = (uint32_t)s;
    if (i & 1) u = (u & 0x807fffffu) | ((uint32_t)(110 + (s >> 40) % 30) << 23); /* e4m3's range */
    check_encode(bits_f(u));
  }
}

/* The definition: the smallest e with amax * 2^-e <= 448, clamped. */
static int def_scale_exp(float amax) {
  if (amax == 0.0f) return 0;
  for (int e = -126; e <= 127; e++)
    if (ldexp((double)amax, -e) <= 448.0) return e;
  return 127;
}

static void test_scale_exponent(void) {
  CHECK_EQ_INT(mok_fp8_scale_exp(0.0f), 0);
  CHECK_EQ_INT(mok_fp8_scale_exp(0x1p-149f), -126); /* subnormal: clamped */
  CHECK_EQ_INT(mok_fp8_scale_exp(0x1.fffffcp-127f), -126);
  CHECK_EQ_INT(mok_fp8_scale_exp(448.0f), 0);
  CHECK_EQ_INT(mok_fp8_scale_exp(448.0f * (1.0f + 0x1p-23f)), 1);
  CHECK_EQ_INT(mok_fp8_scale_exp(1.0f), -8); /* 1 * 2^8 = 256 <= 448 < 512 */
  CHECK_EQ_INT(mok_fp8_scale_exp(0x1p127f), 119);
  CHECK_EQ_INT(mok_fp8_scale_exp(FLT_MAX), 120);
  CHECK_EQ_INT(mok_fp8_scale_exp(INFINITY), 127);
  const float listed[] = {0.0f, 0x1p-149f, 448.0f, 448.0f * (1.0f + 0x1p-23f), 0x1p127f, FLT_MAX};
  for (size_t i = 0; i < sizeof listed / sizeof listed[0]; i++)
    CHECK_EQ_INT(mok_fp8_scale_exp(listed[i]), def_scale_exp(listed[i]));
  uint64_t s = 88172645463325252ull;
  for (int i = 0; i < 200000; i++) {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    float a = bits_f((uint32_t)s & 0x7f7fffffu); /* finite, >= 0 */
    CHECK_MSG(mok_fp8_scale_exp(a) == def_scale_exp(a), "scale_exp(%a) = %d, defined %d",
              (double)a, mok_fp8_scale_exp(a), def_scale_exp(a));
  }
  /* the scales are exact powers of two */
  for (int e = -126; e <= 127; e++) CHECK(ldexpf(1.0f, e) == mok_fp8_pow2(e));
  CHECK(mok_fp8_pow2(-127) == 0x1p-127f && mok_fp8_pow2(-149) == 0x1p-149f);
  CHECK_EQ_INT(mok_fp8_quantize(448.0f * (1.0f + 0x1p-23f), 1), 0x76); /* 224.00001 -> 224 */
  CHECK_EQ_INT(mok_fp8_quantize(-3.0f, mok_fp8_scale_exp(3.0f)), 0xfc); /* -3 * 2^7 = -384 = -1.5 * 2^8 */
}

static const check_case cases[] = {
    CHECK_CASE(test_every_byte_decodes_to_its_defined_value),
    CHECK_CASE(test_encode_of_decode_is_the_byte),
    CHECK_CASE(test_ties_and_midpoints),
    CHECK_CASE(test_saturation_boundary),
    CHECK_CASE(test_subnormals_zero_and_nan),
    CHECK_CASE(test_random_f32_against_the_definition),
    CHECK_CASE(test_scale_exponent),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
