/* SPDX-License-Identifier: Apache-2.0 */
/* Passing a group member's buffer fd between daemons (fd_exchange.h). */
#include "ep/fd_exchange.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "log.h"
#include "mok_status.h"

struct mok_fdx_server {
  int listen_fd;
  int stop_pipe[2];
  int fd;
  uint64_t payload;
  pthread_t thread;
};

void mok_fdx_name(char *buf, size_t len, uid_t uid, uint32_t rank, uint64_t serial) {
  snprintf(buf, len, "mok-ep/%u/%u/%016llx", (unsigned)uid, rank, (unsigned long long)serial);
}

/* sockaddr for an abstract name: a leading NUL, no terminator counted */
static socklen_t abstract_addr(struct sockaddr_un *a, const char *name) {
  memset(a, 0, sizeof *a);
  a->sun_family = AF_UNIX;
  size_t n = strnlen(name, sizeof a->sun_path - 1);
  memcpy(a->sun_path + 1, name, n);
  return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + n);
}

static bool peer_is(int sock, pid_t pid) {
  struct ucred cr;
  socklen_t len = sizeof cr;
  if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cr, &len) != 0) return false;
  return cr.uid == geteuid() && (pid == 0 || cr.pid == pid);
}

static void serve_one(mok_fdx_server *s, int conn) {
  if (!peer_is(conn, 0)) {
    log_warn("group buffer: refused a connection from another uid");
    return;
  }
  char ctl[CMSG_SPACE(sizeof(int))];
  memset(ctl, 0, sizeof ctl);
  struct iovec iov = {.iov_base = &s->payload, .iov_len = sizeof s->payload};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                     .msg_controllen = sizeof ctl};
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &s->fd, sizeof(int));
  if (sendmsg(conn, &m, MSG_NOSIGNAL) < 0)
    log_warn("group buffer: sending the fd failed: %s", strerror(errno));
}

static void *serve_main(void *arg) {
  mok_fdx_server *s = arg;
  for (;;) {
    struct pollfd p[2] = {{.fd = s->listen_fd, .events = POLLIN},
                          {.fd = s->stop_pipe[0], .events = POLLIN}};
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p[1].revents) break;
    if (!(p[0].revents & POLLIN)) continue;
    int conn = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
    if (conn < 0) continue;
    serve_one(s, conn);
    close(conn);
  }
  return NULL;
}

int mok_fdx_serve(const char *name, int fd, uint64_t payload, mok_fdx_server **ret, char *err,
                  size_t errlen) {
  *ret = NULL;
  mok_fdx_server *s = calloc(1, sizeof *s);
  if (!s) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  s->fd = fd;
  s->payload = payload;
  s->stop_pipe[0] = s->stop_pipe[1] = -1;
  s->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  struct sockaddr_un a;
  socklen_t alen = abstract_addr(&a, name);
  const char *step = "socket";
  if (s->listen_fd >= 0) {
    step = "bind";
    if (bind(s->listen_fd, (struct sockaddr *)&a, alen) == 0) {
      step = "listen";
      if (listen(s->listen_fd, 64) == 0) {
        step = "pipe";
        if (pipe2(s->stop_pipe, O_CLOEXEC) == 0) {
          step = "pthread_create";
          int r = pthread_create(&s->thread, NULL, serve_main, s);
          if (r == 0) {
            *ret = s;
            return MOK_OK;
          }
          errno = r;
        }
      }
    }
  }
  snprintf(err, errlen, "serving the group buffer on @%s: %s: %s", name, step, strerror(errno));
  if (s->listen_fd >= 0) close(s->listen_fd);
  if (s->stop_pipe[0] >= 0) close(s->stop_pipe[0]), close(s->stop_pipe[1]);
  free(s);
  return MOK_EENGINE;
}

void mok_fdx_stop(mok_fdx_server *s) {
  if (!s) return;
  char b = 1;
  if (write(s->stop_pipe[1], &b, 1) != 1) log_warn("group buffer: cannot stop the fd server");
  pthread_join(s->thread, NULL);
  close(s->listen_fd);
  close(s->stop_pipe[0]);
  close(s->stop_pipe[1]);
  free(s);
}

static int receive(int sock, int *fd, uint64_t *payload, char *err, size_t errlen) {
  char ctl[CMSG_SPACE(sizeof(int))];
  uint64_t val = 0;
  struct iovec iov = {.iov_base = &val, .iov_len = sizeof val};
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl,
                     .msg_controllen = sizeof ctl};
  struct pollfd p = {.fd = sock, .events = POLLIN};
  if (poll(&p, 1, 5000) != 1) {
    snprintf(err, errlen, "the peer did not send its buffer within 5 s");
    return MOK_ETIMEOUT;
  }
  ssize_t n = recvmsg(sock, &m, MSG_CMSG_CLOEXEC);
  struct cmsghdr *c = n == (ssize_t)sizeof val ? CMSG_FIRSTHDR(&m) : NULL;
  if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
      c->cmsg_len != CMSG_LEN(sizeof(int))) {
    snprintf(err, errlen, "the peer's answer carried no fd (%zd bytes)", n);
    return MOK_EPROTO;
  }
  memcpy(fd, CMSG_DATA(c), sizeof(int));
  *payload = val;
  return MOK_OK;
}

int mok_fdx_fetch(const char *name, pid_t server_pid, uint32_t timeout_ms, int *fd,
                  uint64_t *payload, char *err, size_t errlen) {
  *fd = -1;
  struct sockaddr_un a;
  socklen_t alen = abstract_addr(&a, name);
  uint64_t deadline = mok_clock_ms() + timeout_ms;
  for (;;) {
    int sock = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (sock < 0) {
      snprintf(err, errlen, "socket: %s", strerror(errno));
      return MOK_EENGINE;
    }
    if (connect(sock, (struct sockaddr *)&a, alen) == 0) {
      int r;
      if (!peer_is(sock, server_pid)) {
        r = MOK_EACCES;
        snprintf(err, errlen,
                 "@%s is not served by mokd pid %d of our uid: refusing its buffer", name,
                 (int)server_pid);
      } else {
        r = receive(sock, fd, payload, err, errlen);
      }
      close(sock);
      return r;
    }
    int e = errno;
    close(sock);
    if ((e != ECONNREFUSED && e != ENOENT) || mok_clock_ms() >= deadline) {
      snprintf(err, errlen, "connecting to the peer's buffer @%s: %s", name, strerror(e));
      return MOK_ETIMEOUT;
    }
    struct timespec ts = {0, 1000000};
    nanosleep(&ts, NULL);
  }
}
