/* SPDX-License-Identifier: Apache-2.0 */
/* Shared host memory: sealed memfds registered with the daemon. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"
#include "rpc.h"

const host_region *mok_find_region(const mok_client *c, const void *p, uint64_t bytes) {
  uintptr_t a = (uintptr_t)p;
  for (size_t i = 0; i < c->n_regions; i++) {
    uintptr_t b = (uintptr_t)c->regions[i].ptr;
    if (a >= b && a - b <= c->regions[i].bytes && bytes <= c->regions[i].bytes - (a - b))
      return &c->regions[i];
  }
  return NULL;
}

static int register_memfd(mok_client *c, int fd, uint64_t bytes, uint32_t *ret_id) {
  Mok__RegisterBuffer rb = MOK__REGISTER_BUFFER__INIT;
  rb.kind = MOK__BUFFER_KIND__BUFFER_HOST_MEMFD;
  rb.bytes = bytes;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Mok__Reply *reply = NULL;
  int r = mok_rpc(c, &req, &fd, 1, &reply, NULL, NULL);
  if (r != MOK_OK) return r;
  if (reply->body_case != MOK__REPLY__BODY_REGISTER_BUFFER) r = MOK_EPROTO;
  else *ret_id = reply->register_buffer->region_id;
  mok__reply__free_unpacked(reply, NULL);
  return r == MOK_OK ? r : mok_set_error(r, "register reply without a region id");
}

void *mok_host_alloc(mok_client *c, size_t bytes) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  if (bytes == 0 || bytes > SIZE_MAX - page) {
    mok_set_error(MOK_EINVAL, "cannot allocate %zu bytes", bytes);
    return NULL;
  }
  size_t len = (bytes + page - 1) / page * page;
  int fd = memfd_create("mok-tensor", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) {
    mok_set_error(MOK_ENOMEM, "memfd_create: %s", strerror(errno));
    return NULL;
  }
  void *p = MAP_FAILED;
  /* sealed: the daemon maps it and must never see it shrink */
  if (ftruncate(fd, (off_t)len) < 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0 ||
      (p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) == MAP_FAILED) {
    mok_set_error(MOK_ENOMEM, "shared memory of %zu bytes: %s", len, strerror(errno));
    close(fd);
    return NULL;
  }
  pthread_mutex_lock(&c->lock);
  uint32_t id = 0;
  int r = MOK_OK;
  if (c->n_regions == c->cap_regions) {
    size_t cap = c->cap_regions ? 2 * c->cap_regions : 16;
    host_region *n = realloc(c->regions, cap * sizeof *n);
    if (!n) r = mok_set_error(MOK_ENOMEM, "out of memory");
    else c->regions = n, c->cap_regions = cap;
  }
  if (r == MOK_OK) r = register_memfd(c, fd, len, &id);
  if (r == MOK_OK) c->regions[c->n_regions++] = (host_region){.ptr = p, .bytes = len, .id = id};
  pthread_mutex_unlock(&c->lock);
  close(fd); /* the daemon and our mapping keep the memory */
  if (r != MOK_OK) {
    munmap(p, len);
    return NULL;
  }
  return p;
}

int mok_host_free(mok_client *c, void *ptr) {
  pthread_mutex_lock(&c->lock);
  size_t i = 0;
  while (i < c->n_regions && c->regions[i].ptr != ptr) i++;
  if (i == c->n_regions) {
    pthread_mutex_unlock(&c->lock);
    return mok_set_error(MOK_ENOENT, "%p was not allocated by mok_host_alloc", ptr);
  }
  host_region hr = c->regions[i];
  c->regions[i] = c->regions[--c->n_regions];
  Mok__UnregisterBuffer ub = MOK__UNREGISTER_BUFFER__INIT;
  ub.region_id = hr.id;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  Mok__Reply *reply = NULL;
  int r = mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  if (r == MOK_OK) mok__reply__free_unpacked(reply, NULL);
  pthread_mutex_unlock(&c->lock);
  munmap(hr.ptr, hr.bytes);
  return r;
}

void mok_memory_client_free(mok_client *c) {
  for (size_t i = 0; i < c->n_regions; i++) munmap(c->regions[i].ptr, c->regions[i].bytes);
  free(c->regions);
  c->regions = NULL;
  c->n_regions = c->cap_regions = 0;
}
