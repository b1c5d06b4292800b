/* The Hopper (sm_90a) forward grouped GEMMs: TMA loads into a 4-stage
 * shared-memory ring, wgmma from two consumer warpgroups, one producer
 * warpgroup, a persistent grid walking the tiles of the schedule on the
 * device. Internal to the kernel library: mok_gemm.cu routes the forward
 * products here (MOK_GEMM=hmma keeps the mma.sync kernels); tests call
 * these directly to compare the two paths. */
#ifndef MOK_GEMM_SM90_H
#define MOK_GEMM_SM90_H

#include "mok_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Raises the kernels' shared-memory limit (from mok_k_init). */
int mok_k_sm90_init(void);

/* 1 when the current device is sm_90 and the driver offers the TMA
 * descriptor encoder; else 0 (the caller keeps the mma.sync path). */
int mok_k_sm90_usable(void);

/* Same contract as the mma.sync ffn_gate_up / ffn_down of mok_gemm.cu:
 * schedule != NULL: routed rows of the grouped schedule (M = rows capacity);
 * schedule == NULL: one group of M rows (the shared expert).
 * gate_up: g, u [M, n_inter] (pre-clamp, rounded), h = silu(g') u' [M, n_inter].
 * down:    y [M, H] = h W_d[e]^T. Padding rows and rows past the last group
 * get zeros. Returns a mok_status. */
int mok_k_sm90_gate_up(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                       const mok_k_bf16 *x, const mok_k_bf16 *wg, const mok_k_bf16 *wu,
                       mok_k_bf16 *g, mok_k_bf16 *u, mok_k_bf16 *h, int32_t *status,
                       mok_k_stream stream);
int mok_k_sm90_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                    const mok_k_bf16 *h, const mok_k_bf16 *wd, mok_k_bf16 *y, int32_t *status,
                    mok_k_stream stream);

/* Tests: persistent CTAs per launch (0: one per SM). Results must not
 * depend on it. */
void mok_k_sm90_set_grid(int ctas);

/* Tuning knobs for the bench (defaults 0): pipe = 1 keeps one wgmma batch
 * in flight per consumer; band > 0 walks tiles in bands of that many row
 * blocks; pol_a, pol_b: L2 policy of the A and B loads (0 normal, 1 evict
 * last, 2 evict first). Results do not depend on them. */
void mok_k_sm90_set_tuning(int pipe, int band, int pol_a, int pol_b);

#ifdef __cplusplus
}
#endif

#endif /* MOK_GEMM_SM90_H */
