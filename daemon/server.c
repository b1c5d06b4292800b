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

#include "frame.h"
#include "layer.h"
#include "log.h"
#include "mok.pb-c.h"
#include "mok_status.h"
#include "region.h"
#include "request.h"

/* What one uid holds across all its sessions (the per-uid quotas). Regions
 * and layers are counted when their request is sent to the engine thread
 * (reserved), un-counted when it fails or when they are released; a dead
 * session's share is released once the engine thread has detached it, i.e.
 * once its memory is really unmapped. */
typedef struct uid_usage {
  uid_t uid;
  uint32_t sessions;
  uint32_t regions;
  uint64_t region_bytes;
  uint32_t layers;
  struct uid_usage *next;
} uid_usage;

typedef struct region_rec {
  uint32_t id;
  uint64_t bytes;
} region_rec;

/* Loop-side half of a session: the socket, identity, protocol state. The
 * engine-side half (rings, regions, layers) lives on the engine thread. */
typedef struct session {
  struct server *srv;
  uint64_t id;
  int fd;
  uv_poll_t poll;
  uv_timer_t hello_timer;
  struct ucred cred;
  char name[64];
  bool hello_done;
  bool attached;
  bool closing;
  int open_handles;  /* poll and timer; freed when both closed and no cmd pending */
  uint32_t pending;  /* engine commands not yet back */
  uid_usage *user;   /* this session's uid: what it holds counts there */
  uint32_t regions, layers; /* this session's share of user's counts */
  uint64_t region_bytes;
  region_rec *recs;  /* registered regions, for unregister */
  size_t n_recs, cap_recs;
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
  session *sessions;
  uid_usage *users;
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

static uint64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

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
  uid_usage *u = s->user;
  u->sessions--;
  u->regions -= s->regions;
  u->region_bytes -= s->region_bytes;
  u->layers -= s->layers;
  if (u->sessions == 0) {
    for (uid_usage **p = &srv->users; *p; p = &(*p)->next) {
      if (*p != u) continue;
      *p = u->next;
      break;
    }
    free(u);
  }
  free(s->recs);
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
    mok_cmd *c = new_cmd(s, MOK_CMD_DETACH, 0);
    if (c) submit_cmd(s, c); /* its mappings go once the engine is done with them */
    else log_error("out of memory detaching session %llu", (unsigned long long)s->id);
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
  int r = mok_session_shm_create(&c->in.attach.shm);
  if (r < 0) {
    free(c);
    char why[128];
    snprintf(why, sizeof why, "cannot create the session's shared memory: %s", strerror(-r));
    protocol_error(s, rid, MOK_ENOMEM, why);
    return;
  }
  c->in.attach.limits = s->srv->cfg.limits;
  c->in.attach.uid = (uint32_t)s->cred.uid;
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

/* Per-uid quotas: refuse (ELIMIT, the session stays) what would exceed one. */
static bool uid_quota_refuses(session *s, uint32_t rid, uint32_t regions, uint64_t bytes,
                              uint32_t layers) {
  const mok_server_config *cfg = &s->srv->cfg;
  const uid_usage *u = s->user;
  if (regions && cfg->max_regions_per_uid && u->regions + regions > cfg->max_regions_per_uid) {
    reply_status(s, rid, MOK_ELIMIT,
                 "uid %u already has %u regions across its sessions (max-regions-per-uid %u)",
                 (unsigned)u->uid, u->regions, cfg->max_regions_per_uid);
    return true;
  }
  if (bytes && cfg->max_region_bytes_per_uid &&
      bytes > cfg->max_region_bytes_per_uid - u->region_bytes) {
    reply_status(s, rid, MOK_ELIMIT,
                 "registering %llu bytes would exceed the quota of uid %u: %llu bytes in use "
                 "across its sessions (max-region-bytes-per-uid %llu)",
                 (unsigned long long)bytes, (unsigned)u->uid,
                 (unsigned long long)u->region_bytes,
                 (unsigned long long)cfg->max_region_bytes_per_uid);
    return true;
  }
  if (layers && cfg->max_layers_per_uid && u->layers + layers > cfg->max_layers_per_uid) {
    reply_status(s, rid, MOK_ELIMIT,
                 "uid %u already has %u layers across its sessions (max-layers-per-uid %u)",
                 (unsigned)u->uid, u->layers, cfg->max_layers_per_uid);
    return true;
  }
  return false;
}

static void count_regions(session *s, int sign, uint64_t bytes) {
  s->regions += (uint32_t)sign, s->user->regions += (uint32_t)sign;
  if (sign > 0) s->region_bytes += bytes, s->user->region_bytes += bytes;
  else s->region_bytes -= bytes, s->user->region_bytes -= bytes;
}

static void count_layers(session *s, int sign) {
  s->layers += (uint32_t)sign, s->user->layers += (uint32_t)sign;
}

static void handle_register(session *s, uint32_t rid, const mok_request *q, mok_frame *f) {
  const Mok__RegisterBuffer *m = q->pb->register_buffer;
  if (uid_quota_refuses(s, rid, 1, m->bytes, 0)) {
    mok_frame_close_fds(f);
    return;
  }
  mok_cmd *c = new_cmd(s, MOK_CMD_REGISTER, rid);
  if (!c) {
    mok_frame_close_fds(f);
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
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
  if (uid_quota_refuses(s, rid, 0, 0, 1)) return;
  mok_cmd *c = new_cmd(s, MOK_CMD_CREATE_LAYER, rid);
  if (!c) {
    reply_status(s, rid, MOK_ENOMEM, "out of memory");
    return;
  }
  c->in.layer = q->layer;
  count_layers(s, +1);
  submit_cmd(s, c);
}

/* Expert parallelism: the group is keyed by (the client's uid, key), so two
 * tenants never share one (docs/ep.md). */
static void handle_join_group(session *s, uint32_t rid, const Mok__JoinGroup *m) {
  mok_cmd *c = new_cmd(s, MOK_CMD_JOIN_GROUP, rid);
  if (!c) {
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

/* allow-uids / allow-gids against the peer's credentials (its supplementary
 * groups too, through SO_PEERGROUPS). No list: everyone who can open the
 * socket (its mode and group are the outer gate). */
static bool peer_allowed(const server *srv, int fd, const struct ucred *cr) {
  const mok_server_config *cfg = &srv->cfg;
  if (cfg->n_allow_uids == 0 && cfg->n_allow_gids == 0) return true;
  if (id_listed(cfg->allow_uids, cfg->n_allow_uids, cr->uid)) return true;
  if (cfg->n_allow_gids == 0) return false;
  if (id_listed(cfg->allow_gids, cfg->n_allow_gids, cr->gid)) return true;
  gid_t small[64], *groups = small;
  socklen_t len = sizeof small;
  bool ok = false;
  int r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  if (r < 0 && errno == ERANGE && len > 0 && (groups = malloc(len)) != NULL)
    r = getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len);
  if (r == 0)
    for (size_t i = 0; i < len / sizeof(gid_t) && !ok; i++)
      ok = id_listed(cfg->allow_gids, cfg->n_allow_gids, groups[i]);
  if (groups != small) free(groups);
  return ok;
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
  Mok__Reply reply = MOK__REPLY__INIT;
  reply.status = status;
  reply.message = msg;
  uint8_t buf[512];
  if (mok__reply__get_packed_size(&reply) <= sizeof buf) {
    size_t n = mok__reply__pack(&reply, buf);
    (void)mok_frame_send(fd, 0, buf, n, NULL, 0); /* non-blocking: best effort */
  }
  close(fd);
  uint64_t now = now_ms();
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

static uid_usage *find_user(server *srv, uid_t uid) {
  for (uid_usage *u = srv->users; u; u = u->next)
    if (u->uid == uid) return u;
  return NULL;
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
    if (srv->n_sessions >= srv->cfg.max_sessions) {
      refuse_connection(srv, fd, &cred, MOK_ELIMIT, "mokd has %u sessions already (max-sessions)",
                        srv->n_sessions);
      continue;
    }
    uid_usage *u = find_user(srv, cred.uid);
    if (u && srv->cfg.max_sessions_per_uid && u->sessions >= srv->cfg.max_sessions_per_uid) {
      refuse_connection(srv, fd, &cred, MOK_ELIMIT,
                        "uid %d has %u sessions already (max-sessions-per-uid)", (int)cred.uid,
                        u->sessions);
      continue;
    }
    session *s = calloc(1, sizeof *s);
    if (!u && s && (u = calloc(1, sizeof *u)) != NULL) {
      u->uid = cred.uid;
      u->next = srv->users;
      srv->users = u;
    }
    if (!s || !u) {
      free(s);
      close(fd);
      continue;
    }
    u->sessions++;
    s->user = u;
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

static void reply_stats(session *s, mok_cmd *c) {
  server *srv = s->srv;
  mok_engine_stats *st = &c->out.stats;
  Mok__StatsReply sr = MOK__STATS_REPLY__INIT;
  sr.daemon_version = MOK_VERSION;
  sr.device = (char *)mok_engine_thread_describe(srv->engine);
  sr.engine = (char *)mok_engine_thread_engine_name(srv->engine);
  sr.uptime_ms = now_ms() - srv->start_ms;
  sr.jobs_done = st->jobs_done;
  sr.jobs_failed = st->jobs_failed;
  sr.sessions_total = srv->sessions_total;
  sr.job_latency_p50_ns = st->latency_p50_ns;
  sr.job_latency_p99_ns = st->latency_p99_ns;
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
  for (size_t i = 0; i < st->n_sessions; i++) {
    const mok_session_stats *ss = &st->sessions[i];
    session *peer = find_session(srv, ss->session_id);
    mok__session_info__init(&infos[i]);
    infos[i].session_id = ss->session_id;
    infos[i].client_name = peer ? peer->name : "";
    infos[i].uid = peer ? (uint32_t)peer->cred.uid : 0;
    infos[i].pid = peer ? (uint32_t)peer->cred.pid : 0;
    infos[i].regions = ss->regions;
    infos[i].region_bytes = ss->region_bytes;
    infos[i].layers = ss->layers;
    infos[i].jobs_done = ss->jobs_done;
    infos[i].jobs_failed = ss->jobs_failed;
    Mok__GroupInfo *gi = &ginfos[i * MOK_STATS_GROUPS_MAX];
    Mok__GroupInfo **gp = &gptrs[i * MOK_STATS_GROUPS_MAX];
    for (uint32_t k = 0; k < ss->n_groups; k++) {
      mok__group_info__init(&gi[k]);
      gi[k].group_id = ss->groups[k].group_id;
      gi[k].rank = ss->groups[k].rank;
      gi[k].world = ss->groups[k].world;
      gi[k].generation = ss->groups[k].generation;
      gi[k].sequence = ss->groups[k].sequence;
      gp[k] = &gi[k];
    }
    infos[i].n_groups = ss->n_groups;
    infos[i].groups = gp;
    ptrs[i] = &infos[i];
  }
  sr.n_sessions = st->n_sessions;
  sr.sessions = ptrs;
  Mok__GroupSummary gs[MOK_STATS_DAEMON_GROUPS_MAX], *gsp[MOK_STATS_DAEMON_GROUPS_MAX];
  for (size_t k = 0; k < st->n_groups && k < MOK_STATS_DAEMON_GROUPS_MAX; k++) {
    const mok_daemon_group_stats *d = &st->groups[k];
    mok__group_summary__init(&gs[k]);
    gs[k].group_id = d->group_id;
    gs[k].key = (char *)d->key;
    gs[k].uid = d->uid;
    gs[k].rank = d->rank;
    gs[k].world = d->world;
    gs[k].generation = d->generation;
    gs[k].sequence = d->sequence;
    gs[k].nccl = d->nccl;
    gs[k].sessions = d->sessions;
    gs[k].broken = d->broken;
    gs[k].forming = d->forming;
    gsp[k] = &gs[k];
    sr.n_groups++;
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
  switch (c->kind) {
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

/* Settle the per-uid counts once the engine thread has answered. */
static void settle_counts(session *s, const mok_cmd *c) {
  switch (c->kind) {
  case MOK_CMD_REGISTER:
    if (c->status != MOK_OK) {
      count_regions(s, -1, c->in.reg.bytes);
    } else {
      if (s->n_recs == s->cap_recs) {
        size_t cap = s->cap_recs ? 2 * s->cap_recs : 16;
        region_rec *n = realloc(s->recs, cap * sizeof *n);
        if (!n) break; /* then it stays counted until the session ends */
        s->recs = n, s->cap_recs = cap;
      }
      s->recs[s->n_recs++] = (region_rec){c->out.region_id, c->in.reg.bytes};
    }
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

int mok_server_run(const mok_server_config *cfg) {
  server srv = {.cfg = *cfg, .listen_fd = -1};
  char err[256];
  int exit_code = 1;
  signal(SIGPIPE, SIG_IGN);
  srv.loop = uv_default_loop();
  srv.start_ms = now_ms();
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
  srv.listen_fd = cfg->listen_fd >= 0 ? cfg->listen_fd : make_listen_socket(&srv);
  if (srv.listen_fd < 0) {
    mok_engine_thread_stop(srv.engine, 0);
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
  free(srv.rxbuf);
  log_info("mokd stopped");
  return exit_code;
}
