/* SPDX-License-Identifier: Apache-2.0 */
/* Expert parallelism on the cuda engine (docs/ep.md): the EP bench.
 *
 *   bench_ep_cuda kernels [W] [T] [H] [K] [GPUS]
 *     The data path in one process: W members' buffers on GPU p % GPUS
 *     (one GPU: HBM-local; more: rank 0 reaches its peers over NVLink), a virtual schedule over balanced random routing, then the pull
 *     (dispatch), the push (combine) and a W-member barrier, each timed
 *     with events (median of 20). Bytes are logical: routed rows x row
 *     bytes, per rank per direction, as DeepEP reports them.
 *
 *   bench_ep_cuda daemon MOKD [W] [T] [H] [I] [E] [K] [GPUS]
 *     W mokd (cuda engine) and W client processes, one rank each; bf16
 *     tensors in device memory; forward and backward jobs timed on the
 *     client (submit to completion, median of 10 after 3 warm-ups); then
 *     EP=1 on one mokd at the per-rank slice of the same work (T tokens,
 *     E/W experts) as the baseline of the same run; then W new client
 *     processes re-join the group (their daemons kept it) and run their
 *     first forward: join, layer creation and first job timed.
 *     Run it under MPS when GPUS=1 (members' kernels must run at once).
 */
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../harness/cuda_check.cuh"
#include "../harness/kernel_choices.h"
#include "mok.h"
#include "mok_ep_kernels.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* balanced random routing: K distinct experts of E per token, seeded */
static void routing(int32_t *ids, float *rw, int T, int E, int K, unsigned seed) {
  srand(seed);
  for (int t = 0; t < T; t++) {
    for (int k = 0; k < K; k++) {
      int e, dup;
      do {
        e = rand() % E;
        dup = 0;
        for (int j = 0; j < k; j++) dup |= ids[t * K + j] == e;
      } while (dup);
      ids[t * K + k] = e;
      rw[t * K + k] = 1.0f / (float)K;
    }
  }
}

/* ---- part 1: the kernels in one process ------------------------------------------ */

static int bench_kernels(int W, int T, int H, int K, int gpus) {
  const int E = 64 * W, E_loc = 64, Tv = W * T;
  /* member p's buffer on GPU p % gpus; rank 0 (GPU 0) reaches the others by peer access */
  for (int d = 1; d < gpus; d++) {
    CUDA_CHECK(cudaSetDevice(d));
    CUDA_CHECK(cudaDeviceEnablePeerAccess(0, 0));
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaDeviceEnablePeerAccess(d, 0));
  }
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK((cudaError_t)(kernel_init_from_env() == MOK_OK ? cudaSuccess : cudaErrorUnknown));
  mok_k_ep_layout lay = mok_k_ep_layout_of(T, H, K);
  mok_k_ep g[MOK_K_EP_MAX_WORLD];
  memset(g, 0, sizeof g);
  for (int p = 0; p < W; p++) {
    void *b;
    CUDA_CHECK(cudaSetDevice(p % gpus));
    CUDA_CHECK(cudaMalloc(&b, lay.bytes));
    CUDA_CHECK(cudaMemset(b, 0, lay.bytes));
    fill_bf16<<<1024, 256>>>((uint16_t *)((char *)b + lay.x), (size_t)T * H, 11u + (unsigned)p,
                             1.0f);
    g[0].base[p] = (uint64_t)(uintptr_t)b;
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  CUDA_CHECK(cudaSetDevice(0));
  for (int p = 0; p < W; p++) {
    g[p] = g[0];
    g[p].world = W;
    g[p].rank = p;
    g[p].T_max = T;
    g[p].off = lay;
  }
  /* all members' routing, gathered as a member sees it */
  int32_t *h_ids = (int32_t *)malloc(sizeof(int32_t) * Tv * K);
  float *h_rw = (float *)malloc(sizeof(float) * Tv * K);
  routing(h_ids, h_rw, Tv, E, K, 7);
  int32_t *ids;
  CUDA_CHECK(cudaMalloc((void **)&ids, sizeof(int32_t) * Tv * K));
  CUDA_CHECK(cudaMemcpy(ids, h_ids, sizeof(int32_t) * Tv * K, cudaMemcpyHostToDevice));
  /* rank 0's part of the work: its local experts over the virtual batch */
  mok_k_dims dv = {Tv, H, 1024, E, E_loc, 0, K, 0, mok_k_row_align(), 0, 0.0f};
  char err[160];
  if (mok_k_check_dims(&dv, err, sizeof err) != MOK_OK) {
    fprintf(stderr, "dims: %s\n", err);
    return 1;
  }
  int32_t *sched, *status;
  void *ws;
  uint16_t *rows;
  size_t R = (size_t)mok_k_rows_capacity(&dv);
  CUDA_CHECK(cudaMalloc((void **)&sched, sizeof(int32_t) * mok_k_schedule_ints(&dv)));
  CUDA_CHECK(cudaMalloc(&ws, mok_k_workspace_bytes(&dv)));
  CUDA_CHECK(cudaMalloc((void **)&rows, R * H * 2));
  CUDA_CHECK(cudaMalloc((void **)&status, 4));
  CUDA_CHECK(cudaMemset(status, 0, 4));
  if (mok_k_schedule_build(&dv, ids, sched, ws, status, 0) != MOK_OK) return 1;
  int32_t used = 0;
  int32_t hdr[8];
  CUDA_CHECK(cudaMemcpy(hdr, sched, sizeof hdr, cudaMemcpyDeviceToHost));
  int routed = 0, remote = 0;
  for (int i = 0; i < Tv * K; i++) {
    routed += h_ids[i] < E_loc;
    remote += h_ids[i] < E_loc && (i / K / T) % gpus != 0; /* a row on another GPU */
  }
  used = hdr[6];
  double bytes = (double)routed * H * 2;

  cudaEvent_t a, b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  const int N = 20;
  cudaStream_t st[MOK_K_EP_MAX_WORLD];
  for (int p = 0; p < W; p++) {
    CUDA_CHECK(cudaSetDevice(p % gpus));
    CUDA_CHECK(cudaStreamCreateWithFlags(&st[p], cudaStreamNonBlocking));
  }
  CUDA_CHECK(cudaSetDevice(0));
  int32_t *pstatus[MOK_K_EP_MAX_WORLD];
  for (int p = 0; p < W; p++) {
    CUDA_CHECK(cudaSetDevice(p % gpus));
    CUDA_CHECK(cudaMalloc((void **)&pstatus[p], 4));
    CUDA_CHECK(cudaMemset(pstatus[p], 0, 4));
  }
  CUDA_CHECK(cudaSetDevice(0));
  int sms = 0;
  CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  printf("EP=%d kernels on %d GPU(s) (%s), T=%d tokens/rank, H=%d, K=%d, E=%d (%d/rank), "
         "balanced routing; rank 0's view\n",
         W, gpus, gpus == 1 ? "HBM-local" : "peers over NVLink", T, H, K, E, E_loc);
  printf("  routed rows pulled = pushed: %d (%.1f MiB; %d of them on another GPU), schedule rows "
         "%d\n",
         routed, bytes / 1048576.0, remote, used);
  const int caps[] = {0, 32, 16, 8};
  int bad = 0;
  for (int ci = 0; ci < 4; ci++) {
    double pull[N], push[N], bar[N];
    g[0].max_ctas = caps[ci];
    for (int it = -3; it < N; it++) {
      float ms;
      CUDA_CHECK(cudaEventRecord(a, 0));
      if (mok_k_ep_pull_rows(&g[0], &dv, sched, lay.x, rows, status, 0) != MOK_OK) return 1;
      CUDA_CHECK(cudaEventRecord(b, 0));
      CUDA_CHECK(cudaEventSynchronize(b));
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      if (it >= 0) pull[it] = ms * 1e-3;
      CUDA_CHECK(cudaEventRecord(a, 0));
      if (mok_k_ep_push_rows(&g[0], &dv, sched, rows, NULL, status, 0) != MOK_OK) return 1;
      CUDA_CHECK(cudaEventRecord(b, 0));
      CUDA_CHECK(cudaEventSynchronize(b));
      CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      if (it >= 0) push[it] = ms * 1e-3;
      /* a barrier of W members: each on its own stream, all at once */
      for (int p = 0; p < W; p++) CUDA_CHECK(cudaStreamSynchronize(st[p]));
      CUDA_CHECK(cudaDeviceSynchronize());
      double t0 = now_s();
      uint64_t value = (uint64_t)(ci * 100 + it + 10);
      for (int p = 0; p < W; p++) {
        CUDA_CHECK(cudaSetDevice(p % gpus));
        if (mok_k_ep_barrier(&g[p], value, 1000000000ull, 0, pstatus[p], st[p]) != MOK_OK)
          return 1;
      }
      for (int p = 0; p < W; p++) CUDA_CHECK(cudaStreamSynchronize(st[p]));
      CUDA_CHECK(cudaSetDevice(0));
      if (it >= 0) bar[it] = now_s() - t0;
    }
    int32_t h_status = -1;
    CUDA_CHECK(cudaMemcpy(&h_status, status, 4, cudaMemcpyDeviceToHost));
    for (int p = 0; p < W; p++) {
      int32_t v = -1;
      CUDA_CHECK(cudaMemcpy(&v, pstatus[p], 4, cudaMemcpyDeviceToHost));
      if (v != 0) h_status = v; /* a barrier timed out */
    }
    bad |= h_status != 0;
    double mp = median(pull, N), mq = median(push, N), mb = median(bar, N);
    char who[32];
    if (caps[ci]) snprintf(who, sizeof who, "%d SMs (1024 thr)", caps[ci]);
    else snprintf(who, sizeof who, "all %d SMs", sms);
    printf("  %-18s dispatch (pull) %.3f ms, %5.0f GB/s | combine (push) %.3f ms, %5.0f GB/s | "
           "barrier %.1f us | status %d\n",
           who, mp * 1e3, bytes / mp * 1e-9, mq * 1e3, bytes / mq * 1e-9, mb * 1e6, h_status);
    printf("JSON {\"part\": \"kernels\", \"gpus\": %d, \"sms\": %d, \"remote_rows\": %d, "
           "\"W\": %d, \"T\": %d, \"H\": %d, \"K\": %d, \"rows\": %d, \"pull_ms\": %.4f, "
           "\"push_ms\": %.4f, \"pull_GBps\": %.1f, \"push_GBps\": %.1f, \"barrier_us\": %.1f, "
           "\"status\": %d}\n",
           gpus, caps[ci] ? caps[ci] : sms, remote, W, T, H, K, routed, mp * 1e3, mq * 1e3,
           bytes / mp * 1e-9, bytes / mq * 1e-9, mb * 1e6, h_status);
  }
  return bad;
}

/* ---- part 2: through mokd ------------------------------------------------------------- */

typedef struct shape2 {
  int W, T, H, I, E, K, gpus;
  float capacity; /* the group's capacity multiplier (0: all routes) */
  int ring;       /* the group's ring rows (0: one pass) */
  const uint8_t *nccl_id; /* MOK_BENCH_NCCL=1: the group forms through NCCL */
} shape2;

typedef struct rank_res {
  double fwd[16], bwd[16];
  int n;
  double join_s, layer_s, first_s;
  int rejoined, status;
  size_t ctx_bytes;
  char msg[200];
} rank_res;

static int rank_fail(rank_res *r, const char *what, int st) {
  r->status = st ? st : -1;
  snprintf(r->msg, sizeof r->msg, "%s: %s (%s)", what, mok_status_name(st), mok_last_error());
  return 0;
}

/* One client: connect, (join,) create the layer, run. world 0: no group
 * (the EP=1 baseline at the per-rank slice). first_only: the restarted
 * client, one forward. */
static void rank_main(const char *sock, const shape2 *s, int rank, int world, const char *key,
                      int first_only, rank_res *r) {
  CUDA_CHECK(cudaSetDevice(rank % s->gpus));
  const int E_loc = world ? s->E / world : s->E / s->W, T = s->T, H = s->H, I = s->I, K = s->K;
  const int E_layer = world ? s->E : E_loc;
  size_t wbytes = (size_t)E_loc * I * H * 2, sbytes = (size_t)I * H * 2, tb = (size_t)T * H * 2;
  uint16_t *wg, *wu, *wd, *sg, *su, *sd, *x, *dout, *out, *dx, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd;
  uint16_t **bufs[] = {&wg, &wu, &wd, &dwg, &dwu, &dwd};
  for (int i = 0; i < 6; i++) CUDA_CHECK(cudaMalloc((void **)bufs[i], wbytes));
  uint16_t **sb[] = {&sg, &su, &sd, &dsg, &dsu, &dsd};
  for (int i = 0; i < 6; i++) CUDA_CHECK(cudaMalloc((void **)sb[i], sbytes));
  uint16_t **tbuf[] = {&x, &dout, &out, &dx};
  for (int i = 0; i < 4; i++) CUDA_CHECK(cudaMalloc((void **)tbuf[i], tb));
  fill_bf16<<<1024, 256>>>(wg, wbytes / 2, 1u + rank, 0.02f);
  fill_bf16<<<1024, 256>>>(wu, wbytes / 2, 2u + rank, 0.02f);
  fill_bf16<<<1024, 256>>>(wd, wbytes / 2, 3u + rank, 0.02f);
  fill_bf16<<<1024, 256>>>(sg, sbytes / 2, 4u, 0.02f);
  fill_bf16<<<1024, 256>>>(su, sbytes / 2, 5u, 0.02f);
  fill_bf16<<<1024, 256>>>(sd, sbytes / 2, 6u, 0.02f);
  fill_bf16<<<1024, 256>>>(x, tb / 2, 7u + rank, 1.0f);
  fill_bf16<<<1024, 256>>>(dout, tb / 2, 8u + rank, 1.0f);
  int32_t *h_ids = (int32_t *)malloc(4ull * T * K), *ids;
  float *h_rw = (float *)malloc(4ull * T * K), *rw, *drw;
  routing(h_ids, h_rw, T, E_layer, K, 100u + (unsigned)rank);
  CUDA_CHECK(cudaMalloc((void **)&ids, 4ull * T * K));
  CUDA_CHECK(cudaMalloc((void **)&rw, 4ull * T * K));
  CUDA_CHECK(cudaMalloc((void **)&drw, 4ull * T * K));
  CUDA_CHECK(cudaMemcpy(ids, h_ids, 4ull * T * K, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(rw, h_rw, 4ull * T * K, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaDeviceSynchronize());

  mok_client *c;
  int st = mok_connect(sock, "bench-ep", &c);
  if (st != MOK_OK) {
    rank_fail(r, "mok_connect", st);
    return;
  }
  mok_group *g = NULL;
  double t0 = now_s();
  if (world) {
    mok_group_sizing sz = {(uint32_t)T, (uint32_t)H, (uint32_t)K, (uint32_t)s->E, MOK_DTYPE_BF16,
                           60000, s->capacity, (uint32_t)s->ring, s->nccl_id};
    if ((st = mok_group_join(c, key, (uint32_t)rank, (uint32_t)world, &sz, &g)) != MOK_OK) {
      rank_fail(r, "mok_group_join", st);
      return;
    }
    r->rejoined = mok_group_rejoined(g);
  }
  double t1 = now_s();
  mok_layer_desc d;
  memset(&d, 0, sizeof d);
  d.hidden = (uint32_t)H;
  d.intermediate = (uint32_t)I;
  d.experts = (uint32_t)E_layer;
  d.topk = (uint32_t)K;
  d.shared_intermediate = (uint32_t)I;
  d.max_tokens = (uint32_t)T;
  d.dtype = MOK_DTYPE_BF16;
  d.group = g;
  d.group_tag = 1;
  mok_layer *l;
  if ((st = mok_layer_create(c, &d, &l)) != MOK_OK) {
    rank_fail(r, "mok_layer_create", st);
    return;
  }
  double t2 = now_s();
  size_t ctx_bytes = (size_t)mok_layer_ctx_bytes(l, (uint32_t)T);
  r->ctx_bytes = ctx_bytes;
  void *ctx;
  CUDA_CHECK(cudaMalloc(&ctx, ctx_bytes));
  mok_forward_args fa = {x, wg, wu, wd, sg, su, sd, ids, rw, out, ctx};
  mok_backward_args ba;
  memset(&ba, 0, sizeof ba);
  ba.x = x, ba.w_gate = wg, ba.w_up = wu, ba.w_down = wd, ba.s_gate = sg, ba.s_up = su;
  ba.s_down = sd, ba.d_out = dout, ba.topk_ids = ids, ba.router_weights = rw, ba.ctx = ctx;
  ba.d_x = dx, ba.d_w_gate = dwg, ba.d_w_up = dwu, ba.d_w_down = dwd, ba.d_s_gate = dsg;
  ba.d_s_up = dsu, ba.d_s_down = dsd, ba.d_router_weights = drw;
  int iters = first_only ? 1 : 13;
  for (int it = 0; it < iters; it++) {
    uint64_t tk;
    double a = now_s();
    if ((st = mok_forward(l, (uint32_t)T, &fa, &tk)) != MOK_OK ||
        (st = mok_wait(c, tk, 120000)) != MOK_OK) {
      rank_fail(r, "forward", st);
      return;
    }
    double b = now_s();
    if (first_only) {
      r->join_s = t1 - t0;
      r->layer_s = t2 - t1;
      r->first_s = b - a;
      break;
    }
    if ((st = mok_backward(l, (uint32_t)T, 0, &ba, &tk)) != MOK_OK ||
        (st = mok_wait(c, tk, 120000)) != MOK_OK) {
      rank_fail(r, "backward", st);
      return;
    }
    double e = now_s();
    if (it >= 3) {
      r->fwd[r->n] = b - a;
      r->bwd[r->n] = e - b;
      r->n++;
    }
  }
  mok_close(c); /* no leave: the group lingers for the restarted client */
}

static pid_t start_mokd(const char *mokd, const char *dir, int i, int device) {
  char sock[256], cfg[256], log[256];
  snprintf(sock, sizeof sock, "%s/mokd%d.sock", dir, i);
  snprintf(cfg, sizeof cfg, "%s/mokd%d.conf", dir, i);
  snprintf(log, sizeof log, "%s/mokd%d.log", dir, i);
  FILE *f = fopen(cfg, "w");
  fprintf(f, "device = %d\nlog-level = info\n", device);
  fclose(f);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    freopen(log, "w", stderr);
    execl(mokd, "mokd", "--socket", sock, "--engine", "cuda", "--config", cfg, (char *)NULL);
    _exit(127);
  }
  for (int t = 0; t < 3000; t++) { /* until it serves */
    struct stat sbuf;
    if (stat(sock, &sbuf) == 0) return pid;
    usleep(10000);
  }
  fprintf(stderr, "mokd %d did not come up (%s)\n", i, log);
  return -1;
}

static void run_ranks(const char *dir, const shape2 *s, int world, const char *key, int first_only,
                      rank_res *res, int n) {
  pid_t pids[MOK_K_EP_MAX_WORLD];
  for (int r = 0; r < n; r++) {
    char sock[256];
    snprintf(sock, sizeof sock, "%s/mokd%d.sock", dir, world ? r : s->W);
    pids[r] = fork();
    if (pids[r] == 0) {
      rank_main(sock, s, r, world, key, first_only, &res[r]);
      _exit(0);
    }
  }
  for (int r = 0; r < n; r++) waitpid(pids[r], NULL, 0);
}

static int report_failures(const rank_res *res, int n, const char *what) {
  int bad = 0;
  for (int r = 0; r < n; r++)
    if (res[r].status) {
      printf("  %s rank %d FAILED: %s\n", what, r, res[r].msg);
      bad = 1;
    }
  return bad;
}

static int bench_daemon(const char *mokd, const shape2 *s) {
  char dir[] = "/tmp/mok-bench-ep-XXXXXX";
  if (!mkdtemp(dir)) return 2;
  pid_t d[MOK_K_EP_MAX_WORLD + 1];
  for (int i = 0; i <= s->W; i++)
    if ((d[i] = start_mokd(mokd, dir, i, i % s->gpus)) < 0) return 2;
  /* MOK_BENCH_SIZINGS="capacity:ring,...": more groups of the same layer,
   * each timed against the first (e.g. "0.25:0,0.25:16384") */
  shape2 sizings[8];
  int n_sizings = 0;
  const char *env = getenv("MOK_BENCH_SIZINGS");
  for (const char *p = env; p && *p && n_sizings < 8;) {
    shape2 z = *s;
    char *end;
    z.capacity = strtof(p, &end);
    z.ring = *end == ':' ? (int)strtol(end + 1, &end, 10) : 0;
    sizings[n_sizings++] = z;
    p = *end == ',' ? end + 1 : end + strlen(end);
  }
  /* MOK_BENCH_NCCL=1: every group through NCCL (one GPU per rank), the
   * id from rank 0's mokd; the sizings' groups each get their own */
  const bool nccl = getenv("MOK_BENCH_NCCL") && atoi(getenv("MOK_BENCH_NCCL")) > 0;
  static uint8_t ids[9][MOK_NCCL_ID_BYTES];
  shape2 s0 = *s;
  if (nccl) {
    char sock0[256];
    snprintf(sock0, sizeof sock0, "%s/mokd0.sock", dir);
    mok_client *c;
    if (mok_connect(sock0, "bench-ep-id", &c) != MOK_OK) return 2;
    for (int i = 0; i <= n_sizings; i++)
      if (mok_group_nccl_id(c, ids[i]) != MOK_OK) {
        fprintf(stderr, "mok_group_nccl_id: %s\n", mok_last_error());
        return 2;
      }
    mok_close(c);
    s0.nccl_id = ids[0];
    for (int i = 0; i < n_sizings; i++) sizings[i].nccl_id = ids[1 + i];
    s = &s0;
  }
  const size_t n_res = 2 * (size_t)s->W + 1 + (size_t)n_sizings * s->W;
  rank_res *res = (rank_res *)mmap(NULL, sizeof(rank_res) * n_res, PROT_READ | PROT_WRITE,
                                   MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  memset(res, 0, sizeof(rank_res) * n_res);
  char key[64];
  snprintf(key, sizeof key, "bench-ep-%d", (int)getpid());
  double flop_rank = 6.0 * ((double)s->T + (double)s->T * s->K) * s->H * s->I;
  printf("EP=%d through mokd (cuda engine) on %d GPU(s), group %s: T=%d tokens/rank, H=%d, "
         "I=%d, E=%d (%d/rank), K=%d, I_s=%d, bf16, balanced routing; median of 10\n",
         s->W, s->gpus, nccl ? "through NCCL" : "on this host (VMM fds)", s->T, s->H, s->I, s->E,
         s->E / s->W, s->K, s->I);
  run_ranks(dir, s, s->W, key, 0, res, s->W);
  int bad = report_failures(res, s->W, "EP");
  /* the baseline: one mokd, the per-rank slice of the work */
  run_ranks(dir, s, 0, key, 0, res + 2 * s->W, 1);
  bad |= report_failures(res + 2 * s->W, 1, "EP=1");
  /* restarted clients: the daemons kept the group */
  run_ranks(dir, s, s->W, key, 1, res + s->W, s->W);
  bad |= report_failures(res + s->W, s->W, "re-join");
  rank_res *zres = res + 2 * s->W + 1;
  for (int z = 0; z < n_sizings; z++) {
    char zkey[80];
    snprintf(zkey, sizeof zkey, "%s-z%d", key, z);
    run_ranks(dir, &sizings[z], s->W, zkey, 0, zres + z * s->W, s->W);
    bad |= report_failures(zres + z * s->W, s->W, "sizing");
  }
  if (!bad) {
    rank_res *b = res + 2 * s->W;
    double bf = median(b->fwd, b->n), bb = median(b->bwd, b->n);
    printf("  %-22s %10s %10s %14s %14s\n", "", "fwd ms", "bwd ms", "fwd TFLOP/s", "bwd TFLOP/s");
    printf("  %-22s %10.3f %10.3f %14.1f %14.1f\n", "EP=1 slice (baseline)", bf * 1e3, bb * 1e3,
           flop_rank / bf * 1e-12, 2 * flop_rank / bb * 1e-12);
    double wf = 0, wb = 0;
    for (int r = 0; r < s->W; r++) {
      double f = median(res[r].fwd, res[r].n), g = median(res[r].bwd, res[r].n);
      if (f > wf) wf = f;
      if (g > wb) wb = g;
      printf("  EP=%d rank %-12d %10.3f %10.3f %14.1f %14.1f\n", s->W, r, f * 1e3, g * 1e3,
             flop_rank / f * 1e-12, 2 * flop_rank / g * 1e-12);
    }
    double per_gpu = (double)s->W / s->gpus;
    printf("  EP=%d, all ranks per GPU: fwd %.1f TFLOP/s, bwd %.1f TFLOP/s (%.0f rank(s) per GPU);"
           " vs the EP=1 slice: fwd %.2fx, bwd %.2fx of its rate\n",
           s->W, per_gpu * flop_rank / wf * 1e-12, per_gpu * 2 * flop_rank / wb * 1e-12, per_gpu,
           per_gpu * bf / wf, per_gpu * bb / wb);
    for (int r = 0; r < s->W; r++) {
      rank_res *q = res + s->W + r;
      printf("  restarted client rank %d: re-join %.2f ms (rejoined=%d), layer %.1f ms, first "
             "forward %.1f ms\n",
             r, q->join_s * 1e3, q->rejoined, q->layer_s * 1e3, q->first_s * 1e3);
    }
    /* the group's sizing: ctx bytes per rank and the slowest rank's times */
    printf("  %-26s %12s %10s %10s %12s %12s\n", "group sizing", "ctx MiB/rank", "fwd ms",
           "bwd ms", "fwd vs first", "bwd vs first");
    for (int z = -1; z < n_sizings; z++) {
      const rank_res *q = z < 0 ? res : zres + z * s->W;
      const shape2 *zs = z < 0 ? s : &sizings[z];
      double f = 0, g = 0;
      for (int r = 0; r < s->W; r++) {
        double a = median((double *)q[r].fwd, q[r].n), b = median((double *)q[r].bwd, q[r].n);
        f = a > f ? a : f;
        g = b > g ? b : g;
      }
      char name[64];
      snprintf(name, sizeof name, "capacity %.3g, ring %d", zs->capacity, zs->ring);
      printf("  %-26s %12.1f %10.3f %10.3f %11.3fx %11.3fx\n", name,
             (double)q[0].ctx_bytes / (1 << 20), f * 1e3, g * 1e3, wf / f, wb / g);
      printf("JSON {\"part\": \"sizing\", \"capacity\": %g, \"ring\": %d, \"ctx_bytes\": %zu, "
             "\"fwd_ms\": %.3f, \"bwd_ms\": %.3f}\n",
             zs->capacity, zs->ring, q[0].ctx_bytes, f * 1e3, g * 1e3);
    }
    printf("JSON {\"part\": \"daemon\", \"W\": %d, \"gpus\": %d, \"T\": %d, \"H\": %d, \"I\": %d, "
           "\"E\": %d, \"K\": %d, \"ep1_fwd_ms\": %.3f, \"ep1_bwd_ms\": %.3f, \"ep_fwd_ms\": %.3f, "
           "\"ep_bwd_ms\": %.3f, \"rejoin_ms\": %.3f, \"first_fwd_ms\": %.3f}\n",
           s->W, s->gpus, s->T, s->H, s->I, s->E, s->K, bf * 1e3, bb * 1e3, wf * 1e3, wb * 1e3,
           res[s->W].join_s * 1e3, res[s->W].first_s * 1e3);
  }
  for (int i = 0; i <= s->W; i++) kill(d[i], SIGTERM);
  for (int i = 0; i <= s->W; i++) waitpid(d[i], NULL, 0);
  return bad;
}

int main(int argc, char **argv) {
  if (argc >= 2 && !strcmp(argv[1], "kernels")) {
    int W = argc > 2 ? atoi(argv[2]) : 4, T = argc > 3 ? atoi(argv[3]) : 2048;
    int H = argc > 4 ? atoi(argv[4]) : 7168, K = argc > 5 ? atoi(argv[5]) : 8;
    int gpus = argc > 6 ? atoi(argv[6]) : 1;
    return bench_kernels(W, T, H, K, gpus);
  }
  if (argc >= 3 && !strcmp(argv[1], "daemon")) {
    shape2 s = {4, 2048, 4096, 1024, 64, 8, 1};
    int *f[] = {&s.W, &s.T, &s.H, &s.I, &s.E, &s.K, &s.gpus};
    for (int i = 0; i < 7 && 3 + i < argc; i++) *f[i] = atoi(argv[3 + i]);
    return bench_daemon(argv[2], &s);
  }
  fprintf(stderr, "usage: %s kernels [W T H K GPUS] | daemon MOKD [W T H I E K GPUS]\n", argv[0]);
  return 2;
}
