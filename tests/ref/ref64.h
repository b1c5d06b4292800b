/* SPDX-License-Identifier: Apache-2.0 */
/* ref64: an independent float64 reference of the MoE layer (docs/design.md, "The layer").
 *
 * Written from the math, not from any engine: plain loops, every
 * intermediate kept in double, nothing rounded. Tests hold the engines
 * against it with a relative-error bound.
 *
 * Shapes (row-major), as in docs/math.md:
 *   x, out, d_out, d_x      [T,H]
 *   ids, rw, d_rw           [T,K]   ids global in [0,E) or -1
 *   wg, wu, d_wg, d_wu      [E_loc,I,H]
 *   wd, d_wd                [E_loc,H,I]
 *   sg, su, d_sg, d_su      [I_s,H]
 *   sd, d_sd                [H,I_s]
 * Slots whose id lies outside [first_expert, first_expert+E_loc) or is -1
 * contribute nothing (and get d_rw = 0). With has_limit the SwiGLU clamp
 * g' = min(g, limit), u' = clamp(u, -limit, limit) applies to the routed
 * experts and to the shared expert (docs/math.md: "the same formulas").
 */
#ifndef MOK_REF64_H
#define MOK_REF64_H

#include <stddef.h>
#include <stdint.h>

typedef struct ref64_layer {
  int T, H, I, E, E_loc, first_expert, K, I_s;
  int has_limit;
  double limit;
} ref64_layer;

typedef struct ref64_inputs {
  const double *x, *rw, *wg, *wu, *wd, *sg, *su, *sd; /* sg/su/sd NULL when I_s == 0 */
  const int32_t *ids;
} ref64_inputs;

void ref64_forward(const ref64_layer *L, const ref64_inputs *in, double *out /*[T,H]*/);

/* Every output is fully written (zeros where nothing flows). */
void ref64_backward(const ref64_layer *L, const ref64_inputs *in, const double *d_out,
                    double *d_x, double *d_rw, double *d_wg, double *d_wu, double *d_wd,
                    double *d_sg, double *d_su, double *d_sd /* NULL when no shared */);

/* ||got - ref||_2 / max(||ref||_2, tiny); a NaN or Inf in either -> INFINITY. */
double ref64_rel_err(const double *ref, const double *got, size_t n);

#endif /* MOK_REF64_H */
