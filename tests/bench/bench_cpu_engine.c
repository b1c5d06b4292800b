/* SPDX-License-Identifier: Apache-2.0 */
/* bench_cpu_engine: GFLOP/s of the cpu engine's forward and backward.
 *
 *   bench_cpu_engine [T H I E K I_s dtype(f32|bf16) threads(0: all) iters]
 * defaults: 256 512 256 8 2 0 f32 0 5
 *
 * FLOPs counted: forward 6*T*K*H*I (+ 6*T*H*I_s), backward 12*T*K*H*I
 * (+ 12*T*H*I_s): the GEMMs only, each multiply-add as two. Backward reads
 * the ctx saved by forward (no recompute). A benchmark, not a test.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bf16.h"
#include "engine.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *alloc_filled(size_t n, uint32_t dt, uint64_t *seed, float scale) {
  void *p = malloc(n * mok_dtype_size(dt) + 1);
  if (!p) {
    fprintf(stderr, "out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < n; i++) {
    *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
    float v = ((float)(*seed >> 40) / (float)(1u << 24) * 2.0f - 1.0f) * scale;
    if (dt == MOK_DTYPE_F32)
      ((float *)p)[i] = v;
    else
      ((mok_bf16 *)p)[i] = mok_f32_to_bf16(v);
  }
  return p;
}

static void put(mok_job_args *a, int slot, void *ptr, size_t n, uint32_t dt) {
  a->t[slot].ptr = ptr;
  a->t[slot].bytes = (uint64_t)n * mok_dtype_size(dt);
  a->t[slot].dtype = dt;
  a->t[slot].ndim = 1;
  a->t[slot].shape[0] = (uint32_t)n;
}

static int run(mok_engine *e, const mok_job_args *a) {
  mok_engine_result res;
  mok_engine_run(&mok_engine_cpu, e, a, &res);
  if (res.status != MOK_OK) fprintf(stderr, "job failed: %d: %s\n", res.status, res.message);
  return res.status;
}

int main(int argc, char **argv) {
  int T = 256, H = 512, I = 256, E = 8, K = 2, Is = 0, threads = 0, iters = 5;
  uint32_t dt = MOK_DTYPE_F32;
  if (argc > 1) T = atoi(argv[1]);
  if (argc > 2) H = atoi(argv[2]);
  if (argc > 3) I = atoi(argv[3]);
  if (argc > 4) E = atoi(argv[4]);
  if (argc > 5) K = atoi(argv[5]);
  if (argc > 6) Is = atoi(argv[6]);
  if (argc > 7) dt = strcmp(argv[7], "bf16") == 0 ? MOK_DTYPE_BF16 : MOK_DTYPE_F32;
  if (argc > 8) threads = atoi(argv[8]);
  if (argc > 9) iters = atoi(argv[9]);
  if (T < 1 || H < 1 || I < 1 || E < 1 || K < 1 || K > E || Is < 0 || iters < 1) {
    fprintf(stderr, "usage: %s [T H I E K I_s f32|bf16 threads iters]\n", argv[0]);
    return 2;
  }

  mok_engine_config ec = {.device = 0, .threads = threads};
  mok_engine *e = NULL;
  char err[128];
  if (mok_engine_cpu.open(&ec, &e, err, sizeof err) != MOK_OK) {
    fprintf(stderr, "open: %s\n", err);
    return 1;
  }
  mok_layer_config c = {.hidden = (uint32_t)H, .intermediate = (uint32_t)I, .experts = (uint32_t)E,
                        .local_experts = (uint32_t)E, .topk = (uint32_t)K,
                        .shared_intermediate = (uint32_t)Is, .max_tokens = (uint32_t)T,
                        .dtype = dt};
  if (mok_engine_cpu.prepare_layer(e, &c, err, sizeof err) != MOK_OK) {
    fprintf(stderr, "prepare_layer: %s\n", err);
    return 1;
  }
  mok_layout_dims d = mok_layer_dims(&c, (uint32_t)T);
  uint64_t seed = 42;
  size_t nx = (size_t)T * H, ntk = (size_t)T * K, nw = (size_t)E * I * H, ns = (size_t)Is * H;
  void *x = alloc_filled(nx, dt, &seed, 1.0f), *dout = alloc_filled(nx, dt, &seed, 1.0f);
  void *wg = alloc_filled(nw, dt, &seed, 0.05f), *wu = alloc_filled(nw, dt, &seed, 0.05f),
       *wd = alloc_filled(nw, dt, &seed, 0.05f);
  void *sg = alloc_filled(ns, dt, &seed, 0.05f), *su = alloc_filled(ns, dt, &seed, 0.05f),
       *sd = alloc_filled(ns, dt, &seed, 0.05f);
  float *rw = alloc_filled(ntk, MOK_DTYPE_F32, &seed, 1.0f);
  int32_t *ids = malloc(ntk * sizeof *ids);
  void *out = malloc(nx * 4), *dx = malloc(nx * 4), *ctx = malloc(mok_ctx_bytes(&d));
  float *drw = malloc(ntk * 4);
  void *dwg = malloc(nw * 4), *dwu = malloc(nw * 4), *dwd = malloc(nw * 4);
  void *dsg = malloc(ns * 4 + 1), *dsu = malloc(ns * 4 + 1), *dsd = malloc(ns * 4 + 1);
  if (!ids || !out || !dx || !ctx || !drw || !dwg || !dwu || !dwd || !dsg || !dsu || !dsd) {
    fprintf(stderr, "out of memory\n");
    return 1;
  }
  for (int t = 0; t < T; t++) /* balanced distinct experts per token */
    for (int k = 0; k < K; k++) ids[t * K + k] = (t * 7 + k * (E / K > 0 ? E / K : 1)) % E;

  mok_job_args f, b;
  memset(&f, 0, sizeof f);
  f.op = MOK_OP_FORWARD;
  f.tokens = (uint32_t)T;
  f.layer = &c;
  put(&f, MOK_SLOT_X, x, nx, dt);
  put(&f, MOK_SLOT_TOPK_IDS, ids, ntk, MOK_DTYPE_I32);
  put(&f, MOK_SLOT_ROUTER_W, rw, ntk, MOK_DTYPE_F32);
  put(&f, MOK_SLOT_W_GATE, wg, nw, dt);
  put(&f, MOK_SLOT_W_UP, wu, nw, dt);
  put(&f, MOK_SLOT_W_DOWN, wd, nw, dt);
  if (Is) {
    put(&f, MOK_SLOT_S_GATE, sg, ns, dt);
    put(&f, MOK_SLOT_S_UP, su, ns, dt);
    put(&f, MOK_SLOT_S_DOWN, sd, ns, dt);
  }
  b = f;
  put(&f, MOK_SLOT_OUT, out, nx, dt);
  put(&f, MOK_SLOT_CTX, ctx, mok_ctx_bytes(&d), MOK_DTYPE_U8);
  b.op = MOK_OP_BACKWARD;
  b.t[MOK_SLOT_TOPK_IDS].ptr = NULL;
  put(&b, MOK_SLOT_CTX, ctx, mok_ctx_bytes(&d), MOK_DTYPE_U8);
  put(&b, MOK_SLOT_D_OUT, dout, nx, dt);
  put(&b, MOK_SLOT_D_X, dx, nx, dt);
  put(&b, MOK_SLOT_D_RW, drw, ntk, MOK_DTYPE_F32);
  put(&b, MOK_SLOT_D_W_GATE, dwg, nw, dt);
  put(&b, MOK_SLOT_D_W_UP, dwu, nw, dt);
  put(&b, MOK_SLOT_D_W_DOWN, dwd, nw, dt);
  if (Is) {
    put(&b, MOK_SLOT_D_S_GATE, dsg, ns, dt);
    put(&b, MOK_SLOT_D_S_UP, dsu, ns, dt);
    put(&b, MOK_SLOT_D_S_DOWN, dsd, ns, dt);
  }

  if (run(e, &f) || run(e, &b)) return 1; /* warm-up: scratch grows once */
  double best_f = 1e30, best_b = 1e30;
  for (int i = 0; i < iters; i++) {
    double t0 = now_s();
    if (run(e, &f)) return 1;
    double t1 = now_s();
    if (run(e, &b)) return 1;
    double t2 = now_s();
    if (t1 - t0 < best_f) best_f = t1 - t0;
    if (t2 - t1 < best_b) best_b = t2 - t1;
  }
  double flop_f = 6.0 * T * K * (double)H * I + 6.0 * T * (double)H * Is;
  printf("%s  T=%d H=%d I=%d E=%d K=%d I_s=%d %s\n", mok_engine_cpu.describe(e), T, H, I, E, K,
         Is, dt == MOK_DTYPE_F32 ? "f32" : "bf16");
  printf("forward : %8.3f ms  %7.2f GFLOP/s\n", best_f * 1e3, flop_f / best_f * 1e-9);
  printf("backward: %8.3f ms  %7.2f GFLOP/s\n", best_b * 1e3, 2.0 * flop_f / best_b * 1e-9);
  mok_engine_cpu.close(e);
  return 0;
}
