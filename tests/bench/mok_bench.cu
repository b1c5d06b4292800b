/* SPDX-License-Identifier: Apache-2.0 */
/* mok_bench: the benchmark shapes (docs/design.md) through the kernel library (kernels/mok_kernels.h),
 * in-process, timed the way tests/bench/torch_baseline.py times PyTorch.
 *
 *   mok_bench [--out FILE.json] [--routing-dir DIR] [--T 2048,8192] [--reps N]
 *             [--warmup N] [--deadline S] [--only NAME[,NAME]]
 *             [--variants rows,expert,cluster,pingpong] [--routing balanced|skewed|both]
 *             [--band N]
 *
 * --variants: each configuration once per Hopper tile variant (mok_gemm_sm90.h;
 * "pingpong-plain": pingpong with its down dgrad on plain CTAs, "pingpong-pipe":
 * with one wgmma batch in flight in the k loops, "hmma" for the mma.sync
 * kernels, "fp8" for the fp8 layer: block-scaled e4m3 products, weights
 * quantised once before the timing, on the init's bf16 kernels for the rest;
 * "fp8-pingpong": the fp8 layer with its products on mok's own kernels),
 * on the same buffers, the variants taking
 * turns rep by rep (so a drift of the clocks weighs on all alike);
 * the JSON then has one result per (configuration, variant) with its
 * "variant", and every variant's hash of set 0 must equal the first one's
 * (all bf16 paths are bitwise equal, and fp8 paths equal the first fp8
 * path). Without it: the backend and variant that
 * mok_k_init chose (MOK_GEMM, MOK_GEMM_VARIANT), one result each.
 *
 * For each configuration (shape, T, routing; the same priority order as the
 * baseline) it runs the layer as the engine chains it:
 *   forward:  schedule_build, gather_rows(x), expert_forward, shared_forward, combine
 *   backward: gather_rows(d_out), expert_backward, shared_backward, dispatch_backward
 * (a path named NAME-gx: mokd's chain, bench_layer.h "gathering", with the
 * gate/up producer gathering x's rows) with CUDA events around the chain and
 * between its steps (median of --reps
 * after --warmup, rotating two input sets: x, routing, rw, d_out). Each
 * backward run follows an untimed forward of the same set.
 * TFLOP/s by the benchmark's formula: forward 6*(T + T*K)*H*I, backward twice.
 *
 * Routing: with --routing-dir, the ids/rw files the baseline wrote
 * (NAME_T<T>_<routing>_s<set>.ids|.rw); otherwise (or when a file is
 * missing) the same recipe here: softmax top-k of random logits over the
 * E_loc local experts, 'skewed' with +6 on expert 0 and +1 on experts 1..3.
 *
 * Checks per configuration: the job status word stays 0 (a nonzero status
 * makes every kernel return early, so timings would be void); out and d_x
 * finite; a forward+backward of set 0, then of set 1, then of set 0 again
 * gives bitwise the same out, d_x, d_rw and weight gradients (hashes).
 * The JSON is rewritten after every configuration.
 */
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>

/* the layer, its buffers, the chain and the hashes (shared with mok_bench_daemon --inproc-ab) */
#include "../harness/kernel_choices.h"
#include "bench_layer.h"

/* --memory (bench_pool.h): where the client's tensors live */
static bench_pool g_pool;

/* ---- one configuration ---------------------------------------------------------------- */

typedef struct result {
  int variant;           /* -1: the init's choice (no --variants); else index in the list */
  int same_as_first;     /* --variants: set 0's hash equals the first variant's */
  unsigned long long hash0;
  int ok, status, deterministic;
  unsigned long long nonfinite;
  double max_over_mean[N_SETS];
  int min_rows[N_SETS], max_rows[N_SETS];
  int routing_from_file;
  float fwd_ms, bwd_ms, fwd_part[FWD_STEPS], bwd_part[BWD_STEPS];
  double flops_fwd, mem_gib;
  double ws_bytes; /* the path's workspace (fp8: with the quantised token and routed rows) */
} result;

/* A path to time: the GEMM backend and, on the Hopper one, the tile variant
 * (pp_pairs: its ping-pong down dgrad in 2-CTA clusters or not). */
typedef struct bench_path {
  const char *name;
  int backend, variant, pp_pairs, pipe;
  int cg_choice; /* what the cutlass variant runs on CUTLASS (mok_k_sm90_set_cutlass_choice) */
  int fp8; /* the fp8 layer (docs/math.md "FP8") on the init's bf16 kernels */
  int gathering; /* NAME-gx: mokd's chain, the gate/up producer gathering x (bench_layer.h) */
  char label[32]; /* the name as given */
} bench_path;

static int g_band; /* --band */

static layer *g_layer; /* run_config's, for select_path's fp8 switch */

static int select_path(const bench_path *bp) {
  if (g_layer) g_layer->fp8 = bp->fp8;
  if (g_layer) g_layer->gathering = bp->gathering;
  mok_k_sm90_set_gather_a(bp->gathering);
  if (bp->fp8 && !(g_layer && g_layer->ws8)) return 0;
  if (mok_k_set_gemm_backend(bp->backend) != bp->backend) return 0;
  mok_k_sm90_set_pp_pairs(bp->pp_pairs);
  mok_k_sm90_set_cutlass_choice(bp->cg_choice);
  mok_k_sm90_set_tuning(bp->pipe, g_band, 0, 0);
  return bp->backend != MOK_K_GEMM_SM90 || mok_k_sm90_set_variant(bp->variant) == MOK_OK;
}

#define MAX_PATHS 6 /* --variants: paths a run compares */

/* One configuration on each path (n_paths results in res[]; paths NULL:
 * the init's choice, one result). */
static void run_config(const config *c, const char *routing_dir, int reps, int warmup,
                       const bench_path *paths, int n_paths, cudaStream_t st, result *res) {
  const bench_shape *sh = &SHAPES[c->shape];
  mok_k_dims d;
  layer_dims(c, &d);
  char err[256];
  const int n_res = paths ? n_paths : 1;
  const int init_variant = mok_k_sm90_variant();
  memset(res, 0, sizeof *res * (size_t)n_res);
  for (int v = 0; v < n_res; v++) res[v].variant = paths ? v : -1;
  if (mok_k_check_dims(&d, err, sizeof err) != MOK_OK) {
    fprintf(stderr, "%s: %s\n", sh->name, err);
    for (int v = 0; v < n_res; v++) res[v].status = -1;
    return;
  }
  layer L;
  layer_alloc(&L, &d, &g_pool, NULL);
  g_layer = &L;
  for (int v = 0; paths && v < n_paths; v++)
    if (paths[v].fp8 && mok_k_fp8_supported(&d) && !L.ws8) layer_add_fp8(&L);

  const size_t TK = (size_t)d.T * d.K;
  int32_t *ids = (int32_t *)malloc(TK * 4);
  float *rw = (float *)malloc(TK * 4);
  int from_file = 1;
  double mom[N_SETS];
  int min_rows[N_SETS], max_rows[N_SETS];
  rng_state = 0x1234567ull + (uint64_t)c->shape * 1000003ull + (uint64_t)c->T * 7ull +
              (uint64_t)c->skewed;
  for (int s = 0; s < N_SETS; s++) {
    if (!load_routing(routing_dir, c, s, d.T, d.E_loc, d.K, ids, rw, &mom[s], &min_rows[s],
                      &max_rows[s]))
      from_file = 0;
    CUDA_CHECK(cudaMemcpy(L.ids[s], ids, TK * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(L.rw[s], rw, TK * 4, cudaMemcpyHostToDevice));
  }
  free(ids);
  free(rw);
  CUDA_CHECK(cudaDeviceSynchronize());

  cudaEvent_t ev[FWD_STEPS + 1];
  for (int i = 0; i <= FWD_STEPS; i++) CUDA_CHECK(cudaEventCreate(&ev[i]));
  /* the paths take turns rep by rep (path 0, 1, ..., 0, 1, ...), so a
   * drift of the clocks (power, heat) over the run weighs on all of them
   * alike instead of on whichever ran last */
  float *tf = (float *)malloc(sizeof(float) * n_res * reps * (FWD_STEPS + 1));
  float *tb = (float *)malloc(sizeof(float) * n_res * reps * (BWD_STEPS + 1));
  float *col = (float *)malloc(sizeof(float) * reps);
  int usable[MAX_PATHS];

  for (int v = 0; v < n_res; v++) {
    result *r = &res[v];
    r->mem_gib = L.bytes / 1073741824.0;
    const double R = (double)L.R, TH = (double)d.T * d.H;
    r->ws_bytes = paths && paths[v].fp8
                      ? (double)mok_k_fp8_workspace_bytes(&d) + (TH + R * d.H) * (1.0 + 4.0 / 128)
                      : (double)mok_k_workspace_bytes(&d);
    r->routing_from_file = from_file;
    for (int s = 0; s < N_SETS; s++) {
      r->max_over_mean[s] = mom[s];
      r->min_rows[s] = min_rows[s];
      r->max_rows[s] = max_rows[s];
    }
    r->flops_fwd = 6.0 * (double)d.T * d.K * d.H * d.I + 6.0 * (double)d.T * d.H * d.I_s;
    usable[v] = !paths || select_path(&paths[v]);
    if (!usable[v]) {
      fprintf(stderr, "%s: path %s not available on this device\n", sh->name, paths[v].name);
      r->status = -2;
    }
  }
  for (int i = 0; i < warmup + reps; i++)
    for (int v = 0; v < n_res; v++) {
      if (!usable[v] || (paths && !select_path(&paths[v]))) continue;
      enqueue_forward(&L, i % N_SETS, ev, st);
      CUDA_CHECK(cudaEventSynchronize(ev[FWD_STEPS]));
      if (i < warmup) continue;
      float *row = tf + ((size_t)v * reps + (i - warmup)) * (FWD_STEPS + 1);
      CUDA_CHECK(cudaEventElapsedTime(&row[FWD_STEPS], ev[0], ev[FWD_STEPS]));
      for (int k = 0; k < FWD_STEPS; k++)
        CUDA_CHECK(cudaEventElapsedTime(&row[k], ev[k], ev[k + 1]));
    }
  for (int i = 0; i < warmup + reps; i++)
    for (int v = 0; v < n_res; v++) {
      if (!usable[v] || (paths && !select_path(&paths[v]))) continue;
      enqueue_forward(&L, i % N_SETS, NULL, st);
      enqueue_backward(&L, i % N_SETS, ev, st);
      CUDA_CHECK(cudaEventSynchronize(ev[BWD_STEPS]));
      if (i < warmup) continue;
      float *row = tb + ((size_t)v * reps + (i - warmup)) * (BWD_STEPS + 1);
      CUDA_CHECK(cudaEventElapsedTime(&row[BWD_STEPS], ev[0], ev[BWD_STEPS]));
      for (int k = 0; k < BWD_STEPS; k++)
        CUDA_CHECK(cudaEventElapsedTime(&row[k], ev[k], ev[k + 1]));
    }
  for (int v = 0; v < n_res; v++) {
    result *r = &res[v];
    if (!usable[v] || (paths && !select_path(&paths[v]))) continue;
    const float *tfv = tf + (size_t)v * reps * (FWD_STEPS + 1);
    const float *tbv = tb + (size_t)v * reps * (BWD_STEPS + 1);
    for (int k = 0; k <= FWD_STEPS; k++) {
      for (int i = 0; i < reps; i++) col[i] = tfv[(size_t)i * (FWD_STEPS + 1) + k];
      float m = median_of(col, reps);
      if (k == FWD_STEPS) r->fwd_ms = m;
      else r->fwd_part[k] = m;
    }
    for (int k = 0; k <= BWD_STEPS; k++) {
      for (int i = 0; i < reps; i++) col[i] = tbv[(size_t)i * (BWD_STEPS + 1) + k];
      float m = median_of(col, reps);
      if (k == BWD_STEPS) r->bwd_ms = m;
      else r->bwd_part[k] = m;
    }
    r->status = read_status(&L, st);
    r->nonfinite = dev_nonfinite(&L, L.out, (size_t)d.T * d.H, st) +
                   dev_nonfinite(&L, L.d_x, (size_t)d.T * d.H, st);
    unsigned long long h0 = chain_hash(&L, 0, st);
    (void)chain_hash(&L, 1, st);
    unsigned long long h2 = chain_hash(&L, 0, st);
    r->hash0 = h0;
    r->deterministic = h0 == h2;
    /* every bf16 path equals the first path; every fp8 path the first fp8 one
     * (fp8 on mok's kernels or on CUTLASS: the same arithmetic) */
    int first = 0;
    while (paths && first < v && paths[first].fp8 != paths[v].fp8) first++;
    r->same_as_first = first == v || h0 == res[first].hash0;
    if (r->status == 0) r->status = read_status(&L, st);
    r->ok = r->status == 0 && r->nonfinite == 0 && r->deterministic && r->same_as_first;
  }
  if (paths) { /* back to the init's choice */
    mok_k_set_gemm_backend(MOK_K_GEMM_AUTO);
    mok_k_sm90_set_variant(init_variant);
    mok_k_sm90_set_pp_pairs(1);
    mok_k_sm90_set_tuning(0, g_band, 0, 0);
  }
  L.fp8 = 0;
  L.gathering = 0;
  mok_k_sm90_set_gather_a(-1); /* the default */
  g_layer = NULL;
  free(col);
  free(tf);
  free(tb);
  for (int i = 0; i <= FWD_STEPS; i++) CUDA_CHECK(cudaEventDestroy(ev[i]));
  layer_free(&L);
}

/* ---- output ------------------------------------------------------------------------------- */


typedef struct run_doc {
  const char *path;
  char device[256];
  int sms, reps, warmup;
  config cfg[64];
  result res[64][MAX_PATHS];
  int done[64];
  int n;
  int skipped[64];
  bench_path paths[MAX_PATHS]; /* --variants */
  int n_paths;                 /* 0: the init's choice */
} run_doc;

/* what ran: the --variants path, or the backend and variant mok_k_init chose */
static const char *path_name(const run_doc *D, const result *r) {
  if (r->variant >= 0) return D->paths[r->variant].name;
  return mok_k_gemm_backend() == MOK_K_GEMM_HMMA ? "hmma"
                                                 : mok_k_sm90_variant_name(mok_k_sm90_variant());
}

static void write_json(const run_doc *D) {
  if (!D->path) return;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp", D->path);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    perror(tmp);
    return;
  }
  fprintf(f, "{\n \"tool\": \"mok_bench\",\n \"device\": \"%s\",\n \"sms\": %d,\n", D->device,
          D->sms);
  fprintf(f, " \"reps\": %d,\n \"warmup\": %d,\n \"row_align\": %d,\n", D->reps, D->warmup,
          mok_k_row_align());
  fprintf(f, " \"daemon_note\": \"in-process; the through-the-daemon column comes from "
             "mok_bench_daemon (run_bench.sh)\",\n");
  fprintf(f, " \"kernels\": \"backend %s (mma.sync, or the Hopper wgmma/TMA kernels in the tile "
             "variant of each result)\",\n \"results\": [",
          mok_k_gemm_backend() == MOK_K_GEMM_HMMA ? "hmma" : "sm90");
  int first = 1;
  for (int i = 0; i < D->n; i++) {
    if (!D->done[i]) continue;
    for (int v = 0; v < (D->n_paths ? D->n_paths : 1); v++) {
      const config *c = &D->cfg[i];
      const result *r = &D->res[i][v];
      const bench_shape *sh = &SHAPES[c->shape];
      fprintf(f, "%s\n  {\"shape\": \"%s\", \"T\": %d, \"routing\": \"%s\", \"E\": %d, \"E_loc\": %d, "
                 "\"H\": %d, \"I\": %d, \"K\": %d, \"I_s\": %d, \"variant\": \"%s\",\n",
              first ? "" : ",", sh->name, c->T, c->skewed ? "skewed" : "balanced", sh->E, sh->E / EP,
              sh->H, sh->I, sh->K, sh->I, path_name(D, r));
      first = 0;
      fprintf(f, "   \"ok\": %s, \"status\": %d, \"deterministic\": %s, \"same_as_first_variant\": %s, "
                 "\"nonfinite\": %llu, \"hash0\": \"%016llx\", \"routing_from_file\": %s, "
                 "\"mem_gib\": %.2f, \"ws_bytes\": %.0f,\n",
              r->ok ? "true" : "false", r->status, r->deterministic ? "true" : "false",
              r->same_as_first ? "true" : "false", r->nonfinite, r->hash0,
              r->routing_from_file ? "true" : "false", r->mem_gib, r->ws_bytes);
      fprintf(f, "   \"max_over_mean\": [%.3f, %.3f], \"min_max_rows\": [[%d, %d], [%d, %d]],\n",
              r->max_over_mean[0], r->max_over_mean[1], r->min_rows[0], r->max_rows[0],
              r->min_rows[1], r->max_rows[1]);
      fprintf(f, "   \"flops_fwd\": %.6e, \"flops_bwd\": %.6e, \"fwd_ms\": %.4f, \"bwd_ms\": %.4f, "
                 "\"fwd_tflops\": %.2f, \"bwd_tflops\": %.2f,\n",
              r->flops_fwd, 2 * r->flops_fwd, r->fwd_ms, r->bwd_ms, r->flops_fwd / r->fwd_ms * 1e-9,
              2 * r->flops_fwd / r->bwd_ms * 1e-9);
      fprintf(f, "   \"fwd_parts_ms\": {");
      for (int k = 0; k < FWD_STEPS; k++)
        fprintf(f, "%s\"%s\": %.4f", k ? ", " : "", FWD_NAMES[k], r->fwd_part[k]);
      fprintf(f, "},\n   \"bwd_parts_ms\": {");
      for (int k = 0; k < BWD_STEPS; k++)
        fprintf(f, "%s\"%s\": %.4f", k ? ", " : "", BWD_NAMES[k], r->bwd_part[k]);
      fprintf(f, "}}");
    }
  }
  fprintf(f, "\n ],\n \"skipped\": [");
  first = 1;
  for (int i = 0; i < D->n; i++) {
    if (!D->skipped[i]) continue;
    fprintf(f, "%s[\"%s\", %d, \"%s\"]", first ? "" : ", ", SHAPES[D->cfg[i].shape].name,
            D->cfg[i].T, D->cfg[i].skewed ? "skewed" : "balanced");
    first = 0;
  }
  fprintf(f, "]\n}\n");
  fclose(f);
  if (rename(tmp, D->path) != 0) perror("rename");
}

static void usage(const char *a0) {
  fprintf(stderr,
          "usage: %s [--out FILE.json] [--routing-dir DIR] [--T 2048,8192] [--reps N] "
          "[--warmup N] [--deadline S] [--only NAME[,NAME]] "
          "[--variants rows,expert,cluster,pingpong,pingpong-plain,pingpong-pipe,quad,cutlass,cutlass-every,cutlass-every-pp,hmma][-gx] "
          "[--routing balanced|skewed|both] [--memory own|pool|ipc|ipc-touched|vmm|vmm-ipc] [--pool-gib N] "
          "[--band N]\n",
          a0);
}

int main(int argc, char **argv) {
  static run_doc D;
  const char *routing_dir = NULL, *only = NULL, *tlist = "2048,8192", *variants = NULL;
  const char *routing = "both", *memory = "own";
  double deadline = 1e9, pool_gib = 48;
  int band = 0;
  D.reps = 10;
  D.warmup = 3;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--version")) {
      printf("mok_bench 2\n");
      return 0;
    } else if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(argv[0]);
      return 0;
    } else if (!v) {
      usage(argv[0]);
      return 2;
    } else if (!strcmp(a, "--out")) D.path = v;
    else if (!strcmp(a, "--routing-dir")) routing_dir = v;
    else if (!strcmp(a, "--T")) tlist = v;
    else if (!strcmp(a, "--reps")) D.reps = atoi(v);
    else if (!strcmp(a, "--warmup")) D.warmup = atoi(v);
    else if (!strcmp(a, "--deadline")) deadline = atof(v);
    else if (!strcmp(a, "--only")) only = v;
    else if (!strcmp(a, "--variants")) variants = v;
    else if (!strcmp(a, "--routing")) routing = v;
    else if (!strcmp(a, "--memory")) memory = v;
    else if (!strcmp(a, "--pool-gib")) pool_gib = atof(v);
    else if (!strcmp(a, "--band")) band = atoi(v);
    else {
      usage(argv[0]);
      return 2;
    }
    i++;
  }
  /* the row-mode tile order in bands of N row blocks (column tiles outer
   * within a band; 0: row by row): a tuning sweep, results never depend on it */
  g_band = band > 0 ? band : 0;
  if (band > 0) mok_k_sm90_set_tuning(0, band, 0, 0);
  if (D.reps < 1 || D.warmup < 0 || band < 0 ||
      (strcmp(routing, "both") && strcmp(routing, "balanced") && strcmp(routing, "skewed"))) {
    usage(argv[0]);
    return 2;
  }
  for (const char *at = variants; at && *at;) { /* names: the Hopper variants, or hmma */
    const size_t len = strcspn(at, ",");
    char one[32];
    snprintf(one, sizeof one, "%.*s", (int)(len < sizeof one ? len : sizeof one - 1), at);
    char label[32];
    snprintf(label, sizeof label, "%s", one);
    const size_t ol = strlen(one);
    const int gx = ol > 3 && !strcmp(one + ol - 3, "-gx");
    if (gx) one[ol - 3] = '\0';
    /* pingpong-plain: the pingpong variant with its down dgrad on plain CTAs;
     * pingpong-pipe: with one wgmma batch kept in flight in the k loops */
    const int plain = !strcmp(one, "pingpong-plain"), piped = !strcmp(one, "pingpong-pipe");
    /* fp8: the fp8 layer on the default variant (its products on CUTLASS where
     * the launch table says); fp8-pingpong: on mok's own FP8 kernels */
    const int fp8_pp = !strcmp(one, "fp8-pingpong"), fp8 = fp8_pp || !strcmp(one, "fp8");
    /* cutlass-every: the cutlass variant with every product that has a CUTLASS
     * configuration on it, whatever the rows; cutlass-every-pp: on the ping-pong ones */
    const int cg_wg = !strcmp(one, "cutlass-every"), cg_pp = !strcmp(one, "cutlass-every-pp");
    const int sv = plain || piped ? MOK_K_SM90_PINGPONG
                   : cg_pp || cg_wg ? MOK_K_SM90_CUTLASS
                   : fp8_pp       ? MOK_K_SM90_PINGPONG
                   : fp8          ? mok_k_sm90_variant()
                                  : mok_k_sm90_variant_parse(one);
    if ((sv < 0 && strcmp(one, "hmma")) || D.n_paths == MAX_PATHS) {
      fprintf(stderr, "mok_bench: --variants: unknown '%s' (rows, expert, cluster, pingpong, pingpong-plain, pingpong-pipe, quad, cutlass, cutlass-every, cutlass-every-pp, hmma, fp8, fp8-pingpong; at most %d)\n",
              one, MAX_PATHS);
      return 2;
    }
    bench_path *bp = &D.paths[D.n_paths++];
    bp->fp8 = fp8;
    bp->name = fp8_pp  ? "fp8-pingpong"
               : fp8   ? "fp8"
               : plain ? "pingpong-plain"
               : piped ? "pingpong-pipe"
               : cg_pp ? "cutlass-every-pp"
               : cg_wg ? "cutlass-every"
               : sv >= 0 ? mok_k_sm90_variant_name(sv)
                         : "hmma";
    bp->gathering = gx;
    if (gx) {
      snprintf(bp->label, sizeof bp->label, "%s", label);
      bp->name = bp->label;
    }
    bp->pp_pairs = !plain;
    bp->pipe = piped;
    bp->cg_choice = cg_pp   ? MOK_K_CUTLASS_EVERY_PP
                    : cg_wg ? MOK_K_CUTLASS_EVERY
                            : MOK_K_CUTLASS_TABLE;
    bp->backend = sv >= 0 ? MOK_K_GEMM_SM90 : MOK_K_GEMM_HMMA;
    bp->variant = sv >= 0 ? sv : MOK_K_SM90_ROWS;
    at += len + (at[len] == ',');
  }
  int ts[8], nts = 0;
  for (const char *p = tlist; *p && nts < 8;) {
    int t = atoi(p);
    if (t > 0) ts[nts++] = t;
    const char *comma = strchr(p, ',');
    if (!comma) break;
    p = comma + 1;
  }
  const int pool_kind = bench_pool_kind(memory);
  if (pool_kind < 0 || pool_gib <= 0) {
    fprintf(stderr, "mok_bench: --memory: unknown '%s' (own, pool, ipc, ipc-touched, vmm, vmm-ipc)\n", memory);
    return 2;
  }
  bench_pool_start(&g_pool, pool_kind, (size_t)(pool_gib * 1073741824.0)); /* before any CUDA */
  const double t0 = now_s();
  CUDA_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  snprintf(D.device, sizeof D.device, "%s", prop.name);
  D.sms = prop.multiProcessorCount;
  MOK_CHECK(kernel_init_from_env());
  printf("mok_bench: %s, sm_%d%d, %d SMs; GEMM backend %s, variant %s, %d 2-CTA clusters%s%s\n",
         prop.name, prop.major, prop.minor, prop.multiProcessorCount,
         mok_k_gemm_backend() == MOK_K_GEMM_HMMA ? "mma.sync" : "sm90",
         mok_k_sm90_variant_name(mok_k_sm90_variant()), mok_k_sm90_pair_clusters(),
         variants ? "; sweeping " : "", variants ? variants : "");
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  D.n = make_plan(ts, nts, D.cfg);
  int failures = 0;
  for (int i = 0; i < D.n; i++) {
    const config *c = &D.cfg[i];
    const bench_shape *sh = &SHAPES[c->shape];
    if (only) {
      const char *hit = strstr(only, sh->name);
      if (!hit) continue;
    }
    if ((!strcmp(routing, "balanced") && c->skewed) || (!strcmp(routing, "skewed") && !c->skewed))
      continue;
    if (now_s() - t0 > deadline) {
      D.skipped[i] = 1;
      printf("skip %s T=%d %s (deadline)\n", sh->name, c->T, c->skewed ? "skewed" : "balanced");
      write_json(&D);
      continue;
    }
    run_config(c, routing_dir, D.reps, D.warmup, D.n_paths ? D.paths : NULL, D.n_paths, st,
               D.res[i]);
    D.done[i] = 1;
    for (int v = 0; v < (D.n_paths ? D.n_paths : 1); v++) {
      const result *r = &D.res[i][v];
      failures += !r->ok;
      printf("%-16s T=%-5d %-8s %-7s max/mean %.2f/%.2f  fwd %8.3f ms %6.1f TF/s  bwd %8.3f ms "
             "%6.1f TF/s  status %d det %s same %s nonfinite %llu%s\n",
             sh->name, c->T, c->skewed ? "skewed" : "balanced", path_name(&D, r),
             r->max_over_mean[0], r->max_over_mean[1], r->fwd_ms, r->flops_fwd / r->fwd_ms * 1e-9,
             r->bwd_ms, 2 * r->flops_fwd / r->bwd_ms * 1e-9, r->status,
             r->deterministic ? "yes" : "NO", r->same_as_first ? "yes" : "NO", r->nonfinite,
             r->routing_from_file ? "" : " (own routing)");
      printf("    fwd parts:");
      for (int k = 0; k < FWD_STEPS; k++) printf(" %s %.3f", FWD_NAMES[k], r->fwd_part[k]);
      printf("\n    bwd parts:");
      for (int k = 0; k < BWD_STEPS; k++) printf(" %s %.3f", BWD_NAMES[k], r->bwd_part[k]);
      printf("\n");
    }
    fflush(stdout);
    write_json(&D);
  }
  CUDA_CHECK(cudaStreamDestroy(st));
  bench_pool_stop(&g_pool);
  printf("mok_bench: %.1f s, %d configuration(s) failed a check\n", now_s() - t0, failures);
  return failures ? 1 : 0;
}
