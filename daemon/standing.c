/* SPDX-License-Identifier: Apache-2.0 */
#include "standing.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "mok_slots.h"
#include "mok_status.h"

#define HOT_NS 1000000000ull /* a trigger within this: the engine thread polls closely */

static void store_u64(volatile uint64_t *w, uint64_t v) {
  atomic_thread_fence(memory_order_seq_cst);
  *w = v;
  atomic_thread_fence(memory_order_seq_cst);
}

/* The first failure of a slot: message first, then the status the client reads. */
static void post_error(mok_standing_entry *st, mok_standing_words *w, int status, const char *msg) {
  if (st->failed) return;
  st->failed = true;
  char m[MOK_STANDING_MSG];
  size_t n = strlen(msg);
  if (n >= sizeof m) n = sizeof m - 1;
  memcpy(m, msg, n);
  m[n] = '\0';
  memcpy(w->message, m, sizeof m);
  atomic_thread_fence(memory_order_seq_cst);
  w->error = status;
  atomic_thread_fence(memory_order_seq_cst);
}

static void cancel(mok_standing_entry *st, mok_standing_words *w, const mok_standing_env *env,
                   uint32_t slot, int status, const char *why) {
  if (st->cancelled) return;
  st->cancelled = true;
  st->cancel_status = status;
  snprintf(st->cancel_msg, sizeof st->cancel_msg, "%s", why);
  post_error(st, w, status, why);
  log_info("session %llu: standing job %u (%s) cancelled: %s",
           (unsigned long long)env->session_id, slot, mok_op_name(st->args.op), why);
}

int mok_standing_add(mok_standing_set *set, const mok_standing_env *env, uint32_t slot,
                        uint32_t layer_id, const mok_layer_config *layer,
                        const mok_job_desc *desc, const mok_job_args *args, char *err,
                        size_t errlen) {
  if (slot >= MOK_STANDING_MAX) {
    snprintf(err, errlen, "standing slot %u is not in [0, %u)", slot, MOK_STANDING_MAX);
    return MOK_EINVAL;
  }
  if (args->op != MOK_OP_FORWARD && args->op != MOK_OP_BACKWARD) {
    snprintf(err, errlen, "a standing job is a forward or a backward, not %s",
             mok_op_name(args->op));
    return MOK_EINVAL;
  }
  if (layer->group_id && !env->group) {
    snprintf(err, errlen, "this engine runs no standing jobs of a layer on an expert-parallel "
             "group");
    return MOK_EUNSUPPORTED;
  }
  if (!set->items && !(set->items = calloc(MOK_STANDING_MAX, sizeof *set->items))) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  mok_standing_entry *st = &set->items[slot];
  if (st->used) {
    snprintf(err, errlen, "standing slot %u holds a standing job already (destroy it first)",
             slot);
    return MOK_EBUSY;
  }
  memset(st, 0, sizeof *st);
  st->used = true;
  st->layer_id = layer_id;
  st->layer = *layer;
  st->args = *args;
  st->args.layer = &st->layer;
  st->args.fence_wait = st->args.fence_signal = 0;
  mok_standing_words *w = mok_shm_standing(env->shm, slot);
  st->args.standing_flag = &w->flag;
  st->args.standing_slot = slot;
  for (uint32_t i = 0; i < desc->n_tensors && i < MOK_MAX_TENSORS; i++) {
    uint32_t r = desc->tensors[i].region;
    bool seen = false;
    for (uint32_t k = 0; k < st->n_regions; k++) seen |= st->regions[k] == r;
    if (!seen) st->regions[st->n_regions++] = r;
  }
  /* the words start clean; the generation tells a client which creation it sees */
  memset(w->message, 0, sizeof w->message);
  w->error = 0;
  w->done = 0;
  w->flag = 0;
  w->trigger = 0;
  w->generation = w->generation + 1;
  atomic_thread_fence(memory_order_seq_cst);
  set->live++;
  return MOK_OK;
}

/* a slot destroyed while its instance runs (freed when it ends) */
static bool dying(const mok_standing_entry *st) { return st->args.op == MOK_OP_NOP; }

static void free_slot(mok_standing_set *set, mok_standing_entry *st) {
  st->used = false;
  set->live--;
}

int mok_standing_remove(mok_standing_set *set, const mok_standing_env *env, uint32_t slot,
                         char *err, size_t errlen) {
  (void)env;
  if (slot >= MOK_STANDING_MAX || !set->items || !set->items[slot].used ||
      dying(&set->items[slot])) {
    snprintf(err, errlen, "standing slot %u holds no standing job", slot);
    return MOK_ENOENT;
  }
  mok_standing_entry *st = &set->items[slot];
  if (st->running) { /* its instance ends first; then the slot goes (turn) */
    st->cancelled = true;
    st->failed = true; /* nothing more is posted to the words */
    st->layer_id = 0;
    st->n_regions = 0;
    st->args.op = MOK_OP_NOP; /* marks a slot being destroyed */
    return MOK_OK;
  }
  free_slot(set, st);
  return MOK_OK;
}

static bool on_group(const mok_standing_entry *st) { return st->layer.group_id != 0; }

/* An instance ended (res): count it, post a failure, release the client. */
static void instance_done(mok_standing_set *set, const mok_standing_env *env, uint32_t slot,
                          mok_standing_entry *st, const mok_engine_result *res) {
  mok_standing_words *w = mok_shm_standing(env->shm, slot);
  if (on_group(st) && env->group) env->group->ended(env->group->ctx, st, res);
  if (st->turn_only) { /* a cancelled slot's turn: no instance, the error is set */
    st->turn_only = false;
    if (dying(st)) free_slot(set, st);
    else if (!res->flag_written) store_u64(&w->flag, 1);
    return;
  }
  st->finished++;
  if (dying(st)) {
    free_slot(set, st);
    return;
  }
  if (res->status != MOK_OK) {
    char m[MOK_JOB_MESSAGE_MAX + 32];
    snprintf(m, sizeof m, "instance %llu: %s", (unsigned long long)st->finished, res->message);
    post_error(st, w, res->status, m);
  }
  store_u64(&w->done, st->finished);
  if (!res->flag_written) store_u64(&w->flag, 1);
}

/* A cancelled slot answers each trigger with the flag, so the client's
 * stream moves on (its error is set). */
static void answer(mok_standing_words *w) {
  store_u64(&w->trigger, 0);
  store_u64(&w->flag, 1);
}

/* A trigger of a cancelled slot of a group layer: the member still takes
 * its turn as a failed job, so its peers fail that job at once with this
 * slot's message; then the client is released like any cancelled slot. */
static void answer_cancelled(mok_standing_set *set, const mok_standing_env *env,
                             mok_standing_entry *st, mok_standing_words *w, bool *fatal,
                             char *why, size_t whylen) {
  if (!on_group(st) || !env->group) {
    answer(w);
    return;
  }
  store_u64(&w->trigger, 0);
  mok_engine_result res = {.status = MOK_OK};
  mok_engine_job *j = env->group->fail_turn(
      env->group->ctx, st, st->cancel_status != MOK_OK ? st->cancel_status : MOK_ECLOSED,
      st->cancel_msg[0] ? st->cancel_msg : "the standing job was cancelled", &res);
  if (res.fatal) {
    *fatal = true;
    snprintf(why, whylen, "%s", res.message);
  }
  if (j) { /* its flag comes when the turn on the device ended (instance_done) */
    st->running = j;
    st->turn_only = true;
    set->running++;
    return;
  }
  store_u64(&w->flag, 1);
}

bool mok_standing_turn(mok_standing_set *set, const mok_standing_env *env, uint64_t now,
                       bool take, bool *fatal, char *why, size_t whylen) {
  bool worked = false;
  if (!set->live) return false;
  for (uint32_t slot = 0; slot < MOK_STANDING_MAX; slot++) {
    mok_standing_entry *st = &set->items[slot];
    if (!st->used) continue;
    mok_standing_words *w = mok_shm_standing(env->shm, slot);
    if (st->running) {
      mok_engine_result res = {.status = MOK_OK};
      if (!env->ops->poll(env->engine, st->running, now, &res)) {
        uint64_t tv = w->trigger; /* one read: the copy is what we judge */
        if (tv == 0) st->trigger_seen_ns = 0;
        else if (!st->trigger_seen_ns) st->trigger_seen_ns = now, st->trigger_deferred = false;
        continue;
      }
      if (res.fatal) {
        *fatal = true;
        snprintf(why, whylen, "%s", res.message);
      }
      st->running = NULL;
      set->running--;
      instance_done(set, env, slot, st, &res);
      worked = true;
      if (!st->used) continue;
    }
    if (dying(st)) continue;
    uint64_t tv = w->trigger; /* one read: the copy is what we judge */
    if (tv == 0) {
      st->trigger_seen_ns = 0;
      st->trigger_deferred = false;
      continue;
    }
    if (st->cancelled) {
      /* a group slot's answer is the member's turn, in the order of its
       * triggers: only where triggers are taken */
      if (on_group(st) && !take) continue;
      answer_cancelled(set, env, st, w, fatal, why, whylen);
      worked |= on_group(st);
      continue;
    }
    if (!take) continue;
    if (tv != 1) {
      char m[MOK_STANDING_MSG];
      snprintf(m, sizeof m, "trigger word holds %llu (0 or 1 expected); standing job cancelled",
               (unsigned long long)tv);
      cancel(st, w, env, slot, MOK_EPROTO, m);
      answer_cancelled(set, env, st, w, fatal, why, whylen);
      continue;
    }
    if (st->trigger_seen_ns && now - st->trigger_seen_ns > env->fence_timeout_ns) {
      char m[MOK_STANDING_MSG];
      snprintf(m, sizeof m, "a trigger waited %llu ms for %s; cancelled",
               (unsigned long long)((now - st->trigger_seen_ns) / 1000000ull),
               st->trigger_deferred ? "the session's earlier jobs" : "its previous instance");
      cancel(st, w, env, slot, MOK_ETIMEOUT, m);
      answer_cancelled(set, env, st, w, fatal, why, whylen);
      continue;
    }
    if (on_group(st) && !env->group->ready(env->group->ctx, st)) {
      if (!st->trigger_seen_ns) st->trigger_seen_ns = now;
      st->trigger_deferred = true;
      continue;
    }
    /* take it, then start one instance with the arguments checked at creation */
    store_u64(&w->trigger, 0);
    st->trigger_seen_ns = 0;
    st->trigger_deferred = false;
    set->hot_until_ns = now + HOT_NS;
    mok_job_args a = st->args;
    st->started++;
    mok_engine_result res = {.status = MOK_OK};
    /* a group layer's instance takes the member's turn in the group now */
    mok_engine_job *j = on_group(st) ? env->group->start(env->group->ctx, st, &a, &res)
                                     : env->ops->start(env->engine, NULL, &a, &res);
    worked = true;
    if (res.fatal) {
      *fatal = true;
      snprintf(why, whylen, "%s", res.message);
    }
    if (j) {
      st->running = j;
      set->running++;
      st->instance_t0 = now;
    } else {
      instance_done(set, env, slot, st, &res);
    }
  }
  return worked;
}

static void cancel_where(mok_standing_set *set, const mok_standing_env *env, uint32_t region,
                         uint32_t layer_id, const char *why) {
  for (uint32_t slot = 0; set->live && set->items && slot < MOK_STANDING_MAX; slot++) {
    mok_standing_entry *st = &set->items[slot];
    if (!st->used || st->cancelled || dying(st)) continue;
    bool hit = region == 0;
    if (region == UINT32_MAX) hit = st->layer_id == layer_id;
    else
      for (uint32_t k = 0; k < st->n_regions; k++) hit |= st->regions[k] == region;
    if (!hit) continue;
    char m[MOK_STANDING_MSG];
    if (region && region != UINT32_MAX)
      snprintf(m, sizeof m, "region %u it names %s; create it again", region, why);
    else
      snprintf(m, sizeof m, "%s", why);
    cancel(st, mok_shm_standing(env->shm, slot), env, slot,
           region && region != UINT32_MAX ? MOK_ENOENT : MOK_ECLOSED, m);
  }
}

void mok_standing_cancel_region(mok_standing_set *set, const mok_standing_env *env,
                                uint32_t region, const char *why) {
  if (region && region != UINT32_MAX) cancel_where(set, env, region, 0, why);
}

void mok_standing_cancel_layer(mok_standing_set *set, const mok_standing_env *env,
                               uint32_t layer_id, const char *why) {
  cancel_where(set, env, UINT32_MAX, layer_id, why);
}

void mok_standing_cancel_all(mok_standing_set *set, const mok_standing_env *env, const char *why) {
  cancel_where(set, env, 0, 0, why);
}

bool mok_standing_triggered(const mok_standing_set *set, void *shm) {
  for (uint32_t slot = 0; set->live && slot < MOK_STANDING_MAX; slot++) {
    const mok_standing_entry *st = &set->items[slot];
    if (st->used && !st->running && !dying(st) && mok_shm_standing(shm, slot)->trigger != 0)
      return true;
  }
  return false;
}

void mok_standing_free(mok_standing_set *set) {
  free(set->items);
  memset(set, 0, sizeof *set);
}
