/* SPDX-License-Identifier: Apache-2.0 */
/* Frames: parsing, and sending/receiving with file descriptors. */
#include <dirent.h>
#include <fcntl.h>
#include <sys/socket.h>

#include "harness/check.h"
#include "frame.h"

static int count_open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  struct dirent *e;
  while ((e = readdir(d))) n += e->d_name[0] != '.';
  closedir(d);
  return n - 1; /* the DIR's own fd */
}

static void make_pair(int sv[2]) { CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) == 0); }

static void put_header(uint8_t *buf, uint32_t magic, uint16_t version, uint16_t flags,
                       uint32_t len) {
  mok_frame_header h = {.magic = magic, .version = version, .flags = flags, .request_id = 7,
                        .length = len};
  memcpy(buf, &h, sizeof h);
}

static void test_parse_accepts_a_good_frame(void) {
  uint8_t buf[32];
  put_header(buf, MOK_FRAME_MAGIC, MOK_PROTOCOL_VERSION, 0, 5);
  mok_frame_header h;
  const uint8_t *p;
  size_t len;
  CHECK_EQ_INT(mok_frame_parse(buf, 21, 1024, &h, &p, &len), 0);
  CHECK_EQ_INT(len, 5);
  CHECK(p == buf + 16);
  CHECK_EQ_INT(h.request_id, 7);
}

static void test_parse_rejects_bad_frames(void) {
  uint8_t buf[64] = {0};
  mok_frame_header h;
  const uint8_t *p;
  size_t len;
  CHECK_EQ_INT(mok_frame_parse(buf, 3, 1024, &h, &p, &len), -EPROTO); /* shorter than a header */
  put_header(buf, 0xdeadbeef, MOK_PROTOCOL_VERSION, 0, 0);
  CHECK_EQ_INT(mok_frame_parse(buf, 16, 1024, &h, &p, &len), -EPROTO);
  put_header(buf, MOK_FRAME_MAGIC, MOK_PROTOCOL_VERSION + 1, 0, 0);
  CHECK_EQ_INT(mok_frame_parse(buf, 16, 1024, &h, &p, &len), -EPROTONOSUPPORT);
  put_header(buf, MOK_FRAME_MAGIC, MOK_PROTOCOL_VERSION, 1, 0);
  CHECK_EQ_INT(mok_frame_parse(buf, 16, 1024, &h, &p, &len), -EPROTO); /* reserved flags */
  put_header(buf, MOK_FRAME_MAGIC, MOK_PROTOCOL_VERSION, 0, 10);
  CHECK_EQ_INT(mok_frame_parse(buf, 20, 1024, &h, &p, &len), -EPROTO); /* length lies */
  put_header(buf, MOK_FRAME_MAGIC, MOK_PROTOCOL_VERSION, 0, 48);
  CHECK_EQ_INT(mok_frame_parse(buf, 64, 32, &h, &p, &len), -EMSGSIZE); /* over the limit */
}

static void test_fds_travel_with_the_frame(void) {
  int sv[2];
  make_pair(sv);
  int fds[2] = {open("/dev/null", O_RDONLY), open("/dev/null", O_RDONLY)};
  CHECK_EQ_INT(mok_frame_send(sv[0], 42, "hello", 5, fds, 2), 0);
  uint8_t buf[256];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(sv[1], buf, sizeof buf, 128, 0, &f), 0);
  CHECK_EQ_INT(f.hdr.request_id, 42);
  CHECK_EQ_INT(f.len, 5);
  CHECK(memcmp(f.payload, "hello", 5) == 0);
  CHECK_EQ_INT(f.nfds, 2);
  CHECK(fcntl(f.fds[0], F_GETFD) & FD_CLOEXEC); /* received close-on-exec */
  mok_frame_close_fds(&f);
  CHECK_EQ_INT(f.nfds, 0);
}

static void test_too_many_fds_are_all_closed(void) {
  int sv[2];
  make_pair(sv);
  int fds[8];
  for (int i = 0; i < 8; i++) fds[i] = open("/dev/null", O_RDONLY);
  /* bypass mok_frame_send's own cap: a hostile peer would */
  mok_frame_header h = {.magic = MOK_FRAME_MAGIC, .version = MOK_PROTOCOL_VERSION, .length = 0};
  struct iovec iov = {.iov_base = &h, .iov_len = sizeof h};
  union {
    char b[CMSG_SPACE(sizeof fds)];
    struct cmsghdr a;
  } ctl;
  struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b,
                     .msg_controllen = sizeof ctl.b};
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof fds);
  memcpy(CMSG_DATA(c), fds, sizeof fds);
  CHECK(sendmsg(sv[0], &m, 0) > 0);
  for (int i = 0; i < 8; i++) close(fds[i]);
  int before = count_open_fds();
  uint8_t buf[256];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(sv[1], buf, sizeof buf, 128, 0, &f), -EBADMSG);
  CHECK_EQ_INT(count_open_fds(), before); /* nothing leaked */
}

static void test_oversized_frame_is_refused_and_its_fds_closed(void) {
  int sv[2];
  make_pair(sv);
  int sz = 1 << 20;
  setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &sz, sizeof sz);
  setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &sz, sizeof sz);
  static uint8_t big[200000];
  int fd = open("/dev/null", O_RDONLY);
  CHECK_EQ_INT(mok_frame_send(sv[0], 1, big, sizeof big, &fd, 1), 0);
  close(fd);
  int before = count_open_fds();
  static uint8_t buf[4097];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(sv[1], buf, sizeof buf, 4096, 0, &f), -EMSGSIZE);
  CHECK_EQ_INT(count_open_fds(), before);
}

static void test_closed_peer_and_empty_socket(void) {
  int sv[2];
  make_pair(sv);
  uint8_t buf[64];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(sv[1], buf, sizeof buf, 32, MSG_DONTWAIT, &f), -EAGAIN);
  close(sv[0]);
  CHECK_EQ_INT(mok_frame_recv(sv[1], buf, sizeof buf, 32, 0, &f), 1);
}

static void test_send_refuses_what_cannot_be_sent(void) {
  int sv[2];
  make_pair(sv);
  int fds[5] = {0, 0, 0, 0, 0};
  CHECK_EQ_INT(mok_frame_send(sv[0], 1, "x", 1, fds, 5), -EINVAL);
  CHECK_EQ_INT(mok_frame_send(sv[0], 1, "x", MOK_FRAME_MAX, NULL, 0), -EMSGSIZE);
}

static const check_case cases[] = {
    CHECK_CASE(test_parse_accepts_a_good_frame),
    CHECK_CASE(test_parse_rejects_bad_frames),
    CHECK_CASE(test_fds_travel_with_the_frame),
    CHECK_CASE(test_too_many_fds_are_all_closed),
    CHECK_CASE(test_oversized_frame_is_refused_and_its_fds_closed),
    CHECK_CASE(test_closed_peer_and_empty_socket),
    CHECK_CASE(test_send_refuses_what_cannot_be_sent),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
