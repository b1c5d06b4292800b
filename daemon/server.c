/* SPDX-License-Identifier: Apache-2.0 */
#include "server.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>
#include <uv.h>

#include "client_limits.h"
#include "clock.h"
#include "frame.h"
#include "ep/group.h"
#include "layer.h"
#include "log.h"
#include "metrics.h"
#include "metrics_server.h"
#include "mok.pb-c.h"
#include "mok_status.h"
#include "quota.h"
#include "region.h"
#include "request.h"

typedef struct region_rec {
  uint32_t id;
  uint64_t bytes;
} region_rec;

/* A group this session joined (one entry per successful join). */
typedef struct join_rec {
  uint32_t group_id;
  mok_quota_group *quota;
} join_rec;

/* Loop-side half of a session: the socket, identity, protocol state. The
 * engine-side half (rings, regions, layers) lives on the engine thread. */
typedef struct session {
  struct server *srv;
  uint64_t id;
  int fd;
  uv_poll_t poll;
  uv_timer_t hello_timer;
  struct ucred cred;
  bool admin; /* sees every tenant in Stats (root, mokd's uid, admin-uids/-gids) */
  char name[64];
  bool hello_done;
  bool attached;
  bool closing;
  int open_handles;  /* poll and timer; freed when both closed and no cmd pending */
  uint32_t pending;  /* engine commands not yet back */
  /* allocated with the session, so that releasing its mappings never
   * depends on an allocation succeeding when memory is short */
  mok_cmd *detach;
  mok_uid_usage *user; /* this session's uid: what it holds counts there */
  mok_job_sink *sink;  /* its jobs' label set in the metrics (NULL: off) */
  uint32_t regions, layers; /* this session's share of user's counts */
  uint64_t region_bytes;
  region_rec *recs;  /* registered regions, for unregister */
  size_t n_recs, cap_recs;
  uint32_t registering; /* RegisterBuffers in flight (each has room in recs) */
  join_rec *joins;   /* groups joined, for LeaveGroup and the end */
  size_t n_joins, cap_joins;
  uint32_t joining;  /* JoinGroups in flight (each has room in joins) */
  struct session *next;
} session;

typedef struct server {
  mok_server_config cfg;
  uv_loop_t *loop;
  int listen_fd;
  bool own_socket_path; /* we created it, so we unlink it */
  uv_poll_t listen_poll;
  uv_signal_t sigterm, sigint;
  uv_timer_t watchdog;
  bool watchdog_on;
  uv_async_t engine_done;
  mok_engine_thread *engine;
  mok_metrics *metrics;            /* NULL: no metrics endpoint */
  mok_metrics_server *metrics_srv;
  session *sessions;
  mok_quota quota; /* what each uid (and the daemon) holds */
  uint32_t n_sessions;
  uint64_t refused_window_ms; /* rate limit for logging refused connections */
  uint32_t refused_in_window;
  uint64_t next_session_id;
  uint64_t sessions_total;
  uint64_t epoch;
  uint64_t start_ms;
  bool stopping;
  uint8_t *rxbuf; /* one receive buffer: the loop is single-threaded */
} server;

#define RXBUF_BYTES (MOK_FRAME_MAX + 1) /* one more, so an oversized frame shows */

/* ---- replies ------------------------------------------------------------ */

static void session_close(session *s, const char *why);

/* Send a reply (with fds, which the kernel duplicates into the client).
 * A client that does not read its replies is closed, not waited for. */
static void send_reply(session *s, uint32_t request_id, Mok__Reply *reply, const int *fds,
                       size_t nfds) {
  if (s->closing) return;
  size_t len = mok__reply__get_packed_size(reply);
  uint8_t stackbuf[4096];
  uint8_t *buf = len <= sizeof stackbuf ? stackbuf : malloc(len);
  if (!buf) {
    session_close(s, "out of memory packing a reply");
    return;
  }
  mok__reply__pack(reply, buf);
  int r = mok_frame_send(s->fd, request_id, buf, len, fds, nfds);
  if (buf != stackbuf) free(buf);
  if (r < 0) session_close(s, r == -EAGAIN ? "client is not reading its replies" : strerror(-r));
}

static void reply_status(session *s, uint32_t request_id, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reply_status(session *s, uint32_t request_id, int status, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.status = status;
  reply.message = msg;
  send_reply(s, request_id, &reply, NULL, 0);
}

/* Protocol errors: one error reply where possible, then close this session only. */
static void protocol_error(session *s, uint32_t request_id, int status, const char *why) {
  log_info("session %llu (%s, pid %d): %s; closing it", (unsigned long long)s->id,
           s->name[0] ? s->name : "no hello", (int)s->cred.pid, why);
  mok_metrics_refused(s->srv->metrics, status == MOK_ETIMEOUT ? "hello-timeout-ms" : "protocol");
  reply_status(s, request_id, status, "%s", why);
  session_close(s, NULL);
}

/* ---- session lifetime ------------------------------------------------------- */

static void session_maybe_free(session *s) {
  if (s->open_handles > 0 || s->pending > 0) return;
  server *srv = s->srv;
  for (session **p = &srv->sessions; *p; p = &(*p)->next) {
    if (*p != s) continue;
    *p = s->next;
    break;
  }
  srv->n_sessions--;
  /* its share goes now: the engine has detached it (nothing is pending) */
  mok_uid_usage *u = s->user;
  u->sessions--;
  u->regions -= s->regions;
  u->region_bytes -= s->region_bytes;
  u->layers -= s->layers;
  srv->quota.regions_total -= s->regions;
  uint64_t now = mok_clock_ms();
  for (size_t i = 0; i < s->n_joins; i++) /* lingering in the engine now */
    mok_quota_group_drop(&srv->quota, s->joins[i].quota, false, now);
  mok_quota_prune(&srv->quota, now);
  mok_metrics_session_close(srv->metrics, s->sink);
  free(s->detach);
  free(s->recs);
  free(s->joins);
  free(s);
}

static void on_handle_closed(uv_handle_t *h) {
  session *s = h->data;
  s->open_handles--;
  if (s->open_handles == 0 && s->fd >= 0) {
    close(s->fd);
    s->fd = -1;
  }
  session_maybe_free(s);
}

static mok_cmd *new_cmd(session *s, mok_cmd_kind kind, uint32_t request_id) {
  mok_cmd *c = calloc(1, sizeof *c);
  if (!c) return NULL;
  c->kind = kind;
  c->session_id = s->id;
  c->request_id = request_id;
  return c;
}

static void submit_cmd(session *s, mok_cmd *c) {
  s->pending++;
  mok_engine_thread_submit(s->srv->engine, c);
}

static void session_close(session *s, const char *why) {
  if (s->closing) return;
  s->closing = true;
  if (why) log_info("session %llu (%s): %s", (unsigned long long)s->id, s->name, why);
  if (s->attached) {
    /* allocated with the session: the detach is always sent, and its
     * mappings go once the engine is done with them */
    mok_cmd *c = s->detach;
    s->detach = NULL;
    memset(c, 0, sizeof *c);
    c->kind = MOK_CMD_DETACH;
    c->session_id = s->id;
    submit_cmd(s, c);
  }
  uv_close((uv_handle_t *)&s->poll, on_handle_closed);
  uv_close((uv_handle_t *)&s->hello_timer, on_handle_closed);
}

static session *find_session(server *srv, uint64_t id) {
  for (session *s = srv->sessions; s; s = s->next)
    if (s->id == id) return s;
  return NULL;
}

/* ---- requests -------------------------------------------------------------- */

static void handle_hello(session *s, uint32_t rid, const Mok__Hello *m) {
  /* the client's name goes into logs and stats: printable ASCII only */
  snprintf(s->name, sizeof s->name, "%s", m->client_name ? m->client_name : "");
  for (char *p = s->name; *p; p++)
    if (*p < 0x20 || *p > 0x7e) *p = '?';
  mok_cmd *c = new_cmd(s, MOK_CMD_ATTACH, rid);
  if (!c) {
    protocol_error(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  char why[128];
  int r = mok_session_shm_create(&c->in.attach.shm, why, sizeof why);
  if (r != MOK_OK) {
    free(c);
    protocol_error(s, rid, r, why);
    return;
  }
  c->in.attach.limits = s->srv->cfg.limits;
  c->in.attach.uid = (uint32_t)s->cred.uid;
  c->in.attach.sink = s->sink = mok_metrics_session_open(s->srv->metrics, c->in.attach.uid, s->name);
  /* send the fds first: once attached they belong to the engine thread */
  Mok__HelloReply hr = MOK__HELLO_REPLY__INIT;
  char *caps[] = {"host-memfd", "single-steps", "recompute", "bf16", "f32"};
  hr.session_id = s->id;
  hr.daemon_version = MOK_VERSION;
  hr.device = (char *)mok_engine_thread_describe(s->srv->engine);
  hr.engine = (char *)mok_engine_thread_engine_name(s->srv->engine);
  hr.n_capabilities = sizeof caps / sizeof caps[0];
  hr.capabilities = caps;
  hr.ring_entries = MOK_RING_ENTRIES;
  hr.shm_bytes = MOK_SHM_BYTES;
  hr.daemon_epoch = s->srv->epoch;
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.body_case = MOK__REPLY__BODY_HELLO;
  reply.hello = &hr;
  int fds[3] = {c->in.attach.shm.memfd, c->in.attach.shm.doorbell_in,
                c->in.attach.shm.doorbell_out};
  send_reply(s, rid, &reply, fds, 3);
  if (s->closing) {
    mok_session_shm_destroy(&c->in.attach.shm);
    free(c);
    return;
  }
  s->hello_done = true;
  s->attached = true;
  uv_timer_stop(&s->hello_timer);
  submit_cmd(s, c); /* the HelloReply went already: a failed attach closes the session */
  log_info("session %llu: hello from \"%s\" (uid %d, pid %d)", (unsigned long long)s->id, s->name,
           (int)s->cred.uid, (int)s->cred.pid);
}

/* The client limits: refuse (ELIMIT, the session stays) what would exceed one. */
static bool quota_refuses(session *s, uint32_t rid, uint32_t regions, uint64_t bytes,
                          uint32_t layers) {
  char msg[320];
  if (mok_quota_check(&s->srv->quota, s->user, regions, bytes, layers, msg, sizeof msg) == MOK_OK)
    return false;
  mok_metrics_refused(s->srv->metrics, msg);
  reply_status(s, rid, MOK_ELIMIT, "%s", msg);
  return true;
}

static void count_regions(session *s, int sign, uint64_t bytes) {
  mok_quota_region(&s->srv->quota, s->user, sign, bytes);
  s->regions += (uint32_t)sign;
  if (sign > 0) s->region_bytes += bytes;
  else s->region_bytes -= bytes;
}

static void count_layers(session *s, int sign) {
  mok_quota_layer(s->user, sign);
  s->layers += (uint32_t)sign;
}

/* Room in *items (of *cap, elem bytes each) for want entries. */
static bool make_room(void **items, size_t *cap, size_t want, size_t elem) {
  if (want <= *cap) return true;
  size_t n = *cap ? 2 * *cap : 16;
  while (n < want) n *= 2;
  void *grown = realloc(*items, n * elem);
  if (!grown) return false;
  *items = grown;
  *cap = n;
  return true;
}

static void handle_register(session *s, uint32_t rid, const mok_request *q, mok_frame *f) {
  const Mok__RegisterBuffer *m = q->pb->register_buffer;
  if (quota_refuses(s, rid, 1, m->bytes, 0)) {
    mok_frame_close_fds(f);
    return;
  }
  /* room for its record now: a region the engine mapped is always
   * recorded, so that unregistering it gives its quota back */
  mok_cmd *c = new_cmd(s, MOK_CMD_REGISTER, rid);
  if (!c || !make_room((void **)&s->recs, &s->cap_recs, s->n_recs + s->registering + 1,
                       sizeof *s->recs)) {
    free(c);
    mok_frame_close_fds(f);
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  s->registering++;
  c->in.reg.kind = q->region_kind;
  c->in.reg.fd = q->want_fds ? f->fds[0] : -1;
  f->nfds = 0; /* the engine owns the fd now */
  c->in.reg.offset = m->offset;
  c->in.reg.bytes = m->bytes;
  if (q->region_kind == MOK_REGION_CUDA_IPC) memcpy(c->in.reg.ipc_handle, m->cuda_ipc_handle.data, 64);
  count_regions(s, +1, m->bytes); /* reserved; given back if the engine refuses */
  submit_cmd(s, c);
}

static void handle_create_layer(session *s, uint32_t rid, const mok_request *q) {
  if (quota_refuses(s, rid, 0, 0, 1)) return;
  mok_cmd *c = new_cmd(s, MOK_CMD_CREATE_LAYER, rid);
  if (!c) {
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  c->in.layer = q->layer;
  count_layers(s, +1);
  submit_cmd(s, c);
}

/* What a layer would cost: CreateLayer's checks, nothing kept, no quota. */
static void handle_layer_cost(session *s, uint32_t rid, const mok_request *q) {
  mok_cmd *c = new_cmd(s, MOK_CMD_LAYER_COST, rid);
  if (!c) {
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  c->in.layer = q->layer;
  submit_cmd(s, c);
}

/* Expert parallelism: the group is keyed by (the client's uid, key), so two
 * tenants never share one (docs/ep.md). Its segment counts toward the uid's
 * group quotas from the moment the join is sent. */
static void handle_join_group(session *s, uint32_t rid, const Mok__JoinGroup *m) {
  mok_cmd *c = new_cmd(s, MOK_CMD_JOIN_GROUP, rid);
  if (!c || !make_room((void **)&s->joins, &s->cap_joins, s->n_joins + s->joining + 1,
                       sizeof *s->joins)) {
    free(c);
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  mok_ep_group_join_args *j = &c->in.join;
  j->uid = s->cred.uid;
  snprintf(j->key, sizeof j->key, "%s", m->group_key); /* 1..128 bytes (request.c) */
  j->rank = m->rank;
  j->timeout_ms = m->timeout_ms;
  j->sizing = (mok_ep_group_sizing){
      .world = m->world, .max_tokens = m->max_tokens, .hidden = m->hidden, .topk = m->topk,
      .experts = m->experts, .capacity_ppm = m->capacity_ppm, .ring_rows = m->ring_rows,
      .dtype = m->dtype == MOK__DTYPE__DTYPE_F32    ? MOK_DTYPE_F32
               : m->dtype == MOK__DTYPE__DTYPE_BF16 ? MOK_DTYPE_BF16
                                                    : MOK_DTYPE_INVALID};
  j->nccl = m->nccl_id.len == MOK_GROUP_NCCL_ID_BYTES; /* 0 or 128 bytes (request.c) */
  if (j->nccl) memcpy(j->nccl_id, m->nccl_id.data, MOK_GROUP_NCCL_ID_BYTES);
  /* a sizing the engine will refuse costs 0 bytes (the reservation goes
   * with the refusal); a group through NCCL has no segment, but device
   * buffers of the same size */
  char msg[320];
  mok_quota_group *qg;
  int r = mok_quota_group_reserve(&s->srv->quota, s->user, j->key,
                                  mok_ep_group_segment_bytes(&j->sizing), mok_clock_ms(), &qg, msg,
                                  sizeof msg);
  if (r != MOK_OK) {
    free(c);
    mok_metrics_refused(s->srv->metrics, msg);
    reply_status(s, rid, r, "%s", msg);
    return;
  }
  s->joining++;
  submit_cmd(s, c);
}

static void handle_simple_cmd(session *s, uint32_t rid, mok_cmd_kind kind, uint32_t id) {
  mok_cmd *c = new_cmd(s, kind, rid);
  if (!c) {
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  c->in.id = id;
  submit_cmd(s, c);
}

/* Decoding and per-message validation live in request.c (pure, fuzzed);
 * here: the session's state, then the dispatch to the engine thread. */
static void handle_request(session *s, mok_frame *f) {
  uint32_t rid = f->hdr.request_id;
  mok_request q;
  mok_request_verdict v = mok_request_decode(f->payload, f->len, f->nfds, s->hello_done, &q);
  if (v == MOK_REQ_OK && s->pending >= s->srv->cfg.max_pending_requests &&
      q.pb->body_case != MOK__REQUEST__BODY_GOODBYE) {
    q.status = MOK_ELIMIT;
    snprintf(q.message, sizeof q.message, "more than %u requests awaiting replies",
             s->srv->cfg.max_pending_requests);
    v = MOK_REQ_REPLY;
    mok_metrics_refused(s->srv->metrics, "max-pending-requests");
  }
  if (v == MOK_REQ_OK) v = mok_request_validate(&q, f->nfds, s->hello_done);
  if (v != MOK_REQ_OK) {
    mok_frame_close_fds(f);
    if (v == MOK_REQ_CLOSE) protocol_error(s, rid, q.status, q.message);
    else reply_status(s, rid, q.status, "%s", q.message);
    mok_request_free(&q);
    return;
  }
  const Mok__Request *req = q.pb;
  switch (req->body_case) {
  case MOK__REQUEST__BODY_HELLO: handle_hello(s, rid, req->hello); break;
  case MOK__REQUEST__BODY_REGISTER_BUFFER: handle_register(s, rid, &q, f); break;
  case MOK__REQUEST__BODY_UNREGISTER_BUFFER:
    handle_simple_cmd(s, rid, MOK_CMD_UNREGISTER, req->unregister_buffer->region_id);
    break;
  case MOK__REQUEST__BODY_CREATE_LAYER: handle_create_layer(s, rid, &q); break;
  case MOK__REQUEST__BODY_LAYER_COST: handle_layer_cost(s, rid, &q); break;
  case MOK__REQUEST__BODY_DESTROY_LAYER:
    handle_simple_cmd(s, rid, MOK_CMD_DESTROY_LAYER, req->destroy_layer->layer_id);
    break;
  case MOK__REQUEST__BODY_STATS: handle_simple_cmd(s, rid, MOK_CMD_STATS, 0); break;
  case MOK__REQUEST__BODY_JOIN_GROUP: handle_join_group(s, rid, req->join_group); break;
  case MOK__REQUEST__BODY_GROUP_ID: handle_simple_cmd(s, rid, MOK_CMD_GROUP_ID, 0); break;
  case MOK__REQUEST__BODY_LEAVE_GROUP:
    handle_simple_cmd(s, rid, MOK_CMD_LEAVE_GROUP, req->leave_group->group_id);
    break;
  case MOK__REQUEST__BODY_GOODBYE:
    reply_status(s, rid, MOK_OK, "goodbye");
    session_close(s, "said goodbye");
    break;
  default: /* mok_request_validate refused every other body */
    protocol_error(s, rid, MOK_EPROTO, "unknown message");
  }
  mok_frame_close_fds(f); /* none left unless a handler failed to take them */
  mok_request_free(&q);
}

static void on_session_readable(uv_poll_t *h, int status, int events) {
  session *s = h->data;
  if (s->closing) return;
  if (status < 0) {
    session_close(s, uv_strerror(status));
    return;
  }
  size_t limit = s->hello_done ? MOK_FRAME_MAX : MOK_FRAME_MAX_PRE_HELLO;
  /* a bounded batch per wake-up, so one chatty client cannot starve the loop */
  for (int i = 0; i < 16 && !s->closing; i++) {
    mok_frame f;
    int r = mok_frame_recv(s->fd, s->srv->rxbuf, RXBUF_BYTES, limit, MSG_DONTWAIT, &f);
    if (r == -EAGAIN || r == -EWOULDBLOCK) return;
    if (r == 1) {
      session_close(s, "client disconnected");
      return;
    }
    if (r < 0) {
      char why[160];
      int st = MOK_EPROTO;
      if (r == -EMSGSIZE)
        snprintf(why, sizeof why, "frame larger than %zu bytes refused", limit);
      else if (r == -EPROTONOSUPPORT)
        st = MOK_EVERSION, snprintf(why, sizeof why, "frame of another protocol version");
      else if (r == -EBADMSG)
        snprintf(why, sizeof why, "more than %u file descriptors in one frame",
                 MOK_FRAME_MAX_FDS);
      else if (r == -EPROTO)
        snprintf(why, sizeof why, "malformed frame header or truncated control data");
      else
        snprintf(why, sizeof why, "receive failed: %s", strerror(-r));
      protocol_error(s, 0, st, why);
      return;
    }
    handle_request(s, &f);
  }
}

static void on_hello_timeout(uv_timer_t *t) {
  session *s = t->data;
  protocol_error(s, 0, MOK_ETIMEOUT, "no Hello within the handshake timeout");
}

static bool id_listed(const uint32_t *ids, uint32_t n, uint32_t id) {
  for (uint32_t i = 0; i < n; i++)
    if (ids[i] == id) return true;
  return false;
}

/* Is the peer in uids, or is its primary or a supplementary gid (through
 * SO_PEERGROUPS) in gids? */
static bool peer_listed(int fd, const struct ucred *cr, const uint32_t *uids, uint32_t n_uids,
                        const uint32_t *gids, uint32_t n_gids) {
  if (id_listed(uids, n_uids, cr->uid)) return true;
  if (n_gids == 0) return false;
  if (id_listed(gids, n_gids, cr->gid)) return true;
  gid_t small[64], *groups = small;
  socklen_t len = sizeof small;
  bool ok = false;
  int r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  if (r < 0 && errno == ERANGE && len > 0 && (groups = malloc(len)) != NULL)
    r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  if (r == 0)
    for (size_t i = 0; i < len / sizeof(gid_t) && !ok; i++) ok = id_listed(gids, n_gids, groups[i]);
  if (groups != small) free(groups);
  return ok;
}

/* allow-uids / allow-gids against the peer's credentials. No list:
 * everyone who can open the socket (its mode and group are the outer gate). */
static bool peer_allowed(const server *srv, int fd, const struct ucred *cr) {
  const mok_server_config *cfg = &srv->cfg;
  if (cfg->n_allow_uids == 0 && cfg->n_allow_gids == 0) return true;
  return peer_listed(fd, cr, cfg->allow_uids, cfg->n_allow_uids, cfg->allow_gids,
                     cfg->n_allow_gids);
}

/* Who sees every tenant in Stats: root, mokd's own uid, admin-uids/-gids. */
static bool peer_is_admin(const server *srv, int fd, const struct ucred *cr) {
  const mok_server_config *cfg = &srv->cfg;
  if (cr->uid == 0 || cr->uid == geteuid()) return true;
  return peer_listed(fd, cr, cfg->admin_uids, cfg->n_admin_uids, cfg->admin_gids,
                     cfg->n_admin_gids);
}

/* One error reply on a connection that never becomes a session, then close
 * it. The peer reads it as the answer to its Hello (request id 0). Logged
 * with the peer's identity, at most 10 times a minute. */
static void refuse_connection(server *srv, int fd, const struct ucred *cr, int status,
                              const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void refuse_connection(server *srv, int fd, const struct ucred *cr, int status,
                              const char *fmt, ...) {
  char msg[256];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  mok_metrics_refused(srv->metrics, msg);
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.status = status;
  reply.message = msg;
  uint8_t buf[512];
  if (mok__reply__get_packed_size(&reply) <= sizeof buf) {
    size_t n = mok__reply__pack(&reply, buf);
    (void)mok_frame_send(fd, 0, buf, n, NULL, 0); /* non-blocking: best effort */
  }
  close(fd);
  uint64_t now = mok_clock_ms();
  if (now - srv->refused_window_ms >= 60000) {
    if (srv->refused_in_window > 10)
      log_warn("%u more connections refused in the last minute", srv->refused_in_window - 10);
    srv->refused_window_ms = now;
    srv->refused_in_window = 0;
  }
  if (++srv->refused_in_window <= 10)
    log_warn("refused a connection from uid %d gid %d pid %d: %s", (int)cr->uid, (int)cr->gid,
             (int)cr->pid, msg);
}

static void on_listen_readable(uv_poll_t *h, int status, int events) {
  server *srv = h->data;
  if (status < 0 || srv->stopping) return;
  for (;;) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
        log_warn("accept: %s", strerror(errno));
      return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0) {
      log_warn("SO_PEERCRED: %s; closing the connection", strerror(errno));
      close(fd);
      continue;
    }
    if (!peer_allowed(srv, fd, &cred)) {
      refuse_connection(srv, fd, &cred, MOK_EACCES,
                        "uid %d (gid %d) may not use this mokd: not in allow-uids/allow-gids",
                        (int)cred.uid, (int)cred.gid);
      continue;
    }
    const mok_server_config *cfg = &srv->cfg;
    if (mok_limit_exceeded(MOK_LIMIT_SESSIONS, cfg->max_sessions, srv->n_sessions, 1)) {
      refuse_connection(srv, fd, &cred, MOK_ELIMIT, "mokd has %u sessions already (max-sessions)",
                        srv->n_sessions);
      continue;
    }
    mok_quota_prune(&srv->quota, mok_clock_ms());
    mok_uid_usage *u = mok_quota_user(&srv->quota, cred.uid, false);
    uint32_t held = u ? u->sessions : 0;
    if (mok_limit_exceeded(MOK_LIMIT_SESSIONS_PER_UID, cfg->max_sessions_per_uid, held, 1)) {
      refuse_connection(srv, fd, &cred, MOK_ELIMIT,
                        "uid %d has %u sessions already (max-sessions-per-uid %u)",
                        (int)cred.uid, held, cfg->max_sessions_per_uid);
      continue;
    }
    /* the last free slots are kept for uids that have none yet, so that
     * one tenant (or a few) can never lock the others out: this session
     * and the reserve must both fit */
    if (held > 0 && mok_limit_exceeded(MOK_LIMIT_SESSION_RESERVE, cfg->max_sessions,
                                       srv->n_sessions, 1 + (uint64_t)cfg->session_reserve)) {
      refuse_connection(srv, fd, &cred, MOK_ELIMIT,
                        "mokd has %u of %u sessions in use; the last %u are kept for uids that "
                        "have none (session-reserve), and uid %d has %u",
                        srv->n_sessions, cfg->max_sessions, cfg->session_reserve, (int)cred.uid,
                        held);
      continue;
    }
    session *s = calloc(1, sizeof *s);
    mok_cmd *detach = s ? calloc(1, sizeof *detach) : NULL;
    if (detach) u = mok_quota_user(&srv->quota, cred.uid, true);
    if (!s || !detach || !u) {
      free(s);
      free(detach);
      refuse_connection(srv, fd, &cred, MOK_ENOMEM, "mokd is out of memory");
      continue;
    }
    u->sessions++;
    s->user = u;
    s->detach = detach;
    s->admin = peer_is_admin(srv, fd, &cred);
    s->srv = srv;
    s->fd = fd;
    s->id = ++srv->next_session_id;
    s->cred = cred;
    uv_poll_init(srv->loop, &s->poll, fd);
    uv_timer_init(srv->loop, &s->hello_timer);
    s->poll.data = s;
    s->hello_timer.data = s;
    s->open_handles = 2;
    s->next = srv->sessions;
    srv->sessions = s;
    srv->n_sessions++;
    srv->sessions_total++;
    uv_poll_start(&s->poll, UV_READABLE | UV_DISCONNECT, on_session_readable);
    uv_timer_start(&s->hello_timer, on_hello_timeout, srv->cfg.hello_timeout_ms, 0);
  }
}

/* ---- engine results ----------------------------------------------------------- */

/* Stats, as this client may see them: an admin sees every session and
 * group; anyone else only those of its own uid, with the totals computed
 * from them (and no daemon-wide latencies). */
static void reply_stats(session *s, mok_cmd *c) {
  server *srv = s->srv;
  mok_engine_stats *st = &c->out.stats;
  const bool all = s->admin;
  const uint32_t viewer = (uint32_t)s->cred.uid;
  Mok__StatsReply sr = MOK__STATS_REPLY__INIT;
  sr.daemon_version = MOK_VERSION;
  sr.device = (char *)mok_engine_thread_describe(srv->engine);
  sr.engine = (char *)mok_engine_thread_engine_name(srv->engine);
  sr.uptime_ms = mok_clock_ms() - srv->start_ms;
  sr.own_uid_only = !all;
  sr.viewer_uid = viewer;
  if (all) {
    sr.jobs_done = st->jobs_done;
    sr.jobs_failed = st->jobs_failed;
    sr.sessions_total = srv->sessions_total;
    sr.job_latency_p50_ns = st->latency_p50_ns;
    sr.job_latency_p99_ns = st->latency_p99_ns;
  }
  Mok__SessionInfo *infos = calloc(st->n_sessions ? st->n_sessions : 1, sizeof *infos);
  Mok__SessionInfo **ptrs = calloc(st->n_sessions ? st->n_sessions : 1, sizeof *ptrs);
  size_t ng = (st->n_sessions ? st->n_sessions : 1) * MOK_STATS_GROUPS_MAX;
  Mok__GroupInfo *ginfos = calloc(ng, sizeof *ginfos);
  Mok__GroupInfo **gptrs = calloc(ng, sizeof *gptrs);
  if (!infos || !ptrs || !ginfos || !gptrs) {
    free(infos);
    free(ptrs);
    free(ginfos);
    free(gptrs);
    reply_status(s, c->request_id, MOK_ENOMEM, "out of memory");
    return;
  }
  size_t n = 0;
  for (size_t i = 0; i < st->n_sessions; i++) {
    const mok_session_stats *ss = &st->sessions[i];
    session *peer = find_session(srv, ss->session_id);
    /* a session the loop no longer knows has no known owner: admins only */
    if (!all && (!peer || (uint32_t)peer->cred.uid != viewer)) continue;
    Mok__SessionInfo *x = &infos[n];
    mok__session_info__init(x);
    x->session_id = ss->session_id;
    x->client_name = peer ? peer->name : "";
    x->uid = peer ? (uint32_t)peer->cred.uid : 0;
    x->pid = peer ? (uint32_t)peer->cred.pid : 0;
    x->regions = ss->regions;
    x->region_bytes = ss->region_bytes;
    x->layers = ss->layers;
    x->jobs_done = ss->jobs_done;
    x->jobs_failed = ss->jobs_failed;
    x->mapped_device_bytes = ss->memory.mapped_device_bytes;
    x->workspace_bytes = ss->memory.workspace_bytes;
    x->layer_bytes = ss->memory.layer_bytes;
    x->scratch_bytes = ss->memory.scratch_bytes;
    Mok__GroupInfo *gi = &ginfos[n * MOK_STATS_GROUPS_MAX];
    Mok__GroupInfo **gp = &gptrs[n * MOK_STATS_GROUPS_MAX];
    for (uint32_t k = 0; k < ss->n_groups; k++) {
      mok__group_info__init(&gi[k]);
      gi[k].group_id = ss->groups[k].group_id;
      gi[k].rank = ss->groups[k].rank;
      gi[k].world = ss->groups[k].world;
      gi[k].generation = ss->groups[k].generation;
      gi[k].sequence = ss->groups[k].sequence;
      gp[k] = &gi[k];
    }
    x->n_groups = ss->n_groups;
    x->groups = gp;
    ptrs[n++] = x;
    if (!all) {
      sr.jobs_done += ss->jobs_done;
      sr.jobs_failed += ss->jobs_failed;
      sr.sessions_total++;
    }
  }
  sr.n_sessions = n;
  sr.sessions = ptrs;
  Mok__GroupSummary gs[MOK_STATS_DAEMON_GROUPS_MAX], *gsp[MOK_STATS_DAEMON_GROUPS_MAX];
  for (size_t k = 0; k < st->n_groups && k < MOK_STATS_DAEMON_GROUPS_MAX; k++) {
    const mok_daemon_group_stats *d = &st->groups[k];
    if (!all && d->uid != viewer) continue; /* another tenant's key, ranks, activity */
    Mok__GroupSummary *g = &gs[sr.n_groups];
    mok__group_summary__init(g);
    g->group_id = d->group_id;
    g->key = (char *)d->key;
    g->uid = d->uid;
    g->rank = d->rank;
    g->world = d->world;
    g->generation = d->generation;
    g->sequence = d->sequence;
    g->nccl = d->nccl;
    g->sessions = d->sessions;
    g->broken = d->broken;
    g->forming = d->forming;
    gsp[sr.n_groups++] = g;
  }
  sr.groups = gsp;
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.body_case = MOK__REPLY__BODY_STATS;
  reply.stats = &sr;
  send_reply(s, c->request_id, &reply, NULL, 0);
  free(infos);
  free(ptrs);
  free(ginfos);
  free(gptrs);
}

/* The ctx a forward of the layer at max_tokens saves: the wire formula
 * (mok_wire.h), for engines that do not say. */
static uint64_t layer_ctx_bytes(const mok_layer_config *l) {
  if (l->group_id) return mok_group_ctx_bytes(l, l->max_tokens);
  mok_layout_dims d = mok_layer_dims(l, l->max_tokens);
  return mok_ctx_bytes(&d);
}

static void reply_from_engine(session *s, mok_cmd *c) {
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.status = c->status;
  reply.message = c->message;
  if (c->status != MOK_OK) {
    send_reply(s, c->request_id, &reply, NULL, 0);
    return;
  }
  Mok__RegisterBufferReply rb = MOK__REGISTER_BUFFER_REPLY__INIT;
  Mok__CreateLayerReply cl = MOK__CREATE_LAYER_REPLY__INIT;
  Mok__JoinGroupReply jg = MOK__JOIN_GROUP_REPLY__INIT;
  Mok__GroupIdReply gi = MOK__GROUP_ID_REPLY__INIT;
  Mok__LayerCostReply lc = MOK__LAYER_COST_REPLY__INIT;
  switch (c->kind) {
  case MOK_CMD_LAYER_COST:
    lc.layer_bytes = c->out.cost.layer_bytes;
    lc.workspace_bytes = c->out.cost.workspace_bytes;
    lc.ctx_bytes = c->out.cost.ctx_bytes ? c->out.cost.ctx_bytes : layer_ctx_bytes(&c->out.layer);
    lc.row_align = c->out.layer.row_align;
    lc.local_experts = c->out.layer.local_experts;
    lc.first_expert = c->out.layer.first_expert;
    reply.body_case = MOK__REPLY__BODY_LAYER_COST;
    reply.layer_cost = &lc;
    break;
  case MOK_CMD_GROUP_ID:
    gi.nccl_id.data = (uint8_t *)c->out.nccl_id;
    gi.nccl_id.len = MOK_GROUP_NCCL_ID_BYTES;
    reply.body_case = MOK__REPLY__BODY_GROUP_ID;
    reply.group_id = &gi;
    break;
  case MOK_CMD_JOIN_GROUP:
    jg.group_id = c->out.group.id;
    jg.generation = c->out.group.generation;
    jg.local_experts = c->out.group.local_experts;
    jg.first_expert = c->out.group.first_expert;
    jg.rejoined = c->out.group.rejoined;
    jg.sequence = c->out.group.sequence;
    reply.body_case = MOK__REPLY__BODY_JOIN_GROUP;
    reply.join_group = &jg;
    break;
  case MOK_CMD_REGISTER:
    rb.region_id = c->out.region_id;
    reply.body_case = MOK__REPLY__BODY_REGISTER_BUFFER;
    reply.register_buffer = &rb;
    break;
  case MOK_CMD_CREATE_LAYER:
    cl.layer_id = c->layer_id;
    cl.row_align = c->out.layer.row_align;
    cl.local_experts = c->out.layer.local_experts;
    cl.first_expert = c->out.layer.first_expert;
    reply.body_case = MOK__REPLY__BODY_CREATE_LAYER;
    reply.create_layer = &cl;
    break;
  case MOK_CMD_STATS:
    reply_stats(s, c);
    return;
  default:
    break;
  }
  send_reply(s, c->request_id, &reply, NULL, 0);
}

/* Settle the client limits' counts once the engine thread has answered. */
static void settle_counts(session *s, const mok_cmd *c) {
  switch (c->kind) {
  case MOK_CMD_REGISTER:
    s->registering--;
    if (c->status != MOK_OK) count_regions(s, -1, c->in.reg.bytes);
    else /* room was made when it was sent */
      s->recs[s->n_recs++] = (region_rec){c->out.region_id, c->in.reg.bytes};
    break;
  case MOK_CMD_UNREGISTER:
    if (c->status != MOK_OK) break;
    for (size_t i = 0; i < s->n_recs; i++) {
      if (s->recs[i].id != c->in.id) continue;
      count_regions(s, -1, s->recs[i].bytes);
      s->recs[i] = s->recs[--s->n_recs];
      break;
    }
    break;
  case MOK_CMD_CREATE_LAYER:
    if (c->status != MOK_OK) count_layers(s, -1);
    break;
  case MOK_CMD_DESTROY_LAYER:
    if (c->status == MOK_OK) count_layers(s, -1);
    break;
  case MOK_CMD_JOIN_GROUP: {
    s->joining--;
    mok_quota_group *qg = NULL;
    for (qg = s->user->groups; qg && strcmp(qg->key, c->in.join.key) != 0; qg = qg->next) {}
    if (!qg) break; /* cannot be: its reservation keeps it */
    mok_quota_group_settle(qg, c->status == MOK_OK);
    if (c->status == MOK_OK) /* room was made when it was sent */
      s->joins[s->n_joins++] = (join_rec){c->out.group.id, qg};
    break;
  }
  case MOK_CMD_LEAVE_GROUP:
    if (c->status != MOK_OK) break;
    for (size_t i = 0; i < s->n_joins; i++) {
      if (s->joins[i].group_id != c->in.id) continue;
      mok_quota_group_drop(&s->srv->quota, s->joins[i].quota, true, mok_clock_ms());
      s->joins[i] = s->joins[--s->n_joins];
      break;
    }
    break;
  default:
    break;
  }
}

static void on_engine_done(uv_async_t *h) {
  server *srv = h->data;
  mok_cmd *c = mok_engine_thread_take_done(srv->engine);
  while (c) {
    mok_cmd *next = c->next;
    session *s = find_session(srv, c->session_id);
    if (c->kind == MOK_CMD_SESSION_FAULT) {
      if (s) protocol_error(s, 0, MOK_EPROTO, c->message);
    } else if (s) {
      s->pending--;
      settle_counts(s, c);
      mok_metrics_command_done(srv->metrics, c);
      if (c->kind == MOK_CMD_ATTACH) {
        if (c->status != MOK_OK) {
          s->attached = false;
          session_close(s, c->message);
        }
      } else if (c->kind != MOK_CMD_DETACH && !s->closing) {
        reply_from_engine(s, c);
      }
      session_maybe_free(s);
    }
    if (c->kind == MOK_CMD_STATS && c->session_id == 0) /* the metrics endpoint's */
      mok_metrics_server_engine_stats(srv->metrics_srv, c->status, &c->out.stats);
    if (c->kind == MOK_CMD_STATS) {
      free(c->out.stats.sessions);
      free(c->out.stats.groups);
    }
    free(c);
    c = next;
  }
}

static void wake_loop(void *arg) {
  server *srv = arg;
  uv_async_send(&srv->engine_done);
}

/* ---- start and stop ----------------------------------------------------------- */

static int make_listen_socket(server *srv) {
  const char *path = srv->cfg.socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) {
    log_error("socket path too long (%zu bytes, at most %zu): %s", strlen(path),
              sizeof addr.sun_path - 1, path);
    return -1;
  }
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    log_error("socket: %s", strerror(errno));
    return -1;
  }
  struct stat st;
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      log_error("%s exists and is not a socket; refusing to replace it", path);
      close(fd);
      return -1;
    }
    /* a stale socket is replaced; a live daemon's is not */
    int probe = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof addr) == 0) {
      close(probe);
      close(fd);
      log_error("another mokd is serving %s", path);
      return -1;
    }
    if (probe >= 0) close(probe);
    unlink(path);
  }
  gid_t gid = (gid_t)-1;
  if (srv->cfg.socket_group) {
    struct group gr, *found = NULL;
    char buf[4096];
    int e = getgrnam_r(srv->cfg.socket_group, &gr, buf, sizeof buf, &found);
    if (!found) {
      log_error("socket-group %s: %s", srv->cfg.socket_group,
                e ? strerror(e) : "no such group");
      close(fd);
      return -1;
    }
    gid = gr.gr_gid;
  }
  /* bind with a umask that leaves no more than socket-mode, so the socket
   * is never reachable with wider permissions, not even for a moment */
  mode_t old = umask(0777 & ~srv->cfg.socket_mode);
  int r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  umask(old);
  if (r < 0) {
    log_error("cannot listen on %s: %s", path, strerror(errno));
    close(fd);
    return -1;
  }
  srv->own_socket_path = true;
  if ((gid != (gid_t)-1 && lchown(path, (uid_t)-1, gid) < 0) ||
      chmod(path, srv->cfg.socket_mode) < 0 || listen(fd, 128) < 0) {
    log_error("cannot set up %s (group %s, mode %04o): %s", path,
              srv->cfg.socket_group ? srv->cfg.socket_group : "unchanged",
              (unsigned)srv->cfg.socket_mode, strerror(errno));
    unlink(path);
    srv->own_socket_path = false;
    close(fd);
    return -1;
  }
  return fd;
}

/* Close whatever handle is still open (the failure paths of start-up). */
static void close_walk_cb(uv_handle_t *h, void *arg) {
  (void)arg;
  if (!uv_is_closing(h)) uv_close(h, NULL);
}

static void begin_shutdown(server *srv, const char *why) {
  if (srv->stopping) return;
  srv->stopping = true;
  log_info("%s: shutting down (draining queued jobs for at most %u ms)", why, srv->cfg.drain_ms);
  sd_notify(0, "STOPPING=1\nSTATUS=draining jobs");
  uv_poll_stop(&srv->listen_poll);
  if (srv->own_socket_path) unlink(srv->cfg.socket_path);
  /* the engine drains what clients already queued, then stops */
  mok_engine_thread_stop(srv->engine, srv->cfg.drain_ms);
  srv->engine = NULL;
  mok_metrics_server_stop(srv->metrics_srv);
  srv->metrics_srv = NULL;
  for (session *s = srv->sessions, *next; s; s = next) {
    next = s->next;
    s->attached = false; /* the engine released everything already */
    s->pending = 0;
    /* a session already closing may have closed its handles while waiting
     * for its detach, which will never come back now: free it here */
    if (s->closing) session_maybe_free(s);
    else session_close(s, NULL);
  }
  uv_close((uv_handle_t *)&srv->listen_poll, NULL);
  uv_close((uv_handle_t *)&srv->sigterm, NULL);
  uv_close((uv_handle_t *)&srv->sigint, NULL);
  uv_close((uv_handle_t *)&srv->engine_done, NULL);
  if (srv->watchdog_on) uv_close((uv_handle_t *)&srv->watchdog, NULL);
}

/* systemd's watchdog: ping from the loop at half the interval, so a stuck
 * loop gets the service restarted. */
static void on_watchdog(uv_timer_t *t) {
  (void)t;
  sd_notify(0, "WATCHDOG=1");
}

static void start_watchdog(server *srv) {
  uint64_t usec = 0;
  if (sd_watchdog_enabled(0, &usec) <= 0 || usec == 0) return;
  uint64_t every_ms = usec / 2000u ? usec / 2000u : 1;
  uv_timer_init(srv->loop, &srv->watchdog);
  uv_timer_start(&srv->watchdog, on_watchdog, 0, every_ms);
  srv->watchdog_on = true;
  log_info("systemd watchdog: pinging every %llu ms", (unsigned long long)every_ms);
}

static void on_signal(uv_signal_t *h, int signum) {
  begin_shutdown(h->data, signum == SIGTERM ? "SIGTERM" : "SIGINT");
}

/* vm.max_map_count (0: unknown). */
static uint32_t max_map_count(void) {
  FILE *f = fopen("/proc/sys/vm/max_map_count", "re");
  unsigned long v = 0;
  if (f) {
    if (fscanf(f, "%lu", &v) != 1) v = 0;
    fclose(f);
  }
  return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
}

/* The client limits as the loop enforces them; warn about settings that
 * let one tenant exhaust the daemon for the others. */
static void set_up_limits(server *srv) {
  mok_server_config *cfg = &srv->cfg;
  /* regions are mappings: keep half of vm.max_map_count for the sessions'
   * rings, the engine and the libraries, so that a Hello never fails */
  uint32_t maps = max_map_count();
  if (maps && (cfg->max_regions_total == 0 || cfg->max_regions_total > maps / 2)) {
    log_warn("max-regions-total %u is %s half of vm.max_map_count (%u): using %u, so that "
             "sessions can always map their rings",
             cfg->max_regions_total, cfg->max_regions_total ? "more than" : "no limit, not",
             maps, maps / 2);
    cfg->max_regions_total = maps / 2;
  }
  if (cfg->session_reserve >= cfg->max_sessions)
    log_warn("session-reserve %u leaves none of max-sessions %u for a uid's second session",
             cfg->session_reserve, cfg->max_sessions);
  if (!cfg->max_sessions_per_uid || cfg->max_sessions_per_uid > cfg->max_sessions - cfg->session_reserve)
    log_warn("max-sessions-per-uid %u lets one uid take every session slot but the reserve",
             cfg->max_sessions_per_uid);
  if (cfg->max_regions_total &&
      (!cfg->max_regions_per_uid || cfg->max_regions_per_uid >= cfg->max_regions_total))
    log_warn("max-regions-per-uid %u lets one uid take every region of max-regions-total %u",
             cfg->max_regions_per_uid, cfg->max_regions_total);
  /* group-linger-ms, or MOK_GROUP_LINGER_MS standing in for it (config.c) */
  uint32_t linger =
      cfg->engine_cfg.group_linger_set ? cfg->engine_cfg.group_linger_ms : MOK_GROUP_LINGER_MS;
  srv->quota.lim = (mok_quota_limits){
      .max_regions_total = cfg->max_regions_total,
      .max_regions_per_uid = cfg->max_regions_per_uid,
      .max_region_bytes_per_uid = cfg->max_region_bytes_per_uid,
      .max_layers_per_uid = cfg->max_layers_per_uid,
      .max_groups_per_uid = cfg->max_groups_per_uid,
      .max_group_bytes_per_uid = cfg->max_group_bytes_per_uid,
      .group_linger_ms = linger};
}

/* The group segments' directory: fit for use, stale segments gone. A
 * directory that is not fit leaves groups on this host refused (each join
 * says why), everything else served. */
static void set_up_group_dir(const server *srv) {
  const char *dir = mok_ep_group_dir_of(srv->cfg.engine_cfg.group_dir);
  char err[512];
  unsigned removed = 0;
  if (mok_ep_group_dir_sweep(dir, &removed, err, sizeof err) != MOK_OK) {
    log_warn("%s; expert-parallel groups on this host will be refused until it is fixed", err);
    return;
  }
  if (removed) log_info("group-dir %s: removed %u stale or foreign segment(s)", dir, removed);
}

/* ---- the metrics endpoint's view (daemon/metrics_server.h) ---------------------- */

static bool metrics_request_stats(void *arg) {
  server *srv = arg;
  if (!srv->engine || srv->stopping) return false;
  mok_cmd *c = calloc(1, sizeof *c);
  if (!c) return false;
  c->kind = MOK_CMD_STATS; /* session 0: the endpoint's (session ids start at 1) */
  mok_engine_thread_submit(srv->engine, c);
  return true;
}

static bool metrics_is_admin(void *arg, int fd, const struct ucred *cr) {
  return peer_is_admin(arg, fd, cr);
}

static void metrics_page_info(void *arg, mok_metrics_page_info *info) {
  server *srv = arg;
  info->version = MOK_VERSION;
  info->engine = srv->engine ? mok_engine_thread_engine_name(srv->engine) : "";
  info->device = srv->engine ? mok_engine_thread_describe(srv->engine) : "";
  info->uptime_ms = mok_clock_ms() - srv->start_ms;
  info->connections = srv->n_sessions;
}

int mok_server_run(const mok_server_config *cfg) {
  server srv = {.cfg = *cfg, .listen_fd = -1};
  char err[256];
  int exit_code = 1;
  signal(SIGPIPE, SIG_IGN);
  set_up_limits(&srv);
  set_up_group_dir(&srv);
  srv.loop = uv_default_loop();
  srv.start_ms = mok_clock_ms();
  srv.epoch = ((uint64_t)time(NULL) << 20) ^ (uint64_t)getpid();
  srv.rxbuf = malloc(RXBUF_BYTES);
  if (!srv.rxbuf) return 1;
  const mok_engine_ops *ops = mok_engine_find(cfg->engine);
  if (!ops) {
    log_error("engine \"%s\" is not available in this build (have: cpu%s)", cfg->engine,
              mok_engine_find("cuda") ? ", cuda" : "");
    goto out;
  }
  uv_async_init(srv.loop, &srv.engine_done, on_engine_done);
  srv.engine_done.data = &srv;
  if (mok_engine_thread_start(ops, &cfg->engine_cfg, wake_loop, &srv, &srv.engine, err,
                              sizeof err) != MOK_OK) {
    log_error("cannot start the %s engine: %s", cfg->engine, err);
    goto out;
  }
  /* before the socket exists, so a SIGTERM never finds us without a handler */
  uv_signal_init(srv.loop, &srv.sigterm);
  uv_signal_init(srv.loop, &srv.sigint);
  srv.sigterm.data = srv.sigint.data = &srv;
  uv_signal_start(&srv.sigterm, on_signal, SIGTERM);
  uv_signal_start(&srv.sigint, on_signal, SIGINT);
  if (cfg->metrics.listen || cfg->metrics.socket_path)
    srv.metrics = mok_metrics_create(cfg->metrics.max_label_sets, cfg->metrics.per_uid);
  const mok_metrics_hooks hooks = {.arg = &srv, .request_stats = metrics_request_stats,
                                   .is_admin = metrics_is_admin, .page_info = metrics_page_info};
  if (mok_metrics_server_start(srv.loop, &cfg->metrics, srv.metrics, &hooks, &srv.metrics_srv) < 0) {
    mok_engine_thread_stop(srv.engine, 0);
    goto out;
  }
  srv.listen_fd = cfg->listen_fd >= 0 ? cfg->listen_fd : make_listen_socket(&srv);
  if (srv.listen_fd < 0) {
    mok_engine_thread_stop(srv.engine, 0);
    mok_metrics_server_stop(srv.metrics_srv);
    srv.metrics_srv = NULL;
    goto out;
  }
  uv_poll_init(srv.loop, &srv.listen_poll, srv.listen_fd);
  srv.listen_poll.data = &srv;
  uv_poll_start(&srv.listen_poll, UV_READABLE, on_listen_readable);
  log_info("mokd %s serving %s with the %s engine (%s)", MOK_VERSION, cfg->socket_path,
           ops->name, mok_engine_thread_describe(srv.engine));
  sd_notifyf(0, "READY=1\nSTATUS=serving %s (%s engine)", cfg->socket_path, ops->name);
  start_watchdog(&srv);
  uv_run(srv.loop, UV_RUN_DEFAULT);
  exit_code = 0;
out:
  if (srv.listen_fd >= 0) close(srv.listen_fd);
  uv_walk(srv.loop, close_walk_cb, NULL);
  uv_run(srv.loop, UV_RUN_DEFAULT);
  uv_loop_close(srv.loop);
  mok_quota_free(&srv.quota); /* groups still lingering (the engine left them) */
  mok_metrics_free(srv.metrics); /* the engine, which counted into it, is stopped */
  free(srv.rxbuf);
  log_info("mokd stopped");
  return exit_code;
}
