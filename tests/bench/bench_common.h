/* SPDX-License-Identifier: Apache-2.0 */
/* What mok_bench and mok_bench_daemon share: the benchmark shapes (docs/design.md), the
 * configuration order of tests/bench/torch_baseline.py, the routing recipe
 * and the routing files the baseline writes, small host helpers, the CUDA
 * error check and the device fill kernel. Included by one .cu file of each
 * program. */
#ifndef MOK_BENCH_COMMON_H
#define MOK_BENCH_COMMON_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

#include <cuda_runtime.h>

/* ---- CUDA: error check and random bf16 fill (both programs) ----------------------- */

#include "../harness/cuda_check.cuh"
#include "../harness/model_shapes.h"

/* ---- shapes and the plan (same as torch_baseline.py) ------------------------------- */

typedef struct bench_shape {
  const char *name;
  int E, H, I, K;
} bench_shape;

#define BENCH_SHAPE_(name, E, H, I, K) {name, E, H, I, K},
static const bench_shape SHAPES[] = {MOK_MODEL_SHAPES(BENCH_SHAPE_)};
#define N_SHAPES 4
#define EP MOK_MODEL_EP
static const int T8192_ORDER[N_SHAPES] = {0, 3, 1, 2}; /* kimi, deepseek, glm, qwen */

typedef struct config {
  int shape, T, skewed;
} config;

static int make_plan(const int *ts, int nts, config *out) {
  int n = 0, has2048 = 0;
  for (int i = 0; i < nts; i++) has2048 |= ts[i] == 2048;
  if (has2048)
    for (int s = 0; s < N_SHAPES; s++)
      for (int r = 0; r < 2; r++) out[n++] = (config){s, 2048, r};
  for (int i = 0; i < nts; i++) {
    if (ts[i] == 2048) continue;
    for (int r = 0; r < 2; r++)
      for (int j = 0; j < N_SHAPES; j++) out[n++] = (config){T8192_ORDER[j], ts[i], r};
  }
  return n;
}

/* ---- host helpers ----------------------------------------------------------------- */

static double now_s(void) {
  struct timeval tv;
  gettimeofday(&tv, NULL);
  return tv.tv_sec + tv.tv_usec * 1e-6;
}

static uint64_t rng_state;
static uint64_t rng_next(void) {
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
static double rng_unit(void) { return ((rng_next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static double rng_normal(void) {
  return sqrt(-2.0 * log(rng_unit())) * cos(6.283185307179586 * rng_unit());
}

/* softmax top-k of N(0,1) logits (+ bias when skewed), rw renormalised over the K */
static void gen_routing(int T, int E_loc, int K, int skewed, int32_t *ids, float *rw) {
  double *p = (double *)malloc(sizeof(double) * E_loc);
  char *taken = (char *)malloc(E_loc);
  for (int t = 0; t < T; t++) {
    double mx = -1e300, sum = 0.0;
    for (int e = 0; e < E_loc; e++) {
      double b = !skewed ? 0.0 : e == 0 ? 6.0 : e < 4 ? 1.0 : 0.0;
      p[e] = rng_normal() + b;
      if (p[e] > mx) mx = p[e];
    }
    for (int e = 0; e < E_loc; e++) sum += (p[e] = exp(p[e] - mx));
    memset(taken, 0, E_loc);
    double ksum = 0.0;
    for (int k = 0; k < K; k++) {
      int best = -1;
      for (int e = 0; e < E_loc; e++)
        if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
      taken[best] = 1;
      ids[(size_t)t * K + k] = best;
      rw[(size_t)t * K + k] = (float)(p[best] / sum);
      ksum += p[best] / sum;
    }
    for (int k = 0; k < K; k++) rw[(size_t)t * K + k] = (float)(rw[(size_t)t * K + k] / ksum);
  }
  free(p);
  free(taken);
}

static int read_file(const char *path, void *dst, size_t bytes) {
  FILE *f = fopen(path, "rb");
  if (!f) return 0;
  size_t got = fread(dst, 1, bytes, f);
  int extra = fgetc(f);
  fclose(f);
  return got == bytes && extra == EOF;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return x < y ? -1 : x > y;
}
static float median_of(const float *v, int n) {
  float *c = (float *)malloc(sizeof(float) * n);
  memcpy(c, v, sizeof(float) * n);
  qsort(c, n, sizeof(float), cmp_float);
  float m = n % 2 ? c[n / 2] : 0.5f * (c[n / 2 - 1] + c[n / 2]);
  free(c);
  return m;
}

/* Routing of set s of configuration c: the baseline's file when routing_dir
 * has it (returns 1), else gen_routing (returns 0). Fills the load stats. */
static int load_routing(const char *routing_dir, const config *c, int s, int T, int E_loc, int K,
                        int32_t *ids, float *rw, double *max_over_mean, int *min_rows,
                        int *max_rows) {
  const size_t TK = (size_t)T * K;
  int got = 0;
  if (routing_dir) {
    char base[1024], p1[1100], p2[1100];
    snprintf(base, sizeof base, "%s/%s_T%d_%s_s%d", routing_dir, SHAPES[c->shape].name, T,
             c->skewed ? "skewed" : "balanced", s);
    snprintf(p1, sizeof p1, "%s.ids", base);
    snprintf(p2, sizeof p2, "%s.rw", base);
    got = read_file(p1, ids, TK * 4) && read_file(p2, rw, TK * 4);
  }
  if (!got) gen_routing(T, E_loc, K, c->skewed, ids, rw);
  int *counts = (int *)calloc((size_t)E_loc, sizeof(int));
  for (size_t i = 0; i < TK; i++)
    if (ids[i] >= 0 && ids[i] < E_loc) counts[ids[i]]++;
  int mx = 0, mn = 1 << 30;
  for (int e = 0; e < E_loc; e++) {
    if (counts[e] > mx) mx = counts[e];
    if (counts[e] < mn) mn = counts[e];
  }
  free(counts);
  *max_over_mean = mx / ((double)TK / E_loc);
  *min_rows = mn;
  *max_rows = mx;
  return got;
}

#endif /* MOK_BENCH_COMMON_H */
