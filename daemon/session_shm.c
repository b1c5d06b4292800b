/* SPDX-License-Identifier: Apache-2.0 */
#include "session_shm.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mok_status.h"

#ifndef MFD_NOEXEC_SEAL
#define MFD_NOEXEC_SEAL 0x0008U
#endif

static int create_sealable_memfd(void) {
  /* MFD_NOEXEC_SEAL only exists from Linux 6.3; fall back without it */
  int fd = memfd_create("mok-session", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL);
  if (fd < 0 && errno == EINVAL) fd = memfd_create("mok-session", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  return fd < 0 ? -errno : fd;
}

int mok_session_shm_create(mok_session_shm *ret, char *err, size_t errlen) {
  int r;
  mok_session_shm s = {.memfd = -1, .doorbell_in = -1, .doorbell_out = -1};
  s.memfd = create_sealable_memfd();
  if (s.memfd < 0) {
    r = s.memfd;
    goto fail;
  }
  s.bytes = MOK_SHM_BYTES;
  if (ftruncate(s.memfd, (off_t)s.bytes) < 0 ||
      fcntl(s.memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
    r = -errno;
    goto fail;
  }
  void *p = mmap(NULL, s.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, s.memfd, 0);
  if (p == MAP_FAILED) {
    r = -errno;
    goto fail;
  }
  s.hdr = p;
  s.doorbell_in = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  s.doorbell_out = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (s.doorbell_in < 0 || s.doorbell_out < 0) {
    r = -errno;
    goto fail;
  }
  mok_shm_header *h = s.hdr;
  h->magic = MOK_SHM_MAGIC;
  h->layout_version = MOK_SHM_LAYOUT_VERSION;
  h->entries = MOK_RING_ENTRIES;
  h->sq_entry_size = sizeof(mok_job_desc);
  h->cq_entry_size = sizeof(mok_completion);
  h->sq_offset = MOK_SHM_SQ_OFFSET;
  h->cq_offset = MOK_SHM_CQ_OFFSET;
  h->region_bytes = s.bytes;
  *ret = s;
  return MOK_OK;
fail:
  mok_session_shm_destroy(&s);
  snprintf(err, errlen, "cannot create the session's shared memory: %s", strerror(-r));
  return MOK_ENOMEM;
}

void mok_session_shm_destroy(mok_session_shm *s) {
  if (s->hdr) munmap(s->hdr, s->bytes);
  if (s->memfd >= 0) close(s->memfd);
  if (s->doorbell_in >= 0) close(s->doorbell_in);
  if (s->doorbell_out >= 0) close(s->doorbell_out);
  s->hdr = NULL;
  s->memfd = s->doorbell_in = s->doorbell_out = -1;
}
