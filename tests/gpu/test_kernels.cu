/* SPDX-License-Identifier: Apache-2.0 */
/* GPU tests of the kernel library (kernels/mok_kernels.h).
 *
 *   test_kernels correct   every shape against the float64 reference, 5-run
 *                          bitwise determinism, schedule vs the daemon's host
 *                          builder (both build paths), bad routing ids,
 *                          corrupt schedules, the schedule build alone over
 *                          many routing cases
 *   test_kernels quick     one small shape + the error cases (for sanitizers)
 *   test_kernels time      forward/backward timings at the benchmark shape
 *
 * Inputs are random and never zero; every output is poisoned (NaN bits)
 * before each run, so an element nobody wrote fails. Exit status 0 only
 * when every check passed.
 */
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "../../kernels/mok_kernels.h"
#include "../harness/kernel_choices.h"
#include "../../kernels/common/fp8_e4m3.h"
#include "../../proto/mok_layout.h"
#include "../../proto/mok_status.h"

extern "C" {
#include "../ref/ref64.h"
#include "host_bf16_rng.h"
long long shim_rows_capacity(int T, int K, int E_loc, int row_align);
long long shim_schedule_ints(int T, int K, int E_loc, int row_align);
unsigned shim_sched_magic(void);
int shim_schedule_build(int T, int K, int E, int E_loc, int first, int row_align,
                        const int32_t *ids, int32_t *sched, size_t ints);
int shim_schedule_build_limit(int T, int K, int E, int E_loc, int first, int row_align,
                              int rows_limit, const int32_t *ids, int32_t *sched, size_t ints);
int shim_schedule_validate(int T, int K, int E, int E_loc, int first, int row_align,
                           const int32_t *sched, size_t ints);
}

#include "../harness/cuda_check.cuh"

/* ---- shapes ----------------------------------------------------------------------- */

enum route_kind { ROUTE_RANDOM, ROUTE_IDLE, ROUTE_ONE };

typedef struct shape {
  const char *name;
  int T, H, I, E, E_loc, first, K, I_s;
  int has_limit;
  float limit;
  int route;
  double p_drop;
} shape;

static const shape small_shapes[] = {
    /* name             T    H    I   E  Eloc first K  I_s lim  L     route        drop */
    {"odd_T",           77,  128, 96, 8, 8,   0,    2, 0,  0,   0.0f, ROUTE_RANDOM, 0.1},
    {"idle_nonlocal",   130, 64,  64, 16, 8,  4,    3, 0,  0,   0.0f, ROUTE_IDLE,   0.15},
    {"one_expert",      300, 128, 128, 4, 4,  0,    2, 64, 0,   0.0f, ROUTE_ONE,    0.3},
    {"k1_clamp_shared", 201, 192, 128, 6, 6,  0,    1, 160, 1,  1.0f, ROUTE_RANDOM, 0.1},
    {"clamp_drop_k4",   96,  256, 136, 12, 12, 0,   4, 72, 1,   1.0f, ROUTE_RANDOM, 0.25},
    {"many_experts",    700, 64,  64, 320, 160, 80, 6, 0,  0,   0.0f, ROUTE_RANDOM, 0.1},
    {"T1_Eloc1_K1",     1,   64,  64, 1, 1,   0,    1, 0,  0,   0.0f, ROUTE_RANDOM, 0.0},
    {"T0",              0,   64,  64, 4, 4,   0,    2, 64, 0,   0.0f, ROUTE_RANDOM, 0.0},
};
static const shape mid_shape = {"mid", 2048, 1024, 512, 16, 16, 0, 4, 512, 0, 0.0f,
                                ROUTE_RANDOM, 0.05};

static mok_k_dims dims_of(const shape *s) {
  mok_k_dims d;
  memset(&d, 0, sizeof d);
  d.T = s->T;
  d.H = s->H;
  d.I = s->I;
  d.E = s->E;
  d.E_loc = s->E_loc;
  d.first_expert = s->first;
  d.K = s->K;
  d.I_s = s->I_s;
  d.row_align = mok_k_row_align();
  d.has_limit = s->has_limit;
  d.limit = s->limit;
  return d;
}

/* ---- host inputs ------------------------------------------------------------------ */

typedef struct host_inputs {
  std::vector<uint16_t> x, wg, wu, wd, sg, su, sd, d_out;
  std::vector<float> rw;
  std::vector<int32_t> ids;
} host_inputs;

/* K distinct ids per token (when E allows), then drops. */
static void make_ids(const shape *s, std::vector<int32_t> &ids) {
  ids.assign((size_t)s->T * s->K, -1);
  for (int t = 0; t < s->T; t++) {
    for (int k = 0; k < s->K; k++) {
      int32_t id = -1;
      for (int tries = 0; tries < 64; tries++) {
        if (s->route == ROUTE_ONE) {
          id = k == 0 ? s->first + (s->E_loc > 1 ? 1 : 0) : (int32_t)(rng_next() % s->E);
        } else {
          id = (int32_t)(rng_next() % s->E);
          /* idle: odd local experts never chosen */
          if (s->route == ROUTE_IDLE && id >= s->first && id < s->first + s->E_loc &&
              ((id - s->first) & 1))
            continue;
        }
        bool dup = false;
        for (int j = 0; j < k; j++) dup |= ids[(size_t)t * s->K + j] == id;
        if (!dup || k == 0) break;
      }
      if (k > 0 && rng_unit() < s->p_drop) id = -1;
      if (s->route == ROUTE_ONE && k > 0 && id >= s->first && id < s->first + s->E_loc) id = -1;
      ids[(size_t)t * s->K + k] = id;
    }
  }
  /* drops on k = 0 too (not for ROUTE_ONE, which keeps every token on one expert) */
  if (s->route != ROUTE_ONE)
    for (int t = 0; t < s->T; t++)
      if (rng_unit() < s->p_drop * 0.5) ids[(size_t)t * s->K] = -1;
}

/* With a clamp, some channels get a large constant term through x[:,0] so
 * they are always clamped, and the rest stay far below L: a value near L
 * would let bf16 rounding of g flip the clamp mask against the float64
 * reference (docs/math.md masks on the rounded g). */
static void make_ffn_weights(const shape *s, int n, int groups, std::vector<uint16_t> &wg,
                             std::vector<uint16_t> &wu, std::vector<uint16_t> &wd) {
  const int H = s->H;
  const double a = (s->has_limit ? 0.75 : 4.0) / sqrt((double)H), b = 3.0 / sqrt((double)n);
  wg.resize((size_t)groups * n * H);
  wu.resize(wg.size());
  wd.resize((size_t)groups * H * n);
  for (size_t i = 0; i < wg.size(); i++) wg[i] = rand_bf16(a);
  for (size_t i = 0; i < wu.size(); i++) wu[i] = rand_bf16(a);
  for (size_t i = 0; i < wd.size(); i++) wd[i] = rand_bf16(b);
  if (s->has_limit) {
    for (int e = 0; e < groups; e++)
      for (int i = 0; i < n; i++) {
        size_t at = ((size_t)e * n + i) * H; /* column 0 */
        if (i % 4 == 0) wg[at] = host_f2bf(3.0f * s->limit);
        if (i % 4 == 1) wu[at] = host_f2bf(3.0f * s->limit);
        if (i % 4 == 2) wu[at] = host_f2bf(-3.0f * s->limit);
      }
  }
}

static void make_inputs(const shape *s, host_inputs *in) {
  const size_t TH = (size_t)s->T * s->H;
  in->x.resize(TH);
  for (size_t i = 0; i < TH; i++) in->x[i] = rand_bf16(1.0);
  if (s->has_limit)
    for (int t = 0; t < s->T; t++)
      in->x[(size_t)t * s->H] = host_f2bf((float)(0.9 + 0.2 * rng_unit()));
  make_ffn_weights(s, s->I, s->E_loc, in->wg, in->wu, in->wd);
  if (s->I_s > 0) make_ffn_weights(s, s->I_s, 1, in->sg, in->su, in->sd);
  in->rw.resize((size_t)s->T * s->K);
  for (size_t i = 0; i < in->rw.size(); i++) in->rw[i] = (float)(0.05 + 0.95 * rng_unit());
  in->d_out.resize(TH);
  for (size_t i = 0; i < TH; i++) in->d_out[i] = rand_bf16(1.0);
  make_ids(s, in->ids);
}

/* ---- device layer ------------------------------------------------------------------ */

typedef struct dbuf {
  void *p;
  size_t bytes;
  const char *name;
  int is_output; /* poisoned before and compared after each run */
} dbuf;

typedef struct dev_layer {
  mok_k_dims d;
  long long R, sched_ints;
  uint16_t *x, *wg, *wu, *wd, *sg, *su, *sd, *d_out;
  float *rw;
  int32_t *ids;
  int32_t *sched;
  uint16_t *routed_x, *acts_g, *acts_u, *acts_gs, *acts_us, *routed_y, *shared_y, *out;
  uint16_t *routed_d_out, *routed_d_x, *shared_d_x, *d_x, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd;
  float *d_rw;
  void *ws;
  int32_t *status;
  std::vector<dbuf> bufs;
} dev_layer;

static void *dalloc(dev_layer *L, size_t bytes, const char *name, int is_output) {
  void *p = NULL;
  if (bytes == 0) return NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  L->bufs.push_back(dbuf{p, bytes, name, is_output});
  return p;
}

static void dev_layer_alloc(dev_layer *L, const mok_k_dims *d) {
  L->d = *d;
  L->R = mok_k_rows_capacity(d);
  L->sched_ints = mok_k_schedule_ints(d);
  const size_t TH = (size_t)d->T * d->H, TK = (size_t)d->T * d->K;
  const size_t W = (size_t)d->E_loc * d->I * d->H, S = (size_t)d->I_s * d->H;
  const size_t RH = (size_t)L->R * d->H, RI = (size_t)L->R * d->I, TIs = (size_t)d->T * d->I_s;
  L->x = (uint16_t *)dalloc(L, TH * 2, "x", 0);
  L->wg = (uint16_t *)dalloc(L, W * 2, "w_gate", 0);
  L->wu = (uint16_t *)dalloc(L, W * 2, "w_up", 0);
  L->wd = (uint16_t *)dalloc(L, W * 2, "w_down", 0);
  L->sg = (uint16_t *)dalloc(L, S * 2, "s_gate", 0);
  L->su = (uint16_t *)dalloc(L, S * 2, "s_up", 0);
  L->sd = (uint16_t *)dalloc(L, S * 2, "s_down", 0);
  L->d_out = (uint16_t *)dalloc(L, TH * 2, "d_out", 0);
  L->rw = (float *)dalloc(L, TK * 4, "rw", 0);
  L->ids = (int32_t *)dalloc(L, TK * 4 + 4, "ids", 0);
  L->sched = (int32_t *)dalloc(L, (size_t)L->sched_ints * 4, "schedule", 1);
  L->routed_x = (uint16_t *)dalloc(L, RH * 2, "routed_x", 1);
  L->acts_g = (uint16_t *)dalloc(L, RI * 2, "acts_g", 1);
  L->acts_u = (uint16_t *)dalloc(L, RI * 2, "acts_u", 1);
  L->acts_gs = (uint16_t *)dalloc(L, TIs * 2, "acts_gs", 1);
  L->acts_us = (uint16_t *)dalloc(L, TIs * 2, "acts_us", 1);
  L->routed_y = (uint16_t *)dalloc(L, RH * 2, "routed_y", 1);
  L->shared_y = (uint16_t *)dalloc(L, d->I_s ? TH * 2 : 0, "shared_y", 1);
  L->out = (uint16_t *)dalloc(L, TH * 2, "out", 1);
  L->routed_d_out = (uint16_t *)dalloc(L, RH * 2, "routed_d_out", 1);
  L->routed_d_x = (uint16_t *)dalloc(L, RH * 2, "routed_d_x", 1);
  L->shared_d_x = (uint16_t *)dalloc(L, d->I_s ? TH * 2 : 0, "shared_d_x", 1);
  L->d_x = (uint16_t *)dalloc(L, TH * 2, "d_x", 1);
  L->d_rw = (float *)dalloc(L, TK * 4, "d_rw", 1);
  L->dwg = (uint16_t *)dalloc(L, W * 2, "d_w_gate", 1);
  L->dwu = (uint16_t *)dalloc(L, W * 2, "d_w_up", 1);
  L->dwd = (uint16_t *)dalloc(L, W * 2, "d_w_down", 1);
  L->dsg = (uint16_t *)dalloc(L, S * 2, "d_s_gate", 1);
  L->dsu = (uint16_t *)dalloc(L, S * 2, "d_s_up", 1);
  L->dsd = (uint16_t *)dalloc(L, S * 2, "d_s_down", 1);
  L->ws = dalloc(L, mok_k_workspace_bytes(d), "workspace", 0);
  L->status = (int32_t *)dalloc(L, 4, "status", 0);
}

static void dev_layer_free(dev_layer *L) {
  for (size_t i = 0; i < L->bufs.size(); i++) CUDA_CHECK(cudaFree(L->bufs[i].p));
  L->bufs.clear();
}

/* Host-to-device copy that has landed when it returns: a pageable cudaMemcpy
 * may still be in flight, and the test stream does not wait for it. */
static void upload(void *dst, const void *src, size_t bytes) {
  if (bytes) CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
}

static void dev_layer_upload(dev_layer *L, const host_inputs *in) {
  const mok_k_dims *d = &L->d;
  upload(L->x, in->x.data(), in->x.size() * 2);
  upload(L->wg, in->wg.data(), in->wg.size() * 2);
  upload(L->wu, in->wu.data(), in->wu.size() * 2);
  upload(L->wd, in->wd.data(), in->wd.size() * 2);
  if (d->I_s) {
    upload(L->sg, in->sg.data(), in->sg.size() * 2);
    upload(L->su, in->su.data(), in->su.size() * 2);
    upload(L->sd, in->sd.data(), in->sd.size() * 2);
  }
  upload(L->d_out, in->d_out.data(), in->d_out.size() * 2);
  upload(L->rw, in->rw.data(), in->rw.size() * 4);
  upload(L->ids, in->ids.data(), in->ids.size() * 4);
}

static void poison_outputs(dev_layer *L, cudaStream_t s) {
  for (size_t i = 0; i < L->bufs.size(); i++)
    if (L->bufs[i].is_output || L->bufs[i].p == L->ws)
      CUDA_CHECK(cudaMemsetAsync(L->bufs[i].p, 0xff, L->bufs[i].bytes, s));
  CUDA_CHECK(cudaMemsetAsync(L->status, 0, 4, s));
  CUDA_CHECK(cudaStreamSynchronize(s)); /* before any host upload */
}

/* The layer as the engine chains it (docs/math.md "The whole layer"). */
static void enqueue_forward(dev_layer *L, cudaStream_t s) {
  const mok_k_dims *d = &L->d;
  MOK_CHECK(mok_k_schedule_build(d, L->ids, L->sched, L->ws, L->status, s));
  MOK_CHECK(mok_k_gather_rows(d, L->sched, L->x, L->routed_x, L->status, s));
  MOK_CHECK(mok_k_expert_forward(d, L->sched, L->routed_x, L->wg, L->wu, L->wd, L->acts_g,
                                 L->acts_u, L->routed_y, L->ws, L->status, s));
  MOK_CHECK(mok_k_shared_forward(d, L->x, L->sg, L->su, L->sd, L->acts_gs, L->acts_us,
                                 L->shared_y, L->ws, L->status, s));
  MOK_CHECK(mok_k_combine(d, L->sched, L->routed_y, L->rw, L->shared_y, L->out, L->status, s));
}

/* gathers: routed_x is gathered from x by the backward itself
 * (mok_k_expert_backward_gathering), else the forward's is read */
static void enqueue_backward_from(dev_layer *L, bool gathers, cudaStream_t s) {
  const mok_k_dims *d = &L->d;
  MOK_CHECK(mok_k_gather_rows(d, L->sched, L->d_out, L->routed_d_out, L->status, s));
  if (gathers)
    MOK_CHECK(mok_k_expert_backward_gathering(d, L->sched, L->acts_g, L->acts_u, L->x,
                                              L->routed_x, L->routed_d_out, L->rw, L->wg, L->wu,
                                              L->wd, L->routed_d_x, L->d_rw, L->dwg, L->dwu,
                                              L->dwd, L->ws, L->status, s));
  else
    MOK_CHECK(mok_k_expert_backward(d, L->sched, L->acts_g, L->acts_u, L->routed_x,
                                    L->routed_d_out, L->rw, L->wg, L->wu, L->wd, L->routed_d_x,
                                    L->d_rw, L->dwg, L->dwu, L->dwd, L->ws, L->status, s));
  MOK_CHECK(mok_k_shared_backward(d, L->x, L->d_out, L->acts_gs, L->acts_us, L->sg, L->su,
                                  L->sd, L->shared_d_x, L->dsg, L->dsu, L->dsd, L->ws,
                                  L->status, s));
  MOK_CHECK(mok_k_dispatch_backward(d, L->sched, L->routed_d_x, L->shared_d_x, L->d_x,
                                    L->status, s));
}

static void enqueue_backward(dev_layer *L, cudaStream_t s) { enqueue_backward_from(L, false, s); }

static int32_t read_status(dev_layer *L, cudaStream_t s) {
  int32_t st = -1;
  CUDA_CHECK(cudaStreamSynchronize(s));
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(&st, L->status, 4, cudaMemcpyDeviceToHost));
  return st;
}

static int32_t run_chain(dev_layer *L, cudaStream_t s) {
  poison_outputs(L, s);
  enqueue_forward(L, s);
  enqueue_backward(L, s);
  return read_status(L, s);
}

static std::vector<unsigned char> snapshot(dev_layer *L) {
  size_t total = 0;
  for (size_t i = 0; i < L->bufs.size(); i++)
    if (L->bufs[i].is_output) total += L->bufs[i].bytes;
  std::vector<unsigned char> all(total);
  size_t at = 0;
  for (size_t i = 0; i < L->bufs.size(); i++)
    if (L->bufs[i].is_output) {
      CUDA_CHECK(cudaMemcpy(all.data() + at, L->bufs[i].p, L->bufs[i].bytes,
                            cudaMemcpyDeviceToHost));
      at += L->bufs[i].bytes;
    }
  return all;
}

static std::vector<double> download_bf16(const uint16_t *p, size_t n) {
  std::vector<uint16_t> h(n);
  if (n) CUDA_CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  std::vector<double> out(n);
  for (size_t i = 0; i < n; i++) out[i] = host_bf2d(h[i]);
  return out;
}

static std::vector<double> download_f32(const float *p, size_t n) {
  std::vector<float> h(n);
  if (n) CUDA_CHECK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return std::vector<double>(h.begin(), h.end());
}

static bool all_finite_bf16(const uint16_t *p, size_t n) {
  std::vector<uint16_t> h(n);
  if (n) CUDA_CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  for (size_t i = 0; i < n; i++)
    if ((h[i] & 0x7f80) == 0x7f80) return false;
  return true;
}

/* ---- float64 reference, token ranges on threads ---------------------------------- */

typedef struct ref_task {
  const ref64_layer *L;
  const ref64_inputs *in;
  const double *d_out;
  int t0, t1, backward;
  double *out, *d_x, *d_rw;
  std::vector<double> dwg, dwu, dwd, dsg, dsu, dsd;
} ref_task;

static void *ref_worker(void *arg) {
  ref_task *k = (ref_task *)arg;
  ref64_layer Ls = *k->L;
  Ls.T = k->t1 - k->t0;
  ref64_inputs in = *k->in;
  in.x += (size_t)k->t0 * Ls.H;
  in.rw += (size_t)k->t0 * Ls.K;
  in.ids += (size_t)k->t0 * Ls.K;
  if (!k->backward) {
    ref64_forward(&Ls, &in, k->out + (size_t)k->t0 * Ls.H);
    return NULL;
  }
  size_t W = (size_t)Ls.E_loc * Ls.I * Ls.H, S = (size_t)Ls.I_s * Ls.H;
  k->dwg.resize(W);
  k->dwu.resize(W);
  k->dwd.resize(W);
  k->dsg.resize(S);
  k->dsu.resize(S);
  k->dsd.resize(S);
  ref64_backward(&Ls, &in, k->d_out + (size_t)k->t0 * Ls.H, k->d_x + (size_t)k->t0 * Ls.H,
                 k->d_rw + (size_t)k->t0 * Ls.K, k->dwg.data(), k->dwu.data(), k->dwd.data(),
                 S ? k->dsg.data() : NULL, S ? k->dsu.data() : NULL, S ? k->dsd.data() : NULL);
  return NULL;
}

typedef struct ref_result {
  std::vector<double> out, d_x, d_rw, dwg, dwu, dwd, dsg, dsu, dsd;
} ref_result;

static void reference(const shape *s, const host_inputs *hin, ref_result *r) {
  ref64_layer L = {s->T, s->H, s->I, s->E, s->E_loc, s->first, s->K, s->I_s, s->has_limit,
                   (double)s->limit};
  auto to_d = [](const std::vector<uint16_t> &v) {
    std::vector<double> o(v.size());
    for (size_t i = 0; i < v.size(); i++) o[i] = host_bf2d(v[i]);
    return o;
  };
  std::vector<double> x = to_d(hin->x), wg = to_d(hin->wg), wu = to_d(hin->wu),
                      wd = to_d(hin->wd), sg = to_d(hin->sg), su = to_d(hin->su),
                      sd = to_d(hin->sd), d_out = to_d(hin->d_out);
  std::vector<double> rw(hin->rw.begin(), hin->rw.end());
  ref64_inputs in = {x.data(), rw.data(), wg.data(), wu.data(), wd.data(),
                     s->I_s ? sg.data() : NULL, s->I_s ? su.data() : NULL,
                     s->I_s ? sd.data() : NULL, hin->ids.data()};
  const size_t TH = (size_t)s->T * s->H, W = (size_t)s->E_loc * s->I * s->H,
               S = (size_t)s->I_s * s->H;
  r->out.assign(TH, 0.0);
  r->d_x.assign(TH, 0.0);
  r->d_rw.assign((size_t)s->T * s->K, 0.0);
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int n = (int)std::max(1L, std::min(cores, 16L));
  if (n > s->T) n = s->T > 0 ? s->T : 1;
  for (int pass = 0; pass < 2; pass++) {
    std::vector<ref_task> tasks(n);
    std::vector<pthread_t> th(n);
    for (int i = 0; i < n; i++) {
      ref_task &k = tasks[i];
      k.L = &L;
      k.in = &in;
      k.d_out = d_out.data();
      k.t0 = (int)((long long)s->T * i / n);
      k.t1 = (int)((long long)s->T * (i + 1) / n);
      k.backward = pass;
      k.out = r->out.data();
      k.d_x = r->d_x.data();
      k.d_rw = r->d_rw.data();
      if (pthread_create(&th[i], NULL, ref_worker, &k) != 0) {
        fprintf(stderr, "pthread_create failed\n");
        exit(2);
      }
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    if (pass == 1) { /* weight gradients: sum the token ranges in order */
      r->dwg.assign(W, 0.0);
      r->dwu.assign(W, 0.0);
      r->dwd.assign(W, 0.0);
      r->dsg.assign(S, 0.0);
      r->dsu.assign(S, 0.0);
      r->dsd.assign(S, 0.0);
      for (int i = 0; i < n; i++) {
        for (size_t j = 0; j < W; j++) {
          r->dwg[j] += tasks[i].dwg[j];
          r->dwu[j] += tasks[i].dwu[j];
          r->dwd[j] += tasks[i].dwd[j];
        }
        for (size_t j = 0; j < S; j++) {
          r->dsg[j] += tasks[i].dsg[j];
          r->dsu[j] += tasks[i].dsu[j];
          r->dsd[j] += tasks[i].dsd[j];
        }
      }
    }
  }
}

/* ---- the per-shape test ------------------------------------------------------------- */

static void check_err(const char *shape_name, const char *what, const std::vector<double> &ref,
                      const std::vector<double> &got, double *worst) {
  double e = ref64_rel_err(ref.data(), got.data(), ref.size());
  printf("  %-16s %-10s rel_err %.3e\n", shape_name, what, e);
  EXPECT(e < 1e-2, "%s: %s relative error %.3e (NaN/Inf or >= 1e-2)", shape_name, what, e);
  if (!(e <= *worst)) *worst = e;
}

/* ---- schedule builds ----------------------------------------------------------------- */

#define SCHED_POISON 0x5a5a5a5a /* no schedule entry or id holds it */

/* One device build of d's schedule from the device ids, plain (copy
 * NULL) or the snapshot (copy: where its ids land), into a fresh poisoned
 * schedule; returns the status. */
static int32_t device_build(const mok_k_dims *d, const int32_t *ids, void *ws,
                            int32_t *status, std::vector<int32_t> &got,
                            std::vector<int32_t> *copy, cudaStream_t stream) {
  const size_t ints = (size_t)mok_k_schedule_ints(d), n_ids = (size_t)d->T * d->K;
  int32_t *sched = NULL, *dcopy = NULL;
  CUDA_CHECK(cudaMalloc(&sched, ints * 4 + 16));
  CUDA_CHECK(cudaMemset(sched, 0x5a, ints * 4 + 16));
  if (copy) {
    CUDA_CHECK(cudaMalloc(&dcopy, n_ids * 4 + 16));
    CUDA_CHECK(cudaMemset(dcopy, 0x5a, n_ids * 4 + 16));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemsetAsync(status, 0, 4, stream));
  if (copy)
    MOK_CHECK(mok_k_schedule_build_snapshot(d, ids, dcopy, sched, ws, status, stream));
  else
    MOK_CHECK(mok_k_schedule_build(d, ids, sched, ws, status, stream));
  int32_t st = -1;
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(&st, status, 4, cudaMemcpyDeviceToHost));
  got.resize(ints + 4);
  CUDA_CHECK(cudaMemcpy(got.data(), sched, got.size() * 4, cudaMemcpyDeviceToHost));
  for (int i = 0; i < 4; i++) /* nothing past the schedule's end */
    if (got[ints + i] != SCHED_POISON) st = -2;
  got.resize(ints);
  if (copy) {
    copy->resize(n_ids);
    CUDA_CHECK(cudaMemcpy(copy->data(), dcopy, n_ids * 4, cudaMemcpyDeviceToHost));
  }
  CUDA_CHECK(cudaFree(sched));
  CUDA_CHECK(cudaFree(dcopy));
  return st;
}

/* The plain and the snapshot build: the host builder's schedule bits,
 * nothing written past the schedule, and the snapshot's copy holds the ids
 * it used. */
static void test_builds(const shape *s, dev_layer *L, const std::vector<int32_t> &host,
                        const std::vector<int32_t> &ids, cudaStream_t stream) {
  const mok_k_dims d = dims_of(s);
  std::vector<int32_t> got, got_ids;
  int32_t st = device_build(&d, L->ids, L->ws, L->status, got, NULL, stream);
  EXPECT(st == 0, "%s: build status %d", s->name, st);
  EXPECT(got == host, "%s: build: schedule differs from daemon/schedule.c", s->name);
  st = device_build(&d, L->ids, L->ws, L->status, got, &got_ids, stream);
  EXPECT(st == 0, "%s: snapshot build status %d", s->name, st);
  EXPECT(got == host, "%s: snapshot build: schedule differs from daemon/schedule.c", s->name);
  EXPECT(got_ids == ids, "%s: snapshot build: the copy differs from the ids", s->name);
  int32_t *sched = NULL;
  CUDA_CHECK(cudaMalloc(&sched, host.size() * 4 + 16));
  EXPECT(d.T == 0 ||
             mok_k_schedule_build_snapshot(&d, L->ids, NULL, sched, L->ws, L->status, stream) ==
                 MOK_EINVAL,
         "%s: a snapshot build without its copy was accepted", s->name);
  CUDA_CHECK(cudaFree(sched));
}

/* The schedule build alone over many (T, K, E, E_loc, first_expert,
 * rows_limit): plain and snapshot, against daemon/schedule.c bit
 * for bit, with its status: ids outside [-1, E) raise EROUTE and count as
 * dropped (the host builder refuses them, so it gets them as -1); past the
 * capacity the schedule is the empty one and EOVERFLOW is raised. Its own
 * generator: the shapes' random inputs stay as they are. */
enum sched_route { SR_RANDOM, SR_SKEW, SR_OTHERS, SR_INVALID };

typedef struct sched_case {
  int T, K, E, E_loc, first;
  int rows_limit; /* 0; > 0 a capacity; -1: exactly the rows used; -2: one row fewer */
  int route;
  double p_drop;
} sched_case;

static uint64_t sched_rng_state = 0x243f6a8885a308d3ull;
static uint64_t sched_rng(void) { /* splitmix64 */
  uint64_t z = (sched_rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static int sched_rng_below(int n) { return n > 0 ? (int)(sched_rng() % (uint64_t)n) : 0; }
static double sched_rng_unit(void) { return (double)(sched_rng() >> 11) * (1.0 / 9007199254740992.0); }

static void make_sched_ids(const sched_case *c, std::vector<int32_t> &ids) {
  const size_t n = (size_t)c->T * c->K;
  ids.assign(n, -1);
  const int32_t bad[] = {-2, -3, c->E, c->E + 1, INT32_MIN, INT32_MAX, -1000};
  const int hot = c->first + sched_rng_below(c->E_loc);
  for (size_t i = 0; i < n; i++) {
    int32_t id = sched_rng_below(c->E);
    if (c->route == SR_SKEW) id = hot;
    if (c->route == SR_OTHERS) { /* every id another rank's */
      const int others = c->E - c->E_loc;
      id = others > 0 ? sched_rng_below(others) : -1;
      if (id >= c->first) id += c->E_loc;
    }
    if (sched_rng_unit() < c->p_drop) id = -1;
    if (c->route == SR_INVALID && sched_rng_unit() < 0.05)
      id = bad[sched_rng_below((int)(sizeof bad / sizeof bad[0]))];
    ids[i] = id;
  }
  if (c->route == SR_INVALID && n > 0) ids[n - 1] = c->E; /* at least one */
}

static mok_k_dims sched_dims(const sched_case *c, int rows_limit) {
  mok_k_dims d;
  memset(&d, 0, sizeof d);
  d.T = c->T;
  d.K = c->K;
  d.E = c->E;
  d.E_loc = c->E_loc;
  d.first_expert = c->first;
  d.H = d.I = 8;
  d.row_align = mok_k_row_align();
  d.rows_limit = rows_limit;
  return d;
}

/* Returns the number of device builds compared. */
static int test_sched_case(const sched_case *c, cudaStream_t stream) {
  std::vector<int32_t> ids, valid;
  make_sched_ids(c, ids);
  valid = ids;
  bool invalid = false;
  for (size_t i = 0; i < valid.size(); i++)
    if (valid[i] < -1 || valid[i] >= c->E) {
      valid[i] = -1;
      invalid = true;
    }
  int rows_limit = c->rows_limit;
  if (rows_limit < 0) { /* from the rows the ids use */
    mok_k_dims d0 = sched_dims(c, 0);
    std::vector<int32_t> h0((size_t)mok_k_schedule_ints(&d0));
    int st0 = shim_schedule_build(c->T, c->K, c->E, c->E_loc, c->first, d0.row_align,
                                  valid.data(), h0.data(), h0.size());
    EXPECT(st0 == MOK_OK, "schedule case T=%d: host build %d", c->T, st0);
    const int used = h0[MOK_SCHED_H_ROWS_USED];
    rows_limit = rows_limit == -1 ? used : used - 1;
    if (rows_limit < 1) rows_limit = 1;
  }
  const mok_k_dims d = sched_dims(c, rows_limit);
  char err[160];
  if (mok_k_check_dims(&d, err, sizeof err) != MOK_OK) {
    EXPECT(0, "schedule case: dims rejected: %s", err);
    return 0;
  }
  const size_t ints = (size_t)mok_k_schedule_ints(&d), n = ids.size();
  const int R = (int)mok_k_rows_capacity(&d);
  std::vector<int32_t> want(ints);
  int hst = shim_schedule_build_limit(c->T, c->K, c->E, c->E_loc, c->first, d.row_align,
                                      rows_limit, valid.data(), want.data(), want.size());
  int32_t want_st = invalid ? MOK_EROUTE : 0;
  if (hst == MOK_EOVERFLOW) { /* the empty schedule */
    want.assign(ints, 0);
    want[MOK_SCHED_H_MAGIC] = (int32_t)MOK_SCHED_MAGIC;
    want[MOK_SCHED_H_TOKENS] = d.T;
    want[MOK_SCHED_H_TOPK] = d.K;
    want[MOK_SCHED_H_LOCAL_EXPERTS] = d.E_loc;
    want[MOK_SCHED_H_ROW_ALIGN] = d.row_align;
    want[MOK_SCHED_H_ROWS_CAPACITY] = R;
    want[MOK_SCHED_H_FIRST_EXPERT] = d.first_expert;
    for (size_t i = MOK_SCHED_HEADER_INTS + 2 * (size_t)d.E_loc + 1; i < ints; i++) want[i] = -1;
    want_st = MOK_EOVERFLOW; /* the larger code */
  } else {
    EXPECT(hst == MOK_OK, "schedule case T=%d K=%d E_loc=%d: host build %d", c->T, c->K, c->E_loc,
           hst);
  }

  int32_t *dids = NULL, *ws = NULL, *status = NULL;
  CUDA_CHECK(cudaMalloc(&dids, n * 4 + 16));
  CUDA_CHECK(cudaMalloc(&status, 4));
  CUDA_CHECK(cudaMalloc(&ws, mok_k_workspace_bytes(&d) + 16));
  if (n) CUDA_CHECK(cudaMemcpy(dids, ids.data(), n * 4, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());
  int builds = 0;
  for (int snap = 0; snap < 2; snap++) {
    std::vector<int32_t> got, got_ids;
    int32_t st = device_build(&d, dids, ws, status, got, snap ? &got_ids : NULL, stream);
    bool ok = st == want_st && got == want && (!snap || got_ids == ids);
    EXPECT(ok,
           "schedule case T=%d K=%d E=%d E_loc=%d first=%d rows_limit=%d route=%d%s: "
           "status %d (want %d), schedule %s, copy %s",
           c->T, c->K, c->E, c->E_loc, c->first, rows_limit, c->route, snap ? " snapshot" : "",
           st, want_st, got == want ? "equal" : "DIFFERS",
           !snap ? "-" : got_ids == ids ? "equal" : "DIFFERS");
    builds++;
  }
  CUDA_CHECK(cudaFree(dids));
  CUDA_CHECK(cudaFree(ws));
  CUDA_CHECK(cudaFree(status));
  return builds;
}

/* max_slots: T*K of any case at most this (T cut down; quick mode, which
 * runs under compute-sanitizer) */
static void test_schedule_builds(int n_random, int max_slots, cudaStream_t stream) {
  const sched_case fixed[] = {
      /* T     K   E     E_loc first rows_limit route       drop */
      {0,     2,  4,    4,    0,    0,     SR_RANDOM,  0.0},
      {0,     1,  4096, 4096, 0,    0,     SR_RANDOM,  0.0},  /* T=0, many experts */
      {1,     1,  1,    1,    0,    0,     SR_RANDOM,  0.0},
      {1,     1,  1,    1,    0,    0,     SR_RANDOM,  1.0},
      {1,     8,  64,   8,    16,   0,     SR_RANDOM,  0.2},
      {1000,  1,  16,   16,   0,    0,     SR_RANDOM,  0.1},  /* K=1 */
      {500,   4,  8,    1,    3,    0,     SR_RANDOM,  0.1},  /* E_loc=1 */
      {31,    1,  8,    8,    0,    0,     SR_RANDOM,  0.0},
      {32,    1,  8,    8,    0,    0,     SR_RANDOM,  0.0},
      {33,    1,  8,    8,    0,    0,     SR_RANDOM,  0.0},
      {1023,  1,  40,   40,   0,    0,     SR_RANDOM,  0.0},
      {1025,  1,  40,   40,   0,    0,     SR_RANDOM,  0.0},
      {77,    3,  12,   12,   0,    0,     SR_RANDOM,  0.3},
      {3000,  8,  8192, 4096, 4096, 0,     SR_RANDOM,  0.1},  /* many experts */
      {2048,  8,  1024, 1024, 0,    0,     SR_RANDOM,  0.05}, /* E_loc 1024 */
      {700,   6,  2050, 1025, 1025, 0,     SR_RANDOM,  0.05}, /* E_loc 1025, first 1025 */
      {4096,  8,  64,   64,   0,    0,     SR_SKEW,    0.0},  /* every slot one expert */
      {2000,  10, 256,  256,  0,    0,     SR_SKEW,    0.3},
      {300,   4,  64,   16,   16,   0,     SR_OTHERS,  0.1},  /* nothing local */
      {256,   4,  32,   32,   0,    0,     SR_INVALID, 0.1},  /* EROUTE */
      {600,   3,  64,   16,   32,   0,     SR_INVALID, 0.2},
      {64,    2,  8,    8,    0,    0,     SR_INVALID, 1.0},  /* every valid id dropped */
      {1024,  8,  64,   64,   0,    4096,  SR_RANDOM,  0.0},  /* EOVERFLOW */
      {1024,  8,  64,   64,   0,    4096,  SR_INVALID, 0.0},  /* both */
      {5000,  4,  32,   32,   0,    5000,  SR_SKEW,    0.0},
      {900,   5,  40,   20,   10,   -1,    SR_RANDOM,  0.2},  /* exactly the rows used */
      {900,   5,  40,   20,   10,   -2,    SR_RANDOM,  0.2},  /* one row fewer */
      {900,   5,  4096, 4096, 0,    -2,    SR_RANDOM,  0.2},  /* the same, many experts */
      {8192,  10, 64,   64,   0,    0,     SR_RANDOM,  0.02}, /* a large job */
      {8192,  8,  256,  32,   96,   0,     SR_RANDOM,  0.0},
  };
  int cases = 0, builds = 0;
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++, cases++) {
    sched_case c = fixed[i];
    if (c.T * c.K > max_slots) c.T = max_slots / c.K;
    builds += test_sched_case(&c, stream);
  }
  for (int i = 0; i < n_random; i++, cases++) {
    sched_case c;
    memset(&c, 0, sizeof c);
    const int tsize = sched_rng_below(4);
    c.T = tsize == 0 ? sched_rng_below(40) : tsize == 1 ? sched_rng_below(600)
                                        : sched_rng_below(tsize == 2 ? 3000 : 9000);
    c.K = 1 + sched_rng_below(10);
    const int big = sched_rng_below(8) == 0;
    c.E_loc = big ? 1000 + sched_rng_below(3200) : 1 + sched_rng_below(sched_rng_below(2) ? 16 : 300);
    c.E = c.E_loc + (sched_rng_below(2) ? 0 : sched_rng_below(3 * c.E_loc + 8));
    c.first = sched_rng_below(c.E - c.E_loc + 1);
    const int r = sched_rng_below(10);
    c.route = r < 6 ? SR_RANDOM : r == 6 ? SR_SKEW : r == 7 ? SR_OTHERS : SR_INVALID;
    if (c.route == SR_OTHERS && c.E == c.E_loc) c.route = SR_RANDOM;
    c.p_drop = sched_rng_below(3) == 0 ? 0.0 : sched_rng_unit() * 0.5;
    const int lim = sched_rng_below(6);
    c.rows_limit = lim == 0 ? -1 : lim == 1 ? -2 : 0;
    if (c.T * c.K > max_slots) c.T = max_slots / c.K;
    if (lim == 2 && c.T > 0) c.rows_limit = 1 + sched_rng_below(c.T * c.K);
    builds += test_sched_case(&c, stream);
  }
  printf("schedule builds: %d cases, %d device builds (plain and snapshot) "
         "against daemon/schedule.c\n",
         cases, builds);
}

/* mok_k_moves: copies and zero fills at every alignment class, several in
 * one launch, bytes around them untouched; bad calls refused. */
static void test_moves(cudaStream_t stream) {
  const size_t cap = 1 << 16;
  unsigned char *buf = NULL;
  CUDA_CHECK(cudaMalloc(&buf, 2 * cap));
  std::vector<unsigned char> host(2 * cap), want(2 * cap);
  for (size_t i = 0; i < host.size(); i++) host[i] = (unsigned char)(rng_next() | 1u);
  CUDA_CHECK(cudaMemcpy(buf, host.data(), host.size(), cudaMemcpyHostToDevice));
  want = host;
  /* dst offsets in [0, cap), srcs in [cap, 2 cap): no overlap */
  const struct { size_t dst, src, bytes; int zero; } cases[] = {
      {0, cap, 4096, 0},         /* 16-byte words */
      {8192, cap + 100, 7, 0},   /* bytes */
      {12292, cap + 8, 40, 0},   /* 4-byte words */
      {16384, 0, 4, 1},          /* a status word */
      {20001, 0, 13, 1},         /* odd zeros */
      {24576, cap + 4096, 8000, 0},
      {32768, 0, 4096, 1},
      {61000, cap + 3, 3, 0},
  };
  mok_k_move mv[MOK_K_MOVES_MAX];
  const int n = (int)(sizeof cases / sizeof cases[0]);
  for (int i = 0; i < n; i++) {
    mv[i].dst = buf + cases[i].dst;
    mv[i].src = cases[i].zero ? NULL : buf + cases[i].src;
    mv[i].bytes = cases[i].bytes;
    mv[i].take = 0;
    for (size_t b = 0; b < cases[i].bytes; b++)
      want[cases[i].dst + b] = cases[i].zero ? 0 : host[cases[i].src + b];
  }
  MOK_CHECK(mok_k_moves(mv, n, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> got(2 * cap);
  CUDA_CHECK(cudaMemcpy(got.data(), buf, got.size(), cudaMemcpyDeviceToHost));
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); i++) bad += got[i] != want[i];
  EXPECT(bad == 0, "moves: %zu bytes differ from the expected result", bad);
  /* takes: the bytes out, zeros left at the source (a job's status word
   * goes out and is reset in one step), in each word size */
  const struct { size_t dst, src, bytes; } takes[] = {
      {36864, cap + 8192, 4096}, /* 16-byte words */
      {41000, cap + 13001, 5},   /* bytes (apart from the first's source: they run at once) */
      {45056, cap + 16384, 4},   /* a status word */
  };
  const int nt = (int)(sizeof takes / sizeof takes[0]);
  for (int i = 0; i < nt; i++) {
    mv[i] = mok_k_move{buf + takes[i].dst, buf + takes[i].src, takes[i].bytes, 1};
    for (size_t b = 0; b < takes[i].bytes; b++) {
      want[takes[i].dst + b] = host[takes[i].src + b]; /* nonzero: host bytes are odd */
      want[takes[i].src + b] = 0;
    }
  }
  MOK_CHECK(mok_k_moves(mv, nt, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  CUDA_CHECK(cudaMemcpy(got.data(), buf, got.size(), cudaMemcpyDeviceToHost));
  bad = 0;
  for (size_t i = 0; i < got.size(); i++) bad += got[i] != want[i];
  EXPECT(bad == 0, "moves: after takes, %zu bytes differ from the expected result", bad);
  mok_k_move overlap = {buf + 8, buf, 16, 1}, nosrc = {buf, NULL, 16, 1};
  EXPECT(mok_k_moves(&overlap, 1, stream) == MOK_EINVAL, "moves: a take onto its source accepted");
  EXPECT(mok_k_moves(&nosrc, 1, stream) == MOK_EINVAL, "moves: a take without a source accepted");
  EXPECT(mok_k_moves(mv, MOK_K_MOVES_MAX + 1, stream) == MOK_EINVAL, "moves: n too large accepted");
  EXPECT(mok_k_moves(NULL, 1, stream) == MOK_EINVAL, "moves: NULL list accepted");
  mok_k_move big = {buf, buf + cap, MOK_K_MOVE_BYTES_MAX + 1, 0};
  EXPECT(mok_k_moves(&big, 1, stream) == MOK_EINVAL, "moves: an oversized move accepted");
  mok_k_move nodst = {NULL, buf, 16, 0};
  EXPECT(mok_k_moves(&nodst, 1, stream) == MOK_EINVAL, "moves: a NULL destination accepted");
  EXPECT(mok_k_moves(mv, 0, stream) == MOK_OK, "moves: an empty list refused");
  CUDA_CHECK(cudaFree(buf));
}

static std::vector<unsigned char> download_raw(const void *p, size_t bytes) {
  std::vector<unsigned char> h(bytes);
  if (bytes) CUDA_CHECK(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost));
  return h;
}

/* A bf16 value with the special cases the quantisers must carry, in every
 * fifth block: NaN, inf, huge and tiny magnitudes; zero blocks; else
 * random, block by block of another binade. Its own generator: the shapes'
 * inputs (rng_next) stay what they were. */
static uint16_t fp8_test_value(size_t block) {
  static uint32_t state = 0x9e3779b9u;
  state = state * 1664525u + 1013904223u;
  const uint32_t r = state;
  if (block % 5 == 0) switch ((r >> 24) % 13) {
    case 0: return 0x7fc0; /* NaN */
    case 1: return 0xff80; /* -inf */
    case 2: return 0x7f7f; /* bf16 max */
    case 3: return 0x0001; /* the smallest subnormal */
    default: break;
    }
  if (block % 7 == 3) return 0; /* a zero block */
  const float mag = ldexpf(1.0f, (int)(block % 40) - 20);
  const float v = ((float)(r >> 8) / 16777216.0f - 0.5f) * mag;
  uint32_t u;
  memcpy(&u, &v, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float bf16_value(uint16_t b) {
  const uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* The GPU quantisers against the header's arithmetic on the host (the one
 * the cpu engine runs): every byte of the packed weight (its e4m3 bytes,
 * their transpose, the zero gaps and the scales) and of the quantised rows;
 * decoded values within e4m3's precision of their inputs; bad calls
 * refused. */
/* The hardware encode (mok_fp8_encode2) against the definition
 * (mok_fp8_encode) over every f32 bit pattern: mismatches counted, the
 * first few kept. */
__global__ void fp8_encode_all_kernel(unsigned long long *bad, uint32_t *first) {
  for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32);
       i += (uint64_t)gridDim.x * blockDim.x) {
    const float f = mok_fp8_f32_of_bits((uint32_t)i);
    const uint16_t hw = mok_fp8_encode2(f, -f);
    const uint16_t sw = (uint16_t)(mok_fp8_encode(f) | (uint16_t)mok_fp8_encode(-f) << 8);
    if (hw != sw) {
      const unsigned long long k = atomicAdd(bad, 1ull);
      if (k < 4) first[k] = (uint32_t)i;
    }
  }
}

static void test_fp8_encode_all(cudaStream_t stream) {
  unsigned long long *dbad, bad = 0;
  uint32_t *dfirst, first[4] = {0, 0, 0, 0};
  CUDA_CHECK(cudaMalloc(&dbad, 8));
  CUDA_CHECK(cudaMalloc(&dfirst, 16));
  CUDA_CHECK(cudaMemsetAsync(dbad, 0, 8, stream));
  fp8_encode_all_kernel<<<4096, 256, 0, stream>>>(dbad, dfirst);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpyAsync(&bad, dbad, 8, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaMemcpyAsync(first, dfirst, 16, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  printf("fp8: hardware e4m3 encode vs the definition over all 2^32 f32 (and their negations): "
         "%llu differ\n", bad);
  EXPECT(bad == 0, "fp8: the hardware encode differs from mok_fp8_encode on %llu inputs "
         "(first 0x%08x 0x%08x)", bad, first[0], first[1]);
  CUDA_CHECK(cudaFree(dbad));
  CUDA_CHECK(cudaFree(dfirst));
}

static void test_fp8_quantizers(cudaStream_t stream) {
  const int E = 3, N = 256, K = 384, rows = 37, KR = 640;
  std::vector<uint16_t> w((size_t)E * N * K), x((size_t)rows * KR);
  for (size_t i = 0; i < w.size(); i++) {
    const size_t n = (i / K) % N, k = i % K, e = i / ((size_t)N * K);
    w[i] = fp8_test_value((e * (N / 128) + n / 128) * (K / 128) + k / 128);
  }
  for (size_t i = 0; i < x.size(); i++) x[i] = fp8_test_value((i / KR) * (KR / 128) + (i % KR) / 128);
  const size_t packed_bytes = (size_t)mok_fp8_weight_bytes(E, N, K);
  const size_t at = (size_t)mok_fp8_scales_offset(E, N, K);
  const size_t t_at = (size_t)mok_fp8_transposed_offset(E, N, K);
  std::vector<unsigned char> want(packed_bytes, 0);
  size_t close = 0, normal = 0;
  for (int e = 0; e < E; e++)
    for (int nb = 0; nb < N / 128; nb++)
      for (int kb = 0; kb < K / 128; kb++) {
        float amax = 0.0f;
        for (int n = 0; n < 128; n++)
          for (int k = 0; k < 128; k++)
            amax = fmaxf(amax, fabsf(bf16_value(w[((size_t)e * N + nb * 128 + n) * K + kb * 128 + k])));
        const int ex = mok_fp8_scale_exp(amax);
        const float sc = mok_fp8_pow2(ex);
        for (int n = 0; n < 128; n++)
          for (int k = 0; k < 128; k++) {
            const size_t i = ((size_t)e * N + nb * 128 + n) * K + kb * 128 + k;
            const float v = bf16_value(w[i]);
            want[i] = mok_fp8_quantize(v, ex);
            /* the transposed section: byte (e, k, n) is byte (e, n, k) */
            want[t_at + ((size_t)e * K + kb * 128 + k) * N + nb * 128 + n] = want[i];
            const float back = mok_fp8_decode(want[i]) * sc;
            if (isfinite(v) && fabsf(v) > amax / 64.0f) {
              normal++;
              close += fabsf(back - v) <= fabsf(v) / 16.0f;
            }
          }
        memcpy(&want[at + 4 * (((size_t)e * (N / 128) + nb) * (K / 128) + kb)], &sc, 4);
      }
  EXPECT(normal > 0 && close == normal, "fp8: %zu of %zu weights dequantise within 1/16", close,
         normal);
  void *dw = NULL, *dp = NULL, *dx = NULL, *dq = NULL, *ds = NULL;
  CUDA_CHECK(cudaMalloc(&dw, w.size() * 2));
  CUDA_CHECK(cudaMalloc(&dp, packed_bytes));
  CUDA_CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dp, 0xa5, packed_bytes)); /* every byte must be written */
  MOK_CHECK(mok_k_fp8_quantize_weight((const mok_k_bf16 *)dw, E, N, K, dp, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> got = download_raw(dp, packed_bytes);
  size_t bad = 0, bad_t = 0;
  for (size_t i = 0; i < packed_bytes; i++) bad += got[i] != want[i];
  for (size_t i = t_at; i < at; i++) bad_t += got[i] != want[i];
  EXPECT(bad == 0, "fp8: %zu of %zu packed-weight bytes differ from the host's (%zu of them in "
         "the transposed section)", bad, packed_bytes, bad_t);

  std::vector<unsigned char> wq((size_t)rows * KR);
  std::vector<float> wsc((size_t)rows * (KR / 128));
  for (int r = 0; r < rows; r++)
    for (int kb = 0; kb < KR / 128; kb++) {
      float amax = 0.0f;
      for (int k = 0; k < 128; k++) amax = fmaxf(amax, fabsf(bf16_value(x[(size_t)r * KR + kb * 128 + k])));
      const int ex = mok_fp8_scale_exp(amax);
      for (int k = 0; k < 128; k++) {
        const size_t i = (size_t)r * KR + kb * 128 + k;
        wq[i] = mok_fp8_quantize(bf16_value(x[i]), ex);
      }
      wsc[(size_t)r * (KR / 128) + kb] = mok_fp8_pow2(ex);
    }
  CUDA_CHECK(cudaMalloc(&dx, x.size() * 2));
  CUDA_CHECK(cudaMalloc(&dq, wq.size()));
  CUDA_CHECK(cudaMalloc(&ds, wsc.size() * 4));
  CUDA_CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(dq, 0xa5, wq.size()));
  CUDA_CHECK(cudaMemset(ds, 0xa5, wsc.size() * 4));
  MOK_CHECK(mok_k_fp8_quantize_rows((const mok_k_bf16 *)dx, rows, KR, (uint8_t *)dq, (float *)ds,
                                    stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<unsigned char> gq = download_raw(dq, wq.size()), gs = download_raw(ds, wsc.size() * 4);
  EXPECT(gq == wq, "fp8: quantised rows differ from the host's");
  EXPECT(memcmp(gs.data(), wsc.data(), gs.size()) == 0, "fp8: row scales differ from the host's");

  EXPECT(mok_k_fp8_quantize_weight((const mok_k_bf16 *)dw, E, 200, K, dp, stream) == MOK_EINVAL,
         "fp8: a weight with N not a multiple of 128 accepted");
  EXPECT(mok_k_fp8_quantize_weight((const mok_k_bf16 *)dw, 0, N, K, dp, stream) == MOK_EINVAL,
         "fp8: a weight of no experts accepted");
  EXPECT(mok_k_fp8_quantize_weight((const mok_k_bf16 *)dw, E, N, K, (char *)dp + 1, stream) ==
             MOK_EINVAL,
         "fp8: a misaligned packed weight accepted");
  EXPECT(mok_k_fp8_quantize_rows((const mok_k_bf16 *)dx, rows, 100, (uint8_t *)dq, (float *)ds,
                                 stream) == MOK_EINVAL,
         "fp8: rows of 100 accepted");
  CUDA_CHECK(cudaFree(dw));
  CUDA_CHECK(cudaFree(dp));
  CUDA_CHECK(cudaFree(dx));
  CUDA_CHECK(cudaFree(dq));
  CUDA_CHECK(cudaFree(ds));
}

/* The backward that gathers x's rows itself (mokd's, whose ctx keeps no
 * routed x): wherever the copy runs, every output, routed_x included,
 * equals the chain's bit for bit. routed_x is NaN when the backward starts,
 * so a row it failed to write, or wrote after the gate/up weight gradient
 * read it, shows. */
static void test_gathering_backward(const shape *s, dev_layer *L,
                                    const std::vector<unsigned char> &first, cudaStream_t stream) {
  const mok_k_dims *d = &L->d;
  const int keep = mok_k_gather_host();
  for (int h = 0; h < MOK_K_GATHER_HOSTS; h++) {
    MOK_CHECK(mok_k_set_gather_host(h));
    poison_outputs(L, stream);
    enqueue_forward(L, stream);
    CUDA_CHECK(cudaMemsetAsync(L->routed_x, 0xff, (size_t)L->R * d->H * 2, stream));
    enqueue_backward_from(L, true, stream);
    const int32_t st = read_status(L, stream);
    EXPECT(st == 0 && snapshot(L) == first,
           "%s: the gathering backward (x gathered by %s) differs from gather + backward "
           "(status %d)",
           s->name, mok_k_gather_host_name(h), st);
  }
  MOK_CHECK(mok_k_set_gather_host(keep));
  EXPECT(mok_k_set_gather_host(MOK_K_GATHER_HOSTS) == MOK_EINVAL &&
             mok_k_set_gather_host(-1) == MOK_EINVAL && mok_k_gather_host() == keep &&
             mok_k_gather_host_parse("gu_dgrad") == MOK_K_GATHER_GU_DGRAD &&
             mok_k_gather_host_parse("gu") == -1 && mok_k_gather_host_parse(NULL) == -1,
         "gather host: the setter or the parser accepts what is not a host");
}

/* The bytes buffer p held in a snapshot of the outputs. */
static std::vector<unsigned char> snapshot_part(const dev_layer *L,
                                                const std::vector<unsigned char> &snap,
                                                const void *p) {
  size_t at = 0;
  for (size_t i = 0; i < L->bufs.size(); i++) {
    if (!L->bufs[i].is_output) continue;
    if (L->bufs[i].p == p)
      return std::vector<unsigned char>(snap.begin() + at, snap.begin() + at + L->bufs[i].bytes);
    at += L->bufs[i].bytes;
  }
  return std::vector<unsigned char>();
}

/* The layer as mokd runs a bf16 layer of one GPU, in one routed buffer
 * (routed_d_out's here, NaN before each use): the forward's y over x's
 * rows and the shared expert's y in out, read back by combine; the
 * backward's shared d_x in d_x (or in shared_d_x), read back by the K-sum
 * of mok_k_expert_backward_in_place; with the acts recomputed before it or
 * the forward's kept. Every result equals the chain's bit for bit, and the
 * buffer ends holding the chain's routed x (padding rows zeros). */
static void test_one_buffer(const shape *s, dev_layer *L, const std::vector<unsigned char> &first,
                            cudaStream_t stream) {
  const mok_k_dims *d = &L->d;
  uint16_t *buf = L->routed_d_out;
  const size_t RH = (size_t)L->R * d->H * 2, RI = (size_t)L->R * d->I * 2;
  for (int shared_in_dx = 0; shared_in_dx < 2; shared_in_dx++)
    for (int recompute = 0; recompute < 2; recompute++) {
      poison_outputs(L, stream);
      uint16_t *shared_y = d->I_s ? L->out : NULL;
      MOK_CHECK(mok_k_schedule_build(d, L->ids, L->sched, L->ws, L->status, stream));
      MOK_CHECK(mok_k_expert_forward_gathering(d, L->sched, L->x, buf, L->wg, L->wu, L->wd,
                                               L->acts_g, L->acts_u, buf, L->ws, L->status,
                                               stream));
      MOK_CHECK(mok_k_shared_forward(d, L->x, L->sg, L->su, L->sd, L->acts_gs, L->acts_us,
                                     shared_y, L->ws, L->status, stream));
      MOK_CHECK(mok_k_combine(d, L->sched, buf, L->rw, shared_y, L->out, L->status, stream));
      if (recompute) {
        CUDA_CHECK(cudaMemsetAsync(L->acts_g, 0xff, RI, stream));
        CUDA_CHECK(cudaMemsetAsync(L->acts_u, 0xff, RI, stream));
        CUDA_CHECK(cudaMemsetAsync(buf, 0xff, RH, stream));
        MOK_CHECK(mok_k_gather_rows(d, L->sched, L->x, buf, L->status, stream));
        MOK_CHECK(mok_k_expert_recompute_acts(d, L->sched, buf, L->wg, L->wu, L->acts_g,
                                              L->acts_u, L->ws, L->status, stream));
      }
      CUDA_CHECK(cudaMemsetAsync(buf, 0xff, RH, stream));
      uint16_t *sdx = !d->I_s ? NULL : shared_in_dx ? L->d_x : L->shared_d_x;
      MOK_CHECK(mok_k_shared_backward(d, L->x, L->d_out, L->acts_gs, L->acts_us, L->sg, L->su,
                                      L->sd, sdx, L->dsg, L->dsu, L->dsd, L->ws, L->status,
                                      stream));
      MOK_CHECK(mok_k_gather_rows(d, L->sched, L->d_out, buf, L->status, stream));
      MOK_CHECK(mok_k_expert_backward_in_place(d, L->sched, L->acts_g, L->acts_u, L->x, buf,
                                               L->rw, L->wg, L->wu, L->wd, sdx, L->d_x, L->d_rw,
                                               L->dwg, L->dwu, L->dwd, L->ws, L->status,
                                               stream));
      const int32_t st = read_status(L, stream);
      EXPECT(st == 0, "%s: one buffer (shared d_x in %s, %s): status %d", s->name,
             shared_in_dx ? "d_x" : "shared_d_x", recompute ? "acts recomputed" : "acts kept",
             st);
      const std::vector<unsigned char> now = snapshot(L);
      for (size_t i = 0; i < L->bufs.size(); i++) {
        const dbuf &b = L->bufs[i];
        /* not written on this path: the chain's other routed buffers, the
         * shared y (in out), the shared d_x when it went into d_x */
        if (!b.is_output || b.p == L->routed_x || b.p == L->routed_y || b.p == L->routed_d_x ||
            b.p == L->shared_y || (shared_in_dx && b.p == L->shared_d_x))
          continue;
        const void *want_of = b.p == buf ? (const void *)L->routed_x : b.p;
        EXPECT(snapshot_part(L, now, b.p) == snapshot_part(L, first, want_of),
               "%s: one buffer (shared d_x in %s, %s): %s differs from the chain's%s", s->name,
               shared_in_dx ? "d_x" : "shared_d_x",
               recompute ? "acts recomputed" : "acts kept", b.name,
               b.p == buf ? " routed x" : "");
      }
    }
  /* the layer as the chain leaves it (routed_d_out holds x's rows now, the
   * chain's other routed buffers poison): the tests after this one read it */
  EXPECT(run_chain(L, stream) == 0, "%s: chain after the one-buffer runs failed", s->name);
}

static void test_shape(const shape *s, int runs, cudaStream_t stream) {
  mok_k_dims d = dims_of(s);
  char err[160];
  if (mok_k_check_dims(&d, err, sizeof err) != MOK_OK) {
    EXPECT(0, "%s: dims rejected: %s", s->name, err);
    return;
  }
  host_inputs hin;
  make_inputs(s, &hin);
  dev_layer L;
  dev_layer_alloc(&L, &d);
  dev_layer_upload(&L, &hin);

  int32_t st = run_chain(&L, stream);
  EXPECT(st == 0, "%s: status %d after a valid chain", s->name, st);

  /* schedule: bitwise equal to the daemon's host builder, and accepted by
   * both validators */
  std::vector<int32_t> mine((size_t)L.sched_ints), host((size_t)L.sched_ints);
  CUDA_CHECK(cudaMemcpy(mine.data(), L.sched, mine.size() * 4, cudaMemcpyDeviceToHost));
  int hst = shim_schedule_build(d.T, d.K, d.E, d.E_loc, d.first_expert, d.row_align,
                                hin.ids.data(), host.data(), host.size());
  EXPECT(hst == MOK_OK, "%s: host schedule build %d", s->name, hst);
  EXPECT(mine == host, "%s: device schedule differs from daemon/schedule.c", s->name);
  EXPECT(shim_schedule_validate(d.T, d.K, d.E, d.E_loc, d.first_expert, d.row_align,
                                mine.data(), mine.size()) == MOK_OK,
         "%s: host validator rejects the device schedule", s->name);
  CUDA_CHECK(cudaMemsetAsync(L.status, 0, 4, stream));
  MOK_CHECK(mok_k_schedule_validate(&d, L.sched, L.status, stream));
  st = read_status(&L, stream);
  EXPECT(st == 0, "%s: device validator rejects its own schedule (%d)", s->name, st);
  test_builds(s, &L, host, hin.ids, stream);

  /* every routed row and every act written */
  EXPECT(all_finite_bf16(L.routed_x, (size_t)L.R * d.H) &&
             all_finite_bf16(L.routed_y, (size_t)L.R * d.H) &&
             all_finite_bf16(L.acts_g, (size_t)L.R * d.I) &&
             all_finite_bf16(L.acts_u, (size_t)L.R * d.I) &&
             all_finite_bf16(L.routed_d_out, (size_t)L.R * d.H) &&
             all_finite_bf16(L.routed_d_x, (size_t)L.R * d.H) &&
             all_finite_bf16(L.acts_gs, (size_t)d.T * d.I_s) &&
             all_finite_bf16(L.acts_us, (size_t)d.T * d.I_s),
         "%s: a routed buffer or act holds NaN/Inf (unwritten row?)", s->name);

  std::vector<unsigned char> first = snapshot(&L);

  ref_result r;
  reference(s, &hin, &r);
  const size_t TH = (size_t)d.T * d.H, W = (size_t)d.E_loc * d.I * d.H, S = (size_t)d.I_s * d.H;
  double worst = 0.0;
  check_err(s->name, "out", r.out, download_bf16(L.out, TH), &worst);
  check_err(s->name, "d_x", r.d_x, download_bf16(L.d_x, TH), &worst);
  check_err(s->name, "d_rw", r.d_rw, download_f32(L.d_rw, (size_t)d.T * d.K), &worst);
  check_err(s->name, "d_w_gate", r.dwg, download_bf16(L.dwg, W), &worst);
  check_err(s->name, "d_w_up", r.dwu, download_bf16(L.dwu, W), &worst);
  check_err(s->name, "d_w_down", r.dwd, download_bf16(L.dwd, W), &worst);
  if (S) {
    check_err(s->name, "d_s_gate", r.dsg, download_bf16(L.dsg, S), &worst);
    check_err(s->name, "d_s_up", r.dsu, download_bf16(L.dsu, S), &worst);
    check_err(s->name, "d_s_down", r.dsd, download_bf16(L.dsd, S), &worst);
  }

  /* bitwise repeatable over `runs` runs (outputs poisoned before each) */
  int same = 1;
  for (int i = 1; i < runs; i++) {
    st = run_chain(&L, stream);
    EXPECT(st == 0, "%s: status %d on run %d", s->name, st, i);
    if (snapshot(&L) != first) same = 0;
  }
  EXPECT(same, "%s: outputs differ between runs", s->name);
  test_gathering_backward(s, &L, first, stream);
  test_one_buffer(s, &L, first, stream);

  /* client-provided routed rows (the single-step jobs) may hold anything in
   * padding rows: NaN there must change no bit of any result */
  if (L.R > 0) {
    std::vector<uint16_t> rx((size_t)L.R * d.H), rd((size_t)L.R * d.H);
    CUDA_CHECK(cudaMemcpy(rx.data(), L.routed_x, rx.size() * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(rd.data(), L.routed_d_out, rd.size() * 2, cudaMemcpyDeviceToHost));
    mok_layout_dims l;
    memset(&l, 0, sizeof l);
    l.tokens = (uint64_t)d.T;
    l.topk = (uint64_t)d.K;
    l.local_experts = (uint64_t)d.E_loc;
    l.row_align = (uint64_t)d.row_align;
    const int32_t *row_slot = mine.data() + mok_sched_row_slot_at(&l);
    for (long long r = 0; r < L.R; r++)
      if (row_slot[r] < 0)
        for (int j = 0; j < d.H; j++) rx[(size_t)r * d.H + j] = rd[(size_t)r * d.H + j] = 0xffff;
    std::vector<unsigned char> before = snapshot(&L);
    poison_outputs(&L, stream);
    upload(L.routed_x, rx.data(), rx.size() * 2);
    upload(L.routed_d_out, rd.data(), rd.size() * 2);
    upload(L.sched, mine.data(), mine.size() * 4);
    MOK_CHECK(mok_k_expert_forward(&d, L.sched, L.routed_x, L.wg, L.wu, L.wd, L.acts_g, L.acts_u,
                                   L.routed_y, L.ws, L.status, stream));
    MOK_CHECK(mok_k_shared_forward(&d, L.x, L.sg, L.su, L.sd, L.acts_gs, L.acts_us, L.shared_y,
                                   L.ws, L.status, stream));
    MOK_CHECK(mok_k_combine(&d, L.sched, L.routed_y, L.rw, L.shared_y, L.out, L.status, stream));
    MOK_CHECK(mok_k_expert_backward(&d, L.sched, L.acts_g, L.acts_u, L.routed_x, L.routed_d_out,
                                    L.rw, L.wg, L.wu, L.wd, L.routed_d_x, L.d_rw, L.dwg, L.dwu,
                                    L.dwd, L.ws, L.status, stream));
    MOK_CHECK(mok_k_shared_backward(&d, L.x, L.d_out, L.acts_gs, L.acts_us, L.sg, L.su, L.sd,
                                    L.shared_d_x, L.dsg, L.dsu, L.dsd, L.ws, L.status, stream));
    MOK_CHECK(mok_k_dispatch_backward(&d, L.sched, L.routed_d_x, L.shared_d_x, L.d_x, L.status,
                                      stream));
    st = read_status(&L, stream);
    /* routed_x / routed_d_out are inputs here: put back the run's values
     * before comparing everything else */
    std::vector<unsigned char> after = snapshot(&L);
    size_t at = 0;
    bool equal = st == 0;
    for (size_t i = 0; i < L.bufs.size(); i++) {
      if (!L.bufs[i].is_output) continue;
      bool is_input = L.bufs[i].p == L.routed_x || L.bufs[i].p == L.routed_d_out;
      if (!is_input && memcmp(before.data() + at, after.data() + at, L.bufs[i].bytes) != 0) {
        equal = false;
        printf("  %s: %s changed with NaN padding rows\n", s->name, L.bufs[i].name);
      }
      at += L.bufs[i].bytes;
    }
    EXPECT(equal, "%s: NaN in padding rows of routed_x/routed_d_out changed results", s->name);
  }
  int local = 0;
  for (size_t i = 0; i < hin.ids.size(); i++)
    local += hin.ids[i] >= s->first && hin.ids[i] < s->first + s->E_loc;
  printf("%-16s T=%d H=%d I=%d E=%d E_loc=%d K=%d I_s=%d L=%s local_slots=%d: worst rel_err "
         "%.3e, %d runs %s\n",
         s->name, s->T, s->H, s->I, s->E, s->E_loc, s->K, s->I_s, s->has_limit ? "on" : "off",
         local, worst, runs, same ? "bitwise identical" : "DIFFER");
  dev_layer_free(&L);
}

/* ---- bad input: routing ids and corrupt schedules ----------------------------------- */

static void test_bad_inputs(cudaStream_t stream) {
  const shape s = {"bad_input", 50, 64, 64, 8, 4, 2, 3, 64, 0, 0.0f, ROUTE_RANDOM, 0.1};
  mok_k_dims d = dims_of(&s);
  host_inputs hin;
  make_inputs(&s, &hin);
  dev_layer L;
  dev_layer_alloc(&L, &d);

  const int32_t bad_ids[] = {8, 1000, -2, (int32_t)0x80000000};
  for (int b = 0; b < 4; b++) {
    host_inputs h2 = hin;
    h2.ids[7 + 11 * b] = bad_ids[b];
    dev_layer_upload(&L, &h2);
    int32_t st = run_chain(&L, stream);
    EXPECT(st == MOK_EROUTE, "routing id %d: status %d, want EROUTE", bad_ids[b], st);
    printf("bad routing id %-11d -> status %d (EROUTE=%d)\n", bad_ids[b], st, MOK_EROUTE);
  }

  /* a valid schedule, then one corruption at a time */
  dev_layer_upload(&L, &hin);
  int32_t st = run_chain(&L, stream);
  EXPECT(st == 0, "bad_input base run: status %d", st);
  /* the in-place backward refuses what it cannot run on */
  uint16_t *odd = (uint16_t *)((char *)L.routed_d_out + 2);
  EXPECT(mok_k_expert_backward_in_place(&d, L.sched, L.acts_g, L.acts_u, L.x, NULL, L.rw, L.wg,
                                        L.wu, L.wd, NULL, L.d_x, L.d_rw, L.dwg, L.dwu, L.dwd,
                                        L.ws, L.status, stream) == MOK_EINVAL &&
             mok_k_expert_backward_in_place(&d, L.sched, L.acts_g, L.acts_u, L.x, odd, L.rw,
                                            L.wg, L.wu, L.wd, NULL, L.d_x, L.d_rw, L.dwg, L.dwu,
                                            L.dwd, L.ws, L.status, stream) == MOK_EINVAL &&
             mok_k_expert_backward_in_place(&d, L.sched, L.acts_g, L.acts_u, NULL,
                                            L.routed_d_out, L.rw, L.wg, L.wu, L.wd, NULL, L.d_x,
                                            L.d_rw, L.dwg, L.dwu, L.dwd, L.ws, L.status,
                                            stream) == MOK_EINVAL &&
             mok_k_expert_backward_in_place(&d, L.sched, L.acts_g, L.acts_u, L.x,
                                            L.routed_d_out, L.rw, L.wg, L.wu, L.wd, NULL, NULL,
                                            L.d_rw, L.dwg, L.dwu, L.dwd, L.ws, L.status,
                                            stream) == MOK_EINVAL,
         "in-place backward: a NULL or misaligned buffer, a missing x or d_x accepted");
  std::vector<int32_t> good((size_t)L.sched_ints);
  CUDA_CHECK(cudaMemcpy(good.data(), L.sched, good.size() * 4, cudaMemcpyDeviceToHost));
  const int E_loc = d.E_loc, R = (int)L.R, TK = d.T * d.K;
  int32_t *counts = good.data() + 8, *offsets = counts + E_loc, *row_slot = offsets + E_loc + 1,
          *slot_row = row_slot + R;
  int used_slot = -1, used_row = -1, pad_row = -1, e_two = -1;
  for (int i = 0; i < TK && used_slot < 0; i++)
    if (slot_row[i] >= 0) used_slot = i;
  used_row = slot_row[used_slot];
  for (int e = 0; e < E_loc && e_two < 0; e++)
    if (counts[e] >= 2) e_two = e;
  for (int r = 0; r < R && pad_row < 0; r++)
    if (row_slot[r] < 0) pad_row = r;

  struct corruption {
    const char *name;
    int index; /* into the schedule array */
    int32_t value;
  } cases[] = {
      {"magic", 0, 0x1234},
      {"header T", 1, d.T + 1},
      {"rows_used", 6, R + 1},
      {"counts[0] huge", 8, 1 << 30},
      {"offsets[1] misaligned", 8 + E_loc + 1, offsets[1] + 1},
      {"slot_row out of range", (int)(row_slot - good.data()) + R + used_slot, R + 7},
      {"slot_row disagrees", (int)(row_slot - good.data()) + R + used_slot,
       used_row + 1 < R ? used_row + 1 : 0},
      {"row_slot out of range", (int)(row_slot - good.data()) + used_row, TK + 3},
      {"padding row names a slot", (int)(row_slot - good.data()) + pad_row, used_slot},
      {"rows out of order", -1, 0},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    std::vector<int32_t> bad = good;
    if (cases[c].index >= 0) {
      bad[(size_t)cases[c].index] = cases[c].value;
    } else { /* swap the slots of an expert's first two rows, both ways */
      if (e_two < 0) continue;
      int r0 = offsets[e_two], s0 = row_slot[r0], s1 = row_slot[r0 + 1];
      bad[(size_t)(row_slot - good.data()) + r0] = s1;
      bad[(size_t)(row_slot - good.data()) + r0 + 1] = s0;
      bad[(size_t)(slot_row - good.data()) + s0] = r0 + 1;
      bad[(size_t)(slot_row - good.data()) + s1] = r0;
    }
    int host_st = shim_schedule_validate(d.T, d.K, d.E, d.E_loc, d.first_expert, d.row_align,
                                         bad.data(), bad.size());
    /* validate, then the consumers (which must do nothing) */
    poison_outputs(&L, stream);
    upload(L.sched, bad.data(), bad.size() * 4);
    MOK_CHECK(mok_k_schedule_validate(&d, L.sched, L.status, stream));
    enqueue_backward(&L, stream);
    int32_t vst = read_status(&L, stream);
    EXPECT(vst == MOK_EINVAL, "corrupt schedule (%s): status %d, want EINVAL", cases[c].name,
           vst);
    EXPECT(host_st == MOK_EINVAL, "corrupt schedule (%s): host validator says %d",
           cases[c].name, host_st);
    /* the consumers alone on the unchecked schedule: wrong numbers are fine,
     * out-of-bounds accesses are not (compute-sanitizer runs this) */
    CUDA_CHECK(cudaMemsetAsync(L.status, 0, 4, stream));
    MOK_CHECK(mok_k_gather_rows(&d, L.sched, L.x, L.routed_x, L.status, stream));
    MOK_CHECK(mok_k_expert_forward(&d, L.sched, L.routed_x, L.wg, L.wu, L.wd, L.acts_g, L.acts_u,
                                   L.routed_y, L.ws, L.status, stream));
    MOK_CHECK(
        mok_k_combine(&d, L.sched, L.routed_y, L.rw, L.shared_y, L.out, L.status, stream));
    enqueue_backward(&L, stream);
    MOK_CHECK(mok_k_gather_rows(&d, L.sched, L.d_out, L.routed_d_out, L.status, stream));
    MOK_CHECK(mok_k_expert_backward_in_place(&d, L.sched, L.acts_g, L.acts_u, L.x,
                                             L.routed_d_out, L.rw, L.wg, L.wu, L.wd,
                                             L.shared_d_x, L.d_x, L.d_rw, L.dwg, L.dwu, L.dwd,
                                             L.ws, L.status, stream));
    (void)read_status(&L, stream);
    printf("corrupt schedule %-26s -> device status %d, host validator %d (EINVAL=%d)\n",
           cases[c].name, vst, host_st, MOK_EINVAL);
  }
  dev_layer_free(&L);
}

/* ---- layout agreement with proto/mok_wire.h ------------------------------------------ */

static void test_layout(void) {
  const int Ts[] = {0, 1, 77, 2048}, Ks[] = {1, 4, 10}, Es[] = {1, 8, 64};
  for (int a = 0; a < 4; a++)
    for (int b = 0; b < 3; b++)
      for (int c = 0; c < 3; c++) {
        mok_k_dims d;
        memset(&d, 0, sizeof d);
        d.T = Ts[a];
        d.K = Ks[b];
        d.E = d.E_loc = Es[c];
        d.H = d.I = 64;
        d.row_align = mok_k_row_align();
        EXPECT(mok_k_rows_capacity(&d) == shim_rows_capacity(d.T, d.K, d.E_loc, d.row_align) &&
                   mok_k_schedule_ints(&d) ==
                       shim_schedule_ints(d.T, d.K, d.E_loc, d.row_align),
               "layout sizes differ from mok_wire.h at T=%d K=%d E_loc=%d", d.T, d.K, d.E_loc);
      }
  EXPECT(shim_sched_magic() == 0x5343484bu, "schedule magic changed in mok_wire.h");
}

/* ---- timing ----------------------------------------------------------------------------- */


static void fill(uint16_t *p, size_t n, uint32_t seed, float scale) {
  if (!p || !n) return;
  fill_bf16<<<1024, 256>>>(p, n, seed, scale);
  CUDA_CHECK(cudaGetLastError());
}

static float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

typedef void (*enqueue_fn)(dev_layer *, cudaStream_t);

static float time_ms(dev_layer *L, cudaStream_t s, enqueue_fn fn, int reps) {
  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  for (int i = 0; i < reps + 2; i++) {
    CUDA_CHECK(cudaEventRecord(a, s));
    fn(L, s);
    CUDA_CHECK(cudaEventRecord(b, s));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (i >= 2) t.push_back(ms); /* two warm-ups */
  }
  CUDA_CHECK(cudaEventDestroy(a));
  CUDA_CHECK(cudaEventDestroy(b));
  return median(t);
}

static void enq_expert_fwd(dev_layer *L, cudaStream_t s) {
  MOK_CHECK(mok_k_expert_forward(&L->d, L->sched, L->routed_x, L->wg, L->wu, L->wd, L->acts_g,
                                 L->acts_u, L->routed_y, L->ws, L->status, s));
}
static void enq_expert_bwd(dev_layer *L, cudaStream_t s) {
  MOK_CHECK(mok_k_expert_backward(&L->d, L->sched, L->acts_g, L->acts_u, L->routed_x,
                                  L->routed_d_out, L->rw, L->wg, L->wu, L->wd, L->routed_d_x,
                                  L->d_rw, L->dwg, L->dwu, L->dwd, L->ws, L->status, s));
}
static void enq_shared_fwd(dev_layer *L, cudaStream_t s) {
  MOK_CHECK(mok_k_shared_forward(&L->d, L->x, L->sg, L->su, L->sd, L->acts_gs, L->acts_us,
                                 L->shared_y, L->ws, L->status, s));
}
static void enq_shared_bwd(dev_layer *L, cudaStream_t s) {
  MOK_CHECK(mok_k_shared_backward(&L->d, L->x, L->d_out, L->acts_gs, L->acts_us, L->sg, L->su,
                                  L->sd, L->shared_d_x, L->dsg, L->dsu, L->dsd, L->ws,
                                  L->status, s));
}
static void enq_sched(dev_layer *L, cudaStream_t s) {
  MOK_CHECK(mok_k_schedule_build(&L->d, L->ids, L->sched, L->ws, L->status, s));
}

static void run_timing(cudaStream_t stream) {
  const shape s = {"bench", 2048, 4096, 1024, 64, 64, 0, 10, 1024, 0, 0.0f, ROUTE_RANDOM, 0.0};
  mok_k_dims d = dims_of(&s);
  dev_layer L;
  dev_layer_alloc(&L, &d);
  const size_t TH = (size_t)d.T * d.H, W = (size_t)d.E_loc * d.I * d.H, S = (size_t)d.I_s * d.H;
  fill(L.x, TH, 1, 1.0f);
  fill(L.d_out, TH, 2, 1.0f);
  fill(L.wg, W, 3, 4.0f / 64.0f);
  fill(L.wu, W, 4, 4.0f / 64.0f);
  fill(L.wd, W, 5, 3.0f / 32.0f);
  fill(L.sg, S, 6, 4.0f / 64.0f);
  fill(L.su, S, 7, 4.0f / 64.0f);
  fill(L.sd, S, 8, 3.0f / 32.0f);
  host_inputs hin;
  make_ids(&s, hin.ids);
  hin.rw.resize((size_t)d.T * d.K);
  for (size_t i = 0; i < hin.rw.size(); i++) hin.rw[i] = (float)(0.05 + 0.95 * rng_unit());
  upload(L.ids, hin.ids.data(), hin.ids.size() * 4);
  upload(L.rw, hin.rw.data(), hin.rw.size() * 4);
  CUDA_CHECK(cudaDeviceSynchronize());
  int32_t st = run_chain(&L, stream); /* fills everything once */
  EXPECT(st == 0, "bench: status %d", st);
  EXPECT(all_finite_bf16(L.out, TH) && all_finite_bf16(L.d_x, TH),
         "bench: out or d_x not finite");

  const int reps = 10;
  float fwd = time_ms(&L, stream, enqueue_forward, reps);
  float bwd = time_ms(&L, stream, enqueue_backward, reps);
  float efwd = time_ms(&L, stream, enq_expert_fwd, reps);
  float ebwd = time_ms(&L, stream, enq_expert_bwd, reps);
  float sfwd = time_ms(&L, stream, enq_shared_fwd, reps);
  float sbwd = time_ms(&L, stream, enq_shared_bwd, reps);
  float sch = time_ms(&L, stream, enq_sched, reps);
  st = read_status(&L, stream);
  EXPECT(st == 0, "bench: status %d after timing", st);

  const double TK = (double)d.T * d.K;
  const double f_fwd = 6.0 * (d.T + TK) * d.H * d.I, f_bwd = 2.0 * f_fwd;
  const double f_efwd = 6.0 * TK * d.H * d.I, f_sfwd = 6.0 * d.T * (double)d.H * d.I_s;
  printf("timing T=%d H=%d I=%d E_loc=%d K=%d I_s=%d (median of %d):\n", d.T, d.H, d.I, d.E_loc,
         d.K, d.I_s, reps);
  printf("  forward  (whole layer)   %8.3f ms  %6.1f TFLOP/s\n", fwd, f_fwd / fwd * 1e-9);
  printf("  backward (whole layer)   %8.3f ms  %6.1f TFLOP/s\n", bwd, f_bwd / bwd * 1e-9);
  printf("  expert forward           %8.3f ms  %6.1f TFLOP/s\n", efwd, f_efwd / efwd * 1e-9);
  printf("  expert backward          %8.3f ms  %6.1f TFLOP/s\n", ebwd,
         2 * f_efwd / ebwd * 1e-9);
  printf("  shared forward           %8.3f ms  %6.1f TFLOP/s\n", sfwd, f_sfwd / sfwd * 1e-9);
  printf("  shared backward          %8.3f ms  %6.1f TFLOP/s\n", sbwd,
         2 * f_sfwd / sbwd * 1e-9);
  printf("  schedule build           %8.3f ms\n", sch);
  dev_layer_free(&L);
}

/* ---- main ---------------------------------------------------------------------------------- */

int main(int argc, char **argv) {
  const char *mode = argc > 1 ? argv[1] : "correct";
  int dev = 0;
  CUDA_CHECK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  printf("device: %s, sm_%d%d, %d SMs\n", prop.name, prop.major, prop.minor,
         prop.multiProcessorCount);
  MOK_CHECK(kernel_init_from_env());
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  if (!strcmp(mode, "correct")) {
    test_layout();
    test_moves(stream);
    test_fp8_encode_all(stream);
    test_fp8_quantizers(stream);
    for (size_t i = 0; i < sizeof small_shapes / sizeof small_shapes[0]; i++)
      test_shape(&small_shapes[i], 5, stream);
    test_bad_inputs(stream);
    test_schedule_builds(200, INT32_MAX, stream);
    test_shape(&mid_shape, 5, stream);
  } else if (!strcmp(mode, "quick")) {
    test_layout();
    test_moves(stream);
    test_fp8_quantizers(stream);
    test_shape(&small_shapes[0], 2, stream);
    test_shape(&small_shapes[3], 2, stream);
    test_shape(&small_shapes[5], 2, stream);
    test_shape(&small_shapes[7], 2, stream);
    test_bad_inputs(stream);
    test_schedule_builds(20, 8192, stream);
  } else if (!strcmp(mode, "time")) {
    run_timing(stream);
  } else {
    fprintf(stderr, "usage: %s correct|quick|time\n", argv[0]);
    return 2;
  }
  CUDA_CHECK(cudaStreamDestroy(stream));
  printf("%s: %s (%d failures)\n", mode, failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
