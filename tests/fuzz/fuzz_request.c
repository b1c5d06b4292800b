/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer: one control frame as mokd receives it, through the production
 * code: frame header (proto/frame.c), protobuf Request decoding and the
 * envelope rules (daemon/request.c), each message's validation, including
 * the layer configuration (daemon/layer.c).
 *
 * Input: byte 0 = state (bit 0: Hello done; bits 1-3: fds that came with
 * the frame, 0..4), then the frame's bytes (header + payload).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "request.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  bool hello_done = data[0] & 1;
  size_t nfds = (data[0] >> 1) & 7;
  if (nfds > MOK_FRAME_MAX_FDS) nfds = MOK_FRAME_MAX_FDS;
  data++, size--;
  size_t limit = hello_done ? MOK_FRAME_MAX : MOK_FRAME_MAX_PRE_HELLO;
  mok_frame_header h;
  const uint8_t *payload;
  size_t len;
  if (mok_frame_parse(data, size, limit, &h, &payload, &len) != 0) return 0;
  if (len > size || payload + len > data + size) abort(); /* the parser's promise */
  mok_request q;
  mok_request_verdict v = mok_request_decode(payload, len, nfds, hello_done, &q);
  if (v == MOK_REQ_OK) {
    if (!q.pb) abort();
    v = mok_request_validate(&q, nfds, hello_done);
    if (v == MOK_REQ_OK && q.pb->body_case == MOK__REQUEST__BODY_REGISTER_BUFFER &&
        q.want_fds != nfds)
      abort(); /* a RegisterBuffer goes on only with its fds */
    if (v == MOK_REQ_OK &&
        (q.pb->body_case == MOK__REQUEST__BODY_CREATE_LAYER ||
         q.pb->body_case == MOK__REQUEST__BODY_LAYER_COST) &&
        (q.layer.topk > q.layer.experts || q.layer.hidden == 0 || q.layer.max_tokens == 0))
      abort(); /* a layer that goes on (to be made, or costed) is a valid one */
  }
  if (v != MOK_REQ_OK && (q.status == 0 || !q.message[0])) abort(); /* refusals say why */
  mok_request_free(&q);
  return 0;
}
