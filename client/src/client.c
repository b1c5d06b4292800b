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

#include "internal.h"
#include "rpc.h"

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
  pthread_cond_init(&c->unparked, NULL);
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
  mok_layers_client_free(c);
  mok_groups_client_free(c);
  pthread_mutex_lock(&c->lock);
  if (!c->broken && c->sock >= 0) {
    Mok__Goodbye bye = MOK__GOODBYE__INIT;
    Mok__Request req = MOK__REQUEST__INIT;
    req.body_case = MOK__REQUEST__BODY_GOODBYE;
    req.goodbye = &bye;
    Mok__Reply *reply = NULL;
    if (mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL) == MOK_OK)
      mok__reply__free_unpacked(reply, NULL);
  }
  mok_jobs_wake_sleepers_locked(c); /* they poll the fds closed below */
  pthread_mutex_unlock(&c->lock);
  mok_memory_client_free(c);
  mok_cuda_client_free(c); /* unregisters the sync page before the unmap */
  if (c->shm) munmap(c->shm, c->shm_bytes);
  if (c->sock >= 0) close(c->sock);
  if (c->doorbell_in >= 0) close(c->doorbell_in);
  if (c->doorbell_out >= 0) close(c->doorbell_out);
  pthread_cond_destroy(&c->unparked);
  pthread_mutex_destroy(&c->lock);
  free(c);
}
