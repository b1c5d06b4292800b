/* SPDX-License-Identifier: Apache-2.0 */
/* Hostile clients racing their own shared memory (docs/security.md).
 *
 * An attacker session submits every op while a thread of its own keeps
 * rewriting the buffers that steer the daemon's addressing: topk_ids, the
 * schedule a single step brings, the schedule inside a ctx. It flips each
 * between a valid content (so that a check made once passes) and a hostile
 * one (row and slot numbers far outside every buffer, offsets that run
 * past the capacity, ids past E). The daemon copies each such buffer once,
 * checks the copy and reads only the copy, so the attacker can corrupt
 * only its own outputs. Meanwhile a victim session in another process runs
 * the same forward and backward again and again:
 *   - mokd stays up (a crash or an out-of-bounds access under the
 *     sanitizers fails the test);
 *   - the victim's results stay bitwise equal to its results before the
 *     attack, and its canary region is never written;
 *   - no attacker output that the daemon fills by copying rows (dispatch,
 *     combine_backward) ever holds a word of the victim's marker pattern:
 *     no foreign bytes are read;
 *   - a client that connects afterwards is served, with the victim's bits.
 * The counts (races tried, jobs failed, crashes, mismatches, foreign words)
 * are printed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>

#include "harness/daemon.h"
#include "mok.h"
#include "mok_enums.h"

enum { H = 32, I = 16, E = 4, K = 2, IS = 8, T = 24 };
#define VICTIM_MARK 0x3f5a0000u /* high half of every word of the victim's x (~0.85) */
#define ATTACK_SECONDS 3
#define WAIT_MS 10000 /* a job of these sizes takes well under a millisecond */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t rng(uint32_t *s) {
  *s = *s * 1664525u + 1013904223u;
  return *s >> 8;
}

static uint64_t fnv(const void *p, size_t n, uint64_t h) {
  const unsigned char *b = p;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

static mok_layer_desc layer_desc(void) {
  return (mok_layer_desc){.hidden = H, .intermediate = I, .experts = E, .topk = K,
                          .shared_intermediate = IS, .max_tokens = T, .dtype = MOK_DTYPE_F32};
}

/* One tenant's buffers, all in one registered host region. */
typedef struct tenant {
  mok_client *c;
  mok_layer *l;
  size_t ctx_bytes, sched_bytes;
  float *x, *wg, *wu, *wd, *sg, *su, *sd, *rw, *out, *dout;
  int32_t *ids;
  void *ctx;
  float *dx, *dwg, *dwu, *dwd, *dsg, *dsu, *dsd, *drw;
  /* single steps */
  int32_t *sched;
  float *routed_x, *routed_y, *shared_y, *acts, *routed_dout, *routed_dx, *shared_dx;
} tenant;

static void *carve(char **p, size_t bytes) {
  void *r = *p;
  *p += (bytes + 255) & ~(size_t)255;
  return r;
}

static void tenant_open(tenant *t, const char *sock, const char *name, uint32_t seed,
                        uint32_t x_mark) {
  memset(t, 0, sizeof *t);
  CHECK(mok_connect(sock, name, &t->c) == MOK_OK);
  mok_layer_desc d = layer_desc();
  CHECK_MSG(mok_layer_create(t->c, &d, &t->l) == MOK_OK, "%s", mok_last_error());
  t->ctx_bytes = mok_layer_ctx_bytes(t->l, T);
  t->sched_bytes = 4 * mok_layer_schedule_ints(t->l, T);
  size_t R = mok_layer_rows_capacity(t->l, T), acts = mok_layer_acts_bytes(t->l, T);
  size_t f = sizeof(float), w = (size_t)E * I * H * f, sw = (size_t)IS * H * f;
  size_t total = 64 * 256 + 4 * T * H * f + 6 * w + 6 * sw + 3 * T * K * 4 + t->ctx_bytes +
                 t->sched_bytes + 4 * R * H * f + 2 * T * H * f + acts + T * K * f;
  char *m = mok_host_alloc(t->c, total), *p = m;
  CHECK_MSG(m != NULL, "%s", mok_last_error());
  memset(m, 0, total);
  t->x = carve(&p, T * H * f), t->out = carve(&p, T * H * f), t->dout = carve(&p, T * H * f);
  t->dx = carve(&p, T * H * f);
  t->wg = carve(&p, w), t->wu = carve(&p, w), t->wd = carve(&p, w);
  t->dwg = carve(&p, w), t->dwu = carve(&p, w), t->dwd = carve(&p, w);
  t->sg = carve(&p, sw), t->su = carve(&p, sw), t->sd = carve(&p, sw);
  t->dsg = carve(&p, sw), t->dsu = carve(&p, sw), t->dsd = carve(&p, sw);
  t->ids = carve(&p, T * K * 4), t->rw = carve(&p, T * K * f), t->drw = carve(&p, T * K * f);
  t->ctx = carve(&p, t->ctx_bytes), t->sched = carve(&p, t->sched_bytes);
  t->routed_x = carve(&p, R * H * f), t->routed_y = carve(&p, R * H * f);
  t->routed_dout = carve(&p, R * H * f), t->routed_dx = carve(&p, R * H * f);
  t->shared_y = carve(&p, T * H * f), t->shared_dx = carve(&p, T * H * f);
  t->acts = carve(&p, acts);
  CHECK((size_t)(p - m) <= total);
  uint32_t s = seed;
  for (size_t i = 0; i < (size_t)T * H; i++) {
    /* a marked x: high half 0x3f5a, low half never 0. The attacker's x are
     * k/64 (low half 0), so such a word in a row the daemon copied from x is
     * the victim's */
    uint32_t bits = x_mark ? x_mark | (rng(&s) & 0xffffu) | 1u : 0;
    if (x_mark) memcpy(&t->x[i], &bits, 4);
    else t->x[i] = (float)((int)(rng(&s) % 200) - 100) / 64.0f;
    t->dout[i] = (float)((int)(rng(&s) % 200) - 100) / 64.0f;
  }
  float *ws[] = {t->wg, t->wu, t->wd};
  for (int k = 0; k < 3; k++)
    for (size_t i = 0; i < (size_t)E * I * H; i++) ws[k][i] = (float)((int)(rng(&s) % 64) - 32) / 256.0f;
  float *ss[] = {t->sg, t->su, t->sd};
  for (int k = 0; k < 3; k++)
    for (size_t i = 0; i < (size_t)IS * H; i++) ss[k][i] = (float)((int)(rng(&s) % 64) - 32) / 256.0f;
  for (int i = 0; i < T * K; i++) {
    t->ids[i] = (int32_t)((i / K + i % K) % E);
    t->rw[i] = 0.5f;
  }
}

static mok_forward_args fwd_args(tenant *t) {
  return (mok_forward_args){.x = t->x, .w_gate = t->wg, .w_up = t->wu, .w_down = t->wd,
                            .s_gate = t->sg, .s_up = t->su, .s_down = t->sd,
                            .topk_ids = t->ids, .router_weights = t->rw, .out = t->out,
                            .ctx = t->ctx};
}

static mok_backward_args bwd_args(tenant *t) {
  return (mok_backward_args){.x = t->x, .w_gate = t->wg, .w_up = t->wu, .w_down = t->wd,
                             .s_gate = t->sg, .s_up = t->su, .s_down = t->sd, .d_out = t->dout,
                             .topk_ids = t->ids, .router_weights = t->rw, .ctx = t->ctx,
                             .d_x = t->dx, .d_w_gate = t->dwg, .d_w_up = t->dwu,
                             .d_w_down = t->dwd, .d_s_gate = t->dsg, .d_s_up = t->dsu,
                             .d_s_down = t->dsd, .d_router_weights = t->drw};
}

/* One forward (ctx saved) and backward from it; the hash of every output. */
static int victim_round(tenant *t, uint64_t *ret_hash) {
  uint64_t tk;
  mok_forward_args fa = fwd_args(t);
  if (mok_forward(t->l, T, &fa, &tk) != MOK_OK || mok_wait(t->c, tk, WAIT_MS) != MOK_OK) return -1;
  mok_backward_args ba = bwd_args(t);
  if (mok_backward(t->l, T, 0, &ba, &tk) != MOK_OK || mok_wait(t->c, tk, WAIT_MS) != MOK_OK)
    return -1;
  size_t w = (size_t)E * I * H * 4, sw = (size_t)IS * H * 4;
  uint64_t h = 1469598103934665603ull;
  h = fnv(t->out, (size_t)T * H * 4, h);
  h = fnv(t->ctx, t->ctx_bytes, h);
  h = fnv(t->dx, (size_t)T * H * 4, h);
  h = fnv(t->drw, (size_t)T * K * 4, h);
  h = fnv(t->dwg, w, h), h = fnv(t->dwu, w, h), h = fnv(t->dwd, w, h);
  h = fnv(t->dsg, sw, h), h = fnv(t->dsu, sw, h), h = fnv(t->dsd, sw, h);
  *ret_hash = h;
  return 0;
}

/* The victim, in a process of its own: its reference bits alone, then
 * rounds until told to stop; exit 0 when every round matched and its
 * canary region was never written. Reports the reference over `out`. */
static void victim_main(const char *sock, int ready_fd, int stop_fd, int out_fd) {
  tenant v;
  tenant_open(&v, sock, "victim", 7, VICTIM_MARK);
  unsigned char *canary = mok_host_alloc(v.c, 1 << 16);
  if (!canary) _exit(10);
  memset(canary, 0xa5, 1 << 16);
  uint64_t ref = 0, h = 0;
  if (victim_round(&v, &ref) != 0) _exit(11);
  if (write(out_fd, &ref, sizeof ref) != sizeof ref) _exit(12);
  char go = 1;
  if (write(ready_fd, &go, 1) != 1) _exit(12);
  int rounds = 0, mismatches = 0;
  for (;;) {
    char c;
    if (read(stop_fd, &c, 1) == 1) break; /* non-blocking */
    if (victim_round(&v, &h) != 0) _exit(13);
    rounds++;
    if (h != ref) mismatches++;
  }
  for (int i = 0; i < 1 << 16; i++)
    if (canary[i] != 0xa5) _exit(14);
  int counts[2] = {rounds, mismatches};
  if (write(out_fd, counts, sizeof counts) != sizeof counts) _exit(12);
  mok_close(v.c);
  _exit(mismatches ? 15 : 0);
}

/* ---- the attacker ---- */

typedef struct attack {
  tenant *t;
  _Atomic bool stop;
  /* the valid contents its buffers flip back to */
  int32_t *good_ids, *good_sched;
  unsigned char *good_ctx;
  _Atomic uint64_t flips;
} attack;

/* Hostile int32 values: far past every buffer, negative, the edges. */
static int32_t evil(uint32_t *s) {
  static const int32_t v[] = {INT32_MAX, INT32_MIN, -2, 1 << 30, 1 << 20, 65536, T * K, T * K - 1,
                              E, E + 1, -1, 0x7fff0000};
  return v[rng(s) % (sizeof v / sizeof v[0])];
}

static void *flipper_main(void *p) {
  attack *a = p;
  tenant *t = a->t;
  uint32_t s = 99;
  size_t n_ids = (size_t)T * K, n_sched = t->sched_bytes / 4;
  int32_t *ctx_sched = t->ctx;
  while (!atomic_load(&a->stop)) {
    /* valid first, so that a check may pass ... */
    memcpy(t->ids, a->good_ids, n_ids * 4);
    memcpy(t->sched, a->good_sched, n_sched * 4);
    memcpy(t->ctx, a->good_ctx, t->sched_bytes);
    for (volatile int spin = 0; spin < (int)(rng(&s) % 2000); spin++) {}
    /* ... then hostile, while the job may be using it */
    for (int k = 0; k < 16; k++) {
      t->ids[rng(&s) % n_ids] = evil(&s);
      t->sched[rng(&s) % n_sched] = evil(&s);
      ctx_sched[rng(&s) % n_sched] = evil(&s);
    }
    for (volatile int spin = 0; spin < (int)(rng(&s) % 2000); spin++) {}
    atomic_fetch_add(&a->flips, 1);
  }
  return NULL;
}

/* Words of the victim's marker pattern in a buffer the daemon fills by
 * copying rows of x: each one a foreign word read. */
static size_t foreign_words(const float *p, size_t n) {
  size_t found = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t bits;
    memcpy(&bits, &p[i], 4);
    found += (bits & 0xffff0000u) == VICTIM_MARK && (bits & 0xffffu) != 0;
  }
  return found;
}

static void slot_set(mok_tensor *ts, const mok_layer *l, uint32_t slot, const void *data) {
  ts[slot] = mok_tensor_for(l, T, slot, data);
}

/* One job of every kind, each waited for; counts submitted and failed. */
static void attack_round(tenant *t, int *ret_jobs, int *ret_failed, size_t *ret_foreign,
                         int *ret_hung) {
  uint64_t tk;
  int jobs = 0, failed = 0;
#define RUN(expr)                                                            \
  do {                                                                       \
    jobs++;                                                                  \
    int r_ = (expr);                                                         \
    if (r_ == MOK_OK) r_ = mok_wait(t->c, tk, WAIT_MS);                      \
    if (r_ == MOK_ETIMEOUT && mok_job_pending(t->c, tk)) (*ret_hung)++;      \
    if (r_ != MOK_OK) failed++;                                              \
    if (*ret_hung) goto out;                                                 \
  } while (0)
  mok_forward_args fa = fwd_args(t);
  RUN(mok_forward(t->l, T, &fa, &tk));
  mok_backward_args ba = bwd_args(t);
  RUN(mok_backward(t->l, T, 0, &ba, &tk));
  RUN(mok_backward(t->l, T, MOK_JOB_RECOMPUTE, &ba, &tk));
  mok_tensor ts[MOK_SLOT_COUNT_];
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_X, t->x);
  slot_set(ts, t->l, MOK_SLOT_TOPK_IDS, t->ids);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_X, t->routed_x);
  RUN(mok_submit(t->l, MOK_OP_DISPATCH, 0, T, ts, &tk));
  *ret_foreign += foreign_words(t->routed_x, mok_layer_rows_capacity(t->l, T) * H);
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_X, t->routed_x);
  slot_set(ts, t->l, MOK_SLOT_X, t->x);
  slot_set(ts, t->l, MOK_SLOT_W_GATE, t->wg);
  slot_set(ts, t->l, MOK_SLOT_W_UP, t->wu);
  slot_set(ts, t->l, MOK_SLOT_W_DOWN, t->wd);
  slot_set(ts, t->l, MOK_SLOT_S_GATE, t->sg);
  slot_set(ts, t->l, MOK_SLOT_S_UP, t->su);
  slot_set(ts, t->l, MOK_SLOT_S_DOWN, t->sd);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_Y, t->routed_y);
  slot_set(ts, t->l, MOK_SLOT_SHARED_Y, t->shared_y);
  slot_set(ts, t->l, MOK_SLOT_ACTS, t->acts);
  RUN(mok_submit(t->l, MOK_OP_COMPUTE, 0, T, ts, &tk));
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_Y, t->routed_y);
  slot_set(ts, t->l, MOK_SLOT_ROUTER_W, t->rw);
  slot_set(ts, t->l, MOK_SLOT_SHARED_Y, t->shared_y);
  slot_set(ts, t->l, MOK_SLOT_OUT, t->out);
  RUN(mok_submit(t->l, MOK_OP_COMBINE, 0, T, ts, &tk));
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_D_OUT, t->x); /* x again: a row copy of the attacker's own words */
  slot_set(ts, t->l, MOK_SLOT_ROUTED_DOUT, t->routed_dout);
  RUN(mok_submit(t->l, MOK_OP_COMBINE_BWD, 0, T, ts, &tk));
  *ret_foreign += foreign_words(t->routed_dout, mok_layer_rows_capacity(t->l, T) * H);
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_ACTS, t->acts);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_X, t->routed_x);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_DOUT, t->routed_dout);
  slot_set(ts, t->l, MOK_SLOT_ROUTER_W, t->rw);
  slot_set(ts, t->l, MOK_SLOT_W_GATE, t->wg);
  slot_set(ts, t->l, MOK_SLOT_W_UP, t->wu);
  slot_set(ts, t->l, MOK_SLOT_W_DOWN, t->wd);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_DX, t->routed_dx);
  slot_set(ts, t->l, MOK_SLOT_D_RW, t->drw);
  slot_set(ts, t->l, MOK_SLOT_D_W_GATE, t->dwg);
  slot_set(ts, t->l, MOK_SLOT_D_W_UP, t->dwu);
  slot_set(ts, t->l, MOK_SLOT_D_W_DOWN, t->dwd);
  slot_set(ts, t->l, MOK_SLOT_X, t->x);
  slot_set(ts, t->l, MOK_SLOT_D_OUT, t->dout);
  slot_set(ts, t->l, MOK_SLOT_S_GATE, t->sg);
  slot_set(ts, t->l, MOK_SLOT_S_UP, t->su);
  slot_set(ts, t->l, MOK_SLOT_S_DOWN, t->sd);
  slot_set(ts, t->l, MOK_SLOT_SHARED_DX, t->shared_dx);
  slot_set(ts, t->l, MOK_SLOT_D_S_GATE, t->dsg);
  slot_set(ts, t->l, MOK_SLOT_D_S_UP, t->dsu);
  slot_set(ts, t->l, MOK_SLOT_D_S_DOWN, t->dsd);
  RUN(mok_submit(t->l, MOK_OP_COMPUTE_BWD, 0, T, ts, &tk));
  memset(ts, 0, sizeof ts);
  slot_set(ts, t->l, MOK_SLOT_SCHEDULE, t->sched);
  slot_set(ts, t->l, MOK_SLOT_ROUTED_DX, t->routed_dx);
  slot_set(ts, t->l, MOK_SLOT_SHARED_DX, t->shared_dx);
  slot_set(ts, t->l, MOK_SLOT_D_X, t->dx);
  RUN(mok_submit(t->l, MOK_OP_DISPATCH_BWD, 0, T, ts, &tk));
out:
#undef RUN
  *ret_jobs += jobs;
  *ret_failed += failed;
}

static void test_racing_client_harms_no_one(void) {
  daemon_proc d = harness_start(NULL);
  int ready[2], stop[2], out[2];
  CHECK(pipe(ready) == 0 && pipe(stop) == 0 && pipe(out) == 0);
  CHECK(fcntl(stop[0], F_SETFL, O_NONBLOCK) == 0);
  pid_t vp = fork();
  CHECK(vp >= 0);
  if (vp == 0) victim_main(d.sock, ready[1], stop[0], out[1]);
  close(ready[1]), close(stop[0]), close(out[1]); /* the victim's ends: EOF when it dies */
  uint64_t ref = 0;
  char go;
  CHECK(read(out[0], &ref, sizeof ref) == sizeof ref);
  CHECK(read(ready[0], &go, 1) == 1);

  /* the attacker's valid contents: a forward's ctx, a dispatch's schedule */
  tenant t;
  tenant_open(&t, d.sock, "attacker", 3, 0);
  attack a = {.t = &t};
  a.good_ids = malloc((size_t)T * K * 4);
  a.good_sched = malloc(t.sched_bytes);
  a.good_ctx = malloc(t.sched_bytes);
  CHECK(a.good_ids && a.good_sched && a.good_ctx);
  memcpy(a.good_ids, t.ids, (size_t)T * K * 4);
  uint64_t tk;
  mok_forward_args fa = fwd_args(&t);
  CHECK(mok_forward(t.l, T, &fa, &tk) == MOK_OK && mok_wait(t.c, tk, WAIT_MS) == MOK_OK);
  memcpy(a.good_ctx, t.ctx, t.sched_bytes);
  memcpy(a.good_sched, t.ctx, t.sched_bytes); /* a dispatch builds the same schedule */

  pthread_t flipper;
  CHECK(pthread_create(&flipper, NULL, flipper_main, &a) == 0);
  int jobs = 0, failed = 0, hung = 0;
  size_t foreign = 0;
  uint64_t until = now_ns() + ATTACK_SECONDS * 1000000000ull;
  while (now_ns() < until && harness_alive(&d) && !hung)
    attack_round(&t, &jobs, &failed, &foreign, &hung);
  atomic_store(&a.stop, true);
  pthread_join(flipper, NULL);
  int crashed = !harness_alive(&d);
  if (crashed || hung) kill(vp, SIGKILL);

  signal(SIGPIPE, SIG_IGN); /* the victim may be gone already */
  CHECK(write(stop[1], &go, 1) == 1 || crashed || hung);
  int counts[2] = {-1, -1}, st;
  CHECK(read(out[0], counts, sizeof counts) == sizeof counts || crashed || hung);
  waitpid(vp, &st, 0);
  printf("# races tried: %d jobs (%llu buffer flips), %d failed their checks; crashes %d, "
         "hung jobs %d; victim: %d rounds, %d mismatches; foreign words read %zu\n",
         jobs, (unsigned long long)atomic_load(&a.flips), failed, crashed, hung, counts[0],
         counts[1], foreign);
  CHECK_MSG(!crashed, "mokd died under the attack:\n%s", harness_log(&d));
  CHECK_MSG(!hung, "a job of the attacker did not finish within %d ms", WAIT_MS);
  CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "victim failed (exit %d)",
            WIFEXITED(st) ? WEXITSTATUS(st) : -1);
  CHECK(counts[0] > 0);
  CHECK_EQ_INT(counts[1], 0);
  CHECK_EQ_INT(foreign, 0);
  CHECK(jobs > 50);

  /* a client that comes afterwards is served, with the victim's bits */
  tenant late;
  tenant_open(&late, d.sock, "late", 7, VICTIM_MARK);
  uint64_t h = 0;
  CHECK(victim_round(&late, &h) == 0);
  CHECK(h == ref);
  mok_close(late.c);
  mok_close(t.c);
  free(a.good_ids);
  free(a.good_sched);
  free(a.good_ctx);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_racing_client_harms_no_one),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
