/* SPDX-License-Identifier: Apache-2.0 */
/* mok_bench_daemon: the benchmark shapes (docs/design.md) through mokd (--engine cuda) and libmok,
 * the "through the daemon" column of tests/bench/run_bench.sh.
 *
 *   MOK_SOCKET=... mok_bench_daemon [--out FILE.json] [--routing-dir DIR] [--T 2048,8192]
 *                                   [--reps N] [--warmup N] [--deadline S] [--only NAMES]
 *                                   [--piped 1]   (also jobs back to back: the client ahead)
 *                                   [--memory cudamalloc|cudamalloc-unrounded|vmm]
 *                                   [--inproc-ab 1]  (the same layer in this process too,
 *                                                     the two taking turns: see below)
 *                                   [--phases 1]     (with --inproc-ab: the in-process
 *                                                     chain's time per step, for the
 *                                                     daemon's own, MOK_CUDA_PROFILE=1)
 *                                   [--client-wait stream|host]  (with --inproc-ab: the
 *                                                     mokd jobs ordered on the stream, or
 *                                                     submitted and waited for on the host)
 *   (the client pool: one cudaMalloc rounded up to 2 MiB as PyTorch rounds its
 *   segments, the same not rounded, or cuMemCreate memory mokd maps from an fd)
 *
 * The same configurations, routings and timing as mok_bench (CUDA events on
 * the client's stream, warm-up, median, two input sets), but each forward and
 * backward is one job: mok_forward_on_stream / mok_backward_on_stream on
 * device pointers (one cudaMalloc pool per configuration, registered with
 * mokd once through libmok), ordered on the client's stream by the session's
 * fences, no host wait. The events therefore include everything a trainer
 * would see: the fence write, the daemon noticing the job, its enqueue, the
 * kernels and the completion write. A layer here holds its E_loc experts
 * (experts = E_loc, no group), which is the same computation as the kernel
 * bench's per-GPU slice. Any failed job marks the configuration failed; the
 * first one stops the run (a daemon that fails once is not timed further).
 *
 * --inproc-ab 1: the boundary's cost in one process, on one stream, at one
 * moment. Two separate runs of the same kernels on an H200 at its power cap
 * differ by up to 12 % (the SM clock drifts under sustained load), more than
 * the cost to resolve. So each configuration also runs mokd's chain
 * (bench_layer.h: the kernel library called directly, on the client's
 * stream, in the client's own context, which under MPS is where a
 * trainer's kernels run), and the two sides take turns run by run, warm-up
 * included: A = the chain in this process, B = the same forward (backward)
 * as one mokd job, in the order A B B A A B B A ..., the input set
 * alternating run by run, so that every run follows a run of the other set
 * and each side follows itself and the other equally often. Both sides run
 * the same shapes on the same bytes: the chain reads the very tensors the
 * jobs get (x, routing, d_out, weights, in the client pool, routing from
 * --routing-dir as mok_bench's), and writes its own outputs and activations
 * (carved from the same pool after the jobs' tensors; its schedule, routed
 * rows and workspace cudaMalloc'd, as mok_bench's and mokd's are). Each run
 * is timed with CUDA events on the stream and waited for. Reported: both
 * medians, their ratio (through mokd / in-process - 1, in %) and the median
 * of the per-rep ratios (each B over the A of its rep), forward and
 * backward; and whether one forward+backward of set 0 gives bitwise the same
 * outputs both ways (it must: the same kernels on the same inputs; the
 * run's exit status is 1 when not). The chain is mokd's (bench_layer.h
 * "gathering": one routed buffer, x's rows written back by the backward's
 * K-sum pass); the mokd backward also copies the ctx's schedule in: that is
 * part of what the boundary costs.
 *
 * --phases 1 (with --inproc-ab): the in-process runs also record an event
 * between the chain's steps and print each step's median; mokd started
 * with MOK_CUDA_PROFILE=1 logs the same for each of its jobs (every kernel,
 * copy and memset, from the client's fence to the status word), so the two
 * can be set side by side step by step (tests/bench/phase_table.py).
 * --client-wait host: the mokd side submits each job without a stream
 * (mok_forward / mok_backward, then mok_wait): no fence on either stream, so
 * mokd's kernels run with no wait pending on the client's stream; its times
 * then include the host round trip, and the daemon's phases give its GPU
 * time.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok.h"
#include "../harness/kernel_choices.h"
#include "bench_common.h"
#include "bench_pool.h"
/* the in-process layer (--inproc-ab): the kernel library in mokd's chain
 * (bench_layer.h "gathering") */
#include "bench_layer.h"



/* --memory vmm: the client pool is cuMemCreate memory (2 MiB pages) */
static int g_vmm;
/* --memory cudamalloc (the default) rounds the pool up to whole 2 MiB pages, as
 * PyTorch's caching allocator rounds its segments; cudamalloc-unrounded does
 * not, and mokd's IPC mapping of such an allocation runs the layer up to 25 %
 * slower (docs/cuda.md, "The daemon boundary, measured") */
static int g_round_2m = 1;
/* --inproc-ab 1: the in-process chain and the mokd job take turns */
static int g_ab;
/* --phases 1: the in-process chain's time per step; --client-wait host */
static int g_phases, g_host_wait;

enum { P_X, P_IDS, P_RW, P_DOUT, P_PER_SET };
/* per-set tensors first (N_SETS each), then the shared ones */
static const int SET_SLOTS[P_PER_SET] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_ROUTER_W,
                                         MOK_SLOT_D_OUT};
static const int ONE_SLOTS[] = {MOK_SLOT_W_GATE,   MOK_SLOT_W_UP,     MOK_SLOT_W_DOWN,
                                MOK_SLOT_S_GATE,   MOK_SLOT_S_UP,     MOK_SLOT_S_DOWN,
                                MOK_SLOT_OUT,      MOK_SLOT_CTX,      MOK_SLOT_D_X,
                                MOK_SLOT_D_RW,     MOK_SLOT_D_W_GATE, MOK_SLOT_D_W_UP,
                                MOK_SLOT_D_W_DOWN, MOK_SLOT_D_S_GATE, MOK_SLOT_D_S_UP,
                                MOK_SLOT_D_S_DOWN};
#define N_ONE ((int)(sizeof ONE_SLOTS / sizeof ONE_SLOTS[0]))

static size_t slot_bytes(const mok_layer *l, uint32_t T, int slot) {
  mok_tensor t = mok_tensor_for(l, T, (uint32_t)slot, (void *)16);
  size_t n = mok_dtype_size(t.dtype);
  for (uint32_t i = 0; i < t.ndim; i++) n *= t.shape[i];
  return t.ndim ? n : 0;
}

typedef struct dres {
  int done, ok, from_file;
  float fwd_ms, bwd_ms;
  float fwd_piped_ms, bwd_piped_ms; /* --piped: jobs back to back, one wait at the end */
  /* --inproc-ab: the in-process side's medians, the cost (through mokd over
   * in-process - 1, %) from the medians and as the median of the per-rep
   * ratios, and whether both sides' outputs are bitwise the same */
  int ab, same_output;
  float inproc_fwd_ms, inproc_bwd_ms;
  double overhead_fwd_pct, overhead_bwd_pct, paired_fwd_pct, paired_bwd_pct;
  double flops_fwd, max_over_mean[N_SETS];
  /* --phases: the in-process chain's median per step (ms), and the host
   * time of the client's submission call of a forward job (us) */
  float phase_fwd[FWD_STEPS], phase_bwd[BWD_STEPS], submit_fwd_us;
  char error[256];
} dres;

static int fail(dres *r, const char *what, int st) {
  snprintf(r->error, sizeof r->error, "%s: %s (%s)", what, mok_status_name(st), mok_last_error());
  fprintf(stderr, "mok_bench_daemon: %s\n", r->error);
  return 0;
}

/* One mokd job of the --inproc-ab loops: on the stream, or (--client-wait
 * host) submitted and waited for on the host. 1: it ran. */
static int forward_job(mok_client *c, mok_layer *l, uint32_t T, const mok_forward_args *a,
                       cudaStream_t st, dres *r) {
  uint64_t ticket = 0;
  int s;
  if (!g_host_wait) {
    s = mok_forward_on_stream(l, T, a, st, NULL);
    return s == MOK_OK ? 1 : fail(r, "mok_forward_on_stream", s);
  }
  if ((s = mok_forward(l, T, a, &ticket)) != MOK_OK) return fail(r, "mok_forward", s);
  return (s = mok_wait(c, ticket, 30000)) == MOK_OK ? 1 : fail(r, "mok_wait (forward)", s);
}

static int backward_job(mok_client *c, mok_layer *l, uint32_t T, const mok_backward_args *a,
                        cudaStream_t st, dres *r) {
  uint64_t ticket = 0;
  int s;
  if (!g_host_wait) {
    s = mok_backward_on_stream(l, T, 0, a, st, NULL);
    return s == MOK_OK ? 1 : fail(r, "mok_backward_on_stream", s);
  }
  if ((s = mok_backward(l, T, 0, a, &ticket)) != MOK_OK) return fail(r, "mok_backward", s);
  return (s = mok_wait(c, ticket, 30000)) == MOK_OK ? 1 : fail(r, "mok_wait (backward)", s);
}

/* the n steps between n+1 waited-for events, into out[n] (ms) */
static void phase_times(cudaEvent_t *ev, int n, float *out) {
  for (int k = 0; k < n; k++) CUDA_CHECK(cudaEventElapsedTime(&out[k], ev[k], ev[k + 1]));
}

/* per step, the median over reps of per_rep[rep * n + step] */
static void phase_medians(const float *per_rep, int reps, int n, float *out) {
  float *col = (float *)malloc(sizeof(float) * (size_t)reps);
  for (int k = 0; k < n; k++) {
    for (int i = 0; i < reps; i++) col[i] = per_rep[(size_t)i * n + k];
    out[k] = median_of(col, reps);
  }
  free(col);
}

/* returns 1 when every job of the configuration succeeded */
static int run_config(mok_client *c, const config *cf, const char *routing_dir, int reps,
                      int warmup, int piped, cudaStream_t st, dres *r) {
  const bench_shape *sh = &SHAPES[cf->shape];
  const uint32_t T = (uint32_t)cf->T;
  const int E_loc = sh->E / EP, K = sh->K;
  memset(r, 0, sizeof *r);
  r->done = 1;
  r->flops_fwd = 6.0 * (double)T * K * sh->H * sh->I + 6.0 * (double)T * sh->H * sh->I;
  mok_layer_desc ld;
  memset(&ld, 0, sizeof ld);
  ld.hidden = (uint32_t)sh->H;
  ld.intermediate = (uint32_t)sh->I;
  ld.experts = (uint32_t)E_loc;
  ld.topk = (uint32_t)K;
  ld.shared_intermediate = (uint32_t)sh->I;
  ld.max_tokens = T;
  ld.dtype = MOK_DTYPE_BF16;
  mok_layer *l = NULL;
  int st_ = mok_layer_create(c, &ld, &l);
  if (st_ != MOK_OK) return fail(r, "mok_layer_create", st_);

  size_t set_bytes[P_PER_SET], one_bytes[N_ONE], total = 0;
  for (int k = 0; k < P_PER_SET; k++)
    total += N_SETS * (((set_bytes[k] = slot_bytes(l, T, SET_SLOTS[k])) + 255) & ~(size_t)255);
  for (int k = 0; k < N_ONE; k++)
    total += ((one_bytes[k] = slot_bytes(l, T, ONE_SLOTS[k])) + 255) & ~(size_t)255;
  /* --inproc-ab: the in-process layer's own client tensors (activations,
   * outputs, gradients) in the same pool, after the jobs' tensors */
  mok_k_dims d;
  layer_dims(cf, &d);
  size_t ip_at = 0;
  if (g_ab) {
    char err[200];
    if (mok_k_check_dims(&d, err, sizeof err) != MOK_OK) {
      snprintf(r->error, sizeof r->error, "in-process dims: %s", err);
      fprintf(stderr, "mok_bench_daemon: %s\n", r->error);
      mok_layer_destroy(l);
      return 0;
    }
    ip_at = (total + 4095) & ~(size_t)4095;
    total = ip_at + layer_client_bytes(&d, 0);
  }
  char *pool = NULL;
  size_t pool_bytes = total + 256;
  CUmemGenericAllocationHandle pool_vmm = 0;
  if (g_vmm) { /* cuMemCreate memory: libmok exports it as a POSIX fd, mokd maps it */
    const size_t g = vmm_granularity();
    pool_bytes = (pool_bytes + g - 1) / g * g;
    pool_vmm = vmm_create(pool_bytes);
    pool = vmm_map(pool_vmm, pool_bytes);
  } else {
    if (g_round_2m) pool_bytes = (pool_bytes + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
    CUDA_CHECK(cudaMalloc((void **)&pool, pool_bytes));
  }
  fprintf(stderr, "mok_bench_daemon: %s pool of %zu bytes at %p\n", g_vmm ? "cuMemCreate" : "cudaMalloc",
          pool_bytes, (void *)pool);
  void *ps[N_SETS][P_PER_SET], *po[N_ONE];
  size_t at = 0;
  for (int k = 0; k < P_PER_SET; k++)
    for (int s = 0; s < N_SETS; s++) {
      ps[s][k] = pool + at;
      at += (set_bytes[k] + 255) & ~(size_t)255;
    }
  for (int k = 0; k < N_ONE; k++) {
    po[k] = one_bytes[k] ? pool + at : NULL;
    at += (one_bytes[k] + 255) & ~(size_t)255;
  }
  /* values as mok_bench: x, d_out variance 1, weights variance 1/fan_in */
  const float sq3 = 1.7320508f;
  const float wsc[6] = {sq3 / sqrtf((float)sh->H), sq3 / sqrtf((float)sh->H),
                        sq3 / sqrtf((float)sh->I), sq3 / sqrtf((float)sh->H),
                        sq3 / sqrtf((float)sh->H), sq3 / sqrtf((float)sh->I)};
  for (int k = 0; k < 6; k++)
    fill_bf16<<<2048, 256>>>((uint16_t *)po[k], one_bytes[k] / 2, 3u + k, wsc[k]);
  for (int s = 0; s < N_SETS; s++) {
    fill_bf16<<<2048, 256>>>((uint16_t *)ps[s][P_X], set_bytes[P_X] / 2, 11u + 17u * s, sq3);
    fill_bf16<<<2048, 256>>>((uint16_t *)ps[s][P_DOUT], set_bytes[P_DOUT] / 2, 12u + 17u * s, sq3);
  }
  CUDA_CHECK(cudaGetLastError());
  const size_t TK = (size_t)T * K;
  int32_t *ids = (int32_t *)malloc(TK * 4);
  float *rw = (float *)malloc(TK * 4);
  r->from_file = 1;
  rng_state = 0x1234567ull + (uint64_t)cf->shape * 1000003ull + (uint64_t)T * 7ull +
              (uint64_t)cf->skewed;
  for (int s = 0; s < N_SETS; s++) {
    int mn, mx;
    if (!load_routing(routing_dir, cf, s, (int)T, E_loc, K, ids, rw, &r->max_over_mean[s], &mn,
                      &mx))
      r->from_file = 0;
    CUDA_CHECK(cudaMemcpy(ps[s][P_IDS], ids, TK * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(ps[s][P_RW], rw, TK * 4, cudaMemcpyHostToDevice));
  }
  free(ids);
  free(rw);
  CUDA_CHECK(cudaDeviceSynchronize());

  /* --inproc-ab: the chain in this process on the jobs' own inputs (the
   * same shapes, routings, weights: the same bytes) */
  layer L;
  bench_pool ip;
  if (g_ab) {
    memset(&ip, 0, sizeof ip);
    ip.kind = POOL_LOCAL;
    ip.sock = -1;
    ip.base = pool + ip_at;
    ip.size = pool_bytes - ip_at;
    layer_inputs in;
    memset(&in, 0, sizeof in);
    for (int s = 0; s < N_SETS; s++) {
      in.x[s] = (uint16_t *)ps[s][P_X];
      in.d_out[s] = (uint16_t *)ps[s][P_DOUT];
      in.rw[s] = (float *)ps[s][P_RW];
      in.ids[s] = (int32_t *)ps[s][P_IDS];
    }
    in.wg = (uint16_t *)po[0];
    in.wu = (uint16_t *)po[1];
    in.wd = (uint16_t *)po[2];
    in.sg = (uint16_t *)po[3];
    in.su = (uint16_t *)po[4];
    in.sd = (uint16_t *)po[5];
    layer_alloc(&L, &d, &ip, &in);
    L.gathering = 1; /* mokd's chain (bench_layer.h), the gather rule's default */
  }

  mok_forward_args fa[N_SETS];
  mok_backward_args ba[N_SETS];
  for (int s = 0; s < N_SETS; s++) {
    memset(&fa[s], 0, sizeof fa[s]);
    memset(&ba[s], 0, sizeof ba[s]);
    fa[s].x = ba[s].x = ps[s][P_X];
    fa[s].topk_ids = ba[s].topk_ids = (const int32_t *)ps[s][P_IDS];
    fa[s].router_weights = ba[s].router_weights = (const float *)ps[s][P_RW];
    fa[s].w_gate = ba[s].w_gate = po[0];
    fa[s].w_up = ba[s].w_up = po[1];
    fa[s].w_down = ba[s].w_down = po[2];
    fa[s].s_gate = ba[s].s_gate = po[3];
    fa[s].s_up = ba[s].s_up = po[4];
    fa[s].s_down = ba[s].s_down = po[5];
    fa[s].out = po[6];
    fa[s].ctx = ba[s].ctx = po[7];
    ba[s].d_out = ps[s][P_DOUT];
    ba[s].d_x = po[8];
    ba[s].d_router_weights = (float *)po[9];
    ba[s].d_w_gate = po[10];
    ba[s].d_w_up = po[11];
    ba[s].d_w_down = po[12];
    ba[s].d_s_gate = po[13];
    ba[s].d_s_up = po[14];
    ba[s].d_s_down = po[15];
  }

  int ok = 1;
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  float *tf = (float *)malloc(sizeof(float) * reps), *tb = (float *)malloc(sizeof(float) * reps);
  /* --inproc-ab: the in-process side's times */
  float *af = (float *)malloc(sizeof(float) * reps), *ab = (float *)malloc(sizeof(float) * reps);
  /* --phases: the in-process chain's steps, per rep */
  cudaEvent_t pev[FWD_STEPS + 1];
  float *pf = NULL, *pb = NULL;
  if (g_ab && g_phases) {
    for (int k = 0; k <= FWD_STEPS; k++) CUDA_CHECK(cudaEventCreate(&pev[k]));
    pf = (float *)calloc((size_t)reps * FWD_STEPS, sizeof(float));
    pb = (float *)calloc((size_t)reps * BWD_STEPS, sizeof(float));
  }
  cudaEvent_t *ev = g_ab && g_phases ? pev : NULL;
  float *submit_us = (float *)calloc((size_t)reps, sizeof(float));
  for (int i = 0; g_ab && ok && i < 2 * (warmup + reps); i++) {
    /* run i: A (in-process) when i % 4 is 0 or 3, else B (mokd); set i % 2 */
    const int s = i % N_SETS, in_proc = i % 4 == 0 || i % 4 == 3, rep = i / 2 - warmup;
    CUDA_CHECK(cudaEventRecord(e0, st));
    const double t_call = now_s();
    if (in_proc) enqueue_forward(&L, s, ev, st);
    else ok = forward_job(c, l, T, &fa[s], st, r);
    if (rep >= 0 && !in_proc) submit_us[rep] = (float)((now_s() - t_call) * 1e6);
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    if (rep >= 0) CUDA_CHECK(cudaEventElapsedTime(in_proc ? &af[rep] : &tf[rep], e0, e1));
    if (rep >= 0 && in_proc && ev) phase_times(ev, FWD_STEPS, pf + (size_t)rep * FWD_STEPS);
  }
  for (int i = 0; g_ab && ok && i < 2 * (warmup + reps); i++) {
    const int s = i % N_SETS, in_proc = i % 4 == 0 || i % 4 == 3, rep = i / 2 - warmup;
    if (in_proc) enqueue_forward(&L, s, NULL, st);
    else ok = forward_job(c, l, T, &fa[s], st, r);
    CUDA_CHECK(cudaEventRecord(e0, st));
    if (in_proc) enqueue_backward(&L, s, ev, st);
    else if (ok) ok = backward_job(c, l, T, &ba[s], st, r);
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    if (rep >= 0) CUDA_CHECK(cudaEventElapsedTime(in_proc ? &ab[rep] : &tb[rep], e0, e1));
    if (rep >= 0 && in_proc && ev) phase_times(ev, BWD_STEPS, pb + (size_t)rep * BWD_STEPS);
  }
  if (ev) {
    phase_medians(pf, reps, FWD_STEPS, r->phase_fwd);
    phase_medians(pb, reps, BWD_STEPS, r->phase_bwd);
    for (int k = 0; k <= FWD_STEPS; k++) CUDA_CHECK(cudaEventDestroy(pev[k]));
  }
  free(pf);
  free(pb);
  if (ok) r->submit_fwd_us = median_of(submit_us, reps);
  free(submit_us);
  for (int i = 0; !g_ab && ok && i < warmup + reps; i++) {
    const int s = i % N_SETS;
    CUDA_CHECK(cudaEventRecord(e0, st));
    if ((st_ = mok_forward_on_stream(l, T, &fa[s], st, NULL)) != MOK_OK)
      ok = fail(r, "mok_forward_on_stream", st_);
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    if (i >= warmup) CUDA_CHECK(cudaEventElapsedTime(&tf[i - warmup], e0, e1));
  }
  for (int i = 0; !g_ab && ok && i < warmup + reps; i++) {
    const int s = i % N_SETS;
    if ((st_ = mok_forward_on_stream(l, T, &fa[s], st, NULL)) != MOK_OK)
      ok = fail(r, "mok_forward_on_stream", st_);
    CUDA_CHECK(cudaEventRecord(e0, st));
    if (ok && (st_ = mok_backward_on_stream(l, T, 0, &ba[s], st, NULL)) != MOK_OK)
      ok = fail(r, "mok_backward_on_stream", st_);
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    if (i >= warmup) CUDA_CHECK(cudaEventElapsedTime(&tb[i - warmup], e0, e1));
  }
  /* piped: the client runs ahead of the GPU, as a trainer does, so the
   * daemon's enqueue of a job overlaps the previous job's kernels */
  for (int pass = 0; ok && piped && pass < 2; pass++) {
    CUDA_CHECK(cudaEventRecord(e0, st));
    for (int i = 0; ok && i < reps; i++) {
      const int s = i % N_SETS;
      if ((st_ = mok_forward_on_stream(l, T, &fa[s], st, NULL)) != MOK_OK)
        ok = fail(r, "mok_forward_on_stream", st_);
      if (ok && pass == 1 && (st_ = mok_backward_on_stream(l, T, 0, &ba[s], st, NULL)) != MOK_OK)
        ok = fail(r, "mok_backward_on_stream", st_);
    }
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (pass == 0) r->fwd_piped_ms = ms / reps;
    else r->bwd_piped_ms = ms / reps - r->fwd_piped_ms;
  }
  if ((st_ = mok_sync(c, 30000)) != MOK_OK && ok) ok = fail(r, "a job (mok_sync)", st_);
  if (ok) {
    r->fwd_ms = median_of(tf, reps);
    r->bwd_ms = median_of(tb, reps);
  }
  if (ok && g_ab) {
    /* status nonzero: the chain's kernels returned early; and out, d_x finite */
    const int32_t ist = read_status(&L, st);
    const unsigned long long nf = dev_nonfinite(&L, L.out, (size_t)d.T * d.H, st) +
                                  dev_nonfinite(&L, L.d_x, (size_t)d.T * d.H, st);
    if (ist != 0 || nf != 0) {
      snprintf(r->error, sizeof r->error, "in-process chain: status %d, %llu nonfinite", ist, nf);
      fprintf(stderr, "mok_bench_daemon: %s\n", r->error);
      ok = 0;
    }
  }
  if (ok && g_ab) {
    r->ab = 1;
    r->inproc_fwd_ms = median_of(af, reps);
    r->inproc_bwd_ms = median_of(ab, reps);
    r->overhead_fwd_pct = 100.0 * (r->fwd_ms / r->inproc_fwd_ms - 1.0);
    r->overhead_bwd_pct = 100.0 * (r->bwd_ms / r->inproc_bwd_ms - 1.0);
    float *q = (float *)malloc(sizeof(float) * reps);
    for (int i = 0; i < reps; i++) q[i] = 100.0f * (tf[i] / af[i] - 1.0f);
    r->paired_fwd_pct = median_of(q, reps);
    for (int i = 0; i < reps; i++) q[i] = 100.0f * (tb[i] / ab[i] - 1.0f);
    r->paired_bwd_pct = median_of(q, reps);
    free(q);
    /* the same kernels on the same inputs: set 0 once each way, bitwise */
    const unsigned long long h_in = chain_hash(&L, 0, st);
    if ((st_ = mok_forward_on_stream(l, T, &fa[0], st, NULL)) != MOK_OK ||
        (st_ = mok_backward_on_stream(l, T, 0, &ba[0], st, NULL)) != MOK_OK ||
        (st_ = mok_sync(c, 30000)) != MOK_OK) {
      ok = fail(r, "the comparison's jobs", st_);
    } else {
      const layer_outputs o = {po[6], po[8], po[9], po[10], po[11], po[12], po[13], po[15]};
      r->same_output = outputs_hash(&L, &o, st) == h_in;
    }
  }
  free(tf);
  free(tb);
  free(af);
  free(ab);
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  mok_layer_destroy(l);
  if (g_ab) layer_free(&L);
  mok_cuda_forget(c, pool);
  if (g_vmm) {
    CUDA_CHECK(cudaDeviceSynchronize());
    vmm_unmap_release(pool, pool_bytes, pool_vmm);
  } else {
    CUDA_CHECK(cudaFree(pool));
  }
  r->ok = ok;
  return ok;
}

/* what the in-process side runs: the backend and variant mok_k_init chose
 * (mokd's own mok_k_init chooses from the same environment) */
static const char *inproc_kernels(void) {
  return mok_k_gemm_backend() == MOK_K_GEMM_HMMA ? "hmma"
                                                 : mok_k_sm90_variant_name(mok_k_sm90_variant());
}

static void write_json(const char *path, const char *engine, const char *device, int mps,
                       const config *cfg, const dres *res, int n, const char *note, int reps,
                       int warmup) {
  if (!path) return;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    perror(tmp);
    return;
  }
  fprintf(f, "{\n \"tool\": \"mok_bench_daemon\",\n \"engine\": \"%s\",\n \"device\": \"%s\",\n"
             " \"mps\": %s,\n \"note\": \"%s\",\n \"reps\": %d,\n \"warmup\": %d,\n"
             " \"client_wait\": \"%s\",\n",
          engine, device, mps ? "true" : "false", note, reps, warmup,
          g_host_wait ? "host" : "stream");
  if (g_ab)
    fprintf(f, " \"inproc_ab\": true,\n \"inproc_kernels\": \"%s\",\n"
               " \"inproc_note\": \"in-process: the kernel library on the client's stream, taking "
               "turns run by run with the mokd job (A B B A), on the same inputs; overhead_*_pct: "
               "mokd median / in-process median - 1; paired_*_pct: median of the per-rep ratios\",\n",
            inproc_kernels());
  fprintf(f, " \"results\": [");
  int first = 1;
  for (int i = 0; i < n; i++) {
    if (!res[i].done) continue;
    const dres *r = &res[i];
    fprintf(f, "%s\n  {\"shape\": \"%s\", \"T\": %d, \"routing\": \"%s\", \"ok\": %s, "
               "\"routing_from_file\": %s, \"flops_fwd\": %.6e",
            first ? "" : ",", SHAPES[cfg[i].shape].name, cfg[i].T,
            cfg[i].skewed ? "skewed" : "balanced", r->ok ? "true" : "false",
            r->from_file ? "true" : "false", r->flops_fwd);
    if (r->ok)
      fprintf(f, ", \"fwd_ms\": %.4f, \"bwd_ms\": %.4f, \"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f",
              r->fwd_ms, r->bwd_ms, r->flops_fwd / r->fwd_ms * 1e-9,
              2 * r->flops_fwd / r->bwd_ms * 1e-9);
    if (r->ok && r->ab)
      fprintf(f, ", \"inproc_fwd_ms\": %.4f, \"inproc_bwd_ms\": %.4f, \"overhead_fwd_pct\": %.2f, "
                 "\"overhead_bwd_pct\": %.2f, \"paired_fwd_pct\": %.2f, \"paired_bwd_pct\": %.2f, "
                 "\"same_output\": %s",
              r->inproc_fwd_ms, r->inproc_bwd_ms, r->overhead_fwd_pct, r->overhead_bwd_pct,
              r->paired_fwd_pct, r->paired_bwd_pct, r->same_output ? "true" : "false");
    if (r->ok && r->ab && g_phases) {
      fprintf(f, ", \"submit_fwd_us\": %.2f, \"inproc_fwd_phases_ms\": {", r->submit_fwd_us);
      for (int k = 0; k < FWD_STEPS; k++)
        fprintf(f, "%s\"%s\": %.4f", k ? ", " : "", FWD_NAMES[k], r->phase_fwd[k]);
      fprintf(f, "}, \"inproc_bwd_phases_ms\": {");
      for (int k = 0; k < BWD_STEPS; k++)
        fprintf(f, "%s\"%s\": %.4f", k ? ", " : "", BWD_NAMES[k], r->phase_bwd[k]);
      fprintf(f, "}");
    }
    if (r->ok && r->fwd_piped_ms > 0)
      fprintf(f, ", \"fwd_piped_ms\": %.4f, \"bwd_piped_ms\": %.4f", r->fwd_piped_ms,
              r->bwd_piped_ms);
    else
      fprintf(f, ", \"error\": \"%s\"", r->error);
    fprintf(f, "}");
    first = 0;
  }
  fprintf(f, "\n ]\n}\n");
  fclose(f);
  if (rename(tmp, path) != 0) perror("rename");
}

static int usage(const char *a0) {
  fprintf(stderr, "usage: %s [--out F] [--routing-dir D] [--T L] [--reps N] [--warmup N] "
                  "[--deadline S] [--only NAMES] [--piped 0|1] [--memory cudamalloc|cudamalloc-unrounded|vmm] "
                  "[--inproc-ab 0|1] [--phases 0|1] [--client-wait stream|host]\n", a0);
  return 2;
}

/* "0" or "1", else -1 */
static int parse_01(const char *v) { return !strcmp(v, "0") ? 0 : !strcmp(v, "1") ? 1 : -1; }

int main(int argc, char **argv) {
  const char *out = NULL, *routing_dir = NULL, *only = NULL, *tlist = "2048,8192";
  int reps = 10, warmup = 3, piped = 0;
  double deadline = 1e9;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--version")) {
      printf("mok_bench_daemon 2\n");
      return 0;
    }
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(argv[0]);
      return 0;
    }
    if (!v) return usage(argv[0]);
    if (!strcmp(a, "--out")) out = v;
    else if (!strcmp(a, "--routing-dir")) routing_dir = v;
    else if (!strcmp(a, "--T")) tlist = v;
    else if (!strcmp(a, "--reps")) reps = atoi(v);
    else if (!strcmp(a, "--warmup")) warmup = atoi(v);
    else if (!strcmp(a, "--deadline")) deadline = atof(v);
    else if (!strcmp(a, "--only")) only = v;
    else if (!strcmp(a, "--piped")) {
      if ((piped = parse_01(v)) < 0) return usage(argv[0]);
    } else if (!strcmp(a, "--inproc-ab")) {
      if ((g_ab = parse_01(v)) < 0) return usage(argv[0]);
    } else if (!strcmp(a, "--phases")) {
      if ((g_phases = parse_01(v)) < 0) return usage(argv[0]);
    } else if (!strcmp(a, "--client-wait")) {
      if (strcmp(v, "stream") && strcmp(v, "host")) return usage(argv[0]);
      g_host_wait = !strcmp(v, "host");
    }
    else if (!strcmp(a, "--memory")) {
      if (strcmp(v, "cudamalloc") && strcmp(v, "cudamalloc-unrounded") && strcmp(v, "vmm")) {
        fprintf(stderr, "mok_bench_daemon: --memory: cudamalloc, cudamalloc-unrounded or vmm, "
                        "not '%s'\n", v);
        return 2;
      }
      g_vmm = !strcmp(v, "vmm");
      g_round_2m = strcmp(v, "cudamalloc-unrounded") != 0;
    }
    else {
      fprintf(stderr, "unknown option %s\n", a);
      return usage(argv[0]);
    }
    i++;
  }
  if (reps < 1 || warmup < 0) return usage(argv[0]);
  if ((g_phases || g_host_wait) && !g_ab) {
    fprintf(stderr, "mok_bench_daemon: --phases and --client-wait host go with --inproc-ab 1\n");
    return 2;
  }
  int ts[8], nts = 0;
  for (const char *p = tlist; *p && nts < 8;) {
    int t = atoi(p);
    if (t > 0) ts[nts++] = t;
    const char *comma = strchr(p, ',');
    if (!comma) break;
    p = comma + 1;
  }
  const double t0 = now_s();
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaFree(NULL));
  if (g_vmm) CU_OK(cuInit(0));
  if (g_ab) { /* the in-process side's kernels, in this process's context */
    MOK_CHECK(kernel_init_from_env());
    printf("mok_bench_daemon: in-process side: GEMM backend %s, variant %s\n",
           mok_k_gemm_backend() == MOK_K_GEMM_HMMA ? "mma.sync" : "sm90", inproc_kernels());
  }
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int mps = getenv("CUDA_MPS_PIPE_DIRECTORY") != NULL;
  mok_client *c = NULL;
  int r0 = mok_connect(NULL, "mok_bench_daemon", &c);
  static config cfg[64];
  static dres res[64];
  const int n = make_plan(ts, nts, cfg);
  if (r0 != MOK_OK) {
    fprintf(stderr, "mok_bench_daemon: mok_connect: %s (%s)\n", mok_status_name(r0),
            mok_last_error());
    write_json(out, "none", "", mps, cfg, res, 0, "could not connect to mokd", reps, warmup);
    return 3;
  }
  const char *engine = mok_client_engine(c), *device = mok_client_device(c);
  printf("mok_bench_daemon: mokd engine %s on %s%s\n", engine, device, mps ? " (MPS)" : "");
  if (strcmp(engine, "cuda") != 0) {
    write_json(out, engine, device, mps, cfg, res, 0, "mokd does not run the cuda engine", reps, warmup);
    mok_close(c);
    return 3;
  }
  int failures = 0, differ = 0;
  for (int i = 0; i < n; i++) {
    const bench_shape *sh = &SHAPES[cfg[i].shape];
    if (only && !strstr(only, sh->name)) continue;
    if (now_s() - t0 > deadline) {
      printf("skip %s T=%d %s (deadline)\n", sh->name, cfg[i].T,
             cfg[i].skewed ? "skewed" : "balanced");
      continue;
    }
    int ok = run_config(c, &cfg[i], routing_dir, reps, warmup, piped, st, &res[i]);
    const dres *r = &res[i];
    if (ok && r->ab) /* --inproc-ab: one line, both sides and the cost */
      printf("%-16s T=%-5d %-8s in-process: fwd %8.3f bwd %8.3f ms | through mokd: fwd %8.3f "
             "bwd %8.3f ms | overhead: fwd %+6.2f %% (paired %+6.2f %%) bwd %+6.2f %% "
             "(paired %+6.2f %%) | same output %s",
             sh->name, cfg[i].T, cfg[i].skewed ? "skewed" : "balanced", r->inproc_fwd_ms,
             r->inproc_bwd_ms, r->fwd_ms, r->bwd_ms, r->overhead_fwd_pct, r->paired_fwd_pct,
             r->overhead_bwd_pct, r->paired_bwd_pct, r->same_output ? "yes" : "NO");
    else if (ok)
      printf("%-16s T=%-5d %-8s through mokd: fwd %8.3f ms %6.1f TF/s  bwd %8.3f ms %6.1f TF/s",
             sh->name, cfg[i].T, cfg[i].skewed ? "skewed" : "balanced", r->fwd_ms,
             r->flops_fwd / r->fwd_ms * 1e-9, r->bwd_ms, 2 * r->flops_fwd / r->bwd_ms * 1e-9);
    if (ok && piped)
      printf("  piped: fwd %8.3f ms  bwd %8.3f ms", r->fwd_piped_ms, r->bwd_piped_ms);
    if (ok) printf("\n");
    if (ok && r->ab && g_phases) {
      printf("  in-process phases (ms): fwd");
      for (int k = 0; k < FWD_STEPS; k++) printf(" %s %.4f", FWD_NAMES[k], r->phase_fwd[k]);
      printf(" | bwd");
      for (int k = 0; k < BWD_STEPS; k++) printf(" %s %.4f", BWD_NAMES[k], r->phase_bwd[k]);
      printf("\n");
    }
    differ += ok && r->ab && !r->same_output;
    fflush(stdout);
    write_json(out, engine, device, mps, cfg, res, n, "jobs on device pointers, on the client's stream", reps,
               warmup);
    if (!ok) {
      failures++;
      break;
    }
  }
  mok_close(c);
  CUDA_CHECK(cudaStreamDestroy(st));
  printf("mok_bench_daemon: %.1f s, %d failure(s)", now_s() - t0, failures);
  if (g_ab) printf(", %d configuration(s) whose outputs differ between in-process and mokd", differ);
  printf("\n");
  return failures || differ ? 1 : 0;
}
