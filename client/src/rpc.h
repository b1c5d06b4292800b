/* SPDX-License-Identifier: Apache-2.0 */
/* The control socket's request/reply exchange (rpc.c). */
#ifndef MOK_CLIENT_RPC_H
#define MOK_CLIENT_RPC_H

#include "frame.h"
#include "internal.h"

/* One request, one reply (the client lock held). The reply is the
 * caller's to free with mok__reply__free_unpacked. fds: sent beside it;
 * ret_fds/ret_nfds (may be NULL) receive the reply's fds. */
int mok_rpc(mok_client *c, const Mok__Request *req, const int *fds, size_t nfds,
            Mok__Reply **ret_reply, int *ret_fds, size_t *ret_nfds);

#endif
