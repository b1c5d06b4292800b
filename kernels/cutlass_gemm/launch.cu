/* SPDX-License-Identifier: Apache-2.0 */
/* The CUTLASS products' launch table, the zeros their contracts owe beside
 * the GEMM, and the dispatch (launch.h). Built with or without CUTLASS's
 * headers: without them (MOK_HAVE_CUTLASS unset) nothing runs here. */
#include <atomic>
#include <string.h>

#include "cutlass_gemm/launch.h"
#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"

/* ---- the launch table ---------------------------------------------------------------------
 * One row a product it serves: the configuration, and the range of rows a
 * group must be able to hold (the row capacity over the groups: a pure
 * function of the job's dims, never of timing or of the routing; the
 * weight gradients' rows are their K) for it to run there: at least
 * min_group_rows, and below max_group_rows where that is not 0; outside
 * every row the product stays on the hand-written Hopper kernels
 * (mok_gemm_sm90.cu). Each row's reason is measured in kernels/PERF.md
 * ("Kernels v3"). */
enum {
  CG_DOWN_COOP_128x256_C2,
  CG_DOWN_PP_128x128_C2,
  CG_WGRAD_COOP_128x256,
  CG_WGRAD_PP_128x128,
  CG_DGRAD_COOP_128x256_C2,
  CG_DGRAD_PP_128x128_C2,
};

struct cg_row {
  int mode;
  int config;
  long long min_group_rows, max_group_rows; /* max 0: no bound */
  int min_out; /* the least of a group's output rows and columns, at least this */
};
static const cg_row cg_table[] = {
    /* the shared expert and the routed products at T = 8192: 3-8 % faster;
     * the routed products at T = 2048 (~350 rows an expert): within +-2 % */
    {MOK_GM_DOWN, CG_DOWN_COOP_128x256_C2, 1024, 0, 0},
    /* the down dgrad with its SwiGLU backward, g and u in by TMA during
     * the k loop, at T = 8192: 3.28 ms against the hand-written ping-pong's
     * 3.97 alone (ncu), 4.23 against 4.42 back to back; at T = 2048 the
     * layer's backward 0-2 % slower with it (PERF.md "The down dgrad on CUTLASS") */
    {MOK_GM_DOWN_DGRAD, CG_DGRAD_COOP_128x256_C2, 1024, 0, 0},
    /* the weight gradients at 380-640 rows an expert (T = 2048): a k loop
     * of 6-10 blocks, the epilogue under the other warpgroup's; the layer's
     * backward 1.4-5.1 % faster where the outputs are 2048 or more each way
     * (I >= 2048), 3.5-4.5 % slower at qwen3.5-397b's I = 1024 (PERF.md
     * "The weight gradients on ping-pong") */
    {MOK_GM_WGRAD, CG_WGRAD_PP_128x128, 0, 1024, 2048},
};

/* The tests' and the bench's alternatives to the table (mok_gemm_sm90.h):
 * every product that has a configuration, whatever the rows, on the
 * cooperative or on the ping-pong ones. */
static const cg_row cg_every[] = {
    {MOK_GM_DOWN, CG_DOWN_COOP_128x256_C2, 0, 0, 0},
    {MOK_GM_DOWN_DGRAD, CG_DGRAD_COOP_128x256_C2, 0, 0, 0},
    {MOK_GM_WGRAD, CG_WGRAD_COOP_128x256, 0, 0, 0},
};
static const cg_row cg_every_pp[] = {
    {MOK_GM_DOWN, CG_DOWN_PP_128x128_C2, 0, 0, 0},
    {MOK_GM_DOWN_DGRAD, CG_DGRAD_PP_128x128_C2, 0, 0, 0},
    {MOK_GM_WGRAD, CG_WGRAD_PP_128x128, 0, 0, 0},
};
static std::atomic<int> cg_choice{MOK_K_CUTLASS_TABLE};

extern "C" int mok_k_sm90_set_cutlass_choice(int choice) {
  if (choice < MOK_K_CUTLASS_TABLE || choice > MOK_K_CUTLASS_EVERY_PP) return MOK_EINVAL;
  cg_choice.store(choice, std::memory_order_relaxed);
  return MOK_OK;
}

extern "C" int mok_k_sm90_cutlass_choice_parse(const char *name) {
  static const char *const names[] = {"table", "every", "every-pp"};
  for (int i = 0; name && i < 3; i++)
    if (!strcmp(name, names[i])) return MOK_K_CUTLASS_TABLE + i;
  return -1;
}

int mok__cg_init(void) {
#ifdef MOK_HAVE_CUTLASS
  /* The groups' arguments and CUTLASS's workspace (tens of KB a launch) come
   * from the device's default memory pool, stream-ordered: let the pool keep
   * what it frees, so that a launch does not map fresh pages each time. */
  int dev = 0;
  cudaMemPool_t pool;
  uint64_t keep = 64ull << 20;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, dev) != cudaSuccess ||
      cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep) != cudaSuccess)
    return mok_k_launch_status();
#endif
  return MOK_OK;
}

int mok__cg_built(void) {
#ifdef MOK_HAVE_CUTLASS
  return 1;
#else
  return 0;
#endif
}

/* The row that serves product `mode` with these parameters, or NULL. */
/* The least of a group's output rows and columns (WGRAD: each output half's). */
static int cg_min_out(int mode, const mok_gemm_params *p) {
  int m = p->M;
  if (mode == MOK_GM_WGRAD && p->C1 && p->c_split > 0 && p->c_split < p->M)
    m = p->c_split < p->M - p->c_split ? p->c_split : p->M - p->c_split;
  return m < p->N ? m : p->N;
}

template <size_t N>
static const cg_row *cg_find(const cg_row (&rows)[N], int mode, const mok_gemm_params *p) {
  const long long capacity = mode == MOK_GM_WGRAD ? p->K : p->M; /* the groups' rows */
  for (const cg_row &r : rows)
    if (r.mode == mode && capacity >= r.min_group_rows * p->groups &&
        (r.max_group_rows == 0 || capacity < r.max_group_rows * p->groups) &&
        cg_min_out(mode, p) >= r.min_out)
      return &r;
  return nullptr;
}
static const cg_row *cg_row_of(int mode, const mok_gemm_params *p) {
  switch (cg_choice.load(std::memory_order_relaxed)) {
  case MOK_K_CUTLASS_EVERY: return cg_find(cg_every, mode, p);
  case MOK_K_CUTLASS_EVERY_PP: return cg_find(cg_every_pp, mode, p);
  default: return cg_find(cg_table, mode, p);
  }
}

static bool ld_ok(long long ld) { return ld > 0 && ld % 8 == 0; }

int mok__cg_takes(int mode, const mok_gemm_params *p) {
  if (!mok__cg_built() || !p || p->M <= 0 || p->N <= 0 || p->groups <= 0) return 0;
  if (!cg_row_of(mode, p) || p->N % 8 || !ld_ok(p->lda) || !ld_ok(p->ldb) || !ld_ok(p->ldc))
    return 0;
  if (mode == MOK_GM_DOWN) return p->K > 0 && p->K % 8 == 0 && p->gather_dst == nullptr;
  /* DOWN_DGRAD: g, u and h rows of N, dg | du rows of 2N (the epilogue's
   * layout); the TMA boxes of g and u need 16-byte rows */
  if (mode == MOK_GM_DOWN_DGRAD)
    return p->K > 0 && p->K % 8 == 0 && p->gather_dst == nullptr && p->G && p->U && p->C1 &&
           p->ldc == 2LL * p->N && (!p->rw || p->row_slot);
  /* WGRAD: the gather beside it needs the hand kernel's idle producer warps;
   * the second half's A starts c_split columns in (16-byte aligned) */
  if (mode == MOK_GM_WGRAD)
    return p->gather_dst == nullptr && p->M % 8 == 0 && (p->c_split >= p->M || p->c_split % 8 == 0);
  return 0;
}

/* ---- the zeros ------------------------------------------------------------------------------ */

/* Row r's N columns (ld apart) as zeros, 16-byte vectors by the block. */
__device__ static void zero_row(bf16 *c, long long ld, long long r, int N) {
  uint4 *row = (uint4 *)(c + r * ld);
  for (int v = threadIdx.x; v < N / 8; v += blockDim.x) row[v] = make_uint4(0, 0, 0, 0);
}

/* The rows a row product's GEMM does not write, [lo, hi): for e < groups
 * group e's padding [first + count, next group's first); for e = groups
 * the rows past the last group (none when no_tail). Derived from the
 * offsets and counts the GEMM's groups were made of, so the two cover
 * every row once. */
__device__ static void unwritten_rows(const mok_gemm_params &p, int e, int *lo, int *hi) {
  const int M = p.M;
  auto clampM = [M](int v) { return v < 0 ? 0 : v > M ? M : v; };
  if (e < p.groups) {
    const mok__cg_rows g = mok__cg_group_rows(p, e, M);
    *lo = g.first + g.count;
    *hi = clampM(p.offsets[e + 1]);
  } else {
    *lo = clampM(p.offsets[p.groups]);
    *hi = p.no_tail ? *lo : M;
  }
}

/* DOWN: zeros in y's unwritten rows (blockIdx.y: e of unwritten_rows). */
__global__ static void down_zero_rows(const mok_gemm_params p) {
  if (job_failed(p.status) || !p.offsets) return;
  int lo, hi;
  unwritten_rows(p, blockIdx.y, &lo, &hi);
  for (long long r = lo + blockIdx.x; r < hi; r += gridDim.x) zero_row(p.C0, p.ldc, r, p.N);
}

/* DOWN_DGRAD: zeros in the unwritten rows of dg | du (2N), h (N) and the
 * d_rw partials, as the hand-written kernels store them. */
__global__ static void dgrad_zero_rows(const mok_gemm_params p) {
  if (job_failed(p.status) || !p.offsets) return;
  int lo, hi;
  unwritten_rows(p, blockIdx.y, &lo, &hi);
  for (long long r = lo + blockIdx.x; r < hi; r += gridDim.x) {
    zero_row(p.C0, p.ldc, r, 2 * p.N);
    zero_row(p.C1, p.N, r, p.N);
    if (p.partial)
      for (int i = threadIdx.x; i < p.n_partial; i += blockDim.x) p.partial[r * p.n_partial + i] = 0.0f;
  }
}

/* WGRAD: blockIdx.y = expert e in e_range with no rows: d_W[e] as zeros
 * (rows < c_split in C0, the rest in C1). */
__global__ static void wgrad_zero(const mok_gemm_params p) {
  if (job_failed(p.status)) return;
  const int e = blockIdx.y;
  if (p.e_range && (e < p.e_range[0] || e >= p.e_range[1])) return;
  if (mok__cg_group_rows(p, e, p.K).count > 0) return;
  const int split = p.C1 && p.c_split < p.M ? p.c_split : p.M;
  for (long long r = blockIdx.x; r < p.M; r += gridDim.x) {
    bf16 *c = (r < split ? p.C0 : p.C1) + (long long)e * p.c_expert_stride;
    zero_row(c, p.ldc, r < split ? r : r - split, p.N);
  }
}

/* ---- the dispatch --------------------------------------------------------------------------- */

int mok__cg_run(int mode, const mok_gemm_params *p, int ctas, cudaStream_t stream) {
  if (!mok__cg_takes(mode, p)) return MOK_EUNSUPPORTED;
#ifdef MOK_HAVE_CUTLASS
  const int config = cg_row_of(mode, p)->config;
  switch (config) {
  case CG_DOWN_COOP_128x256_C2:
  case CG_DOWN_PP_128x128_C2:
    if (p->offsets) down_zero_rows<<<dim3(32, p->groups + 1), 256, 0, stream>>>(*p);
    return config == CG_DOWN_PP_128x128_C2 ? mok__cg_down_pp_128x128_c2(p, ctas, stream)
                                           : mok__cg_down_coop_128x256_c2(p, ctas, stream);
  case CG_DGRAD_COOP_128x256_C2:
  case CG_DGRAD_PP_128x128_C2:
    if (p->offsets) dgrad_zero_rows<<<dim3(32, p->groups + 1), 256, 0, stream>>>(*p);
    return config == CG_DGRAD_PP_128x128_C2 ? mok__cg_down_dgrad_pp_128x128_c2(p, ctas, stream)
                                            : mok__cg_down_dgrad_coop_128x256_c2(p, ctas, stream);
  case CG_WGRAD_COOP_128x256:
  case CG_WGRAD_PP_128x128: {
    wgrad_zero<<<dim3(32, p->groups), 256, 0, stream>>>(*p);
    const int halves = p->C1 && p->c_split < p->M ? 2 : 1;
    return config == CG_WGRAD_PP_128x128 ? mok__cg_wgrad_pp_128x128(p, halves, ctas, stream)
                                         : mok__cg_wgrad_coop_128x256(p, halves, ctas, stream);
  }
  }
  return MOK_EUNSUPPORTED;
#else
  (void)ctas;
  (void)stream;
  return MOK_EUNSUPPORTED;
#endif
}
