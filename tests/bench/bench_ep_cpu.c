/* SPDX-License-Identifier: Apache-2.0 */
/* Expert parallelism on the cpu engine (docs/ep.md): per-rank dispatch (pull)
 * and combine (push) bytes/s, layer times, and how long a restarted client
 * takes to run its first job in a group its daemon still holds.
 *
 *   build/bench/bench_ep_cpu [W] [T] [H] [I] [E] [K] [iters]
 *   defaults: W=4 T=256 H=512 I=256 E=16 K=4 iters=5, float32, one engine
 *   thread per rank.
 *
 * Part 1 runs W processes that each open a cpu engine and join the group
 * directly (no daemon, no client): the data path and its phases.
 * Part 2 runs W real mokd and W libmok clients: layer times end to end, then
 * W new client processes re-join and run their first job.
 */
#include <math.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>

#include "check.h"
#include "cpu/steps.h"
#include "ep/group.h"
#include "integration/harness.h"
#include "log.h"
#include "mok.h"
#include "mok_slots.h"

#define MAXW 16
#define MAXIT 64

typedef struct rank_out {
  double fwd_s[MAXIT], bwd_s[MAXIT], pull_s[MAXIT], push_s[MAXIT], compute_s[MAXIT],
      wait1_s[MAXIT], wait2_s[MAXIT], local_s[MAXIT];
  double rows[MAXIT], row_bytes;
  double join_s, first_job_s;
  int status;
  char msg[128];
} rank_out;

static uint32_t W = 4, T = 256, H = 512, I = 256, E = 16, K = 4, ITERS = 5;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(const double *v, uint32_t n) {
  double tmp[MAXIT];
  memcpy(tmp, v, n * sizeof *tmp);
  qsort(tmp, n, sizeof *tmp, cmp_d);
  return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

static void fill(float *p, size_t n, unsigned seed) {
  unsigned s = seed;
  for (size_t i = 0; i < n; i++) {
    s = s * 1103515245u + 12345u;
    p[i] = ((float)((s >> 8) & 0xffff) / 65536.0f - 0.5f) * 0.2f;
  }
}

static void routing(int32_t *ids, float *rw, uint32_t rank) {
  unsigned s = 77 + rank;
  for (uint32_t t = 0; t < T; t++)
    for (uint32_t k = 0; k < K; k++) {
      s = s * 1103515245u + 12345u;
      ids[t * K + k] = (int32_t)((s >> 8) % (E / K)) * (int32_t)K + (int32_t)k; /* distinct per token */
      rw[t * K + k] = 1.0f / (float)K;
    }
}

/* ---- part 1: engines in-process -------------------------------------------- */

static void view(mok_job_args *a, const mok_layer_config *cfg, uint32_t slot, void *p) {
  mok_tensor_view *v = &a->t[slot];
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape(cfg, a->tokens, slot, &v->dtype, &v->ndim, shape);
  uint64_t n = 1;
  for (uint32_t i = 0; i < v->ndim; i++) v->shape[i] = (uint32_t)shape[i], n *= shape[i];
  v->bytes = n * mok_dtype_size(v->dtype);
  v->ptr = p ? p : calloc(1, v->bytes + 64);
  CHECK(v->ptr != NULL);
}

static void engine_rank(uint32_t r, const char *key, rank_out *o) {
  mok_engine_config ec = {.threads = 1};
  mok_engine *e;
  char err[256];
  CHECK_MSG(mok_engine_cpu.open(&ec, &e, err, sizeof err) == MOK_OK, "%s", err);
  static _Atomic bool no_abort = false;
  mok_ep_group_table *tb = mok_ep_group_table_create(&no_abort);
  mok_ep_group_join_args ja = {.uid = getuid(), .rank = r, .timeout_ms = 60000,
                               .sizing = {W, T, H, K, E, MOK_DTYPE_F32}};
  snprintf(ja.key, sizeof ja.key, "%s", key);
  mok_ep_group *g;
  bool rejoined;
  CHECK_MSG(mok_ep_group_join(tb, &ja, &g, &rejoined, err, sizeof err) == MOK_OK, "%s", err);
  uint32_t El = E / W;
  mok_layer_config cfg = {.hidden = H, .intermediate = I, .experts = E, .local_experts = El,
                          .first_expert = r * El, .topk = K, .max_tokens = T,
                          .dtype = MOK_DTYPE_F32, .group_id = mok_ep_group_id(g),
                          .group_world = W, .group_rank = r, .group_tokens = T};
  CHECK_MSG(mok_engine_cpu.prepare_layer(e, &cfg, err, sizeof err) == MOK_OK, "%s", err);
  mok_job_args fa = {.op = MOK_OP_FORWARD, .tokens = T, .layer = &cfg};
  float *x = calloc((size_t)T * H, 4), *rw = calloc((size_t)T * K, 4);
  int32_t *ids = calloc((size_t)T * K, 4);
  fill(x, (size_t)T * H, 1 + r);
  routing(ids, rw, r);
  view(&fa, &cfg, MOK_SLOT_X, x);
  view(&fa, &cfg, MOK_SLOT_TOPK_IDS, ids);
  view(&fa, &cfg, MOK_SLOT_ROUTER_W, rw);
  view(&fa, &cfg, MOK_SLOT_W_GATE, NULL);
  view(&fa, &cfg, MOK_SLOT_W_UP, NULL);
  view(&fa, &cfg, MOK_SLOT_W_DOWN, NULL);
  fill(fa.t[MOK_SLOT_W_GATE].ptr, fa.t[MOK_SLOT_W_GATE].bytes / 4, 2);
  fill(fa.t[MOK_SLOT_W_UP].ptr, fa.t[MOK_SLOT_W_UP].bytes / 4, 3);
  fill(fa.t[MOK_SLOT_W_DOWN].ptr, fa.t[MOK_SLOT_W_DOWN].bytes / 4, 4);
  view(&fa, &cfg, MOK_SLOT_OUT, NULL);
  view(&fa, &cfg, MOK_SLOT_CTX, NULL);
  mok_job_args ba = fa;
  ba.op = MOK_OP_BACKWARD;
  memset(&ba.t[MOK_SLOT_OUT], 0, sizeof ba.t[0]);
  memset(&ba.t[MOK_SLOT_TOPK_IDS], 0, sizeof ba.t[0]);
  view(&ba, &cfg, MOK_SLOT_D_OUT, NULL);
  fill(ba.t[MOK_SLOT_D_OUT].ptr, ba.t[MOK_SLOT_D_OUT].bytes / 4, 5);
  view(&ba, &cfg, MOK_SLOT_D_X, NULL);
  view(&ba, &cfg, MOK_SLOT_D_RW, NULL);
  view(&ba, &cfg, MOK_SLOT_D_W_GATE, NULL);
  view(&ba, &cfg, MOK_SLOT_D_W_UP, NULL);
  view(&ba, &cfg, MOK_SLOT_D_W_DOWN, NULL);
  for (uint32_t it = 0; it <= ITERS; it++) { /* iteration 0 warms up */
    mok_engine_result res;
    double t0 = now_s();
    mok_engine_cpu.start(e, g, &fa, &res);
    double t1 = now_s();
    CHECK_MSG(res.status == MOK_OK, "forward: %s", res.message);
    mok_ep_cpu_timing tm = *mok__cpu_ep_last_timing(e);
    mok_engine_cpu.start(e, g, &ba, &res);
    double t2 = now_s();
    CHECK_MSG(res.status == MOK_OK, "backward: %s", res.message);
    if (it == 0) continue;
    uint32_t i = it - 1;
    o->fwd_s[i] = t1 - t0;
    o->bwd_s[i] = t2 - t1;
    o->pull_s[i] = 1e-9 * (double)tm.pull_ns;
    o->push_s[i] = 1e-9 * (double)tm.push_ns;
    o->compute_s[i] = 1e-9 * (double)tm.compute_ns;
    o->wait1_s[i] = 1e-9 * (double)tm.barrier1_ns;
    o->wait2_s[i] = 1e-9 * (double)tm.barrier2_ns;
    o->local_s[i] = 1e-9 * (double)tm.local_ns;
    o->rows[i] = (double)tm.rows;
    o->row_bytes = (double)tm.row_bytes;
  }
  mok_ep_group_table_destroy(tb);
  mok_engine_cpu.close(e);
}

/* ---- part 2: daemons and clients ---------------------------------------------- */

static void client_rank(const char *sock, uint32_t r, const char *key, uint32_t iters,
                        rank_out *o) {
  mok_client *c;
  CHECK_MSG(mok_connect(sock, "bench-ep", &c) == MOK_OK, "%s", mok_last_error());
  mok_group_sizing sz = {.max_tokens = T, .hidden = H, .topk = K, .experts = E,
                         .dtype = MOK_DTYPE_F32, .timeout_ms = 60000};
  mok_group *g;
  double t0 = now_s();
  CHECK_MSG(mok_group_join(c, key, r, W, &sz, &g) == MOK_OK, "%s", mok_last_error());
  o->join_s = now_s() - t0;
  mok_layer_desc d = {.hidden = H, .intermediate = I, .experts = E, .topk = K,
                      .max_tokens = T, .dtype = MOK_DTYPE_F32, .group = g};
  mok_layer *l;
  CHECK_MSG(mok_layer_create(c, &d, &l) == MOK_OK, "%s", mok_last_error());
  uint32_t El = E / W;
  float *x = mok_host_alloc(c, 4ull * T * H), *rw = mok_host_alloc(c, 4ull * T * K);
  int32_t *ids = mok_host_alloc(c, 4ull * T * K);
  float *wg = mok_host_alloc(c, 4ull * El * I * H), *wu = mok_host_alloc(c, 4ull * El * I * H);
  float *wd = mok_host_alloc(c, 4ull * El * H * I), *out = mok_host_alloc(c, 4ull * T * H);
  float *dout = mok_host_alloc(c, 4ull * T * H), *dx = mok_host_alloc(c, 4ull * T * H);
  float *drw = mok_host_alloc(c, 4ull * T * K), *dwg = mok_host_alloc(c, 4ull * El * I * H);
  float *dwu = mok_host_alloc(c, 4ull * El * I * H), *dwd = mok_host_alloc(c, 4ull * El * H * I);
  void *ctx = mok_host_alloc(c, mok_layer_ctx_bytes(l, T));
  CHECK(x && rw && ids && wg && wu && wd && out && dout && dx && drw && dwg && dwu && dwd && ctx);
  fill(x, (size_t)T * H, 1 + r);
  fill(dout, (size_t)T * H, 5);
  fill(wg, (size_t)El * I * H, 2);
  fill(wu, (size_t)El * I * H, 3);
  fill(wd, (size_t)El * H * I, 4);
  routing(ids, rw, r);
  mok_forward_args fa = {.x = x, .w_gate = wg, .w_up = wu, .w_down = wd, .topk_ids = ids,
                         .router_weights = rw, .out = out, .ctx = ctx};
  mok_backward_args ba = {.x = x, .w_gate = wg, .w_up = wu, .w_down = wd, .d_out = dout,
                          .router_weights = rw, .ctx = ctx, .d_x = dx, .d_w_gate = dwg,
                          .d_w_up = dwu, .d_w_down = dwd, .d_router_weights = drw};
  for (uint32_t it = 0; it < iters; it++) {
    uint64_t tk;
    double a = now_s();
    CHECK(mok_forward(l, T, &fa, &tk) == MOK_OK);
    int st = mok_wait(c, tk, -1);
    double b = now_s();
    CHECK_MSG(st == MOK_OK, "forward: %s", mok_last_error());
    CHECK(mok_backward(l, T, 0, &ba, &tk) == MOK_OK);
    st = mok_wait(c, tk, -1);
    CHECK_MSG(st == MOK_OK, "backward: %s", mok_last_error());
    if (it == 0) o->first_job_s = b - t0; /* join + layer + first forward */
    o->fwd_s[it] = b - a;
    o->bwd_s[it] = now_s() - b;
  }
  mok_close(c); /* without leaving: the daemons keep the group */
}

static rank_out *shared(void) {
  rank_out *o = mmap(NULL, sizeof(rank_out) * MAXW, PROT_READ | PROT_WRITE,
                     MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(o != MAP_FAILED);
  memset(o, 0, sizeof(rank_out) * MAXW);
  return o;
}

static void wait_all(pid_t *pids) {
  for (uint32_t r = 0; r < W; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %u failed", r);
  }
}

int main(int argc, char **argv) {
  uint32_t *params[] = {&W, &T, &H, &I, &E, &K, &ITERS};
  for (int i = 1; i < argc && i <= 7; i++) *params[i - 1] = (uint32_t)strtoul(argv[i], NULL, 10);
  if (W > MAXW || ITERS > MAXIT || ITERS == 0 || E % W || E % K) {
    fprintf(stderr, "bench_ep_cpu: W <= %d, iters 1..%d, E a multiple of W and of K\n", MAXW,
            MAXIT);
    return 2;
  }
  double flops_fwd = 6.0 * T * K * H * I; /* per rank, on average */
  printf("EP=%u on the cpu engine: T=%u tokens/rank, H=%u, I=%u, E=%u, K=%u, float32, "
         "1 engine thread/rank, %ld cores, median of %u\n",
         W, T, H, I, E, K, sysconf(_SC_NPROCESSORS_ONLN), ITERS);
  mok_log_set_level(MOK_LOG_WARN);
  char key[64];
  snprintf(key, sizeof key, "bench-ep-%d", (int)getpid());

  /* part 1 */
  rank_out *o = shared();
  pid_t pids[MAXW];
  for (uint32_t r = 0; r < W; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      engine_rank(r, key, &o[r]);
      _exit(0);
    }
  }
  wait_all(pids);
  printf("\n1) engines in-process (the data path):\n");
  printf("rank  rows  pull MB/s  push MB/s  pull ms  compute ms  push ms  wait1 ms  wait2 ms  "
         "local ms  fwd ms  bwd ms  fwd GFLOP/s\n");
  for (uint32_t r = 0; r < W; r++) {
    double rows = median(o[r].rows, ITERS), bytes = rows * o[r].row_bytes;
    double pull = median(o[r].pull_s, ITERS), push = median(o[r].push_s, ITERS);
    double fwd = median(o[r].fwd_s, ITERS);
    printf("%4u %5.0f %10.0f %10.0f %8.2f %11.2f %8.2f %9.2f %9.2f %9.2f %7.1f %7.1f %11.2f\n",
           r, rows, bytes / pull / 1e6, bytes / push / 1e6, 1e3 * pull,
           1e3 * median(o[r].compute_s, ITERS), 1e3 * push, 1e3 * median(o[r].wait1_s, ITERS),
           1e3 * median(o[r].wait2_s, ITERS), 1e3 * median(o[r].local_s, ITERS), 1e3 * fwd,
           1e3 * median(o[r].bwd_s, ITERS), flops_fwd / fwd / 1e9);
  }
  munmap(o, sizeof(rank_out) * MAXW);

  /* part 2 */
  daemon_proc d[MAXW];
  for (uint32_t r = 0; r < W; r++) d[r] = harness_start("threads = 1\nlog-level = warn\n");
  o = shared();
  snprintf(key, sizeof key, "bench-ep-d-%d", (int)getpid());
  for (uint32_t r = 0; r < W; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      client_rank(d[r].sock, r, key, ITERS + 1, &o[r]);
      _exit(0);
    }
  }
  wait_all(pids);
  printf("\n2) through mokd and libmok (end to end):\n");
  printf("rank  join ms  fwd ms  bwd ms\n");
  for (uint32_t r = 0; r < W; r++)
    printf("%4u %8.3f %7.1f %7.1f\n", r, 1e3 * o[r].join_s, 1e3 * median(o[r].fwd_s + 1, ITERS),
           1e3 * median(o[r].bwd_s + 1, ITERS));
  rank_out *o2 = shared();
  for (uint32_t r = 0; r < W; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      client_rank(d[r].sock, r, key, 1, &o2[r]);
      _exit(0);
    }
  }
  wait_all(pids);
  printf("\n3) restarted clients (new processes) re-join the group their daemons kept:\n");
  printf("rank  re-join ms  join+layer+first forward ms\n");
  for (uint32_t r = 0; r < W; r++)
    printf("%4u %11.3f %28.1f   (first join %.3f ms, join+layer+first forward %.1f ms)\n", r,
           1e3 * o2[r].join_s, 1e3 * o2[r].first_job_s, 1e3 * o[r].join_s,
           1e3 * o[r].first_job_s);
  for (uint32_t r = 0; r < W; r++) harness_stop(&d[r]);
  return 0;
}
