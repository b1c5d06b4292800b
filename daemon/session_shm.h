/* SPDX-License-Identifier: Apache-2.0 */
/* The session's shared-memory region (rings) and its doorbells. */
#ifndef MOK_SESSION_SHM_H
#define MOK_SESSION_SHM_H

#include <stddef.h>

#include "mok_wire.h"

typedef struct mok_session_shm {
  int memfd;         /* sealed: the client can neither shrink nor grow it */
  mok_shm_header *hdr;
  size_t bytes;
  int doorbell_in;   /* eventfd: client -> daemon */
  int doorbell_out;  /* eventfd: daemon -> client */
} mok_session_shm;

/* Create the memfd, seal it, map it, lay out the header, make the doorbells.
 * Returns MOK_OK, or MOK_ENOMEM with the reason in err (whatever failed:
 * the client can only retry later); on failure nothing is left open. */
int mok_session_shm_create(mok_session_shm *ret, char *err, size_t errlen);
/* Close and unmap whatever is set; idempotent. */
void mok_session_shm_destroy(mok_session_shm *s);

#endif
