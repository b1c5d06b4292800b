/* SPDX-License-Identifier: Apache-2.0 */
/* The CUTLASS products' launch table, the zeros their contracts owe beside
 * the GEMM, and the dispatch (launch.h). Built with or without CUTLASS's
 * headers: without them (MOK_HAVE_CUTLASS unset) nothing runs here. */
#include <atomic>
#include <string.h>

#include "common/fp8_e4m3.h"
#include "common/swiglu.cuh"
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
  CG_F8_COOP_128x128,
  CG_F8_COOP_128x128_C12,
  CG_F8_PP_64x128_C2,
  CG_F8_DGRAD_COOP_128x128_C12,
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
    /* the FP8 forward's products, 1x2 clusters sharing the activation tile:
     * 1.21-1.59x mok's FP8 kernel at every bench shape and T (down), 1.17-1.37x
     * (gate/up with its SwiGLU pass); the fastest of five configurations on
     * all 16 (kernels/PERF.md "FP8 on CUTLASS") */
    {MOK_CG_F8_PLAIN, CG_F8_COOP_128x128_C12, 0, 0, 0},
    {MOK_CG_F8_GATE_UP, CG_F8_COOP_128x128_C12, 0, 0, 0},
    /* the FP8 down dgrad with mok's SwiGLU-backward epilogue: 2.96 ms against
     * mok's FP8 kernel's 5.24 at kimi-k2.7 T=8192 (ncu, H200); the fp8 backward
     * 5-13 % faster at T=8192, 2-9 % at T=2048 (kernels/PERF.md "FP8 on CUTLASS",
     * "The FP8 down dgrad quantising from shared memory") */
    {MOK_CG_F8_DOWN_DGRAD, CG_F8_DGRAD_COOP_128x128_C12, 0, 0, 0},
};

/* The tests' and the bench's alternatives to the table (mok_gemm_sm90.h):
 * every product that has a configuration, whatever the rows, on the
 * cooperative or on the ping-pong ones. */
static const cg_row cg_every[] = {
    {MOK_GM_DOWN, CG_DOWN_COOP_128x256_C2, 0, 0, 0},
    {MOK_GM_DOWN_DGRAD, CG_DGRAD_COOP_128x256_C2, 0, 0, 0},
    {MOK_GM_WGRAD, CG_WGRAD_COOP_128x256, 0, 0, 0},
    {MOK_CG_F8_PLAIN, CG_F8_COOP_128x128, 0, 0, 0},
    {MOK_CG_F8_GATE_UP, CG_F8_COOP_128x128, 0, 0, 0},
    {MOK_CG_F8_DOWN_DGRAD, CG_F8_DGRAD_COOP_128x128_C12, 0, 0, 0},
};
static const cg_row cg_every_pp[] = {
    {MOK_GM_DOWN, CG_DOWN_PP_128x128_C2, 0, 0, 0},
    {MOK_GM_DOWN_DGRAD, CG_DGRAD_PP_128x128_C2, 0, 0, 0},
    {MOK_GM_WGRAD, CG_WGRAD_PP_128x128, 0, 0, 0},
    {MOK_CG_F8_PLAIN, CG_F8_PP_64x128_C2, 0, 0, 0},
    {MOK_CG_F8_GATE_UP, CG_F8_PP_64x128_C2, 0, 0, 0},
    {MOK_CG_F8_DOWN_DGRAD, CG_F8_DGRAD_COOP_128x128_C12, 0, 0, 0},
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

/* capacity: the rows the groups can hold (a pure function of the job's dims) */
template <size_t N>
static const cg_row *cg_find(const cg_row (&rows)[N], int mode, long long capacity, int groups,
                             int min_out) {
  for (const cg_row &r : rows)
    if (r.mode == mode && capacity >= r.min_group_rows * groups &&
        (r.max_group_rows == 0 || capacity < r.max_group_rows * groups) && min_out >= r.min_out)
      return &r;
  return nullptr;
}
static const cg_row *cg_row_of(int mode, long long capacity, int groups, int min_out) {
  switch (cg_choice.load(std::memory_order_relaxed)) {
  case MOK_K_CUTLASS_EVERY: return cg_find(cg_every, mode, capacity, groups, min_out);
  case MOK_K_CUTLASS_EVERY_PP: return cg_find(cg_every_pp, mode, capacity, groups, min_out);
  default: return cg_find(cg_table, mode, capacity, groups, min_out);
  }
}
static const cg_row *cg_row_of(int mode, const mok_gemm_params *p) {
  return cg_row_of(mode, mode == MOK_GM_WGRAD ? p->K : p->M, p->groups, cg_min_out(mode, p));
}
/* The bench's choice of the FP8 products' configuration (-1: the table's) */
static const int cg_f8_configs[] = {CG_F8_COOP_128x128, CG_F8_COOP_128x128_C12,
                                    CG_F8_PP_64x128_C2};
static const char *const cg_f8_config_names[] = {"coop-128x128", "coop-128x128-c1x2",
                                                 "pp-64x128-c2x1"};
#define CG_F8_CONFIGS ((int)(sizeof cg_f8_configs / sizeof cg_f8_configs[0]))
static std::atomic<int> cg_f8_choice{-1};

extern "C" int mok_k_sm90_set_fp8_cutlass_config(int config) {
  if (config < -1 || config >= CG_F8_CONFIGS) return MOK_EINVAL;
  cg_f8_choice.store(config, std::memory_order_relaxed);
  return MOK_OK;
}

extern "C" const char *mok_k_sm90_fp8_cutlass_config_name(int config) {
  return config >= 0 && config < CG_F8_CONFIGS ? cg_f8_config_names[config] : NULL;
}

/* FP8 product `mode`'s configuration, or -1: none (mok's kernel runs it) */
static int cg_f8_config(int mode, const mok__cg_f8 *p) {
  const int chosen = cg_f8_choice.load(std::memory_order_relaxed);
  if (mode == MOK_CG_F8_DOWN_DGRAD && chosen >= 0) return CG_F8_DGRAD_COOP_128x128_C12; /* its one */
  if (chosen >= 0) return cg_f8_configs[chosen];
  const cg_row *r = cg_row_of(mode, p->M, p->groups, p->M < p->N ? p->M : p->N);
  return r ? r->config : -1;
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

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

int mok__cg_f8_takes(int mode, const mok__cg_f8 *p) {
  if (!mok__cg_built() || !p || p->M <= 0 || p->groups <= 0 || (p->offsets && !p->counts) ||
      p->N <= 0 || p->K <= 0 || p->N % 128 || p->K % 128 || cg_f8_config(mode, p) < 0)
    return 0;
  const int sets = mode == MOK_CG_F8_GATE_UP ? 2 : 1;
  if (p->sets != sets || !aligned16(p->a) || !p->sa) return 0;
  if (mode == MOK_CG_F8_DOWN_DGRAD) /* g and u through TMA boxes; the rows' slots for rw */
    return aligned16(p->b[0]) && p->sb[0] && p->hq && p->hs && aligned16(p->hq) &&
           aligned16(p->g) && aligned16(p->u) && p->dgu && p->h && (!p->rw || p->row_slot) &&
           (!p->partial || p->n_partial >= 0);
  for (int s = 0; s < sets; s++)
    if (!aligned16(p->b[s]) || !aligned16(p->c[s]) || !p->sb[s]) return 0;
  return mode == MOK_CG_F8_PLAIN || (p->hq && p->hs && aligned16(p->hq));
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
__device__ static void unwritten_rows_of(const int32_t *offsets, const int32_t *counts, int groups,
                                         int M, bool no_tail, int e, int *lo, int *hi) {
  auto clampM = [M](int v) { return v < 0 ? 0 : v > M ? M : v; };
  if (e < groups) {
    const mok__cg_rows g = mok__cg_rows_of(offsets, counts, e, M);
    *lo = g.first + g.count;
    *hi = clampM(offsets[e + 1]);
  } else {
    *lo = clampM(offsets[groups]);
    *hi = no_tail ? *lo : M;
  }
}
__device__ static void unwritten_rows(const mok_gemm_params &p, int e, int *lo, int *hi) {
  unwritten_rows_of(p.offsets, p.counts, p.groups, p.M, p.no_tail, e, lo, hi);
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

/* FP8 DOWN_DGRAD: dgrad_zero_rows' rows, and there dg | du's bytes and
 * scales as zeros (as mok_gemm_sm90_fp8.cu leaves rows without a real row) */
__global__ static void f8_dgrad_zero_q(const mok__cg_f8 p) {
  if (job_failed(p.status) || !p.offsets) return;
  int lo, hi;
  unwritten_rows_of(p.offsets, p.counts, p.groups, p.M, false, blockIdx.y, &lo, &hi);
  const int qv = 2 * p.N / 16, sb = 2 * p.N / 128;
  for (long long r = lo + blockIdx.x; r < hi; r += gridDim.x) {
    uint4 *q = (uint4 *)(p.hq + r * 2LL * p.N);
    for (int v = threadIdx.x; v < qv; v += blockDim.x) q[v] = make_uint4(0, 0, 0, 0);
    for (int i = threadIdx.x; i < sb; i += blockDim.x) p.hs[r * sb + i] = 0.0f;
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

/* FP8 GATE_UP after its GEMM (blockIdx.y = group e, or the tail past the
 * last group): each real row's h = rnd(silu(g') u') from the g and u the
 * GEMM stored, quantised per 128 columns (one warp a block of 128: lane l
 * columns 4l .. 4l+3; the block's amax is a max, order-free), as
 * mok_gemm_sm90_fp8.cu's up epilogue does it; every other row gets zeros
 * in g, u, h's bytes and scale 0, as that kernel leaves padding rows. */
__global__ static void f8_swiglu_rows(const mok__cg_f8 p) {
  if (job_failed(p.status)) return;
  const int e = blockIdx.y, lane = threadIdx.x & 31, blocks = p.N / 128;
  int used_lo = 0, used_hi = 0, zero_lo = 0, zero_hi = 0;
  if (!p.offsets) {
    used_hi = p.M;
  } else {
    if (e < p.groups) {
      const mok__cg_rows g = mok__cg_rows_of(p.offsets, p.counts, e, p.M);
      used_lo = g.first;
      used_hi = g.first + g.count;
    }
    unwritten_rows_of(p.offsets, p.counts, p.groups, p.M, false, e, &zero_lo, &zero_hi);
  }
  const long long used_units = (long long)(used_hi - used_lo) * blocks;
  const long long units = used_units + (long long)(zero_hi > zero_lo ? zero_hi - zero_lo : 0) * blocks;
  const int warps = blockDim.x / 32;
  for (long long w = (long long)blockIdx.x * warps + threadIdx.x / 32; w < units;
       w += (long long)gridDim.x * warps) {
    const bool used = w < used_units;
    const long long v = used ? w : w - used_units;
    const long long r = (used ? used_lo : zero_lo) + v / blocks;
    const int kb = (int)(v % blocks);
    const long long at = r * p.N + kb * 128 + 4 * lane;
    uint2 *g4 = (uint2 *)(p.c[0] + at), *u4 = (uint2 *)(p.c[1] + at);
    if (!used) {
      *g4 = *u4 = make_uint2(0, 0);
      *(uint32_t *)(p.hq + at) = 0;
      if (lane == 0) p.hs[r * blocks + kb] = 0.0f;
      continue;
    }
    const uint2 graw = *g4, uraw = *u4;
    const __nv_bfloat162 *g2 = (const __nv_bfloat162 *)&graw, *u2 = (const __nv_bfloat162 *)&uraw;
    float h[4];
    for (int j = 0; j < 2; j++) {
      const float2 g = __bfloat1622float2(g2[j]), u = __bfloat1622float2(u2[j]);
      float gv, uv;
      swiglu_forward(g.x, u.x, p.has_limit, p.limit, &gv, &uv, &h[2 * j]);
      swiglu_forward(g.y, u.y, p.has_limit, p.limit, &gv, &uv, &h[2 * j + 1]);
    }
    const float2 h01 = __bfloat1622float2(__floats2bfloat162_rn(h[0], h[1]));
    const float2 h23 = __bfloat1622float2(__floats2bfloat162_rn(h[2], h[3]));
    float amax = fmaxf(fmaxf(fabsf(h01.x), fabsf(h01.y)), fmaxf(fabsf(h23.x), fabsf(h23.y)));
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const int ex = mok_fp8_scale_exp(amax);
    *(uint32_t *)(p.hq + at) = (uint32_t)mok_fp8_quantize2(h01.x, h01.y, ex) |
                               (uint32_t)mok_fp8_quantize2(h23.x, h23.y, ex) << 16;
    if (lane == 0) p.hs[r * blocks + kb] = mok_fp8_pow2(ex);
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

#ifdef MOK_HAVE_CUTLASS
/* An FP8 product's groups as the zero kernels of the bf16 products read
 * them (their outputs set by the caller). */
static mok_gemm_params f8_rows_params(const mok__cg_f8 *p) {
  mok_gemm_params z;
  memset(&z, 0, sizeof z);
  z.offsets = p->offsets;
  z.counts = p->counts;
  z.groups = p->groups;
  z.M = p->M;
  z.N = p->N;
  z.status = p->status;
  return z;
}
#endif

int mok__cg_f8_run(int mode, const mok__cg_f8 *p, int ctas, cudaStream_t stream) {
  if (!mok__cg_f8_takes(mode, p)) return MOK_EUNSUPPORTED;
#ifdef MOK_HAVE_CUTLASS
  const int config = cg_f8_config(mode, p);
  if (mode == MOK_CG_F8_DOWN_DGRAD) {
    if (p->offsets) { /* the unwritten rows: dg | du, h, the partials as DOWN_DGRAD's; the bytes */
      mok_gemm_params z = f8_rows_params(p);
      z.C0 = p->dgu;
      z.ldc = 2LL * p->N;
      z.C1 = p->h;
      z.partial = p->partial;
      z.n_partial = p->n_partial;
      dgrad_zero_rows<<<dim3(32, p->groups + 1), 256, 0, stream>>>(z);
      f8_dgrad_zero_q<<<dim3(32, p->groups + 1), 256, 0, stream>>>(*p);
    }
    return mok__cg_f8_dgrad_coop_128x128_c12(p, ctas, stream);
  }
  if (mode == MOK_CG_F8_PLAIN && p->offsets) { /* y's unwritten rows, as DOWN's */
    mok_gemm_params z = f8_rows_params(p);
    z.C0 = p->c[0];
    z.ldc = p->N;
    down_zero_rows<<<dim3(32, p->groups + 1), 256, 0, stream>>>(z);
  }
  int st;
  switch (config) {
  case CG_F8_COOP_128x128: st = mok__cg_f8_coop_128x128(p, ctas, stream); break;
  case CG_F8_COOP_128x128_C12: st = mok__cg_f8_coop_128x128_c12(p, ctas, stream); break;
  default: st = mok__cg_f8_pp_64x128_c2(p, ctas, stream); break;
  }
  if (st == MOK_OK && mode == MOK_CG_F8_GATE_UP) {
    f8_swiglu_rows<<<dim3(132, p->offsets ? p->groups + 1 : 1), 256, 0, stream>>>(*p);
    st = mok_k_launch_status();
  }
  return st;
#else
  (void)ctas;
  (void)stream;
  return MOK_EUNSUPPORTED;
#endif
}
