/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine against the float64 reference, and its bitwise promises.
 *
 *  - ref64 itself against central finite differences;
 *  - every op's outputs and every gradient against ref64 (f32 < 1e-5,
 *    bf16 < 1e-2 relative) over shapes that exercise odd T, ragged H and I,
 *    idle experts, one hot expert, dropped slots, K=1, the clamp, a shared
 *    expert with I_s != I, rw = 0, a local expert window;
 *  - outputs poisoned before each run, so an element never written fails;
 *  - bitwise: 1, 2, 3 threads; recompute vs saved ctx; single-step chain vs
 *    whole layer;
 *  - bad routing ids, corrupted schedules and contexts, missing tensors.
 *
 * Jobs are built by hand as the daemon would hand them over (mok_job_args
 * with mok_tensor_view entries).
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "common/fp8_e4m3.h"
#include "harness/check.h"
#include "engine.h"
#include "ref64.h"
#include "ref_fp8.h"
#include "mok_slots.h"
#include "schedule.h"

#define F32_TOL 1e-5
#define BF16_TOL 1e-2
#define POISON 0xff /* NaN in f32 and bf16 */

/* ---- small utilities ------------------------------------------------------ */

static void *xmalloc(size_t n) {
  void *p = malloc(n ? n : 1);
  CHECK_MSG(p, "out of memory (%zu bytes)", n);
  return p;
}

static void *xcalloc(size_t n) {
  void *p = calloc(1, n ? n : 1);
  CHECK_MSG(p, "out of memory (%zu bytes)", n);
  return p;
}

static void *dup_bytes(const void *src, size_t n) {
  void *p = xmalloc(n);
  memcpy(p, src, n);
  return p;
}

typedef struct rng {
  uint64_t s;
} rng;

static uint64_t rng_next(rng *r) {
  r->s ^= r->s << 13;
  r->s ^= r->s >> 7;
  r->s ^= r->s << 17;
  return r->s;
}

static double rng_uniform(rng *r, double lo, double hi) {
  return lo + (hi - lo) * (double)(rng_next(r) >> 11) * (1.0 / 9007199254740992.0);
}

/* An element of a tensor of dt (an fp8 layer's activations are bf16). */
static size_t esize(uint32_t dt) { return mok_dtype_size(mok_layer_act_dtype(dt)); }

/* Layer-dtype buffer from doubles (rounded as the engine stores them). */
static void *to_layer(uint32_t dt, const double *src, size_t n) {
  void *p = xmalloc(n * esize(dt));
  for (size_t i = 0; i < n; i++) {
    if (dt == MOK_DTYPE_F32)
      ((float *)p)[i] = (float)src[i];
    else
      ((mok_bf16 *)p)[i] = mok_f32_to_bf16((float)src[i]);
  }
  return p;
}

static double *from_layer(uint32_t dt, const void *p, size_t n) {
  double *d = xmalloc(n * sizeof *d);
  for (size_t i = 0; i < n; i++)
    d[i] = dt == MOK_DTYPE_F32 ? (double)((const float *)p)[i]
                               : (double)mok_bf16_to_f32(((const mok_bf16 *)p)[i]);
  return d;
}

static double *from_f32(const float *p, size_t n) { return from_layer(MOK_DTYPE_F32, p, n); }

/* ---- a problem: the layer, its inputs, and their engine copies ------------ */

enum routing {
  ROUTE_RANDOM,   /* K distinct experts per token */
  ROUTE_DROPS,    /* random, with -1 slots (one token fully dropped) */
  ROUTE_IDLE,     /* only even experts used */
  ROUTE_ONE,      /* every slot on one expert */
};

typedef struct spec {
  int T, H, I, E, E_loc, first, K, Is;
  uint32_t dtype;
  int has_limit;
  double limit;
  enum routing route;
  int rw_zero;   /* some router weights exactly 0 */
  int quantized; /* inputs on a coarse grid: clamp masks exact in bf16 */
  uint64_t seed;
} spec;

typedef struct problem {
  spec s;
  mok_layer_config cfg;
  ref64_layer ref;
  size_t n_x, n_tk, n_w, n_s; /* T*H, T*K, E_loc*I*H, I_s*H */
  /* inputs as the engine sees them, and the same values in double */
  double *x, *rw, *wg, *wu, *wd, *sg, *su, *sd, *dout;
  int32_t *ids;
  void *x_l, *wg_l, *wu_l, *wd_l, *sg_l, *su_l, *sd_l, *dout_l;
  float *rw_f;
  /* fp8 layers: the weights' packed forms, by slot - MOK_SLOT_W_GATE
   * (quantize_weight of the bf16 masters above, in engine_prepare) */
  void *packed[6];
  size_t packed_bytes[6];
} problem;

/* Values in [-1, 1] or on the grid {-4..4}/8 (quantized). */
static void fill(rng *r, double *p, size_t n, double scale, int quantized) {
  for (size_t i = 0; i < n; i++)
    p[i] = quantized ? (double)((int)(rng_next(r) % 9) - 4) / 8.0 * scale
                     : rng_uniform(r, -1.0, 1.0) * scale;
}

static void make_routing(problem *p, rng *r) {
  const spec *s = &p->s;
  for (int t = 0; t < s->T; t++) {
    int32_t *row = p->ids + (size_t)t * s->K;
    for (int k = 0; k < s->K; k++) {
      int32_t id;
      int fresh;
      do { /* distinct experts per token, as top-k gives */
        if (s->route == ROUTE_IDLE)
          id = (int32_t)(2 * (rng_next(r) % (uint64_t)((s->E + 1) / 2)));
        else
          id = (int32_t)(rng_next(r) % (uint64_t)s->E);
        fresh = 1;
        for (int j = 0; j < k; j++) fresh &= row[j] != id;
      } while (!fresh && s->K <= (s->route == ROUTE_IDLE ? (s->E + 1) / 2 : s->E));
      row[k] = id;
    }
    if (s->route == ROUTE_ONE)
      for (int k = 0; k < s->K; k++) row[k] = s->first + s->E_loc - 1;
    if (s->route == ROUTE_DROPS) {
      if (t == 1)
        for (int k = 0; k < s->K; k++) row[k] = -1;
      else if (rng_next(r) % 3 == 0)
        row[rng_next(r) % (uint64_t)s->K] = -1;
    }
  }
}

/* Quantise doubles through the layer dtype and keep both forms. */
static void keep_layer(const problem *p, double *d, size_t n, void **ret_l) {
  *ret_l = to_layer(p->s.dtype, d, n);
  double *q = from_layer(p->s.dtype, *ret_l, n);
  memcpy(d, q, n * sizeof *d);
  free(q);
}

static problem *problem_make(const spec *s) {
  problem *p = xcalloc(sizeof *p);
  p->s = *s;
  mok_layer_config *c = &p->cfg;
  c->hidden = (uint32_t)s->H;
  c->intermediate = (uint32_t)s->I;
  c->experts = (uint32_t)s->E;
  c->local_experts = (uint32_t)s->E_loc;
  c->first_expert = (uint32_t)s->first;
  c->topk = (uint32_t)s->K;
  c->shared_intermediate = (uint32_t)s->Is;
  c->max_tokens = (uint32_t)(s->T + 3);
  c->dtype = s->dtype;
  c->row_align = 1;
  c->has_limit = s->has_limit;
  c->swiglu_limit = (float)s->limit;
  p->ref = (ref64_layer){s->T, s->H, s->I, s->E, s->E_loc, s->first, s->K, s->Is,
                         s->has_limit, (double)(float)s->limit};
  p->n_x = (size_t)s->T * s->H;
  p->n_tk = (size_t)s->T * s->K;
  p->n_w = (size_t)s->E_loc * s->I * s->H;
  p->n_s = (size_t)s->Is * s->H;

  rng r = {s->seed * 0x9e3779b97f4a7c15ull + 1};
  p->x = xmalloc(p->n_x * sizeof(double));
  p->dout = xmalloc(p->n_x * sizeof(double));
  p->rw = xmalloc(p->n_tk * sizeof(double));
  p->ids = xmalloc(p->n_tk * sizeof(int32_t));
  p->wg = xmalloc(p->n_w * sizeof(double));
  p->wu = xmalloc(p->n_w * sizeof(double));
  p->wd = xmalloc(p->n_w * sizeof(double));
  fill(&r, p->x, p->n_x, 1.0, s->quantized);
  fill(&r, p->dout, p->n_x, 1.0, 0);
  /* pre-activations of order 1; quantized: x on 1/8, weights on 1/16, so g
   * and u lie on 1/128 and are exact in bf16 below 2 */
  double gain = s->quantized ? 0.5 : 2.0 / sqrt(s->H);
  fill(&r, p->wg, p->n_w, gain, s->quantized);
  fill(&r, p->wu, p->n_w, gain, s->quantized);
  fill(&r, p->wd, p->n_w, 1.0 / sqrt(s->I), 0);
  for (size_t i = 0; i < p->n_tk; i++) {
    p->rw[i] = rng_uniform(&r, 0.05, 1.0);
    if (s->rw_zero && i % 3 == 1) p->rw[i] = 0.0;
  }
  make_routing(p, &r);
  if (s->Is) {
    p->sg = xmalloc(p->n_s * sizeof(double));
    p->su = xmalloc(p->n_s * sizeof(double));
    p->sd = xmalloc(p->n_s * sizeof(double));
    fill(&r, p->sg, p->n_s, gain, s->quantized);
    fill(&r, p->su, p->n_s, gain, s->quantized);
    fill(&r, p->sd, p->n_s, 1.0 / sqrt(s->Is), 0);
    keep_layer(p, p->sg, p->n_s, &p->sg_l);
    keep_layer(p, p->su, p->n_s, &p->su_l);
    keep_layer(p, p->sd, p->n_s, &p->sd_l);
  }
  keep_layer(p, p->x, p->n_x, &p->x_l);
  keep_layer(p, p->dout, p->n_x, &p->dout_l);
  keep_layer(p, p->wg, p->n_w, &p->wg_l);
  keep_layer(p, p->wu, p->n_w, &p->wu_l);
  keep_layer(p, p->wd, p->n_w, &p->wd_l);
  p->rw_f = xmalloc(p->n_tk * sizeof(float));
  for (size_t i = 0; i < p->n_tk; i++) {
    p->rw_f[i] = (float)p->rw[i];
    p->rw[i] = p->rw_f[i];
  }
  return p;
}

static ref64_inputs ref_inputs(const problem *p) {
  ref64_inputs in = {p->x, p->rw, p->wg, p->wu, p->wd, p->sg, p->su, p->sd, p->ids};
  return in;
}

static mok_layout_dims dims_of(const problem *p) {
  return mok_layer_dims(&p->cfg, (uint32_t)p->s.T);
}
static size_t rows_cap(const problem *p) {
  mok_layout_dims d = dims_of(p);
  return (size_t)mok_rows_capacity(&d);
}
static size_t ctx_bytes(const problem *p) {
  mok_layout_dims d = dims_of(p);
  return (size_t)mok_ctx_bytes(&d);
}
static size_t acts_bytes(const problem *p) {
  mok_layout_dims d = dims_of(p);
  return (size_t)mok_acts_bytes(&d);
}
static size_t sched_ints(const problem *p) {
  mok_layout_dims d = dims_of(p);
  return (size_t)mok_schedule_ints(&d);
}

/* ---- engines and jobs ------------------------------------------------------ */

static mok_engine *engine_open(int threads) {
  mok_engine_config ec = {.device = 0, .threads = threads};
  mok_engine *e = NULL;
  char err[128];
  int st = mok_engine_cpu.open(&ec, &e, err, sizeof err);
  CHECK_MSG(st == MOK_OK && e, "open: %s", err);
  return e;
}

static void fp8_pack(mok_engine *e, problem *p);

/* Prepares the layer; an fp8 problem's weights are quantised then, as a
 * trainer does after each optimizer step. */
static void engine_prepare(mok_engine *e, problem *p) {
  char err[128];
  int st = mok_engine_cpu.prepare_layer(e, &p->cfg, err, sizeof err);
  CHECK_MSG(st == MOK_OK, "prepare_layer: %s", err);
  CHECK_EQ_INT(p->cfg.row_align, 1);
  if (p->s.dtype == MOK_DTYPE_FP8_E4M3) fp8_pack(e, p);
}

static void job_init(mok_job_args *a, const problem *p, uint32_t op, uint32_t flags) {
  memset(a, 0, sizeof *a);
  a->op = op;
  a->flags = flags;
  a->tokens = (uint32_t)p->s.T;
  a->layer = &p->cfg;
}

/* Tensor of n elements of dtype dt (the daemon gives resolved views); an
 * fp8 layer's dtype names its bf16 activations. */
static void put(mok_job_args *a, int slot, const void *ptr, size_t n, uint32_t dt) {
  mok_tensor_view *v = &a->t[slot];
  v->ptr = (void *)ptr;
  v->bytes = (uint64_t)n * esize(dt);
  v->dtype = mok_layer_act_dtype(dt);
  v->ndim = 1;
  v->shape[0] = (uint32_t)n;
}

static void put_weights(mok_job_args *a, const problem *p) {
  uint32_t dt = p->s.dtype;
  if (dt == MOK_DTYPE_FP8_E4M3) {
    for (int i = 0; i < (p->s.Is ? 6 : 3); i++)
      put(a, MOK_SLOT_W_GATE + i, p->packed[i], p->packed_bytes[i], MOK_DTYPE_U8);
    return;
  }
  put(a, MOK_SLOT_W_GATE, p->wg_l, p->n_w, dt);
  put(a, MOK_SLOT_W_UP, p->wu_l, p->n_w, dt);
  put(a, MOK_SLOT_W_DOWN, p->wd_l, p->n_w, dt);
  if (p->s.Is) {
    put(a, MOK_SLOT_S_GATE, p->sg_l, p->n_s, dt);
    put(a, MOK_SLOT_S_UP, p->su_l, p->n_s, dt);
    put(a, MOK_SLOT_S_DOWN, p->sd_l, p->n_s, dt);
  }
}

static mok_engine_result run_job(mok_engine *e, const mok_job_args *a) {
  mok_engine_result res;
  memset(&res, 0x5a, sizeof res);
  mok_engine_run(&mok_engine_cpu, e, a, &res);
  CHECK(memchr(res.message, 0, sizeof res.message) != NULL);
  return res;
}

static void run_ok(mok_engine *e, const mok_job_args *a) {
  mok_engine_result res = run_job(e, a);
  CHECK_MSG(res.status == MOK_OK, "job %u failed: status %d: %s", a->op, res.status, res.message);
}

/* Everything forward + backward produce. */
typedef struct results {
  void *out, *ctx, *d_x, *d_wg, *d_wu, *d_wd, *d_sg, *d_su, *d_sd;
  float *d_rw;
} results;

static void *poisoned(size_t bytes, int byte) {
  void *p = xmalloc(bytes);
  memset(p, byte, bytes);
  return p;
}

static void results_alloc(results *r, const problem *p, int ctx_poison) {
  size_t es = esize(p->s.dtype);
  r->out = poisoned(p->n_x * es, POISON);
  r->ctx = poisoned(ctx_bytes(p), ctx_poison);
  r->d_x = poisoned(p->n_x * es, POISON);
  r->d_rw = poisoned(p->n_tk * sizeof(float), POISON);
  r->d_wg = poisoned(p->n_w * es, POISON);
  r->d_wu = poisoned(p->n_w * es, POISON);
  r->d_wd = poisoned(p->n_w * es, POISON);
  r->d_sg = p->s.Is ? poisoned(p->n_s * es, POISON) : NULL;
  r->d_su = p->s.Is ? poisoned(p->n_s * es, POISON) : NULL;
  r->d_sd = p->s.Is ? poisoned(p->n_s * es, POISON) : NULL;
}

static void results_free(results *r) {
  free(r->out);
  free(r->ctx);
  free(r->d_x);
  free(r->d_rw);
  free(r->d_wg);
  free(r->d_wu);
  free(r->d_wd);
  free(r->d_sg);
  free(r->d_su);
  free(r->d_sd);
}

static void forward_job(mok_job_args *a, const problem *p, results *r, int with_ctx) {
  uint32_t dt = p->s.dtype;
  job_init(a, p, MOK_OP_FORWARD, 0);
  put(a, MOK_SLOT_X, p->x_l, p->n_x, dt);
  put(a, MOK_SLOT_TOPK_IDS, p->ids, p->n_tk, MOK_DTYPE_I32);
  put(a, MOK_SLOT_ROUTER_W, p->rw_f, p->n_tk, MOK_DTYPE_F32);
  put_weights(a, p);
  put(a, MOK_SLOT_OUT, r->out, p->n_x, dt);
  if (with_ctx) put(a, MOK_SLOT_CTX, r->ctx, ctx_bytes(p), MOK_DTYPE_U8);
}

static void backward_job(mok_job_args *a, const problem *p, results *r, uint32_t flags,
                         int with_ctx) {
  uint32_t dt = p->s.dtype;
  job_init(a, p, MOK_OP_BACKWARD, flags);
  put(a, MOK_SLOT_X, p->x_l, p->n_x, dt);
  if (flags & MOK_JOB_RECOMPUTE) put(a, MOK_SLOT_TOPK_IDS, p->ids, p->n_tk, MOK_DTYPE_I32);
  put(a, MOK_SLOT_ROUTER_W, p->rw_f, p->n_tk, MOK_DTYPE_F32);
  put_weights(a, p);
  if (with_ctx) put(a, MOK_SLOT_CTX, r->ctx, ctx_bytes(p), MOK_DTYPE_U8);
  put(a, MOK_SLOT_D_OUT, p->dout_l, p->n_x, dt);
  put(a, MOK_SLOT_D_X, r->d_x, p->n_x, dt);
  put(a, MOK_SLOT_D_RW, r->d_rw, p->n_tk, MOK_DTYPE_F32);
  put(a, MOK_SLOT_D_W_GATE, r->d_wg, p->n_w, dt);
  put(a, MOK_SLOT_D_W_UP, r->d_wu, p->n_w, dt);
  put(a, MOK_SLOT_D_W_DOWN, r->d_wd, p->n_w, dt);
  if (p->s.Is) {
    put(a, MOK_SLOT_D_S_GATE, r->d_sg, p->n_s, dt);
    put(a, MOK_SLOT_D_S_UP, r->d_su, p->n_s, dt);
    put(a, MOK_SLOT_D_S_DOWN, r->d_sd, p->n_s, dt);
  }
}

/* forward (with ctx) then backward from that ctx, into fresh poisoned results */
static void run_layer(mok_engine *e, const problem *p, results *r, int ctx_poison) {
  mok_job_args a;
  results_alloc(r, p, ctx_poison);
  forward_job(&a, p, r, 1);
  run_ok(e, &a);
  backward_job(&a, p, r, 0, 1);
  run_ok(e, &a);
}

/* ---- comparison with ref64 ------------------------------------------------- */

static void expect_close(const char *what, const double *ref, const double *got, size_t n,
                         double tol) {
  double err = ref64_rel_err(ref, got, n);
  if (getenv("TEST_VERBOSE")) fprintf(stderr, "    %-18s rel err %.3g\n", what, err);
  CHECK_MSG(err < tol, "%s: relative error %.3g exceeds %.1g", what, err, tol);
}

static void expect_layer_close(const char *what, uint32_t dt, const double *ref, const void *got,
                               size_t n, double tol) {
  double *g = from_layer(dt, got, n);
  expect_close(what, ref, g, n, tol);
  free(g);
}

typedef struct ref_results {
  double *out, *d_x, *d_rw, *d_wg, *d_wu, *d_wd, *d_sg, *d_su, *d_sd;
} ref_results;

static void ref_run(const problem *p, ref_results *rr) {
  ref64_inputs in = ref_inputs(p);
  rr->out = xmalloc(p->n_x * sizeof(double));
  rr->d_x = xmalloc(p->n_x * sizeof(double));
  rr->d_rw = xmalloc(p->n_tk * sizeof(double));
  rr->d_wg = xmalloc(p->n_w * sizeof(double));
  rr->d_wu = xmalloc(p->n_w * sizeof(double));
  rr->d_wd = xmalloc(p->n_w * sizeof(double));
  rr->d_sg = p->s.Is ? xmalloc(p->n_s * sizeof(double)) : NULL;
  rr->d_su = p->s.Is ? xmalloc(p->n_s * sizeof(double)) : NULL;
  rr->d_sd = p->s.Is ? xmalloc(p->n_s * sizeof(double)) : NULL;
  ref64_forward(&p->ref, &in, rr->out);
  ref64_backward(&p->ref, &in, p->dout, rr->d_x, rr->d_rw, rr->d_wg, rr->d_wu, rr->d_wd, rr->d_sg,
                 rr->d_su, rr->d_sd);
}

static void expect_matches_ref(const problem *p, const results *r, const ref_results *rr) {
  const uint32_t dt = p->s.dtype;
  const double tol = dt == MOK_DTYPE_F32 ? F32_TOL : BF16_TOL;
  expect_layer_close("out", dt, rr->out, r->out, p->n_x, tol);
  expect_layer_close("d_x", dt, rr->d_x, r->d_x, p->n_x, tol);
  double *drw = from_f32(r->d_rw, p->n_tk);
  expect_close("d_router_weights", rr->d_rw, drw, p->n_tk, tol);
  free(drw);
  expect_layer_close("d_w_gate", dt, rr->d_wg, r->d_wg, p->n_w, tol);
  expect_layer_close("d_w_up", dt, rr->d_wu, r->d_wu, p->n_w, tol);
  expect_layer_close("d_w_down", dt, rr->d_wd, r->d_wd, p->n_w, tol);
  if (p->s.Is) {
    expect_layer_close("d_s_gate", dt, rr->d_sg, r->d_sg, p->n_s, tol);
    expect_layer_close("d_s_up", dt, rr->d_su, r->d_su, p->n_s, tol);
    expect_layer_close("d_s_down", dt, rr->d_sd, r->d_sd, p->n_s, tol);
  }
}

/* A problem of s on a fresh engine of `threads`, prepared, its layer run into r. */
static problem *run_fresh(const spec *s, int threads, mok_engine **ret_e, results *r,
                          int ctx_poison) {
  problem *p = problem_make(s);
  *ret_e = engine_open(threads);
  engine_prepare(*ret_e, p);
  run_layer(*ret_e, p, r, ctx_poison);
  return p;
}

/* Runs the layer on a 2-thread engine and holds every output against ref64. */
static void check_against_ref(const spec *s) {
  mok_engine *e;
  results r;
  problem *p = run_fresh(s, 2, &e, &r, 0xa5);
  ref_results rr;
  ref_run(p, &rr);
  expect_matches_ref(p, &r, &rr);
  results_free(&r);
  mok_engine_cpu.close(e);
}

/* ---- ref64 against finite differences ------------------------------------- */

/* loss = Σ out · d_out; returns its numerical derivative in one parameter. */
static double fd_loss(const ref64_layer *L, ref64_inputs *in, const double *dout, double *param,
                      double h) {
  size_t n = (size_t)L->T * L->H;
  double *out = xmalloc(n * sizeof *out);
  double saved = *param, lp = 0.0, lm = 0.0;
  *param = saved + h;
  ref64_forward(L, in, out);
  for (size_t i = 0; i < n; i++) lp += out[i] * dout[i];
  *param = saved - h;
  ref64_forward(L, in, out);
  for (size_t i = 0; i < n; i++) lm += out[i] * dout[i];
  *param = saved;
  free(out);
  return (lp - lm) / (2.0 * h);
}

static void fd_check_array(const char *what, const ref64_layer *L, ref64_inputs *in,
                           const double *dout, double *param, const double *grad, size_t n) {
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < n; i++) {
    double fd = fd_loss(L, in, dout, &param[i], 1e-6);
    num += (fd - grad[i]) * (fd - grad[i]);
    den += grad[i] * grad[i];
  }
  CHECK_MSG(den > 0.0, "%s: gradient is all zero", what);
  CHECK_MSG(sqrt(num / den) < 1e-6, "%s: finite differences disagree (rel %.3g)", what,
            sqrt(num / den));
}

static void test_ref64_finite_differences(void) {
  /* tiny layer: local experts 1..3 of 4, dropped slot, shared expert, clamp */
  spec s = {.T = 3, .H = 5, .I = 3, .E = 4, .E_loc = 3, .first = 1, .K = 2, .Is = 2,
            .dtype = MOK_DTYPE_F32, .has_limit = 1, .limit = 0.4, .seed = 7};
  problem *p = problem_make(&s);
  p->ids[0] = 1, p->ids[1] = 3, p->ids[2] = 2, p->ids[3] = -1, p->ids[4] = 0, p->ids[5] = 1;
  ref64_inputs in = ref_inputs(p);
  ref_results rr;
  ref_run(p, &rr);
  fd_check_array("d_x", &p->ref, &in, p->dout, p->x, rr.d_x, p->n_x);
  fd_check_array("d_rw", &p->ref, &in, p->dout, p->rw, rr.d_rw, p->n_tk);
  fd_check_array("d_w_gate", &p->ref, &in, p->dout, p->wg, rr.d_wg, p->n_w);
  fd_check_array("d_w_up", &p->ref, &in, p->dout, p->wu, rr.d_wu, p->n_w);
  fd_check_array("d_w_down", &p->ref, &in, p->dout, p->wd, rr.d_wd, p->n_w);
  fd_check_array("d_s_gate", &p->ref, &in, p->dout, p->sg, rr.d_sg, p->n_s);
  fd_check_array("d_s_up", &p->ref, &in, p->dout, p->su, rr.d_su, p->n_s);
  fd_check_array("d_s_down", &p->ref, &in, p->dout, p->sd, rr.d_sd, p->n_s);
  /* slot (1,1) is dropped, slot (2,0) is not local (expert 0): no gradient */
  CHECK(rr.d_rw[3] == 0.0 && rr.d_rw[4] == 0.0);
}

/* ---- against ref64 ------------------------------------------------------------ */

static void test_f32_basic(void) {
  spec s = {.T = 33, .H = 64, .I = 48, .E = 6, .E_loc = 6, .K = 2, .dtype = MOK_DTYPE_F32,
            .seed = 1};
  check_against_ref(&s);
}

static void test_bf16_basic(void) {
  spec s = {.T = 33, .H = 64, .I = 48, .E = 6, .E_loc = 6, .K = 2, .dtype = MOK_DTYPE_BF16,
            .seed = 2};
  check_against_ref(&s);
}

/* shared expert with I_s != I, local window of experts 2..5 of 8 */
static void test_shared_and_window(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 29, .H = 40, .I = 24, .E = 8, .E_loc = 4, .first = 2, .K = 3, .Is = 56,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .seed = 3};
    check_against_ref(&s);
  }
}

/* H and I not multiples of the 8-wide tiles, T not of the 4-row tiles */
static void test_ragged_shapes(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 7, .H = 21, .I = 13, .E = 3, .E_loc = 3, .K = 2, .Is = 5,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .seed = 4};
    check_against_ref(&s);
  }
}

/* large enough that every GEMM splits into several row and column blocks.
 * The clamp only on f32: with continuous inputs, bf16 rounding of g flips
 * the clamp mask of the few values within 0.4% of L (test_clamp covers bf16
 * with inputs on a grid). */
static void test_multi_block_shapes(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 100, .H = 300, .I = 136, .E = 3, .E_loc = 3, .K = 2, .Is = 72,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .has_limit = !bf, .limit = 1.5,
              .seed = 30};
    check_against_ref(&s);
  }
}

static void test_idle_experts(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 25, .H = 32, .I = 16, .E = 7, .E_loc = 7, .K = 2,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .route = ROUTE_IDLE, .seed = 5};
    check_against_ref(&s);
  }
}

/* every slot of every token on one expert (twice per token: K=2) */
static void test_one_expert(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 19, .H = 32, .I = 24, .E = 5, .E_loc = 4, .first = 1, .K = 2, .Is = 8,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .route = ROUTE_ONE, .seed = 6};
    check_against_ref(&s);
  }
}

static void test_dropped_slots(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 31, .H = 32, .I = 24, .E = 4, .E_loc = 4, .K = 3, .Is = 16,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .route = ROUTE_DROPS, .seed = 7};
    check_against_ref(&s);
  }
}

static void test_topk_one(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 17, .H = 24, .I = 16, .E = 4, .E_loc = 4, .K = 1,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .seed = 8};
    check_against_ref(&s);
  }
}

/* rw = 0 on a third of the slots: their d_rw is still <W_d^T d_out, h> */
static void test_router_weight_zero(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 21, .H = 32, .I = 16, .E = 4, .E_loc = 4, .K = 2, .Is = 8,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .rw_zero = 1, .seed = 9};
    problem *p = problem_make(&s);
    mok_engine *e = engine_open(2);
    engine_prepare(e, p);
    results r;
    run_layer(e, p, &r, 0);
    ref_results rr;
    ref_run(p, &rr);
    expect_matches_ref(p, &r, &rr);
    /* the rw = 0 slots on their own */
    double *want = xmalloc(p->n_tk * sizeof(double)), *got = xmalloc(p->n_tk * sizeof(double));
    size_t n = 0;
    for (size_t i = 0; i < p->n_tk; i++) {
      if (p->rw[i] != 0.0 || p->ids[i] < 0) continue;
      CHECK(rr.d_rw[i] != 0.0);
      want[n] = rr.d_rw[i];
      got[n++] = r.d_rw[i];
    }
    CHECK(n > 5);
    expect_close("d_rw where rw = 0", want, got, n, bf ? BF16_TOL : F32_TOL);
    mok_engine_cpu.close(e);
  }
}

/* Fraction of local (routed and shared) pre-activations the clamp changes. */
static double clamp_fraction(const problem *p) {
  const spec *s = &p->s;
  size_t bitten = 0, total = 0;
  for (int t = 0; t < s->T; t++)
    for (int k = 0; k <= s->K; k++) {
      const double *wg, *wu;
      int n;
      if (k == s->K) {
        if (!s->Is) continue;
        wg = p->sg, wu = p->su, n = s->Is;
      } else {
        int e = p->ids[t * s->K + k] - s->first;
        if (p->ids[t * s->K + k] < 0 || e < 0 || e >= s->E_loc) continue;
        wg = p->wg + (size_t)e * s->I * s->H, wu = p->wu + (size_t)e * s->I * s->H, n = s->I;
      }
      for (int i = 0; i < n; i++) {
        double g = 0, u = 0;
        for (int h = 0; h < s->H; h++) {
          g += p->x[t * s->H + h] * wg[i * s->H + h];
          u += p->x[t * s->H + h] * wu[i * s->H + h];
        }
        bitten += (g > s->limit) + (fabs(u) > s->limit);
        total += 2;
      }
    }
  return (double)bitten / (double)total;
}

/* Inputs on a grid so g and u are exact in bf16 (below 2); the limit sits
 * between grid points, so the clamp masks agree exactly with ref64. */
static void test_clamp(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 23, .H = 32, .I = 24, .E = 4, .E_loc = 4, .K = 2, .Is = 12,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .has_limit = 1,
              .limit = 0.25 + 1.0 / 256, .quantized = 1, .seed = 10};
    problem *p = problem_make(&s);
    double frac = clamp_fraction(p);
    CHECK_MSG(frac > 0.1, "the clamp changes only %.3f of the pre-activations", frac);
    mok_engine *e = engine_open(2);
    engine_prepare(e, p);
    results r;
    run_layer(e, p, &r, 0);
    ref_results rr;
    ref_run(p, &rr);
    expect_matches_ref(p, &r, &rr);
    /* and the clamp matters: without it the reference is far from the engine */
    p->ref.has_limit = 0;
    ref_results unclamped;
    ref_run(p, &unclamped);
    double *out = from_layer(p->s.dtype, r.out, p->n_x);
    CHECK(ref64_rel_err(unclamped.out, out, p->n_x) > 0.05);
    double *dwg = from_layer(p->s.dtype, r.d_wg, p->n_w);
    CHECK(ref64_rel_err(unclamped.d_wg, dwg, p->n_w) > 0.05);
    mok_engine_cpu.close(e);
  }
}

/* T = 0: nothing routed, every weight gradient zero */
static void test_no_tokens(void) {
  spec s = {.T = 0, .H = 16, .I = 8, .E = 2, .E_loc = 2, .K = 2, .Is = 4,
            .dtype = MOK_DTYPE_BF16, .seed = 11};
  problem *p = problem_make(&s);
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  results r;
  run_layer(e, p, &r, 0);
  for (size_t i = 0; i < p->n_w; i++) CHECK(((mok_bf16 *)r.d_wd)[i] == 0);
  for (size_t i = 0; i < p->n_s; i++) CHECK(((mok_bf16 *)r.d_sg)[i] == 0);
  mok_engine_cpu.close(e);
}

/* T = 0 with the empty tensors handed over as NULL (f32: no widening copy) */
static void test_no_tokens_null_tensors(void) {
  spec s = {.T = 0, .H = 16, .I = 8, .E = 2, .E_loc = 2, .K = 2, .Is = 4,
            .dtype = MOK_DTYPE_F32, .seed = 11};
  problem *p = problem_make(&s);
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  results r;
  results_alloc(&r, p, 0);
  mok_job_args a;
  forward_job(&a, p, &r, 1);
  for (int slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (a.t[slot].bytes == 0) a.t[slot].ptr = NULL;
  run_ok(e, &a);
  backward_job(&a, p, &r, 0, 1);
  for (int slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (a.t[slot].bytes == 0) a.t[slot].ptr = NULL;
  run_ok(e, &a);
  for (size_t i = 0; i < p->n_w; i++) CHECK(((float *)r.d_wg)[i] == 0.0f);
  for (size_t i = 0; i < p->n_s; i++) CHECK(((float *)r.d_sd)[i] == 0.0f);
  mok_engine_cpu.close(e);
}

/* ---- bitwise promises ------------------------------------------------------- */

static void expect_same_bytes(const char *what, const void *a, const void *b, size_t n) {
  CHECK_MSG(memcmp(a, b, n) == 0, "%s differs bitwise", what);
}

static void expect_same_grads(const problem *p, const results *a, const results *b) {
  size_t es = esize(p->s.dtype);
  expect_same_bytes("d_x", a->d_x, b->d_x, p->n_x * es);
  expect_same_bytes("d_rw", a->d_rw, b->d_rw, p->n_tk * sizeof(float));
  expect_same_bytes("d_w_gate", a->d_wg, b->d_wg, p->n_w * es);
  expect_same_bytes("d_w_up", a->d_wu, b->d_wu, p->n_w * es);
  expect_same_bytes("d_w_down", a->d_wd, b->d_wd, p->n_w * es);
  if (p->s.Is) {
    expect_same_bytes("d_s_gate", a->d_sg, b->d_sg, p->n_s * es);
    expect_same_bytes("d_s_up", a->d_su, b->d_su, p->n_s * es);
    expect_same_bytes("d_s_down", a->d_sd, b->d_sd, p->n_s * es);
  }
}

static void expect_same_results(const problem *p, const results *a, const results *b) {
  expect_same_bytes("out", a->out, b->out, p->n_x * esize(p->s.dtype));
  expect_same_bytes("ctx", a->ctx, b->ctx, ctx_bytes(p));
  expect_same_grads(p, a, b);
}

/* 1, 2 and 3 threads give the same bits; ctx poisoned differently each run,
 * so equal ctx bytes also prove every byte of it is written. */
static void check_threads_bitwise(const spec *s) {
  problem *p = problem_make(s);
  results r[3];
  for (int n = 1; n <= 3; n++) {
    mok_engine *e = engine_open(n);
    engine_prepare(e, p);
    CHECK(strstr(mok_engine_cpu.describe(e), "cpu") != NULL);
    run_layer(e, p, &r[n - 1], 0x11 * n);
    mok_engine_cpu.close(e);
  }
  expect_same_results(p, &r[0], &r[1]);
  expect_same_results(p, &r[0], &r[2]);
  for (int n = 0; n < 3; n++) results_free(&r[n]);
}

static void test_threads_bitwise(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 77, .H = 200, .I = 136, .E = 3, .E_loc = 3, .K = 2, .Is = 24,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .has_limit = 1, .limit = 0.8,
              .route = ROUTE_DROPS, .seed = 12};
    check_threads_bitwise(&s);
  }
}

/* backward with RECOMPUTE rebuilds the forward ctx bit for bit, into the
 * given ctx or into scratch, and the gradients equal the saved-ctx ones */
static void check_recompute_bitwise(const spec *s) {
  mok_engine *e;
  results saved;
  problem *p = run_fresh(s, 2, &e, &saved, 0x33);

  mok_job_args a;
  results rc;
  results_alloc(&rc, p, 0x77);
  backward_job(&a, p, &rc, MOK_JOB_RECOMPUTE, 1);
  run_ok(e, &a);
  expect_same_bytes("recomputed ctx", saved.ctx, rc.ctx, ctx_bytes(p));
  expect_same_grads(p, &saved, &rc);

  results rs;
  results_alloc(&rs, p, 0x77);
  backward_job(&a, p, &rs, MOK_JOB_RECOMPUTE, 0);
  run_ok(e, &a);
  expect_same_grads(p, &saved, &rs);

  /* forward without a ctx gives the same out */
  results nf;
  results_alloc(&nf, p, 0);
  forward_job(&a, p, &nf, 0);
  run_ok(e, &a);
  expect_same_bytes("out without ctx", saved.out, nf.out, p->n_x * esize(p->s.dtype));
  mok_engine_cpu.close(e);
}

static void test_recompute_bitwise(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 27, .H = 48, .I = 32, .E = 6, .E_loc = 4, .first = 1, .K = 2, .Is = 20,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .has_limit = 1, .limit = 0.7,
              .route = ROUTE_DROPS, .seed = 13};
    check_recompute_bitwise(&s);
  }
}

/* dispatch -> compute -> combine and combine_bwd -> compute_bwd ->
 * dispatch_bwd as separate jobs equal forward and backward bit for bit. */
static void check_steps_chain(const spec *s) {
  problem *p = problem_make(s);
  const uint32_t dt = p->s.dtype;
  const size_t es = esize(dt), R = rows_cap(p), rows_n = R * p->s.H;
  mok_engine *e = engine_open(3);
  engine_prepare(e, p);
  results whole;
  run_layer(e, p, &whole, 0x21);

  int32_t *sched = poisoned(sched_ints(p) * 4, 0x5c);
  void *routed_x = poisoned(rows_n * es, POISON), *routed_y = poisoned(rows_n * es, POISON);
  void *acts = poisoned(acts_bytes(p), 0x3b);
  void *shared_y = p->s.Is ? poisoned(p->n_x * es, POISON) : NULL;
  void *out = poisoned(p->n_x * es, POISON);
  mok_job_args a;

  job_init(&a, p, MOK_OP_DISPATCH, 0);
  put(&a, MOK_SLOT_X, p->x_l, p->n_x, dt);
  put(&a, MOK_SLOT_TOPK_IDS, p->ids, p->n_tk, MOK_DTYPE_I32);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_ROUTED_X, routed_x, rows_n, dt);
  run_ok(e, &a);

  job_init(&a, p, MOK_OP_COMPUTE, 0);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_ROUTED_X, routed_x, rows_n, dt);
  put_weights(&a, p);
  put(&a, MOK_SLOT_ROUTED_Y, routed_y, rows_n, dt);
  put(&a, MOK_SLOT_ACTS, acts, acts_bytes(p), MOK_DTYPE_U8);
  if (p->s.Is) {
    put(&a, MOK_SLOT_X, p->x_l, p->n_x, dt);
    put(&a, MOK_SLOT_SHARED_Y, shared_y, p->n_x, dt);
  }
  run_ok(e, &a);

  job_init(&a, p, MOK_OP_COMBINE, 0);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_ROUTED_Y, routed_y, rows_n, dt);
  put(&a, MOK_SLOT_ROUTER_W, p->rw_f, p->n_tk, MOK_DTYPE_F32);
  if (p->s.Is) put(&a, MOK_SLOT_SHARED_Y, shared_y, p->n_x, dt);
  put(&a, MOK_SLOT_OUT, out, p->n_x, dt);
  run_ok(e, &a);

  expect_same_bytes("dispatch schedule vs ctx", sched, whole.ctx, sched_ints(p) * 4);
  mok_layout_dims d = dims_of(p);
  expect_same_bytes("compute acts vs ctx", acts,
                    (char *)whole.ctx + mok_align256(mok_schedule_bytes(&d)), acts_bytes(p));
  expect_same_bytes("chained out", out, whole.out, p->n_x * es);

  /* backward steps */
  void *routed_dout = poisoned(rows_n * es, POISON), *routed_dx = poisoned(rows_n * es, POISON);
  void *shared_dx = p->s.Is ? poisoned(p->n_x * es, POISON) : NULL;
  results st;
  results_alloc(&st, p, 0);

  job_init(&a, p, MOK_OP_COMBINE_BWD, 0);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_D_OUT, p->dout_l, p->n_x, dt);
  put(&a, MOK_SLOT_ROUTED_DOUT, routed_dout, rows_n, dt);
  run_ok(e, &a);

  job_init(&a, p, MOK_OP_COMPUTE_BWD, 0);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_ACTS, acts, acts_bytes(p), MOK_DTYPE_U8);
  put(&a, MOK_SLOT_ROUTED_X, routed_x, rows_n, dt);
  put(&a, MOK_SLOT_ROUTED_DOUT, routed_dout, rows_n, dt);
  put(&a, MOK_SLOT_ROUTER_W, p->rw_f, p->n_tk, MOK_DTYPE_F32);
  put_weights(&a, p);
  put(&a, MOK_SLOT_ROUTED_DX, routed_dx, rows_n, dt);
  put(&a, MOK_SLOT_D_RW, st.d_rw, p->n_tk, MOK_DTYPE_F32);
  put(&a, MOK_SLOT_D_W_GATE, st.d_wg, p->n_w, dt);
  put(&a, MOK_SLOT_D_W_UP, st.d_wu, p->n_w, dt);
  put(&a, MOK_SLOT_D_W_DOWN, st.d_wd, p->n_w, dt);
  if (p->s.Is) {
    put(&a, MOK_SLOT_X, p->x_l, p->n_x, dt);
    put(&a, MOK_SLOT_D_OUT, p->dout_l, p->n_x, dt);
    put(&a, MOK_SLOT_SHARED_DX, shared_dx, p->n_x, dt);
    put(&a, MOK_SLOT_D_S_GATE, st.d_sg, p->n_s, dt);
    put(&a, MOK_SLOT_D_S_UP, st.d_su, p->n_s, dt);
    put(&a, MOK_SLOT_D_S_DOWN, st.d_sd, p->n_s, dt);
  }
  run_ok(e, &a);

  job_init(&a, p, MOK_OP_DISPATCH_BWD, 0);
  put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
  put(&a, MOK_SLOT_ROUTED_DX, routed_dx, rows_n, dt);
  if (p->s.Is) put(&a, MOK_SLOT_SHARED_DX, shared_dx, p->n_x, dt);
  put(&a, MOK_SLOT_D_X, st.d_x, p->n_x, dt);
  run_ok(e, &a);

  expect_same_grads(p, &whole, &st);
  /* padding rows of the routed buffers are zero, not left poisoned */
  for (size_t r = (size_t)sched[MOK_SCHED_H_ROWS_USED]; r < R; r++)
    for (size_t b = 0; b < p->s.H * es; b++) {
      CHECK(((unsigned char *)routed_x)[r * p->s.H * es + b] == 0);
      CHECK(((unsigned char *)routed_dx)[r * p->s.H * es + b] == 0);
    }
  mok_engine_cpu.close(e);
}

static void test_steps_chain_bitwise(void) {
  for (int bf = 0; bf < 2; bf++) {
    spec s = {.T = 26, .H = 40, .I = 24, .E = 6, .E_loc = 5, .first = 1, .K = 3, .Is = 16,
              .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32, .has_limit = 1, .limit = 0.6,
              .route = ROUTE_DROPS, .seed = 14};
    check_steps_chain(&s);
    s.Is = 0;
    s.route = ROUTE_IDLE;
    check_steps_chain(&s);
  }
}

/* ---- bitwise against a naive f32 emulation of docs/math.md ------------------
 *
 * One slot at a time, plain serial float loops, rnd() exactly where math.md
 * puts it. Any change of a rounding point or a summation order in the engine
 * shows up here as a bit difference. */

typedef struct emu {
  const problem *p;
  uint32_t dt;
  const float *x, *dout, *wg, *wu, *wd, *sg, *su, *sd; /* layer values as f32 */
} emu;

static float emu_rnd(const emu *m, float v) {
  return m->dt == MOK_DTYPE_BF16 ? mok_round_bf16(v) : v;
}
static float emu_silu(float v) { return v / (1.0f + expf(-v)); }
static float emu_dsilu(float v) {
  float s = 1.0f / (1.0f + expf(-v));
  return s * (1.0f + v * (1.0f - s));
}

static float *f32_of(uint32_t dt, const void *src, size_t n) {
  float *f = xmalloc(n * sizeof *f);
  for (size_t i = 0; i < n; i++)
    f[i] = dt == MOK_DTYPE_F32 ? ((const float *)src)[i]
                               : mok_bf16_to_f32(((const mok_bf16 *)src)[i]);
  return f;
}

/* One FFN row: g, u (rounded, pre-clamp), g', u', h. */
static void emu_hidden(const emu *m, const float *xr, const float *wg, const float *wu, int n,
                       float *g, float *u, float *gc, float *uc, float *h) {
  const spec *s = &m->p->s;
  const float L = (float)s->limit;
  for (int i = 0; i < n; i++) {
    float ag = 0.0f, au = 0.0f;
    for (int c = 0; c < s->H; c++) ag = ag + xr[c] * wg[(size_t)i * s->H + c];
    for (int c = 0; c < s->H; c++) au = au + xr[c] * wu[(size_t)i * s->H + c];
    g[i] = emu_rnd(m, ag);
    u[i] = emu_rnd(m, au);
    gc[i] = s->has_limit && g[i] > L ? L : g[i];
    uc[i] = s->has_limit ? (u[i] > L ? L : (u[i] < -L ? -L : u[i])) : u[i];
    h[i] = emu_rnd(m, emu_silu(gc[i]) * uc[i]);
  }
}

typedef struct emu_grads {
  float *dx_acc_rows;      /* routed d_x rows [T*K, H] (rounded), per slot */
  float *dwg, *dwu, *dwd;  /* f32 accumulators */
} emu_grads;

/* backward of one row (rw, or 1 for shared): adds to the weight-grad
 * accumulators, writes its d_x row, returns d_rw. */
static float emu_backward_row(const emu *m, const float *xr, const float *dor, float rw,
                              int shared, const float *wg, const float *wu, const float *wd,
                              int n, float *dwg, float *dwu, float *dwd, float *dx_row) {
  const spec *s = &m->p->s;
  const float L = (float)s->limit;
  float *g = xmalloc(n * sizeof(float) * 7 + 1), *u = g + n, *gc = u + n, *uc = gc + n,
        *h = uc + n, *dg = h + n, *du = dg + n;
  emu_hidden(m, xr, wg, wu, n, g, u, gc, uc, h);
  float drw = 0.0f;
  for (int i = 0; i < n; i++) {
    float a = 0.0f;
    for (int j = 0; j < s->H; j++) a = a + dor[j] * wd[(size_t)j * n + i];
    drw = drw + a * h[i];
    float dh = shared ? a : rw * a;
    float pg = !s->has_limit || g[i] <= L ? 1.0f : 0.0f;
    float pu = !s->has_limit || (u[i] >= -L && u[i] <= L) ? 1.0f : 0.0f;
    dg[i] = emu_rnd(m, dh * uc[i] * emu_dsilu(gc[i]) * pg);
    du[i] = emu_rnd(m, dh * emu_silu(gc[i]) * pu);
  }
  for (int j = 0; j < s->H; j++) {
    float acc = 0.0f;
    for (int i = 0; i < n; i++)
      acc = acc + (dg[i] * wg[(size_t)i * s->H + j] + du[i] * wu[(size_t)i * s->H + j]);
    dx_row[j] = emu_rnd(m, acc);
  }
  /* d_w_down = sum over rows of d_out * h~, h~ = rnd(rw h) (h itself for the shared expert) */
  for (int i = 0; i < n; i++)
    if (!shared) h[i] = emu_rnd(m, rw * h[i]);
  for (int j = 0; j < s->H; j++)
    for (int i = 0; i < n; i++) dwd[(size_t)j * n + i] = dwd[(size_t)j * n + i] + dor[j] * h[i];
  for (int i = 0; i < n; i++)
    for (int j = 0; j < s->H; j++) {
      dwg[(size_t)i * s->H + j] = dwg[(size_t)i * s->H + j] + dg[i] * xr[j];
      dwu[(size_t)i * s->H + j] = dwu[(size_t)i * s->H + j] + du[i] * xr[j];
    }
  free(g);
  return drw;
}

static void store_layer(uint32_t dt, const float *src, void *dst, size_t n, const emu *m) {
  for (size_t i = 0; i < n; i++) {
    float v = emu_rnd(m, src[i]);
    if (dt == MOK_DTYPE_F32)
      ((float *)dst)[i] = v;
    else
      ((mok_bf16 *)dst)[i] = mok_f32_to_bf16(v);
  }
}

static int emu_local(const problem *p, size_t slot) {
  int32_t id = p->ids[slot];
  int e = id - p->s.first;
  return id >= 0 && e >= 0 && e < p->s.E_loc ? e : -1;
}

static void emu_layer(const problem *p, results *r) {
  const spec *s = &p->s;
  emu m = {p, s->dtype, f32_of(s->dtype, p->x_l, p->n_x), f32_of(s->dtype, p->dout_l, p->n_x),
           f32_of(s->dtype, p->wg_l, p->n_w), f32_of(s->dtype, p->wu_l, p->n_w),
           f32_of(s->dtype, p->wd_l, p->n_w), NULL, NULL, NULL};
  if (s->Is) {
    m.sg = f32_of(s->dtype, p->sg_l, p->n_s);
    m.su = f32_of(s->dtype, p->su_l, p->n_s);
    m.sd = f32_of(s->dtype, p->sd_l, p->n_s);
  }
  const int H = s->H, I = s->I, Is = s->Is, K = s->K;
  const size_t wsz = (size_t)I * H;
  int nmax = I > Is ? I : Is;
  float *g = xmalloc(sizeof(float) * 5 * nmax), *u = g + nmax, *gc = u + nmax, *uc = gc + nmax,
        *h = uc + nmax;
  float *acc = xmalloc(sizeof(float) * H), *y = xmalloc(sizeof(float) * H);
  float *dx_rows = xmalloc(sizeof(float) * (p->n_tk + 1) * H), *dxs = xmalloc(sizeof(float) * H);
  float *dwg = xcalloc(sizeof(float) * p->n_w), *dwu = xcalloc(sizeof(float) * p->n_w),
        *dwd = xcalloc(sizeof(float) * p->n_w);
  float *dsg = xcalloc(sizeof(float) * (p->n_s + 1)), *dsu = xcalloc(sizeof(float) * (p->n_s + 1)),
        *dsd = xcalloc(sizeof(float) * (p->n_s + 1));
  float *out = xmalloc(sizeof(float) * (p->n_x + 1)), *dx = xmalloc(sizeof(float) * (p->n_x + 1));
  for (int t = 0; t < s->T; t++) {
    const float *xr = m.x + (size_t)t * H, *dor = m.dout + (size_t)t * H;
    /* forward */
    for (int j = 0; j < H; j++) acc[j] = 0.0f;
    if (Is) {
      emu_hidden(&m, xr, m.sg, m.su, Is, g, u, gc, uc, h);
      for (int j = 0; j < H; j++) {
        float a = 0.0f;
        for (int i = 0; i < Is; i++) a = a + h[i] * m.sd[(size_t)j * Is + i];
        acc[j] = emu_rnd(&m, a); /* shared_y, stored in the layer dtype */
      }
    }
    for (int k = 0; k < K; k++) {
      int e = emu_local(p, (size_t)t * K + k);
      if (e < 0) continue;
      emu_hidden(&m, xr, m.wg + e * wsz, m.wu + e * wsz, I, g, u, gc, uc, h);
      for (int j = 0; j < H; j++) {
        float a = 0.0f;
        for (int i = 0; i < I; i++) a = a + h[i] * m.wd[e * wsz + (size_t)j * I + i];
        y[j] = emu_rnd(&m, a);
      }
      float w = p->rw_f[(size_t)t * K + k];
      for (int j = 0; j < H; j++) acc[j] = acc[j] + w * y[j];
    }
    for (int j = 0; j < H; j++) out[(size_t)t * H + j] = acc[j];
    /* backward */
    if (Is) emu_backward_row(&m, xr, dor, 1.0f, 1, m.sg, m.su, m.sd, Is, dsg, dsu, dsd, dxs);
    for (int j = 0; j < H; j++) acc[j] = Is ? dxs[j] : 0.0f;
    for (int k = 0; k < K; k++) {
      size_t slot = (size_t)t * K + k;
      int e = emu_local(p, slot);
      if (e < 0) {
        r->d_rw[slot] = 0.0f;
        continue;
      }
      float *row = dx_rows + slot * H;
      r->d_rw[slot] = emu_backward_row(&m, xr, dor, p->rw_f[slot], 0, m.wg + e * wsz,
                                       m.wu + e * wsz, m.wd + e * wsz, I, dwg + e * wsz,
                                       dwu + e * wsz, dwd + e * wsz, row);
      for (int j = 0; j < H; j++) acc[j] = acc[j] + row[j];
    }
    for (int j = 0; j < H; j++) dx[(size_t)t * H + j] = acc[j];
  }
  store_layer(s->dtype, out, r->out, p->n_x, &m);
  store_layer(s->dtype, dx, r->d_x, p->n_x, &m);
  store_layer(s->dtype, dwg, r->d_wg, p->n_w, &m);
  store_layer(s->dtype, dwu, r->d_wu, p->n_w, &m);
  store_layer(s->dtype, dwd, r->d_wd, p->n_w, &m);
  if (Is) {
    store_layer(s->dtype, dsg, r->d_sg, p->n_s, &m);
    store_layer(s->dtype, dsu, r->d_su, p->n_s, &m);
    store_layer(s->dtype, dsd, r->d_sd, p->n_s, &m);
  }
}

static void test_matches_math_md_bitwise(void) {
  for (int bf = 0; bf < 2; bf++)
    for (int variant = 0; variant < 2; variant++) {
      spec s = {.T = 13, .H = 20, .I = 12, .E = 5, .E_loc = 4, .first = 1, .K = 2,
                .Is = variant ? 9 : 0, .dtype = bf ? MOK_DTYPE_BF16 : MOK_DTYPE_F32,
                .has_limit = variant, .limit = 0.6, .route = ROUTE_DROPS, .rw_zero = 1,
                .seed = 20 + (uint64_t)variant};
      problem *p = problem_make(&s);
      mok_engine *e = engine_open(2);
      engine_prepare(e, p);
      results got, want;
      run_layer(e, p, &got, 0);
      results_alloc(&want, p, 0);
      emu_layer(p, &want);
      expect_same_bytes("out", want.out, got.out, p->n_x * esize(p->s.dtype));
      expect_same_grads(p, &want, &got);
      mok_engine_cpu.close(e);
    }
}

/* ---- bad inputs --------------------------------------------------------------- */

static void test_bad_routing_ids(void) {
  spec s = {.T = 9, .H = 8, .I = 4, .E = 4, .E_loc = 2, .first = 2, .K = 2,
            .dtype = MOK_DTYPE_F32, .seed = 15};
  problem *p = problem_make(&s);
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  const int32_t bad_ids[] = {4, 1000, -2, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof bad_ids / sizeof bad_ids[0]; i++) {
    int32_t saved = p->ids[7];
    p->ids[7] = bad_ids[i]; /* t=3, k=1 */
    results r;
    results_alloc(&r, p, 0);
    mok_job_args a;
    forward_job(&a, p, &r, 1);
    mok_engine_result res = run_job(e, &a);
    CHECK_EQ_INT(res.status, MOK_EROUTE);
    CHECK_STR_CONTAINS(res.message, "t=3, k=1");
    char id[32];
    snprintf(id, sizeof id, "= %d", bad_ids[i]);
    CHECK_STR_CONTAINS(res.message, id);
    /* dispatch and recompute-backward check the same way */
    job_init(&a, p, MOK_OP_DISPATCH, 0);
    int32_t *sched = xmalloc(sched_ints(p) * 4);
    void *routed = xmalloc(rows_cap(p) * p->s.H * 4);
    put(&a, MOK_SLOT_X, p->x_l, p->n_x, MOK_DTYPE_F32);
    put(&a, MOK_SLOT_TOPK_IDS, p->ids, p->n_tk, MOK_DTYPE_I32);
    put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
    put(&a, MOK_SLOT_ROUTED_X, routed, rows_cap(p) * p->s.H, MOK_DTYPE_F32);
    CHECK_EQ_INT(run_job(e, &a).status, MOK_EROUTE);
    backward_job(&a, p, &r, MOK_JOB_RECOMPUTE, 0);
    CHECK_EQ_INT(run_job(e, &a).status, MOK_EROUTE);
    p->ids[7] = saved;
  }
  mok_engine_cpu.close(e);
}

typedef void (*sched_corrupt)(int32_t *sc, const mok_sched_view *v);

#define CORRUPT(name, body)                                                    \
  static void name(int32_t *sc, const mok_sched_view *v) {                     \
    (void)sc;                                                                  \
    (void)v;                                                                   \
    body;                                                                      \
  }
CORRUPT(k_magic, sc[0] = 0)
CORRUPT(k_tokens, sc[1] = 1000)
CORRUPT(k_topk, sc[2] = 1)
CORRUPT(k_experts, sc[3] = 99)
CORRUPT(k_align, sc[4] = 4)
CORRUPT(k_capacity, sc[5] = 1 << 30)
CORRUPT(k_used, sc[6] = 1 << 30)
CORRUPT(k_used_neg, sc[6] = -1)
CORRUPT(k_first, sc[7] = 0)
CORRUPT(k_count, ((int32_t *)v->counts)[1] = 1 << 28)
CORRUPT(k_offset, ((int32_t *)v->offsets)[1] = -100)
CORRUPT(k_offset_end, ((int32_t *)v->offsets)[v->local_experts] = 1 << 29)
CORRUPT(k_row_slot, ((int32_t *)v->row_slot)[2] = 1 << 29)
CORRUPT(k_row_slot_neg, ((int32_t *)v->row_slot)[2] = -9)
CORRUPT(k_slot_row, ((int32_t *)v->slot_row)[3] = 1 << 29)
CORRUPT(k_slot_row_neg, ((int32_t *)v->slot_row)[3] = -9)
CORRUPT(k_slot_row_cross, ((int32_t *)v->slot_row)[0] = ((int32_t *)v->slot_row)[2])

static const struct {
  sched_corrupt fn;
  const char *what;
} corruptions[] = {
    {k_magic, "magic"}, {k_tokens, "T"}, {k_topk, "K"}, {k_experts, "E_loc"},
    {k_align, "row_align"}, {k_capacity, "capacity"}, {k_used, "rows_used"},
    {k_used_neg, "rows_used<0"}, {k_first, "first_expert"}, {k_count, "counts"},
    {k_offset, "offsets"}, {k_offset_end, "last offset"}, {k_row_slot, "row_slot"},
    {k_row_slot_neg, "row_slot<0"}, {k_slot_row, "slot_row"}, {k_slot_row_neg, "slot_row<0"},
    {k_slot_row_cross, "slot_row crossed"},
};

/* Every op that takes a schedule or ctx fails cleanly on each corruption. */
static void test_corrupt_schedule_and_ctx(void) {
  spec s = {.T = 11, .H = 16, .I = 8, .E = 5, .E_loc = 4, .first = 1, .K = 2, .Is = 4,
            .dtype = MOK_DTYPE_BF16, .seed = 16};
  problem *p = problem_make(&s);
  /* slots 0, 2, 3 local so the row/slot corruptions hit used entries */
  p->ids[0] = 1, p->ids[1] = 2, p->ids[2] = 3, p->ids[3] = 4;
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  results good;
  run_layer(e, p, &good, 0);
  const uint32_t dt = p->s.dtype;
  const size_t es = esize(dt), rows_n = rows_cap(p) * p->s.H;
  void *routed_a = xcalloc(rows_n * es), *routed_b = xcalloc(rows_n * es);
  void *acts = xcalloc(acts_bytes(p)), *tok = xcalloc(p->n_x * es);
  results r;
  results_alloc(&r, p, 0);

  for (size_t c = 0; c < sizeof corruptions / sizeof corruptions[0]; c++) {
    void *ctx = dup_bytes(good.ctx, ctx_bytes(p));
    mok_sched_view v = mok_schedule_view(&(mok_sched_shape){dims_of(p), 5, 1}, ctx);
    corruptions[c].fn(ctx, &v);
    const int32_t *sched = ctx;
    for (uint32_t op = MOK_OP_BACKWARD; op <= MOK_OP_DISPATCH_BWD; op++) {
      if (op == MOK_OP_DISPATCH) continue; /* writes a schedule, reads none */
      mok_job_args a;
      if (op == MOK_OP_BACKWARD) {
        backward_job(&a, p, &r, 0, 0);
        put(&a, MOK_SLOT_CTX, ctx, ctx_bytes(p), MOK_DTYPE_U8);
      } else {
        job_init(&a, p, op, 0);
        put(&a, MOK_SLOT_SCHEDULE, sched, sched_ints(p), MOK_DTYPE_I32);
        put_weights(&a, p);
        put(&a, MOK_SLOT_X, p->x_l, p->n_x, dt);
        put(&a, MOK_SLOT_D_OUT, p->dout_l, p->n_x, dt);
        put(&a, MOK_SLOT_ROUTER_W, p->rw_f, p->n_tk, MOK_DTYPE_F32);
        put(&a, MOK_SLOT_ROUTED_X, routed_a, rows_n, dt);
        put(&a, MOK_SLOT_ROUTED_Y, routed_b, rows_n, dt);
        put(&a, MOK_SLOT_ROUTED_DOUT, routed_b, rows_n, dt);
        put(&a, MOK_SLOT_ROUTED_DX, routed_a, rows_n, dt);
        put(&a, MOK_SLOT_ACTS, acts, acts_bytes(p), MOK_DTYPE_U8);
        put(&a, MOK_SLOT_SHARED_Y, tok, p->n_x, dt);
        put(&a, MOK_SLOT_SHARED_DX, tok, p->n_x, dt);
        put(&a, MOK_SLOT_OUT, r.out, p->n_x, dt);
        put(&a, MOK_SLOT_D_X, r.d_x, p->n_x, dt);
        put(&a, MOK_SLOT_D_RW, r.d_rw, p->n_tk, MOK_DTYPE_F32);
        put(&a, MOK_SLOT_D_W_GATE, r.d_wg, p->n_w, dt);
        put(&a, MOK_SLOT_D_W_UP, r.d_wu, p->n_w, dt);
        put(&a, MOK_SLOT_D_W_DOWN, r.d_wd, p->n_w, dt);
        put(&a, MOK_SLOT_D_S_GATE, r.d_sg, p->n_s, dt);
        put(&a, MOK_SLOT_D_S_UP, r.d_su, p->n_s, dt);
        put(&a, MOK_SLOT_D_S_DOWN, r.d_sd, p->n_s, dt);
      }
      mok_engine_result res = run_job(e, &a);
      CHECK_MSG(res.status == MOK_EINVAL, "op %u accepted corrupted %s (status %d: %s)", op,
                corruptions[c].what, res.status, res.message);
      CHECK_STR_CONTAINS(res.message, "schedule");
    }
    free(ctx);
  }
  mok_engine_cpu.close(e);
}

/* Random ints in the schedule part and random bytes in the acts part of a
 * ctx: backward either rejects it (EINVAL) or, when the schedule is still
 * consistent, runs; it never reads out of bounds (run under ASan). */
static void test_random_ctx_garbage(void) {
  spec s = {.T = 6, .H = 8, .I = 4, .E = 3, .E_loc = 3, .K = 2, .Is = 3,
            .dtype = MOK_DTYPE_F32, .route = ROUTE_DROPS, .seed = 18};
  problem *p = problem_make(&s);
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  results good, r;
  run_layer(e, p, &good, 0);
  results_alloc(&r, p, 0);
  const size_t n_ints = sched_ints(p), bytes = ctx_bytes(p);
  void *ctx = xmalloc(bytes);
  rng g = {99};
  int rejected = 0, accepted = 0;
  for (int iter = 0; iter < 600; iter++) {
    memcpy(ctx, good.ctx, bytes);
    for (int m = 0; m <= iter % 3; m++) {
      size_t at = rng_next(&g) % n_ints;
      int32_t v = (int32_t)(rng_next(&g) % 41) - 20;
      if (iter % 5 == 0) v = (int32_t)rng_next(&g);
      ((int32_t *)ctx)[at] = v;
    }
    if (iter % 4 == 0) /* and garbage activations: any float bits are data */
      for (size_t b = mok_align256(n_ints * 4); b < bytes; b += 7)
        ((unsigned char *)ctx)[b] = (unsigned char)rng_next(&g);
    mok_job_args a;
    backward_job(&a, p, &r, 0, 0);
    put(&a, MOK_SLOT_CTX, ctx, bytes, MOK_DTYPE_U8);
    mok_engine_result res = run_job(e, &a);
    CHECK_MSG(res.status == MOK_OK || res.status == MOK_EINVAL, "status %d: %s", res.status,
              res.message);
    if (res.status == MOK_OK)
      accepted++;
    else
      rejected++;
  }
  CHECK(rejected > 300 && accepted > 0);
  mok_engine_cpu.close(e);
}

static void test_missing_and_short_tensors(void) {
  spec s = {.T = 5, .H = 8, .I = 4, .E = 2, .E_loc = 2, .K = 2, .Is = 4,
            .dtype = MOK_DTYPE_F32, .seed = 17};
  problem *p = problem_make(&s);
  mok_engine *e = engine_open(1);
  engine_prepare(e, p);
  results r;
  results_alloc(&r, p, 0);
  mok_job_args a;
  forward_job(&a, p, &r, 1);
  a.t[MOK_SLOT_S_UP].ptr = NULL; /* shared layer without its up weights */
  mok_engine_result res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_EINVAL);
  CHECK_STR_CONTAINS(res.message, "s_up");

  forward_job(&a, p, &r, 1);
  a.t[MOK_SLOT_CTX].bytes -= 1;
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  CHECK_STR_CONTAINS(res.message, "ctx");

  forward_job(&a, p, &r, 1);
  a.t[MOK_SLOT_X].dtype = MOK_DTYPE_BF16;
  CHECK_EQ_INT(run_job(e, &a).status, MOK_ESHAPE);

  backward_job(&a, p, &r, 0, 0); /* no ctx and no recompute */
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_EINVAL);
  CHECK_STR_CONTAINS(res.message, "ctx");

  forward_job(&a, p, &r, 1);
  a.flags = MOK_JOB_RECOMPUTE;
  CHECK_EQ_INT(run_job(e, &a).status, MOK_EINVAL);

  forward_job(&a, p, &r, 1);
  a.tokens = p->cfg.max_tokens + 1;
  CHECK(run_job(e, &a).status != MOK_OK);

  job_init(&a, p, MOK_OP_NOP, 0);
  a.layer = NULL;
  CHECK_EQ_INT(run_job(e, &a).status, MOK_OK);
  mok_engine_cpu.close(e);
}

static void test_prepare_layer(void) {
  mok_engine *e = engine_open(1);
  mok_layer_config c = {.hidden = 8, .intermediate = 4, .experts = 4, .local_experts = 4,
                        .topk = 2, .max_tokens = 16, .dtype = MOK_DTYPE_I32};
  char err[128];
  CHECK_EQ_INT(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err), MOK_EUNSUPPORTED);
  CHECK_STR_CONTAINS(err, "bfloat16");
  c.dtype = MOK_DTYPE_BF16;
  c.row_align = 16;
  CHECK_EQ_INT(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err), MOK_OK);
  CHECK_EQ_INT(c.row_align, 1);
  c.has_limit = true;
  c.swiglu_limit = -1.0f;
  CHECK_EQ_INT(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err), MOK_EINVAL);
  c.has_limit = false;
  c.first_expert = 1; /* local experts 1..4 of 4 */
  CHECK_EQ_INT(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err), MOK_EINVAL);
  mok_engine_cpu.close(e);
  mok_engine_cpu.close(NULL);
  mok_engine_config bad = {.device = 0, .threads = -1};
  mok_engine *none = NULL;
  CHECK_EQ_INT(mok_engine_cpu.open(&bad, &none, err, sizeof err), MOK_EINVAL);
  CHECK(none == NULL);
}

/* ---- fp8 layers (docs/math.md, "FP8 (e4m3, block-scaled)") -----------------
 *
 * The bf16 masters are quantised by the engine's quantize_weight (fp8_pack,
 * from engine_prepare); every job then takes the packed forms. ref_fp8 is
 * the recipe in double, written from docs/math.md; ref64 the unquantised
 * layer. */

/* Weight i (slot MOK_SLOT_W_GATE + i) of a problem: its bf16 master and its
 * doubles. */
static const void *fp8_master(const problem *p, int i, const double **ret_d, size_t *ret_n) {
  const void *l[6] = {p->wg_l, p->wu_l, p->wd_l, p->sg_l, p->su_l, p->sd_l};
  const double *d[6] = {p->wg, p->wu, p->wd, p->sg, p->su, p->sd};
  if (ret_d) *ret_d = d[i];
  *ret_n = i < 3 ? p->n_w : p->n_s;
  return l[i];
}

static void fp8_pack(mok_engine *e, problem *p) {
  for (int i = 0; i < (p->s.Is ? 6 : 3); i++) {
    const uint32_t slot = MOK_SLOT_W_GATE + (uint32_t)i;
    size_t n, bytes = (size_t)mok_slot_packed_bytes(&p->cfg, slot);
    const void *master = fp8_master(p, i, NULL, &n);
    CHECK(bytes > 0);
    free(p->packed[i]);
    p->packed[i] = poisoned(bytes, 0x5a);
    p->packed_bytes[i] = bytes;
    mok_job_args a;
    job_init(&a, p, MOK_OP_QUANTIZE_WEIGHT, 0);
    a.tokens = 0;
    put(&a, (int)slot, master, n, MOK_DTYPE_BF16);
    put(&a, MOK_SLOT_PACKED_WEIGHT, p->packed[i], bytes, MOK_DTYPE_U8);
    run_ok(e, &a);
  }
}

static spec fp8_spec(uint64_t seed) {
  spec s = {.T = 37, .H = 256, .I = 128, .E = 5, .E_loc = 4, .first = 1, .K = 2, .Is = 128,
            .dtype = MOK_DTYPE_FP8_E4M3, .has_limit = 1, .limit = 1.0, .route = ROUTE_DROPS,
            .seed = seed};
  return s;
}

/* v[i] and its bf16 copy times 2^f(i) (both exact). */
static void scale_pow2(double *v, mok_bf16 *l, size_t n, int (*f)(size_t, const void *),
                       const void *arg) {
  for (size_t i = 0; i < n; i++) {
    v[i] = ldexp(v[i], f(i, arg));
    l[i] = mok_f32_to_bf16((float)v[i]);
  }
}

static int token_block_exp(size_t i, const void *arg) { /* [T, H] by token and 128 of H */
  size_t H = *(const size_t *)arg;
  return (int)((i / H + i % H / 128) % 3) - 1;
}

typedef struct weight_shape {
  size_t N, K;
} weight_shape;

static int weight_block_exp(size_t i, const void *arg) { /* [E, N, K] by 128x128 block */
  const weight_shape *w = arg;
  size_t e = i / (w->N * w->K), nb = i / w->K % w->N / 128, kb = i % w->K / 128;
  return (int)((e + 2 * nb + 3 * kb) % 4) - 2;
}

/* An fp8 problem whose blocks differ in magnitude by powers of two (x and
 * d_out per token and 128 of H, each weight per 128x128 block), so that a
 * scale read from the wrong block, or applied twice, is seen. */
static problem *fp8_problem(const spec *s) {
  problem *p = problem_make(s);
  size_t H = (size_t)s->H;
  scale_pow2(p->x, p->x_l, p->n_x, token_block_exp, &H);
  scale_pow2(p->dout, p->dout_l, p->n_x, token_block_exp, &H);
  for (int i = 0; i < (s->Is ? 6 : 3); i++) {
    const double *w;
    size_t n, In = (size_t)(i < 3 ? s->I : s->Is);
    mok_bf16 *l = (mok_bf16 *)fp8_master(p, i, &w, &n);
    weight_shape ws = {i % 3 == 2 ? H : In, i % 3 == 2 ? In : H};
    scale_pow2((double *)w, l, n, weight_block_exp, &ws);
  }
  return p;
}

/* Every byte and scale of every packed weight is the recipe's, special
 * values included (NaN, inf, a huge value, a zero block, bf16 subnormals);
 * the transposed section is the first section's transpose byte for byte,
 * and the bytes between the sections are zero (mok_layout.h; there are
 * none while N and K are multiples of 128, as a layer's are: 128 * 128 is
 * a multiple of 256). */
static void test_fp8_quantize_weight_matches_the_recipe(void) {
  spec s = fp8_spec(31);
  problem *p = fp8_problem(&s);
  /* block (0, 0) of w_gate's expert 0: specials; block (0, 1): all zero;
   * w_up's block (0, 0): bf16 subnormals only */
  mok_bf16 *wg = p->wg_l, *wu = p->wu_l;
  const float specials[] = {NAN, INFINITY, -3e38f, 1e-40f, -0.0f};
  for (int i = 0; i < 5; i++) wg[(size_t)(7 * i + 3) * s.H + 11 * i] = mok_f32_to_bf16(specials[i]);
  for (int n = 0; n < 128; n++)
    for (int k = 128; k < 256; k++) wg[(size_t)n * s.H + k] = mok_f32_to_bf16(0.0f);
  for (int n = 0; n < 128; n++)
    for (int k = 0; k < 128; k++)
      wu[(size_t)n * s.H + k] = mok_f32_to_bf16((float)((n * 7 + k) % 5 - 2) * 1e-39f);
  /* w_gate's expert 1, block (0, 0): 0.5 everywhere but one NaN, which the
   * amax leaves out (scale 2^-9, 0.5 * 2^9 = 256) */
  mok_bf16 *e1 = wg + (size_t)s.I * s.H;
  for (int n = 0; n < 128; n++)
    for (int k = 0; k < 128; k++) e1[(size_t)n * s.H + k] = mok_f32_to_bf16(0.5f);
  e1[5 * s.H + 7] = mok_f32_to_bf16(NAN);
  for (size_t i = 0; i < p->n_w; i++) { /* the doubles follow the bf16 bytes */
    p->wg[i] = mok_bf16_to_f32(wg[i]);
    p->wu[i] = mok_bf16_to_f32(wu[i]);
  }
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  for (int i = 0; i < 6; i++) {
    const double *w;
    size_t n;
    fp8_master(p, i, &w, &n);
    int down = i % 3 == 2, E = i < 3 ? s.E_loc : 1, In = i < 3 ? s.I : s.Is;
    int N = down ? s.H : In, K = down ? In : s.H;
    size_t ns = (size_t)E * (N / 128) * (K / 128), off = (size_t)mok_fp8_scales_offset(E, N, K);
    size_t t_off = (size_t)mok_fp8_transposed_offset(E, N, K);
    CHECK(t_off >= n && t_off % 256 == 0 && off >= t_off + n && off % 256 == 0);
    double *q = xmalloc(n * sizeof *q), *sc = xmalloc(ns * sizeof *sc);
    ref_fp8_quantize_weight(w, E, N, K, q, sc);
    const uint8_t *b = p->packed[i], *bt = b + t_off;
    for (size_t j = 0; j < n; j++) {
      double got = mok_fp8_decode(b[j]);
      CHECK_MSG((isnan(got) && isnan(q[j])) || (got == q[j] && !signbit(got) == !signbit(q[j])),
                "weight %d byte %zu: 0x%02x (%g), the recipe gives %g", i, j, b[j], got, q[j]);
    }
    size_t t_bad = 0; /* byte (e, k, n) of the transpose is byte (e, n, k) */
    for (size_t e8 = 0; e8 < (size_t)E; e8++)
      for (size_t k = 0; k < (size_t)K; k++)
        for (size_t nn = 0; nn < (size_t)N; nn++)
          t_bad += bt[(e8 * K + k) * N + nn] != b[(e8 * N + nn) * K + k];
    CHECK_MSG(t_bad == 0, "weight %d: %zu bytes of the transposed section are not the transpose",
              i, t_bad);
    for (size_t j = n; j < t_off; j++) CHECK_EQ_INT(b[j], 0);
    for (size_t j = t_off + n; j < off; j++) CHECK_EQ_INT(b[j], 0);
    for (size_t j = 0; j < ns; j++) {
      float got;
      memcpy(&got, b + off + 4 * j, 4);
      CHECK_MSG((double)got == sc[j], "weight %d scale %zu: %g, the recipe gives %g", i, j,
                (double)got, sc[j]);
    }
    CHECK_EQ_INT(p->packed_bytes[i], off + 4 * ns);
    free(q);
    free(sc);
  }
  const uint8_t *b = p->packed[0];
  float s00, s01, su00;
  memcpy(&s00, b + mok_fp8_scales_offset(s.E_loc, s.I, s.H), 4);
  memcpy(&s01, b + mok_fp8_scales_offset(s.E_loc, s.I, s.H) + 4, 4);
  memcpy(&su00, (const uint8_t *)p->packed[1] + mok_fp8_scales_offset(s.E_loc, s.I, s.H), 4);
  CHECK(s00 == 0x1p127f && s01 == 1.0f && su00 == 0x1p-126f); /* inf; zero; subnormal amax */
  CHECK_EQ_INT(b[3 * s.H], 0x7f);               /* NaN */
  CHECK_EQ_INT(b[10 * s.H + 11], 0x7e);          /* inf * 2^-127: saturated to 448 */
  float s1;
  memcpy(&s1, b + mok_fp8_scales_offset(s.E_loc, s.I, s.H) + 4 * 2, 4); /* expert 1, (0, 0) */
  const uint8_t *b1 = b + (size_t)s.I * s.H;
  CHECK(s1 == 0x1p-9f && b1[5 * s.H + 7] == 0x7f && b1[5 * s.H + 8] == 0x78 && b1[0] == 0x78);
  mok_engine_cpu.close(e);
}

/* The engine against the recipe in double, fed the same bf16 inputs: what
 * is left is the engine's f32 sums, and the bf16 roundings of the results
 * (g, u, h, dg, du, out, d_x, d_w_*: relative 2^-9 each) those move; a
 * rounding that flips moves an e4m3 operand one step more, rarely. */
#define FP8_RECIPE_TOL 1e-3

typedef struct fp8_errors {
  double out, d_x, d_rw, d_wg, d_wu, d_wd, d_sg, d_su, d_sd;
} fp8_errors;

static double rel_err_layer(const double *ref, const void *got, size_t n) {
  double *g = from_layer(MOK_DTYPE_BF16, got, n);
  double e = ref64_rel_err(ref, g, n);
  free(g);
  return e;
}

static fp8_errors fp8_errors_of(const problem *p, const results *r, const ref_results *rr) {
  fp8_errors e;
  double *drw = from_f32(r->d_rw, p->n_tk);
  e.out = rel_err_layer(rr->out, r->out, p->n_x);
  e.d_x = rel_err_layer(rr->d_x, r->d_x, p->n_x);
  e.d_rw = ref64_rel_err(rr->d_rw, drw, p->n_tk);
  e.d_wg = rel_err_layer(rr->d_wg, r->d_wg, p->n_w);
  e.d_wu = rel_err_layer(rr->d_wu, r->d_wu, p->n_w);
  e.d_wd = rel_err_layer(rr->d_wd, r->d_wd, p->n_w);
  e.d_sg = p->s.Is ? rel_err_layer(rr->d_sg, r->d_sg, p->n_s) : 0.0;
  e.d_su = p->s.Is ? rel_err_layer(rr->d_su, r->d_su, p->n_s) : 0.0;
  e.d_sd = p->s.Is ? rel_err_layer(rr->d_sd, r->d_sd, p->n_s) : 0.0;
  free(drw);
  return e;
}

static void fp8_errors_print(const char *what, const fp8_errors *e) {
  if (!getenv("TEST_VERBOSE")) return;
  fprintf(stderr, "    %s: out %.3g d_x %.3g d_rw %.3g d_w_gate %.3g d_w_up %.3g d_w_down %.3g "
          "d_s_gate %.3g d_s_up %.3g d_s_down %.3g\n", what, e->out, e->d_x, e->d_rw, e->d_wg,
          e->d_wu, e->d_wd, e->d_sg, e->d_su, e->d_sd);
}

static void ref_fp8_run(const problem *p, ref_results *rr) {
  ref_run(p, rr); /* allocates; the unquantised values are overwritten */
  ref64_inputs in = ref_inputs(p);
  ref_fp8_forward(&p->ref, &in, rr->out);
  ref_fp8_backward(&p->ref, &in, p->dout, rr->d_x, rr->d_rw, rr->d_wg, rr->d_wu, rr->d_wd,
                   rr->d_sg, rr->d_su, rr->d_sd);
}

/* Every output's error (bf16 results, norm-wise) of an fp8 problem's layer,
 * against ref_fp8 (the recipe) or ref64 (the unquantised layer); what
 * prints them with TEST_VERBOSE. */
static fp8_errors fp8_measure(problem *p, mok_engine *e, int against_recipe, const char *what) {
  engine_prepare(e, p);
  results r;
  run_layer(e, p, &r, 0xa5);
  ref_results rr;
  if (against_recipe)
    ref_fp8_run(p, &rr);
  else
    ref_run(p, &rr);
  fp8_errors err = fp8_errors_of(p, &r, &rr);
  fp8_errors_print(what, &err);
  results_free(&r);
  return err;
}

static void expect_errors_below(const fp8_errors *e, const fp8_errors *bound, const char *of) {
  const double *v = &e->out, *b = &bound->out;
  const char *names[] = {"out", "d_x", "d_rw", "d_w_gate", "d_w_up", "d_w_down", "d_s_gate",
                         "d_s_up", "d_s_down"};
  for (int i = 0; i < 9; i++)
    CHECK_MSG(v[i] < b[i], "%s: relative error %.3g against %s exceeds %g", names[i], v[i], of,
              b[i]);
}

static void test_fp8_layer_matches_the_recipe(void) {
  const fp8_errors bound = {FP8_RECIPE_TOL, FP8_RECIPE_TOL, FP8_RECIPE_TOL, FP8_RECIPE_TOL,
                            FP8_RECIPE_TOL, FP8_RECIPE_TOL, FP8_RECIPE_TOL, FP8_RECIPE_TOL,
                            FP8_RECIPE_TOL};
  mok_engine *e = engine_open(2);
  for (int shared = 0; shared < 2; shared++) {
    spec s = fp8_spec(32 + (uint64_t)shared);
    s.Is = shared ? 128 : 0;
    s.route = shared ? ROUTE_DROPS : ROUTE_IDLE;
    fp8_errors err = fp8_measure(fp8_problem(&s), e, 1, "fp8 engine vs the recipe in double");
    expect_errors_below(&err, &bound, "the recipe");
  }
  mok_engine_cpu.close(e);
}

/* What block-scaled e4m3 costs against the unquantised float64 layer
 * (docs/math.md, "FP8", has the numbers and what the format leads to
 * expect: about 2.4 % rms per quantised operand, adding in quadrature
 * along a result's path). The bounds sit above the measured errors (5-6 %)
 * and far below what a wrong recipe gives (the scales applied twice, or a
 * scale read from the wrong block: 0.5 to 1). */
static const fp8_errors FP8_ERROR_BOUND = {
    .out = 0.1, .d_x = 0.1, .d_rw = 0.1, .d_wg = 0.1, .d_wu = 0.1, .d_wd = 0.1,
    .d_sg = 0.1, .d_su = 0.1, .d_sd = 0.1};

static void test_fp8_error_against_the_unquantised_layer(void) {
  spec s = fp8_spec(33);
  s.has_limit = 0; /* a clamp's masks flip with the operands' error: docs/math.md */
  mok_engine *e = engine_open(2);
  fp8_errors err = fp8_measure(fp8_problem(&s), e, 0, "fp8 engine vs the unquantised layer");
  expect_errors_below(&err, &FP8_ERROR_BOUND, "the unquantised layer");
  /* the same layer in bf16, for scale: fp8 does cost something */
  s.dtype = MOK_DTYPE_BF16;
  fp8_errors eb = fp8_measure(fp8_problem(&s), e, 0, "bf16 engine vs the unquantised layer");
  CHECK(eb.out < err.out / 4);
  mok_engine_cpu.close(e);
}

/* Two runs, 1..3 threads, recompute, the single-step chain: the same bits. */
static void test_fp8_bitwise(void) {
  spec s = fp8_spec(34);
  check_threads_bitwise(&s);
  check_recompute_bitwise(&s);
  check_steps_chain(&s);
  s.Is = 0;
  s.route = ROUTE_IDLE;
  check_steps_chain(&s);
}

/* Which section of a packed weight each job reads (mok_layout.h): the
 * forward the e4m3 bytes, the backward's dgrads their transposed copy, as
 * the cuda engine's K-major GEMMs do; never one section rebuilt from the
 * other. One section of one weight corrupted (every value's sign flipped),
 * the other left as quantize_weight wrote it: the transposed one leaves the
 * forward bitwise as it was and changes d_x (only d_x, for the gate and up
 * weights, which no other gradient reads); the first changes out, and a
 * backward from the unchanged forward's ctx gives the same bits as before. */
static void test_fp8_jobs_read_their_own_section(void) {
  spec s = fp8_spec(36);
  problem *p = fp8_problem(&s);
  mok_engine *e = engine_open(2);
  engine_prepare(e, p);
  results r0;
  run_layer(e, p, &r0, 0xa5);
  const size_t es = esize(s.dtype), xb = p->n_x * es;
  static const char *const names[6] = {"w_gate", "w_up", "w_down", "s_gate", "s_up", "s_down"};
  for (int i = 0; i < 6; i++) {
    uint64_t w[3];
    CHECK(mok_slot_weight_dims(&p->cfg, MOK_SLOT_W_GATE + (uint32_t)i, w));
    const size_t n = (size_t)(w[0] * w[1] * w[2]);
    const size_t t_off = (size_t)mok_fp8_transposed_offset(w[0], w[1], w[2]);
    for (int transposed = 0; transposed < 2; transposed++) {
      uint8_t *sec = (uint8_t *)p->packed[i] + (transposed ? t_off : 0);
      for (size_t j = 0; j < n; j++) sec[j] ^= 0x80;
      results r, rb;
      run_layer(e, p, &r, 0xa5);
      results_alloc(&rb, p, 0); /* the backward of the forward before the corruption */
      memcpy(rb.ctx, r0.ctx, ctx_bytes(p));
      mok_job_args a;
      backward_job(&a, p, &rb, 0, 1);
      run_ok(e, &a);
      if (transposed) {
        CHECK_MSG(memcmp(r.out, r0.out, xb) == 0 && memcmp(r.ctx, r0.ctx, ctx_bytes(p)) == 0,
                  "%s: the forward read the transposed section", names[i]);
        CHECK_MSG(memcmp(r.d_x, r0.d_x, xb) != 0,
                  "%s: d_x did not change with the transposed section", names[i]);
        if (i % 3 != 2) { /* gate, up: only the gate/up dgrad (d_x) reads them */
          results only_dx = r0;
          only_dx.d_x = r.d_x;
          expect_same_grads(p, &only_dx, &r);
        }
      } else {
        CHECK_MSG(memcmp(r.out, r0.out, xb) != 0,
                  "%s: out did not change with the first section", names[i]);
        expect_same_grads(p, &r0, &rb); /* the backward reads the transposed one */
      }
      for (size_t j = 0; j < n; j++) sec[j] ^= 0x80;
      results_free(&r);
      results_free(&rb);
    }
  }
  results r1; /* restored: the same bits again */
  run_layer(e, p, &r1, 0x3c);
  expect_same_bytes("out", r1.out, r0.out, xb);
  expect_same_grads(p, &r0, &r1);
  results_free(&r0);
  results_free(&r1);
  mok_engine_cpu.close(e);
}

/* Direct jobs (no daemon checks): an fp8 layer of the wrong size (and one on
 * a group, which runs), a short packed weight, a quantize job without
 * exactly one source. */
static void test_fp8_refusals(void) {
  mok_engine *e = engine_open(1);
  char err[256];
  mok_layer_config c = {.hidden = 7000, .intermediate = 128, .experts = 2, .local_experts = 2,
                        .topk = 1, .max_tokens = 4, .dtype = MOK_DTYPE_FP8_E4M3};
  CHECK_EQ_INT(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "hidden = 7000 is not a multiple of 128");
  c.hidden = 128;
  /* on a group (rank 0 of 2, one local expert): prepared like any group layer
   * (docs/ep.md "FP8 layers on a group") */
  c.group_id = 3, c.group_world = 2, c.group_rank = 0, c.group_tokens = 4;
  c.local_experts = 1;
  CHECK_MSG(mok_engine_cpu.prepare_layer(e, &c, err, sizeof err) == MOK_OK, "%s", err);
  spec s = fp8_spec(35);
  problem *p = problem_make(&s);
  engine_prepare(e, p);
  results r;
  results_alloc(&r, p, 0);
  mok_job_args a;
  forward_job(&a, p, &r, 1);
  a.t[MOK_SLOT_W_DOWN].bytes--;
  mok_engine_result res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  CHECK_STR_CONTAINS(res.message, "tensor 'w_down' has");
  /* a packed form without the transposed section (e4m3 bytes, then scales) */
  const uint64_t one_way = mok_fp8_transposed_offset(s.E_loc, s.H, s.I) +
                           4u * s.E_loc * (s.H / 128) * (s.I / 128);
  CHECK(one_way < p->packed_bytes[2]);
  forward_job(&a, p, &r, 1);
  a.t[MOK_SLOT_W_DOWN].bytes = one_way;
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  CHECK_STR_CONTAINS(res.message, "tensor 'w_down' has");
  backward_job(&a, p, &r, MOK_JOB_RECOMPUTE, 0);
  a.t[MOK_SLOT_W_GATE].bytes = one_way;
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  CHECK_STR_CONTAINS(res.message, "tensor 'w_gate' has");
  forward_job(&a, p, &r, 1);
  put(&a, MOK_SLOT_W_UP, p->wu_l, p->n_w, MOK_DTYPE_BF16); /* the master, not the packed form */
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  job_init(&a, p, MOK_OP_QUANTIZE_WEIGHT, 0);
  a.tokens = 0;
  put(&a, MOK_SLOT_PACKED_WEIGHT, p->packed[0], p->packed_bytes[0], MOK_DTYPE_U8);
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_EINVAL);
  CHECK_STR_CONTAINS(res.message, "exactly one source weight");
  put(&a, MOK_SLOT_W_GATE, p->wg_l, p->n_w, MOK_DTYPE_BF16);
  put(&a, MOK_SLOT_W_UP, p->wu_l, p->n_w, MOK_DTYPE_BF16);
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_EINVAL);
  a.t[MOK_SLOT_W_UP].ptr = NULL;
  a.tokens = 2;
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_EINVAL);
  a.tokens = 0;
  a.t[MOK_SLOT_PACKED_WEIGHT].bytes--;
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  a.t[MOK_SLOT_PACKED_WEIGHT].bytes = one_way; /* w_gate's shape is w_down's transposed */
  res = run_job(e, &a);
  CHECK_EQ_INT(res.status, MOK_ESHAPE);
  results_free(&r);
  mok_engine_cpu.close(e);
}

static const check_case cases[] = {
    CHECK_CASE(test_ref64_finite_differences),
    CHECK_CASE(test_f32_basic),
    CHECK_CASE(test_bf16_basic),
    CHECK_CASE(test_shared_and_window),
    CHECK_CASE(test_ragged_shapes),
    CHECK_CASE(test_multi_block_shapes),
    CHECK_CASE(test_idle_experts),
    CHECK_CASE(test_one_expert),
    CHECK_CASE(test_dropped_slots),
    CHECK_CASE(test_topk_one),
    CHECK_CASE(test_router_weight_zero),
    CHECK_CASE(test_clamp),
    CHECK_CASE(test_no_tokens),
    CHECK_CASE(test_no_tokens_null_tensors),
    CHECK_CASE(test_threads_bitwise),
    CHECK_CASE(test_recompute_bitwise),
    CHECK_CASE(test_steps_chain_bitwise),
    CHECK_CASE(test_matches_math_md_bitwise),
    CHECK_CASE(test_bad_routing_ids),
    CHECK_CASE(test_corrupt_schedule_and_ctx),
    CHECK_CASE(test_random_ctx_garbage),
    CHECK_CASE(test_missing_and_short_tensors),
    CHECK_CASE(test_prepare_layer),
    CHECK_CASE(test_fp8_quantize_weight_matches_the_recipe),
    CHECK_CASE(test_fp8_layer_matches_the_recipe),
    CHECK_CASE(test_fp8_error_against_the_unquantised_layer),
    CHECK_CASE(test_fp8_bitwise),
    CHECK_CASE(test_fp8_jobs_read_their_own_section),
    CHECK_CASE(test_fp8_refusals),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
