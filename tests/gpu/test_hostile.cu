/* SPDX-License-Identifier: Apache-2.0 */
/* A hostile tenant against mokd's cuda engine (docs/cuda.md, "Copy, check, use").
 *
 *   test_hostile attacker SECONDS [host]
 *       A client that races its own buffers while its jobs run: a kernel on a
 *       side stream (host: a thread) keeps rewriting its topk_ids, its ctx
 *       (schedule and acts), its single-step schedule and acts - with random
 *       words, flipped bits, valid values nudged by one and the valid bytes
 *       again, in turn - while the main stream submits every kind of job
 *       (forward with ctx, backward from ctx, recompute, the six single
 *       steps). Jobs may fail (that is fine); mokd must not. Prints
 *       "attacker: races N jobs ok A failed F crashes C".
 *   test_hostile victim ROUNDS [HASH]
 *       A client with two layers of other shapes in one session (so one
 *       workspace serves both) running fixed jobs: forward + backward from
 *       ctx, recompute, and the single-step chain, each round hashing every
 *       output and ctx byte. Prints "victim: rounds R failed F mismatches M
 *       hash H" (mismatches: rounds whose hash differs from HASH, or from
 *       round 1 without HASH).
 *
 * $MOK_SOCKET names mokd. Exit status 0 when the figures are as they must
 * be: attacker crashes 0; victim failures 0 and mismatches 0.
 */
#include <math.h>
#include <pthread.h>

#include <atomic>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../harness/cuda_check.cuh"
#include "mok.h"
#include "../harness/check_client.h"


static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- a layer with every slot's buffer at T tokens ------------------------------------ */

typedef struct shape {
  int T, H, I, E, K, I_s;
} shape;

typedef struct tlayer {
  shape s;
  mok_client *c;
  mok_layer *l;
  int host;
  void *pool;
  void *p[MOK_SLOT_COUNT_];
  size_t bytes[MOK_SLOT_COUNT_];
} tlayer;

static size_t slot_bytes(const mok_layer *l, int T, int slot) {
  mok_tensor t = mok_tensor_for(l, (uint32_t)T, (uint32_t)slot, (void *)1);
  size_t n = mok_dtype_size(t.dtype);
  for (uint32_t i = 0; i < t.ndim; i++) n *= t.shape[i];
  return t.ndim ? n : 0;
}

static __host__ __device__ uint32_t mix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  return h ^ (h >> 16);
}

/* the inputs: bf16 from a hash, routing ids distinct per token (some dropped) */
static void fill_inputs(tlayer *L, uint32_t seed, cudaStream_t st) {
  const shape *s = &L->s;
  const int bf[] = {MOK_SLOT_X, MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN, MOK_SLOT_S_GATE,
                    MOK_SLOT_S_UP, MOK_SLOT_S_DOWN, MOK_SLOT_D_OUT};
  for (size_t i = 0; i < sizeof bf / sizeof bf[0]; i++) {
    int sl = bf[i];
    if (!L->bytes[sl]) continue;
    float scale = sl == MOK_SLOT_X || sl == MOK_SLOT_D_OUT ? 1.0f
                  : sl == MOK_SLOT_W_DOWN || sl == MOK_SLOT_S_DOWN ? 2.0f / sqrtf((float)s->I)
                                                                  : 2.0f / sqrtf((float)s->H);
    size_t n = L->bytes[sl] / 2;
    if (L->host) {
      uint16_t *d = NULL;
      CUDA_CHECK(cudaMalloc(&d, n * 2));
      fill_bf16<<<256, 256, 0, st>>>(d, n, seed + (uint32_t)sl * 7919u, scale);
      CUDA_CHECK(cudaMemcpyAsync(L->p[sl], d, n * 2, cudaMemcpyDeviceToHost, st));
      CUDA_CHECK(cudaStreamSynchronize(st));
      CUDA_CHECK(cudaFree(d));
    } else {
      fill_bf16<<<256, 256, 0, st>>>((uint16_t *)L->p[sl], n, seed + (uint32_t)sl * 7919u, scale);
    }
  }
  size_t TK = (size_t)s->T * s->K;
  int32_t *ids = (int32_t *)malloc(TK * 4);
  float *rw = (float *)malloc(TK * 4);
  for (int t = 0; t < s->T; t++)
    for (int k = 0; k < s->K; k++) {
      uint32_t h = mix(seed ^ (uint32_t)(t * 131 + k));
      int id = (int)((h + (uint32_t)k * (uint32_t)(s->E / s->K)) % (uint32_t)s->E);
      for (int j = 0; j < k; j++)
        if (ids[t * s->K + j] == id) id = (id + 1) % s->E, j = -1;
      ids[t * s->K + k] = (h >> 24) < 20 ? -1 : id;
      rw[t * s->K + k] = 0.1f + (float)(h >> 8 & 1023) / 1200.0f;
    }
  if (L->host) {
    memcpy(L->p[MOK_SLOT_TOPK_IDS], ids, TK * 4);
    memcpy(L->p[MOK_SLOT_ROUTER_W], rw, TK * 4);
  } else {
    CUDA_CHECK(cudaMemcpyAsync(L->p[MOK_SLOT_TOPK_IDS], ids, TK * 4, cudaMemcpyHostToDevice, st));
    CUDA_CHECK(cudaMemcpyAsync(L->p[MOK_SLOT_ROUTER_W], rw, TK * 4, cudaMemcpyHostToDevice, st));
    CUDA_CHECK(cudaStreamSynchronize(st));
  }
  free(ids);
  free(rw);
}

static void tlayer_open(tlayer *L, mok_client *c, shape s, int host, uint32_t seed,
                        cudaStream_t st) {
  memset(L, 0, sizeof *L);
  L->s = s;
  L->c = c;
  L->host = host;
  mok_layer_desc d = {};
  d.hidden = (uint32_t)s.H, d.intermediate = (uint32_t)s.I, d.experts = (uint32_t)s.E;
  d.topk = (uint32_t)s.K, d.shared_intermediate = (uint32_t)s.I_s;
  d.max_tokens = (uint32_t)s.T, d.dtype = MOK_DTYPE_BF16;
  MK(mok_layer_create(c, &d, &L->l));
  size_t total = 0;
  for (int sl = 0; sl < MOK_SLOT_COUNT_; sl++) {
    L->bytes[sl] = slot_bytes(L->l, s.T, sl);
    total += (L->bytes[sl] + 255) & ~(size_t)255;
  }
  if (host) {
    L->pool = mok_host_alloc(c, total + 256);
    if (!L->pool) {
      fprintf(stderr, "mok_host_alloc: %s\n", mok_last_error());
      exit(2);
    }
    memset(L->pool, 0, total + 256);
  } else {
    /* on st, before the fills on st (st does not wait for the legacy stream) */
    CUDA_CHECK(cudaMalloc(&L->pool, total + 256));
    CUDA_CHECK(cudaMemsetAsync(L->pool, 0, total + 256, st));
  }
  size_t at = 0;
  for (int sl = 0; sl < MOK_SLOT_COUNT_; sl++) {
    L->p[sl] = L->bytes[sl] ? (char *)L->pool + at : NULL;
    at += (L->bytes[sl] + 255) & ~(size_t)255;
  }
  fill_inputs(L, seed, st);
}

static void tlayer_close(tlayer *L) {
  mok_layer_destroy(L->l);
  if (L->host) {
    mok_host_free(L->c, L->pool);
  } else {
    mok_cuda_forget(L->c, L->pool);
    cudaFree(L->pool);
  }
}

/* the slots of each op (tests/gpu/test_cuda_engine.c's chain) */
enum { J_FWD, J_BWD, J_RECOMPUTE, J_DISPATCH, J_COMPUTE, J_COMBINE, J_COMBINE_BWD,
       J_COMPUTE_BWD, J_DISPATCH_BWD, J_KINDS };
static const char *job_name[J_KINDS] = {"forward", "backward", "recompute", "dispatch", "compute",
                                        "combine", "combine_bwd", "compute_bwd", "dispatch_bwd"};
static const uint32_t job_op[J_KINDS] = {MOK_OP_FORWARD, MOK_OP_BACKWARD, MOK_OP_BACKWARD,
                                         MOK_OP_DISPATCH, MOK_OP_COMPUTE, MOK_OP_COMBINE,
                                         MOK_OP_COMBINE_BWD, MOK_OP_COMPUTE_BWD,
                                         MOK_OP_DISPATCH_BWD};
#define W3 MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN
#define S3 MOK_SLOT_S_GATE, MOK_SLOT_S_UP, MOK_SLOT_S_DOWN
static const int slots_fwd[] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_ROUTER_W, W3, S3,
                                MOK_SLOT_OUT, MOK_SLOT_CTX, -1};
static const int slots_bwd[] = {MOK_SLOT_X, MOK_SLOT_ROUTER_W, W3, S3, MOK_SLOT_D_OUT,
                                MOK_SLOT_CTX, MOK_SLOT_D_X, MOK_SLOT_D_RW, MOK_SLOT_D_W_GATE,
                                MOK_SLOT_D_W_UP, MOK_SLOT_D_W_DOWN, MOK_SLOT_D_S_GATE,
                                MOK_SLOT_D_S_UP, MOK_SLOT_D_S_DOWN, -1};
static const int slots_rec[] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_ROUTER_W, W3, S3,
                                MOK_SLOT_D_OUT, MOK_SLOT_CTX, MOK_SLOT_D_X, MOK_SLOT_D_RW,
                                MOK_SLOT_D_W_GATE, MOK_SLOT_D_W_UP, MOK_SLOT_D_W_DOWN,
                                MOK_SLOT_D_S_GATE, MOK_SLOT_D_S_UP, MOK_SLOT_D_S_DOWN, -1};
static const int slots_disp[] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_SCHEDULE,
                                 MOK_SLOT_ROUTED_X, -1};
static const int slots_comp[] = {MOK_SLOT_SCHEDULE, MOK_SLOT_ROUTED_X, W3, MOK_SLOT_ROUTED_Y,
                                 MOK_SLOT_ACTS, MOK_SLOT_X, S3, MOK_SLOT_SHARED_Y, -1};
static const int slots_comb[] = {MOK_SLOT_SCHEDULE, MOK_SLOT_ROUTED_Y, MOK_SLOT_ROUTER_W,
                                 MOK_SLOT_OUT, MOK_SLOT_SHARED_Y, -1};
static const int slots_cb[] = {MOK_SLOT_SCHEDULE, MOK_SLOT_D_OUT, MOK_SLOT_ROUTED_DOUT, -1};
static const int slots_cpb[] = {MOK_SLOT_SCHEDULE, MOK_SLOT_ACTS, MOK_SLOT_ROUTED_X,
                                MOK_SLOT_ROUTED_DOUT, MOK_SLOT_ROUTER_W, W3, MOK_SLOT_ROUTED_DX,
                                MOK_SLOT_D_RW, MOK_SLOT_D_W_GATE, MOK_SLOT_D_W_UP,
                                MOK_SLOT_D_W_DOWN, MOK_SLOT_X, MOK_SLOT_D_OUT, S3,
                                MOK_SLOT_SHARED_DX, MOK_SLOT_D_S_GATE, MOK_SLOT_D_S_UP,
                                MOK_SLOT_D_S_DOWN, -1};
static const int slots_db[] = {MOK_SLOT_SCHEDULE, MOK_SLOT_ROUTED_DX, MOK_SLOT_D_X,
                               MOK_SLOT_SHARED_DX, -1};
static const int *job_slots[J_KINDS] = {slots_fwd, slots_bwd, slots_rec, slots_disp, slots_comp,
                                        slots_comb, slots_cb, slots_cpb, slots_db};

static bool shared_slot(int sl) {
  return sl == MOK_SLOT_S_GATE || sl == MOK_SLOT_S_UP || sl == MOK_SLOT_S_DOWN ||
         sl == MOK_SLOT_SHARED_Y || sl == MOK_SLOT_SHARED_DX || sl == MOK_SLOT_D_S_GATE ||
         sl == MOK_SLOT_D_S_UP || sl == MOK_SLOT_D_S_DOWN;
}

/* submit job kind k; stream NULL: without a stream (host memory) */
static int submit(const tlayer *L, int k, cudaStream_t st, uint64_t *ticket) {
  mok_tensor t[MOK_SLOT_COUNT_];
  memset(t, 0, sizeof t);
  for (const int *sl = job_slots[k]; *sl >= 0; sl++) {
    if (shared_slot(*sl) && !L->s.I_s) continue;
    if (!L->p[*sl]) continue;
    t[*sl] = mok_tensor_for(L->l, (uint32_t)L->s.T, (uint32_t)*sl, L->p[*sl]);
  }
  uint32_t flags = k == J_RECOMPUTE ? MOK_JOB_RECOMPUTE : 0;
  if (L->host) return mok_submit(L->l, job_op[k], flags, (uint32_t)L->s.T, t, ticket);
  return mok_submit_on_stream(L->l, job_op[k], flags, (uint32_t)L->s.T, t, st, ticket);
}

/* ---- the attacker ----------------------------------------------------------------------- */

/* One pass over n words of dst: mode 0 the valid words again, 1 random
 * words, 2 the valid words with bits flipped, 3 valid words nudged by one
 * (plausible ids and offsets that disagree with the rest). Runs `passes`
 * passes, the mode changing with each. */
__global__ void scribble(uint32_t *dst, const uint32_t *good, size_t n, uint32_t seed,
                         int passes) {
  for (int p = 0; p < passes; p++) {
    const uint32_t mode = mix(seed * 977u + (uint32_t)p) & 3u;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
      uint32_t h = mix((uint32_t)i * 2654435761u ^ seed ^ (uint32_t)p * 40503u);
      uint32_t g = good[i], v;
      switch (mode) {
      case 0: v = g; break;
      case 1: v = h; break;
      case 2: v = (h & 15u) == 0 ? g ^ (1u << (h >> 27)) : g; break;
      default: v = (h & 3u) == 0 ? g + ((h >> 8) & 1u ? 1u : 0xffffffffu) : g; break;
      }
      ((volatile uint32_t *)dst)[i] = v;
    }
    __threadfence_system();
  }
}

typedef struct target {
  void *buf;
  void *good; /* the valid bytes (device; host mode: host) */
  size_t bytes;
} target;

typedef struct host_scribbler {
  target t[4];
  int n;
  std::atomic<int> stop;
  uint64_t passes;
} host_scribbler;

static void *host_scribble_main(void *arg) {
  host_scribbler *hs = (host_scribbler *)arg;
  uint32_t seed = 12345;
  while (!hs->stop.load()) {
    for (int b = 0; b < hs->n; b++) {
      volatile uint32_t *d = (volatile uint32_t *)hs->t[b].buf;
      const uint32_t *g = (const uint32_t *)hs->t[b].good;
      size_t n = hs->t[b].bytes / 4;
      uint32_t mode = mix(seed++) & 3u;
      for (size_t i = 0; i < n; i++) { /* the modes of scribble() */
        uint32_t h = mix((uint32_t)i ^ seed);
        uint32_t flip = (h & 15u) ? g[i] : g[i] ^ (1u << (h >> 27));
        uint32_t nudge = (h & 3u) ? g[i] : g[i] + 1u;
        d[i] = mode == 0 ? g[i] : mode == 1 ? h : mode == 2 ? flip : nudge;
      }
    }
    hs->passes++;
  }
  return NULL;
}

static int attacker(double seconds, int host) {
  mok_client *c;
  MK(mok_connect(NULL, host ? "hostile-attacker-host" : "hostile-attacker", &c));
  cudaStream_t st, side;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  tlayer L;
  const shape s = {256, 256, 128, 8, 2, 64};
  tlayer_open(&L, c, s, host, 7, st);
  /* one clean pass of every job kind: the valid bytes the scribbler starts from */
  for (int k = 0; k < J_KINDS; k++) {
    uint64_t tk;
    MK(submit(&L, k, st, &tk));
    int r = mok_wait(c, tk, 60000);
    if (r != MOK_OK) {
      fprintf(stderr, "attacker: clean %s failed: %s\n", job_name[k], mok_last_error());
      return 2;
    }
  }
  const int tslots[4] = {MOK_SLOT_TOPK_IDS, MOK_SLOT_CTX, MOK_SLOT_SCHEDULE, MOK_SLOT_ACTS};
  target tg[4];
  for (int b = 0; b < 4; b++) {
    tg[b].buf = L.p[tslots[b]];
    tg[b].bytes = L.bytes[tslots[b]] & ~(size_t)3;
    if (host) {
      tg[b].good = malloc(tg[b].bytes);
      memcpy(tg[b].good, tg[b].buf, tg[b].bytes);
    } else {
      CUDA_CHECK(cudaMalloc(&tg[b].good, tg[b].bytes));
      CUDA_CHECK(cudaMemcpy(tg[b].good, tg[b].buf, tg[b].bytes, cudaMemcpyDeviceToDevice));
    }
  }
  host_scribbler hs;
  hs.n = 0;
  hs.stop.store(0);
  hs.passes = 0;
  pthread_t th;
  if (host) {
    memcpy(hs.t, tg, sizeof tg);
    hs.n = 4;
    if (pthread_create(&th, NULL, host_scribble_main, &hs) != 0) {
      fprintf(stderr, "attacker: pthread_create failed\n");
      return 2;
    }
  }
  uint64_t races = 0, ok = 0, failed = 0, crashes = 0, by_kind_failed[J_KINDS] = {0};
  uint64_t queue[16];
  int qkind[16], qn = 0;
  uint32_t seed = 1;
  const double t0 = now_s();
  int k = 0;
  while (now_s() - t0 < seconds && !crashes) {
    if (!host && cudaStreamQuery(side) == cudaSuccess) /* keep the side stream scribbling */
      for (int b = 0; b < 4; b++)
        scribble<<<64, 256, 0, side>>>((uint32_t *)tg[b].buf, (const uint32_t *)tg[b].good,
                                       tg[b].bytes / 4, seed++, 8);
    uint64_t tk = 0;
    int r = submit(&L, k, st, &tk);
    if (r == MOK_OK) {
      queue[qn] = tk, qkind[qn] = k, qn++;
      races++;
    } else if (r == MOK_ECLOSED || r == MOK_EIO || r == MOK_EPROTO) {
      printf("attacker: submit: %s: %s\n", mok_status_name(r), mok_last_error());
      crashes++;
    } else {
      failed++;
    }
    k = (k + 1) % J_KINDS;
    while (qn == 16 || (qn > 0 && now_s() - t0 >= seconds)) {
      int w = mok_wait(c, queue[0], 120000);
      if (w == MOK_OK) ok++;
      else if (w == MOK_ECLOSED || w == MOK_EIO || w == MOK_EPROTO ||
               (w == MOK_ETIMEOUT && mok_job_pending(c, queue[0]))) {
        printf("attacker: %s: %s: %s\n", job_name[qkind[0]], mok_status_name(w), mok_last_error());
        crashes++;
      } else {
        failed++;
        by_kind_failed[qkind[0]]++;
      }
      memmove(queue, queue + 1, (size_t)(qn - 1) * sizeof queue[0]);
      memmove(qkind, qkind + 1, (size_t)(qn - 1) * sizeof qkind[0]);
      qn--;
      if (crashes) break;
    }
  }
  if (host) {
    hs.stop.store(1);
    pthread_join(th, NULL);
  }
  cudaError_t ce = cudaStreamSynchronize(side);
  cudaError_t ce2 = cudaStreamSynchronize(st);
  printf("attacker (%s memory): %.0f s, scribble passes %llu; failed by kind:",
         host ? "host" : "device", now_s() - t0,
         (unsigned long long)(host ? hs.passes : (uint64_t)seed * 8 / 4));
  for (int j = 0; j < J_KINDS; j++)
    printf(" %s %llu", job_name[j], (unsigned long long)by_kind_failed[j]);
  printf("\nattacker: races %llu jobs ok %llu failed %llu crashes %llu\n",
         (unsigned long long)races, (unsigned long long)ok, (unsigned long long)failed,
         (unsigned long long)crashes);
  if (ce != cudaSuccess || ce2 != cudaSuccess)
    printf("attacker: own CUDA error %s / %s\n", cudaGetErrorString(ce), cudaGetErrorString(ce2));
  if (!crashes) {
    for (int b = 0; b < 4; b++) host ? free(tg[b].good) : (void)cudaFree(tg[b].good);
    tlayer_close(&L);
    mok_close(c);
  }
  return crashes ? 1 : 0;
}

/* ---- the victim ------------------------------------------------------------------------- */

static uint64_t hash_bytes(uint64_t h, const void *p, size_t n) {
  const unsigned char *b = (const unsigned char *)p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  return h;
}

/* every output slot and the ctx, from device memory; *poison counts the
 * 16-byte blocks still all 0xff (outputs a job did not write) */
static uint64_t hash_outputs(const tlayer *L, uint64_t h, long *poison) {
  const int outs[] = {MOK_SLOT_OUT, MOK_SLOT_CTX, MOK_SLOT_D_X, MOK_SLOT_D_RW, MOK_SLOT_D_W_GATE,
                      MOK_SLOT_D_W_UP, MOK_SLOT_D_W_DOWN, MOK_SLOT_D_S_GATE, MOK_SLOT_D_S_UP,
                      MOK_SLOT_D_S_DOWN, MOK_SLOT_SCHEDULE, MOK_SLOT_ROUTED_X, MOK_SLOT_ROUTED_Y,
                      MOK_SLOT_SHARED_Y, MOK_SLOT_ACTS, MOK_SLOT_ROUTED_DOUT, MOK_SLOT_ROUTED_DX,
                      MOK_SLOT_SHARED_DX};
  for (size_t i = 0; i < sizeof outs / sizeof outs[0]; i++) {
    size_t n = L->bytes[outs[i]];
    if (!n) continue;
    void *p = malloc(n);
    CUDA_CHECK(cudaMemcpy(p, L->p[outs[i]], n, cudaMemcpyDeviceToHost));
    h = hash_bytes(h, p, n);
    for (size_t b = 0; b + 16 <= n; b += 16) {
      const uint64_t *w = (const uint64_t *)((const char *)p + b);
      *poison += w[0] == ~0ull && w[1] == ~0ull;
    }
    free(p);
  }
  return h;
}

static void poison_outputs(const tlayer *L, cudaStream_t st) {
  for (int sl = MOK_SLOT_OUT; sl < MOK_SLOT_COUNT_; sl++)
    if (sl != MOK_SLOT_D_OUT && L->bytes[sl])
      CUDA_CHECK(cudaMemsetAsync(L->p[sl], 0xff, L->bytes[sl], st));
}

/* one round on one layer: fwd + bwd from ctx, recompute, the step chain;
 * each phase's hash (and its poisoned blocks) goes to the round's line */
static uint64_t victim_round(const tlayer *L, cudaStream_t st, uint64_t h, int *failed,
                             char *line, size_t len) {
  static const int phases[3][8] = {{J_FWD, J_BWD, -1},
                                   {J_RECOMPUTE, -1},
                                   {J_DISPATCH, J_COMPUTE, J_COMBINE, J_COMBINE_BWD, J_COMPUTE_BWD,
                                    J_DISPATCH_BWD, -1}};
  for (int p = 0; p < 3; p++) {
    poison_outputs(L, st);
    if (p == 1) { /* recompute rebuilds the ctx: start from forward's */
      uint64_t tk;
      MK(submit(L, J_FWD, st, &tk));
      if (mok_wait(L->c, tk, 120000) != MOK_OK) (*failed)++;
    }
    for (const int *k = phases[p]; *k >= 0; k++) {
      uint64_t tk;
      int r = submit(L, *k, st, &tk);
      if (r == MOK_OK) r = mok_wait(L->c, tk, 120000);
      if (r != MOK_OK) {
        (*failed)++;
        printf("victim: %s: %s: %s\n", job_name[*k], mok_status_name(r), mok_last_error());
      }
    }
    CUDA_CHECK(cudaStreamSynchronize(st));
    long poison = 0;
    uint64_t ph = hash_outputs(L, 0xcbf29ce484222325ull, &poison);
    h = hash_bytes(h, &ph, sizeof ph);
    size_t at = strlen(line);
    snprintf(line + at, len - at, " %08x/%ld", (unsigned)(ph >> 32), poison);
  }
  return h;
}

static int victim(int rounds, const char *want) {
  mok_client *c;
  MK(mok_connect(NULL, "hostile-victim", &c));
  cudaStream_t st;
  CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  tlayer A, B;
  tlayer_open(&A, c, shape{300, 128, 128, 4, 2, 64}, 0, 11, st);
  tlayer_open(&B, c, shape{1024, 512, 256, 16, 4, 256}, 0, 13, st);
  uint64_t first = 0, ref = want ? strtoull(want, NULL, 16) : 0;
  int failed = 0, mismatches = 0;
  for (int r = 0; r < rounds; r++) {
    uint64_t h = 0xcbf29ce484222325ull;
    char line[256] = "";
    h = victim_round(&A, st, h, &failed, line, sizeof line);
    h = victim_round(&B, st, h, &failed, line, sizeof line);
    printf("victim: round %d phases (hash/poisoned blocks):%s\n", r, line);
    if (r == 0) first = h;
    if ((want && h != ref) || (!want && h != first)) {
      mismatches++;
      printf("victim: round %d hash %016llx differs\n", r, (unsigned long long)h);
    }
  }
  printf("victim: rounds %d failed %d mismatches %d hash %016llx\n", rounds, failed, mismatches,
         (unsigned long long)first);
  tlayer_close(&A);
  tlayer_close(&B);
  mok_close(c);
  return failed || mismatches ? 1 : 0;
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: test_hostile attacker SECONDS [host] | victim ROUNDS [HASH]\n");
    return 2;
  }
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaFree(NULL));
  if (strcmp(argv[1], "attacker") == 0)
    return attacker(atof(argv[2]), argc > 3 && strcmp(argv[3], "host") == 0);
  if (strcmp(argv[1], "victim") == 0) return victim(atoi(argv[2]), argc > 3 ? argv[3] : NULL);
  fprintf(stderr, "unknown mode %s\n", argv[1]);
  return 2;
}
