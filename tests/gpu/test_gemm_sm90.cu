/* SPDX-License-Identifier: Apache-2.0 */
/* Device test and focused bench of the Hopper GEMMs
 * (kernels/mok_gemm_sm90.cu) against the mma.sync kernels and a float64
 * host reference.
 *
 *   test_gemm_sm90 correct   shapes with ragged and empty experts, one hot
 *                            expert, T not a multiple of the tile, clamp,
 *                            K tails, the shared expert: every output
 *                            written (poisoned before), padding rows zero,
 *                            error vs float64, difference vs mma.sync,
 *                            bitwise repeatable over grid sizes, every
 *                            tile variant (v3) bitwise equal to the
 *                            default Hopper path and mma.sync, a row's
 *                            result independent of the other rows, NaN in
 *                            padding rows harmless
 *   test_gemm_sm90 bench [SHAPE [T]]
 *                            the benchmark shapes at T=2048 and 8192, balanced
 *                            routing: TFLOP/s of gate_up and down, new (and
 *                            its tuning variants) vs mma.sync in the same
 *                            process; y must equal mma.sync's bit for bit
 *   test_gemm_sm90 bwd       the backward GEMMs (down dgrad, gate/up dgrad,
 *                            wgrad) through mok_k_expert_backward and
 *                            mok_k_shared_backward on the correct shapes:
 *                            each mode alone and all together on the new
 *                            kernels must equal mma.sync bit for bit (all
 *                            outputs poisoned first), also with grids 7 and
 *                            1, in every tile variant and with NaN in the
 *                            padding rows
 *   correct and bwd take the cutlass variant's choice as a second word:
 *                            every (the default: every product with a
 *                            CUTLASS configuration, whatever its rows) or
 *                            every-pp (the same on the ping-pong ones)
 *   test_gemm_sm90 profile SHAPE T [VARIANTS]
 *                            one launch of each GEMM per tile variant
 *                            (default "rows,cluster") inside a profiler
 *                            range, for ncu --profile-from-start off
 *   test_gemm_sm90 fp8       the block-scaled e4m3 grouped GEMM as the down
 *                            projection against float64 over the same e4m3
 *                            values (ragged, one hot expert, T=1), padding
 *                            rows zero, bitwise repeatable
 *   test_gemm_sm90 fp8bench [SHAPE]
 *                            its time beside the bf16 down GEMM's at the
 *                            benchmark shapes, T=2048 and 8192
 *   test_gemm_sm90 trace SHAPE T
 *                            (a build with -DMOK_TILE_TRACE=1) where the two
 *                            weight gradients' tile time goes
 *   test_gemm_sm90 bwdbench [SHAPE [T]]
 *                            the benchmark shapes: expert_backward with all
 *                            backward GEMMs on mma.sync, each alone on the
 *                            new kernels, all on them; the new kernels
 *                            timed alone; outputs compared bitwise
 * Exit status 0 only when every check passed.
 */
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "../../kernels/common/fp8_e4m3.h"
#include "../../kernels/common/tile_trace.cuh"
#include "../../kernels/mok_gemm_sm90.h"
#include "../harness/kernel_choices.h"
#include "../../kernels/mok_kernels.h"
#include "../../kernels/mok_kernels_internal.cuh"
#include "../../proto/mok_status.h"

extern "C" {
#include "host_bf16_rng.h"
}

#include "../harness/cuda_check.cuh"
#include "../harness/model_shapes.h"

/* ---- device helpers ---------------------------------------------------------------- */


/* elements whose bits differ, and the largest |a - b| (test-only atomics) */
__global__ void diff_bf16(const uint16_t *a, const uint16_t *b, size_t n,
                          unsigned long long *ndiff, unsigned *maxbits) {
  unsigned long long mine = 0;
  float mx = 0.0f;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    if (a[i] != b[i]) {
      mine++;
      float fa = __uint_as_float((uint32_t)a[i] << 16), fb = __uint_as_float((uint32_t)b[i] << 16);
      float d = fabsf(fa - fb);
      if (!(d <= mx)) mx = isnan(d) ? 3.0e38f : d;
    }
  }
  if (mine) atomicAdd(ndiff, mine);
  atomicMax(maxbits, __float_as_uint(mx));
}

static void fill(uint16_t *p, size_t n, uint32_t seed, float scale) {
  if (n) fill_bf16<<<1024, 256>>>(p, n, seed, scale);
  CUDA_CHECK(cudaGetLastError());
}

static void *dmalloc(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static std::vector<uint16_t> down16(const uint16_t *p, size_t n) {
  std::vector<uint16_t> v(n);
  if (n) CUDA_CHECK(cudaMemcpy(v.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return v;
}

static void up16(uint16_t *p, const std::vector<uint16_t> &v) {
  if (!v.empty()) CUDA_CHECK(cudaMemcpy(p, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
}

/* the GEMM backend of the public launchers: mma.sync, or the Hopper kernels */
static void set_hmma(bool on) {
  const int want = on ? MOK_K_GEMM_HMMA : MOK_K_GEMM_SM90;
  if (mok_k_set_gemm_backend(want) != want) {
    fprintf(stderr, "the %s backend is not available\n", on ? "mma.sync" : "Hopper");
    exit(2);
  }
}

/* the Hopper kernels' tile variant (mok_gemm_sm90.h) */
static void set_variant(int v) {
  if (mok_k_sm90_set_variant(v) != MOK_OK) {
    fprintf(stderr, "unknown sm90 variant %d\n", v);
    exit(2);
  }
}

/* where the parts of a schedule of these dims start (proto/mok_layout.h) */
typedef struct sched_parts {
  const int32_t *counts, *offsets, *row_slot, *slot_row;
} sched_parts;

static sched_parts parts_of(const mok_k_dims *d, const std::vector<int32_t> &sched) {
  const mok_layout_dims l = mok_k_layout_dims(d);
  sched_parts s;
  s.counts = sched.data() + mok_sched_counts_at(&l);
  s.offsets = sched.data() + mok_sched_offsets_at(&l);
  s.row_slot = sched.data() + mok_sched_row_slot_at(&l);
  s.slot_row = sched.data() + mok_sched_slot_row_at(&l);
  return s;
}

/* ---- one routed layer on the device ------------------------------------------------ */

typedef struct layer {
  mok_k_dims d;
  long long R, sched_ints;
  uint16_t *x, *wg, *wu, *wd, *rx, *g, *u, *h, *y;
  int32_t *ids, *sched, *status;
  void *ws;
} layer;

static mok_k_dims make_dims(int T, int H, int I, int E_loc, int K, int limit) {
  mok_k_dims d;
  memset(&d, 0, sizeof d);
  d.T = T;
  d.H = H;
  d.I = I;
  d.E = E_loc;
  d.E_loc = E_loc;
  d.first_expert = 0;
  d.K = K;
  d.I_s = 0;
  d.row_align = mok_k_row_align();
  d.has_limit = limit;
  d.limit = 1.0f;
  return d;
}

static void layer_alloc(layer *L, const mok_k_dims *d) {
  L->d = *d;
  L->R = mok_k_rows_capacity(d);
  L->sched_ints = mok_k_schedule_ints(d);
  const size_t W = (size_t)d->E_loc * d->I * d->H;
  L->x = (uint16_t *)dmalloc((size_t)d->T * d->H * 2);
  L->wg = (uint16_t *)dmalloc(W * 2);
  L->wu = (uint16_t *)dmalloc(W * 2);
  L->wd = (uint16_t *)dmalloc(W * 2);
  L->rx = (uint16_t *)dmalloc((size_t)L->R * d->H * 2);
  L->g = (uint16_t *)dmalloc((size_t)L->R * d->I * 2);
  L->u = (uint16_t *)dmalloc((size_t)L->R * d->I * 2);
  L->h = (uint16_t *)dmalloc((size_t)L->R * d->I * 2);
  L->y = (uint16_t *)dmalloc((size_t)L->R * d->H * 2);
  L->ids = (int32_t *)dmalloc((size_t)d->T * d->K * 4);
  L->sched = (int32_t *)dmalloc((size_t)L->sched_ints * 4);
  L->status = (int32_t *)dmalloc(4);
  L->ws = dmalloc(mok_k_workspace_bytes(d));
}

static void layer_free(layer *L) {
  void *p[] = {L->x, L->wg, L->wu, L->wd, L->rx, L->g, L->u, L->h, L->y, L->ids, L->sched,
               L->status, L->ws};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_CHECK(cudaFree(p[i]));
}

/* schedule + gather from the ids on the device */
static void layer_route(layer *L, const std::vector<int32_t> &ids) {
  if (!ids.empty())
    CUDA_CHECK(cudaMemcpy(L->ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(L->status, 0, 4));
  MOK_CHECK(mok_k_schedule_build(&L->d, L->ids, L->sched, L->ws, L->status, 0));
  MOK_CHECK(mok_k_gather_rows(&L->d, L->sched, L->x, L->rx, L->status, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
}

static void poison(layer *L) {
  const size_t RI = (size_t)L->R * L->d.I * 2, RH = (size_t)L->R * L->d.H * 2;
  CUDA_CHECK(cudaMemset(L->g, 0xff, RI));
  CUDA_CHECK(cudaMemset(L->u, 0xff, RI));
  CUDA_CHECK(cudaMemset(L->h, 0xff, RI));
  CUDA_CHECK(cudaMemset(L->y, 0xff, RH));
}

/* the forward GEMMs through the public launchers; hmma picks the path */
static void layer_forward(layer *L, bool hmma) {
  set_hmma(hmma);
  MOK_CHECK(mok_k_gate_up_swiglu(&L->d, L->sched, L->rx, L->wg, L->wu, L->g, L->u, L->h,
                                 L->status, 0));
  MOK_CHECK(mok_k_down(&L->d, L->sched, L->h, L->wd, L->y, L->status, 0));
  set_hmma(false);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  int32_t st = -1;
  CUDA_CHECK(cudaMemcpy(&st, L->status, 4, cudaMemcpyDeviceToHost));
  EXPECT(st == 0, "status %d after the forward", st);
}

typedef struct outs {
  std::vector<uint16_t> g, u, h, y;
} outs;

static outs snap(const layer *L) {
  outs o;
  o.g = down16(L->g, (size_t)L->R * L->d.I);
  o.u = down16(L->u, (size_t)L->R * L->d.I);
  o.h = down16(L->h, (size_t)L->R * L->d.I);
  o.y = down16(L->y, (size_t)L->R * L->d.H);
  return o;
}

static bool same(const outs &a, const outs &b) {
  return a.g == b.g && a.u == b.u && a.h == b.h && a.y == b.y;
}

/* ---- float64 reference on the kernel's own rows ------------------------------------- */

static double silu64(double v) { return v / (1.0 + exp(-v)); }

typedef struct errs {
  double num[4], den[4]; /* g, u, h, y */
} errs;

/* Row r of expert e, its input row xr: g, u from x (float64); h from the
 * kernel's own rounded g, u; y from the kernel's own h (so each GEMM is
 * checked on its own inputs). */
static void ref_row(const layer *L, const outs &o, const std::vector<uint16_t> &xr,
                    const std::vector<uint16_t> &wg, const std::vector<uint16_t> &wu,
                    const std::vector<uint16_t> &wd, long long r, int e, errs *E) {
  const int H = L->d.H, I = L->d.I;
  const double lim = L->d.limit;
  for (int c = 0; c < I; c++) {
    double g = 0, u = 0;
    const uint16_t *a = &xr[(size_t)r * H], *bg = &wg[((size_t)e * I + c) * H],
                   *bu = &wu[((size_t)e * I + c) * H];
    for (int k = 0; k < H; k++) {
      double xv = host_bf2d(a[k]);
      g += xv * host_bf2d(bg[k]);
      u += xv * host_bf2d(bu[k]);
    }
    const size_t at = (size_t)r * I + c;
    double gk = host_bf2d(o.g[at]), uk = host_bf2d(o.u[at]);
    E->num[0] += (gk - g) * (gk - g);
    E->den[0] += g * g;
    E->num[1] += (uk - u) * (uk - u);
    E->den[1] += u * u;
    if (L->d.has_limit) {
      gk = std::min(gk, lim);
      uk = std::min(std::max(uk, -lim), lim);
    }
    const double hr = silu64(gk) * uk, hk = host_bf2d(o.h[at]);
    E->num[2] += (hk - hr) * (hk - hr);
    E->den[2] += hr * hr;
  }
  for (int n = 0; n < H; n++) {
    double y = 0;
    const uint16_t *a = &o.h[(size_t)r * I], *b = &wd[((size_t)e * H + n) * I];
    for (int k = 0; k < I; k++) y += host_bf2d(a[k]) * host_bf2d(b[k]);
    const double yk = host_bf2d(o.y[(size_t)r * H + n]);
    E->num[3] += (yk - y) * (yk - y);
    E->den[3] += y * y;
  }
}

static double rel(const errs &E, int i) {
  return E.den[i] > 0 ? sqrt(E.num[i] / E.den[i]) : sqrt(E.num[i]);
}

/* ---- the correctness cases ------------------------------------------------------------ */

enum route { R_RANDOM, R_HOLES, R_ONE };

typedef struct tcase {
  const char *name;
  int T, H, I, E_loc, K, limit, route;
  double p_drop;
  int ref_rows; /* rows checked against float64 (0: all) */
} tcase;

static const tcase CASES[] = {
    /* name           T     H     I    Eloc K  lim route     drop  ref */
    {"ragged_holes",  333,  256,  192, 8,   2, 0,  R_HOLES,  0.1,  0},
    {"one_expert",    300,  128,  128, 4,   1, 0,  R_ONE,    0.0,  0},
    {"odd_clamp",     77,   200,  136, 5,   3, 1,  R_RANDOM, 0.2,  0},
    {"k_tail",        129,  72,   96,  3,   2, 0,  R_RANDOM, 0.0,  0},
    {"T1",            1,    64,   64,  1,   1, 0,  R_RANDOM, 0.0,  0},
    {"T0",            0,    64,   64,  4,   2, 0,  R_RANDOM, 0.0,  0},
    {"wide",          1000, 1024, 512, 16,  4, 0,  R_HOLES,  0.05, 96},
    {"big_k",         700,  4096, 1024, 6,  2, 1,  R_RANDOM, 0.05, 48},
    {"wide_inter",    160,  128,  1152, 3,  2, 0,  R_RANDOM, 0.0,  0},
};

static std::vector<int32_t> make_ids(const tcase *c) {
  std::vector<int32_t> ids((size_t)c->T * c->K, -1);
  for (int t = 0; t < c->T; t++)
    for (int k = 0; k < c->K; k++) {
      int32_t id = -1;
      for (int tries = 0; tries < 64; tries++) {
        if (c->route == R_ONE) {
          id = c->E_loc > 1 ? 1 : 0;
          break;
        }
        id = (int32_t)(rng_next() % c->E_loc);
        /* holes: experts 1 and E_loc-2 never chosen (empty groups) */
        if (c->route == R_HOLES && (id == 1 || id == c->E_loc - 2)) continue;
        bool dup = false;
        for (int j = 0; j < k; j++) dup |= ids[(size_t)t * c->K + j] == id;
        if (!dup) break;
      }
      if (rng_unit() < c->p_drop) id = -1;
      ids[(size_t)t * c->K + k] = id;
    }
  return ids;
}

static void compare_paths(const char *name, const char *what, const std::vector<uint16_t> &a,
                          const std::vector<uint16_t> &b) {
  size_t ndiff = 0;
  double num = 0, den = 0, mx = 0;
  for (size_t i = 0; i < a.size(); i++) {
    double x = host_bf2d(a[i]), y = host_bf2d(b[i]);
    if (a[i] != b[i]) ndiff++;
    num += (x - y) * (x - y);
    den += y * y;
    mx = std::max(mx, fabs(x - y));
  }
  const double r = den > 0 ? sqrt(num / den) : sqrt(num);
  printf("    vs mma.sync %-2s: %zu of %zu differ (%.3f%%), rel %.2e, max|d| %.3g\n", what, ndiff,
         a.size(), a.size() ? 100.0 * ndiff / a.size() : 0.0, r, mx);
  EXPECT(r < 1e-2, "%s: %s differs from the mma.sync kernel (rel %.3e)", name, what, r);
}

/* elements whose bits differ over g, u, h, y */
static size_t outs_ndiff(const outs &a, const outs &b) {
  size_t n = 0;
  const std::vector<uint16_t> *x[4] = {&a.g, &a.u, &a.h, &a.y}, *y[4] = {&b.g, &b.u, &b.h, &b.y};
  for (int k = 0; k < 4; k++) {
    n += x[k]->size() != y[k]->size();
    for (size_t i = 0; i < x[k]->size() && i < y[k]->size(); i++) n += (*x[k])[i] != (*y[k])[i];
  }
  return n;
}

/* The forward of every variant but the default, at grids 132 (0), 7 and 1,
 * outputs poisoned first: each must equal the default Hopper path (o) and
 * mma.sync (hm) bit for bit. */
static void test_variants_fwd(const char *name, layer *L, const outs &o, const outs &hm) {
  const int grids[3] = {0, 7, 1};
  for (int v = 1; v < MOK_K_SM90_VARIANTS; v++) {
    size_t worst_o = 0, worst_h = 0;
    for (int gi = 0; gi < 3; gi++) {
      set_variant(v);
      mok_k_sm90_set_grid(grids[gi]);
      poison(L);
      layer_forward(L, false);
      const outs ov = snap(L);
      mok_k_sm90_set_grid(0);
      set_variant(MOK_K_SM90_ROWS);
      const size_t d_o = outs_ndiff(ov, o), d_h = outs_ndiff(ov, hm);
      worst_o = std::max(worst_o, d_o);
      worst_h = std::max(worst_h, d_h);
      EXPECT(d_o == 0 && d_h == 0,
             "%s: variant %s, grid %d: %zu elements differ from the default path, %zu from "
             "mma.sync",
             name, mok_k_sm90_variant_name(v), grids[gi], d_o, d_h);
    }
    printf("    variant %-8s (grids 132/7/1): differ from rows %zu, from mma.sync %zu%s\n",
           mok_k_sm90_variant_name(v), worst_o, worst_h,
           worst_o | worst_h ? "" : "  (bitwise equal)");
  }
  /* the pairs' k loops with one wgmma batch in flight (the bench's pipe knob) */
  for (int gi = 0; gi < 3; gi++) {
    set_variant(MOK_K_SM90_PINGPONG);
    mok_k_sm90_set_tuning(1, 0, 0, 0);
    mok_k_sm90_set_grid(grids[gi]);
    poison(L);
    layer_forward(L, false);
    const outs ov = snap(L);
    mok_k_sm90_set_grid(0);
    mok_k_sm90_set_tuning(0, 0, 0, 0);
    set_variant(MOK_K_SM90_ROWS);
    const size_t d_o = outs_ndiff(ov, o), d_h = outs_ndiff(ov, hm);
    EXPECT(d_o == 0 && d_h == 0,
           "%s: pingpong with the pipelined k loop, grid %d: %zu elements differ from the "
           "default path, %zu from mma.sync",
           name, grids[gi], d_o, d_h);
    if (gi == 2)
      printf("    pingpong, pipelined k loop (grids 132/7/1): %s\n",
             d_o | d_h ? "DIFFERS" : "bitwise equal");
  }
}

/* One forward from x (mok_k_expert_forward_gathering) with the outputs
 * poisoned and the routed_x scratch all NaN first: true when the scratch
 * is still all NaN after it (the gate/up producer gathered the rows). */
static bool forward_from_x(layer *L, uint16_t *scratch, size_t RH) {
  poison(L);
  CUDA_CHECK(cudaMemset(scratch, 0xff, RH * 2));
  MOK_CHECK(mok_k_expert_forward_gathering(&L->d, L->sched, L->x, scratch, L->wg, L->wu, L->wd,
                                           L->g, L->u, L->y, L->ws, L->status, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<uint16_t> sc = down16(scratch, RH);
  size_t untouched = 0;
  for (size_t i = 0; i < sc.size(); i++) untouched += sc[i] == 0xffff;
  return RH > 0 && untouched == RH;
}

/* The forward from x (mok_k_expert_forward_gathering): on the cluster
 * variants the gate/up producer gathers the rows itself and the routed_x
 * scratch is never read, elsewhere gather_rows fills it first. The scratch
 * starts as NaN, every variant at grids 132/7/1 and mma.sync: g, u and y
 * bitwise equal to the routed path's (o). */
static void test_gathering_fwd(const char *name, layer *L, const outs &o) {
  const mok_k_dims *d = &L->d;
  mok_k_sm90_set_gather_a(1);
  const size_t RH = (size_t)L->R * d->H;
  uint16_t *scratch = (uint16_t *)dmalloc(RH * 2 + 16);
  const int grids[3] = {0, 7, 1};
  int gathered = 0, runs = 0;
  for (int v = -1; v < MOK_K_SM90_VARIANTS; v++) /* -1: mma.sync */
    for (int gi = 0; gi < (v < 0 ? 1 : 3); gi++) {
      set_hmma(v < 0);
      if (v >= 0) set_variant(v);
      mok_k_sm90_set_grid(grids[gi]);
      const bool in_producer = forward_from_x(L, scratch, RH);
      mok_k_sm90_set_grid(0);
      set_variant(MOK_K_SM90_ROWS);
      set_hmma(false);
      int32_t st = -1;
      CUDA_CHECK(cudaMemcpy(&st, L->status, 4, cudaMemcpyDeviceToHost));
      const outs ov = snap(L);
      size_t nd = 0;
      for (size_t i = 0; i < o.g.size(); i++) nd += (ov.g[i] != o.g[i]) + (ov.u[i] != o.u[i]);
      for (size_t i = 0; i < o.y.size(); i++) nd += ov.y[i] != o.y[i];
      gathered += in_producer;
      runs++;
      EXPECT(st == 0 && nd == 0,
             "%s: forward from x, %s, grid %d: status %d, %zu elements of g, u, y differ from the "
             "routed path",
             name, v < 0 ? "mma.sync" : mok_k_sm90_variant_name(v), grids[gi], st, nd);
      /* the pair variants gather in the producer (T > 0); rows, expert and
       * mma.sync copy first; quad does either (it runs pairs when its
       * column tiles do not pair up) */
      const bool pairs = v == MOK_K_SM90_CLUSTER || v == MOK_K_SM90_PINGPONG ||
                         v == MOK_K_SM90_CUTLASS;
      EXPECT(d->T == 0 || mok_k_sm90_pair_clusters() == 0 || v == MOK_K_SM90_QUAD ||
                 in_producer == pairs,
             "%s: forward from x, %s: routed_x %s", name,
             v < 0 ? "mma.sync" : mok_k_sm90_variant_name(v),
             in_producer ? "untouched where a copy was due" : "written by a gathering producer");
    }
  mok_k_sm90_set_gather_a(0);
  /* off: every variant copies first */
  set_variant(MOK_K_SM90_PINGPONG);
  forward_from_x(L, scratch, RH);
  set_variant(MOK_K_SM90_ROWS);
  const std::vector<uint16_t> sc = down16(scratch, RH), xr = down16(L->rx, RH);
  const outs ov = snap(L);
  EXPECT(sc == xr && ov.g == o.g && ov.u == o.u && ov.y == o.y,
         "%s: forward from x, gathering off: routed_x or the outputs differ from gather_rows and "
         "the routed path",
         name);
  /* the default: in the producer where I is small enough, else copied first */
  mok_k_sm90_set_gather_a(-1);
  set_variant(MOK_K_SM90_PINGPONG);
  {
    const bool in_producer = forward_from_x(L, scratch, RH);
    set_variant(MOK_K_SM90_ROWS);
    const outs od = snap(L);
    EXPECT(od.g == o.g && od.u == o.u && od.y == o.y,
           "%s: forward from x, the default: outputs differ from the routed path", name);
    EXPECT(d->T == 0 || mok_k_sm90_pair_clusters() == 0 ||
               in_producer == (d->I <= MOK_K_SM90_GATHER_MAX_I),
           "%s: forward from x, the default at I=%d: %s", name, d->I,
           in_producer ? "gathered in the producer" : "copied first");
  }
  printf("    forward from x: %d runs bitwise equal to the routed path, %d gathered in the "
         "producer; off: routed copy written; the default (I=%d): %s\n",
         runs, gathered, d->I, d->I <= MOK_K_SM90_GATHER_MAX_I ? "in the producer" : "copied first");
  CUDA_CHECK(cudaFree(scratch));
}

static void test_case(const tcase *c) {
  mok_k_dims d = make_dims(c->T, c->H, c->I, c->E_loc, c->K, c->limit);
  char err[160];
  if (mok_k_check_dims(&d, err, sizeof err) != MOK_OK) {
    EXPECT(0, "%s: dims rejected: %s", c->name, err);
    return;
  }
  layer L;
  layer_alloc(&L, &d);
  const size_t W = (size_t)d.E_loc * d.I * d.H;
  fill(L.x, (size_t)d.T * d.H, 11, 1.0f);
  fill(L.wg, W, 12, (float)(2.0 / sqrt((double)d.H)));
  fill(L.wu, W, 13, (float)(2.0 / sqrt((double)d.H)));
  fill(L.wd, W, 14, (float)(3.0 / sqrt((double)d.I)));
  std::vector<int32_t> ids = make_ids(c);
  layer_route(&L, ids);
  std::vector<int32_t> sched((size_t)L.sched_ints);
  CUDA_CHECK(cudaMemcpy(sched.data(), L.sched, sched.size() * 4, cudaMemcpyDeviceToHost));
  const sched_parts sp = parts_of(&d, sched);
  const int32_t *counts = sp.counts, *offsets = sp.offsets, *row_slot = sp.row_slot;
  const int32_t *slot_row = sp.slot_row;

  /* both paths, outputs poisoned first */
  poison(&L);
  layer_forward(&L, true);
  outs ref_hmma = snap(&L);
  poison(&L);
  layer_forward(&L, false);
  outs o = snap(&L);

  /* every element written; padding and tail rows exactly zero */
  size_t bad_pad = 0, nan_used = 0;
  for (long long r = 0; r < L.R; r++) {
    const bool used = row_slot[r] >= 0;
    for (int j = 0; j < d.I; j++) {
      const size_t at = (size_t)r * d.I + j;
      if (!used) bad_pad += (o.g[at] | o.u[at] | o.h[at]) != 0;
      else nan_used += (o.g[at] & 0x7f80) == 0x7f80 || (o.h[at] & 0x7f80) == 0x7f80;
    }
    for (int j = 0; j < d.H; j++) {
      const uint16_t v = o.y[(size_t)r * d.H + j];
      if (!used) bad_pad += v != 0;
      else nan_used += (v & 0x7f80) == 0x7f80;
    }
  }
  EXPECT(bad_pad == 0, "%s: %zu padding elements not zero", c->name, bad_pad);
  EXPECT(nan_used == 0, "%s: %zu used elements NaN/Inf (unwritten?)", c->name, nan_used);

  /* float64 on the kernel's rows */
  std::vector<uint16_t> xr = down16(L.rx, (size_t)L.R * d.H), wg = down16(L.wg, W),
                        wu = down16(L.wu, W), wd = down16(L.wd, W);
  errs E;
  memset(&E, 0, sizeof E);
  std::vector<long long> rows;
  for (long long r = 0; r < L.R; r++)
    if (row_slot[r] >= 0) rows.push_back(r);
  size_t step = c->ref_rows && rows.size() > (size_t)c->ref_rows ? rows.size() / c->ref_rows : 1;
  int checked = 0;
  for (size_t i = 0; i < rows.size(); i += step) {
    int e = 0;
    while (e + 1 < d.E_loc && offsets[e + 1] <= rows[i]) e++;
    ref_row(&L, o, xr, wg, wu, wd, rows[i], e, &E);
    checked++;
  }
  const char *nm[4] = {"g", "u", "h", "y"};
  printf("%-14s T=%d H=%d I=%d E_loc=%d K=%d lim=%d rows=%zu R=%lld counts:", c->name, d.T, d.H,
         d.I, d.E_loc, d.K, d.limit > 0 && d.has_limit, rows.size(), L.R);
  for (int e = 0; e < d.E_loc && e < 8; e++) printf(" %d", counts[e]);
  printf("%s\n", d.E_loc > 8 ? " ..." : "");
  for (int i = 0; i < 4; i++) {
    printf("    vs float64 %s: rel %.3e (%d rows)\n", nm[i], rel(E, i), checked);
    EXPECT(rel(E, i) < 1e-2, "%s: %s rel err %.3e vs float64", c->name, nm[i], rel(E, i));
  }
  compare_paths(c->name, "g", o.g, ref_hmma.g);
  compare_paths(c->name, "h", o.h, ref_hmma.h);
  compare_paths(c->name, "y", o.y, ref_hmma.y);

  /* bitwise repeatable, whatever the number of persistent CTAs, the tile
   * order or the pipelining */
  const int grids[4] = {7, 1, 0, 0}, pipes[4] = {1, 0, 1, 0}, bands[4] = {0, 3, 16, 0};
  bool rep = true;
  for (int i = 0; i < 4; i++) {
    mok_k_sm90_set_grid(grids[i]);
    mok_k_sm90_set_tuning(pipes[i], bands[i], i % 3, (i + 1) % 3);
    poison(&L);
    layer_forward(&L, false);
    rep = rep && same(snap(&L), o);
  }
  mok_k_sm90_set_grid(0);
  mok_k_sm90_set_tuning(0, 0, 0, 0);
  EXPECT(rep, "%s: results differ between runs / grid sizes / tile orders", c->name);

  /* the v3 tile variants: bitwise equal to the default Hopper path and to
   * mma.sync, whatever the grid (the cluster variant rounds it to pairs) */
  test_variants_fwd(c->name, &L, o, ref_hmma);
  test_gathering_fwd(c->name, &L, o);

  /* NaN in the padding rows of routed_x changes nothing */
  std::vector<uint16_t> xn = xr;
  for (long long r = 0; r < L.R; r++)
    if (row_slot[r] < 0)
      for (int j = 0; j < d.H; j++) xn[(size_t)r * d.H + j] = 0xffff;
  up16(L.rx, xn);
  bool nan_ok = true;
  for (int v = 0; v < MOK_K_SM90_VARIANTS; v++) {
    set_variant(v);
    poison(&L);
    layer_forward(&L, false);
    set_variant(MOK_K_SM90_ROWS);
    const bool ok = same(snap(&L), o);
    EXPECT(ok, "%s: NaN padding rows changed results (variant %s)", c->name,
           mok_k_sm90_variant_name(v));
    nan_ok = nan_ok && ok;
  }

  /* a row's result does not depend on the other rows: drop every odd token */
  bool indep = true;
  if (d.T > 1) {
    std::vector<int32_t> ids2 = ids;
    for (int t = 1; t < d.T; t += 2)
      for (int k = 0; k < d.K; k++) ids2[(size_t)t * d.K + k] = -1;
    layer_route(&L, ids2);
    poison(&L);
    layer_forward(&L, false);
    outs o2 = snap(&L);
    std::vector<int32_t> sched2((size_t)L.sched_ints);
    CUDA_CHECK(cudaMemcpy(sched2.data(), L.sched, sched2.size() * 4, cudaMemcpyDeviceToHost));
    const int32_t *slot_row2 = parts_of(&d, sched2).slot_row;
    for (long long s = 0; s < (long long)d.T * d.K; s += 1) {
      if ((s / d.K) % 2 || slot_row[s] < 0) continue;
      const long long r1 = slot_row[s], r2 = slot_row2[s];
      if (r2 < 0) {
        indep = false;
        continue;
      }
      indep = indep &&
              !memcmp(&o.y[(size_t)r1 * d.H], &o2.y[(size_t)r2 * d.H], (size_t)d.H * 2) &&
              !memcmp(&o.h[(size_t)r1 * d.I], &o2.h[(size_t)r2 * d.I], (size_t)d.I * 2) &&
              !memcmp(&o.g[(size_t)r1 * d.I], &o2.g[(size_t)r2 * d.I], (size_t)d.I * 2);
    }
    EXPECT(indep, "%s: a row's result changed with the other rows of the batch", c->name);
  }
  printf("    repeatable (grids 132/7/1, bands 0/3/16, pipelined or not): %s; NaN padding harmless "
         "(every variant): %s; row-independent: %s\n",
         rep ? "yes" : "NO", nan_ok ? "yes" : "NO", indep ? "yes" : "NO");
  layer_free(&L);
}

/* The shared expert (one group of T rows, no schedule) through
 * mok_k_shared_forward, new vs mma.sync. */
static void test_shared(void) {
  mok_k_dims d = make_dims(201, 192, 128, 2, 1, 0);
  d.I_s = 160;
  const size_t TH = (size_t)d.T * d.H, S = (size_t)d.I_s * d.H;
  uint16_t *x = (uint16_t *)dmalloc(TH * 2), *sg = (uint16_t *)dmalloc(S * 2),
           *su = (uint16_t *)dmalloc(S * 2), *sd = (uint16_t *)dmalloc(S * 2);
  uint16_t *ag = (uint16_t *)dmalloc((size_t)d.T * d.I_s * 2),
           *au = (uint16_t *)dmalloc((size_t)d.T * d.I_s * 2), *y = (uint16_t *)dmalloc(TH * 2);
  int32_t *status = (int32_t *)dmalloc(4);
  void *ws = dmalloc(mok_k_workspace_bytes(&d));
  fill(x, TH, 21, 1.0f);
  fill(sg, S, 22, 0.15f);
  fill(su, S, 23, 0.15f);
  fill(sd, S, 24, 0.2f);
  CUDA_CHECK(cudaMemset(status, 0, 4));
  /* path 0: mma.sync; 1 + v: the Hopper kernels in variant v */
  std::vector<uint16_t> res[1 + MOK_K_SM90_VARIANTS][3];
  for (int path = 0; path < 1 + MOK_K_SM90_VARIANTS; path++) {
    CUDA_CHECK(cudaMemset(ag, 0xff, (size_t)d.T * d.I_s * 2));
    CUDA_CHECK(cudaMemset(au, 0xff, (size_t)d.T * d.I_s * 2));
    CUDA_CHECK(cudaMemset(y, 0xff, TH * 2));
    set_hmma(path == 0);
    if (path > 0) set_variant(path - 1);
    MOK_CHECK(mok_k_shared_forward(&d, x, sg, su, sd, ag, au, y, ws, status, 0));
    set_hmma(false);
    set_variant(MOK_K_SM90_ROWS);
    CUDA_CHECK(cudaDeviceSynchronize());
    res[path][0] = down16(ag, (size_t)d.T * d.I_s);
    res[path][1] = down16(au, (size_t)d.T * d.I_s);
    res[path][2] = down16(y, TH);
  }
  printf("shared expert  T=%d H=%d I_s=%d\n", d.T, d.H, d.I_s);
  compare_paths("shared", "g", res[1][0], res[0][0]);
  compare_paths("shared", "u", res[1][1], res[0][1]);
  compare_paths("shared", "y", res[1][2], res[0][2]);
  for (int v = 1; v < MOK_K_SM90_VARIANTS; v++) {
    size_t n = 0;
    for (int i = 0; i < 3; i++)
      for (size_t j = 0; j < res[0][i].size(); j++)
        n += (res[1 + v][i][j] != res[0][i][j]) + (res[1 + v][i][j] != res[1][i][j]);
    printf("    variant %-8s: %zu elements differ from mma.sync or the default path\n",
           mok_k_sm90_variant_name(v), n);
    EXPECT(n == 0, "shared forward, variant %s: not bitwise equal", mok_k_sm90_variant_name(v));
  }
  void *p[] = {x, sg, su, sd, ag, au, y, status, ws};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_CHECK(cudaFree(p[i]));
}

/* ---- bench ------------------------------------------------------------------------------ */

typedef struct bshape {
  const char *name;
  int E_loc, H, I, K;
} bshape;

/* one GPU's slice of each benchmark shape */
#define BSHAPE_(name, E, H, I, K) {name, (E) / MOK_MODEL_EP, H, I, K},
static const bshape BSHAPES[] = {MOK_MODEL_SHAPES(BSHAPE_)};

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/* median ms of gate_up and of down over reps, after 2 warm-up runs */
static void time_path(layer *L, bool hmma, int reps, float *ms_gu, float *ms_dn) {
  cudaEvent_t ev[3];
  for (int i = 0; i < 3; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
  std::vector<float> a, b;
  set_hmma(hmma);
  for (int i = 0; i < reps + 2; i++) {
    CUDA_CHECK(cudaEventRecord(ev[0], 0));
    MOK_CHECK(mok_k_gate_up_swiglu(&L->d, L->sched, L->rx, L->wg, L->wu, L->g, L->u, L->h,
                                   L->status, 0));
    CUDA_CHECK(cudaEventRecord(ev[1], 0));
    MOK_CHECK(mok_k_down(&L->d, L->sched, L->h, L->wd, L->y, L->status, 0));
    CUDA_CHECK(cudaEventRecord(ev[2], 0));
    CUDA_CHECK(cudaEventSynchronize(ev[2]));
    float x, y;
    CUDA_CHECK(cudaEventElapsedTime(&x, ev[0], ev[1]));
    CUDA_CHECK(cudaEventElapsedTime(&y, ev[1], ev[2]));
    if (i >= 2) {
      a.push_back(x);
      b.push_back(y);
    }
  }
  set_hmma(false);
  *ms_gu = median(a);
  *ms_dn = median(b);
  for (int i = 0; i < 3; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
}

/* variants of the sm90 kernel timed in the bench: (tile variant, pipelined,
 * band, L2 policy of A, of B) */
static const int VARIANTS[][5] = {{MOK_K_SM90_ROWS, 0, 0, 0, 0},    {MOK_K_SM90_EXPERT, 0, 0, 0, 0},
                                  {MOK_K_SM90_CLUSTER, 0, 0, 0, 0}, {MOK_K_SM90_ROWS, 0, 0, 1, 0},
                                  {MOK_K_SM90_CLUSTER, 0, 0, 1, 0}, {MOK_K_SM90_ROWS, 1, 0, 0, 0}};
#define NVAR (int)(sizeof VARIANTS / sizeof VARIANTS[0])

static size_t dev_ndiff(const uint16_t *a, const uint16_t *b, size_t n);

static void balanced_ids(std::vector<int32_t> &ids, int T, int K, int E) {
  ids.assign((size_t)T * K, 0);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      int32_t id;
      bool dup;
      do {
        id = (int32_t)(rng_next() % E);
        dup = false;
        for (int j = 0; j < k; j++) dup |= ids[(size_t)t * K + j] == id;
      } while (dup);
      ids[(size_t)t * K + k] = id;
    }
}

/* A bench layer: dims at T, buffers, random x and weights, balanced routing. */
static mok_k_dims bench_layer(const bshape *s, int T, layer *L) {
  mok_k_dims d = make_dims(T, s->H, s->I, s->E_loc, s->K, 0);
  layer_alloc(L, &d);
  const size_t W = (size_t)d.E_loc * d.I * d.H;
  fill(L->x, (size_t)T * d.H, 31, 1.0f);
  fill(L->wg, W, 32, 0.02f);
  fill(L->wu, W, 33, 0.02f);
  fill(L->wd, W, 34, 0.03f);
  std::vector<int32_t> ids;
  balanced_ids(ids, T, d.K, d.E_loc);
  layer_route(L, ids);
  return d;
}

static void bench(const char *only, int only_T) {
  const int Ts[2] = {2048, 8192};
  printf("\nTFLOP/s of gate_up / down / both (median ms of both); sm90 variants "
         "(tiles,pipe,band,L2 A,L2 B):");
  for (int v = 0; v < NVAR; v++)
    printf(" v%d=(%s,%d,%d,%d,%d)", v, mok_k_sm90_variant_name(VARIANTS[v][0]), VARIANTS[v][1],
           VARIANTS[v][2], VARIANTS[v][3], VARIANTS[v][4]);
  printf("\n");
  for (int ti = 0; ti < 2; ti++)
    for (size_t si = 0; si < sizeof BSHAPES / sizeof BSHAPES[0]; si++) {
      const bshape *s = &BSHAPES[si];
      const int T = Ts[ti];
      if ((only && strcmp(only, s->name)) || (only_T && only_T != T)) continue;
      layer L;
      mok_k_dims d = bench_layer(s, T, &L); /* balanced: K distinct experts per token */
      const int reps = T >= 8192 ? 5 : 10;
      const double rows = (double)T * d.K;
      const double f_gu = 2.0 * rows * d.H * 2.0 * d.I, f_dn = 2.0 * rows * d.I * d.H;
      float hg, hd;
      time_path(&L, true, reps, &hg, &hd);
      uint16_t *y_h = (uint16_t *)dmalloc((size_t)L.R * d.H * 2);
      CUDA_CHECK(cudaMemcpy(y_h, L.y, (size_t)L.R * d.H * 2, cudaMemcpyDeviceToDevice));
      printf("%-16s %5d  hmma %5.1f / %5.1f / %5.1f (%6.3f ms)", s->name, T, f_gu / hg * 1e-9,
             f_dn / hd * 1e-9, (f_gu + f_dn) / (hg + hd) * 1e-9, hg + hd);
      float best = 1e30f;
      size_t nd_var = 0; /* y of every variant against mma.sync's */
      for (int v = 0; v < NVAR; v++) {
        float ng, nd;
        set_variant(VARIANTS[v][0]);
        mok_k_sm90_set_tuning(VARIANTS[v][1], VARIANTS[v][2], VARIANTS[v][3], VARIANTS[v][4]);
        time_path(&L, false, reps, &ng, &nd);
        set_variant(MOK_K_SM90_ROWS);
        nd_var += dev_ndiff(L.y, y_h, (size_t)L.R * d.H);
        printf(" | v%d %5.1f / %5.1f / %5.1f", v, f_gu / ng * 1e-9, f_dn / nd * 1e-9,
               (f_gu + f_dn) / (ng + nd) * 1e-9);
        best = std::min(best, ng + nd);
      }
      mok_k_sm90_set_tuning(0, 0, 0, 0);
      unsigned long long *nd_d = (unsigned long long *)dmalloc(16);
      CUDA_CHECK(cudaMemset(nd_d, 0, 16));
      diff_bf16<<<1024, 256>>>(L.y, y_h, (size_t)L.R * d.H, nd_d, (unsigned *)(nd_d + 1));
      unsigned long long hd2[2];
      CUDA_CHECK(cudaMemcpy(hd2, nd_d, 16, cudaMemcpyDeviceToHost));
      float maxd;
      unsigned mb = (unsigned)hd2[1];
      memcpy(&maxd, &mb, 4);
      int32_t st = -1;
      CUDA_CHECK(cudaMemcpy(&st, L.status, 4, cudaMemcpyDeviceToHost));
      EXPECT(st == 0, "bench %s: status %d", s->name, st);
      EXPECT(hd2[0] == 0 && nd_var == 0,
             "bench %s T=%d: y differs from mma.sync in %llu elements (%zu over all variants)",
             s->name, T, hd2[0], nd_var);
      printf(" | best %.2fx; y vs hmma: %llu differ (all variants: %zu)\n", (hg + hd) / best,
             hd2[0], nd_var);
      fflush(stdout);
      CUDA_CHECK(cudaFree(y_h));
      CUDA_CHECK(cudaFree(nd_d));
      layer_free(&L);
    }
}

/* ---- backward ------------------------------------------------------------------------- */

/* the backward's own buffers, on top of a routed layer that ran forward */
typedef struct bwd_bufs {
  uint16_t *dout, *rdout, *dxr, *dwg, *dwu, *dwd;
  float *rw, *drw;
} bwd_bufs;

static void bwd_alloc(bwd_bufs *b, const layer *L) {
  const mok_k_dims *d = &L->d;
  const size_t W = (size_t)d->E_loc * d->I * d->H;
  b->dout = (uint16_t *)dmalloc((size_t)d->T * d->H * 2);
  b->rdout = (uint16_t *)dmalloc((size_t)L->R * d->H * 2);
  b->dxr = (uint16_t *)dmalloc((size_t)L->R * d->H * 2);
  b->dwg = (uint16_t *)dmalloc(W * 2);
  b->dwu = (uint16_t *)dmalloc(W * 2);
  b->dwd = (uint16_t *)dmalloc(W * 2);
  b->rw = (float *)dmalloc((size_t)d->T * d->K * 4);
  b->drw = (float *)dmalloc((size_t)d->T * d->K * 4);
  std::vector<float> rw((size_t)d->T * d->K);
  for (size_t i = 0; i < rw.size(); i++) rw[i] = (float)(0.05 + 0.9 * rng_unit());
  if (!rw.empty()) CUDA_CHECK(cudaMemcpy(b->rw, rw.data(), rw.size() * 4, cudaMemcpyHostToDevice));
  fill(b->dout, (size_t)d->T * d->H, 41, 0.5f);
  MOK_CHECK(mok_k_gather_rows(d, L->sched, b->dout, b->rdout, L->status, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
}

static void bwd_free(bwd_bufs *b) {
  void *p[] = {b->dout, b->rdout, b->dxr, b->dwg, b->dwu, b->dwd, b->rw, b->drw};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_CHECK(cudaFree(p[i]));
}

typedef struct bouts {
  std::vector<uint16_t> dxr, dwg, dwu, dwd, drw; /* drw as 16-bit halves */
} bouts;

static void bwd_run(layer *L, bwd_bufs *b, int mask) {
  const mok_k_dims *d = &L->d;
  const size_t W = (size_t)d->E_loc * d->I * d->H;
  CUDA_CHECK(cudaMemset(b->dxr, 0xff, (size_t)L->R * d->H * 2));
  CUDA_CHECK(cudaMemset(b->dwg, 0xff, W * 2));
  CUDA_CHECK(cudaMemset(b->dwu, 0xff, W * 2));
  CUDA_CHECK(cudaMemset(b->dwd, 0xff, W * 2));
  CUDA_CHECK(cudaMemset(b->drw, 0xff, (size_t)d->T * d->K * 4));
  mok_k_sm90_set_bwd_modes(mask);
  MOK_CHECK(mok_k_expert_backward(d, L->sched, L->g, L->u, L->rx, b->rdout, b->rw, L->wg, L->wu,
                                  L->wd, b->dxr, b->drw, b->dwg, b->dwu, b->dwd, L->ws, L->status,
                                  0));
  mok_k_sm90_set_bwd_modes(7);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaDeviceSynchronize());
  int32_t st = -1;
  CUDA_CHECK(cudaMemcpy(&st, L->status, 4, cudaMemcpyDeviceToHost));
  EXPECT(st == 0, "status %d after the backward", st);
}

static bouts bwd_snap(const layer *L, const bwd_bufs *b) {
  const mok_k_dims *d = &L->d;
  const size_t W = (size_t)d->E_loc * d->I * d->H;
  bouts o;
  o.dxr = down16(b->dxr, (size_t)L->R * d->H);
  o.dwg = down16(b->dwg, W);
  o.dwu = down16(b->dwu, W);
  o.dwd = down16(b->dwd, W);
  o.drw = down16((const uint16_t *)b->drw, (size_t)d->T * d->K * 2);
  return o;
}

static size_t ndiff16(const std::vector<uint16_t> &a, const std::vector<uint16_t> &b) {
  size_t n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); i++) n += a[i] != b[i];
  return n + (a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
}

static size_t nbad16(const std::vector<uint16_t> &a) { /* NaN/Inf: unwritten (poison) */
  size_t n = 0;
  for (size_t i = 0; i < a.size(); i++) n += (a[i] & 0x7f80) == 0x7f80;
  return n;
}

/* differing elements per output; true when all equal */
static bool bwd_compare(const char *name, const char *what, const bouts &o, const bouts &r) {
  const size_t n[5] = {ndiff16(o.dxr, r.dxr), ndiff16(o.drw, r.drw), ndiff16(o.dwg, r.dwg),
                       ndiff16(o.dwu, r.dwu), ndiff16(o.dwd, r.dwd)};
  const bool ok = !(n[0] | n[1] | n[2] | n[3] | n[4]);
  printf("    %-28s vs mma.sync: differ d_x %zu/%zu d_rw %zu d_wg %zu d_wu %zu d_wd %zu of %zu%s\n",
         what, n[0], o.dxr.size(), n[1], n[2], n[3], n[4], o.dwd.size(), ok ? "  (bitwise equal)" : "");
  EXPECT(ok, "%s: %s differs from mma.sync", name, what);
  return ok;
}

static void test_bwd_case(const tcase *c) {
  mok_k_dims d = make_dims(c->T, c->H, c->I, c->E_loc, c->K, c->limit);
  layer L;
  layer_alloc(&L, &d);
  const size_t W = (size_t)d.E_loc * d.I * d.H;
  fill(L.x, (size_t)d.T * d.H, 11, 1.0f);
  fill(L.wg, W, 12, (float)(2.0 / sqrt((double)d.H)));
  fill(L.wu, W, 13, (float)(2.0 / sqrt((double)d.H)));
  fill(L.wd, W, 14, (float)(3.0 / sqrt((double)d.I)));
  std::vector<int32_t> ids = make_ids(c);
  layer_route(&L, ids);
  layer_forward(&L, false);
  bwd_bufs b;
  bwd_alloc(&b, &L);
  printf("%-14s T=%d H=%d I=%d E_loc=%d K=%d lim=%d R=%lld (gate/up dgrad on %s)\n", c->name, d.T,
         d.H, d.I, d.E_loc, d.K, d.has_limit, L.R, d.I % 16 ? "mma.sync: I % 16" : "sm90");
  bwd_run(&L, &b, 0);
  const bouts ref = bwd_snap(&L, &b);
  const size_t bad = nbad16(ref.dxr) + nbad16(ref.dwg) + nbad16(ref.dwu) + nbad16(ref.dwd);
  EXPECT(bad == 0, "%s: %zu mma.sync backward outputs NaN/Inf", c->name, bad);
  const int masks[4] = {MOK_K_SM90_BWD_DOWN_DGRAD, MOK_K_SM90_BWD_GATE_UP_DGRAD,
                        MOK_K_SM90_BWD_WGRAD, 7};
  const char *mn[4] = {"down dgrad on sm90", "gate/up dgrad on sm90", "wgrad on sm90", "all on sm90"};
  for (int i = 0; i < 4; i++) {
    bwd_run(&L, &b, masks[i]);
    bwd_compare(c->name, mn[i], bwd_snap(&L, &b), ref);
  }
  /* grid sizes */
  const int grids[2] = {7, 1};
  for (int i = 0; i < 2; i++) {
    mok_k_sm90_set_grid(grids[i]);
    bwd_run(&L, &b, 7);
    mok_k_sm90_set_grid(0);
    bwd_compare(c->name, grids[i] == 7 ? "all on sm90, grid 7" : "all on sm90, grid 1",
                bwd_snap(&L, &b), ref);
  }
  /* the v3 tile variants (the cluster one runs the gate/up dgrad in pairs) */
  for (int v = 1; v < MOK_K_SM90_VARIANTS; v++)
    for (int gi = 0; gi < 3; gi++) {
      const int grid = gi == 0 ? 0 : gi == 1 ? 7 : 1;
      char what[64];
      snprintf(what, sizeof what, "all on sm90, %s, grid %d", mok_k_sm90_variant_name(v),
               grid ? grid : 132);
      set_variant(v);
      mok_k_sm90_set_grid(grid);
      bwd_run(&L, &b, 7);
      mok_k_sm90_set_grid(0);
      set_variant(MOK_K_SM90_ROWS);
      bwd_compare(c->name, what, bwd_snap(&L, &b), ref);
    }
  /* NaN in the padding rows of routed_x and routed_d_out: both paths alike */
  std::vector<int32_t> sched((size_t)L.sched_ints);
  CUDA_CHECK(cudaMemcpy(sched.data(), L.sched, sched.size() * 4, cudaMemcpyDeviceToHost));
  const int32_t *row_slot = parts_of(&d, sched).row_slot;
  std::vector<uint16_t> xr = down16(L.rx, (size_t)L.R * d.H), dr = down16(b.rdout, (size_t)L.R * d.H);
  size_t npad = 0;
  for (long long r = 0; r < L.R; r++)
    if (row_slot[r] < 0) {
      npad++;
      for (int j = 0; j < d.H; j++) xr[(size_t)r * d.H + j] = dr[(size_t)r * d.H + j] = 0xffff;
    }
  up16(L.rx, xr);
  up16(b.rdout, dr);
  bwd_run(&L, &b, 0);
  const bouts ref_nan = bwd_snap(&L, &b);
  bwd_run(&L, &b, 7);
  bwd_compare(c->name, "all on sm90, NaN padding", bwd_snap(&L, &b), ref_nan);
  set_variant(MOK_K_SM90_CLUSTER);
  bwd_run(&L, &b, 7);
  set_variant(MOK_K_SM90_ROWS);
  bwd_compare(c->name, "all on sm90, cluster, NaN padding", bwd_snap(&L, &b), ref_nan);
  /* the ping-pong down dgrad skips the wgmmas of a padding half itself, in
   * 2-CTA clusters (the default) and on plain CTAs, at grids 132 and 7 */
  for (int plain = 0; plain < 2; plain++)
    for (int grid = 0; grid <= 7; grid += 7) {
      char what[80];
      snprintf(what, sizeof what, "all on sm90, pingpong%s, grid %d, NaN padding",
               plain ? " (plain CTAs)" : "", grid ? grid : 132);
      mok_k_sm90_set_pp_pairs(!plain);
      mok_k_sm90_set_grid(grid);
      set_variant(MOK_K_SM90_PINGPONG);
      bwd_run(&L, &b, 7);
      set_variant(MOK_K_SM90_ROWS);
      mok_k_sm90_set_grid(0);
      mok_k_sm90_set_pp_pairs(1);
      bwd_compare(c->name, what, bwd_snap(&L, &b), ref_nan);
    }
  printf("    NaN in %zu padding rows: mma.sync's outputs %s\n", npad,
         ndiff16(ref_nan.dxr, ref.dxr) + ndiff16(ref_nan.dwg, ref.dwg) + ndiff16(ref_nan.dwd, ref.dwd) ==
                 0
             ? "unchanged"
             : "CHANGED");
  bwd_free(&b);
  layer_free(&L);
}

/* the shared expert's backward (one group of T rows) */
static void test_bwd_shared(int I_s) {
  mok_k_dims d = make_dims(201, 192, 128, 2, 1, 1);
  d.I_s = I_s;
  const size_t TH = (size_t)d.T * d.H, S = (size_t)d.I_s * d.H, TI = (size_t)d.T * d.I_s;
  uint16_t *x = (uint16_t *)dmalloc(TH * 2), *dout = (uint16_t *)dmalloc(TH * 2),
           *sg = (uint16_t *)dmalloc(S * 2), *su = (uint16_t *)dmalloc(S * 2),
           *sd = (uint16_t *)dmalloc(S * 2), *ag = (uint16_t *)dmalloc(TI * 2),
           *au = (uint16_t *)dmalloc(TI * 2), *y = (uint16_t *)dmalloc(TH * 2),
           *dx = (uint16_t *)dmalloc(TH * 2), *dg = (uint16_t *)dmalloc(S * 2),
           *du = (uint16_t *)dmalloc(S * 2), *dd = (uint16_t *)dmalloc(S * 2);
  int32_t *status = (int32_t *)dmalloc(4);
  void *ws = dmalloc(mok_k_workspace_bytes(&d));
  fill(x, TH, 21, 1.0f);
  fill(dout, TH, 25, 0.5f);
  fill(sg, S, 22, 0.15f);
  fill(su, S, 23, 0.15f);
  fill(sd, S, 24, 0.2f);
  CUDA_CHECK(cudaMemset(status, 0, 4));
  MOK_CHECK(mok_k_shared_forward(&d, x, sg, su, sd, ag, au, y, ws, status, 0));
  /* path 0: mma.sync; 1 + v: the Hopper kernels in variant v */
  std::vector<uint16_t> res[1 + MOK_K_SM90_VARIANTS][4];
  for (int path = 0; path < 1 + MOK_K_SM90_VARIANTS; path++) {
    uint16_t *o[4] = {dx, dg, du, dd};
    for (int i = 0; i < 4; i++) CUDA_CHECK(cudaMemset(o[i], 0xff, (i ? S : TH) * 2));
    mok_k_sm90_set_bwd_modes(path ? 7 : 0);
    if (path > 0) set_variant(path - 1);
    MOK_CHECK(mok_k_shared_backward(&d, x, dout, ag, au, sg, su, sd, dx, dg, du, dd, ws, status, 0));
    mok_k_sm90_set_bwd_modes(7);
    set_variant(MOK_K_SM90_ROWS);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (int i = 0; i < 4; i++) res[path][i] = down16(o[i], i ? S : TH);
  }
  for (int path = 1; path < 1 + MOK_K_SM90_VARIANTS; path++) {
    const size_t n[4] = {ndiff16(res[path][0], res[0][0]), ndiff16(res[path][1], res[0][1]),
                         ndiff16(res[path][2], res[0][2]), ndiff16(res[path][3], res[0][3])};
    const size_t bad = nbad16(res[path][0]) + nbad16(res[path][1]) + nbad16(res[path][2]) +
                       nbad16(res[path][3]);
    printf("shared bwd     T=%d H=%d I_s=%d clamp, %-7s: differ d_x %zu d_sg %zu d_su %zu d_sd %zu; "
           "NaN/Inf %zu\n",
           d.T, d.H, d.I_s, mok_k_sm90_variant_name(path - 1), n[0], n[1], n[2], n[3], bad);
    EXPECT(!(n[0] | n[1] | n[2] | n[3]) && bad == 0,
           "shared backward I_s=%d, variant %s differs from mma.sync", I_s,
           mok_k_sm90_variant_name(path - 1));
  }
  void *p[] = {x, dout, sg, su, sd, ag, au, y, dx, dg, du, dd, status, ws};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) CUDA_CHECK(cudaFree(p[i]));
}


static size_t dev_ndiff(const uint16_t *a, const uint16_t *b, size_t n) {
  unsigned long long *nd = (unsigned long long *)dmalloc(16);
  CUDA_CHECK(cudaMemset(nd, 0, 16));
  if (n) diff_bf16<<<1024, 256>>>(a, b, n, nd, (unsigned *)(nd + 1));
  unsigned long long h[2];
  CUDA_CHECK(cudaMemcpy(h, nd, 16, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaFree(nd));
  return (size_t)h[0];
}

/* One weight gradient on the new kernel alone, from the operands a
 * backward left in the workspace: which 0 the down one (d_out^T rw h), 1 the
 * gate/up one (dgu^T x). */
static void wgrad_run(const layer *L, const bwd_bufs *b, int which) {
  const mok_k_dims *d = &L->d;
  const ws_layout WL = mok_k_ws_layout(d);
  const char *ws = (const char *)L->ws;
  const int n = d->I, R = (int)L->R;
  if (which == 0)
    MOK_CHECK(mok_k_sm90_wgrad(d, L->sched, d->E_loc, R, d->H, n, b->rdout,
                               (const uint16_t *)(ws + WL.h), b->dwd, NULL, d->H, n,
                               (long long)d->H * n, NULL, L->status, 0));
  else
    MOK_CHECK(mok_k_sm90_wgrad(d, L->sched, d->E_loc, R, 2 * n, d->H,
                               (const uint16_t *)(ws + WL.dgu), L->rx, b->dwg, b->dwu, n, d->H,
                               (long long)n * d->H, NULL, L->status, 0));
}

/* Backward GEMMs at the benchmark shapes. expert_backward (all its kernels)
 * with masks 0 (mma.sync), 1, 2, 4 (one mode on sm90), 7 (all); the new
 * kernels alone through their launchers; mma.sync per mode derived as
 * new + (t(0) - t(mode alone)). */
static void bwd_bench(const char *only, int only_T) {
  const int Ts[2] = {2048, 8192};
  printf("\nbackward GEMMs, TFLOP/s by real rows (median ms): down dgrad | gate/up dgrad | wgrad "
         "(both) | expert_backward total\n");
  for (int ti = 0; ti < 2; ti++)
    for (size_t si = 0; si < sizeof BSHAPES / sizeof BSHAPES[0]; si++) {
      const bshape *sh = &BSHAPES[si];
      const int T = Ts[ti];
      if ((only && strcmp(only, sh->name)) || (only_T && only_T != T)) continue;
      layer L;
      mok_k_dims d = bench_layer(sh, T, &L);
      const size_t W = (size_t)d.E_loc * d.I * d.H;
      layer_forward(&L, false);
      bwd_bufs b;
      bwd_alloc(&b, &L);
      const int reps = T >= 8192 ? 5 : 10;
      cudaEvent_t ev[5];
      for (int i = 0; i < 5; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
      float tot[5];
      const int masks[5] = {0, 1, 2, 4, 7};
      uint16_t *keep[4] = {NULL, NULL, NULL, NULL};
      size_t nd[4] = {0, 0, 0, 0};
      for (int mi = 0; mi < 5; mi++) {
        std::vector<float> v;
        mok_k_sm90_set_bwd_modes(masks[mi]);
        for (int i = 0; i < reps + 1; i++) {
          CUDA_CHECK(cudaEventRecord(ev[0], 0));
          MOK_CHECK(mok_k_expert_backward(&d, L.sched, L.g, L.u, L.rx, b.rdout, b.rw, L.wg, L.wu,
                                          L.wd, b.dxr, b.drw, b.dwg, b.dwu, b.dwd, L.ws, L.status,
                                          0));
          CUDA_CHECK(cudaEventRecord(ev[1], 0));
          CUDA_CHECK(cudaEventSynchronize(ev[1]));
          float ms;
          CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
          if (i) v.push_back(ms);
        }
        mok_k_sm90_set_bwd_modes(7);
        tot[mi] = median(v);
        uint16_t *outs4[4] = {b.dxr, b.dwg, b.dwu, b.dwd};
        const size_t sz[4] = {(size_t)L.R * d.H, W, W, W};
        for (int j = 0; j < 4; j++) {
          if (mi == 0) {
            keep[j] = (uint16_t *)dmalloc(sz[j] * 2);
            CUDA_CHECK(cudaMemcpy(keep[j], outs4[j], sz[j] * 2, cudaMemcpyDeviceToDevice));
          } else {
            nd[j] += dev_ndiff(outs4[j], keep[j], sz[j]);
          }
        }
      }
      /* the new kernels alone */
      const ws_layout WL = mok_k_ws_layout(&d);
      char *ws = (char *)L.ws;
      const int n = d.I, Rr = (int)L.R;
      float kt[3];
      {
        std::vector<float> v0, v1, v2;
        for (int i = 0; i < reps + 1; i++) {
          CUDA_CHECK(cudaEventRecord(ev[0], 0));
          MOK_CHECK(mok_k_sm90_down_dgrad(&d, L.sched, Rr, n, b.rdout, L.wd, L.g, L.u, b.rw,
                                          (uint16_t *)(ws + WL.dgu), (uint16_t *)(ws + WL.h),
                                          (float *)(ws + WL.partial), mok_k_partial_tiles(&d),
                                          L.status, 0));
          CUDA_CHECK(cudaEventRecord(ev[1], 0));
          MOK_CHECK(mok_k_sm90_gate_up_dgrad(&d, L.sched, Rr, n, (uint16_t *)(ws + WL.dgu), L.wg,
                                             L.wu, b.dxr, L.status, 0));
          CUDA_CHECK(cudaEventRecord(ev[2], 0));
          wgrad_run(&L, &b, 0);
          wgrad_run(&L, &b, 1);
          CUDA_CHECK(cudaEventRecord(ev[3], 0));
          CUDA_CHECK(cudaEventSynchronize(ev[3]));
          float a, bb, cc;
          CUDA_CHECK(cudaEventElapsedTime(&a, ev[0], ev[1]));
          CUDA_CHECK(cudaEventElapsedTime(&bb, ev[1], ev[2]));
          CUDA_CHECK(cudaEventElapsedTime(&cc, ev[2], ev[3]));
          if (i) {
            v0.push_back(a);
            v1.push_back(bb);
            v2.push_back(cc);
          }
        }
        kt[0] = median(v0);
        kt[1] = median(v1);
        kt[2] = median(v2);
      }
      const double rows = (double)T * d.K, hi = (double)d.H * d.I;
      const double f[3] = {2 * rows * hi, 4 * rows * hi, 6 * rows * hi};
      printf("%-16s %5d new ", sh->name, T);
      for (int j = 0; j < 3; j++) printf("%5.1f (%6.3f) ", f[j] / kt[j] * 1e-9, kt[j]);
      printf("| hmma(derived) ");
      for (int j = 0; j < 3; j++) {
        const float h = kt[j] + tot[0] - tot[j + 1];
        printf("%5.1f (%6.3f) ", f[j] / h * 1e-9, h);
      }
      printf("| total hmma %6.3f ms %5.1f TF/s, sm90 %6.3f ms %5.1f TF/s, %.2fx; outputs differ %zu %zu %zu %zu\n",
             tot[0], 12 * rows * hi / tot[0] * 1e-9, tot[4], 12 * rows * hi / tot[4] * 1e-9,
             tot[0] / tot[4], nd[0], nd[1], nd[2], nd[3]);
      EXPECT(!(nd[0] | nd[1] | nd[2] | nd[3]), "bwd bench %s T=%d: outputs differ from mma.sync",
             sh->name, T);
      int32_t st = -1;
      CUDA_CHECK(cudaMemcpy(&st, L.status, 4, cudaMemcpyDeviceToHost));
      EXPECT(st == 0, "bwd bench %s: status %d", sh->name, st);
      fflush(stdout);
      for (int j = 0; j < 4; j++) CUDA_CHECK(cudaFree(keep[j]));
      for (int i = 0; i < 5; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
      bwd_free(&b);
      layer_free(&L);
    }
}

/* A benchmark shape by name (NULL when there is none). */
static const bshape *find_bshape(const char *name) {
  for (size_t i = 0; i < sizeof BSHAPES / sizeof BSHAPES[0]; i++)
    if (name && !strcmp(name, BSHAPES[i].name)) return &BSHAPES[i];
  return NULL;
}

/* One forward and one backward of each variant at one shape, between
 * cudaProfilerStart and cudaProfilerStop, after a warm-up of each: for
 * `ncu --profile-from-start off`, which then sees one launch of every GEMM
 * kernel per variant (gate_up, down, down dgrad, gate/up dgrad, the two
 * wgrads, then gate_up and down of the forward from x), in that order.
 * Outputs are checked against mma.sync's. */
static void profile(const char *name, int T, const char *variants) {
  const bshape *sh = find_bshape(name);
  if (!sh || T <= 0) {
    EXPECT(0, "profile: unknown shape %s or bad T %d", name ? name : "(none)", T);
    return;
  }
  int vs[8], nv = 0;
  for (const char *at = variants; at && *at && nv < 8;) {
    char one[32];
    size_t len = strcspn(at, ",");
    snprintf(one, sizeof one, "%.*s", (int)(len < sizeof one ? len : sizeof one - 1), at);
    const int v = mok_k_sm90_variant_parse(one);
    EXPECT(v >= 0, "profile: unknown variant '%s'", one);
    if (v >= 0) vs[nv++] = v;
    at += len + (at[len] == ',');
  }
  layer L;
  mok_k_dims d = bench_layer(sh, T, &L);
  bwd_bufs b;
  layer_forward(&L, true); /* mma.sync's y, for the check */
  bwd_alloc(&b, &L);
  uint16_t *y_h = (uint16_t *)dmalloc((size_t)L.R * d.H * 2);
  CUDA_CHECK(cudaMemcpy(y_h, L.y, (size_t)L.R * d.H * 2, cudaMemcpyDeviceToDevice));
  for (int i = 0; i < nv; i++) { /* warm-up: module loads, clocks */
    set_variant(vs[i]);
    layer_forward(&L, false);
    bwd_run(&L, &b, 7);
  }
  printf("profile %s T=%d:", sh->name, T);
  CUDA_CHECK(cudaProfilerStart());
  for (int i = 0; i < nv; i++) {
    set_variant(vs[i]);
    printf(" %s", mok_k_sm90_variant_name(vs[i]));
    MOK_CHECK(mok_k_gate_up_swiglu(&d, L.sched, L.rx, L.wg, L.wu, L.g, L.u, L.h, L.status, 0));
    MOK_CHECK(mok_k_down(&d, L.sched, L.h, L.wd, L.y, L.status, 0));
    MOK_CHECK(mok_k_expert_backward(&d, L.sched, L.g, L.u, L.rx, b.rdout, b.rw, L.wg, L.wu, L.wd,
                                    b.dxr, b.drw, b.dwg, b.dwu, b.dwd, L.ws, L.status, 0));
    /* the forward from x: the gate/up product gathering its rows (pairs
     * variants), then DOWN; routed x untouched there */
    mok_k_sm90_set_gather_a(1);
    MOK_CHECK(mok_k_expert_forward_gathering(&d, L.sched, L.x, L.rx, L.wg, L.wu, L.wd, L.g, L.u,
                                             L.y, L.ws, L.status, 0));
    mok_k_sm90_set_gather_a(0);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaProfilerStop());
  set_variant(MOK_K_SM90_ROWS);
  const size_t nd = dev_ndiff(L.y, y_h, (size_t)L.R * d.H);
  int32_t st = -1;
  CUDA_CHECK(cudaMemcpy(&st, L.status, 4, cudaMemcpyDeviceToHost));
  printf("; status %d, y vs mma.sync: %zu differ\n", st, nd);
  EXPECT(st == 0 && nd == 0, "profile %s T=%d: status %d, %zu elements of y differ", sh->name, T,
         st, nd);
  CUDA_CHECK(cudaFree(y_h));
  bwd_free(&b);
  layer_free(&L);
}

/* ---- trace ------------------------------------------------------------------------------
 * Where a weight gradient's tile time goes, from a build with the tile
 * trace (kernels/common/tile_trace.cuh; nvcc -DMOK_TILE_TRACE=1): per
 * tile, the consumers' lookup, the wait for the first block's data, the k
 * loop, the epilogue and the step to the next tile, and the producer's wait
 * for a free stage, as medians and means over every CTA's tiles, in ns
 * (each CTA's clock64 turned into ns by its %globaltimer span). */
#define TRACE_TILES 4096

static double tr_median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

static void trace_report(const char *what, const unsigned long long *h, int ctas, float ms) {
  const int S = MOK_TRACE_STAMPS;
  const char *names[7] = {"lookup", "first data", "k loop", "epilogue", "to next tile", "tile",
                          "producer: free stage"};
  std::vector<double> part[7];
  double sum[7] = {0};
  long tiles = 0;
  for (int c = 0; c < ctas; c++) {
    const unsigned long long *row = h + (size_t)c * S * (1 + TRACE_TILES);
    const double clk = (double)(row[MOK_TRACE_CLK_END] - row[MOK_TRACE_CLK_START]);
    const double ns_per = clk > 0 ? (double)(row[MOK_TRACE_GT_END] - row[MOK_TRACE_GT_START]) / clk : 0;
    const int n = (int)std::min<unsigned long long>(row[MOK_TRACE_TILES], TRACE_TILES);
    for (int i = 0; i < n; i++) {
      const unsigned long long *t = row + S * (1 + i);
      const unsigned long long *nx = i + 1 < n ? t + S : NULL;
      double v[7] = {(double)(t[1] - t[0]), (double)(t[2] - t[1]), (double)(t[3] - t[2]),
                     (double)(t[4] - t[3]), nx ? (double)(nx[0] - t[4]) : -1,
                     nx ? (double)(nx[0] - t[0]) : -1, (double)(t[6] - t[5])};
      for (int j = 0; j < 7; j++) {
        if (v[j] < 0) continue;
        part[j].push_back(v[j] * ns_per);
        sum[j] += v[j] * ns_per;
      }
      tiles++;
    }
  }
  printf("  %s: %.3f ms, %ld tiles on %d CTAs (%.1f a CTA); ns a tile, median / mean:\n", what,
         ms, tiles, ctas, (double)tiles / ctas);
  for (int j = 0; j < 7; j++)
    printf("    %-22s %8.0f %8.0f\n", names[j], tr_median(part[j]),
           part[j].empty() ? 0.0 : sum[j] / part[j].size());
  EXPECT(tiles > 0, "trace %s: no tile stamped", what);
}

static void trace(const char *name, int T) {
  const bshape *sh = find_bshape(name);
  if (!sh || T <= 0) {
    EXPECT(0, "trace: unknown shape %s or bad T %d", name ? name : "(none)", T);
    return;
  }
  if (mok_k_sm90_set_trace(NULL, 0) == MOK_EUNSUPPORTED) {
    EXPECT(0, "trace: this build has no tile trace (nvcc -DMOK_TILE_TRACE=1)");
    return;
  }
  layer L;
  (void)bench_layer(sh, T, &L);
  bwd_bufs b;
  layer_forward(&L, false);
  bwd_alloc(&b, &L);
  bwd_run(&L, &b, 7); /* dy, h, dgu in the workspace; warm */
  int ctas = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&ctas, cudaDevAttrMultiProcessorCount, 0));
  const size_t words = (size_t)ctas * MOK_TRACE_STAMPS * (1 + TRACE_TILES);
  unsigned long long *buf = (unsigned long long *)dmalloc(words * 8);
  std::vector<unsigned long long> h(words);
  cudaEvent_t ev[2];
  for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
  printf("trace %s T=%d (balanced):\n", sh->name, T);
  for (int which = 0; which < 2; which++) {
    for (int rep = 0; rep < 2; rep++) { /* the second, warm, is kept */
      CUDA_CHECK(cudaMemset(buf, 0, words * 8));
      MOK_CHECK(mok_k_sm90_set_trace(buf, TRACE_TILES));
      CUDA_CHECK(cudaEventRecord(ev[0], 0));
      wgrad_run(&L, &b, which);
      CUDA_CHECK(cudaEventRecord(ev[1], 0));
      CUDA_CHECK(cudaEventSynchronize(ev[1]));
      MOK_CHECK(mok_k_sm90_set_trace(NULL, 0));
    }
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, ev[0], ev[1]));
    CUDA_CHECK(cudaMemcpy(h.data(), buf, words * 8, cudaMemcpyDeviceToHost));
    trace_report(which == 0 ? "down weight gradient" : "gate/up weight gradient", h.data(), ctas,
                 ms);
  }
  int32_t st = -1;
  CUDA_CHECK(cudaMemcpy(&st, L.status, 4, cudaMemcpyDeviceToHost));
  EXPECT(st == 0, "trace %s T=%d: status %d", sh->name, T, st);
  for (int i = 0; i < 2; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
  CUDA_CHECK(cudaFree(buf));
  bwd_free(&b);
  layer_free(&L);
}

/* ---- fp8 ---------------------------------------------------------------------------------
 * The block-scaled e4m3 grouped GEMM (mok_k_sm90_fp8_rows_gemm) as the
 * down projection: h's rows and W_d quantised by the library's quantisers,
 * against a float64 sum over the same e4m3 values and scales (all rows at
 * the small shapes, sampled rows at the bench shapes), padding rows zero
 * (the output poisoned first), bitwise repeatable; at the bench shapes its
 * time beside the bf16 down GEMM's on the same rows. */
static float bf16_host(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

typedef struct fp8_down {
  uint8_t *q;      /* h's rows, e4m3 */
  float *sq;       /* their scales */
  void *w;         /* W_d packed */
  uint16_t *y;     /* the fp8 product */
  size_t w_bytes;
} fp8_down;

static void fp8_down_alloc(fp8_down *f, const layer *L) {
  const mok_k_dims *d = &L->d;
  f->q = (uint8_t *)dmalloc((size_t)L->R * d->I);
  f->sq = (float *)dmalloc((size_t)L->R * (d->I / 128) * 4);
  f->w_bytes = (size_t)mok_fp8_weight_bytes((uint64_t)d->E_loc, (uint64_t)d->H, (uint64_t)d->I);
  f->w = dmalloc(f->w_bytes);
  f->y = (uint16_t *)dmalloc((size_t)L->R * d->H * 2);
  MOK_CHECK(mok_k_fp8_quantize_rows(L->h, (int)L->R, d->I, f->q, f->sq, 0));
  MOK_CHECK(mok_k_fp8_quantize_weight(L->wd, d->E_loc, d->H, d->I, f->w, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
}

static void fp8_down_free(fp8_down *f) {
  CUDA_CHECK(cudaFree(f->q));
  CUDA_CHECK(cudaFree(f->sq));
  CUDA_CHECK(cudaFree(f->w));
  CUDA_CHECK(cudaFree(f->y));
}

static int fp8_down_run(const layer *L, fp8_down *f) {
  return mok_k_sm90_fp8_rows_gemm(&L->d, L->sched, (int)L->R, L->d.H, L->d.I, f->q, f->sq, f->w,
                                  f->y, L->status, 0);
}

/* rows_step: every row (1) or a sample; returns the worst |got - want| over
 * the largest |want| */
static double fp8_down_check(const char *name, const layer *L, const fp8_down *f, int rows_step) {
  const mok_k_dims *d = &L->d;
  const int H = d->H, I = d->I, KB = I / 128;
  std::vector<int32_t> sc((size_t)L->sched_ints);
  CUDA_CHECK(cudaMemcpy(sc.data(), L->sched, sc.size() * 4, cudaMemcpyDeviceToHost));
  const sched_ptrs sv = sched_view(d, sc.data());
  std::vector<uint8_t> q((size_t)L->R * I), w(f->w_bytes);
  std::vector<float> sq((size_t)L->R * KB);
  CUDA_CHECK(cudaMemcpy(q.data(), f->q, q.size(), cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(sq.data(), f->sq, sq.size() * 4, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(w.data(), f->w, w.size(), cudaMemcpyDeviceToHost));
  const std::vector<uint16_t> y = down16(f->y, (size_t)L->R * H);
  const float *sw = (const float *)(w.data() + mok_fp8_scales_offset((uint64_t)d->E_loc,
                                                                      (uint64_t)H, (uint64_t)I));
  float dec[256];
  for (int b = 0; b < 256; b++) dec[b] = mok_fp8_decode((uint8_t)b);
  double worst = 0, top = 0;
  size_t pad_bad = 0, checked = 0;
  for (int e = 0; e < d->E_loc; e++) {
    const int off = sv.offsets[e], cnt = sv.counts[e], end = sv.offsets[e + 1];
    for (int r = off; r < end; r++) {
      const bool used = r < off + cnt;
      if (!used) { /* padding rows: zeros */
        for (int n = 0; n < H; n++) pad_bad += y[(size_t)r * H + n] != 0;
        continue;
      }
      if ((r - off) % rows_step) continue;
      for (int n = 0; n < H; n++) {
        double acc = 0;
        for (int kb = 0; kb < KB; kb++) {
          double part = 0;
          for (int k = kb * 128; k < kb * 128 + 128; k++)
            part += (double)dec[q[(size_t)r * I + k]] *
                    dec[w[((size_t)e * H + n) * I + k]];
          acc += part * sq[(size_t)r * KB + kb] * sw[((size_t)e * (H / 128) + n / 128) * KB + kb];
        }
        const double got = bf16_host(y[(size_t)r * H + n]);
        worst = std::max(worst, fabs(got - acc));
        top = std::max(top, fabs(acc));
        checked++;
      }
    }
  }
  const double rel = top > 0 ? worst / top : worst;
  printf("  %s: fp8 down vs float64 over the same e4m3 values: %zu outputs, worst %.3g of the "
         "largest (bf16 output: 2^-9 = 1.95e-3); padding rows not zero: %zu\n",
         name, checked, rel, pad_bad);
  EXPECT(checked > 0 && rel < 4e-3 && pad_bad == 0,
         "%s: fp8 down: worst error %.3g of the largest output, %zu padding values not zero",
         name, rel, pad_bad);
  return rel;
}

/* The FP8 forward (gate/up with h quantised, then down; the routed rows and
 * a shared expert of T rows) on mok's kernel (the pingpong variant) and on
 * CUTLASS (the cutlass variant: the launch table's configuration and every
 * other, on every SM and on 7 and 1 CTAs):
 * g, u, y, the shared outputs and the whole fp8 workspace (h's bytes and
 * scales; everything else poisoned alike) must be bitwise equal. */
typedef struct fp8_fwd_out {
  std::vector<uint16_t> g, u, y, gs, us, ys;
  std::vector<uint8_t> ws;
} fp8_fwd_out;

static fp8_fwd_out fp8_forward_on(const layer *L, const uint8_t *xq, const float *xs,
                                  const uint8_t *tq, const float *ts, void *const w[3],
                                  void *const sw[3], uint16_t *shared[3], void *ws,
                                  size_t ws_bytes) {
  const mok_k_dims *d = &L->d;
  const size_t RI = (size_t)L->R * d->I, TI = (size_t)d->T * d->I_s;
  CUDA_CHECK(cudaMemset(L->g, 0xff, RI * 2));
  CUDA_CHECK(cudaMemset(L->u, 0xff, RI * 2));
  CUDA_CHECK(cudaMemset(L->y, 0xff, (size_t)L->R * d->H * 2));
  for (int i = 0; i < 3; i++)
    CUDA_CHECK(cudaMemset(shared[i], 0xff, (i == 2 ? (size_t)d->T * d->H : TI) * 2));
  CUDA_CHECK(cudaMemset(ws, 0xab, ws_bytes));
  MOK_CHECK(mok_k_fp8_expert_forward(d, L->sched, xq, xs, w[0], w[1], w[2], L->g, L->u, L->y, ws,
                                     L->status, 0));
  fp8_fwd_out o;
  CUDA_CHECK(cudaDeviceSynchronize());
  o.g = down16(L->g, RI);
  o.u = down16(L->u, RI);
  o.y = down16(L->y, (size_t)L->R * d->H);
  o.ws.resize(ws_bytes);
  CUDA_CHECK(cudaMemcpy(o.ws.data(), ws, ws_bytes, cudaMemcpyDeviceToHost));
  MOK_CHECK(mok_k_fp8_shared_forward(d, tq, ts, sw[0], sw[1], sw[2], shared[0], shared[1],
                                     shared[2], ws, L->status, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
  o.gs = down16(shared[0], TI);
  o.us = down16(shared[1], TI);
  o.ys = down16(shared[2], (size_t)d->T * d->H);
  return o;
}

/* The routed FP8 backward (the down dgrad with dg | du quantised, the gate/up
 * dgrad, the bf16 weight gradients) from the forward's g and u on L: every
 * output and the whole workspace (everything else poisoned alike). */
typedef struct fp8_bwd_io {
  uint16_t *rdout, *rdx, *dwg, *dwu, *dwd;
  uint8_t *dq;
  float *ds, *rw, *drw;
} fp8_bwd_io;

static std::vector<std::vector<uint8_t>> fp8_backward_on(const layer *L, const fp8_bwd_io *b,
                                                         void *const w[3], void *ws,
                                                         size_t ws_bytes) {
  const mok_k_dims *d = &L->d;
  const size_t W = (size_t)d->E_loc * d->I * d->H, TK = (size_t)d->T * d->K;
  const size_t RH = (size_t)L->R * d->H;
  CUDA_CHECK(cudaMemset(b->rdx, 0xff, RH * 2));
  CUDA_CHECK(cudaMemset(b->drw, 0xff, TK * 4));
  for (uint16_t *o : {b->dwg, b->dwu, b->dwd}) CUDA_CHECK(cudaMemset(o, 0xff, W * 2));
  CUDA_CHECK(cudaMemset(ws, 0xab, ws_bytes));
  MOK_CHECK(mok_k_fp8_expert_backward(d, L->sched, L->g, L->u, NULL, L->rx, b->rdout, b->dq, b->ds,
                                      b->rw, w[0], w[1], w[2], b->rdx, b->drw, b->dwg, b->dwu,
                                      b->dwd, ws, L->status, 0));
  CUDA_CHECK(cudaDeviceSynchronize());
  auto grab = [](const void *p, size_t n) {
    std::vector<uint8_t> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
    return v;
  };
  return {grab(b->rdx, RH * 2), grab(b->drw, TK * 4), grab(b->dwg, W * 2), grab(b->dwu, W * 2),
          grab(b->dwd, W * 2), grab(ws, ws_bytes)};
}

static void fp8_forward_variants(const char *name, layer *L) {
  mok_k_dims *d = &L->d;
  d->I_s = d->I; /* a shared expert of the routed experts' size: W's first expert */
  const size_t xb = (size_t)L->R * d->H, tb = (size_t)d->T * d->H;
  uint8_t *xq = (uint8_t *)dmalloc(xb), *tq = (uint8_t *)dmalloc(tb);
  float *xs = (float *)dmalloc(xb / 128 * 4), *ts = (float *)dmalloc(tb / 128 * 4);
  MOK_CHECK(mok_k_fp8_quantize_rows(L->rx, (int)L->R, d->H, xq, xs, 0));
  MOK_CHECK(mok_k_fp8_quantize_rows(L->x, d->T, d->H, tq, ts, 0));
  const uint16_t *src[3] = {L->wg, L->wu, L->wd};
  void *w[3], *sw[3];
  uint16_t *shared[3];
  for (int i = 0; i < 3; i++) {
    const int n = i == 2 ? d->H : d->I, k = i == 2 ? d->I : d->H;
    w[i] = dmalloc(mok_fp8_weight_bytes((uint64_t)d->E_loc, (uint64_t)n, (uint64_t)k));
    sw[i] = dmalloc(mok_fp8_weight_bytes(1, (uint64_t)n, (uint64_t)k));
    MOK_CHECK(mok_k_fp8_quantize_weight(src[i], d->E_loc, n, k, w[i], 0));
    MOK_CHECK(mok_k_fp8_quantize_weight(src[i], 1, n, k, sw[i], 0));
    shared[i] = (uint16_t *)dmalloc((i == 2 ? tb : (size_t)d->T * d->I_s) * 2);
  }
  const size_t ws_bytes = mok_k_fp8_workspace_bytes(d);
  void *ws = dmalloc(ws_bytes);
  fp8_bwd_io b;
  const size_t W = (size_t)d->E_loc * d->I * d->H, TK = (size_t)d->T * d->K;
  uint16_t *dout = (uint16_t *)dmalloc(tb * 2);
  b.rdout = (uint16_t *)dmalloc(xb * 2);
  b.rdx = (uint16_t *)dmalloc(xb * 2);
  b.dwg = (uint16_t *)dmalloc(W * 2);
  b.dwu = (uint16_t *)dmalloc(W * 2);
  b.dwd = (uint16_t *)dmalloc(W * 2);
  b.dq = (uint8_t *)dmalloc(xb);
  b.ds = (float *)dmalloc(xb / 128 * 4);
  b.rw = (float *)dmalloc(TK * 4);
  b.drw = (float *)dmalloc(TK * 4);
  fill(dout, tb, 47, 1.0f);
  MOK_CHECK(mok_k_gather_rows(d, L->sched, dout, b.rdout, L->status, 0));
  MOK_CHECK(mok_k_fp8_quantize_rows(b.rdout, (int)L->R, d->H, b.dq, b.ds, 0));
  {
    std::vector<float> rw(TK);
    for (size_t i = 0; i < TK; i++) rw[i] = 0.25f + (float)(rng_next() % 1000) / 1000.0f;
    CUDA_CHECK(cudaMemcpy(b.rw, rw.data(), TK * 4, cudaMemcpyHostToDevice));
  }
  const int variant = mok_k_sm90_variant();
  MOK_CHECK(mok_k_sm90_set_variant(MOK_K_SM90_PINGPONG));
  const fp8_fwd_out ref = fp8_forward_on(L, xq, xs, tq, ts, w, sw, shared, ws, ws_bytes);
  const std::vector<std::vector<uint8_t>> bref = fp8_backward_on(L, &b, w, ws, ws_bytes);
  static const char *const bwd_what[6] = {"routed d_x", "d_rw", "d_w_gate", "d_w_up", "d_w_down",
                                          "workspace (dg | du, h, their bytes)"};
  static const int grids[] = {0, 7, 1};
  int runs = 0, differ = 0;
  MOK_CHECK(mok_k_sm90_set_variant(MOK_K_SM90_CUTLASS));
  for (int c = -1; c < 0 || mok_k_sm90_fp8_cutlass_config_name(c); c++) /* -1: the table's */
    for (int gi = 0; gi < 3; gi++) {
      MOK_CHECK(mok_k_sm90_set_fp8_cutlass_config(c));
      mok_k_sm90_set_grid(grids[gi]);
      const fp8_fwd_out o = fp8_forward_on(L, xq, xs, tq, ts, w, sw, shared, ws, ws_bytes);
      const bool same[7] = {o.g == ref.g, o.u == ref.u, o.y == ref.y, o.ws == ref.ws,
                            o.gs == ref.gs, o.us == ref.us, o.ys == ref.ys};
      const char *what[7] = {"g", "u", "y", "workspace (h)", "shared g", "shared u", "shared y"};
      runs++;
      for (int i = 0; i < 7; i++)
        if (!same[i]) {
          differ++;
          EXPECT(false, "%s: fp8 forward on CUTLASS (%s, grid %d): %s differs from mok's kernel",
                 name, c < 0 ? "the table's" : mok_k_sm90_fp8_cutlass_config_name(c), grids[gi],
                 what[i]);
        }
      if (c >= 0) continue; /* the backward's dgrad has one configuration */
      const std::vector<std::vector<uint8_t>> bo = fp8_backward_on(L, &b, w, ws, ws_bytes);
      for (int i = 0; i < 6; i++)
        if (bo[i] != bref[i]) {
          differ++;
          EXPECT(false, "%s: fp8 backward on CUTLASS (grid %d): %s differs from mok's kernel",
                 name, grids[gi], bwd_what[i]);
        }
    }
  mok_k_sm90_set_grid(0);
  MOK_CHECK(mok_k_sm90_set_fp8_cutlass_config(-1));
  MOK_CHECK(mok_k_sm90_set_variant(variant));
  printf("  %s: fp8 forward on CUTLASS, %d configurations x grids, and the backward: %d outputs "
         "differ from mok's kernel\n", name, runs, differ);
  for (void *p : {(void *)dout, (void *)b.rdout, (void *)b.rdx, (void *)b.dwg, (void *)b.dwu,
                  (void *)b.dwd, (void *)b.dq, (void *)b.ds, (void *)b.rw, (void *)b.drw})
    CUDA_CHECK(cudaFree(p));
  for (int i = 0; i < 3; i++) {
    CUDA_CHECK(cudaFree(w[i]));
    CUDA_CHECK(cudaFree(sw[i]));
    CUDA_CHECK(cudaFree(shared[i]));
  }
  CUDA_CHECK(cudaFree(ws));
  CUDA_CHECK(cudaFree(xq));
  CUDA_CHECK(cudaFree(tq));
  CUDA_CHECK(cudaFree(xs));
  CUDA_CHECK(cudaFree(ts));
  d->I_s = 0;
}

static void fp8_case(const char *name, int T, int H, int I, int E_loc, int K, bool hot) {
  layer L;
  mok_k_dims d = make_dims(T, H, I, E_loc, K, 0);
  layer_alloc(&L, &d);
  const size_t W = (size_t)E_loc * I * H;
  fill(L.x, (size_t)T * H, 41, 1.0f);
  fill(L.wg, W, 42, 0.05f);
  fill(L.wu, W, 43, 0.05f);
  fill(L.wd, W, 44, 0.05f);
  std::vector<int32_t> ids((size_t)T * K);
  for (size_t i = 0; i < ids.size(); i++)
    ids[i] = hot ? (i % K == 0 ? 1 % E_loc : -1) : (int32_t)(rng_next() % (uint64_t)E_loc);
  layer_route(&L, ids);
  poison(&L);
  layer_forward(&L, false);
  fp8_down f;
  fp8_down_alloc(&f, &L);
  CUDA_CHECK(cudaMemset(f.y, 0xff, (size_t)L.R * H * 2));
  MOK_CHECK(fp8_down_run(&L, &f));
  CUDA_CHECK(cudaDeviceSynchronize());
  fp8_down_check(name, &L, &f, 1);
  const std::vector<uint16_t> first = down16(f.y, (size_t)L.R * H);
  CUDA_CHECK(cudaMemset(f.y, 0xff, (size_t)L.R * H * 2));
  MOK_CHECK(fp8_down_run(&L, &f));
  CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT(down16(f.y, (size_t)L.R * H) == first, "%s: fp8 down: two runs differ", name);
  int32_t st = -1;
  CUDA_CHECK(cudaMemcpy(&st, L.status, 4, cudaMemcpyDeviceToHost));
  EXPECT(st == 0, "%s: fp8 down: status %d", name, st);
  /* what the launcher refuses: N or K off the 128 blocks, missing operands */
  const int R = (int)L.R;
  EXPECT(mok_k_sm90_fp8_rows_gemm(&d, L.sched, R, H - 64, I, f.q, f.sq, f.w, f.y, L.status, 0) ==
                 MOK_EINVAL &&
             mok_k_sm90_fp8_rows_gemm(&d, L.sched, R, H, I + 32, f.q, f.sq, f.w, f.y, L.status,
                                      0) == MOK_EINVAL &&
             mok_k_sm90_fp8_rows_gemm(&d, L.sched, R, H, I, NULL, f.sq, f.w, f.y, L.status, 0) ==
                 MOK_EINVAL &&
             mok_k_sm90_fp8_rows_gemm(&d, L.sched, R, H, I, f.q, NULL, f.w, f.y, L.status, 0) ==
                 MOK_EINVAL &&
             mok_k_sm90_fp8_rows_gemm(&d, NULL, R, H, I, f.q, f.sq, f.w, f.y, L.status, 0) ==
                 MOK_EINVAL &&
             mok_k_sm90_fp8_rows_gemm(&d, L.sched, -1, H, I, f.q, f.sq, f.w, f.y, L.status, 0) ==
                 MOK_EINVAL,
         "%s: fp8 down: the launcher accepts an N or K off the 128 blocks, or a missing operand",
         name);
  fp8_forward_variants(name, &L);
  fp8_down_free(&f);
  layer_free(&L);
}

/* Each product's time, interleaved rep by rep: the bf16 down GEMM, and the
 * fp8 down and gate/up (h quantised) on mok's kernel (pingpong) and on each
 * CUTLASS configuration (the cutlass variant,
 * mok_k_sm90_set_fp8_cutlass_config). */
static void fp8_bench(const char *only) {
  printf("\nfp8 products on mok's kernel and on each CUTLASS configuration, bf16 down on the same "
         "rows (median ms of 10 after one, TFLOP/s by real rows); fp8 vs bf16 down outputs: rms "
         "difference over rms\n");
  const int variant = mok_k_sm90_variant();
  int configs = 0;
  while (mok_k_sm90_fp8_cutlass_config_name(configs)) configs++;
  for (int ti = 0; ti < 2; ti++)
    for (size_t si = 0; si < sizeof BSHAPES / sizeof BSHAPES[0]; si++) {
      const bshape *sh = &BSHAPES[si];
      const int T = ti ? 8192 : 2048;
      if (only && strcmp(only, sh->name)) continue;
      layer L;
      mok_k_dims d = bench_layer(sh, T, &L);
      layer_forward(&L, false);
      fp8_down f;
      fp8_down_alloc(&f, &L);
      const size_t xb = (size_t)L.R * d.H, wb = mok_fp8_weight_bytes((uint64_t)d.E_loc,
                                                                      (uint64_t)d.I, (uint64_t)d.H);
      uint8_t *xq = (uint8_t *)dmalloc(xb);
      float *xs = (float *)dmalloc(xb / 128 * 4);
      void *wg = dmalloc(wb), *wu = dmalloc(wb), *ws = dmalloc(mok_k_fp8_workspace_bytes(&d));
      MOK_CHECK(mok_k_fp8_quantize_rows(L.rx, (int)L.R, d.H, xq, xs, 0));
      MOK_CHECK(mok_k_fp8_quantize_weight(L.wg, d.E_loc, d.I, d.H, wg, 0));
      MOK_CHECK(mok_k_fp8_quantize_weight(L.wu, d.E_loc, d.I, d.H, wu, 0));
      /* step 0: bf16 down; then per kernel (mok's, each configuration) its down and gate/up */
      const int kernels = 1 + configs, steps = 1 + 2 * kernels;
      std::vector<cudaEvent_t> ev(steps + 1);
      for (auto &e : ev) CUDA_CHECK(cudaEventCreate(&e));
      std::vector<std::vector<float>> v(steps);
      for (int i = 0; i < 11; i++) { /* interleaved */
        for (int k = 0; k < steps; k++) {
          const int kern = (k - 1) / 2; /* 0: mok's; c + 1: configuration c */
          MOK_CHECK(mok_k_sm90_set_variant(k > 0 && kern > 0 ? MOK_K_SM90_CUTLASS
                                                              : MOK_K_SM90_PINGPONG));
          MOK_CHECK(mok_k_sm90_set_fp8_cutlass_config(k > 0 && kern > 0 ? kern - 1 : -1));
          CUDA_CHECK(cudaEventRecord(ev[k], 0));
          if (k == 0)
            MOK_CHECK(mok_k_down(&d, L.sched, L.h, L.wd, L.y, L.status, 0));
          else if (k % 2)
            MOK_CHECK(fp8_down_run(&L, &f));
          else
            MOK_CHECK(mok_k_fp8_gate_up(&d, L.sched, xq, xs, wg, wu, L.g, L.u, ws, L.status, 0));
        }
        CUDA_CHECK(cudaEventRecord(ev[steps], 0));
        CUDA_CHECK(cudaEventSynchronize(ev[steps]));
        for (int k = 0; i && k < steps; k++) {
          float ms;
          CUDA_CHECK(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
          v[k].push_back(ms);
        }
      }
      MOK_CHECK(mok_k_sm90_set_fp8_cutlass_config(-1));
      MOK_CHECK(mok_k_sm90_set_variant(variant));
      const double flops = 2.0 * T * d.K * (double)d.H * d.I;
      std::vector<float> m(steps);
      for (int k = 0; k < steps; k++) m[k] = median(v[k]);
      const std::vector<uint16_t> yb = down16(L.y, (size_t)L.R * d.H), y8 = down16(f.y, (size_t)L.R * d.H);
      double se = 0, sr = 0;
      for (size_t i = 0; i < yb.size(); i++) {
        const double a = bf16_host(yb[i]), b = bf16_host(y8[i]);
        se += (a - b) * (a - b);
        sr += a * a;
      }
      printf("%-16s %5d down bf16 %6.3f ms %5.1f TF/s; fp8 vs bf16 rms diff %.3g\n", sh->name, T,
             m[0], flops / m[0] * 1e-9, sr > 0 ? sqrt(se / sr) : 0.0);
      for (int kern = 0; kern < kernels; kern++) {
        const float md = m[1 + 2 * kern], mg = m[2 + 2 * kern];
        printf("%-16s %5d   %-18s down %6.3f ms %6.1f TF/s (%.2fx mok's) | gate/up %6.3f ms "
               "%6.1f TF/s (%.2fx mok's)\n",
               sh->name, T, kern ? mok_k_sm90_fp8_cutlass_config_name(kern - 1) : "mok's kernel",
               md, flops / md * 1e-9, m[1] / md, mg, 2 * flops / mg * 1e-9, m[2] / mg);
      }
      fp8_down_check(sh->name, &L, &f, 1000);
      for (auto &e : ev) CUDA_CHECK(cudaEventDestroy(e));
      CUDA_CHECK(cudaFree(xq));
      CUDA_CHECK(cudaFree(xs));
      CUDA_CHECK(cudaFree(wg));
      CUDA_CHECK(cudaFree(wu));
      CUDA_CHECK(cudaFree(ws));
      fp8_down_free(&f);
      layer_free(&L);
    }
}

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "correct";
  CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, sm_%d%d, %d SMs; sm90 path usable: %d\n", prop.name, prop.major,
         prop.minor, prop.multiProcessorCount, mok_k_sm90_usable());
  MOK_CHECK(kernel_init_from_env());
  printf("2-CTA clusters at once: %d%s\n", mok_k_sm90_pair_clusters(),
         mok_k_sm90_pair_clusters() ? "" : " (the cluster variant runs as rows)");
  if (!mok_k_sm90_usable()) {
    printf("the sm90 path is not usable on this device\n");
    return 1;
  }
  bool all = !strcmp(mode, "all");
  /* the cutlass variant with every product that has a CUTLASS configuration
   * on it, whatever the rows (the small shapes here are below the launch
   * table's thresholds): on the cooperative configurations, or the ping-pong
   * ones with "every-pp" */
  if (all || !strcmp(mode, "correct") || !strcmp(mode, "bwd")) {
    const bool pp = argc > 2 && !strcmp(argv[2], "every-pp");
    if (argc > 2 && !pp && strcmp(argv[2], "every")) {
      fprintf(stderr, "%s: the cutlass choice is every or every-pp, not '%s'\n", mode, argv[2]);
      return 2;
    }
    MOK_CHECK(mok_k_sm90_set_cutlass_choice(pp ? MOK_K_CUTLASS_EVERY_PP : MOK_K_CUTLASS_EVERY));
    printf("the cutlass variant: every product with a CUTLASS configuration, %s\n",
           pp ? "ping-pong" : "cooperative");
  }
  if (all || !strcmp(mode, "correct")) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
      test_case(&CASES[i]);
      mok_k_sm90_set_grid(0);
    }
    test_shared();
  }
  if (all || !strcmp(mode, "bwd")) {
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++) {
      test_bwd_case(&CASES[i]);
      mok_k_sm90_set_grid(0);
    }
    test_bwd_shared(160);
    test_bwd_shared(136);
  }
  if (all || !strcmp(mode, "bench"))
    bench(argc > 2 ? argv[2] : NULL, argc > 3 ? atoi(argv[3]) : 0);
  if (all || !strcmp(mode, "bwdbench"))
    bwd_bench(argc > 2 ? argv[2] : NULL, argc > 3 ? atoi(argv[3]) : 0);
  if (all || !strcmp(mode, "fp8")) {
    printf("\nfp8 down (block-scaled e4m3):\n");
    fp8_case("fp8 256x256 E4", 200, 256, 256, 4, 2, false);
    fp8_case("fp8 384x512 E7 ragged", 700, 384, 512, 7, 3, false);
    fp8_case("fp8 one hot expert", 300, 256, 384, 5, 2, true);
    fp8_case("fp8 T=1", 1, 128, 128, 3, 1, false);
  }
  if (!strcmp(mode, "fp8bench")) fp8_bench(argc > 2 ? argv[2] : NULL);
  if (!strcmp(mode, "trace"))
    trace(argc > 2 ? argv[2] : NULL, argc > 3 ? atoi(argv[3]) : 0);
  if (!strcmp(mode, "profile"))
    profile(argc > 2 ? argv[2] : NULL, argc > 3 ? atoi(argv[3]) : 0,
            argc > 4 ? argv[4] : "rows,cluster");
  printf("%s: %s (%d failures)\n", mode, failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
