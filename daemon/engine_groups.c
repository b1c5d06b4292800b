/* SPDX-License-Identifier: Apache-2.0 */
/* The engine thread's expert-parallel groups (docs/ep.md, docs/ep_nccl.md):
 * JoinGroup and LeaveGroup, groups formed through NCCL on threads of their
 * own, the layers on a group, and the group a job (or a standing instance)
 * takes its turn in. The groups themselves: ep/group.c; the engines' part:
 * engine.h (start() with a group, group_*). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_thread_internal.h"
#include "log.h"
#include "mok_slots.h"
#include "mok_status.h"

/* The group a session joined (NULL: it did not, or the group is gone). */
static mok_ep_group *session_group(mok_engine_thread *t, esession *s, uint32_t id) {
  for (size_t i = 0; i < s->n_groups; i++)
    if (s->groups[i] == id) return mok_ep_group_find(t->groups, id);
  return NULL;
}

/* A layer on a group: its shapes must fit the group's sizing; it holds the
 * rank's local experts. The group's dtype is the layer's activations' (an
 * fp8 layer's are bf16: it runs on a bf16 group, its fp8 a layer property,
 * docs/ep.md "FP8 layers on a group"). */
int mok__group_layer_config(mok_engine_thread *t, esession *s, mok_layer_config *cfg, char *err,
                            size_t errlen) {
  mok_ep_group *g = session_group(t, s, cfg->group_id);
  if (!g) {
    snprintf(err, errlen, "group %u was not joined by this session (JoinGroup first)",
             cfg->group_id);
    return MOK_ENOENT;
  }
  const mok_ep_group_sizing *z = mok_ep_group_get_sizing(g);
  const bool fp8 = cfg->dtype == MOK_DTYPE_FP8_E4M3;
  if (fp8 && z->dtype != MOK_DTYPE_BF16) {
    snprintf(err, errlen,
             "an fp8 layer's activations are bfloat16: it runs on a bfloat16 group, and group "
             "%u is %s (join one with dtype bfloat16)",
             cfg->group_id, mok_dtype_name(z->dtype));
    return MOK_EINVAL;
  }
  if (cfg->hidden != z->hidden || cfg->topk != z->topk || cfg->experts != z->experts ||
      mok_layer_act_dtype(cfg->dtype) != z->dtype || cfg->max_tokens > z->max_tokens) {
    snprintf(err, errlen,
             "the layer (hidden %u, topk %u, experts %u, dtype %s, max_tokens %u) does not fit "
             "its group (hidden %u, topk %u, experts %u, dtype %s, max_tokens up to %u)",
             cfg->hidden, cfg->topk, cfg->experts, mok_dtype_name(cfg->dtype), cfg->max_tokens,
             z->hidden, z->topk, z->experts, mok_dtype_name(z->dtype), z->max_tokens);
    return MOK_EINVAL;
  }
  if (fp8 && z->ring_rows) {
    /* the cuda engine's fp8 backward writes every local expert's weight
     * gradients at once, so a macrobatch of some experts would clear the
     * others'; both engines refuse alike */
    snprintf(err, errlen,
             "fp8 layers do not run on a group with ring_rows (%u): join one without a ring "
             "(capacity still bounds the routed buffers)",
             z->ring_rows);
    return MOK_EUNSUPPORTED;
  }
  cfg->group_world = z->world;
  cfg->group_rank = mok_ep_group_rank(g);
  cfg->group_tokens = z->max_tokens;
  cfg->group_ring = z->ring_rows;
  cfg->local_experts = z->experts / z->world;
  cfg->first_expert = cfg->group_rank * cfg->local_experts;
  return MOK_OK;
}

/* The group's capacity in rows of this layer's schedule: it needs the
 * engine's row alignment, known once the engine has prepared the layer. */
int mok__group_layer_rows(mok_engine_thread *t, esession *s, mok_layer_config *cfg, char *err,
                          size_t errlen) {
  const mok_ep_group_sizing *z = mok_ep_group_get_sizing(session_group(t, s, cfg->group_id));
  cfg->group_rows = mok_group_rows_limit(z->capacity_ppm, z->world, z->max_tokens, z->topk,
                                         cfg->local_experts, cfg->row_align);
  if (cfg->group_ring && cfg->group_ring < cfg->row_align) {
    snprintf(err, errlen,
             "ring_rows = %u is smaller than one aligned row group of the %s engine (%u rows)",
             cfg->group_ring, t->ops->name, cfg->row_align);
    return MOK_EINVAL;
  }
  return MOK_OK;
}

/* ---- groups formed through NCCL, off the engine thread ------------------- */

static void *former_main(void *arg) {
  former *f = arg;
  f->state = f->t->ops->group_form(f->t->engine, &f->form, &f->status, f->message,
                                   sizeof f->message);
  atomic_store(&f->done, true);
  ring_doorbell(f->t->cmd_efd); /* the engine thread finishes the join */
  return NULL;
}

static bool group_forming(const mok_engine_thread *t, uint32_t group_id) {
  for (const former *f = t->forming; f; f = f->next)
    if (f->group_id == group_id) return true;
  return false;
}

/* Start forming g for the join c (deferred: answered by finish_former). */
static int start_former(mok_engine_thread *t, esession *s, mok_cmd *c, mok_ep_group *g,
                        bool rejoined) {
  former *f = calloc(1, sizeof *f);
  if (!f) {
    snprintf(c->message, sizeof c->message, "out of memory");
    return MOK_ENOMEM;
  }
  f->t = t;
  f->cmd = c;
  f->session_id = s->id;
  f->group_id = mok_ep_group_id(g);
  f->rejoined = rejoined;
  f->form = mok_ep_group_form_of(g);
  int r = pthread_create(&f->thread, NULL, former_main, f);
  if (r != 0) {
    free(f);
    snprintf(c->message, sizeof c->message, "cannot start a thread to form the group: %s",
             strerror(r));
    return MOK_EENGINE;
  }
  f->next = t->forming;
  t->forming = f;
  c->deferred = true;
  log_info("group %u: forming through NCCL (waits for every rank, at most %u ms)", f->group_id,
           f->form.timeout_ms);
  return MOK_OK;
}

static void join_reply(mok_cmd *c, mok_ep_group *g, bool rejoined);
static bool session_room_for_group(esession *s);

/* A formation ended: install the state and answer the join, or fail it (the
 * group then goes, as after a failed attach). The session or the group may
 * have gone meanwhile. */
static void finish_former(mok_engine_thread *t, former *f) {
  pthread_join(f->thread, NULL);
  mok_cmd *c = f->cmd;
  esession *s = mok__thread_find_session(t, f->session_id);
  mok_ep_group *g = t->groups ? mok_ep_group_find(t->groups, f->group_id) : NULL;
  c->status = f->status;
  snprintf(c->message, sizeof c->message, "%s", f->message);
  if (c->status == MOK_OK && (!s || !g)) {
    c->status = MOK_ECLOSED;
    snprintf(c->message, sizeof c->message, "the session or group went while the group formed");
  }
  if (c->status == MOK_OK && !session_room_for_group(s)) {
    c->status = MOK_ENOMEM;
    snprintf(c->message, sizeof c->message, "out of memory");
  }
  if (c->status == MOK_OK) {
    s->groups[s->n_groups++] = f->group_id;
    t->ops->group_install(t->engine, g, f->state);
    join_reply(c, g, f->rejoined);
  } else {
    if (f->state) t->ops->group_discard(t->engine, f->state);
    if (g) {
      mok_ep_group_mark_broken(g, c->message);
      mok_ep_group_unref(t->groups, g, true);
    }
  }
  c->deferred = false;
  mok__thread_post_done(t, c);
  free(f);
}

/* Joins whose group finished forming (wait: every one, at shutdown). */
void mok__group_poll_formers(mok_engine_thread *t, bool wait) {
  for (former **p = &t->forming; *p;) {
    former *f = *p;
    if (!wait && !atomic_load(&f->done)) {
      p = &f->next;
      continue;
    }
    *p = f->next;
    finish_former(t, f);
  }
}

/* Groups formed through NCCL keep their buffers on the device: an engine
 * that makes their ids (cuda) forms them. */
static bool forms_nccl_groups(const mok_engine_thread *t) { return t->ops->group_new_id != NULL; }

/* false: this engine does not (c says so) */
static bool check_forms_nccl_groups(mok_engine_thread *t, mok_cmd *c) {
  if (forms_nccl_groups(t)) return true;
  c->status = MOK_EUNSUPPORTED;
  snprintf(c->message, sizeof c->message,
           "the %s engine forms groups through this host's shared memory only (join without "
           "an nccl_id); groups through NCCL need the cuda engine",
           t->ops->name);
  return false;
}

void mok__group_cmd_id(mok_engine_thread *t, mok_cmd *c) {
  if (check_forms_nccl_groups(t, c))
    c->status = t->ops->group_new_id(t->engine, c->out.nccl_id, c->message, sizeof c->message);
}

void mok__group_cmd_join(mok_engine_thread *t, esession *s, mok_cmd *c) {
  if (t->ops->groups == MOK_ENGINE_NO_GROUPS || !t->groups) {
    c->status = MOK_EUNSUPPORTED;
    snprintf(c->message, sizeof c->message,
             "the %s engine does not run expert-parallel groups yet", t->ops->name);
    return;
  }
  if (c->in.join.nccl && !check_forms_nccl_groups(t, c)) return;
  mok_ep_group *forming = mok_ep_group_find_key(t->groups, c->in.join.uid, c->in.join.key);
  if (forming && group_forming(t, mok_ep_group_id(forming))) {
    c->status = MOK_EBUSY;
    snprintf(c->message, sizeof c->message,
             "group '%s' is being formed through another session of this mokd; join again "
             "once that join returned",
             c->in.join.key);
    return;
  }
  if (!session_room_for_group(s)) {
    c->status = MOK_ENOMEM;
    snprintf(c->message, sizeof c->message, "out of memory");
    return;
  }
  mok_ep_group *g;
  bool rejoined = false;
  c->status = mok_ep_group_join(t->groups, &c->in.join, &g, &rejoined, c->message,
                             sizeof c->message);
  if (c->status != MOK_OK) return;
  if (t->ops->group_form && mok_ep_group_needs_forming(g)) {
    /* every rank must join before the group forms: not on this thread */
    c->status = start_former(t, s, c, g, rejoined);
    if (c->status != MOK_OK) {
      mok_ep_group_mark_broken(g, c->message);
      mok_ep_group_unref(t->groups, g, true);
    }
    return;
  }
  if (t->ops->group_attach) {
    c->status = t->ops->group_attach(t->engine, g, c->message, sizeof c->message);
    if (c->status != MOK_OK) {
      mok_ep_group_attach_failed(g, c->message);
      mok_ep_group_unref(t->groups, g, true);
      return;
    }
  }
  s->groups[s->n_groups++] = mok_ep_group_id(g); /* room was made above */
  join_reply(c, g, rejoined);
}

/* Room for one more join's entry in the session (false: out of memory). */
static bool session_room_for_group(esession *s) {
  if (s->n_groups < s->cap_groups) return true;
  size_t cap = s->cap_groups ? 2 * s->cap_groups : 4;
  uint32_t *n = realloc(s->groups, cap * sizeof *n);
  if (!n) return false;
  s->groups = n, s->cap_groups = cap;
  return true;
}

static void join_reply(mok_cmd *c, mok_ep_group *g, bool rejoined) {
  const mok_ep_group_sizing *z = mok_ep_group_get_sizing(g);
  c->status = MOK_OK;
  c->out.group.id = mok_ep_group_id(g);
  c->out.group.local_experts = z->experts / z->world;
  c->out.group.first_expert = mok_ep_group_rank(g) * (z->experts / z->world);
  c->out.group.generation = mok_ep_group_generation(g);
  c->out.group.sequence = mok_ep_group_sequence(g);
  c->out.group.rejoined = rejoined;
}

void mok__group_cmd_leave(mok_engine_thread *t, esession *s, mok_cmd *c) {
  for (size_t i = 0; i < s->n_groups; i++) {
    if (s->groups[i] != c->in.id) continue;
    s->groups[i] = s->groups[--s->n_groups];
    mok_ep_group *g = t->groups ? mok_ep_group_find(t->groups, c->in.id) : NULL;
    if (g) mok_ep_group_unref(t->groups, g, true);
    return;
  }
  c->status = MOK_ENOENT;
  snprintf(c->message, sizeof c->message, "group %u was not joined by this session", c->in.id);
}

/* The group a job of a group layer goes to (start()'s g), or NULL: the
 * session left the group (res says so), or the job failed its checks and
 * took its turn in the group through the host segment
 * (mok_ep_group_post_failure). A failed job on a group whose posts travel on
 * the device goes to its group as a NOP that takes the turn there. */
mok_ep_group *mok__group_of_job(mok_engine_thread *t, esession *s, const mok_job_desc *desc,
                                const mok_layer_config *layer, mok_engine_result *res) {
  mok_ep_group *g = session_group(t, s, layer->group_id);
  if (!g) {
    res->status = MOK_ENOENT;
    snprintf(res->message, sizeof res->message,
             "%s: the layer's group %u was left; re-join and re-create the layer",
             mok_op_name(desc->op), layer->group_id);
    return NULL;
  }
  if (res->status == MOK_OK) return g;
  if (desc->op != MOK_OP_FORWARD && desc->op != MOK_OP_BACKWARD) return NULL;
  return mok_ep_group_post_failure(g, layer, desc->op, desc->flags, desc->tokens, res->status,
                                   res->message)
             ? NULL
             : g;
}

/* ---- standing jobs of group layers (standing.h mok_standing_group_ops) ----
 *
 * A standing instance of a layer on a group takes the member's turn when
 * the engine thread takes its trigger, exactly as a ring job of the layer
 * takes it when the engine thread takes its descriptor: the same engine
 * entry point (start() with the group), the same failure rules. So a
 * member's group jobs are numbered in the order its triggers and
 * descriptors are taken, and members must trigger in the same order
 * (docs/ep.md "Capture and replay on a group"). */

/* cpu: the group job runs here, on the session's scratch, after the
 * session's other jobs and instances (as a ring group job waits for them);
 * cuda: the session's stream orders it. */
static bool standing_group_ready(void *ctx, const mok_standing_entry *st) {
  (void)st;
  esession *s = ctx;
  return s->thread->ops->groups == MOK_ENGINE_GROUPS_ON_STREAM ||
         (!s->n_pend && !s->standing.running);
}

static mok_engine_job *standing_group_start(void *ctx, const mok_standing_entry *st,
                                            const mok_job_args *a, mok_engine_result *res) {
  esession *s = ctx;
  mok_engine_thread *t = s->thread;
  mok_ep_group *g = session_group(t, s, st->layer.group_id);
  if (!g) {
    res->status = MOK_ENOENT;
    snprintf(res->message, sizeof res->message,
             "%s: the layer's group %u was left; re-join and create the layer and its standing "
             "jobs again", mok_op_name(a->op), st->layer.group_id);
    return NULL;
  }
  return t->ops->start(t->engine, g, a, res);
}

static mok_engine_job *standing_group_fail_turn(void *ctx, const mok_standing_entry *st,
                                                int status, const char *msg,
                                                mok_engine_result *res) {
  esession *s = ctx;
  mok_engine_thread *t = s->thread;
  mok_ep_group *g = session_group(t, s, st->layer.group_id);
  if (!g) return NULL; /* left: no turn to take */
  if (mok_ep_group_post_failure(g, &st->layer, (uint16_t)st->args.op, (uint16_t)st->args.flags,
                                st->args.tokens, status, msg))
    return NULL; /* the turn was taken through the host segment */
  if (t->ops->groups != MOK_ENGINE_GROUPS_ON_STREAM) return NULL;
  /* on the device: a NOP carrying the failure takes the turn, then writes the flag */
  mok_job_args a;
  memset(&a, 0, sizeof a);
  a.op = MOK_OP_NOP;
  a.session = s->es;
  a.group_failed = status;
  a.standing_flag = st->args.standing_flag;
  a.standing_slot = st->args.standing_slot;
  return t->ops->start(t->engine, g, &a, res);
}

/* A peer that never arrived at a device barrier: the group cannot go on
 * (as for a ring job: poll_session). */
static void standing_group_ended(void *ctx, const mok_standing_entry *st,
                                 const mok_engine_result *res) {
  esession *s = ctx;
  mok_engine_thread *t = s->thread;
  if (res->status != MOK_ETIMEOUT || !t->groups || t->ops->groups != MOK_ENGINE_GROUPS_ON_STREAM)
    return;
  mok_ep_group *g = mok_ep_group_find(t->groups, st->layer.group_id);
  if (g && !mok_ep_group_is_broken(g)) mok_ep_group_count_timeout(g);
  if (g) mok_ep_group_mark_broken(g, res->message);
}

mok_standing_group_ops mok__group_standing_ops(esession *s) {
  return (mok_standing_group_ops){.ready = standing_group_ready,
                                  .start = standing_group_start,
                                  .fail_turn = standing_group_fail_turn,
                                  .ended = standing_group_ended,
                                  .ctx = s};
}

/* ---- stats ------------------------------------------------------------------ */

void mok__group_session_stats(mok_engine_thread *t, const esession *s, mok_session_stats *o) {
  for (size_t i = 0; i < s->n_groups && o->n_groups < MOK_STATS_GROUPS_MAX; i++) {
    mok_ep_group *g = t->groups ? mok_ep_group_find(t->groups, s->groups[i]) : NULL;
    if (!g) continue;
    o->groups[o->n_groups++] = (mok_group_stats){
        .group_id = mok_ep_group_id(g), .rank = mok_ep_group_rank(g),
        .world = mok_ep_group_get_sizing(g)->world,
        .generation = mok_ep_group_generation(g), .sequence = mok_ep_group_sequence(g)};
  }
}

void mok__group_daemon_stats(mok_engine_thread *t, mok_engine_stats *st) {
  /* every group of this daemon, lingering ones included */
  size_t ng = 0;
  for (mok_ep_group *g = t->groups ? mok_ep_group_next(t->groups, NULL) : NULL; g;
       g = mok_ep_group_next(t->groups, g))
    ng++;
  if (ng > MOK_STATS_DAEMON_GROUPS_MAX) ng = MOK_STATS_DAEMON_GROUPS_MAX;
  st->groups = ng ? calloc(ng, sizeof *st->groups) : NULL;
  for (mok_ep_group *g = st->groups ? mok_ep_group_next(t->groups, NULL) : NULL;
       g && st->n_groups < ng; g = mok_ep_group_next(t->groups, g)) {
    mok_daemon_group_stats *o = &st->groups[st->n_groups++];
    o->group_id = mok_ep_group_id(g);
    o->uid = (uint32_t)mok_ep_group_uid(g);
    o->rank = mok_ep_group_rank(g);
    o->world = mok_ep_group_get_sizing(g)->world;
    o->sessions = mok_ep_group_refs(g);
    o->generation = mok_ep_group_generation(g);
    o->sequence = mok_ep_group_sequence(g);
    o->nccl = mok_ep_group_is_nccl(g);
    o->broken = mok_ep_group_is_broken(g);
    o->forming = group_forming(t, o->group_id);
    snprintf(o->key, sizeof o->key, "%s", mok_ep_group_key(g));
    o->timeouts = mok_ep_group_timeouts(g);
    for (uint32_t p = 0; p < o->world && p < MOK_GROUP_MAX_WORLD; p++)
      o->rank_missed[p] = mok_ep_group_rank_missed(g, p);
  }
}
