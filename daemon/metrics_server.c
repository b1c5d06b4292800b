/* SPDX-License-Identifier: Apache-2.0 */
#include "metrics_server.h"

#include <errno.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "http.h"
#include "log.h"
#include "mok_status.h"

#define BACKLOG 64
#define PAGE_TYPE "text/plain; version=0.0.4; charset=utf-8"
#define TEXT_TYPE "text/plain; charset=utf-8"

/* One rendered page, shared by every scraper that waited for it. */
typedef struct shared_page {
  uint32_t refs;
  size_t len;
  char *data;
} shared_page;

typedef enum conn_state {
  C_READING, /* the request is coming in */
  C_WAITING, /* for the engine's stats */
  C_WRITING, /* the response */
  C_DRAINING /* response sent and shut down: reading to EOF, then close */
} conn_state;

typedef union stream_handle {
  uv_handle_t handle;
  uv_stream_t stream;
  uv_tcp_t tcp;
  uv_pipe_t pipe;
} stream_handle;

typedef struct conn {
  struct mok_metrics_server *srv;
  stream_handle h;
  uv_timer_t timer;
  int open_handles;
  bool closing, unix_peer, admin;
  conn_state state;
  size_t len;
  char buf[MOK_HTTP_MAX_REQUEST];
  char head[512]; /* the response head, and an error's short body after it */
  size_t head_len, body_len;
  shared_page *page;
  uv_write_t wr;
  uv_shutdown_t sd;
  struct conn *next;
} conn;

/* A connection over metrics-max-connections: accepted only to be closed. */
typedef struct reject {
  struct mok_metrics_server *srv;
  stream_handle h;
} reject;

struct mok_metrics_server {
  uv_loop_t *loop;
  mok_metrics_config cfg;
  mok_metrics *m;
  mok_metrics_hooks hooks;
  stream_handle tcp, pipe;
  bool tcp_on, pipe_on;
  bool tcp_paused, pipe_paused; /* a connection left unaccepted (out of memory) */
  char socket_path[sizeof(((struct sockaddr_un *)0)->sun_path)];
  bool own_path;
  conn *conns;
  uint32_t n_conns;
  uint32_t open; /* listeners and rejects still open */
  bool stats_in_flight;
  bool stopping;
};

static void on_connection(uv_stream_t *listener, int status);

static void maybe_free(mok_metrics_server *s) {
  if (s->stopping && s->open == 0 && s->n_conns == 0) free(s);
}

static void on_listener_closed(uv_handle_t *h) {
  mok_metrics_server *s = h->data;
  s->open--;
  maybe_free(s);
}

/* ---- connections --------------------------------------------------------------- */

static void page_release(shared_page *p) {
  if (p && --p->refs == 0) {
    free(p->data);
    free(p);
  }
}

static void on_conn_closed(uv_handle_t *h) {
  conn *c = h->data;
  if (--c->open_handles > 0) return;
  mok_metrics_server *s = c->srv;
  for (conn **p = &s->conns; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  s->n_conns--;
  page_release(c->page);
  free(c);
  /* a connection left waiting for want of memory gets its turn now */
  if (!s->stopping && s->tcp_paused) {
    s->tcp_paused = false;
    on_connection(&s->tcp.stream, 0);
  }
  if (!s->stopping && s->pipe_paused) {
    s->pipe_paused = false;
    on_connection(&s->pipe.stream, 0);
  }
  maybe_free(s);
}

static void conn_close(conn *c) {
  if (c->closing) return;
  c->closing = true;
  uv_close(&c->h.handle, on_conn_closed);
  uv_close((uv_handle_t *)&c->timer, on_conn_closed);
}

static void on_drain_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  conn *c = h->data;
  (void)hint;
  *buf = uv_buf_init(c->buf, sizeof c->buf);
}

/* After the response: whatever the client still sends is read and dropped
 * until it closes (closing with unread bytes would reset the connection
 * and could destroy the response on its way); the timer bounds it. */
static void on_drain_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  conn *c = st->data;
  (void)buf;
  if (nread < 0) conn_close(c);
}

static void on_shutdown(uv_shutdown_t *req, int status) {
  conn *c = req->data;
  if (c->closing) return;
  if (status < 0) {
    conn_close(c);
    return;
  }
  c->state = C_DRAINING;
  if (uv_read_start(&c->h.stream, on_drain_alloc, on_drain_read) < 0) conn_close(c);
}

static void on_written(uv_write_t *req, int status) {
  conn *c = req->data;
  if (c->closing) return;
  if (status < 0 || uv_shutdown(&c->sd, &c->h.stream, on_shutdown) < 0) conn_close(c);
}

/* Send status with either the shared page or a short text body. */
static void respond(conn *c, int status, shared_page *page, const char *text) {
  if (c->closing) return;
  uv_read_stop(&c->h.stream);
  c->state = C_WRITING;
  size_t body = page ? page->len : strlen(text) + 1; /* text and a newline */
  c->head_len = mok_http_response_head(c->head, sizeof c->head, status,
                                       page ? PAGE_TYPE : TEXT_TYPE, body);
  uv_buf_t bufs[2];
  int n = 1;
  if (page) {
    c->page = page;
    page->refs++;
    bufs[1] = uv_buf_init(page->data, (unsigned)page->len);
    n = 2;
  } else if (c->head_len && c->head_len + body <= sizeof c->head) {
    memcpy(c->head + c->head_len, text, body - 1);
    c->head[c->head_len + body - 1] = '\n';
    c->head_len += body;
  } else {
    c->head_len = 0;
  }
  if (c->head_len == 0) { /* cannot be: heads and texts are short */
    conn_close(c);
    return;
  }
  bufs[0] = uv_buf_init(c->head, (unsigned)c->head_len);
  c->wr.data = c;
  c->sd.data = c;
  if (uv_write(&c->wr, &c->h.stream, bufs, (unsigned)n, on_written) < 0) {
    conn_close(c);
    return;
  }
  mok_metrics_http_answered(c->srv->m, status);
}

/* The last word on a connection that ran out of time: one non-blocking try
 * at a short response, then close. */
static void on_conn_timeout(uv_timer_t *t) {
  conn *c = t->data;
  mok_metrics_http_timed_out(c->srv->m);
  if (c->state == C_READING || c->state == C_WAITING) {
    int status = c->state == C_READING ? 408 : 503;
    const char *text = c->state == C_READING ? "no complete request within metrics-timeout-ms"
                                             : "the engine did not answer within metrics-timeout-ms";
    char msg[512];
    size_t n = mok_http_response_head(msg, sizeof msg, status, TEXT_TYPE, strlen(text) + 1);
    if (n && n + strlen(text) + 1 < sizeof msg) {
      n += (size_t)snprintf(msg + n, sizeof msg - n, "%s\n", text);
      uv_buf_t b = uv_buf_init(msg, (unsigned)n);
      if (uv_try_write(&c->h.stream, &b, 1) == (int)n) mok_metrics_http_answered(c->srv->m, status);
    }
  }
  conn_close(c);
}

static void wait_for_stats(conn *c) {
  mok_metrics_server *s = c->srv;
  uv_read_stop(&c->h.stream);
  c->state = C_WAITING;
  if (s->stats_in_flight) return; /* its answer serves this one too */
  if (s->hooks.request_stats(s->hooks.arg)) s->stats_in_flight = true;
  else respond(c, 503, NULL, "mokd cannot ask its engine now");
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf) {
  conn *c = h->data;
  (void)hint;
  /* never more than the request cap: a full buffer was refused already */
  *buf = uv_buf_init(c->buf + c->len, (unsigned)(sizeof c->buf - c->len));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf) {
  conn *c = st->data;
  (void)buf;
  if (c->closing || c->state != C_READING) return;
  if (nread < 0) { /* gone (or no room: cannot be) before a whole request */
    conn_close(c);
    return;
  }
  c->len += (size_t)nread;
  mok_http_request req;
  switch (mok_http_parse(c->buf, c->len, &req)) {
  case MOK_HTTP_NEED_MORE: return;
  case MOK_HTTP_ERROR: respond(c, req.status, NULL, req.why); return;
  case MOK_HTTP_DONE: break;
  }
  if (strcmp(req.path, "/metrics") != 0) respond(c, 404, NULL, "not found: the page is /metrics");
  else wait_for_stats(c);
}

static int stream_init(mok_metrics_server *s, uv_stream_t *listener, stream_handle *h, void *data) {
  int r = listener == &s->pipe.stream ? uv_pipe_init(s->loop, &h->pipe, 0)
                                      : uv_tcp_init(s->loop, &h->tcp);
  h->handle.data = data;
  return r;
}

static void on_reject_closed(uv_handle_t *h) {
  reject *r = h->data;
  mok_metrics_server *s = r->srv;
  free(r);
  s->open--;
  maybe_free(s);
}

static void on_connection(uv_stream_t *listener, int status) {
  mok_metrics_server *s = listener->data;
  if (status < 0) {
    log_warn("metrics endpoint: accept: %s", uv_strerror(status));
    return;
  }
  if (s->stopping) return;
  bool is_pipe = listener == &s->pipe.stream;
  if (s->n_conns >= s->cfg.max_connections) {
    reject *r = calloc(1, sizeof *r);
    if (!r || stream_init(s, listener, &r->h, r) < 0) {
      free(r);
      goto pause;
    }
    r->srv = s;
    s->open++;
    (void)uv_accept(listener, &r->h.stream); /* taken, to be closed at once */
    mok_metrics_http_over_cap(s->m);
    uv_close(&r->h.handle, on_reject_closed);
    return;
  }
  conn *c = calloc(1, sizeof *c);
  if (!c || stream_init(s, listener, &c->h, c) < 0) {
    free(c);
    goto pause;
  }
  c->srv = s;
  c->unix_peer = is_pipe;
  c->open_handles = 2;
  uv_timer_init(s->loop, &c->timer);
  c->timer.data = c;
  c->next = s->conns;
  s->conns = c;
  s->n_conns++;
  int r = uv_accept(listener, &c->h.stream);
  if (r < 0) {
    log_warn("metrics endpoint: accept: %s", uv_strerror(r));
    conn_close(c);
    return;
  }
  uv_timer_start(&c->timer, on_conn_timeout, s->cfg.timeout_ms, 0);
  if (is_pipe) {
    /* the Unix socket tells who connects: only those who see every tenant */
    uv_os_fd_t fd;
    struct ucred cr;
    socklen_t len = sizeof cr;
    c->admin = uv_fileno(&c->h.handle, &fd) == 0 &&
               getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &len) == 0 &&
               s->hooks.is_admin(s->hooks.arg, fd, &cr);
    if (!c->admin) {
      respond(c, 403, NULL,
              "only root, mokd's uid and admin-uids/admin-gids may read these metrics");
      return;
    }
  }
  if (uv_read_start(&c->h.stream, on_alloc, on_read) < 0) conn_close(c);
  return;
pause:
  /* libuv keeps the connection queued and stops accepting until we take it */
  log_warn("metrics endpoint: out of memory; the next connection waits");
  if (is_pipe) s->pipe_paused = true;
  else s->tcp_paused = true;
}

/* ---- the engine's answer -------------------------------------------------------- */

void mok_metrics_server_engine_stats(mok_metrics_server *s, int status,
                                     const mok_engine_stats *st) {
  if (!s) return;
  s->stats_in_flight = false;
  if (s->stopping) return;
  uint32_t waiting = 0;
  for (conn *c = s->conns; c; c = c->next) waiting += !c->closing && c->state == C_WAITING;
  if (!waiting) return;
  shared_page *page = NULL;
  const char *why = "the engine could not gather its stats";
  int code = 503;
  if (status == MOK_OK) {
    mok_metrics_page_info info = {0};
    s->hooks.page_info(s->hooks.arg, &info);
    info.http_connections = s->n_conns;
    page = calloc(1, sizeof *page);
    if (page) page->data = mok_metrics_render(s->m, &info, st, &page->len);
    if (!page || !page->data) {
      free(page);
      page = NULL;
      code = 500;
      why = "out of memory rendering the page";
    }
  }
  if (page) page->refs = 1; /* ours, while we hand it out */
  for (conn *c = s->conns; c; c = c->next) {
    if (c->closing || c->state != C_WAITING) continue;
    if (page) respond(c, 200, page, NULL);
    else respond(c, code, NULL, why);
  }
  page_release(page);
}

/* ---- start and stop --------------------------------------------------------------- */

static int start_tcp(mok_metrics_server *s) {
  struct sockaddr_storage addr;
  bool loopback;
  char err[256];
  if (mok_metrics_parse_listen(s->cfg.listen, &addr, &loopback, err, sizeof err) < 0) {
    log_error("%s", err);
    return -1;
  }
  int r = uv_tcp_init(s->loop, &s->tcp.tcp);
  if (r < 0) {
    log_error("metrics-listen %s: %s", s->cfg.listen, uv_strerror(r));
    return -1;
  }
  s->tcp.handle.data = s;
  s->tcp_on = true;
  s->open++;
  r = uv_tcp_bind(&s->tcp.tcp, (const struct sockaddr *)&addr, 0);
  if (r == 0) r = uv_listen(&s->tcp.stream, BACKLOG, on_connection);
  if (r < 0) {
    log_error("metrics-listen %s: cannot listen there: %s", s->cfg.listen, uv_strerror(r));
    return -1;
  }
  log_info("metrics: http://%s/metrics%s", s->cfg.listen,
           loopback ? "" : " (not a loopback address: metrics-allow-nonlocal)");
  return 0;
}

static int start_pipe(mok_metrics_server *s) {
  const char *path = s->cfg.socket_path;
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path) {
    log_error("metrics-socket path too long: %s", path);
    return -1;
  }
  strcpy(addr.sun_path, path);
  snprintf(s->socket_path, sizeof s->socket_path, "%s", path);
  struct stat st;
  if (lstat(path, &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      log_error("metrics-socket %s exists and is not a socket; refusing to replace it", path);
      return -1;
    }
    int probe = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (probe >= 0 && connect(probe, (struct sockaddr *)&addr, sizeof addr) == 0) {
      close(probe);
      log_error("metrics-socket %s: another process is serving it", path);
      return -1;
    }
    if (probe >= 0) close(probe);
    unlink(path); /* a stale socket */
  }
  gid_t gid = (gid_t)-1;
  if (s->cfg.socket_group) {
    struct group gr, *found = NULL;
    char buf[4096];
    int e = getgrnam_r(s->cfg.socket_group, &gr, buf, sizeof buf, &found);
    if (!found) {
      log_error("metrics-socket-group %s: %s", s->cfg.socket_group,
                e ? strerror(e) : "no such group");
      return -1;
    }
    gid = gr.gr_gid;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    log_error("metrics-socket: socket: %s", strerror(errno));
    return -1;
  }
  /* never reachable with wider permissions than metrics-socket-mode */
  mode_t old = umask(0777 & ~s->cfg.socket_mode);
  int r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  umask(old);
  if (r < 0) {
    log_error("metrics-socket %s: cannot bind: %s", path, strerror(errno));
    close(fd);
    return -1;
  }
  s->own_path = true;
  if ((gid != (gid_t)-1 && lchown(path, (uid_t)-1, gid) < 0) || chmod(path, s->cfg.socket_mode) < 0 ||
      listen(fd, BACKLOG) < 0) {
    log_error("metrics-socket %s: cannot set it up (group %s, mode %04o): %s", path,
              s->cfg.socket_group ? s->cfg.socket_group : "unchanged",
              (unsigned)s->cfg.socket_mode, strerror(errno));
    close(fd);
    return -1;
  }
  if ((r = uv_pipe_init(s->loop, &s->pipe.pipe, 0)) < 0) {
    log_error("metrics-socket %s: %s", path, uv_strerror(r));
    close(fd);
    return -1;
  }
  s->pipe.handle.data = s;
  s->pipe_on = true;
  s->open++;
  if ((r = uv_pipe_open(&s->pipe.pipe, fd)) < 0) {
    close(fd);
  } else {
    r = uv_listen(&s->pipe.stream, BACKLOG, on_connection);
  }
  if (r < 0) {
    log_error("metrics-socket %s: cannot listen: %s", path, uv_strerror(r));
    return -1;
  }
  log_info("metrics: unix:%s /metrics (admins only)", path);
  return 0;
}

int mok_metrics_server_start(uv_loop_t *loop, const mok_metrics_config *cfg, mok_metrics *m,
                             const mok_metrics_hooks *hooks, mok_metrics_server **ret) {
  *ret = NULL;
  if (!cfg->listen && !cfg->socket_path) return 0;
  char err[320];
  if (mok_metrics_config_check(cfg, err, sizeof err) < 0) {
    log_error("%s", err);
    return -1;
  }
  if (!m) {
    log_error("metrics: out of memory");
    return -1;
  }
  mok_metrics_server *s = calloc(1, sizeof *s);
  if (!s) {
    log_error("metrics: out of memory");
    return -1;
  }
  s->loop = loop;
  s->cfg = *cfg;
  s->m = m;
  s->hooks = *hooks;
  if ((cfg->listen && start_tcp(s) < 0) || (cfg->socket_path && start_pipe(s) < 0)) {
    mok_metrics_server_stop(s);
    return -1;
  }
  *ret = s;
  return 0;
}

void mok_metrics_server_stop(mok_metrics_server *s) {
  if (!s || s->stopping) return;
  s->stopping = true;
  if (s->tcp_on) uv_close(&s->tcp.handle, on_listener_closed);
  if (s->pipe_on) uv_close(&s->pipe.handle, on_listener_closed);
  if (s->own_path) unlink(s->socket_path);
  for (conn *c = s->conns; c; c = c->next) conn_close(c);
  maybe_free(s);
}
