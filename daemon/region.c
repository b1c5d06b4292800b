/* SPDX-License-Identifier: Apache-2.0 */
#include "region.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "mok_status.h"

#ifndef TMPFS_MAGIC
#define TMPFS_MAGIC 0x01021994 /* linux/magic.h: shmem, which memfd_create uses */
#endif
#ifndef HUGETLBFS_MAGIC
#define HUGETLBFS_MAGIC 0x958458f6
#endif

int mok_region_map_memfd(int fd, uint64_t offset, uint64_t bytes, mok_region *ret,
                         char *err, size_t errlen) {
  struct stat st;
  memset(ret, 0, sizeof *ret);
  if (bytes == 0) {
    snprintf(err, errlen, "region of 0 bytes");
    return MOK_EINVAL;
  }
  if (fstat(fd, &st) < 0) {
    snprintf(err, errlen, "fstat of the buffer fd failed: %s", strerror(errno));
    return MOK_EINVAL;
  }
  if (!S_ISREG(st.st_mode)) {
    snprintf(err, errlen, "the buffer fd is not a memfd or regular file");
    return MOK_EINVAL;
  }
  /* Only shmem's seals pin the pages: on hugetlbfs F_SEAL_SHRINK does not
   * stop fallocate(PUNCH_HOLE), and a punched page would fault mokd
   * (SIGBUS) the next time a job touched it. */
  struct statfs fs;
  if (fstatfs(fd, &fs) < 0) {
    snprintf(err, errlen, "fstatfs of the buffer fd failed: %s", strerror(errno));
    return MOK_EINVAL;
  }
  if ((unsigned long)fs.f_type != (unsigned long)TMPFS_MAGIC) {
    snprintf(err, errlen,
             "host buffer must be a plain memfd (shmem); this one lives on %s (filesystem "
             "magic 0x%lx), where sealing does not stop hole punching and a punched page "
             "would fault mokd: create it with memfd_create without MFD_HUGETLB",
             (unsigned long)fs.f_type == (unsigned long)HUGETLBFS_MAGIC ? "hugetlbfs"
                                                                         : "another filesystem",
             (unsigned long)fs.f_type);
    return MOK_EINVAL;
  }
  int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0 || !(seals & F_SEAL_SHRINK)) {
    snprintf(err, errlen,
             "host buffer must be a memfd sealed with F_SEAL_SHRINK (seals: %d)", seals);
    return MOK_EINVAL;
  }
  if (offset > (uint64_t)st.st_size || bytes > (uint64_t)st.st_size - offset) {
    snprintf(err, errlen, "buffer offset %llu + %llu bytes exceeds the memfd size %llu",
             (unsigned long long)offset, (unsigned long long)bytes,
             (unsigned long long)st.st_size);
    return MOK_EBOUNDS;
  }
  uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
  uint64_t map_off = offset & ~(page - 1);
  uint64_t map_len = offset - map_off + bytes;
  void *p = mmap(NULL, map_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)map_off);
  if (p == MAP_FAILED) {
    snprintf(err, errlen, "mmap of %llu bytes failed: %s", (unsigned long long)map_len,
             strerror(errno));
    return errno == ENOMEM ? MOK_ENOMEM : MOK_EINVAL;
  }
  ret->kind = MOK_REGION_HOST_MEMFD;
  ret->map_base = p;
  ret->map_bytes = map_len;
  ret->base = (char *)p + (offset - map_off);
  ret->bytes = bytes;
  /* the memfd's identity: a second registration of it (any offset) is the
   * same memory, which job_check.c must see through (the top bit keeps the
   * object nonzero, i.e. known, whatever st_dev is) */
  ret->backing = (mok_region_backing){.object = (uint64_t)st.st_dev | (1ull << 63),
                                      .object2 = (uint64_t)st.st_ino, .offset = offset};
  return MOK_OK;
}

void mok_region_unmap_host(mok_region *r) {
  if (r->map_base) munmap(r->map_base, r->map_bytes);
  r->map_base = NULL;
  r->base = NULL;
}

int mok_region_table_add(mok_region_table *t, mok_region *r) {
  if (t->count == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    mok_region *n = realloc(t->items, cap * sizeof *n);
    if (!n) return MOK_ENOMEM;
    t->items = n;
    t->cap = cap;
  }
  r->id = ++t->next_id;
  t->items[t->count++] = *r;
  t->total_bytes += r->bytes;
  return MOK_OK;
}

mok_region *mok_region_table_find(mok_region_table *t, uint32_t id) {
  for (size_t i = 0; i < t->count; i++)
    if (t->items[i].id == id) return &t->items[i];
  return NULL;
}

int mok_region_table_remove(mok_region_table *t, uint32_t id, mok_region *ret) {
  for (size_t i = 0; i < t->count; i++) {
    if (t->items[i].id != id) continue;
    *ret = t->items[i];
    t->items[i] = t->items[--t->count];
    t->total_bytes -= ret->bytes;
    return MOK_OK;
  }
  return MOK_ENOENT;
}

void mok_region_table_free(mok_region_table *t) {
  free(t->items);
  memset(t, 0, sizeof *t);
}
