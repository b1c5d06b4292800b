/* SPDX-License-Identifier: Apache-2.0 */
/* Connection, handshake, control requests. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "frame.h"
#include "internal.h"

/* mokd refused us or closed our session with an error it sent unasked
 * (request id 0: a refused connection, a protocol error, a handshake
 * timeout): if such a frame is waiting, report its status and message. */
static int daemon_said_why(mok_client *c, uint8_t *rx, int fallback_status, const char *fallback) {
  mok_frame f;
  c->broken = true;
  if (mok_frame_recv(c->sock, rx, MOK_FRAME_MAX + 1, MOK_FRAME_MAX, MSG_DONTWAIT, &f) == 0) {
    mok_frame_close_fds(&f);
    Mok__Reply *reply = mok__reply__unpack(NULL, f.len, f.payload);
    if (reply && reply->status != MOK_OK) {
      int st = reply->status > 0 ? reply->status : MOK_EPROTO;
      mok_set_error(st, "mokd: %s", reply->message ? reply->message : mok_status_name(st));
      mok__reply__free_unpacked(reply, NULL);
      return st;
    }
    if (reply) mok__reply__free_unpacked(reply, NULL);
  }
  return mok_set_error(fallback_status, "%s", fallback);
}

int mok_rpc(mok_client *c, const Mok__Request *req, const int *fds, size_t nfds,
            Mok__Reply **ret_reply, int *ret_fds, size_t *ret_nfds) {
  if (c->broken) return mok_set_error(MOK_ECLOSED, "the connection to mokd is closed");
  size_t len = mok__request__get_packed_size(req);
  uint8_t *buf = malloc(len ? len : 1);
  if (!buf) return mok_set_error(MOK_ENOMEM, "out of memory");
  mok__request__pack(req, buf);
  uint32_t rid = ++c->next_request;
  int r = mok_frame_send(c->sock, rid, buf, len, fds, nfds);
  free(buf);
  uint8_t *rx = malloc(MOK_FRAME_MAX + 1);
  if (!rx) return mok_set_error(MOK_ENOMEM, "out of memory");
  if (r < 0) {
    char why[160];
    snprintf(why, sizeof why, "sending to mokd failed: %s", strerror(-r));
    r = daemon_said_why(c, rx, MOK_ECLOSED, why);
    free(rx);
    return r;
  }
  mok_frame f;
  r = mok_frame_recv(c->sock, rx, MOK_FRAME_MAX + 1, MOK_FRAME_MAX, 0, &f);
  if (r != 0) {
    /* a reset (mokd closed with our request unread) is reported before
     * the frame it sent first: read that frame if it is there */
    char why[160];
    snprintf(why, sizeof why, "mokd closed the connection%s%s", r < 0 ? ": " : "",
             r < 0 ? strerror(-r) : "");
    r = r < 0 ? daemon_said_why(c, rx, MOK_ECLOSED, why) : mok_set_error(MOK_ECLOSED, "%s", why);
    free(rx);
    c->broken = true;
    return r;
  }
  Mok__Reply *reply = mok__reply__unpack(NULL, f.len, f.payload);
  free(rx);
  if (reply && f.hdr.request_id == 0 && f.hdr.request_id != rid && reply->status != MOK_OK) {
    int st = reply->status > 0 ? reply->status : MOK_EPROTO;
    mok_set_error(st, "mokd: %s", reply->message ? reply->message : mok_status_name(st));
    mok__reply__free_unpacked(reply, NULL);
    mok_frame_close_fds(&f);
    c->broken = true;
    return st;
  }
  if (!reply || f.hdr.request_id != rid) {
    if (reply) mok__reply__free_unpacked(reply, NULL);
    mok_frame_close_fds(&f);
    c->broken = true;
    return mok_set_error(MOK_EPROTO, "malformed or out-of-order reply from mokd");
  }
  if (ret_nfds) {
    memcpy(ret_fds, f.fds, sizeof(int) * f.nfds);
    *ret_nfds = f.nfds;
  } else {
    mok_frame_close_fds(&f);
  }
  if (reply->status != MOK_OK) {
    int st = reply->status;
    mok_set_error(st, "%s", reply->message ? reply->message : mok_status_name(st));
    if (ret_nfds) {
      f.nfds = *ret_nfds;
      memcpy(f.fds, ret_fds, sizeof(int) * f.nfds);
      mok_frame_close_fds(&f);
      *ret_nfds = 0;
    }
    mok__reply__free_unpacked(reply, NULL);
    return st > 0 ? st : MOK_EPROTO;
  }
  *ret_reply = reply;
  return MOK_OK;
}

static int connect_socket(const char *path, int *ret) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  if (strlen(path) >= sizeof addr.sun_path)
    return mok_set_error(MOK_EINVAL, "socket path too long: %s", path);
  strcpy(addr.sun_path, path);
  int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  if (fd < 0) return mok_set_error(MOK_EIO, "socket: %s", strerror(errno));
  if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
    int e = errno;
    close(fd);
    return mok_set_error(e == EACCES ? MOK_EACCES : MOK_ECLOSED,
                         "cannot connect to mokd at %s: %s%s", path, strerror(e),
                         e == ENOENT || e == ECONNREFUSED ? " (is mokd running? set MOK_SOCKET)"
                                                          : "");
  }
  *ret = fd;
  return MOK_OK;
}

static int take_hello(mok_client *c, const Mok__Reply *reply, const int *fds, size_t nfds) {
  if (reply->body_case != MOK__REPLY__BODY_HELLO || nfds != 3)
    return mok_set_error(MOK_EPROTO, "mokd's hello reply lacks its %s",
                         nfds != 3 ? "shared memory and doorbells" : "body");
  const Mok__HelloReply *h = reply->hello;
  if (h->shm_bytes != MOK_SHM_BYTES || h->ring_entries != MOK_RING_ENTRIES)
    return mok_set_error(MOK_EVERSION, "mokd's ring layout differs from this libmok's");
  void *p = mmap(NULL, MOK_SHM_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (p == MAP_FAILED) return mok_set_error(MOK_ENOMEM, "mmap of the rings: %s", strerror(errno));
  c->shm = p;
  c->shm_bytes = MOK_SHM_BYTES;
  if (c->shm->magic != MOK_SHM_MAGIC || c->shm->layout_version != MOK_SHM_LAYOUT_VERSION)
    return mok_set_error(MOK_EVERSION, "ring layout version %u, this libmok reads %u",
                         c->shm->layout_version, MOK_SHM_LAYOUT_VERSION);
  c->doorbell_in = fds[1];
  c->doorbell_out = fds[2];
  c->session_id = h->session_id;
  snprintf(c->engine, sizeof c->engine, "%s", h->engine);
  snprintf(c->device, sizeof c->device, "%s", h->device);
  return MOK_OK;
}

int mok_connect(const char *socket_path, const char *client_name, mok_client **ret) {
  const char *path = socket_path ? socket_path : getenv("MOK_SOCKET");
  if (!path || !*path) path = MOK_DEFAULT_SOCKET;
  mok_client *c = calloc(1, sizeof *c);
  if (!c) return mok_set_error(MOK_ENOMEM, "out of memory");
  pthread_mutex_init(&c->lock, NULL);
  c->sock = c->doorbell_in = c->doorbell_out = -1;
  c->next_ticket = 1;
  int r = connect_socket(path, &c->sock);
  if (r != MOK_OK) goto fail;
  Mok__Hello hello = MOK__HELLO__INIT;
  hello.protocol_version = MOK_PROTOCOL_VERSION;
  hello.client_name = (char *)(client_name ? client_name : "libmok");
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_HELLO;
  req.hello = &hello;
  Mok__Reply *reply = NULL;
  int fds[MOK_FRAME_MAX_FDS];
  size_t nfds = 0;
  r = mok_rpc(c, &req, NULL, 0, &reply, fds, &nfds);
  if (r != MOK_OK) goto fail;
  r = take_hello(c, reply, fds, nfds);
  mok__reply__free_unpacked(reply, NULL);
  if (nfds >= 1) close(fds[0]); /* the mapping stays */
  for (size_t i = 1; r != MOK_OK && i < nfds; i++) close(fds[i]);
  if (r != MOK_OK) goto fail;
  *ret = c;
  return MOK_OK;
fail:
  c->broken = true;
  mok_close(c);
  return r;
}

const char *mok_client_engine(const mok_client *c) { return c->engine; }
const char *mok_client_device(const mok_client *c) { return c->device; }
uint64_t mok_client_session(const mok_client *c) { return c->session_id; }

int mok_stats(mok_client *c, mok_daemon_stats *ret) {
  Mok__Stats st = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &st;
  Mok__Reply *reply = NULL;
  pthread_mutex_lock(&c->lock);
  int r = mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) return r;
  if (reply->body_case != MOK__REPLY__BODY_STATS) {
    mok__reply__free_unpacked(reply, NULL);
    return mok_set_error(MOK_EPROTO, "stats reply without stats");
  }
  const Mok__StatsReply *s = reply->stats;
  ret->uptime_ms = s->uptime_ms;
  ret->jobs_done = s->jobs_done;
  ret->jobs_failed = s->jobs_failed;
  ret->sessions_now = s->n_sessions;
  ret->sessions_total = s->sessions_total;
  ret->latency_p50_ns = s->job_latency_p50_ns;
  ret->latency_p99_ns = s->job_latency_p99_ns;
  mok__reply__free_unpacked(reply, NULL);
  return MOK_OK;
}

void mok_close(mok_client *c) {
  if (!c) return;
  /* let in-flight jobs finish: they write into memory we are about to unmap */
  if (!c->broken) (void)mok_sync(c, 5000);
  mok_standing_client_free(c); /* destroys what the caller did not */
  while (c->n_layers) mok_layer_destroy(c->layers[c->n_layers - 1]);
  /* groups stay with the daemon (lingering for a restarted client) */
  for (size_t i = 0; i < c->n_groups; i++) free(c->groups[i]);
  free(c->groups);
  if (!c->broken && c->sock >= 0) {
    Mok__Goodbye bye = MOK__GOODBYE__INIT;
    Mok__Request req = MOK__REQUEST__INIT;
    req.body_case = MOK__REQUEST__BODY_GOODBYE;
    req.goodbye = &bye;
    Mok__Reply *reply = NULL;
    if (mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL) == MOK_OK)
      mok__reply__free_unpacked(reply, NULL);
  }
  for (size_t i = 0; i < c->n_regions; i++) munmap(c->regions[i].ptr, c->regions[i].bytes);
  free(c->regions);
  free(c->layers);
  mok_cuda_client_free(c); /* unregisters the sync page before the unmap */
  if (c->shm) munmap(c->shm, c->shm_bytes);
  if (c->sock >= 0) close(c->sock);
  if (c->doorbell_in >= 0) close(c->doorbell_in);
  if (c->doorbell_out >= 0) close(c->doorbell_out);
  pthread_mutex_destroy(&c->lock);
  free(c);
}
