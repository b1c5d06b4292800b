/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine's expert-parallel layer (docs/ep.md): forward and backward
 * of a layer on a group, through the group's shared host segment.
 *
 * Rank r of W, E_loc = E / W local experts r*E_loc ..:
 *   forward:  copy x, topk_ids, router_weights into r's slots; barrier 1
 *             (with every member's job signature compared); build the
 *             schedule of the virtual batch (all ranks' slots, W*T_max
 *             tokens) for the local experts and PULL its rows from every
 *             rank's x; compute; PUSH each output row into its owner's
 *             unique (t,k) landing slot; barrier 2; the shared expert and
 *             the ordered K-sum on the own tokens, locally.
 *   backward: copy x, d_out, router_weights (and, with recompute, topk_ids);
 *             barrier 1; pull x and d_out rows; compute_backward on the
 *             local experts (weight gradients stay local); push d_x rows and
 *             d_rw values into the owner's (t,k) slots; barrier 2; shared
 *             expert and ordered K-sum of d_x locally.
 * Every routed row goes through the same row-independent, fixed-order code
 * as a single-daemon job, and each local expert's rows keep ascending
 * (rank, token, k) order, so results equal the cpu engine's EP=1 bits.
 *
 * An fp8 layer runs on a bf16 group: the rows exchanged are its bf16
 * activations, and the steps quantise the routed rows this rank computes
 * on (1x128 blocks of one row: the bytes the single-daemon layer gives
 * them), so its bits equal EP=1's too. Its weights are packed (the rank's
 * local experts); it runs without a ring (engine_groups.c).
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cpu/steps.h"
#include "clock.h"
#include "ep/group.h"
#include "mok_slots.h"

static void *slot_tensor(const job_env *env, int slot) { return env->tensors[slot]; }

/* env for the routed part: the virtual batch of all ranks' slots. */
static mok_status virtual_env(const job_env *l, job_env *v) {
  *v = *l;
  const mok_layer_config *c = l->cfg;
  v->T = (size_t)c->group_world * c->group_tokens;
  v->Is = 0;
  v->dims = mok_group_routed_dims(c);
  v->rows_cap = (size_t)mok_rows_capacity(&v->dims);
  v->shape = (mok_sched_shape){v->dims, c->experts, c->first_expert};
  char msg[MOK_JOB_MESSAGE_MAX];
  mok_status st = mok_schedule_shape_check(&v->shape, msg, sizeof msg);
  if (st != MOK_OK) return mok__cpu_job_fail(v, st, "group batch: %s", msg);
  return MOK_OK;
}

/* Push: landing[row_slot[r]] = rows[r] for every used row. */
typedef struct push_arg {
  const mok_sched_view *v;
  const char *rows;
  char *land;
  size_t row_bytes;
  const float *drw_virtual; /* backward: d_rw per virtual slot, or NULL */
  float *drw_land;
} push_arg;

static void push_rows(void *p, size_t r0, size_t r1) {
  const push_arg *a = p;
  for (size_t r = r0; r < r1; r++) {
    int32_t slot = a->v->row_slot[r];
    if (slot < 0) continue;
    memcpy(a->land + (size_t)slot * a->row_bytes, a->rows + r * a->row_bytes, a->row_bytes);
    if (a->drw_virtual) a->drw_land[slot] = a->drw_virtual[slot];
  }
}

static void push(job_env *v, const mok_sched_view *sv, const void *rows, void *land,
                 const float *drw_virtual, float *drw_land) {
  push_arg a = {sv, rows, land, v->H * v->es, drw_virtual, drw_land};
  mok__cpu_par_for(v, sv->rows_used, push_rows, &a);
}

/* ---- the ring: macrobatches of whole local experts -------------------------
 *
 * With a ring (the group's ring_rows), the routed buffers hold ring rows and
 * the schedule's rows run in macrobatches: each takes as many whole local
 * experts, in order, as fit the ring, and is pulled, computed and pushed
 * before the next reuses the buffers. An expert never spans two
 * macrobatches, so its weight gradients are one pass over its rows and
 * every result keeps the bits of a run without a ring. The ctx keeps every
 * row's activations (it is sized by the group's capacity, not the ring). */
typedef struct macrobatch {
  size_t e0, e1;  /* local experts [e0, e1) */
  size_t base, n; /* schedule rows [base, base + n) */
} macrobatch;

static size_t ring_rows(const job_env *v) {
  size_t ring = v->cfg->group_ring;
  return ring && ring < v->rows_cap ? ring : 0;
}

/* The macrobatch that starts at local expert e0. */
static mok_status next_macrobatch(job_env *v, const mok_sched_view *sv, size_t ring, size_t e0,
                                  macrobatch *mb) {
  size_t base = (size_t)sv->offsets[e0], e1 = e0;
  while (e1 < sv->local_experts && (size_t)sv->offsets[e1 + 1] - base <= ring) e1++;
  if (e1 == e0)
    return mok__cpu_job_fail(v, MOK_EOVERFLOW,
                             "ring_rows %zu < expert %zu's %d rows: raise ring_rows (to at least "
                             "world*max_tokens)",
                             ring, sv->first_expert + e0, sv->offsets[e0 + 1] - sv->offsets[e0]);
  *mb = (macrobatch){e0, e1, base, (size_t)sv->offsets[e1] - base};
  return MOK_OK;
}

static void *expert_offset(void *w, size_t e, size_t per_expert) {
  return w ? (char *)w + e * per_expert : NULL;
}

/* The env and schedule view of one macrobatch: its experts' weights (and
 * weight gradients), its rows renumbered from 0 (slots of other
 * macrobatches: -1), its own acts layout of n rows. */
static mok_status macrobatch_env(job_env *v, const mok_sched_view *sv, const macrobatch *mb,
                                 job_env *s, mok_sched_view *ssv) {
  size_t n_exp = mb->e1 - mb->e0, n_slots = v->T * v->K;
  int32_t *offsets = mok__cpu_scratch(v, SCR_EP_MB_OFFSETS, (v->E_loc + 1) * sizeof(int32_t));
  int32_t *slot_row = mok__cpu_scratch(v, SCR_EP_MB_SLOT_ROW, n_slots * sizeof(int32_t));
  if (!offsets || !slot_row) return v->res->status;
  for (size_t e = 0; e <= n_exp; e++) offsets[e] = sv->offsets[mb->e0 + e] - (int32_t)mb->base;
  for (size_t i = 0; i < n_slots; i++) {
    int32_t r = sv->slot_row[i];
    slot_row[i] = r >= (int32_t)mb->base && (size_t)r < mb->base + mb->n ? r - (int32_t)mb->base
                                                                          : -1;
  }
  *s = *v;
  s->E_loc = n_exp;
  s->rows_cap = mb->n;
  s->dims.local_experts = n_exp;
  s->dims.rows_limit = mb->n ? mb->n : 1; /* the acts layout of the ring rows */
  size_t gu = v->I * v->H * v->es; /* [I,H] and [H,I]: one expert's weights */
  static const int per_expert[] = {MOK_SLOT_W_GATE,   MOK_SLOT_W_UP,   MOK_SLOT_W_DOWN,
                                   MOK_SLOT_D_W_GATE, MOK_SLOT_D_W_UP, MOK_SLOT_D_W_DOWN};
  for (size_t i = 0; i < sizeof per_expert / sizeof per_expert[0]; i++)
    s->tensors[per_expert[i]] = expert_offset(v->tensors[per_expert[i]], mb->e0, gu);
  *ssv = *sv;
  ssv->local_experts = (uint32_t)n_exp;
  ssv->first_expert = sv->first_expert + (uint32_t)mb->e0;
  ssv->rows_capacity = ssv->rows_used = (uint32_t)mb->n;
  ssv->counts = sv->counts + mb->e0;
  ssv->offsets = offsets;
  ssv->row_slot = sv->row_slot + mb->base;
  ssv->slot_row = slot_row;
  return MOK_OK;
}

/* acts rows [0, n) of a macrobatch <-> rows [base, base + n) of the ctx's
 * g_routed and u_routed (whose layout is the full schedule's). */
static void acts_rows_copy(const job_env *v, const job_env *s, const macrobatch *mb, void *ctx_acts,
                           void *ring_acts, bool to_ctx) {
  size_t row = v->I * v->es, full = mok_acts_routed_bytes(&v->dims);
  size_t ring = mok_acts_routed_bytes(&s->dims);
  for (int half = 0; half < 2; half++) {
    char *c = (char *)ctx_acts + half * full + mb->base * row;
    char *r = (char *)ring_acts + half * ring;
    if (to_ctx)
      memcpy(c, r, mb->n * row);
    else
      memcpy(r, c, mb->n * row);
  }
}

/* Rows past the last macrobatch, and the arrays' padding, as a pass without
 * a ring leaves them: zero. */
static void acts_zero_tail(const job_env *v, void *ctx_acts, size_t rows_used) {
  size_t row = v->I * v->es, full = mok_acts_routed_bytes(&v->dims);
  for (int half = 0; half < 2; half++)
    memset((char *)ctx_acts + half * full + rows_used * row, 0, full - rows_used * row);
}

/* This rank's copy-in: x-like rows and the routing of its tokens (ids of
 * tokens past T are -1: they route nowhere). */
static void copy_in_rows(const job_env *l, const mok_ep_group *g, void *dst_all, const void *src) {
  size_t row_bytes = l->H * l->es, T_max = mok_ep_group_get_sizing(g)->max_tokens;
  memcpy((char *)dst_all + (size_t)mok_ep_group_rank(g) * T_max * row_bytes, src, l->T * row_bytes);
}

static void copy_in_routing(const job_env *l, const mok_ep_group *g, const int32_t *ids,
                            const float *rw) {
  const mok_ep_group_buffers *b = mok_ep_group_bufs(g);
  size_t K = l->K, T_max = mok_ep_group_get_sizing(g)->max_tokens;
  size_t base = (size_t)mok_ep_group_rank(g) * T_max * K;
  if (ids) {
    memcpy(b->ids + base, ids, l->T * K * sizeof(int32_t));
    for (size_t i = l->T * K; i < T_max * K; i++) b->ids[base + i] = -1;
  }
  memcpy(b->rw + base, rw, l->T * K * sizeof(float));
}

/* The own tokens' view of the landing slots: slot_row[t*K+k] = t*K+k for a
 * routed slot, -1 for a dropped one (rows = this rank's landing block). */
static mok_status own_view(job_env *l, const int32_t *ids, mok_sched_view *v) {
  size_t n = l->T * l->K;
  int32_t *slot_row = mok__cpu_scratch(l, SCR_EP_SLOT_ROW, n * sizeof(int32_t));
  if (!slot_row) return l->res->status;
  for (size_t i = 0; i < n; i++) slot_row[i] = ids[i] >= 0 ? (int32_t)i : -1;
  memset(v, 0, sizeof *v);
  v->tokens = (uint32_t)l->T;
  v->topk = (uint32_t)l->K;
  v->slot_row = slot_row;
  return MOK_OK;
}

static void *own_landing(const job_env *l, const mok_ep_group *g) {
  size_t T_max = mok_ep_group_get_sizing(g)->max_tokens;
  return (char *)mok_ep_group_bufs(g)->land +
         (size_t)mok_ep_group_rank(g) * T_max * l->K * l->H * l->es;
}

/* ctx of a group layer (mok_wire.h): virtual schedule | own ids | acts. */
typedef struct group_ctx {
  int32_t *sched;
  int32_t *ids;
  void *acts_routed; /* g_routed, u_routed: the virtual env's acts layout */
  void *g_shared, *u_shared;
} group_ctx;

static group_ctx ctx_split(const job_env *l, const job_env *v, void *ctx, bool zero_padding) {
  const mok_layer_config *c = l->cfg;
  group_ctx g;
  char *base = ctx;
  uint64_t sched_bytes = mok_schedule_bytes(&v->dims), ids_off = mok_group_ctx_ids_offset(c);
  uint64_t ids_bytes = 4ull * l->T * l->K, acts_off = mok_group_ctx_acts_offset(c, (uint32_t)l->T);
  uint64_t routed = mok_acts_routed_bytes(&v->dims), shared = mok_acts_shared_bytes(&l->dims);
  g.sched = (int32_t *)base;
  g.ids = (int32_t *)(base + ids_off);
  g.acts_routed = base + acts_off;
  g.g_shared = base + acts_off + 2 * routed;
  g.u_shared = (char *)g.g_shared + shared;
  if (zero_padding) {
    size_t shared_used = l->T * l->Is * l->es;
    memset(base + sched_bytes, 0, ids_off - sched_bytes);
    memset(base + ids_off + ids_bytes, 0, acts_off - ids_off - ids_bytes);
    memset((char *)g.g_shared + shared_used, 0, shared - shared_used);
    memset((char *)g.u_shared + shared_used, 0, shared - shared_used);
  }
  return g;
}

/* The rank's own routing ids (the job's, or a ctx's), copied once into
 * scratch: everything after reads the copy, never the client's buffer. */
static const int32_t *own_ids_in(job_env *l, const int32_t *ids) {
  size_t bytes = l->T * l->K * sizeof(int32_t);
  int32_t *copy = mok__cpu_scratch(l, SCR_EP_OWN_IDS, bytes);
  if (copy) memcpy(copy, ids, bytes);
  return copy;
}

/* The rank's own checks before barrier 1, posted so that every member
 * fails the job with the same message: its copy of the ids could be made
 * (ids NULL: scratch failed, l->res says why) and every id is in range. */
static mok_status own_checks(job_env *l, const int32_t *ids, mok_ep_group_post *post) {
  if (!ids) {
    snprintf(post->msg, sizeof post->msg, "%.*s", (int)sizeof post->msg - 1, l->res->message);
    return l->res->status != MOK_OK ? l->res->status : MOK_ENOMEM;
  }
  return mok_routing_check(&l->shape, ids, post->msg, sizeof post->msg);
}

static void group_fail(job_env *l, int st, const char *err) {
  mok__cpu_job_fail(l, st, "%s", err);
}

static void ep_forward(job_env *l, job_env *v, mok_ep_group *g) {
  char err[MOK_JOB_MESSAGE_MAX];
  const mok_ep_group_buffers *b = mok_ep_group_bufs(g);
  const float *rw = slot_tensor(l, MOK_SLOT_ROUTER_W);
  const void *x = slot_tensor(l, MOK_SLOT_X);
  mok_ep_cpu_timing *tm = &l->eng->ep_timing;
  memset(tm, 0, sizeof *tm);
  uint64_t t0 = mok_clock_ns();
  int st = mok_ep_group_job_start(g, err, sizeof err);
  if (st != MOK_OK) {
    group_fail(l, st, err);
    return;
  }
  const int32_t *ids = own_ids_in(l, slot_tensor(l, MOK_SLOT_TOPK_IDS));
  copy_in_rows(l, g, b->x, x);
  copy_in_routing(l, g, ids, rw);
  uint64_t t1 = mok_clock_ns();
  tm->copy_in_ns = t1 - t0;
  mok_ep_group_post post =
      mok_ep_group_post_for(l->cfg, l->args->op, l->args->flags, (uint32_t)l->T);
  post.status = own_checks(l, ids, &post);
  st = mok_ep_group_job_post(g, &post, err, sizeof err);
  uint64_t t2 = mok_clock_ns();
  tm->barrier1_ns = t2 - t1;
  if (st != MOK_OK) {
    group_fail(l, st, err);
    return;
  }

  /* pull, compute, push: failures are posted at barrier 2 */
  void *ctx = slot_tensor(l, MOK_SLOT_CTX);
  group_ctx gc = {0};
  if (ctx) gc = ctx_split(l, v, ctx, true);
  const size_t ring = ring_rows(v);
  size_t routed_bytes = (ring ? ring : v->rows_cap) * v->H * v->es;
  void *routed_x = mok__cpu_scratch(v, SCR_LAYER_ROUTED_X, routed_bytes);
  void *routed_y = mok__cpu_scratch(v, SCR_LAYER_ROUTED_Y, routed_bytes);
  mok_status local = (routed_x && routed_y) ? MOK_OK : v->res->status;
  mok_sched_view sv;
  if (local == MOK_OK) local = mok__cpu_schedule_build(v, b->ids, ctx ? gc.sched : NULL, &sv);
  if (local == MOK_OK) {
    tm->rows = sv.rows_used;
    tm->row_bytes = v->H * v->es;
  }
  if (local == MOK_OK && !ring) {
    uint64_t a = mok_clock_ns();
    mok__cpu_gather_rows(v, &sv, b->x, routed_x); /* the pull */
    uint64_t bb = mok_clock_ns();
    tm->pull_ns = bb - a;
    local =
        mok__cpu_step_compute(v, &sv, routed_x, NULL, routed_y, NULL, ctx ? gc.acts_routed : NULL);
    tm->compute_ns = mok_clock_ns() - bb;
    if (local == MOK_OK) {
      uint64_t c = mok_clock_ns();
      push(v, &sv, routed_y, b->land, NULL, NULL);
      tm->push_ns = mok_clock_ns() - c;
    }
  }
  for (size_t e0 = 0; local == MOK_OK && ring && e0 < sv.local_experts;) {
    macrobatch mb;
    job_env s;
    mok_sched_view ssv;
    void *ring_acts = NULL;
    local = next_macrobatch(v, &sv, ring, e0, &mb);
    if (local == MOK_OK) local = macrobatch_env(v, &sv, &mb, &s, &ssv);
    if (local == MOK_OK && ctx &&
        !(ring_acts = mok__cpu_scratch(v, SCR_EP_RING_ACTS, mok_acts_bytes(&s.dims))))
      local = v->res->status;
    if (local != MOK_OK) break;
    uint64_t a = mok_clock_ns();
    mok__cpu_gather_rows(&s, &ssv, b->x, routed_x);
    uint64_t bb = mok_clock_ns();
    local = mok__cpu_step_compute(&s, &ssv, routed_x, NULL, routed_y, NULL, ring_acts);
    uint64_t c = mok_clock_ns();
    if (local == MOK_OK) {
      if (ctx) acts_rows_copy(v, &s, &mb, gc.acts_routed, ring_acts, true);
      push(&s, &ssv, routed_y, b->land, NULL, NULL);
    }
    tm->pull_ns += bb - a;
    tm->compute_ns += c - bb;
    tm->push_ns += mok_clock_ns() - c;
    e0 = mb.e1;
  }
  if (local == MOK_OK && ring && ctx) acts_zero_tail(v, gc.acts_routed, sv.rows_used);
  uint64_t t3 = mok_clock_ns();
  st = mok_ep_group_job_finish(g, local, local == MOK_OK ? "" : v->res->message, err, sizeof err);
  uint64_t t4 = mok_clock_ns();
  tm->barrier2_ns = t4 - t3;
  if (st != MOK_OK) {
    l->res->status = MOK_OK; /* the group's verdict replaces a local message */
    {
    group_fail(l, st, err);
    return;
  }
  }

  /* local: the shared expert and the ordered K-sum */
  if (ctx) memcpy(gc.ids, ids, l->T * l->K * sizeof(int32_t));
  void *shared_y = NULL;
  if (l->Is) {
    shared_y = mok__cpu_scratch(l, SCR_LAYER_SHARED_Y, l->T * l->H * l->es);
    if (!shared_y) return;
    if (mok__cpu_shared_forward(l, x, ctx ? gc.g_shared : NULL, ctx ? gc.u_shared : NULL,
                                shared_y) != MOK_OK)
      return;
  }
  mok_sched_view own;
  if (own_view(l, ids, &own) != MOK_OK) return;
  mok__cpu_step_combine(l, &own, own_landing(l, g), rw, shared_y, slot_tensor(l, MOK_SLOT_OUT));
  tm->local_ns = mok_clock_ns() - t4;
}

/* The routed part of backward with a ring: per macrobatch, pull x (and with
 * recompute, the gate/up GEMM again) and d_out, backward of its experts,
 * push d_x rows and d_rw. */
static mok_status ring_backward(job_env *v, const mok_ep_group *g, group_ctx *gc, bool recompute,
                                void *routed_x, void *routed_dout, void *routed_dx,
                                float *drw_v) {
  const mok_ep_group_buffers *b = mok_ep_group_bufs(g);
  mok_sched_view sv;
  mok_status local;
  if (recompute) {
    if ((local = mok__cpu_schedule_build(v, b->ids, gc->sched, &sv)) != MOK_OK) return local;
  } else if ((local = mok__cpu_schedule_in(v, gc->sched, &sv)) != MOK_OK) {
    return local;
  }
  size_t n_slots = v->T * v->K, ring = ring_rows(v);
  float *drw_mb = mok__cpu_scratch(v, SCR_EP_MB_DRW, n_slots * sizeof(float));
  if (!drw_mb) return v->res->status;
  memset(drw_v, 0, n_slots * sizeof(float));
  for (size_t e0 = 0; e0 < sv.local_experts;) {
    macrobatch mb;
    job_env s;
    mok_sched_view ssv;
    void *ring_acts;
    if ((local = next_macrobatch(v, &sv, ring, e0, &mb)) != MOK_OK ||
        (local = macrobatch_env(v, &sv, &mb, &s, &ssv)) != MOK_OK)
      return local;
    if (!(ring_acts = mok__cpu_scratch(v, SCR_EP_RING_ACTS, mok_acts_bytes(&s.dims))))
      return v->res->status;
    mok__cpu_gather_rows(&s, &ssv, b->x, routed_x);
    if (recompute) {
      if ((local = mok__cpu_step_compute(&s, &ssv, routed_x, NULL, NULL, NULL, ring_acts)) !=
          MOK_OK)
        return local;
      acts_rows_copy(v, &s, &mb, gc->acts_routed, ring_acts, true);
    } else {
      acts_rows_copy(v, &s, &mb, gc->acts_routed, ring_acts, false);
    }
    mok__cpu_gather_rows(&s, &ssv, b->d_out, routed_dout);
    local = mok__cpu_step_compute_bwd(&s, &ssv, ring_acts, routed_x, routed_dout, b->rw, NULL, NULL,
                                      routed_dx, drw_mb, NULL);
    if (local != MOK_OK) return local;
    for (size_t i = 0; i < n_slots; i++)
      if (ssv.slot_row[i] >= 0) drw_v[i] = drw_mb[i];
    push(&s, &ssv, routed_dx, b->land, drw_v, b->d_rw);
    e0 = mb.e1;
  }
  if (recompute) acts_zero_tail(v, gc->acts_routed, sv.rows_used);
  return MOK_OK;
}

static void ep_backward(job_env *l, job_env *v, mok_ep_group *g) {
  char err[MOK_JOB_MESSAGE_MAX];
  const mok_ep_group_buffers *b = mok_ep_group_bufs(g);
  const bool recompute = (l->args->flags & MOK_JOB_RECOMPUTE) != 0;
  const float *rw = slot_tensor(l, MOK_SLOT_ROUTER_W);
  const void *x = slot_tensor(l, MOK_SLOT_X), *d_out = slot_tensor(l, MOK_SLOT_D_OUT);
  void *ctx = slot_tensor(l, MOK_SLOT_CTX);
  int st = mok_ep_group_job_start(g, err, sizeof err);
  if (st != MOK_OK) {
    group_fail(l, st, err);
    return;
  }
  group_ctx gc = {0};
  if (!ctx) ctx = mok__cpu_scratch(l, SCR_LAYER_CTX, mok_group_ctx_bytes(l->cfg, (uint32_t)l->T));
  /* own routing: the job's topk_ids with recompute, else the forward's
   * copy in ctx (client memory: copied once, checked like any routing) */
  const int32_t *ids = NULL;
  if (ctx) {
    gc = ctx_split(l, v, ctx, recompute);
    ids = own_ids_in(l, recompute ? slot_tensor(l, MOK_SLOT_TOPK_IDS) : gc.ids);
  }
  mok_ep_group_post post =
      mok_ep_group_post_for(l->cfg, l->args->op, l->args->flags, (uint32_t)l->T);
  post.status = own_checks(l, ids, &post);
  if (recompute && post.status == MOK_OK) memcpy(gc.ids, ids, l->T * l->K * sizeof(int32_t));
  copy_in_rows(l, g, b->x, x);
  copy_in_rows(l, g, b->d_out, d_out);
  copy_in_routing(l, g, ids, rw);
  st = mok_ep_group_job_post(g, &post, err, sizeof err);
  if (st != MOK_OK) {
    group_fail(l, st, err);
    return;
  }

  const size_t ring = ring_rows(v);
  size_t routed_bytes = (ring ? ring : v->rows_cap) * v->H * v->es;
  void *routed_x = mok__cpu_scratch(v, SCR_LAYER_ROUTED_X, routed_bytes);
  void *routed_dout = mok__cpu_scratch(v, SCR_LAYER_ROUTED_DOUT, routed_bytes);
  void *routed_dx = mok__cpu_scratch(v, SCR_LAYER_ROUTED_DX, routed_bytes);
  float *drw_v = mok__cpu_scratch(v, SCR_EP_DRW, v->T * v->K * sizeof(float));
  mok_status local = (routed_x && routed_dout && routed_dx && drw_v) ? MOK_OK : v->res->status;
  mok_sched_view sv;
  if (local == MOK_OK && ring) {
    local = ring_backward(v, g, &gc, recompute, routed_x, routed_dout, routed_dx, drw_v);
  } else if (local == MOK_OK && recompute) {
    local = mok__cpu_schedule_build(v, b->ids, gc.sched, &sv);
    if (local == MOK_OK) {
      mok__cpu_gather_rows(v, &sv, b->x, routed_x);
      local = mok__cpu_step_compute(v, &sv, routed_x, NULL, NULL, NULL, gc.acts_routed);
    }
  } else if (local == MOK_OK) {
    local = mok__cpu_schedule_in(v, gc.sched, &sv);
    if (local == MOK_OK) mok__cpu_gather_rows(v, &sv, b->x, routed_x);
  }
  if (local == MOK_OK && !ring) {
    mok__cpu_gather_rows(v, &sv, b->d_out, routed_dout); /* the reverse combine's pull */
    local = mok__cpu_step_compute_bwd(v, &sv, gc.acts_routed, routed_x, routed_dout, b->rw, NULL,
                                      NULL, routed_dx, drw_v, NULL);
  }
  if (local == MOK_OK && !ring) push(v, &sv, routed_dx, b->land, drw_v, b->d_rw);
  st = mok_ep_group_job_finish(g, local, local == MOK_OK ? "" : v->res->message, err, sizeof err);
  if (st != MOK_OK) {
    l->res->status = MOK_OK;
    {
    group_fail(l, st, err);
    return;
  }
  }

  /* local: shared expert (recomputed acts with recompute), ordered K-sums */
  void *shared_dx = NULL;
  if (l->Is) {
    if (recompute &&
        mok__cpu_shared_forward(l, x, gc.g_shared, gc.u_shared, NULL) != MOK_OK)
      return;
    shared_dx = mok__cpu_scratch(l, SCR_LAYER_SHARED_DX, l->T * l->H * l->es);
    if (!shared_dx) return;
    if (mok__cpu_shared_backward(l, x, gc.g_shared, gc.u_shared, d_out, shared_dx) != MOK_OK)
      return;
  }
  mok_sched_view own;
  if (own_view(l, ids, &own) != MOK_OK) return;
  float *d_rw = slot_tensor(l, MOK_SLOT_D_RW);
  size_t T_max = mok_ep_group_get_sizing(g)->max_tokens;
  const float *drw_own = b->d_rw + (size_t)mok_ep_group_rank(g) * T_max * l->K;
  for (size_t i = 0; i < l->T * l->K; i++) d_rw[i] = own.slot_row[i] >= 0 ? drw_own[i] : 0.0f;
  mok__cpu_step_dispatch_bwd(l, &own, own_landing(l, g), shared_dx, slot_tensor(l, MOK_SLOT_D_X));
}

void mok__cpu_run_group(mok_engine *e, struct mok_ep_group *g, const mok_job_args *a,
                        mok_engine_result *res) {
  job_env l, v;
  if (mok__cpu_env_init(&l, e, a, res) != MOK_OK) return;
  if (a->op != MOK_OP_FORWARD && a->op != MOK_OP_BACKWARD) {
    mok__cpu_job_fail(&l, MOK_EUNSUPPORTED,
                      "a layer on a group runs forward and backward; single steps need a layer "
                      "without a group");
    return;
  }
  const mok_layer_config *c = a->layer;
  const mok_ep_group_sizing *sz = mok_ep_group_get_sizing(g);
  if (c->group_world != sz->world || c->group_tokens != sz->max_tokens ||
      c->group_rank != mok_ep_group_rank(g) || c->hidden != sz->hidden || c->topk != sz->topk ||
      c->experts != sz->experts || mok_layer_act_dtype(c->dtype) != sz->dtype ||
      (l.fp8 && sz->ring_rows)) { /* fp8: no ring (engine_groups.c) */
    mok__cpu_job_fail(&l, MOK_EINVAL, "the layer does not fit its group's sizing");
    return;
  }
  if (virtual_env(&l, &v) != MOK_OK) return;
  if (a->op == MOK_OP_FORWARD)
    ep_forward(&l, &v, g);
  else
    ep_backward(&l, &v, g);
}

const mok_ep_cpu_timing *mok__cpu_ep_last_timing(const mok_engine *e) { return &e->ep_timing; }
