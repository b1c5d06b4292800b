/* SPDX-License-Identifier: Apache-2.0 */
/* mok status codes: one table, shared by mokd, libmok, the wire and Python.
 *
 * Every reply and every job completion carries one of these plus a message a
 * person can act on. Values are stable: they travel in protobuf replies and in
 * completion descriptors, so never renumber, only append.
 */
#ifndef MOK_STATUS_H
#define MOK_STATUS_H

/* M(name, value, short description) */
#define MOK_STATUS_MAP(M)                                                      \
  M(OK, 0, "success")                                                          \
  M(EINVAL, 1, "invalid argument")                                             \
  M(EPROTO, 2, "protocol error")                                               \
  M(EVERSION, 3, "protocol version mismatch")                                  \
  M(ENOMEM, 4, "out of memory")                                                \
  M(ELIMIT, 5, "limit or quota exceeded")                                      \
  M(ENOENT, 6, "no such object")                                               \
  M(EBOUNDS, 7, "tensor out of the bounds of its region")                      \
  M(ESHAPE, 8, "tensor shape or dtype does not match the layer")               \
  M(EROUTE, 9, "routing id out of range")                                      \
  M(EOVERFLOW, 10, "capacity overflow")                                        \
  M(ETIMEOUT, 11, "timed out")                                                 \
  M(EENGINE, 12, "engine failure")                                             \
  M(EUNSUPPORTED, 13, "not supported by this engine or build")                 \
  M(ESHUTDOWN, 14, "daemon shutting down")                                     \
  M(EIO, 15, "i/o error")                                                      \
  M(ECLOSED, 16, "connection closed")                                          \
  M(EBUSY, 17, "resource busy")                                                \
  M(EACCES, 18, "permission denied")

typedef enum mok_status {
#define MOK_STATUS_ENUM_(name, value, desc) MOK_##name = value,
  MOK_STATUS_MAP(MOK_STATUS_ENUM_)
#undef MOK_STATUS_ENUM_
  MOK_STATUS_COUNT_
} mok_status;

#endif /* MOK_STATUS_H */
