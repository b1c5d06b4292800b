/* SPDX-License-Identifier: Apache-2.0 */
/* Control-socket frames: a 16-byte header, a protobuf payload, and up to
 * MOK_FRAME_MAX_FDS file descriptors beside it (SCM_RIGHTS).
 *
 * The socket is SOCK_SEQPACKET, so one recvmsg returns exactly one frame and
 * the fds that travelled with it. Every error path closes every fd received,
 * so a malformed frame can never leak a descriptor into the receiver.
 */
#ifndef MOK_FRAME_H
#define MOK_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "mok_wire.h"

typedef struct mok_frame {
  mok_frame_header hdr;
  const uint8_t *payload; /* points into the receive buffer */
  size_t len;
  int fds[MOK_FRAME_MAX_FDS];
  size_t nfds;
} mok_frame;

/* Check a received frame's bytes: magic, flags, version, that the declared
 * length matches the bytes received and is within limit. Pure: no I/O.
 * Returns 0, -EPROTO (malformed), -EMSGSIZE (over limit) or
 * -EPROTONOSUPPORT (other protocol version). */
int mok_frame_parse(const uint8_t *buf, size_t n, size_t limit, mok_frame_header *ret_hdr,
                    const uint8_t **ret_payload, size_t *ret_len);

/* Send one frame. Returns 0 or -errno (-EMSGSIZE if over MOK_FRAME_MAX,
 * -EINVAL for too many fds). Blocking or not as the socket is. */
int mok_frame_send(int sock, uint32_t request_id, const void *payload, size_t len,
                   const int *fds, size_t nfds);

/* Receive one frame into buf (cap bytes; must be > limit so oversized frames
 * are seen as such). flags are extra recvmsg flags (MSG_DONTWAIT).
 * Returns 0 with *ret filled, 1 when the peer closed the connection, or
 * -errno: -EAGAIN (nothing pending), -EMSGSIZE (frame over limit, or
 * truncated), -EPROTO (malformed, or a truncated control message),
 * -EPROTONOSUPPORT (version), -EBADMSG (fds that are not ours to take).
 * On any error no fd is left open. On success the caller owns ret->fds. */
int mok_frame_recv(int sock, uint8_t *buf, size_t cap, size_t limit, int flags, mok_frame *ret);

/* Close every fd a frame carried. */
void mok_frame_close_fds(mok_frame *f);

#endif /* MOK_FRAME_H */
