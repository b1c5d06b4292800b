/* SPDX-License-Identifier: Apache-2.0 */
#include "engine_thread.h"
#include "engine_thread_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "client_limits.h"
#include "clock.h"
#include "job_check.h"
#include "job_sink.h"
#include "log.h"
#include "mok_status.h"
#include "region.h"
#include "standing.h"


static void drain_eventfd(int efd) {
  uint64_t v;
  while (read(efd, &v, sizeof v) > 0) {}
}

/* ---- done queue --------------------------------------------------------- */

void mok__thread_post_done(mok_engine_thread *t, mok_cmd *c) {
  c->next = NULL;
  pthread_mutex_lock(&t->lock);
  if (t->done_tail) t->done_tail->next = c;
  else t->done_head = c;
  t->done_tail = c;
  pthread_mutex_unlock(&t->lock);
  t->on_done(t->on_done_arg);
}

mok_cmd *mok_engine_thread_take_done(mok_engine_thread *t) {
  pthread_mutex_lock(&t->lock);
  mok_cmd *c = t->done_head;
  t->done_head = t->done_tail = NULL;
  pthread_mutex_unlock(&t->lock);
  return c;
}

void mok_engine_thread_submit(mok_engine_thread *t, mok_cmd *cmd) {
  cmd->next = NULL;
  pthread_mutex_lock(&t->lock);
  if (t->cmd_tail) t->cmd_tail->next = cmd;
  else t->cmd_head = cmd;
  t->cmd_tail = cmd;
  pthread_mutex_unlock(&t->lock);
  ring_doorbell(t->cmd_efd);
}

/* ---- sessions ------------------------------------------------------------ */

esession *mok__thread_find_session(mok_engine_thread *t, uint64_t id) {
  for (esession *s = t->sessions; s; s = s->next)
    if (s->id == id) return s;
  return NULL;
}

static void poll_session_blocking(mok_engine_thread *t, esession *s);

/* A sticky device error: nothing on this engine can be trusted any more.
 * docs/design.md, Operation: report and exit non-zero so that the service manager restarts
 * mokd; clients see their connection close. */
static void engine_fatal(mok_engine_thread *t, const char *why) {
  log_error("the %s engine failed for good: %s; mokd exits", t->ops->name, why);
  _exit(3);
}

static void release_region(mok_engine_thread *t, mok_region *r) {
  if (t->ops->region_release) t->ops->region_release(t->engine, r);
  if (r->kind == MOK_REGION_HOST_MEMFD) mok_region_unmap_host(r);
}

static void release_layer_state(mok_engine_thread *t, mok_engine_layer *l) {
  if (l && t->ops->layer_close) t->ops->layer_close(t->engine, l);
}

/* Jobs or standing instances of the session still run. */
static bool session_busy(const esession *s) { return s->n_pend || s->standing.running; }

static mok_standing_env standing_env(mok_engine_thread *t, esession *s) {
  s->thread = t;
  s->standing_group = mok__group_standing_ops(s);
  bool groups = t->groups && t->ops->groups != MOK_ENGINE_NO_GROUPS;
  return (mok_standing_env){.ops = t->ops, .engine = t->engine, .es = s->es, .shm = s->shm.hdr,
                            .fence_timeout_ns = t->fence_timeout_ns, .session_id = s->id,
                            .group = groups ? &s->standing_group : NULL};
}

/* Regions and layers dropped while jobs ran: release them once none does. */
static void release_dead(mok_engine_thread *t, esession *s) {
  if (session_busy(s)) return;
  for (size_t i = 0; i < s->n_dead_regions; i++) release_region(t, &s->dead_regions[i]);
  s->n_dead_regions = 0;
  for (size_t i = 0; i < s->n_dead_layers; i++) release_layer_state(t, s->dead_layers[i]);
  s->n_dead_layers = 0;
}

static bool keep_dead_region(esession *s, const mok_region *r) {
  if (s->n_dead_regions == s->cap_dead_regions) {
    size_t cap = s->cap_dead_regions ? 2 * s->cap_dead_regions : 8;
    mok_region *n = realloc(s->dead_regions, cap * sizeof *n);
    if (!n) return false;
    s->dead_regions = n;
    s->cap_dead_regions = cap;
  }
  s->dead_regions[s->n_dead_regions++] = *r;
  return true;
}

static bool keep_dead_layer(esession *s, mok_engine_layer *l) {
  if (s->n_dead_layers == s->cap_dead_layers) {
    size_t cap = s->cap_dead_layers ? 2 * s->cap_dead_layers : 8;
    mok_engine_layer **n = realloc(s->dead_layers, cap * sizeof *n);
    if (!n) return false;
    s->dead_layers = n;
    s->cap_dead_layers = cap;
  }
  s->dead_layers[s->n_dead_layers++] = l;
  return true;
}

/* The session's share of its uid's held jobs, after n_pend, n_pend_refused
 * or faulted changed (a faulted session counts for nothing). */
static void uid_jobs_recount(esession *s) {
  if (!s->uid_jobs) return;
  uint32_t now = s->faulted ? 0 : s->n_pend - s->n_pend_refused;
  s->uid_jobs->held = s->uid_jobs->held - s->uid_counted + now;
  s->uid_counted = now;
}

/* The session joins its uid's record (made for the uid's first session). */
static bool uid_jobs_join(mok_engine_thread *t, esession *s) {
  uid_jobs *u = t->uids;
  while (u && u->uid != s->uid) u = u->next;
  if (!u) {
    if (!(u = calloc(1, sizeof *u))) return false;
    u->uid = s->uid;
    u->next = t->uids;
    t->uids = u;
  }
  s->uid_jobs = u;
  s->uid_next = u->sessions;
  u->sessions = s;
  return true;
}

static void uid_jobs_leave(mok_engine_thread *t, esession *s) {
  uid_jobs *u = s->uid_jobs;
  if (!u) return;
  u->held -= s->uid_counted;
  s->uid_counted = 0;
  for (esession **p = &u->sessions; *p; p = &(*p)->uid_next)
    if (*p == s) {
      *p = s->uid_next;
      break;
    }
  s->uid_jobs = NULL;
  if (u->sessions) return;
  for (uid_jobs **p = &t->uids; *p; p = &(*p)->next)
    if (*p == u) {
      *p = u->next;
      break;
    }
  free(u);
}

/* Only once the session has no job running (see cmd_detach). */
static void session_free(mok_engine_thread *t, esession *s) {
  uid_jobs_leave(t, s);
  /* a group outlives the session that joined it (lingering for a re-join) */
  for (size_t i = 0; i < s->n_groups; i++) {
    mok_ep_group *g = t->groups ? mok_ep_group_find(t->groups, s->groups[i]) : NULL;
    if (g) mok_ep_group_unref(t->groups, g, false);
  }
  free(s->groups);
  release_dead(t, s);
  mok_standing_free(&s->standing);
  for (size_t i = 0; i < s->regions.count; i++) release_region(t, &s->regions.items[i]);
  mok_region_table_free(&s->regions);
  for (size_t i = 0; i < s->n_layers; i++) release_layer_state(t, s->layers[i].state);
  free(s->layers);
  free(s->dead_regions);
  free(s->dead_layers);
  if (s->es && t->ops->session_close) t->ops->session_close(t->engine, s->es);
  if (s->shm.doorbell_in >= 0) epoll_ctl(t->epfd, EPOLL_CTL_DEL, s->shm.doorbell_in, NULL);
  mok_session_shm_destroy(&s->shm);
  free(s);
}

static void cmd_attach(mok_engine_thread *t, mok_cmd *c) {
  esession *s = calloc(1, sizeof *s);
  if (!s) {
    mok_session_shm_destroy(&c->in.attach.shm);
    c->status = MOK_ENOMEM;
    snprintf(c->message, sizeof c->message, "out of memory attaching the session");
    return;
  }
  s->id = c->session_id;
  s->shm = c->in.attach.shm;
  s->limits = c->in.attach.limits;
  s->uid = c->in.attach.uid;
  s->sink = c->in.attach.sink;
  if (!uid_jobs_join(t, s)) {
    c->status = MOK_ENOMEM;
    snprintf(c->message, sizeof c->message, "out of memory attaching the session");
    session_free(t, s);
    return;
  }
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = s};
  if (epoll_ctl(t->epfd, EPOLL_CTL_ADD, s->shm.doorbell_in, &ev) < 0) {
    c->status = MOK_EIO;
    snprintf(c->message, sizeof c->message, "epoll_ctl: %s", strerror(errno));
    session_free(t, s);
    return;
  }
  if (t->ops->session_open) {
    c->status = t->ops->session_open(t->engine, s->shm.hdr, &s->es, c->message, sizeof c->message);
    if (c->status != MOK_OK) {
      s->es = NULL;
      session_free(t, s);
      return;
    }
  }
  s->next = t->sessions;
  t->sessions = s;
  c->status = MOK_OK;
}

static void cmd_register(mok_engine_thread *t, esession *s, mok_cmd *c) {
  mok_region r;
  if (mok_limit_exceeded(MOK_LIMIT_REGIONS, s->limits.max_regions, s->regions.count, 1)) {
    c->status = MOK_ELIMIT;
    snprintf(c->message, sizeof c->message, "session already has %zu regions (limit %u)",
             s->regions.count, s->limits.max_regions);
    return;
  }
  if (mok_limit_exceeded(MOK_LIMIT_REGION_BYTES, s->limits.max_region_bytes, s->regions.total_bytes,
                         c->in.reg.bytes)) {
    c->status = MOK_ELIMIT;
    snprintf(c->message, sizeof c->message,
             "registering %llu bytes would exceed the session's quota of %llu bytes "
             "(%llu in use)",
             (unsigned long long)c->in.reg.bytes, (unsigned long long)s->limits.max_region_bytes,
             (unsigned long long)s->regions.total_bytes);
    return;
  }
  mok_region_source src = {.kind = c->in.reg.kind, .fd = c->in.reg.fd,
                           .offset = c->in.reg.offset, .bytes = c->in.reg.bytes,
                           .session = s->es};
  memcpy(src.ipc_handle, c->in.reg.ipc_handle, sizeof src.ipc_handle);
  if (c->in.reg.kind == MOK_REGION_HOST_MEMFD) {
    c->status = mok_region_map_memfd(c->in.reg.fd, c->in.reg.offset, c->in.reg.bytes, &r,
                                     c->message, sizeof c->message);
    if (c->status != MOK_OK) return;
    if (t->ops->region_import) {
      c->status = t->ops->region_import(t->engine, &src, &r, c->message, sizeof c->message);
      if (c->status != MOK_OK) {
        mok_region_unmap_host(&r);
        return;
      }
    }
  } else {
    if (!t->ops->region_import) {
      c->status = MOK_EUNSUPPORTED;
      snprintf(c->message, sizeof c->message, "the %s engine cannot map GPU buffers",
               t->ops->name);
      return;
    }
    memset(&r, 0, sizeof r);
    r.kind = (mok_region_kind)c->in.reg.kind;
    c->status = t->ops->region_import(t->engine, &src, &r, c->message, sizeof c->message);
    if (c->status != MOK_OK) return;
  }
  c->status = mok_region_table_add(&s->regions, &r);
  if (c->status != MOK_OK) {
    release_region(t, &r);
    snprintf(c->message, sizeof c->message, "out of memory");
    return;
  }
  c->out.region_id = r.id;
}

/* The layer as the engine would run it (group fields filled, prepared). */
static int prepared_layer(mok_engine_thread *t, esession *s, mok_layer_config *cfg, char *err,
                          size_t errlen) {
  int st;
  if (cfg->group_id && (st = mok__group_layer_config(t, s, cfg, err, errlen)) != MOK_OK) return st;
  if ((st = t->ops->prepare_layer(t->engine, cfg, err, errlen)) != MOK_OK) return st;
  if (cfg->group_id && (st = mok__group_layer_rows(t, s, cfg, err, errlen)) != MOK_OK) return st;
  return MOK_OK;
}

static void cmd_layer_cost(mok_engine_thread *t, esession *s, mok_cmd *c) {
  mok_layer_config cfg = c->in.layer;
  c->status = prepared_layer(t, s, &cfg, c->message, sizeof c->message);
  if (c->status != MOK_OK) return;
  memset(&c->out.cost, 0, sizeof c->out.cost);
  if (t->ops->layer_cost)
    c->status = t->ops->layer_cost(t->engine, &cfg, &c->out.cost, c->message, sizeof c->message);
  c->out.layer = cfg;
}

static void cmd_create_layer(mok_engine_thread *t, esession *s, mok_cmd *c) {
  if (mok_limit_exceeded(MOK_LIMIT_LAYERS, s->limits.max_layers, s->n_layers, 1)) {
    c->status = MOK_ELIMIT;
    snprintf(c->message, sizeof c->message, "session already has %zu layers (limit %u)",
             s->n_layers, s->limits.max_layers);
    return;
  }
  mok_layer_config cfg = c->in.layer;
  c->status = prepared_layer(t, s, &cfg, c->message, sizeof c->message);
  if (c->status != MOK_OK) return;
  if (s->n_layers == s->cap_layers) {
    size_t cap = s->cap_layers ? 2 * s->cap_layers : 8;
    layer_entry *n = realloc(s->layers, cap * sizeof *n);
    if (!n) {
      c->status = MOK_ENOMEM;
      snprintf(c->message, sizeof c->message, "out of memory");
      return;
    }
    s->layers = n;
    s->cap_layers = cap;
  }
  mok_engine_layer *state = NULL;
  if (t->ops->layer_open) {
    c->status = t->ops->layer_open(t->engine, &cfg, &state, c->message, sizeof c->message);
    if (c->status != MOK_OK) return;
  }
  s->layers[s->n_layers].id = ++s->next_layer_id;
  s->layers[s->n_layers].cfg = cfg;
  s->layers[s->n_layers].state = state;
  s->n_layers++;
  c->layer_id = s->next_layer_id;
  c->out.layer = cfg;
}

static void cmd_destroy_layer(mok_engine_thread *t, esession *s, mok_cmd *c) {
  for (size_t i = 0; i < s->n_layers; i++) {
    if (s->layers[i].id != c->in.id) continue;
    mok_engine_layer *state = s->layers[i].state;
    mok_standing_env env = standing_env(t, s);
    mok_standing_cancel_layer(&s->standing, &env, c->in.id,
                              "its layer was destroyed; create the layer and the job again");
    if (state && (!session_busy(s) || !keep_dead_layer(s, state))) {
      /* no job runs, or (out of memory) wait for them here: the layer's
       * device memory must outlive the jobs that use it */
      while (session_busy(s)) poll_session_blocking(t, s);
      release_layer_state(t, state);
    }
    s->layers[i] = s->layers[--s->n_layers];
    c->status = MOK_OK;
    return;
  }
  c->status = MOK_ENOENT;
  snprintf(c->message, sizeof c->message, "layer %u does not exist in this session", c->in.id);
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void cmd_stats(mok_engine_thread *t, mok_cmd *c) {
  mok_engine_stats *st = &c->out.stats;
  memset(st, 0, sizeof *st);
  st->jobs_done = t->jobs_done;
  st->jobs_failed = t->jobs_failed;
  size_t n = t->latency_count < LATENCY_WINDOW ? t->latency_count : LATENCY_WINDOW;
  if (n > 0) {
    uint64_t sorted[LATENCY_WINDOW];
    memcpy(sorted, t->latency, n * sizeof *sorted);
    qsort(sorted, n, sizeof *sorted, cmp_u64);
    st->latency_p50_ns = sorted[n / 2];
    st->latency_p99_ns = sorted[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1];
  }
  size_t count = 0;
  for (esession *s = t->sessions; s; s = s->next) count++;
  st->sessions = count ? calloc(count, sizeof *st->sessions) : NULL;
  if (count && !st->sessions) {
    c->status = MOK_ENOMEM;
    snprintf(c->message, sizeof c->message, "out of memory");
    return;
  }
  for (esession *s = t->sessions; s; s = s->next) {
    mok_session_stats *o = &st->sessions[st->n_sessions++];
    o->session_id = s->id;
    o->regions = (uint32_t)s->regions.count;
    o->region_bytes = s->regions.total_bytes;
    o->layers = (uint32_t)s->n_layers;
    o->jobs_done = s->jobs_done;
    o->jobs_failed = s->jobs_failed;
    if (!s->faulted) { /* as max-jobs-per-uid counts them (uid_jobs_in_flight) */
      uint32_t queued = atomic_load_explicit(&s->shm.hdr->sq_tail.value, memory_order_acquire) -
                        s->sq_head;
      o->jobs_in_flight = (queued <= MOK_RING_ENTRIES ? queued : MOK_RING_ENTRIES) + s->n_pend -
                          s->n_pend_refused;
    }
    o->sink = s->detaching ? NULL : s->sink;
    if (s->es && t->ops->session_memory) t->ops->session_memory(t->engine, s->es, &o->memory);
    mok__group_session_stats(t, s, o);
  }
  mok__group_daemon_stats(t, st);
  c->status = MOK_OK;
}

static void cmd_detach(mok_engine_thread *t, esession *s) {
  mok_standing_env env = standing_env(t, s);
  mok_standing_cancel_all(&s->standing, &env, "the session closed");
  if (session_busy(s)) {
    /* its GPU work finishes first (docs/design.md, Operation); poll_all frees it then */
    s->detaching = true;
    return;
  }
  for (esession **p = &t->sessions; *p; p = &(*p)->next) {
    if (*p != s) continue;
    *p = s->next;
    break;
  }
  if (t->rr_next == s) t->rr_next = NULL;
  session_free(t, s);
}

static void run_command(mok_engine_thread *t, mok_cmd *c) {
  c->status = MOK_OK;
  c->message[0] = '\0';
  if (c->kind == MOK_CMD_ATTACH) {
    cmd_attach(t, c);
    return;
  }
  if (c->kind == MOK_CMD_STATS) {
    cmd_stats(t, c);
    return;
  }
  esession *s = mok__thread_find_session(t, c->session_id);
  if (!s) {
    if (c->kind == MOK_CMD_REGISTER && c->in.reg.fd >= 0) close(c->in.reg.fd);
    c->status = MOK_ENOENT;
    snprintf(c->message, sizeof c->message, "session %llu is not attached",
             (unsigned long long)c->session_id);
    return;
  }
  switch (c->kind) {
  case MOK_CMD_REGISTER:
    cmd_register(t, s, c);
    if (c->in.reg.fd >= 0) close(c->in.reg.fd); /* the mapping keeps what it needs */
    c->in.reg.fd = -1;
    break;
  case MOK_CMD_UNREGISTER: {
    mok_region r;
    c->status = mok_region_table_remove(&s->regions, c->in.id, &r);
    if (c->status == MOK_OK) {
      mok_standing_env env = standing_env(t, s);
      mok_standing_cancel_region(&s->standing, &env, c->in.id, "was unregistered");
    }
    if (c->status == MOK_OK && (!session_busy(s) || !keep_dead_region(s, &r))) {
      while (session_busy(s)) poll_session_blocking(t, s);
      release_region(t, &r);
    }
    else snprintf(c->message, sizeof c->message, "region %u is not registered", c->in.id);
    break;
  }
  case MOK_CMD_CREATE_LAYER: cmd_create_layer(t, s, c); break;
  case MOK_CMD_LAYER_COST: cmd_layer_cost(t, s, c); break;
  case MOK_CMD_DESTROY_LAYER: cmd_destroy_layer(t, s, c); break;
  case MOK_CMD_DETACH: cmd_detach(t, s); break;
  case MOK_CMD_JOIN_GROUP: mok__group_cmd_join(t, s, c); break;
  case MOK_CMD_LEAVE_GROUP: mok__group_cmd_leave(t, s, c); break;
  case MOK_CMD_GROUP_ID: mok__group_cmd_id(t, c); break;
  default:
    c->status = MOK_EINVAL;
    snprintf(c->message, sizeof c->message, "unknown command %d", (int)c->kind);
  }
}

static void run_commands(mok_engine_thread *t) {
  pthread_mutex_lock(&t->lock);
  mok_cmd *c = t->cmd_head;
  t->cmd_head = t->cmd_tail = NULL;
  pthread_mutex_unlock(&t->lock);
  while (c) {
    mok_cmd *next = c->next;
    run_command(t, c);
    if (!c->deferred) mok__thread_post_done(t, c);
    c = next;
  }
}

/* ---- jobs ------------------------------------------------------------------ */

static void session_fault(mok_engine_thread *t, esession *s, const char *why) {
  if (s->faulted) return;
  s->faulted = true;
  uid_jobs_recount(s);
  mok_cmd *c = calloc(1, sizeof *c);
  if (!c) return; /* the loop will still see the socket close eventually */
  c->kind = MOK_CMD_SESSION_FAULT;
  c->session_id = s->id;
  c->status = MOK_EPROTO;
  snprintf(c->message, sizeof c->message, "%s", why);
  mok__thread_post_done(t, c);
}

static void post_completion(esession *s, uint64_t user_data, uint64_t seq, int status,
                            const char *msg, uint64_t engine_ns) {
  mok_shm_header *h = s->shm.hdr;
  mok_completion *slot = &mok_shm_cq_entries(h)[s->cq_tail & (MOK_RING_ENTRIES - 1)];
  mok_completion c = {.user_data = user_data, .seq = seq, .status = status,
                      .engine_ns = engine_ns};
  snprintf(c.message, sizeof c.message, "%.*s", (int)sizeof c.message - 1, msg ? msg : "");
  if (status != MOK_OK) { /* the whole message, at the same index (mok_wire.h) */
    size_t n = msg ? strnlen(msg, MOK_JOB_MESSAGE_MAX - 1) : 0;
    char *full = mok_shm_msg_entry(h, s->cq_tail);
    if (n) memcpy(full, msg, n);
    full[n] = '\0';
  }
  memcpy(slot, &c, sizeof c);
  s->cq_tail++;
  atomic_store_explicit(&h->cq_tail.value, s->cq_tail, memory_order_release);
  /* pairs with the client's fence between setting NEED_WAKEUP and re-reading cq_tail */
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&h->cq_flags.value, memory_order_relaxed) & MOK_RING_NEED_WAKEUP)
    ring_doorbell(s->shm.doorbell_out);
}

/* Account for a finished job and post its completion. */
static void finish_job(mok_engine_thread *t, esession *s, uint64_t user_data, uint64_t seq,
                       uint16_t op, mok_engine_result *res, uint64_t dt) {
  if (res->status == MOK_OK) {
    res->message[0] = '\0';
    s->jobs_done++;
    t->jobs_done++;
  } else {
    s->jobs_failed++;
    t->jobs_failed++;
    log_debug("session %llu job %llu (%s) failed: %s", (unsigned long long)s->id,
              (unsigned long long)seq, mok_op_name(op), res->message);
  }
  t->latency[t->latency_count++ % LATENCY_WINDOW] = dt;
  mok_job_sink_record(s->sink, op, res->status, dt);
  post_completion(s, user_data, seq, res->status, res->message, dt);
}

/* Poll the session's running jobs, oldest first; post what finished.
 * Returns true while some job of the session still runs. */
static bool poll_session(mok_engine_thread *t, esession *s, uint64_t now) {
  while (s->pend_head) {
    pend *p = s->pend_head;
    mok_engine_result res = {.status = MOK_OK};
    if (!t->ops->poll(t->engine, p->job, now, &res)) return true;
    if (res.fatal) engine_fatal(t, res.message);
    s->pend_head = p->next;
    if (!s->pend_head) s->pend_tail = NULL;
    s->n_pend--;
    if (p->fail_status != MOK_OK) s->n_pend_refused--;
    uid_jobs_recount(s);
    if (p->fail_status != MOK_OK) { /* the fence-only NOP of a job that failed validation */
      res.status = p->fail_status;
      memcpy(res.message, p->fail_message, sizeof res.message);
    }
    if (p->group_id && res.status == MOK_ETIMEOUT && t->groups) {
      /* a peer never arrived at a device barrier: the group cannot go on */
      mok_ep_group *g = mok_ep_group_find(t->groups, p->group_id);
      if (g && !mok_ep_group_is_broken(g)) mok_ep_group_count_timeout(g); /* a device barrier's */
      if (g) mok_ep_group_mark_broken(g, res.message);
    }
    uint64_t end = now == UINT64_MAX ? mok_clock_ns() : now;
    if (!s->detaching) finish_job(t, s, p->user_data, p->seq, p->op, &res, end - p->t0);
    free(p);
  }
  release_dead(t, s);
  return false;
}

static void pause_briefly(void) {
  struct timespec ts = {0, 20000};
  nanosleep(&ts, NULL);
}

/* Poll the session's standing instances; take triggers when take. Returns
 * true when an instance started or finished. */
static bool standing_turn(mok_engine_thread *t, esession *s, uint64_t now, bool take) {
  if (!s->standing.live) return false;
  mok_standing_env env = standing_env(t, s);
  bool fatal = false;
  char why[MOK_JOB_MESSAGE_MAX];
  bool worked = mok_standing_turn(&s->standing, &env, now, take, &fatal, why, sizeof why);
  if (fatal) engine_fatal(t, why);
  if (worked) release_dead(t, s);
  return worked;
}

/* Wait for every running job and standing instance of s (a command needs
 * its memory released); no new standing instance starts meanwhile. */
static void poll_session_blocking(mok_engine_thread *t, esession *s) {
  for (;;) {
    bool jobs = poll_session(t, s, mok_clock_ns());
    standing_turn(t, s, mok_clock_ns(), false);
    if (!jobs && !s->standing.running) break;
    pause_briefly();
  }
}

/* Poll every session; free detached sessions whose work finished.
 * Returns true while any job still runs. */
static bool poll_all(mok_engine_thread *t, uint64_t now) {
  if (!t->ops->poll) return false;
  bool running = false;
  for (esession **pp = &t->sessions; *pp;) {
    esession *s = *pp;
    if (poll_session(t, s, now)) running = true;
    standing_turn(t, s, now, !s->faulted && !s->detaching && now != UINT64_MAX);
    if (s->standing.running) running = true;
    if (s->detaching && !session_busy(s)) {
      *pp = s->next;
      if (t->rr_next == s) t->rr_next = NULL;
      session_free(t, s);
      continue;
    }
    pp = &s->next;
  }
  return running;
}

/* Jobs a uid has submitted and not yet seen complete, over all its sessions:
 * those still in the submission rings and those running. */
/* Jobs of s's uid in flight: held (a refused job still waiting for its turn
 * to complete holds nothing) and queued in its sessions' rings. */
static uint32_t uid_jobs_in_flight(const esession *s) {
  uint32_t n = s->uid_jobs->held;
  for (const esession *q = s->uid_jobs->sessions; q; q = q->uid_next) {
    if (q->faulted) continue;
    uint32_t tail = atomic_load_explicit(&q->shm.hdr->sq_tail.value, memory_order_acquire);
    uint32_t queued = tail - q->sq_head;
    n += queued <= MOK_RING_ENTRIES ? queued : MOK_RING_ENTRIES;
  }
  return n;
}

/* A descriptor that creates (op forward or backward) or destroys (NOP) a
 * standing job: checked like any job, kept, never run here (standing.h). */
static void standing_desc(mok_engine_thread *t, esession *s, const mok_job_desc *desc,
                          mok_engine_result *res) {
  mok_standing_env env = standing_env(t, s);
  uint64_t slot64 = desc->reserved[0];
  uint32_t slot = slot64 < MOK_STANDING_MAX ? (uint32_t)slot64 : MOK_STANDING_MAX;
  if (!t->ops->start || !t->ops->poll) {
    res->status = MOK_EUNSUPPORTED;
    snprintf(res->message, sizeof res->message, "the %s engine runs no standing jobs",
             t->ops->name);
    return;
  }
  if (desc->op == MOK_OP_NOP) {
    res->status = mok_standing_remove(&s->standing, &env, slot, res->message,
                                       sizeof res->message);
    return;
  }
  mok_job_desc d = *desc;
  d.flags = (uint16_t)(d.flags & ~MOK_JOB_STANDING);
  const layer_entry *le = NULL;
  for (size_t i = 0; i < s->n_layers; i++)
    if (s->layers[i].id == d.layer) le = &s->layers[i];
  mok_job_args args;
  res->status = mok_job_check(&d, &s->regions, le ? &le->cfg : NULL, &args, res->message,
                              sizeof res->message);
  if (res->status != MOK_OK) return;
  args.session = s->es;
  args.layer_state = le->state;
  res->status = mok_standing_add(&s->standing, &env, slot, le->id, &le->cfg, &d, &args,
                                    res->message, sizeof res->message);
}

/* Copy s's next descriptor out of its submission ring, if it has one and
 * room for its completion: once, so that the client cannot change the copy
 * while it is checked and used. false: none (or s faulted: a ring index
 * out of bounds). */
static bool take_desc(mok_engine_thread *t, esession *s, mok_job_desc *desc) {
  if (s->faulted || s->detaching) return false;
  mok_shm_header *h = s->shm.hdr;
  uint32_t tail = atomic_load_explicit(&h->sq_tail.value, memory_order_acquire);
  uint32_t pending = tail - s->sq_head;
  if (pending == 0) return false;
  if (pending > MOK_RING_ENTRIES) {
    session_fault(t, s, "submission ring tail moved past its capacity");
    return false;
  }
  uint32_t cq_head = atomic_load_explicit(&h->cq_head.value, memory_order_acquire);
  uint32_t used = s->cq_tail - cq_head;
  if (used > MOK_RING_ENTRIES) {
    session_fault(t, s, "completion ring head moved past its tail");
    return false;
  }
  /* every running job will post a completion: keep room for all of them */
  if (used + s->n_pend >= MOK_RING_ENTRIES) return false;

  memcpy(desc, &mok_shm_sq_entries(h)[s->sq_head & (MOK_RING_ENTRIES - 1)], sizeof *desc);
  s->sq_head++;
  atomic_store_explicit(&h->sq_head.value, s->sq_head, memory_order_release);
  s->seq++;
  return true;
}

/* Take and run (or start) one job of s if it has one and room for its
 * completion. Returns true when a job was taken. */
static bool run_one_job(mok_engine_thread *t, esession *s) {
  mok_job_desc desc;
  if (!take_desc(t, s, &desc)) return false;
  mok_job_args args;
  mok_engine_result res = {.status = MOK_OK};
  uint64_t t0 = mok_clock_ns();
  if (desc.flags & MOK_JOB_STANDING) {
    standing_desc(t, s, &desc, &res);
    finish_job(t, s, desc.user_data, s->seq, desc.op, &res, mok_clock_ns() - t0);
    return true;
  }

  const layer_entry *le = NULL;
  if (desc.op != MOK_OP_NOP)
    for (size_t i = 0; i < s->n_layers; i++)
      if (s->layers[i].id == desc.layer) le = &s->layers[i];
  res.status = mok_job_check(&desc, &s->regions, le ? &le->cfg : NULL, &args, res.message,
                             sizeof res.message);
  if (res.status == MOK_OK && s->limits.max_jobs_per_uid) {
    /* a failed job still takes its turn (a group's peers see the failure) */
    uint32_t in_flight = uid_jobs_in_flight(s);
    if (mok_limit_exceeded(MOK_LIMIT_JOBS_PER_UID, s->limits.max_jobs_per_uid, in_flight, 1)) {
      res.status = MOK_ELIMIT;
      snprintf(res.message, sizeof res.message, "uid %u has %u jobs in flight (max-jobs-per-uid %u)",
               s->uid, in_flight + 1, s->limits.max_jobs_per_uid); /* this one included */
    }
  }
  mok_ep_group *group = NULL;
  /* quantize_weight reads one of the rank's weights and writes its packed
   * form: the rank's own work, no turn in the group */
  if (le && le->cfg.group_id && desc.op != MOK_OP_QUANTIZE_WEIGHT) {
    /* a job on the engine thread reads the outputs of the session's earlier
     * jobs: they finish first */
    if (t->ops->groups == MOK_ENGINE_GROUPS_ON_CALLER)
      while (s->n_pend) poll_session_blocking(t, s);
    group = mok__group_of_job(t, s, &desc, &le->cfg, &res);
  }
  pend *p = calloc(1, sizeof *p);
  if (!p) {
    res.status = MOK_ENOMEM;
    snprintf(res.message, sizeof res.message, "out of memory taking the job");
    finish_job(t, s, desc.user_data, s->seq, desc.op, &res, mok_clock_ns() - t0);
    return true;
  }
  p->user_data = desc.user_data;
  p->seq = s->seq;
  p->t0 = t0;
  p->op = desc.op;
  if (res.status != MOK_OK) {
    /* the job fails, but its GPU fences are still honoured, in order */
    p->fail_status = res.status;
    memcpy(p->fail_message, res.message, sizeof p->fail_message);
    memset(&args, 0, sizeof args);
    args.op = MOK_OP_NOP;
    args.fence_wait = desc.fence_wait;
    args.fence_signal = desc.fence_signal;
    res.status = MOK_OK;
    res.message[0] = '\0';
  }
  args.session = s->es;
  args.layer_state = le ? le->state : NULL;
  args.taken_ns = t0;
  if (group) {
    args.group_failed = p->fail_status; /* a failed job's NOP takes the turn on the device */
    if (p->fail_status == MOK_OK) p->group_id = le->cfg.group_id;
  }
  p->job = t->ops->start(t->engine, group, &args, &res);
  if (res.fatal) engine_fatal(t, res.message);
  if (!p->job) {
    if (p->fail_status != MOK_OK) {
      res.status = p->fail_status;
      memcpy(res.message, p->fail_message, sizeof res.message);
    }
    finish_job(t, s, desc.user_data, s->seq, desc.op, &res, mok_clock_ns() - t0);
    free(p);
    return true;
  }
  if (s->pend_tail) s->pend_tail->next = p;
  else s->pend_head = p;
  s->pend_tail = p;
  s->n_pend++;
  if (p->fail_status != MOK_OK) s->n_pend_refused++;
  uid_jobs_recount(s);
  return true;
}

/* One round-robin turn: at most one job per session. */
static bool run_jobs_round(mok_engine_thread *t) {
  bool any = false;
  if (!t->sessions) return false;
  esession *start = t->rr_next ? t->rr_next : t->sessions;
  esession *s = start;
  do {
    if (run_one_job(t, s)) any = true;
    s = s->next ? s->next : t->sessions;
  } while (s != start && s);
  t->rr_next = start->next; /* the next turn starts one further on */
  return any;
}

static void wait_for_wake(mok_engine_thread *t, int ms);

/* A job the engine could take now: submitted, and room for its completion.
 * A session whose completion ring is full (a client that does not drain it)
 * does not count, or the engine would spin on it for ever; it is served
 * again once the client drains and submits (which rings the doorbell). */
static bool any_job_pending(mok_engine_thread *t) {
  for (esession *s = t->sessions; s; s = s->next) {
    if (s->faulted || s->detaching) continue;
    mok_shm_header *h = s->shm.hdr;
    uint32_t tail = atomic_load_explicit(&h->sq_tail.value, memory_order_acquire);
    uint32_t cq_head = atomic_load_explicit(&h->cq_head.value, memory_order_acquire);
    uint32_t used = s->cq_tail - cq_head;
    if (tail != s->sq_head && used + s->n_pend < MOK_RING_ENTRIES) return true;
    if (!s->faulted && mok_standing_triggered(&s->standing, h)) return true;
  }
  return false;
}

/* Some session holds standing jobs (live), triggered lately (hot): a
 * trigger written by a client's CUDA stream rings no doorbell, so the
 * engine thread looks at the words every 20 us while hot, every ms while
 * live (docs/cuda.md "Capture and replay"). */
static void standing_state(mok_engine_thread *t, uint64_t now, bool *live, bool *hot) {
  *live = *hot = false;
  for (esession *s = t->sessions; s; s = s->next) {
    if (!s->standing.live) continue;
    *live = true;
    if (s->standing.hot_until_ns > now) *hot = true;
  }
}

static void set_need_wakeup(mok_engine_thread *t, bool on) {
  for (esession *s = t->sessions; s; s = s->next)
    atomic_store_explicit(&s->shm.hdr->sq_flags.value, on ? MOK_RING_NEED_WAKEUP : 0u,
                          memory_order_relaxed);
  atomic_thread_fence(memory_order_seq_cst);
}

/* Sleep until a doorbell or ms pass (clients are asked to ring while we do). */
static void sleep_until_work(mok_engine_thread *t, int ms) {
  set_need_wakeup(t, true);
  if (!any_job_pending(t)) wait_for_wake(t, ms);
  set_need_wakeup(t, false);
}

/* Sleep until a doorbell (a command, a client's job, a finished job) or
 * ms pass; the doorbells are drained. */
static void wait_for_wake(mok_engine_thread *t, int ms) {
  struct epoll_event evs[32];
  int n = epoll_wait(t->epfd, evs, 32, ms);
  for (int i = 0; i < n; i++) {
    esession *s = evs[i].data.ptr;
    drain_eventfd(s ? s->shm.doorbell_in : t->cmd_efd);
  }
}

static void engine_wake(void *arg) {
  mok_engine_thread *t = arg;
  ring_doorbell(t->cmd_efd);
}

static void *engine_main(void *arg) {
  mok_engine_thread *t = arg;
  uint64_t idle_since = 0;
  bool was_running = false;
  for (;;) {
    run_commands(t);
    if (t->forming) mok__group_poll_formers(t, false);
    if (atomic_load(&t->stopping)) break;
    if (mok_clock_ns() - t->ticked_ns > 100000000ull) {
      t->ticked_ns = mok_clock_ns();
      if (t->groups) mok_ep_group_tick(t->groups); /* groups nobody re-joined in time */
      if (t->ops->idle) t->ops->idle(t->engine, t->ticked_ns); /* idle workspaces go back */
    }
    bool took = run_jobs_round(t);
    uint64_t now = mok_clock_ns();
    bool running = poll_all(t, now);
    /* the spin counts from the last job taken or the last one ended: a
     * client that waited for a long job submits its next one just after */
    const bool ended = was_running && !running;
    was_running = running;
    if (took) {
      idle_since = 0;
      continue;
    }
    if (!idle_since || ended) idle_since = now;
    if (now - idle_since < t->spin_ns) continue; /* a job now starts without a wake-up */
    bool standing_live, standing_hot;
    standing_state(t, now, &standing_live, &standing_hot);
    if (standing_hot) {
      pause_briefly();
      continue;
    }
    if (running) { /* work in flight: poll it, gently, or wait for its wake */
      if (t->ops->wakes_when_done) sleep_until_work(t, 100);
      else pause_briefly();
      continue;
    }
    sleep_until_work(t, standing_live ? 1 : 1000);
    idle_since = 0;
  }
  mok__group_poll_formers(t, true); /* each ends within its group's timeout */
  /* drain: what clients submitted before the stop still runs, within a bound */
  uint64_t deadline = mok_clock_ns() + (uint64_t)t->drain_ms * 1000000ull;
  for (;;) {
    uint64_t now = mok_clock_ns();
    if (now >= deadline) break;
    bool took = run_jobs_round(t);
    bool running = poll_all(t, now);
    if (!took && !running) break;
    if (!took) pause_briefly();
  }
  /* out of time: whatever still runs stops waiting for its fences */
  while (poll_all(t, UINT64_MAX)) pause_briefly();
  for (esession *s = t->sessions; s; s = s->next) {
    mok_shm_header *h = s->shm.hdr;
    uint32_t tail = atomic_load_explicit(&h->sq_tail.value, memory_order_acquire);
    if (tail - s->sq_head > 0 && !s->faulted)
      log_warn("session %llu: %u jobs left unrun at shutdown", (unsigned long long)s->id,
               tail - s->sq_head);
  }
  return NULL;
}

int mok_engine_thread_start(const mok_engine_ops *ops, const mok_engine_config *cfg,
                            void (*on_done)(void *arg), void *arg, mok_engine_thread **ret,
                            char *err, size_t errlen) {
  mok_engine_thread *t = calloc(1, sizeof *t);
  if (!t) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  t->ops = ops;
  t->on_done = on_done;
  t->on_done_arg = arg;
  t->epfd = -1;
  t->cmd_efd = -1;
  pthread_mutex_init(&t->lock, NULL);
  t->spin_ns = 1000ull * (cfg->idle_spin_us ? cfg->idle_spin_us : MOK_IDLE_SPIN_US);
  /* MOK_FENCE_TIMEOUT_MS is in it already (config.c's environment table) */
  t->fence_timeout_ns = (uint64_t)(cfg->fence_timeout_ms ? cfg->fence_timeout_ms : 30000u) * 1000000ull;
  mok_engine_config ecfg = *cfg;
  ecfg.wake = engine_wake;
  ecfg.wake_arg = t;
  int r = ops->open(&ecfg, &t->engine, err, errlen);
  if (r != MOK_OK) goto fail;
  if (ops->groups != MOK_ENGINE_NO_GROUPS &&
      !(t->groups = mok_ep_group_table_create(&t->stopping))) {
    snprintf(err, errlen, "out of memory");
    r = MOK_ENOMEM;
    goto fail;
  }
  if (t->groups && cfg->group_linger_set) mok_ep_group_set_linger_ms(t->groups, cfg->group_linger_ms);
  if (t->groups && cfg->group_dir) mok_ep_group_set_dir(t->groups, cfg->group_dir);
  t->epfd = epoll_create1(EPOLL_CLOEXEC);
  t->cmd_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
  if (t->epfd < 0 || t->cmd_efd < 0 || epoll_ctl(t->epfd, EPOLL_CTL_ADD, t->cmd_efd, &ev) < 0) {
    snprintf(err, errlen, "engine thread set-up: %s", strerror(errno));
    r = MOK_EIO;
    goto fail;
  }
  snprintf(t->describe, sizeof t->describe, "%s", ops->describe(t->engine));
  if (pthread_create(&t->thread, NULL, engine_main, t) != 0) {
    snprintf(err, errlen, "cannot start the engine thread");
    r = MOK_ENOMEM;
    goto fail;
  }
  *ret = t;
  return MOK_OK;
fail:
  mok_ep_group_table_destroy(t->groups);
  if (t->engine) ops->close(t->engine);
  if (t->epfd >= 0) close(t->epfd);
  if (t->cmd_efd >= 0) close(t->cmd_efd);
  pthread_mutex_destroy(&t->lock);
  free(t);
  return r;
}

const char *mok_engine_thread_describe(mok_engine_thread *t) { return t->describe; }
const char *mok_engine_thread_engine_name(mok_engine_thread *t) { return t->ops->name; }

void mok_engine_thread_stop(mok_engine_thread *t, uint32_t drain_ms) {
  if (!t) return;
  t->drain_ms = drain_ms;
  atomic_store(&t->stopping, true);
  ring_doorbell(t->cmd_efd);
  pthread_join(t->thread, NULL);
  /* commands that arrived too late, and sessions never detached */
  run_commands(t);
  while (t->sessions) cmd_detach(t, t->sessions);
  mok_ep_group_table_destroy(t->groups); /* this daemon's ranks leave their groups */
  t->ops->close(t->engine);
  close(t->epfd);
  close(t->cmd_efd);
  mok_cmd *c = mok_engine_thread_take_done(t);
  while (c) {
    mok_cmd *next = c->next;
    if (c->kind == MOK_CMD_STATS) free(c->out.stats.sessions);
    free(c);
    c = next;
  }
  pthread_mutex_destroy(&t->lock);
  free(t);
}
