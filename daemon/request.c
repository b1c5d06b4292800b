/* SPDX-License-Identifier: Apache-2.0 */
#include "request.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ep/group.h"
#include "layer.h"
#include "mok_status.h"
#include "region.h"

static mok_request_verdict refuse(mok_request *req, mok_request_verdict v, int status,
                                  const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static mok_request_verdict refuse(mok_request *req, mok_request_verdict v, int status,
                                  const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(req->message, sizeof req->message, fmt, ap);
  va_end(ap);
  req->status = status;
  return v;
}

mok_request_verdict mok_request_decode(const uint8_t *payload, size_t len, size_t nfds,
                                       bool hello_done, mok_request *req) {
  memset(req, 0, sizeof *req);
  req->pb = mok__request__unpack(NULL, len, payload);
  if (!req->pb)
    return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO,
                  "malformed request: protobuf decoding failed");
  int body = req->pb->body_case;
  if (body == MOK__REQUEST__BODY__NOT_SET)
    return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO,
                  "unknown message (a newer client, or not a mok request)");
  if (nfds && body != MOK__REQUEST__BODY_REGISTER_BUFFER)
    return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO,
                  "file descriptors sent with a message that takes none");
  if (!hello_done && body != MOK__REQUEST__BODY_HELLO)
    return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO, "the first message must be Hello");
  return MOK_REQ_OK;
}

static mok_request_verdict validate_register(mok_request *req, const Mok__RegisterBuffer *m,
                                             size_t nfds) {
  switch (m->kind) {
  case MOK__BUFFER_KIND__BUFFER_HOST_MEMFD:
    req->want_fds = 1, req->region_kind = MOK_REGION_HOST_MEMFD;
    break;
  case MOK__BUFFER_KIND__BUFFER_CUDA_VMM_FD:
    req->want_fds = 1, req->region_kind = MOK_REGION_CUDA_VMM;
    break;
  case MOK__BUFFER_KIND__BUFFER_CUDA_IPC:
    req->want_fds = 0, req->region_kind = MOK_REGION_CUDA_IPC;
    break;
  default:
    return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "unknown buffer kind %d", (int)m->kind);
  }
  if (nfds != req->want_fds)
    return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "this buffer kind takes %zu fd(s), %zu came",
                  req->want_fds, nfds);
  if (req->region_kind == MOK_REGION_CUDA_IPC && m->cuda_ipc_handle.len != 64)
    return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "a CUDA IPC handle is 64 bytes, got %zu",
                  m->cuda_ipc_handle.len);
  if (m->bytes == 0)
    return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "a buffer of 0 bytes");
  if (m->offset > UINT64_MAX - m->bytes)
    return refuse(req, MOK_REQ_REPLY, MOK_EBOUNDS, "buffer offset %llu + %llu bytes overflows",
                  (unsigned long long)m->offset, (unsigned long long)m->bytes);
  return MOK_REQ_OK;
}

/* CreateLayer and LayerCost carry the same description, checked alike. */
static mok_request_verdict validate_layer(mok_request *req, const Mok__LayerConfig *lc,
                                          const char *what) {
  if (!lc) return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "%s without a config", what);
  mok_layer_config cfg = {
      .hidden = lc->hidden,
      .intermediate = lc->intermediate,
      .experts = lc->experts,
      .topk = lc->topk,
      .shared_intermediate = lc->shared_intermediate,
      .max_tokens = lc->max_tokens,
      .dtype = lc->dtype == MOK__DTYPE__DTYPE_F32      ? MOK_DTYPE_F32
               : lc->dtype == MOK__DTYPE__DTYPE_BF16     ? MOK_DTYPE_BF16
               : lc->dtype == MOK__DTYPE__DTYPE_FP8_E4M3 ? MOK_DTYPE_FP8_E4M3
                                                         : MOK_DTYPE_INVALID,
      .has_limit = lc->has_swiglu_limit,
      .swiglu_limit = lc->swiglu_limit,
  };
  cfg.group_id = lc->group_id; /* the engine thread checks it against the group */
  cfg.group_tag = lc->group_tag;
  int r = mok_layer_validate(&cfg, req->message, sizeof req->message);
  if (r != MOK_OK) {
    req->status = r;
    return MOK_REQ_REPLY;
  }
  req->layer = cfg;
  return MOK_REQ_OK;
}

mok_request_verdict mok_request_validate(mok_request *req, size_t nfds, bool hello_done) {
  const Mok__Request *pb = req->pb;
  switch (pb->body_case) {
  case MOK__REQUEST__BODY_HELLO:
    if (hello_done) return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO, "Hello sent twice");
    if (pb->hello->protocol_version != MOK_PROTOCOL_VERSION)
      return refuse(req, MOK_REQ_CLOSE, MOK_EVERSION,
                    "client speaks protocol %u, this mokd speaks %u",
                    pb->hello->protocol_version, MOK_PROTOCOL_VERSION);
    return MOK_REQ_OK;
  case MOK__REQUEST__BODY_REGISTER_BUFFER: return validate_register(req, pb->register_buffer, nfds);
  case MOK__REQUEST__BODY_CREATE_LAYER:
    return validate_layer(req, pb->create_layer->config, "CreateLayer");
  case MOK__REQUEST__BODY_LAYER_COST:
    return validate_layer(req, pb->layer_cost->config, "LayerCost");
  case MOK__REQUEST__BODY_JOIN_GROUP: {
    /* the rest (sizing, rank, world) is checked where the group lives (ep/group.c) */
    const char *key = pb->join_group->group_key;
    size_t n = key ? strlen(key) : 0;
    if (n == 0 || n > 128)
      return refuse(req, MOK_REQ_REPLY, MOK_EINVAL, "group key must be 1..128 bytes, got %zu",
                    n);
    size_t id = pb->join_group->nccl_id.len;
    if (id != 0 && id != MOK_GROUP_NCCL_ID_BYTES)
      return refuse(req, MOK_REQ_REPLY, MOK_EINVAL,
                    "nccl_id must be empty or %u bytes (from GroupId), got %zu",
                    MOK_GROUP_NCCL_ID_BYTES, id);
    return MOK_REQ_OK;
  }
  case MOK__REQUEST__BODY_GROUP_ID:
  case MOK__REQUEST__BODY_LEAVE_GROUP:
  case MOK__REQUEST__BODY_UNREGISTER_BUFFER:
  case MOK__REQUEST__BODY_DESTROY_LAYER:
  case MOK__REQUEST__BODY_STATS:
  case MOK__REQUEST__BODY_GOODBYE:
    return MOK_REQ_OK;
  default:
    return refuse(req, MOK_REQ_CLOSE, MOK_EPROTO, "unknown message");
  }
}

void mok_request_free(mok_request *req) {
  if (req->pb) mok__request__free_unpacked(req->pb, NULL);
  req->pb = NULL;
}
