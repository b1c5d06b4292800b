/* SPDX-License-Identifier: Apache-2.0 */
/* The products the library runs on CUTLASS's sm90 grouped GEMM (grouped.cuh),
 * as the rest of the kernel library sees them. Internal to kernels/. */
#ifndef MOK_CUTLASS_LAUNCH_H
#define MOK_CUTLASS_LAUNCH_H

#include <cuda_runtime.h>

#include "common/gemm_params.cuh"

/* The rows of group e of the schedule: [first, first + count), clamped to
 * [0, M) (the launcher's copy is validated; the clamp keeps every kernel in
 * bounds whatever it holds). No schedule: one group of M rows. The GEMM's
 * groups and the zeros beside them both come from here. */
struct mok__cg_rows {
  int first, count;
};
__device__ inline mok__cg_rows mok__cg_rows_of(const int32_t *offsets, const int32_t *counts,
                                               int e, int M) {
  if (!offsets) return mok__cg_rows{0, M};
  int first = offsets[e], count = counts[e];
  if (first < 0 || first > M) first = M;
  if (count < 0) count = 0;
  if (count > M - first) count = M - first;
  return mok__cg_rows{first, count};
}
__device__ inline mok__cg_rows mok__cg_group_rows(const mok_gemm_params &p, int e, int M) {
  return mok__cg_rows_of(p.offsets, p.counts, e, M);
}

/* Once per device, from mok_k_sm90_init: the memory pool the launches'
 * small allocations come from keeps what they free. Returns a mok_status. */
int mok__cg_init(void);

/* 1 when this build has the CUTLASS products (CUTLASS's headers were found
 * at build time); 0: every call below returns MOK_EUNSUPPORTED. */
int mok__cg_built(void);

/* Whether product `mode` with these parameters runs on a CUTLASS
 * configuration (the launch table's row for it, and the shape's limits:
 * 16-byte aligned rows for TMA). */
int mok__cg_takes(int mode, const mok_gemm_params *p);

/* Runs product `mode` (MOK_GM_DOWN, MOK_GM_DOWN_DGRAD or MOK_GM_WGRAD) on its configuration,
 * the zeros its contract owes included, on `ctas` persistent CTAs (0: one
 * per SM; tests use fewer). Returns a mok_status. */
int mok__cg_run(int mode, const mok_gemm_params *p, int ctas, cudaStream_t stream);

/* The configurations, one translation unit each (kernels/cutlass_gemm/cfg_NAME.cu):
 * halves is WGRAD's number of output halves (1 or 2). */
int mok__cg_down_coop_128x256_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream);
int mok__cg_down_pp_128x128_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream);
int mok__cg_down_dgrad_coop_128x256_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream);
int mok__cg_down_dgrad_pp_128x128_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream);
int mok__cg_wgrad_coop_128x256(const mok_gemm_params *p, int halves, int ctas,
                               cudaStream_t stream);
int mok__cg_wgrad_pp_128x128(const mok_gemm_params *p, int halves, int ctas, cudaStream_t stream);

/* ---- the FP8 products (docs/math.md "FP8") ----
 * C[set] [M][N] bf16 = the rows of A (e4m3 [M][K], K contiguous; scales sa
 * [M][K/128]) times B[set] of their group transposed (e4m3 [groups][N][K];
 * scales sb [groups][N/128][K/128]: the packed weight's first section), a
 * product per set: sets = 1 (PLAIN) or 2 (GATE_UP: g from B[0] into C[0],
 * u from B[1] into C[1], the same rows). N and K multiples of 128. Rows past
 * each group's count get zeros (GATE_UP: g, u, and h's bytes and scales,
 * from the SwiGLU pass that follows the GEMM).
 * DOWN_DGRAD (sets = 1): a = A B^T with B W_d's transposed section ([E][N =
 * I][K = H]; scales sb [groups][K/128][N/128]), then the SwiGLU backward
 * into dgu, h, the d_rw partials and dg | du quantised (hq, hs), as
 * mok_gemm_sm90_fp8.cu's; C unused. */
#define MOK_CG_F8_PLAIN 16
#define MOK_CG_F8_GATE_UP 17
#define MOK_CG_F8_DOWN_DGRAD 18
struct mok__cg_f8 {
  const int32_t *offsets, *counts; /* the validated schedule's groups; NULL: one group of M rows */
  int groups, M, N, K;
  const uint8_t *a;
  const float *sa;
  const uint8_t *b[2];
  const float *sb[2];
  __nv_bfloat16 *c[2];
  int sets;
  /* GATE_UP: h = rnd(silu(g') u') quantised per row per 128: bytes hq [M][N], scales hs [M][N/128];
   * DOWN_DGRAD: dg | du quantised, [M][2N] and [M][2N/128] */
  uint8_t *hq;
  float *hs;
  /* DOWN_DGRAD: the saved g, u [M][N] (pre-clamp), each row's slot for its
   * router weight rw (NULL: 1), the outputs dg | du [M][2N], h [M][N] and
   * the d_rw partials [M][n_partial] (NULL: none) */
  const __nv_bfloat16 *g, *u;
  const int32_t *row_slot;
  const float *rw;
  int n_slots;
  __nv_bfloat16 *dgu, *h;
  float *partial;
  int n_partial;
  int has_limit;
  float limit;
  const int32_t *status;
};
/* Whether FP8 product `mode` (MOK_CG_F8_*) runs on a CUTLASS configuration;
 * the caller also asks for the cutlass variant. */
int mok__cg_f8_takes(int mode, const mok__cg_f8 *p);
/* Runs it, its zeros (and GATE_UP's SwiGLU pass) included, on `ctas`
 * persistent CTAs (0: one per SM). Returns a mok_status. */
int mok__cg_f8_run(int mode, const mok__cg_f8 *p, int ctas, cudaStream_t stream);
int mok__cg_f8_coop_128x128(const mok__cg_f8 *p, int ctas, cudaStream_t stream);
int mok__cg_f8_pp_64x128_c2(const mok__cg_f8 *p, int ctas, cudaStream_t stream);
int mok__cg_f8_dgrad_coop_128x128_c12(const mok__cg_f8 *p, int ctas, cudaStream_t stream);
int mok__cg_f8_coop_128x128_c12(const mok__cg_f8 *p, int ctas, cudaStream_t stream);

#endif /* MOK_CUTLASS_LAUNCH_H */
