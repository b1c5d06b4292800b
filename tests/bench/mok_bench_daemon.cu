/* SPDX-License-Identifier: Apache-2.0 */
/* mok_bench_daemon: the benchmark shapes (docs/design.md) through mokd (--engine cuda) and libmok,
 * the "through the daemon" column of tests/bench/run_bench.sh.
 *
 *   MOK_SOCKET=... mok_bench_daemon [--out FILE.json] [--routing-dir DIR] [--T 2048,8192]
 *                                   [--reps N] [--warmup N] [--deadline S] [--only NAMES]
 *                                   [--piped 1]   (also jobs back to back: the client ahead)
 *                                   [--memory cudamalloc|cudamalloc-unrounded|vmm]
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
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mok.h"
#include "bench_common.h"
#include "bench_pool.h"



/* --memory vmm: the client pool is cuMemCreate memory (2 MiB pages) */
static int g_vmm;
/* --memory cudamalloc (the default) rounds the pool up to whole 2 MiB pages, as
 * PyTorch's caching allocator rounds its segments; cudamalloc-unrounded does
 * not, and mokd's IPC mapping of such an allocation runs the layer up to 25 %
 * slower (docs/cuda.md, "The daemon boundary, measured") */
static int g_round_2m = 1;

#define N_SETS 2
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
  double flops_fwd, max_over_mean[N_SETS];
  char error[256];
} dres;

static int fail(dres *r, const char *what, int st) {
  snprintf(r->error, sizeof r->error, "%s: %s (%s)", what, mok_status_name(st), mok_last_error());
  fprintf(stderr, "mok_bench_daemon: %s\n", r->error);
  return 0;
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
  for (int i = 0; ok && i < warmup + reps; i++) {
    const int s = i % N_SETS;
    CUDA_CHECK(cudaEventRecord(e0, st));
    if ((st_ = mok_forward_on_stream(l, T, &fa[s], st, NULL)) != MOK_OK)
      ok = fail(r, "mok_forward_on_stream", st_);
    CUDA_CHECK(cudaEventRecord(e1, st));
    CUDA_CHECK(cudaEventSynchronize(e1));
    if (i >= warmup) CUDA_CHECK(cudaEventElapsedTime(&tf[i - warmup], e0, e1));
  }
  for (int i = 0; ok && i < warmup + reps; i++) {
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
  free(tf);
  free(tb);
  CUDA_CHECK(cudaEventDestroy(e0));
  CUDA_CHECK(cudaEventDestroy(e1));
  mok_layer_destroy(l);
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

static void write_json(const char *path, const char *engine, const char *device, int mps,
                       const config *cfg, const dres *res, int n, const char *note) {
  if (!path) return;
  char tmp[1100];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    perror(tmp);
    return;
  }
  fprintf(f, "{\n \"tool\": \"mok_bench_daemon\",\n \"engine\": \"%s\",\n \"device\": \"%s\",\n"
             " \"mps\": %s,\n \"note\": \"%s\",\n \"results\": [",
          engine, device, mps ? "true" : "false", note);
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

int main(int argc, char **argv) {
  const char *out = NULL, *routing_dir = NULL, *only = NULL, *tlist = "2048,8192";
  int reps = 10, warmup = 3, piped = 0;
  double deadline = 1e9;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--version")) {
      printf("mok_bench_daemon 1\n");
      return 0;
    }
    if (!v) {
      fprintf(stderr, "usage: %s [--out F] [--routing-dir D] [--T L] [--reps N] [--warmup N] "
                      "[--deadline S] [--only NAMES] [--piped 0|1] [--memory cudamalloc|cudamalloc-unrounded|vmm]\n", argv[0]);
      return 2;
    }
    if (!strcmp(a, "--out")) out = v;
    else if (!strcmp(a, "--routing-dir")) routing_dir = v;
    else if (!strcmp(a, "--T")) tlist = v;
    else if (!strcmp(a, "--reps")) reps = atoi(v);
    else if (!strcmp(a, "--warmup")) warmup = atoi(v);
    else if (!strcmp(a, "--deadline")) deadline = atof(v);
    else if (!strcmp(a, "--only")) only = v;
    else if (!strcmp(a, "--piped")) piped = atoi(v);
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
      return 2;
    }
    i++;
  }
  if (reps < 1 || warmup < 0) return 2;
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
    write_json(out, "none", "", mps, cfg, res, 0, "could not connect to mokd");
    return 3;
  }
  const char *engine = mok_client_engine(c), *device = mok_client_device(c);
  printf("mok_bench_daemon: mokd engine %s on %s%s\n", engine, device, mps ? " (MPS)" : "");
  if (strcmp(engine, "cuda") != 0) {
    write_json(out, engine, device, mps, cfg, res, 0, "mokd does not run the cuda engine");
    mok_close(c);
    return 3;
  }
  int failures = 0;
  for (int i = 0; i < n; i++) {
    const bench_shape *sh = &SHAPES[cfg[i].shape];
    if (only && !strstr(only, sh->name)) continue;
    if (now_s() - t0 > deadline) {
      printf("skip %s T=%d %s (deadline)\n", sh->name, cfg[i].T,
             cfg[i].skewed ? "skewed" : "balanced");
      continue;
    }
    int ok = run_config(c, &cfg[i], routing_dir, reps, warmup, piped, st, &res[i]);
    if (ok)
      printf("%-16s T=%-5d %-8s through mokd: fwd %8.3f ms %6.1f TF/s  bwd %8.3f ms %6.1f TF/s",
             sh->name, cfg[i].T, cfg[i].skewed ? "skewed" : "balanced", res[i].fwd_ms,
             res[i].flops_fwd / res[i].fwd_ms * 1e-9, res[i].bwd_ms,
             2 * res[i].flops_fwd / res[i].bwd_ms * 1e-9);
    if (ok && piped)
      printf("  piped: fwd %8.3f ms  bwd %8.3f ms", res[i].fwd_piped_ms, res[i].bwd_piped_ms);
    if (ok) printf("\n");
    fflush(stdout);
    write_json(out, engine, device, mps, cfg, res, n, "jobs on device pointers, on the client's stream");
    if (!ok) {
      failures++;
      break;
    }
  }
  mok_close(c);
  CUDA_CHECK(cudaStreamDestroy(st));
  printf("mok_bench_daemon: %.1f s, %d failure(s)\n", now_s() - t0, failures);
  return failures ? 1 : 0;
}
