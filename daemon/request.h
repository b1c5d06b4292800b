/* SPDX-License-Identifier: Apache-2.0 */
/* Decoding and validating one control request: pure, no I/O, no loop.
 *
 * The server receives a frame (proto/frame.c), then calls
 * mok_request_decode (protobuf unpack and the envelope rules: a known body,
 * fds only where the message takes them, Hello first), then its own
 * stateful checks (requests in flight), then mok_request_validate (each
 * message's own fields). The fuzzer (tests/fuzz/fuzz_request.c) drives the
 * same two functions on arbitrary bytes.
 */
#ifndef MOK_REQUEST_H
#define MOK_REQUEST_H

#include <stdbool.h>
#include <stddef.h>

#include "mok.pb-c.h"
#include "mok_wire.h"

typedef enum mok_request_verdict {
  MOK_REQ_OK = 0,       /* go on */
  MOK_REQ_REPLY,        /* reply status + message; the session stays open */
  MOK_REQ_CLOSE,        /* protocol error: reply, then close the session */
} mok_request_verdict;

typedef struct mok_request {
  Mok__Request *pb; /* owned; mok_request_free releases it */
  int status;       /* mok_status of a refusal */
  char message[256];
  /* filled by mok_request_validate, by body: */
  int region_kind;        /* RegisterBuffer: mok_region_kind */
  size_t want_fds;        /* RegisterBuffer */
  mok_layer_config layer; /* CreateLayer and LayerCost, checked by mok_layer_validate */
} mok_request;

/* Unpack payload and apply the envelope rules. nfds: fds that came with the
 * frame. On MOK_REQ_OK req->pb is set; otherwise status and message say why
 * (req->pb may still be set: always call mok_request_free). The caller owns
 * the fds and must close them unless a RegisterBuffer takes them. */
mok_request_verdict mok_request_decode(const uint8_t *payload, size_t len, size_t nfds,
                                       bool hello_done, mok_request *req);

/* Check the decoded message's own fields (protocol version of a Hello,
 * buffer kind and fd count, the layer configuration). hello_done as above. */
mok_request_verdict mok_request_validate(mok_request *req, size_t nfds, bool hello_done);

void mok_request_free(mok_request *req);

#endif
