/* SPDX-License-Identifier: Apache-2.0 */
/* The layer in one process: the kernel library (kernels/mok_kernels.h)
 * called directly on one stream, as the engine chains it,
 *   forward:  schedule_build, gather_rows(x), expert_forward, shared_forward, combine
 *   backward: gather_rows(d_out), shared_backward, expert_backward, dispatch_backward
 * (gathering: as mokd chains a bf16 layer, the forward's
 * expert_forward_gathering with the gate/up producer gathering x's rows
 * (mok_k_sm90_set_gather_a) and its y over the routed x, the shared
 * expert's y in out and its d_x in d_x, and the backward in d_out's routed
 * buffer, mok_k_expert_backward_in_place) with its buffers, the random fill
 * both bench programs use, the job status word and the hashes that check
 * results bitwise. Used by mok_bench (the in-process bench) and by
 * mok_bench_daemon --inproc-ab (the same chain next to the same layer
 * through mokd). Included by one .cu file of
 * each program; mok_k_init must have run before the first launch. */
#ifndef MOK_BENCH_LAYER_H
#define MOK_BENCH_LAYER_H

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../kernels/mok_gemm_sm90.h"
#include "../../kernels/mok_kernels.h"
#include "../../proto/mok_layout.h"
#include "../../proto/mok_status.h"

#include "bench_common.h"
#include "bench_pool.h"


/* ---- device helpers --------------------------------------------------------------- */

/* order-independent integer hash of a buffer (position-weighted word sum) */
static __global__ void hash_words(const uint32_t *p, size_t n, unsigned long long *out) {
  unsigned long long acc = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    acc += (unsigned long long)p[i] * (2ull * i + 1ull);
  atomicAdd(out, acc);
}

static __global__ void count_nonfinite_bf16(const uint16_t *p, size_t n, unsigned long long *out) {
  unsigned long long c = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    c += (p[i] & 0x7f80u) == 0x7f80u;
  if (c) atomicAdd(out, c);
}

/* ---- the layer on the device ----------------------------------------------------- */

#define N_SETS 2

/* The layer's dims for one configuration, as mok_bench has always run it:
 * the E_loc local experts of E (ids drawn over the local ones), the shared
 * expert as wide as a routed one. */
static void layer_dims(const config *c, mok_k_dims *d) {
  const bench_shape *sh = &SHAPES[c->shape];
  memset(d, 0, sizeof *d);
  d->T = c->T;
  d->H = sh->H;
  d->I = sh->I;
  d->E = sh->E;
  d->E_loc = sh->E / EP;
  d->first_expert = 0; /* ids are drawn over the local experts only */
  d->K = sh->K;
  d->I_s = sh->I;
  d->row_align = mok_k_row_align();
}

typedef struct layer {
  mok_k_dims d;
  long long R, sched_ints;
  uint16_t *x[N_SETS], *d_out[N_SETS];
  float *rw[N_SETS];
  int32_t *ids[N_SETS];
  uint16_t *wg, *wu, *wd, *sg, *su, *sd;
  int32_t *sched;
  uint16_t *routed_x, *acts_g, *acts_u, *acts_gs, *acts_us, *routed_y, *shared_y, *out;
  uint16_t *routed_d_out, *routed_d_x, *shared_d_x, *d_x, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd;
  float *d_rw;
  void *ws;
  int32_t *status;
  unsigned long long *scratch;
  bench_pool *pool; /* where the client's tensors come from (bench_pool.h) */
  void *allocs[64];
  int n_allocs;
  size_t bytes;
  /* the fp8 layer on the same inputs (layer_add_fp8): packed weights, x or
   * d_out quantised per token (tq, ts) and routed (rq, rs), its workspace */
  void *pwg, *pwu, *pwd, *psg, *psu, *psd;
  uint8_t *tq, *rq;
  float *ts, *rs;
  void *ws8;
  int fp8; /* the enqueue functions run the fp8 layer */
  int gathering; /* mokd's chain: no routed x kept from the forward (above) */
} layer;

/* Inputs the layer reads from somewhere else (layer_alloc neither allocates
 * nor fills them): the per-set x, d_out, routing and the six weights. */
typedef struct layer_inputs {
  uint16_t *x[N_SETS], *d_out[N_SETS];
  float *rw[N_SETS];
  int32_t *ids[N_SETS];
  uint16_t *wg, *wu, *wd, *sg, *su, *sd;
} layer_inputs;

static void *dalloc(layer *L, size_t bytes) {
  void *p = NULL;
  if (bytes == 0) bytes = 16;
  CUDA_CHECK(cudaMalloc(&p, bytes));
  L->allocs[L->n_allocs++] = p;
  L->bytes += bytes;
  return p;
}

/* a tensor a trainer would own (mokd reads it through the client's mapping) */
static void *client_alloc(layer *L, size_t bytes) {
  void *p = bench_pool_take(L->pool, bytes ? bytes : 16);
  if (!p) return dalloc(L, bytes);
  L->bytes += bytes;
  return p;
}

/* Bytes the client tensors of layer_alloc take from a pool (each carve
 * rounded to bench_pool_take's 512), without the inputs when with_inputs
 * is 0 (layer_alloc given a layer_inputs). Inline: mok_bench has no use for it. */
static inline size_t layer_client_bytes(const mok_k_dims *d, int with_inputs) {
  const size_t R = (size_t)mok_k_rows_capacity(d);
  const size_t TH = (size_t)d->T * d->H, TK = (size_t)d->T * d->K;
  const size_t W = (size_t)d->E_loc * d->I * d->H, S = (size_t)d->I_s * d->H;
  const size_t RI = R * d->I, TIs = (size_t)d->T * d->I_s;
  const size_t inputs[] = {TH * 2, TH * 2, TK * 4, TK * 4, TH * 2, TH * 2, TK * 4, TK * 4,
                           W * 2,  W * 2,  W * 2,  S * 2,  S * 2,  S * 2};
  const size_t others[] = {RI * 2, RI * 2, TIs * 2, TIs * 2, TH * 2, TH * 2, TK * 4,
                           W * 2,  W * 2,  W * 2,   S * 2,   S * 2,  S * 2};
  size_t n = 512;
  for (size_t i = 0; with_inputs && i < sizeof inputs / sizeof inputs[0]; i++)
    n += (inputs[i] + 511) & ~(size_t)511;
  for (size_t i = 0; i < sizeof others / sizeof others[0]; i++)
    n += ((others[i] ? others[i] : 16) + 511) & ~(size_t)511;
  return n;
}

static void layer_free(layer *L) {
  for (int i = 0; i < L->n_allocs; i++) CUDA_CHECK(cudaFree(L->allocs[i]));
  L->n_allocs = 0;
  bench_pool_reset(L->pool);
}

static void fill(uint16_t *p, size_t n, uint32_t seed, float scale) {
  fill_bf16<<<2048, 256>>>(p, n, seed, scale);
  CUDA_CHECK(cudaGetLastError());
}

/* The layer's buffers: the client's tensors from pool (POOL_OWN: one
 * cudaMalloc each), the rest (schedule, routed rows, workspace) cudaMalloc'd
 * as mokd's own workspace is. in: the inputs are those (NULL: allocated and
 * filled here; the routing ids and weights are the caller's to write). */
static void layer_alloc(layer *L, const mok_k_dims *d, bench_pool *pool, const layer_inputs *in) {
  memset(L, 0, sizeof *L);
  L->d = *d;
  L->pool = pool;
  L->R = mok_k_rows_capacity(d);
  L->sched_ints = mok_k_schedule_ints(d);
  const size_t TH = (size_t)d->T * d->H, TK = (size_t)d->T * d->K;
  const size_t W = (size_t)d->E_loc * d->I * d->H, S = (size_t)d->I_s * d->H;
  const size_t RH = (size_t)L->R * d->H, RI = (size_t)L->R * d->I, TIs = (size_t)d->T * d->I_s;
  for (int s = 0; s < N_SETS; s++) {
    L->x[s] = in ? in->x[s] : (uint16_t *)client_alloc(L, TH * 2);
    L->d_out[s] = in ? in->d_out[s] : (uint16_t *)client_alloc(L, TH * 2);
    L->rw[s] = in ? in->rw[s] : (float *)client_alloc(L, TK * 4);
    L->ids[s] = in ? in->ids[s] : (int32_t *)client_alloc(L, TK * 4);
  }
  L->wg = in ? in->wg : (uint16_t *)client_alloc(L, W * 2);
  L->wu = in ? in->wu : (uint16_t *)client_alloc(L, W * 2);
  L->wd = in ? in->wd : (uint16_t *)client_alloc(L, W * 2);
  L->sg = in ? in->sg : (uint16_t *)client_alloc(L, S * 2);
  L->su = in ? in->su : (uint16_t *)client_alloc(L, S * 2);
  L->sd = in ? in->sd : (uint16_t *)client_alloc(L, S * 2);
  L->sched = (int32_t *)dalloc(L, (size_t)L->sched_ints * 4);
  L->routed_x = (uint16_t *)dalloc(L, RH * 2);
  L->acts_g = (uint16_t *)client_alloc(L, RI * 2);
  L->acts_u = (uint16_t *)client_alloc(L, RI * 2);
  L->acts_gs = (uint16_t *)client_alloc(L, TIs * 2);
  L->acts_us = (uint16_t *)client_alloc(L, TIs * 2);
  L->routed_y = (uint16_t *)dalloc(L, RH * 2);
  L->shared_y = (uint16_t *)dalloc(L, TH * 2);
  L->out = (uint16_t *)client_alloc(L, TH * 2);
  L->routed_d_out = (uint16_t *)dalloc(L, RH * 2);
  L->routed_d_x = (uint16_t *)dalloc(L, RH * 2);
  L->shared_d_x = (uint16_t *)dalloc(L, TH * 2);
  L->d_x = (uint16_t *)client_alloc(L, TH * 2);
  L->d_rw = (float *)client_alloc(L, TK * 4);
  L->dwg = (uint16_t *)client_alloc(L, W * 2);
  L->dwu = (uint16_t *)client_alloc(L, W * 2);
  L->dwd = (uint16_t *)client_alloc(L, W * 2);
  L->dsg = (uint16_t *)client_alloc(L, S * 2);
  L->dsu = (uint16_t *)client_alloc(L, S * 2);
  L->dsd = (uint16_t *)client_alloc(L, S * 2);
  L->ws = dalloc(L, mok_k_workspace_bytes(d));
  L->status = (int32_t *)dalloc(L, 4);
  L->scratch = (unsigned long long *)dalloc(L, 8);
  CUDA_CHECK(cudaMemset(L->status, 0, 4));
  if (!in) {
    /* values of the size a trained layer sees: x, d_out ~ U(-sqrt3, sqrt3)
     * (variance 1), weights variance 1/fan_in; never zero */
    const float a_in = sqrtf(3.0f);
    for (int s = 0; s < N_SETS; s++) {
      fill(L->x[s], TH, 11u + 17u * s, a_in);
      fill(L->d_out[s], TH, 12u + 17u * s, a_in);
    }
    fill(L->wg, W, 3, sqrtf(3.0f / d->H));
    fill(L->wu, W, 4, sqrtf(3.0f / d->H));
    fill(L->wd, W, 5, sqrtf(3.0f / d->I));
    fill(L->sg, S, 6, sqrtf(3.0f / d->H));
    fill(L->su, S, 7, sqrtf(3.0f / d->H));
    fill(L->sd, S, 8, sqrtf(3.0f / (d->I_s ? d->I_s : 1)));
  }
  CUDA_CHECK(cudaDeviceSynchronize());
}

/* The fp8 layer's pieces beside a bf16 layer's (docs/math.md "FP8"): the
 * weights quantised once (what a trainer does after each optimizer step). */
static void layer_add_fp8(layer *L) {
  const mok_k_dims *d = &L->d;
  void **packed[6] = {&L->pwg, &L->pwu, &L->pwd, &L->psg, &L->psu, &L->psd};
  const uint16_t *masters[6] = {L->wg, L->wu, L->wd, L->sg, L->su, L->sd};
  for (int i = 0; i < 6; i++) {
    const int shared = i >= 3, down = i % 3 == 2, n = shared ? d->I_s : d->I;
    const int E = shared ? 1 : d->E_loc, N = down ? d->H : n, K = down ? n : d->H;
    *packed[i] = NULL;
    if (n == 0) continue;
    *packed[i] = client_alloc(L, (size_t)mok_fp8_weight_bytes((uint64_t)E, (uint64_t)N, (uint64_t)K));
    MOK_CHECK(mok_k_fp8_quantize_weight(masters[i], E, N, K, *packed[i], 0));
  }
  const size_t TH = (size_t)d->T * d->H, RH = (size_t)L->R * d->H;
  L->tq = (uint8_t *)dalloc(L, TH);
  L->ts = (float *)dalloc(L, TH / 128 * 4);
  L->rq = (uint8_t *)dalloc(L, RH);
  L->rs = (float *)dalloc(L, RH / 128 * 4);
  L->ws8 = dalloc(L, mok_k_fp8_workspace_bytes(d));
  CUDA_CHECK(cudaDeviceSynchronize());
}

#define FWD_STEPS 5
#define BWD_STEPS 4
static const char *FWD_NAMES[FWD_STEPS] = {"schedule_build", "gather", "expert_forward",
                                           "shared_forward", "combine"};
/* the shared expert's backward first, as mokd runs it (its d_x is the base
 * of the K-sum); in the gathering chain the K-sum is part of the routed
 * backward, and "dispatch_backward" an empty step */
static const char *BWD_NAMES[BWD_STEPS] = {"gather_d_out", "shared_backward", "expert_backward",
                                           "dispatch_backward"};

/* ev: FWD_STEPS+1 events recorded between the steps (NULL: none) */
/* fp8: "gather" quantises x per token and copies the routed rows' bytes */
static void enqueue_forward_fp8(layer *L, int s, cudaEvent_t *ev, cudaStream_t st) {
  const mok_k_dims *d = &L->d;
  MOK_CHECK(mok_k_fp8_quantize_rows(L->x[s], d->T, d->H, L->tq, L->ts, st));
  MOK_CHECK(mok_k_fp8_gather_rows(d, L->sched, L->tq, L->ts, L->rq, L->rs, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[2], st));
  MOK_CHECK(mok_k_fp8_expert_forward(d, L->sched, L->rq, L->rs, L->pwg, L->pwu, L->pwd, L->acts_g,
                                     L->acts_u, L->routed_y, L->ws8, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[3], st));
  MOK_CHECK(mok_k_fp8_shared_forward(d, L->tq, L->ts, L->psg, L->psu, L->psd, L->acts_gs,
                                     L->acts_us, L->shared_y, L->ws8, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[4], st));
}

static void enqueue_forward(layer *L, int s, cudaEvent_t *ev, cudaStream_t st) {
  const mok_k_dims *d = &L->d;
  if (ev) CUDA_CHECK(cudaEventRecord(ev[0], st));
  MOK_CHECK(mok_k_schedule_build(d, L->ids[s], L->sched, L->ws, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[1], st));
  if (L->fp8) {
    enqueue_forward_fp8(L, s, ev, st);
    MOK_CHECK(mok_k_combine(d, L->sched, L->routed_y, L->rw[s], L->shared_y, L->out, L->status,
                            st));
    if (ev) CUDA_CHECK(cudaEventRecord(ev[5], st));
    return;
  }
  if (!L->gathering) {
    MOK_CHECK(mok_k_gather_rows(d, L->sched, L->x[s], L->routed_x, L->status, st));
    if (ev) CUDA_CHECK(cudaEventRecord(ev[2], st));
    MOK_CHECK(mok_k_expert_forward(d, L->sched, L->routed_x, L->wg, L->wu, L->wd, L->acts_g,
                                   L->acts_u, L->routed_y, L->ws, L->status, st));
  } else { /* the gather is part of expert_forward: an empty "gather" step; y over x's rows */
    if (ev) CUDA_CHECK(cudaEventRecord(ev[2], st));
    MOK_CHECK(mok_k_expert_forward_gathering(d, L->sched, L->x[s], L->routed_x, L->wg, L->wu,
                                             L->wd, L->acts_g, L->acts_u, L->routed_x, L->ws,
                                             L->status, st));
  }
  /* gathering: the shared expert's y in out, read back by combine (mokd's chain) */
  uint16_t *routed_y = L->gathering ? L->routed_x : L->routed_y;
  uint16_t *shared_y = L->gathering && d->I_s ? L->out : L->shared_y;
  if (ev) CUDA_CHECK(cudaEventRecord(ev[3], st));
  MOK_CHECK(mok_k_shared_forward(d, L->x[s], L->sg, L->su, L->sd, L->acts_gs, L->acts_us,
                                 shared_y, L->ws, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[4], st));
  MOK_CHECK(mok_k_combine(d, L->sched, routed_y, L->rw[s], shared_y, L->out, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[5], st));
}

/* ev: BWD_STEPS+1 events (NULL: none); after enqueue_forward of the same set */
/* fp8: as mokd runs it, the backward gathers x's routed rows itself (the
 * fp8 forward writes none), beside its down weight gradient */
static void enqueue_backward_fp8(layer *L, int s, cudaEvent_t *ev, cudaStream_t st) {
  const mok_k_dims *d = &L->d;
  if (ev) CUDA_CHECK(cudaEventRecord(ev[0], st));
  MOK_CHECK(mok_k_gather_rows(d, L->sched, L->d_out[s], L->routed_d_out, L->status, st));
  MOK_CHECK(mok_k_fp8_quantize_rows(L->d_out[s], d->T, d->H, L->tq, L->ts, st));
  MOK_CHECK(mok_k_fp8_gather_rows(d, L->sched, L->tq, L->ts, L->rq, L->rs, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[1], st));
  MOK_CHECK(mok_k_fp8_shared_backward(d, L->x[s], L->d_out[s], L->tq, L->ts, L->acts_gs,
                                      L->acts_us, L->psg, L->psu, L->psd, L->shared_d_x, L->dsg,
                                      L->dsu, L->dsd, L->ws8, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[2], st));
  MOK_CHECK(mok_k_fp8_expert_backward(d, L->sched, L->acts_g, L->acts_u, L->x[s], L->routed_x,
                                      L->routed_d_out, L->rq, L->rs, L->rw[s], L->pwg, L->pwu,
                                      L->pwd, L->routed_d_x, L->d_rw, L->dwg, L->dwu, L->dwd,
                                      L->ws8, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[3], st));
  MOK_CHECK(mok_k_dispatch_backward(d, L->sched, L->routed_d_x, L->shared_d_x, L->d_x, L->status,
                                    st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[4], st));
}

/* gathering (mokd's chain): the shared expert's d_x into d_x, then the
 * routed backward in d_out's routed buffer with the K-sum that reads d_x
 * back (mok_k_expert_backward_in_place) */
static void enqueue_backward(layer *L, int s, cudaEvent_t *ev, cudaStream_t st) {
  const mok_k_dims *d = &L->d;
  if (L->fp8) {
    enqueue_backward_fp8(L, s, ev, st);
    return;
  }
  uint16_t *shared_d_x = L->gathering ? L->d_x : L->shared_d_x;
  if (ev) CUDA_CHECK(cudaEventRecord(ev[0], st));
  MOK_CHECK(mok_k_gather_rows(d, L->sched, L->d_out[s], L->routed_d_out, L->status, st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[1], st));
  MOK_CHECK(mok_k_shared_backward(d, L->x[s], L->d_out[s], L->acts_gs, L->acts_us, L->sg, L->su,
                                  L->sd, shared_d_x, L->dsg, L->dsu, L->dsd, L->ws, L->status,
                                  st));
  if (ev) CUDA_CHECK(cudaEventRecord(ev[2], st));
  if (!L->gathering) {
    MOK_CHECK(mok_k_expert_backward(d, L->sched, L->acts_g, L->acts_u, L->routed_x,
                                    L->routed_d_out, L->rw[s], L->wg, L->wu, L->wd, L->routed_d_x,
                                    L->d_rw, L->dwg, L->dwu, L->dwd, L->ws, L->status, st));
    if (ev) CUDA_CHECK(cudaEventRecord(ev[3], st));
    MOK_CHECK(mok_k_dispatch_backward(d, L->sched, L->routed_d_x, L->shared_d_x, L->d_x,
                                      L->status, st));
  } else {
    MOK_CHECK(mok_k_expert_backward_in_place(
        d, L->sched, L->acts_g, L->acts_u, L->x[s], L->routed_d_out, L->rw[s], L->wg, L->wu,
        L->wd, d->I_s ? shared_d_x : NULL, L->d_x, L->d_rw, L->dwg, L->dwu, L->dwd, L->ws,
        L->status, st));
    if (ev) CUDA_CHECK(cudaEventRecord(ev[3], st));
  }
  if (ev) CUDA_CHECK(cudaEventRecord(ev[4], st));
}

static int32_t read_status(layer *L, cudaStream_t st) {
  int32_t v = -1;
  CUDA_CHECK(cudaStreamSynchronize(st));
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpy(&v, L->status, 4, cudaMemcpyDeviceToHost));
  return v;
}

/* hash of bytes at p (any device memory this process reaches) */
static unsigned long long dev_hash(layer *L, const void *p, size_t bytes, cudaStream_t st) {
  unsigned long long h = 0;
  CUDA_CHECK(cudaMemsetAsync(L->scratch, 0, 8, st));
  hash_words<<<1024, 256, 0, st>>>((const uint32_t *)p, bytes / 4, L->scratch);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpyAsync(&h, L->scratch, 8, cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaStreamSynchronize(st));
  return h;
}

static unsigned long long dev_nonfinite(layer *L, const uint16_t *p, size_t n, cudaStream_t st) {
  unsigned long long c = 0;
  CUDA_CHECK(cudaMemsetAsync(L->scratch, 0, 8, st));
  count_nonfinite_bf16<<<1024, 256, 0, st>>>(p, n, L->scratch);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaMemcpyAsync(&c, L->scratch, 8, cudaMemcpyDeviceToHost, st));
  CUDA_CHECK(cudaStreamSynchronize(st));
  return c;
}

/* The layer's outputs of one forward+backward: out, d_x, d_rw and the
 * weight gradients (d_s_up is left out, as it always was). */
typedef struct layer_outputs {
  const void *out, *d_x, *d_rw, *dwg, *dwu, *dwd, *dsg, *dsd;
} layer_outputs;

/* one hash of those outputs (the order and mixing of chain_hash) */
static unsigned long long outputs_hash(layer *L, const layer_outputs *o, cudaStream_t st) {
  const mok_k_dims *d = &L->d;
  const size_t TH = (size_t)d->T * d->H, W = (size_t)d->E_loc * d->I * d->H,
               S = (size_t)d->I_s * d->H;
  unsigned long long h = dev_hash(L, o->out, TH * 2, st);
  h = h * 31 + dev_hash(L, o->d_x, TH * 2, st);
  h = h * 31 + dev_hash(L, o->d_rw, (size_t)d->T * d->K * 4, st);
  h = h * 31 + dev_hash(L, o->dwg, W * 2, st);
  h = h * 31 + dev_hash(L, o->dwu, W * 2, st);
  h = h * 31 + dev_hash(L, o->dwd, W * 2, st);
  h = h * 31 + dev_hash(L, o->dsg, S * 2, st);
  h = h * 31 + dev_hash(L, o->dsd, S * 2, st);
  return h;
}

/* hash of every output of one forward+backward of set s */
static unsigned long long chain_hash(layer *L, int s, cudaStream_t st) {
  enqueue_forward(L, s, NULL, st);
  enqueue_backward(L, s, NULL, st);
  const layer_outputs o = {L->out, L->d_x, L->d_rw, L->dwg, L->dwu, L->dwd, L->dsg, L->dsd};
  return outputs_hash(L, &o, st);
}

#endif /* MOK_BENCH_LAYER_H */
