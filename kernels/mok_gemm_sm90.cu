/* The forward grouped GEMMs on Hopper (sm_90a): TMA + wgmma, warp
 * specialised, persistent.
 *
 *   GATE_UP  rows x I (x2), K=H   A routed_x [M,H], B W_g|W_u [E,I,H]  -> g, u, h (SwiGLU)
 *   DOWN     rows x H,      K=I   A h [M,I],        B W_d [E,H,I]      -> y
 *
 * One CTA per SM (384 threads): warpgroup 0 is the producer (one thread
 * issues TMA loads of 128x64 A and 256x64 B tiles into a 4-stage ring,
 * completion on "full" mbarriers); warpgroups 1 and 2 are consumers, each
 * owning 64 rows of the 128x256 output tile (wgmma m64n256k16, f32
 * accumulators in registers), releasing stages on "empty" mbarriers.
 * GATE_UP's 256 B rows are 128 gate rows then 128 up rows of the same
 * intermediate columns, so silu(g)*u is thread-local in the epilogue.
 *
 * Tiles: every 128-row block of the routed buffer times every column tile,
 * m-major, walked by CTA c as c, c+G, c+2G, ...; a block's expert comes from
 * the schedule's offsets on the device (groups start at multiples of 128,
 * so a block has one expert), exactly as the mma.sync kernel finds it.
 * Blocks past the last group and padding rows are written as zeros; a
 * consumer whose 64 rows are all padding skips its wgmmas. Each output
 * element is computed by one CTA with K in ascending 64-wide blocks, so
 * results are bitwise repeatable and independent of the grid size, and a
 * row's result depends only on its own input row.
 *
 * Bench knobs (mok_k_sm90_set_tuning; defaults measured best or equal, see
 * kernels/PERF.md v1): a pipelined consumer loop (one wgmma batch in
 * flight), banded tile order, L2 eviction hints on the TMA loads.
 */
#include <cudaTypedefs.h>
#include <stdlib.h>
#include <string.h>

#include "mok_gemm_sm90.h"
#include "mok_kernels_internal.cuh"
#include "mok_sm90_ptx.cuh"

#define S9_BM 128
#define S9_BN 256 /* B rows per tile (GATE_UP: 128 gate + 128 up) */
#define S9_BK 64  /* one 128-byte swizzle row of bf16 */
#define S9_STAGES 4
#define S9_THREADS 384
#define S9_CONSUMER_WARPS 8
#define S9_A_BYTES (S9_BM * S9_BK * 2)
#define S9_B_BYTES (S9_BN * S9_BK * 2)
#define S9_STAGE_BYTES (S9_A_BYTES + S9_B_BYTES)
#define S9_SMEM_BYTES (S9_STAGES * S9_STAGE_BYTES + 1024 + 2 * S9_STAGES * 8)

enum s9_mode { S9_GATE_UP = 0, S9_DOWN = 1 };

typedef struct s9_params {
  int M, N, K;         /* output rows (buffer), output columns, reduction */
  int tile_n;          /* output columns per tile: 128 (GATE_UP) or 256 */
  int m_tiles, n_tiles;
  int band;            /* > 0: bands of this many row blocks, column tiles outer */
  int pol_a, pol_b;    /* L2 policy of the A and B loads (l2_policy kinds) */
  int E_loc;           /* grouped: schedule's local experts */
  const int32_t *offsets, *counts; /* NULL: one group of M rows */
  bf16 *C0, *C1, *C2;  /* GATE_UP: g, u, h; DOWN: y */
  long long ldc;
  int has_limit;
  float limit;
  const int32_t *status;
} s9_params;

/* ---- SwiGLU (must match mok_gemm.cu bit for bit: explicit roundings) -------- */

__device__ static inline float s9_silu(float v) { return __fdiv_rn(v, __fadd_rn(1.0f, expf(-v))); }

/* ---- the device-side tile scheduler ------------------------------------------- */

/* Rows [row0, store_end) of the tile are written; [row0, used_end) hold real
 * rows. e = -1: past the last group (zeros only). Clamped like the mma.sync
 * kernel, so an unchecked schedule still stays in bounds. */
typedef struct s9_tile {
  int e, row0, used_end, store_end, n0;
} s9_tile;

__device__ static inline s9_tile s9_locate(const s9_params &p, int t) {
  s9_tile tl;
  int mb, nb;
  if (p.band > 0) { /* the CTAs at work share fewer A and B tiles (L2) */
    const int per = p.band * p.n_tiles, b = t / per, idx = t - b * per;
    const int bm = min(p.band, p.m_tiles - b * p.band);
    nb = idx / bm;
    mb = b * p.band + (idx - nb * bm);
  } else {
    mb = t / p.n_tiles;
    nb = t - mb * p.n_tiles;
  }
  tl.n0 = nb * p.tile_n;
  tl.row0 = mb * S9_BM;
  tl.e = 0;
  if (!p.offsets) {
    tl.used_end = tl.store_end = min(tl.row0 + S9_BM, p.M);
    return tl;
  }
  const int rows_used = min(max(p.offsets[p.E_loc], 0), p.M);
  if (tl.row0 >= rows_used) {
    tl.e = -1;
    tl.used_end = tl.row0;
    tl.store_end = min(tl.row0 + S9_BM, p.M);
    return tl;
  }
  tl.e = find_group(p.offsets, p.E_loc, tl.row0);
  const int group_end = min(max(p.offsets[tl.e + 1], tl.row0), p.M);
  tl.store_end = min(tl.row0 + S9_BM, group_end);
  const long long used = (long long)p.offsets[tl.e] + max(p.counts[tl.e], 0);
  tl.used_end = (int)min(max(used, (long long)tl.row0), (long long)tl.store_end);
  return tl;
}

/* ---- producer: one thread streams A and B tiles into the ring ----------------- */

template <int MODE>
__device__ static void s9_produce(const s9_params &p, const CUtensorMap *ma, const CUtensorMap *mb0,
                                  const CUtensorMap *mb1, uint32_t base, uint32_t bars) {
  const int total = p.m_tiles * p.n_tiles, nk = (p.K + S9_BK - 1) / S9_BK;
  const uint64_t pa = l2_policy(p.pol_a), pb = l2_policy(p.pol_b);
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const s9_tile tl = s9_locate(p, t);
    if (tl.used_end <= tl.row0) continue; /* zeros only: the consumers need no data */
    const int e = tl.e;
    for (int kb = 0; kb < nk; kb++) {
      const uint32_t full = bars + 8 * s, empty = bars + 8 * (S9_STAGES + s);
      const uint32_t sa = base + s * S9_STAGE_BYTES, sb = sa + S9_A_BYTES;
      mbar_wait(empty, ph ^ 1); /* the consumers released this stage */
      mbar_arrive_expect_tx(full, S9_STAGE_BYTES); /* whole boxes, out-of-bounds parts zero-filled */
      tma_load_2d_hint(sa, ma, kb * S9_BK, tl.row0, full, pa);
      if (MODE == S9_GATE_UP) {
        tma_load_3d_hint(sb, mb0, kb * S9_BK, tl.n0, e, full, pb);
        tma_load_3d_hint(sb + S9_B_BYTES / 2, mb1, kb * S9_BK, tl.n0, e, full, pb);
      } else {
        tma_load_3d_hint(sb, mb0, kb * S9_BK, tl.n0, e, full, pb);
      }
      if (++s == S9_STAGES) {
        s = 0;
        ph ^= 1;
      }
    }
  }
}

/* ---- consumers: wgmma over the ring, then the epilogue ------------------------ */

__device__ static inline void s9_store2(bf16 *dst, float a, float b) {
  *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}

/* Accumulator register i of m64n256 holds row 16*warp + lane/4 + 8*((i>>1)&1),
 * column 8*(i>>2) + 2*(lane%4) + (i&1) of the warpgroup's 64x256 block. */
template <int MODE>
__device__ static inline void s9_epilogue(const s9_params &p, const s9_tile &tl, const float (&acc)[128],
                                          int cw) {
  const int lt = threadIdx.x & 127, warp = lt >> 5, lane = lt & 31;
  const int rbase = tl.row0 + 64 * cw + 16 * warp + (lane >> 2), cq = 2 * (lane & 3);
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int r = rbase + 8 * hh;
    if (r >= tl.store_end) continue;
    const bool used = r < tl.used_end;
    const long long row = (long long)r * p.ldc;
    if (MODE == S9_GATE_UP) {
#pragma unroll
      for (int j = 0; j < 16; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        float gv[2] = {0.0f, 0.0f}, uv[2] = {0.0f, 0.0f}, hv[2] = {0.0f, 0.0f};
        if (used) {
#pragma unroll
          for (int c = 0; c < 2; c++) {
            gv[c] = bf2f(f2bf(acc[4 * j + 2 * hh + c]));
            uv[c] = bf2f(f2bf(acc[64 + 4 * j + 2 * hh + c]));
            float gc = gv[c], uc = uv[c];
            if (p.has_limit) {
              gc = fminf(gc, p.limit);
              uc = fminf(fmaxf(uc, -p.limit), p.limit);
            }
            hv[c] = __fmul_rn(s9_silu(gc), uc);
          }
        }
        s9_store2(p.C0 + row + n, gv[0], gv[1]);
        s9_store2(p.C1 + row + n, uv[0], uv[1]);
        s9_store2(p.C2 + row + n, hv[0], hv[1]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 32; j++) {
        const int n = tl.n0 + 8 * j + cq;
        if (n >= p.N) continue;
        s9_store2(p.C0 + row + n, used ? acc[4 * j + 2 * hh] : 0.0f,
                  used ? acc[4 * j + 2 * hh + 1] : 0.0f);
      }
    }
  }
}

/* The consumer warpgroup's k loop over one tile. PIPE = 1 keeps one wgmma
 * batch in flight and releases the previous stage once it is known
 * complete; PIPE = 0 waits for each batch. s, ph: the ring position. */
template <int PIPE>
__device__ static inline void s9_mma_loop(float (&acc)[128], uint32_t base, uint32_t bars, int cw,
                                          int nk, int &s, int &ph) {
  const bool lead = (threadIdx.x & 31) == 0; /* one arrival per warp */
  int prev = -1;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    const uint32_t sa = base + s * S9_STAGE_BYTES;
    const uint64_t da = wgmma_desc_k128(sa + cw * 64 * 128);
    const uint64_t db = wgmma_desc_k128(sa + S9_A_BYTES);
    acc_fence(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < S9_BK / 16; k++) /* +32 B along K per step: +2 in the address field */
      wgmma_m64n256k16(acc, da + 2 * k, db + 2 * k, (kb > 0 || k > 0) ? 1 : 0);
    wgmma_commit();
    if (PIPE) {
      wgmma_wait<1>();
      acc_fence(acc);
      mbar_arrive_if(bars + 8 * (S9_STAGES + prev), lead && prev >= 0);
      prev = s;
    } else {
      wgmma_wait<0>();
      acc_fence(acc);
      mbar_arrive_if(bars + 8 * (S9_STAGES + s), lead);
    }
    if (++s == S9_STAGES) {
      s = 0;
      ph ^= 1;
    }
  }
  if (PIPE) {
    wgmma_wait<0>();
    acc_fence(acc);
    mbar_arrive_if(bars + 8 * (S9_STAGES + prev), lead && prev >= 0);
  }
}

/* A warpgroup whose 64 rows are all padding: follow the ring, no math. */
__device__ static inline void s9_skip_loop(uint32_t bars, int nk, int &s, int &ph) {
  const bool lead = (threadIdx.x & 31) == 0;
  for (int kb = 0; kb < nk; kb++) {
    mbar_wait(bars + 8 * s, ph);
    mbar_arrive_if(bars + 8 * (S9_STAGES + s), lead);
    if (++s == S9_STAGES) {
      s = 0;
      ph ^= 1;
    }
  }
}

template <int MODE, int PIPE>
__device__ static void s9_consume(const s9_params &p, uint32_t base, uint32_t bars) {
  const int cw = threadIdx.x / 128 - 1; /* rows 64*cw .. of the tile */
  const int total = p.m_tiles * p.n_tiles, nk = (p.K + S9_BK - 1) / S9_BK;
  float acc[128];
#pragma unroll
  for (int i = 0; i < 128; i++) acc[i] = 0.0f;
  int s = 0, ph = 0;
  for (int t = blockIdx.x; t < total; t += gridDim.x) {
    const s9_tile tl = s9_locate(p, t);
    if (tl.used_end > tl.row0) {
      if (tl.row0 + 64 * cw < tl.used_end)
        s9_mma_loop<PIPE>(acc, base, bars, cw, nk, s, ph);
      else /* all padding: the epilogue writes zeros */
        s9_skip_loop(bars, nk, s, ph);
    }
    s9_epilogue<MODE>(p, tl, acc, cw);
  }
}

template <int MODE, int PIPE>
__global__ void __launch_bounds__(S9_THREADS, 1)
    s9_gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b0,
                   const __grid_constant__ CUtensorMap map_b1, const s9_params p) {
  extern __shared__ __align__(1024) unsigned char s9_smem_raw[];
  __shared__ int s_failed;
  /* the 128-byte swizzle is computed from address bits: stages 1024-aligned */
  const uint32_t base = (s9_smem(s9_smem_raw) + 1023u) & ~1023u;
  const uint32_t bars = base + S9_STAGES * S9_STAGE_BYTES; /* full[S], then empty[S] */
  if (threadIdx.x == 0) {
    s_failed = job_failed(p.status);
    if (!s_failed) {
      for (int i = 0; i < S9_STAGES; i++) {
        mbar_init(bars + 8 * i, 1);
        mbar_init(bars + 8 * (S9_STAGES + i), S9_CONSUMER_WARPS);
      }
      mbar_fence_init();
      tma_prefetch_map(&map_a);
      tma_prefetch_map(&map_b0);
      if (MODE == S9_GATE_UP) tma_prefetch_map(&map_b1);
    }
  }
  __syncthreads();
  if (s_failed) return; /* one decision for the whole CTA */
  if (threadIdx.x < 128) {
    regs_dec<40>();
    if (threadIdx.x == 0) s9_produce<MODE>(p, &map_a, &map_b0, &map_b1, base, bars);
  } else {
    regs_inc<232>();
    s9_consume<MODE, PIPE>(p, base, bars);
  }
}

/* ---- host side ------------------------------------------------------------------ */

static int s9_grid_override = 0;
static int s9_pipe = 0, s9_band = 0, s9_pol_a = 0, s9_pol_b = 0;

extern "C" void mok_k_sm90_set_grid(int ctas) { s9_grid_override = ctas > 0 ? ctas : 0; }

extern "C" void mok_k_sm90_set_tuning(int pipe, int band, int pol_a, int pol_b) {
  s9_pipe = pipe ? 1 : 0;
  s9_band = band > 0 ? band : 0;
  s9_pol_a = pol_a >= 0 && pol_a <= 2 ? pol_a : 0;
  s9_pol_b = pol_b >= 0 && pol_b <= 2 ? pol_b : 0;
}

/* cuTensorMapEncodeTiled through the runtime (the library never links
 * libcuda: machines without a GPU have none). */
static PFN_cuTensorMapEncodeTiled_v12000 s9_lookup_encode(void) {
  void *fn = NULL;
  cudaDriverEntryPointQueryResult q;
  if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                       &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return NULL;
  }
  return (PFN_cuTensorMapEncodeTiled_v12000)fn;
}

static PFN_cuTensorMapEncodeTiled_v12000 s9_encode_fn(void) {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = s9_lookup_encode(); /* thread-safe init */
  return fn;
}

extern "C" int mok_k_sm90_usable(void) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return major == 9 && minor == 0 && s9_encode_fn() != NULL;
}

extern "C" int mok_k_sm90_init(void) {
  const void *k[4] = {(const void *)s9_gemm_kernel<S9_GATE_UP, 0>,
                      (const void *)s9_gemm_kernel<S9_GATE_UP, 1>,
                      (const void *)s9_gemm_kernel<S9_DOWN, 0>, (const void *)s9_gemm_kernel<S9_DOWN, 1>};
  cudaError_t err = cudaSuccess;
  for (int i = 0; i < 4 && err == cudaSuccess; i++)
    err = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize, S9_SMEM_BYTES);
  if (err != cudaSuccess) {
    mok_k_set_cuda_error((int)err);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

/* A row-major bf16 tensor [d2][d1][d0] (d0 contiguous) as a TMA map with
 * boxes of 64 x box1 (x 1), 128-byte swizzle, zero fill out of bounds. */
static int s9_map(CUtensorMap *m, const void *ptr, int rank, long long d0, long long d1,
                  long long d2, int box1) {
  PFN_cuTensorMapEncodeTiled_v12000 enc = s9_encode_fn();
  if (!enc) return MOK_EENGINE;
  cuuint64_t dims[3] = {(cuuint64_t)d0, (cuuint64_t)d1, (cuuint64_t)d2};
  cuuint64_t strides[2] = {(cuuint64_t)d0 * 2, (cuuint64_t)(d0 * d1) * 2};
  cuuint32_t box[3] = {S9_BK, (cuuint32_t)box1, 1};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)ptr, dims, strides,
                   box, estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? MOK_OK : MOK_EENGINE;
}

static int s9_grid(int tiles) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    (void)cudaGetLastError();
    sms = 132;
  }
  int g = s9_grid_override > 0 ? s9_grid_override : sms;
  return g < tiles ? g : tiles;
}

static s9_params s9_base(const mok_k_dims *d, const int32_t *schedule, int M, int32_t *status) {
  s9_params p;
  memset(&p, 0, sizeof p);
  p.M = M;
  p.has_limit = d->has_limit;
  p.limit = d->limit;
  p.status = status;
  if (schedule) {
    sched_ptrs s = sched_view(d, schedule);
    p.E_loc = d->E_loc;
    p.offsets = s.offsets;
    p.counts = s.counts;
  }
  return p;
}

template <int MODE>
static int s9_launch(const s9_params &p, const CUtensorMap &a, const CUtensorMap &b0,
                     const CUtensorMap &b1, cudaStream_t stream) {
  const int tiles = p.m_tiles * p.n_tiles;
  if (tiles == 0) return MOK_OK;
  s9_params q = p;
  q.band = s9_band;
  q.pol_a = s9_pol_a;
  q.pol_b = s9_pol_b;
  if (s9_pipe)
    s9_gemm_kernel<MODE, 1><<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, b0, b1, q);
  else
    s9_gemm_kernel<MODE, 0><<<s9_grid(tiles), S9_THREADS, S9_SMEM_BYTES, stream>>>(a, b0, b1, q);
  return mok_k_launch_status();
}

extern "C" int mok_k_sm90_gate_up(const mok_k_dims *d, const int32_t *schedule, int M,
                                  int n_inter, const mok_k_bf16 *x, const mok_k_bf16 *wg,
                                  const mok_k_bf16 *wu, mok_k_bf16 *g, mok_k_bf16 *u,
                                  mok_k_bf16 *h, int32_t *status, mok_k_stream stream) {
  if (M <= 0 || n_inter <= 0) return MOK_OK;
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = n_inter;
  p.K = d->H;
  p.tile_n = S9_BN / 2;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (n_inter + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)g;
  p.C1 = (bf16 *)u;
  p.C2 = (bf16 *)h;
  p.ldc = n_inter;
  CUtensorMap ma, mg, mu;
  int st = s9_map(&ma, x, 2, d->H, M, 1, S9_BM);
  if (st == MOK_OK) st = s9_map(&mg, wg, 3, d->H, n_inter, groups, S9_BN / 2);
  if (st == MOK_OK) st = s9_map(&mu, wu, 3, d->H, n_inter, groups, S9_BN / 2);
  if (st != MOK_OK) return st;
  return s9_launch<S9_GATE_UP>(p, ma, mg, mu, stream);
}

extern "C" int mok_k_sm90_down(const mok_k_dims *d, const int32_t *schedule, int M, int n_inter,
                               const mok_k_bf16 *h, const mok_k_bf16 *wd, mok_k_bf16 *y,
                               int32_t *status, mok_k_stream stream) {
  if (M <= 0) return MOK_OK;
  const int groups = schedule ? d->E_loc : 1;
  s9_params p = s9_base(d, schedule, M, status);
  p.N = d->H;
  p.K = n_inter;
  p.tile_n = S9_BN;
  p.m_tiles = (M + S9_BM - 1) / S9_BM;
  p.n_tiles = (d->H + p.tile_n - 1) / p.tile_n;
  p.C0 = (bf16 *)y;
  p.ldc = d->H;
  CUtensorMap ma, mb;
  int st = s9_map(&ma, h, 2, n_inter, M, 1, S9_BM);
  if (st == MOK_OK) st = s9_map(&mb, wd, 3, n_inter, d->H, groups, S9_BN);
  if (st != MOK_OK) return st;
  return s9_launch<S9_DOWN>(p, ma, mb, mb, stream);
}
