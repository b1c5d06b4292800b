/* SPDX-License-Identifier: Apache-2.0 */
/* The control socket's request/reply exchange: one framed protobuf request,
 * one reply, descriptors beside them; a daemon's unasked refusal is read and
 * reported. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "rpc.h"

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
