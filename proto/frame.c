/* SPDX-License-Identifier: Apache-2.0 */
#include "frame.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

int mok_frame_parse(const uint8_t *buf, size_t n, size_t limit, mok_frame_header *ret_hdr,
                    const uint8_t **ret_payload, size_t *ret_len) {
  mok_frame_header h;
  if (n < sizeof h) return -EPROTO;
  if (n > limit) return -EMSGSIZE;
  memcpy(&h, buf, sizeof h);
  if (h.magic != MOK_FRAME_MAGIC || h.flags != 0) return -EPROTO;
  if (h.version != MOK_PROTOCOL_VERSION) return -EPROTONOSUPPORT;
  if ((size_t)h.length != n - sizeof h) return -EPROTO;
  *ret_hdr = h;
  *ret_payload = buf + sizeof h;
  *ret_len = h.length;
  return 0;
}

int mok_frame_send(int sock, uint32_t request_id, const void *payload, size_t len,
                   const int *fds, size_t nfds) {
  if (len + sizeof(mok_frame_header) > MOK_FRAME_MAX) return -EMSGSIZE;
  if (nfds > MOK_FRAME_MAX_FDS) return -EINVAL;
  mok_frame_header h = {.magic = MOK_FRAME_MAGIC,
                        .version = MOK_PROTOCOL_VERSION,
                        .flags = 0,
                        .request_id = request_id,
                        .length = (uint32_t)len};
  struct iovec iov[2] = {{.iov_base = &h, .iov_len = sizeof h},
                         {.iov_base = (void *)payload, .iov_len = len}};
  union {
    char buf[CMSG_SPACE(sizeof(int) * MOK_FRAME_MAX_FDS)];
    struct cmsghdr align;
  } ctl;
  struct msghdr msg = {.msg_iov = iov, .msg_iovlen = len ? 2 : 1};
  if (nfds > 0) {
    memset(&ctl, 0, sizeof ctl);
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    memcpy(CMSG_DATA(c), fds, sizeof(int) * nfds);
  }
  for (;;) {
    ssize_t r = sendmsg(sock, &msg, MSG_NOSIGNAL);
    if (r >= 0) return (size_t)r == sizeof h + len ? 0 : -EIO;
    if (errno != EINTR) return -errno;
  }
}

void mok_frame_close_fds(mok_frame *f) {
  for (size_t i = 0; i < f->nfds; i++) {
    if (f->fds[i] >= 0) close(f->fds[i]);
    f->fds[i] = -1;
  }
  f->nfds = 0;
}

/* Take every fd out of the control messages; returns -EBADMSG if there are
 * more than fit (all closed then) or a control message we do not expect. */
static int collect_fds(struct msghdr *msg, mok_frame *f) {
  int r = 0;
  f->nfds = 0;
  for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR(msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) {
      r = -EBADMSG;
      continue;
    }
    size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < n; i++) {
      int fd;
      memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      if (f->nfds < MOK_FRAME_MAX_FDS) {
        f->fds[f->nfds++] = fd;
      } else {
        close(fd);
        r = -EBADMSG;
      }
    }
  }
  if (r < 0) mok_frame_close_fds(f);
  return r;
}

int mok_frame_recv(int sock, uint8_t *buf, size_t cap, size_t limit, int flags, mok_frame *ret) {
  union {
    /* room for more fds than allowed, so an excess is seen and closed */
    char buf[CMSG_SPACE(sizeof(int) * (MOK_FRAME_MAX_FDS + 4))];
    struct cmsghdr align;
  } ctl;
  struct iovec iov = {.iov_base = buf, .iov_len = cap};
  struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1,
                       .msg_control = ctl.buf, .msg_controllen = sizeof ctl.buf};
  ssize_t n;
  memset(ret, 0, sizeof *ret);
  do {
    n = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | flags);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -errno;
  int r = collect_fds(&msg, ret);
  if (r < 0) return r;
  if (msg.msg_flags & MSG_CTRUNC) {
    mok_frame_close_fds(ret);
    return -EPROTO;
  }
  if (n == 0 && ret->nfds == 0) return 1; /* orderly shutdown */
  if (msg.msg_flags & MSG_TRUNC) {
    mok_frame_close_fds(ret);
    return -EMSGSIZE;
  }
  r = mok_frame_parse(buf, (size_t)n, limit, &ret->hdr, &ret->payload, &ret->len);
  if (r < 0) mok_frame_close_fds(ret);
  return r;
}
