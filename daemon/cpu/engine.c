/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine: docs/math.md on the host, f32, bf16 and fp8 layers.
 *
 * Here: the engine table, its scratch, client sessions (each on a runner
 * of its own, cpu/runner.c) and the ops, each a chain of the steps
 * (cpu/steps.c) on engine scratch, so the whole layer gives the bits of the
 * single-step chain. Expert-parallel jobs: cpu/ep.c.
 *
 * Memory: scratch buffers are cached in the engine and grown on demand; the
 * routed buffers are bounded by max_tokens, the weight copies (transposed
 * for forward, widened for bf16) by the size of the layer's weights.
 * run() is called by one thread at a time (the engine thread).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "cpu/pool.h"
#include "cpu/runner.h"
#include "cpu/steps.h"
#include "engine.h"
#include "job_check.h"
#include "layer.h"
#include "mok_slots.h"
#include "schedule.h"

/* ---- engine state and scratch --------------------------------------------- */

/* A client session: its scratch and the runner that runs its jobs in order. */
struct mok_engine_session {
  mok_engine *e;
  cpu_scratch_set scr;
  cpu_runner *runner;
};

/* Stands in for a tensor of zero bytes handed over as NULL, so that NULL
 * always means "absent" inside the engine. Never read or written. */
static max_align_t empty_tensor[1];

mok_status mok__cpu_job_fail(job_env *env, mok_status st, const char *fmt, ...) {
  char *m = env->res->message;
  int n = snprintf(m, sizeof env->res->message, "%s: ", env->op_name);
  if (n < 0 || n >= (int)sizeof env->res->message) n = 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(m + n, sizeof env->res->message - (size_t)n, fmt, ap);
  va_end(ap);
  env->res->status = st;
  return st;
}

/* Scratch memory: large buffers straight from mmap, so that giving them
 * back really returns them to the system (malloc keeps freed heap memory,
 * and raises its mmap threshold after large frees). */
#define SCRATCH_MMAP_BYTES (256u << 10)

static void *scratch_alloc(size_t cap) {
  if (cap >= SCRATCH_MMAP_BYTES) {
    void *p = mmap(NULL, cap, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
  }
  void *p = NULL;
  return posix_memalign(&p, 64, cap) == 0 ? p : NULL;
}

static void scratch_free(void *p, size_t cap) {
  if (!p) return;
  if (cap >= SCRATCH_MMAP_BYTES) munmap(p, cap);
  else free(p);
}

/* Returns a buffer of at least `bytes` (64-byte aligned), or NULL after
 * failing the job with MOK_ENOMEM. */
void *mok__cpu_scratch(job_env *env, int id, size_t bytes) {
  cpu_scratch_buf *b = &env->scr->buf[id];
  if (bytes == 0) bytes = 64;
  if (b->cap < bytes) {
    mok_engine *e = env->eng;
    size_t cap = (bytes + 63u) & ~(size_t)63u;
    if (cap < bytes) {
      mok__cpu_job_fail(env, MOK_ENOMEM, "scratch of %zu bytes is too large", bytes);
      return NULL;
    }
    uint64_t grow = cap - b->cap;
    uint64_t total = atomic_fetch_add(&e->scratch_total, grow) + grow;
    if (total > e->scratch_limit) {
      atomic_fetch_sub(&e->scratch_total, grow);
      mok__cpu_job_fail(
          env, MOK_ENOMEM,
          "%zu MiB more scratch would pass the cpu engine's budget of %llu MiB (held by "
          "running jobs; retry, or run smaller jobs)",
          (size_t)(grow >> 20), (unsigned long long)(e->scratch_limit >> 20));
      return NULL;
    }
    void *p = scratch_alloc(cap);
    if (!p) {
      atomic_fetch_sub(&e->scratch_total, grow);
      mok__cpu_job_fail(env, MOK_ENOMEM, "out of memory for %zu bytes of scratch", bytes);
      return NULL;
    }
    scratch_free(b->ptr, b->cap);
    b->ptr = p;
    b->cap = cap;
    atomic_fetch_add(&env->scr->bytes, grow);
  }
  return b->ptr;
}

/* Give every buffer of a set back (no job of its owner runs). */
static void scratch_release(mok_engine *e, cpu_scratch_set *set) {
  uint64_t held = 0;
  for (int i = 0; i < SCR_COUNT_; i++) {
    scratch_free(set->buf[i].ptr, set->buf[i].cap);
    held += set->buf[i].cap;
    set->buf[i].ptr = NULL;
    set->buf[i].cap = 0;
  }
  atomic_fetch_sub(&e->scratch_total, held);
  atomic_store(&set->bytes, 0);
}

void mok__cpu_par_for(job_env *env, size_t n, cpu_pool_fn fn, void *arg) {
  mok__cpu_pool_run(env->eng->pool, n, fn, arg);
}

/* ---- the ops ---------------------------------------------------------------- */

static void *tensor(const job_env *env, int slot) { return env->tensors[slot]; }

static size_t routed_bytes(const job_env *env) { return env->rows_cap * env->H * env->es; }
static size_t token_bytes(const job_env *env) { return env->T * env->H * env->es; }

/* ctx = schedule, zero padding to 256, acts. */
static void ctx_split(const job_env *env, void *ctx, int32_t **ret_sched, void **ret_acts) {
  uint64_t sb = mok_schedule_bytes(&env->dims);
  memset((char *)ctx + sb, 0, mok_align256(sb) - sb);
  *ret_sched = ctx;
  *ret_acts = (char *)ctx + mok_align256(sb);
}

static mok_status op_forward(job_env *env) {
  if (env->args->flags & MOK_JOB_QUANTIZE_WEIGHTS) { /* the masters' packed forms first */
    mok_status q = mok__cpu_fp8_quantize_weights(env);
    if (q != MOK_OK) return q;
  }
  void *ctx = tensor(env, MOK_SLOT_CTX), *acts = NULL;
  int32_t *sched_out = NULL;
  if (ctx) ctx_split(env, ctx, &sched_out, &acts);
  void *routed_x = mok__cpu_scratch(env, SCR_LAYER_ROUTED_X, routed_bytes(env));
  void *routed_y = mok__cpu_scratch(env, SCR_LAYER_ROUTED_Y, routed_bytes(env));
  void *shared_y = env->Is ? mok__cpu_scratch(env, SCR_LAYER_SHARED_Y, token_bytes(env)) : NULL;
  if (!routed_x || !routed_y || (env->Is && !shared_y)) return env->res->status;
  const void *x = tensor(env, MOK_SLOT_X);
  mok_sched_view v;
  mok_status st = mok__cpu_step_dispatch(env, x, tensor(env, MOK_SLOT_TOPK_IDS), sched_out, routed_x, &v);
  if (st != MOK_OK) return st;
  st = mok__cpu_step_compute(env, &v, routed_x, x, routed_y, shared_y, acts);
  if (st != MOK_OK) return st;
  return mok__cpu_step_combine(env, &v, routed_y, tensor(env, MOK_SLOT_ROUTER_W), shared_y,
                               tensor(env, MOK_SLOT_OUT));
}

/* The context backward reads: rebuilt (RECOMPUTE; written to the client's
 * ctx when it gave one, else kept in scratch) or the client's, copied in
 * and checked. *v views the daemon's schedule. */
static mok_status backward_context(job_env *env, mok_sched_view *v, const void **ret_acts,
                                   void *routed_x) {
  const void *x = tensor(env, MOK_SLOT_X);
  void *ctx = tensor(env, MOK_SLOT_CTX);
  if (env->args->flags & MOK_JOB_RECOMPUTE) {
    bool client_ctx = ctx != NULL;
    if (!ctx) ctx = mok__cpu_scratch(env, SCR_LAYER_CTX, mok_ctx_bytes(&env->dims));
    if (!ctx) return env->res->status;
    int32_t *sched;
    void *acts;
    ctx_split(env, ctx, &sched, &acts);
    mok_status st = mok__cpu_step_dispatch(env, x, tensor(env, MOK_SLOT_TOPK_IDS),
                                  client_ctx ? sched : NULL, routed_x, v);
    if (st != MOK_OK) return st;
    *ret_acts = acts;
    return mok__cpu_step_compute(env, v, routed_x, x, NULL, NULL, acts);
  }
  mok_status st = mok__cpu_schedule_in(env, ctx, v);
  if (st != MOK_OK) return st;
  *ret_acts = (const char *)ctx + mok_align256(mok_schedule_bytes(&env->dims));
  mok__cpu_gather_rows(env, v, x, routed_x); /* dispatch's copy, from the saved schedule */
  return MOK_OK;
}

static mok_status op_backward(job_env *env) {
  void *routed_x = mok__cpu_scratch(env, SCR_LAYER_ROUTED_X, routed_bytes(env));
  void *routed_dout = mok__cpu_scratch(env, SCR_LAYER_ROUTED_DOUT, routed_bytes(env));
  void *routed_dx = mok__cpu_scratch(env, SCR_LAYER_ROUTED_DX, routed_bytes(env));
  void *shared_dx = env->Is ? mok__cpu_scratch(env, SCR_LAYER_SHARED_DX, token_bytes(env)) : NULL;
  if (!routed_x || !routed_dout || !routed_dx || (env->Is && !shared_dx)) return env->res->status;
  mok_sched_view v;
  const void *acts = NULL;
  mok_status st = backward_context(env, &v, &acts, routed_x);
  if (st != MOK_OK) return st;
  const void *d_out = tensor(env, MOK_SLOT_D_OUT);
  mok__cpu_gather_rows(env, &v, d_out, routed_dout); /* combine_backward */
  st = mok__cpu_step_compute_bwd(env, &v, acts, routed_x, routed_dout,
                                 tensor(env, MOK_SLOT_ROUTER_W), tensor(env, MOK_SLOT_X), d_out,
                                 routed_dx, tensor(env, MOK_SLOT_D_RW), shared_dx);
  if (st != MOK_OK) return st;
  return mok__cpu_step_dispatch_bwd(env, &v, routed_dx, shared_dx, tensor(env, MOK_SLOT_D_X));
}

static mok_status op_dispatch(job_env *env) {
  mok_sched_view v;
  return mok__cpu_step_dispatch(env, tensor(env, MOK_SLOT_X), tensor(env, MOK_SLOT_TOPK_IDS),
                       tensor(env, MOK_SLOT_SCHEDULE), tensor(env, MOK_SLOT_ROUTED_X), &v);
}

static mok_status op_compute(job_env *env) {
  mok_sched_view v;
  mok_status st = mok__cpu_schedule_in(env, tensor(env, MOK_SLOT_SCHEDULE), &v);
  if (st != MOK_OK) return st;
  return mok__cpu_step_compute(env, &v, tensor(env, MOK_SLOT_ROUTED_X), tensor(env, MOK_SLOT_X),
                               tensor(env, MOK_SLOT_ROUTED_Y), tensor(env, MOK_SLOT_SHARED_Y),
                               tensor(env, MOK_SLOT_ACTS));
}

static mok_status op_combine(job_env *env) {
  mok_sched_view v;
  mok_status st = mok__cpu_schedule_in(env, tensor(env, MOK_SLOT_SCHEDULE), &v);
  if (st != MOK_OK) return st;
  return mok__cpu_step_combine(env, &v, tensor(env, MOK_SLOT_ROUTED_Y),
                               tensor(env, MOK_SLOT_ROUTER_W), tensor(env, MOK_SLOT_SHARED_Y),
                               tensor(env, MOK_SLOT_OUT));
}

static mok_status op_combine_bwd(job_env *env) {
  mok_sched_view v;
  mok_status st = mok__cpu_schedule_in(env, tensor(env, MOK_SLOT_SCHEDULE), &v);
  if (st != MOK_OK) return st;
  mok__cpu_gather_rows(env, &v, tensor(env, MOK_SLOT_D_OUT), tensor(env, MOK_SLOT_ROUTED_DOUT));
  return MOK_OK;
}

static mok_status op_compute_bwd(job_env *env) {
  mok_sched_view v;
  mok_status st = mok__cpu_schedule_in(env, tensor(env, MOK_SLOT_SCHEDULE), &v);
  if (st != MOK_OK) return st;
  return mok__cpu_step_compute_bwd(
      env, &v, tensor(env, MOK_SLOT_ACTS), tensor(env, MOK_SLOT_ROUTED_X),
      tensor(env, MOK_SLOT_ROUTED_DOUT), tensor(env, MOK_SLOT_ROUTER_W), tensor(env, MOK_SLOT_X),
      tensor(env, MOK_SLOT_D_OUT), tensor(env, MOK_SLOT_ROUTED_DX), tensor(env, MOK_SLOT_D_RW),
      tensor(env, MOK_SLOT_SHARED_DX));
}

static mok_status op_dispatch_bwd(job_env *env) {
  mok_sched_view v;
  mok_status st = mok__cpu_schedule_in(env, tensor(env, MOK_SLOT_SCHEDULE), &v);
  if (st != MOK_OK) return st;
  return mok__cpu_step_dispatch_bwd(env, &v, tensor(env, MOK_SLOT_ROUTED_DX),
                                    tensor(env, MOK_SLOT_SHARED_DX), tensor(env, MOK_SLOT_D_X));
}

/* ---- which tensors each op reads and writes --------------------------------
 *
 * The daemon's table (proto/mok_slots.c), less what this engine can do
 * without: jobs reach it through mok_engine_run too (tests, tools), without
 * the daemon's checks, and there it stays as lenient as each op allows.
 * Shapes come from the same table. */

#define SLOT_BIT(name) (1ull << MOK_SLOT_##name)

static mok_job_slots slots_of(const mok_layer_config *layer, uint32_t op, uint32_t flags) {
  mok_job_slots s = mok_job_slot_sets(layer, op, flags);
  uint64_t lenient = 0, unread = 0;
  switch (op) {
  case MOK_OP_BACKWARD:
    if (flags & MOK_JOB_RECOMPUTE)
      lenient = SLOT_BIT(CTX); /* rebuilt into scratch when none is given */
    else
      unread = SLOT_BIT(TOPK_IDS); /* the saved schedule routes; the ids are not read */
    break;
  case MOK_OP_COMPUTE:
  case MOK_OP_COMPUTE_BWD:
    /* optional to the daemon without a shared expert; only that expert reads them */
    if (!layer->shared_intermediate) unread = SLOT_BIT(X) | SLOT_BIT(D_OUT);
    break;
  case MOK_OP_COMBINE:
    lenient = SLOT_BIT(SHARED_Y); /* added when given, with or without a shared expert */
    break;
  case MOK_OP_DISPATCH_BWD:
    lenient = SLOT_BIT(SHARED_DX); /* the same for the shared expert's dx */
    break;
  default:
    break;
  }
  s.required &= ~lenient;
  s.optional = (s.optional | lenient) & ~unread;
  return s;
}

/* Expected dtype and byte size of a slot for this job (the shared table). */
static void slot_expect(const job_env *env, int slot, uint32_t *ret_dtype, uint64_t *ret_bytes) {
  uint32_t nd = 0;
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape_job(env->cfg, env->args->op, env->args->flags, env->quant_source,
                         (uint32_t)env->T, (uint32_t)slot, ret_dtype, &nd, shape);
  uint64_t n = nd ? 1 : 0;
  for (uint32_t i = 0; i < nd; i++) n *= shape[i];
  *ret_bytes = n * mok_dtype_size(*ret_dtype);
}

/* The daemon has checked shapes already; this keeps the engine safe when
 * called directly (tests, tools) and names the slot when something is off.
 * Resolves env->tensors: only the slots this op reads or writes. */
static mok_status check_tensors(job_env *env) {
  mok_job_slots s = slots_of(env->cfg, env->args->op, env->args->flags);
  uint64_t required = s.required;
  if (env->args->op == MOK_OP_QUANTIZE_WEIGHT) { /* the shapes follow the source weight */
    uint64_t present = 0;
    for (int slot = 0; slot < MOK_SLOT_COUNT_; slot++)
      if (env->args->t[slot].ptr) present |= 1ull << slot;
    char err[MOK_JOB_MESSAGE_MAX];
    if (mok_quantize_check(env->cfg, present & s.optional, &env->quant_source, err, sizeof err))
      return mok__cpu_job_fail(env, MOK_EINVAL, "%s", err);
  }
  for (int slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    uint64_t bit = 1ull << slot;
    if (!((required | s.optional) & bit)) continue;
    const mok_tensor_view *t = &env->args->t[slot];
    const char *name = mok_slot_name((uint32_t)slot);
    uint32_t dt;
    uint64_t bytes;
    slot_expect(env, slot, &dt, &bytes);
    if (!t->ptr) {
      if (!(required & bit)) continue;
      if (bytes > 0) return mok__cpu_job_fail(env, MOK_EINVAL, "tensor '%s' is required", name);
      env->tensors[slot] = empty_tensor;
      continue;
    }
    if (t->dtype != dt)
      return mok__cpu_job_fail(env, MOK_ESHAPE, "tensor '%s' has dtype %u, expected %u", name,
                               t->dtype, dt);
    if (t->bytes < bytes)
      return mok__cpu_job_fail(env, MOK_ESHAPE, "tensor '%s' has %llu bytes, expected %llu", name,
                               (unsigned long long)t->bytes, (unsigned long long)bytes);
    env->tensors[slot] = t->ptr;
  }
  return MOK_OK;
}

static mok_status check_layer(const mok_layer_config *c, char *err, size_t errlen) {
  if (c->dtype != MOK_DTYPE_F32 && c->dtype != MOK_DTYPE_BF16 && c->dtype != MOK_DTYPE_FP8_E4M3) {
    snprintf(err, errlen, "the cpu engine runs float32, bfloat16 and fp8 layers, not dtype %u",
             c->dtype);
    return MOK_EUNSUPPORTED;
  }
  if (c->dtype == MOK_DTYPE_FP8_E4M3) {
    int r = mok_layer_check_fp8_blocks(c, err, errlen);
    if (r != MOK_OK) return r;
  }
  if (!c->hidden || !c->intermediate || !c->topk || !c->local_experts || !c->experts) {
    snprintf(err, errlen, "hidden, intermediate, topk and experts must be at least 1");
    return MOK_EINVAL;
  }
  if (c->has_limit && !(c->swiglu_limit > 0.0f && isfinite(c->swiglu_limit))) {
    snprintf(err, errlen, "swiglu_limit must be finite and > 0, got %g", (double)c->swiglu_limit);
    return MOK_EINVAL;
  }
  if (c->row_align != 1) {
    snprintf(err, errlen, "the cpu engine needs row_align 1, got %u", c->row_align);
    return MOK_EINVAL;
  }
  mok_sched_shape shape = {mok_layer_dims(c, c->max_tokens), c->experts, c->first_expert};
  return mok_schedule_shape_check(&shape, err, errlen);
}

static mok_status job_env_init(job_env *env, mok_engine *e, const mok_job_args *a,
                               mok_engine_result *res) {
  memset(env, 0, sizeof *env);
  env->eng = e;
  env->scr = a->session ? &a->session->scr : &e->direct;
  env->args = a;
  env->res = res;
  env->op_name = mok_op_name(a->op);
  env->cfg = a->layer;
  const mok_layer_config *c = a->layer;
  if (!c) return mok__cpu_job_fail(env, MOK_EINVAL, "the job names no layer");
  if (a->flags & ~(uint32_t)MOK_JOB_FLAGS_ALL)
    return mok__cpu_job_fail(env, MOK_EINVAL, "unknown job flags 0x%x", a->flags);
  char err[MOK_JOB_MESSAGE_MAX];
  mok_status st = mok_job_check_flags_op(c, a->op, a->flags, err, sizeof err);
  if (st == MOK_OK) st = check_layer(c, err, sizeof err);
  if (st != MOK_OK) return mok__cpu_job_fail(env, st, "%s", err);
  if (a->tokens > c->max_tokens)
    return mok__cpu_job_fail(env, MOK_ELIMIT, "%u tokens exceed the layer's max_tokens %u",
                             a->tokens, c->max_tokens);
  if (a->op == MOK_OP_QUANTIZE_WEIGHT &&
      (st = mok_job_check_tokens_op(c, a->op, a->tokens, MOK_EINVAL, err, sizeof err)) != MOK_OK)
    return mok__cpu_job_fail(env, st, "%s", err);
  env->dtype = mok_layer_act_dtype(c->dtype);
  env->es = mok_dtype_size(env->dtype);
  env->fp8 = c->dtype == MOK_DTYPE_FP8_E4M3;
  env->quant_source = MOK_SLOT_COUNT_;
  env->T = a->tokens;
  env->H = c->hidden;
  env->I = c->intermediate;
  env->Is = c->shared_intermediate;
  env->K = c->topk;
  env->E_loc = c->local_experts;
  env->dims = mok_layer_dims(c, a->tokens);
  env->rows_cap = (size_t)mok_rows_capacity(&env->dims);
  env->shape = (mok_sched_shape){env->dims, c->experts, c->first_expert};
  return MOK_OK;
}

mok_status mok__cpu_env_init(job_env *env, mok_engine *e, const mok_job_args *a,
                             mok_engine_result *res) {
  res->status = MOK_OK;
  res->message[0] = '\0';
  mok_status st = job_env_init(env, e, a, res);
  return st == MOK_OK ? check_tensors(env) : st;
}

/* ---- the engine table ------------------------------------------------------- */

/* Half of the machine's memory: what every session's scratch together may hold. */
static uint64_t default_scratch_limit(void) {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return 8ull << 30;
  return (uint64_t)pages * (uint64_t)page / 2;
}

static int cpu_open(const mok_engine_config *cfg, mok_engine **ret, char *err, size_t errlen) {
  *ret = NULL;
  int threads = cfg ? cfg->threads : 0;
  if (threads < 0) {
    snprintf(err, errlen, "cpu engine: threads must be >= 0 (0: one per core), got %d", threads);
    return MOK_EINVAL;
  }
  mok_engine *e = calloc(1, sizeof *e);
  if (!e) {
    snprintf(err, errlen, "cpu engine: out of memory");
    return MOK_ENOMEM;
  }
  int rc = mok__cpu_pool_create(threads, &e->pool);
  if (rc) {
    snprintf(err, errlen, "cpu engine: cannot start %d worker threads: %s", threads, strerror(rc));
    free(e);
    return rc == ENOMEM ? MOK_ENOMEM : MOK_EENGINE;
  }
  e->scratch_limit = default_scratch_limit();
  e->idle_ms = cfg && cfg->workspace_idle_ms ? cfg->workspace_idle_ms : MOK_WORKSPACE_IDLE_MS;
  e->wake = cfg ? cfg->wake : NULL;
  e->wake_arg = cfg ? cfg->wake_arg : NULL;
  int n = mok__cpu_pool_threads(e->pool);
  snprintf(e->description, sizeof e->description, "cpu: %d thread%s", n, n == 1 ? "" : "s");
  *ret = e;
  return MOK_OK;
}

static void cpu_close(mok_engine *e) {
  if (!e) return;
  mok__cpu_pool_destroy(e->pool);
  scratch_release(e, &e->direct);
  free(e);
}

static const char *cpu_describe(const mok_engine *e) { return e ? e->description : "cpu"; }

static int cpu_prepare_layer(mok_engine *e, mok_layer_config *cfg, char *err, size_t errlen) {
  (void)e;
  cfg->row_align = 1;
  int r = check_layer(cfg, err, errlen);
  if (r != MOK_OK || !cfg->group_id) return r;
  /* a group layer's schedule covers the group's whole virtual batch */
  mok_sched_shape shape = {mok_group_routed_dims(cfg), cfg->experts, cfg->first_expert};
  return mok_schedule_shape_check(&shape, err, errlen);
}

static void cpu_run(mok_engine *e, const mok_job_args *a, mok_engine_result *res) {
  res->status = MOK_OK;
  res->message[0] = '\0';
  if (a->op == MOK_OP_NOP) return;
  job_env env;
  if (job_env_init(&env, e, a, res) != MOK_OK) return;
  if (check_tensors(&env) != MOK_OK) return;
  mok_status st;
  switch (a->op) {
  case MOK_OP_FORWARD: st = op_forward(&env); break;
  case MOK_OP_BACKWARD: st = op_backward(&env); break;
  case MOK_OP_DISPATCH: st = op_dispatch(&env); break;
  case MOK_OP_COMPUTE: st = op_compute(&env); break;
  case MOK_OP_COMBINE: st = op_combine(&env); break;
  case MOK_OP_COMBINE_BWD: st = op_combine_bwd(&env); break;
  case MOK_OP_COMPUTE_BWD: st = op_compute_bwd(&env); break;
  case MOK_OP_DISPATCH_BWD: st = op_dispatch_bwd(&env); break;
  case MOK_OP_QUANTIZE_WEIGHT: st = mok__cpu_op_quantize_weight(&env); break;
  default:
    st = mok__cpu_job_fail(&env, MOK_EUNSUPPORTED, "op %u is not known to the cpu engine", a->op);
  }
  if (st != MOK_OK && res->status == MOK_OK)
    mok__cpu_job_fail(&env, MOK_EENGINE, "failed (status %d)", st);
}

/* ---- sessions: jobs on the session's runner (cpu/runner.h) ------------------- */

static void session_run(void *arg, const mok_job_args *a, mok_engine_result *res) {
  mok_engine_session *s = arg;
  cpu_run(s->e, a, res);
}

static void session_idle(void *arg) {
  mok_engine_session *s = arg;
  scratch_release(s->e, &s->scr);
}

static int cpu_session_open(mok_engine *e, void *sync_page, mok_engine_session **ret, char *err,
                            size_t errlen) {
  (void)sync_page; /* no GPU fences on the cpu engine */
  *ret = NULL;
  mok_engine_session *s = calloc(1, sizeof *s);
  if (!s) {
    snprintf(err, errlen, "cpu engine: out of memory");
    return MOK_ENOMEM;
  }
  s->e = e;
  cpu_runner_ops ops = {session_run, session_idle, e->wake, e->wake_arg};
  int rc = mok__cpu_runner_start(&ops, s, e->idle_ms, &s->runner);
  if (rc) {
    free(s);
    snprintf(err, errlen, "cpu engine: cannot start the session's runner thread: %s",
             strerror(rc));
    return rc == ENOMEM || rc == EAGAIN ? MOK_ENOMEM : MOK_EENGINE;
  }
  *ret = s;
  return MOK_OK;
}

static void cpu_session_close(mok_engine *e, mok_engine_session *s) {
  if (!s) return;
  mok__cpu_runner_stop(s->runner); /* no job of it is unfinished (the engine thread's rule) */
  scratch_release(e, &s->scr);
  free(s);
}

/* Every job of a session goes through its runner, a NOP too, so that jobs
 * complete in submission order; without a session, run it here. A job on a
 * group runs here too, on the session's scratch (MOK_ENGINE_GROUPS_ON_CALLER:
 * the engine thread waited for the session's earlier jobs). */
static mok_engine_job *cpu_start(mok_engine *e, struct mok_ep_group *g, const mok_job_args *a,
                                 mok_engine_result *res) {
  if (g) {
    mok__cpu_run_group(e, g, a, res);
    return NULL;
  }
  res->status = MOK_OK;
  res->message[0] = '\0';
  if (!a->session) {
    cpu_run(e, a, res);
    return NULL;
  }
  return mok__cpu_runner_submit(a->session->runner, a, res);
}

/* Jobs of the cpu engine wait for nothing outside: now_ns (and shutdown's
 * UINT64_MAX) does not change when they end. */
static int cpu_poll(mok_engine *e, mok_engine_job *j, uint64_t now_ns, mok_engine_result *res) {
  (void)e;
  (void)now_ns;
  return mok__cpu_runner_poll(j, res);
}

static void cpu_session_memory(mok_engine *e, mok_engine_session *s, mok_session_memory *ret) {
  (void)e;
  memset(ret, 0, sizeof *ret);
  ret->scratch_bytes = atomic_load(&s->scr.bytes);
}

const mok_engine_ops mok_engine_cpu = {
    .name = "cpu",
    .groups = MOK_ENGINE_GROUPS_ON_CALLER,
    .wakes_when_done = true,
    .open = cpu_open,
    .close = cpu_close,
    .describe = cpu_describe,
    .prepare_layer = cpu_prepare_layer,
    .session_open = cpu_session_open,
    .session_close = cpu_session_close,
    .start = cpu_start,
    .poll = cpu_poll,
    .session_memory = cpu_session_memory,
};

