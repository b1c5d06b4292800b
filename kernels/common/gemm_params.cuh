/* SPDX-License-Identifier: Apache-2.0 */
/* The five grouped products of the layer and the one parameter block both
 * GEMM kernels (mma.sync in mok_gemm.cu, Hopper in mok_gemm_sm90.cu) run
 * them from. mok_gemm.cu fills it once per product; the mma.sync kernel
 * reads the operand pointers, the Hopper launcher turns them into TMA maps
 * and adds its tiling.
 *
 *   GATE_UP    rows x N=I,  K=H   A routed_x (K-major), B W_g|W_u (K-major)  -> g, u, h
 *   DOWN       rows x N=H,  K=I   A h,                  B W_d (K-major)      -> y
 *   DOWN_DGRAD rows x N=I,  K=H   A routed_d_out,       B W_d (N-major)      -> dg|du, rw h, d_rw partials
 *   GU_DGRAD   rows x N=H,  K=2I  A dg|du,              B W_g;W_u (N-major)  -> routed_d_x
 *   WGRAD      M x N per group, K = the group's rows; A d_out or dg|du (M-major),
 *              B rw h or x (N-major)                                         -> d_W[e]
 */
#ifndef MOK_COMMON_GEMM_PARAMS_CUH
#define MOK_COMMON_GEMM_PARAMS_CUH

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>

enum mok_gemm_mode {
  MOK_GM_GATE_UP = 0,
  MOK_GM_DOWN = 1,
  MOK_GM_DOWN_DGRAD = 2,
  MOK_GM_GU_DGRAD = 3,
  MOK_GM_WGRAD = 4,
};

typedef struct mok_gemm_params {
  /* the product: M output rows (row modes: the routed buffer; WGRAD: per
   * group), N output columns, K the reduction (GU_DGRAD: 2I; WGRAD: the
   * buffer's rows, of which each group reduces over its own) */
  int M, N, K;
  const __nv_bfloat16 *A; /* row modes: A[r * lda + k]; WGRAD: A[k * lda + m] */
  long long lda;
  /* B0; B1: W_u of GATE_UP (columns) and of GU_DGRAD (k >= b_split).
   * K-major: B(k, n) = W[e][n * ldb + k]; N-major: W[e][k * ldb + n] */
  const __nv_bfloat16 *B0, *B1;
  long long ldb, b_expert_stride;
  int b_split;
  /* GATE_UP: g, u, h; DOWN, GU_DGRAD: y, d_x; DOWN_DGRAD: dg|du (ldc = 2N), h;
   * WGRAD: output rows < c_split to C0, the rest to C1, per group e at
   * e * c_expert_stride */
  __nv_bfloat16 *C0, *C1, *C2;
  long long ldc, c_expert_stride;
  int c_split;
  /* the rows: offsets != NULL: the schedule's groups (E_loc); else one
   * group of M rows (WGRAD: of K rows) */
  int E_loc, n_slots, groups;
  const int32_t *offsets, *counts, *row_slot;
  const int32_t *e_range; /* WGRAD: device [e0, e1); other groups are left alone. NULL: all */
  int no_tail;            /* row modes: tiles past the last group write nothing */
  /* DOWN_DGRAD */
  const float *rw;          /* router weight per slot (NULL: 1) */
  const __nv_bfloat16 *G, *U; /* saved pre-clamp g, u [M, N] */
  float *partial;           /* d_rw partials [M, n_partial] per 128 columns (NULL: none) */
  int n_partial;
  int has_limit;
  float limit;
  const int32_t *status;
  /* A row gather beside the product (Hopper kernels only; gather_dst NULL:
   * none): gather_dst[r] = gather_src[gather_row_slot[r] / gather_k] for
   * gather_row0 <= r < gather_rows, zeros where the slot is not in [0, gather_slots), as
   * gather_rows writes them; gather_vecs 16-byte vectors a row. The
   * backward's routed x, for its gate/up weight gradient two products
   * later, copied while this product keeps the tensor cores busy. */
  const __nv_bfloat16 *gather_src;
  __nv_bfloat16 *gather_dst;
  const int32_t *gather_row_slot;
  int gather_row0, gather_rows, gather_vecs, gather_k, gather_slots;
  /* GATE_UP with the rows gathered by the GEMM's producer (a_x != NULL;
   * only where mok__sm90_gathers says so): row r of A is
   * a_x[row_slot[r] / a_k], zeros where the slot is not in [0, n_slots),
   * as gather_rows would write it; A is then never read. */
  const __nv_bfloat16 *a_x;
  int a_k;
  /* the Hopper kernel's tiling and knobs (its launcher fills these) */
  int tile_n, m_tiles, n_tiles;
  int order, band;  /* tile order (mok_tile_order) and its band */
  int pol_a, pol_b; /* L2 policy of the A and B loads */
  int nk_split;     /* GU_DGRAD: k blocks of the W_g half */
  int wstore;       /* WGRAD: epilogue through TMA stores */
  int cluster;      /* 2: pairs of CTAs share B through TMA multicast */
} mok_gemm_params;

/* Runs one product on the Hopper kernels (mok_gemm_sm90.cu): mode is a
 * mok_gemm_mode; returns a mok_status. The mma.sync launch lives in
 * mok_gemm.cu, which picks between the two. */
int mok_k_sm90_run(int mode, const mok_gemm_params *p, cudaStream_t stream);
/* 1 when mok_k_sm90_run sends this product to a CUTLASS configuration (the
 * cutlass variant and kernels/cutlass_gemm/'s launch table), whose kernels
 * carry no gather beside them. */
int mok__sm90_on_cutlass(int mode, const mok_gemm_params *p);
/* 1 when mok_k_sm90_run runs this product (GATE_UP) with its rows gathered
 * by the producer (p->a_x): the 2-CTA cluster kernel on a schedule. */
int mok__sm90_gathers(int mode, const mok_gemm_params *p);

#endif /* MOK_COMMON_GEMM_PARAMS_CUH */
