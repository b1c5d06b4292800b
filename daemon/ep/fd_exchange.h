/* SPDX-License-Identifier: Apache-2.0 */
/* Handing a file descriptor from one mokd to another on the same host.
 *
 * A group member shares its device buffer with its peers as a VMM POSIX fd
 * (docs/ep.md). The owner serves the fd on an abstract Unix socket named
 * from values only the group's members know (the segment records the
 * name's serial); a peer connects, checks with SO_PEERCRED that the server
 * is the mokd the segment names (pid) running as its own uid, and receives
 * the fd with SCM_RIGHTS. The server checks the client's uid the same way,
 * so a process of another user can neither fetch the buffer nor pose as
 * its owner. Each exchange carries a payload (the buffer's size) that both
 * sides know the meaning of.
 */
#ifndef MOK_FD_EXCHANGE_H
#define MOK_FD_EXCHANGE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#define MOK_FDX_NAME_MAX 100

typedef struct mok_fdx_server mok_fdx_server;

/* The abstract socket name of a member's buffer: the group's uid, the
 * member's rank and the buffer's serial (64 random bits, kept in the
 * segment, which only the group's daemons can read). */
void mok_fdx_name(char *buf, size_t len, uid_t uid, uint32_t rank, uint64_t serial);

/* Serve fd (kept open by the server until stop) with payload to clients of
 * our own uid, from a thread of its own. Returns a mok_status. */
int mok_fdx_serve(const char *name, int fd, uint64_t payload, mok_fdx_server **ret, char *err,
                  size_t errlen);
void mok_fdx_stop(mok_fdx_server *s);

/* Fetch the fd from the server named name, which must run as our uid with
 * process id server_pid; retries until timeout_ms passes (the peer may be
 * starting its server). The caller owns *fd. Returns a mok_status. */
int mok_fdx_fetch(const char *name, pid_t server_pid, uint32_t timeout_ms, int *fd,
                  uint64_t *payload, char *err, size_t errlen);

#endif /* MOK_FD_EXCHANGE_H */
