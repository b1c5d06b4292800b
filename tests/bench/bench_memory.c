/* SPDX-License-Identifier: Apache-2.0 */
/* mokd's device memory for a session of L layers of one shape (docs/cuda.md,
 * "Workspaces").
 *
 *   bench_memory MOKD_PID SHAPE T L[,L...]      SHAPE: kimi | deepseek
 *
 * For each L: a new session creates L layers (max_tokens T) of the shape's
 * per-GPU slice (E_loc = 48 local experts, shared expert I_s = I) and runs
 * one forward (saving its ctx) and one backward per layer; then mokd's
 * device memory is read, the session closes and, after mokd's idle turn,
 * read again. All layers use the same client tensors (mokd's memory is what
 * is measured). Two readings of mokd's memory:
 *   nvidia-smi  mokd's used_memory (--query-compute-apps; not under MPS)
 *   device      cudaMemGetInfo's used bytes (the client allocates nothing
 *               meanwhile, so the change is mokd's)
 * both above their values before the first session. The target is one
 * workspace (mok__cuda_job_space of the layer's largest job here, with the
 * engine's headroom) plus 1 MiB per layer. Prints one row per L.
 *
 * mokd must run with MOK_WORKSPACE_IDLE_MS small (the script sets 500).
 */
#ifdef MOK_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/internal.h"
#include "mok.h"
#include "harness/check_client.h"


typedef struct bshape {
  const char *name;
  int E_loc, H, I, K, I_s;
} bshape;
static const bshape bshapes[] = {
    {"kimi", 48, 7168, 2048, 8, 2048},     /* kimi-k2.7, E = 384 over 8 ranks */
    {"deepseek", 48, 7168, 3072, 6, 3072}, /* deepseek-v4-pro, E = 384 over 8 ranks */
};

static double mib(double b) { return b / (1024.0 * 1024.0); }

/* mokd's used_memory in MiB as nvidia-smi reports it (-1: not listed) */
static double smi_mib(int pid) {
  FILE *f = popen("nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits "
                  "2>/dev/null",
                  "r");
  if (!f) return -1;
  char line[256];
  double v = -1;
  while (fgets(line, sizeof line, f)) {
    int p = 0;
    double m = 0;
    if (sscanf(line, "%d, %lf", &p, &m) == 2 && p == pid) v = m;
  }
  pclose(f);
  return v;
}

static double device_used(void) {
  size_t fr = 0, tot = 0;
  CK(cudaMemGetInfo(&fr, &tot));
  return (double)(tot - fr);
}

/* a device buffer of random bf16 (a 4 MiB host block tiled) */
static void *dev_bf16(size_t bytes, double scale) {
  void *p = NULL;
  CK(cudaMalloc(&p, bytes));
  size_t blk = (size_t)4 << 20;
  if (blk > bytes) blk = bytes;
  uint16_t *h = malloc(blk);
  uint32_t s = 12345;
  for (size_t i = 0; i < blk / 2; i++) {
    s = s * 1664525u + 1013904223u;
    float v = (float)((double)(s >> 8) / 16777216.0 * 2.0 - 1.0) * (float)scale;
    uint32_t u;
    memcpy(&u, &v, 4);
    h[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  CK(cudaMemcpy(p, h, blk, cudaMemcpyHostToDevice));
  for (size_t at = blk; at < bytes; at += blk)
    CK(cudaMemcpy((char *)p + at, p, bytes - at < blk ? bytes - at : blk,
                  cudaMemcpyDeviceToDevice));
  free(h);
  return p;
}

int main(int argc, char **argv) {
  if (argc < 5) {
    fprintf(stderr, "usage: bench_memory MOKD_PID kimi|deepseek T L[,L...]\n");
    return 2;
  }
  int pid = atoi(argv[1]);
  const bshape *b = NULL;
  for (size_t i = 0; i < sizeof bshapes / sizeof bshapes[0]; i++)
    if (strcmp(argv[2], bshapes[i].name) == 0) b = &bshapes[i];
  if (!b) {
    fprintf(stderr, "unknown shape %s\n", argv[2]);
    return 2;
  }
  const int T = atoi(argv[3]);
  CK(cudaSetDevice(0));
  CK(cudaFree(NULL));
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  /* the client's tensors, shared by every layer */
  const size_t H = (size_t)b->H, I = (size_t)b->I, E = (size_t)b->E_loc, K = (size_t)b->K,
               I_s = (size_t)b->I_s, TH = (size_t)T * H, TK = (size_t)T * K;
  mok_layer_config cfg = {.hidden = b->H, .intermediate = b->I, .experts = b->E_loc,
                          .local_experts = b->E_loc, .topk = b->K,
                          .shared_intermediate = b->I_s, .max_tokens = (uint32_t)T,
                          .dtype = MOK_DTYPE_BF16, .row_align = 128};
  mok_layout_dims ld = mok_layer_dims(&cfg, (uint32_t)T);
  size_t ctx_bytes = (size_t)mok_ctx_bytes(&ld);
  void *x = dev_bf16(TH * 2, 1.0), *d_out = dev_bf16(TH * 2, 1.0);
  void *wg = dev_bf16(E * I * H * 2, 4.0 / sqrt((double)H));
  void *wu = dev_bf16(E * I * H * 2, 4.0 / sqrt((double)H));
  void *wd = dev_bf16(E * H * I * 2, 3.0 / sqrt((double)I));
  void *sg = dev_bf16(I_s * H * 2, 4.0 / sqrt((double)H));
  void *su = dev_bf16(I_s * H * 2, 4.0 / sqrt((double)H));
  void *sd = dev_bf16(H * I_s * 2, 3.0 / sqrt((double)I_s));
  void *out, *ctx, *d_x, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd;
  int32_t *ids;
  float *rw, *drw;
  CK(cudaMalloc(&out, TH * 2));
  CK(cudaMalloc(&d_x, TH * 2));
  CK(cudaMalloc(&ctx, ctx_bytes));
  CK(cudaMalloc(&dwg, E * I * H * 2));
  CK(cudaMalloc(&dwu, E * I * H * 2));
  CK(cudaMalloc(&dwd, E * H * I * 2));
  CK(cudaMalloc(&dsg, I_s * H * 2));
  CK(cudaMalloc(&dsu, I_s * H * 2));
  CK(cudaMalloc(&dsd, H * I_s * 2));
  CK(cudaMalloc((void **)&ids, TK * 4));
  CK(cudaMalloc((void **)&rw, TK * 4));
  CK(cudaMalloc((void **)&drw, TK * 4));
  int32_t *hids = malloc(TK * 4);
  float *hrw = malloc(TK * 4);
  for (size_t t = 0; t < (size_t)T; t++) /* balanced: K distinct experts per token */
    for (size_t k = 0; k < K; k++) {
      hids[t * K + k] = (int32_t)((t * 7 + k * (E / K)) % E);
      hrw[t * K + k] = 1.0f / (float)K;
    }
  CK(cudaMemcpy(ids, hids, TK * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(rw, hrw, TK * 4, cudaMemcpyHostToDevice));
  free(hids), free(hrw);
  CK(cudaDeviceSynchronize());

  /* what the engine's workspace should be: the larger of the two jobs, with
   * its headroom (none past the layer's need at max_tokens, here T) */
  size_t need = mok__cuda_job_space(&cfg, (uint32_t)T, MOK_OP_BACKWARD, 0, true, false, NULL, NULL);
  size_t need_f =
      mok__cuda_job_space(&cfg, (uint32_t)T, MOK_OP_FORWARD, 0, true, false, NULL, NULL);
  if (need_f > need) need = need_f;
  double ws_mib = mib((double)mok__cuda_ws_roomy(need, need));

  sleep(2);
  double smi0 = smi_mib(pid), dev0 = device_used();
  printf("%-9s %5s %4s %12s %12s %12s %12s %14s %8s\n", "shape", "T", "L", "smi MiB", "device MiB",
         "target MiB", "per layer", "after close", "ms/layer");
  char *list = strdup(argv[4]);
  double smi1 = 0;
  int L1 = 0, rc = 0;
  for (char *tok = strtok(list, ","); tok; tok = strtok(NULL, ",")) {
    int L = atoi(tok);
    mok_client *c;
    MK(mok_connect(NULL, "bench_memory", &c));
    mok_layer **layers = calloc((size_t)L, sizeof *layers);
    mok_layer_desc d = {.hidden = b->H, .intermediate = b->I, .experts = b->E_loc,
                        .topk = b->K, .shared_intermediate = b->I_s,
                        .max_tokens = (uint32_t)T, .dtype = MOK_DTYPE_BF16};
    for (int l = 0; l < L; l++) MK(mok_layer_create(c, &d, &layers[l]));
    mok_forward_args fa = {.x = x, .w_gate = wg, .w_up = wu, .w_down = wd, .s_gate = sg,
                           .s_up = su, .s_down = sd, .topk_ids = ids, .router_weights = rw,
                           .out = out, .ctx = ctx};
    mok_backward_args ba = {.x = x, .w_gate = wg, .w_up = wu, .w_down = wd, .s_gate = sg,
                            .s_up = su, .s_down = sd, .d_out = d_out, .topk_ids = ids,
                            .router_weights = rw, .ctx = ctx, .d_x = d_x, .d_w_gate = dwg,
                            .d_w_up = dwu, .d_w_down = dwd, .d_s_gate = dsg, .d_s_up = dsu,
                            .d_s_down = dsd, .d_router_weights = drw};
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    CK(cudaEventRecord(e0, st));
    for (int l = 0; l < L; l++) {
      MK(mok_forward_on_stream(layers[l], (uint32_t)T, &fa, st, NULL));
      MK(mok_backward_on_stream(layers[l], (uint32_t)T, 0, &ba, st, NULL));
    }
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    int err = mok_sync(c, 600000);
    if (err != MOK_OK) {
      printf("L=%d: a job failed: %s\n", L, mok_last_error());
      rc = 1;
    }
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    double smi = smi_mib(pid) - smi0, dev = mib(device_used() - dev0);
    if (!L1) L1 = L, smi1 = smi;
    for (int l = 0; l < L; l++) mok_layer_destroy(layers[l]);
    free(layers);
    mok_close(c);
    sleep(4); /* the session's workspace went at close; the pool is trimmed in mokd's idle turn */
    double after = mib(device_used() - dev0);
    double per = L > L1 ? (smi - smi1) / (L - L1) : 0;
    printf("%-9s %5d %4d %12.0f %12.0f %12.0f %12.2f %14.0f %8.2f\n", b->name, T, L, smi, dev,
           ws_mib + L, per, after, ms / L);
    fflush(stdout);
    if (dev > ws_mib + L + 64) rc = 1; /* 64 MiB for the pool's granularity */
    cudaEventDestroy(e0), cudaEventDestroy(e1);
  }
  free(list);
  return rc;
}
#else
#include <stdio.h>
int main(void) {
  puts("bench_memory: built without CUDA");
  return 77;
}
#endif
