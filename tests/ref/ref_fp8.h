/* SPDX-License-Identifier: Apache-2.0 */
/* ref_fp8: a float64 reference of an fp8 layer, written from docs/math.md
 * ("FP8 (e4m3, block-scaled)"), not from any engine or from
 * kernels/common/fp8_e4m3.h: e4m3 rounding by frexp/nearbyint in double,
 * block scales by stepping the exponent, every sum in double. It rounds
 * where the recipe rounds (e4m3 of each quantised operand, bf16 of g, u, h,
 * dg, du and of each stored output), so an engine fed the same bf16 inputs
 * differs from it only by its f32 sums (and what those move across a
 * rounding boundary).
 *
 * Inputs as ref64's (ref64.h): the bf16 values as doubles, weights the
 * bf16 masters; the reference quantises them itself. */
#ifndef MOK_REF_FP8_H
#define MOK_REF_FP8_H

#include "ref64.h"

/* e4m3 of v (nearest, ties to even, saturating at +-448; NaN stays NaN). */
double ref_fp8_e4m3(double v);
/* bf16 of v (nearest, ties to even). */
double ref_fp8_bf16(double v);
/* The smallest e in [-126, 127] with amax * 2^-e <= 448 (0 for amax 0). */
int ref_fp8_scale_exp(double amax);
/* A weight [E, N, K] in 128x128 blocks: q [E, N, K] the e4m3 values (before
 * scaling), s [E, N/128, K/128] the scales. */
void ref_fp8_quantize_weight(const double *w, int E, int N, int K, double *q, double *s);

void ref_fp8_forward(const ref64_layer *L, const ref64_inputs *in, double *out /*[T,H]*/);
void ref_fp8_backward(const ref64_layer *L, const ref64_inputs *in, const double *d_out,
                      double *d_x, double *d_rw, double *d_wg, double *d_wu, double *d_wd,
                      double *d_sg, double *d_su, double *d_sd /* NULL when no shared */);

#endif /* MOK_REF_FP8_H */
