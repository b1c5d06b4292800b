/* SPDX-License-Identifier: Apache-2.0 */
/* The SwiGLU (+ clamp) pieces of the GEMM epilogues (docs/math.md), one
 * copy for every kernel: results must agree bit for bit between the
 * mma.sync and the Hopper kernels, so every operation is an explicitly
 * rounded intrinsic (no contraction into FMAs) in one fixed order. */
#ifndef MOK_COMMON_SWIGLU_CUH
#define MOK_COMMON_SWIGLU_CUH

#include <cuda_bf16.h>

/* sigma(v) = 1 / (1 + exp(-v)): the hardware exponential (a few f32 ulp,
 * far below bf16's rounding) and one correctly rounded reciprocal, not
 * two IEEE divisions: the down dgrad's epilogue computes this for every
 * element of its tile, in series with its k loop on the cooperative
 * kernel (kernels/PERF.md, "The down dgrad on CUTLASS"). */
__device__ static inline float swiglu_sigmoid(float v) {
  return __frcp_rn(__fadd_rn(1.0f, __expf(-v)));
}
/* silu(v) = v sigma(v) */
__device__ static inline float swiglu_silu(float v) { return __fmul_rn(v, swiglu_sigmoid(v)); }

/* bf16 rounding of an f32, back to f32 */
__device__ static inline float swiglu_round(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}

/* Forward, one element: the accumulators of the gate and up projections
 * -> g, u rounded to bf16 (saved pre-clamp), h = silu(g') u' (f32; the
 * caller rounds it when storing), g', u' clamped when has_limit. */
__device__ static inline void swiglu_forward(float acc_g, float acc_u, int has_limit, float limit,
                                             float *g, float *u, float *h) {
  *g = swiglu_round(acc_g);
  *u = swiglu_round(acc_u);
  float gc = *g, uc = *u;
  if (has_limit) {
    gc = fminf(gc, limit);
    uc = fminf(fmaxf(uc, -limit), limit);
  }
  *h = __fmul_rn(swiglu_silu(gc), uc);
}

/* Backward, one element: saved g, u (pre-clamp), a = d_out W_d (f32) and
 * the router weight w -> h rounded to bf16 (the d_rw term is a * h), dg
 * and du (f32; the caller rounds them when storing). The clamp passes no
 * gradient where it cut. The h the down dgrad stores for the down weight
 * gradient is swiglu_h_weighted(h, w): rw folded in there, so that the
 * weight gradient reads routed d_out as it is (no scaled copy). */
typedef struct swiglu_grad {
  float h, dg, du;
} swiglu_grad;

__device__ static inline swiglu_grad swiglu_backward(float g, float u, float a, float w,
                                                     int has_limit, float limit) {
  float gc = g, uc = u;
  bool pass_g = true, pass_u = true;
  if (has_limit) {
    pass_g = g <= limit;
    pass_u = u >= -limit && u <= limit;
    gc = fminf(gc, limit);
    uc = fminf(fmaxf(uc, -limit), limit);
  }
  const float sig = swiglu_sigmoid(gc), silu = __fmul_rn(gc, sig);
  swiglu_grad r;
  r.h = swiglu_round(__fmul_rn(silu, uc));
  const float dh = __fmul_rn(w, a);
  const float dsilu = __fmul_rn(sig, __fadd_rn(1.0f, __fmul_rn(gc, __fsub_rn(1.0f, sig))));
  r.dg = pass_g ? __fmul_rn(__fmul_rn(dh, uc), dsilu) : 0.0f;
  r.du = pass_u ? __fmul_rn(dh, silu) : 0.0f;
  return r;
}

/* h~ = w h (f32; the caller rounds it to bf16 when storing): the down
 * weight gradient's operand, d_W_d = sum_r d_out_r^T h~_r (docs/math.md) */
__device__ static inline float swiglu_h_weighted(float h, float w) { return __fmul_rn(w, h); }

#endif /* MOK_COMMON_SWIGLU_CUH */
