/* SPDX-License-Identifier: Apache-2.0 */
/* The GEMM backends of the kernel library and the Hopper (sm_90a) grouped
 * GEMMs, forward and backward: TMA loads into a 4-stage shared-memory
 * ring, wgmma from two consumer warpgroups, one producer warpgroup, a
 * persistent grid walking the tiles of the schedule on the device.
 * Internal to the kernel library: mok_gemm.cu routes the products to the
 * backend chosen at mok_k_init; tests and benches call these to compare
 * the paths and variants. Results equal the mma.sync kernels' bit for bit
 * on every backend and variant. */
#ifndef MOK_GEMM_SM90_H
#define MOK_GEMM_SM90_H

#include "mok_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the backend: chosen once -----------------------------------------------
 * mok_k_init_with takes it from its choices (gemm "hmma": mma.sync for
 * every product; otherwise the Hopper kernels where the device has them).
 * Tests and benches set it with mok_k_set_gemm_backend (returns the backend
 * in force: SM90 asked on a device without it gives HMMA; AUTO: the init's
 * choice). */
#define MOK_K_GEMM_AUTO (-1)
#define MOK_K_GEMM_HMMA 0
#define MOK_K_GEMM_SM90 1
int mok_k_set_gemm_backend(int backend);
int mok_k_gemm_backend(void);

/* ---- the Hopper kernels ------------------------------------------------------ */

/* Raises the kernels' shared-memory limit and counts the 2-CTA clusters the
 * device runs at once (from mok_k_init_with). */
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

/* Backward, same contracts as the mma.sync modes of mok_gemm.cu:
 * down_dgrad: a = d_out W_d[e] per row, SwiGLU backward: dgu [M, 2n]
 *   (dg | du), h [M, n], d_rw partials [M, n_partial] (128-column tiles;
 *   partial NULL: none); rw NULL: rw = 1.
 * gate_up_dgrad: d_x [M, H] = dg W_g[e] + du W_u[e]; n_inter must be a
 *   multiple of 16 (else MOK_EINVAL: the caller keeps mma.sync).
 * wgrad: per group e (schedule: the expert's rows; else all `rows`),
 *   C[e] [M, N] = a^T b over the rows, a [rows, M], b [rows, N]; output
 *   rows < c_split to c0 + e*c_expert_stride, the rest (from row c_split)
 *   to c1 likewise, rows ldc apart. */
int mok_k_sm90_down_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                          const mok_k_bf16 *d_out, const mok_k_bf16 *wd, const mok_k_bf16 *g,
                          const mok_k_bf16 *u, const float *rw, mok_k_bf16 *dgu, mok_k_bf16 *h,
                          float *partial, int n_partial, int32_t *status, mok_k_stream stream);
int mok_k_sm90_gate_up_dgrad(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                             const mok_k_bf16 *dgu, const mok_k_bf16 *wg, const mok_k_bf16 *wu,
                             mok_k_bf16 *d_x, int32_t *status, mok_k_stream stream);
int mok_k_sm90_wgrad(const mok_k_dims *d, const int32_t *schedule, int groups, int rows, int M,
                     int N, const mok_k_bf16 *a, const mok_k_bf16 *b, mok_k_bf16 *c0,
                     mok_k_bf16 *c1, int c_split, long long ldc, long long c_expert_stride,
                     const int32_t *e_range, int32_t *status, mok_k_stream stream);

/* Which backward modes mok_gemm.cu sends here (bits: MOK_K_SM90_BWD_*;
 * default all). Tests and benches compare them one at a time. */
#define MOK_K_SM90_BWD_DOWN_DGRAD 1
#define MOK_K_SM90_BWD_GATE_UP_DGRAD 2
#define MOK_K_SM90_BWD_WGRAD 4
void mok_k_sm90_set_bwd_modes(int mask);
int mok_k_sm90_bwd_modes(void);

/* The tile variant of the row-mode products (v3; results never depend on it):
 *   ROWS     row block by row block (v1/v2);
 *   EXPERT   expert by expert, column tile outer, its row blocks inner;
 *   CLUSTER  2-CTA clusters on row blocks 2p, 2p+1: one expert's weight
 *            tile loaded once for both (TMA multicast), rows order; for
 *            GATE_UP, DOWN and the gate/up dgrad (the down dgrad and the
 *            wgrads run ROWS) (PERF.md v3).
 *   PINGPONG CLUSTER, and the down dgrad on 128x128 tiles with one
 *            consumer warpgroup a tile, so that one's SwiGLU-backward
 *            epilogue overlaps the other's k loop (PERF.md v4).
 *   QUAD     PINGPONG, with GATE_UP, DOWN and the gate/up dgrad in 2x2
 *            clusters (two row blocks x two column tiles): A shared by the
 *            two column tiles, B by the two row blocks of one expert.
 *   CUTLASS  PINGPONG, with DOWN, the down dgrad and the weight gradients on
 *            CUTLASS's sm90 grouped GEMM where its launch table says
 *            (kernels/cutlass_gemm/launch.cu); the default. In a build
 *            without CUTLASS's headers, PINGPONG (PERF.md "Kernels v3").
 * The variant choice rows|expert|cluster|pingpong|quad|cutlass at mok_k_init_with, or the setter
 * (MOK_EINVAL for an unknown one). WGRAD always runs ROWS. */
#define MOK_K_SM90_ROWS 0
#define MOK_K_SM90_EXPERT 1
#define MOK_K_SM90_CLUSTER 2
#define MOK_K_SM90_PINGPONG 3
#define MOK_K_SM90_QUAD 4
#define MOK_K_SM90_CUTLASS 5
#define MOK_K_SM90_VARIANTS 6
int mok_k_sm90_set_variant(int variant);
int mok_k_sm90_variant(void);
const char *mok_k_sm90_variant_name(int variant); /* "rows", ..., "quad", "cutlass" */
int mok_k_sm90_variant_parse(const char *name);   /* -1: unknown */
/* 2-CTA clusters the device runs at once (from mok_k_sm90_init); 0: the
 * cluster variant falls back to ROWS order on plain CTAs. */
int mok_k_sm90_pair_clusters(void);
/* The block-scaled e4m3 grouped GEMM (mok_gemm_sm90_fp8.cu; docs/math.md
 * "FP8"): c [M][N] bf16 = the rows of a [M][K] (e4m3 bytes, scales
 * a_scales [M][K/128], mok_k_fp8_quantize_rows) times their expert's
 * b_packed [E_loc][N][K] transposed (mok_k_fp8_quantize_weight's packed
 * form: its first e4m3 section and its scales), for the routed rows of the schedule (M its row capacity); padding
 * rows get zeros. N and K multiples of 128. MOK_EUNSUPPORTED off sm_90.
 * A tested kernel: no layer op calls it yet. */
int mok_k_sm90_fp8_rows_gemm(const mok_k_dims *d, const int32_t *schedule, int M, int N, int K,
                             const uint8_t *a, const float *a_scales, const void *b_packed,
                             mok_k_bf16 *c, int32_t *status, mok_k_stream stream);

/* Tests and bench: what the cutlass variant runs on CUTLASS (kernels/cutlass_gemm/):
 * its launch table (the default), or every product that has a CUTLASS
 * configuration whatever its rows, on its cooperative (EVERY) or its
 * ping-pong (EVERY_PP) configuration. Results do not depend on it.
 * MOK_EINVAL for another value. */
#define MOK_K_CUTLASS_TABLE 0
#define MOK_K_CUTLASS_EVERY 1
#define MOK_K_CUTLASS_EVERY_PP 2
int mok_k_sm90_set_cutlass_choice(int choice);
int mok_k_sm90_cutlass_choice_parse(const char *name); /* "table", "every", "every-pp"; -1: other */

/* Bench and tests: the FP8 products' CUTLASS configuration, 0 ..
 * (mok_k_sm90_fp8_cutlass_config_name: NULL past the last), or -1 (the
 * default): the launch table's. Results do not depend on it. MOK_EINVAL for
 * another value. */
int mok_k_sm90_set_fp8_cutlass_config(int config);
const char *mok_k_sm90_fp8_cutlass_config_name(int config);

/* Bench and tests: the pingpong variant's down dgrad in 2-CTA clusters
 * (1, the default) or on plain CTAs (0). Results do not depend on it. */
void mok_k_sm90_set_pp_pairs(int on);

/* Tests and bench: mok_k_expert_forward_gathering's gate/up product
 * gathers x's rows in its producer where the 2-CTA cluster kernel runs it
 * (1), or reads a routed copy gather_rows wrote first (0), or, the
 * default (-1), gathers where the expert's intermediate size I is at most
 * MOK_K_SM90_GATHER_MAX_I (measured faster there, slower above it:
 * kernels/PERF.md). Results do not depend on it. */
#define MOK_K_SM90_GATHER_MAX_I 1024
void mok_k_sm90_set_gather_a(int mode);

/* Tests: persistent CTAs per launch (0: one per SM; the cluster variant
 * rounds up to whole clusters). Results must not depend on it. */
void mok_k_sm90_set_grid(int ctas);

/* Measurement builds (nvcc -DMOK_TILE_TRACE=1, kernels/common/tile_trace.cuh):
 * the plain kernel's per-tile timeline into buf, one row per CTA of
 * MOK_TRACE_STAMPS x (1 + tiles_per_cta) words (NULL: off).
 * MOK_EUNSUPPORTED in a build without the trace. */
int mok_k_sm90_set_trace(unsigned long long *buf, int tiles_per_cta);

/* Tuning knobs for the bench (defaults 0): pipe = 1 keeps one wgmma batch
 * in flight per consumer; band > 0 walks tiles in bands of that many row
 * blocks; pol_a, pol_b: L2 policy of the A and B loads (0 normal, 1 evict
 * last, 2 evict first). Results do not depend on them. */
void mok_k_sm90_set_tuning(int pipe, int band, int pol_a, int pol_b);

#ifdef __cplusplus
}
#endif

#endif /* MOK_GEMM_SM90_H */
