/* SPDX-License-Identifier: Apache-2.0 */
/* Regions: client memory a session has registered, as the engine sees it.
 *
 * A region table belongs to one session and is touched only by the engine
 * thread. Ids are session-local, start at 1 and are never reused within a
 * session, so a stale id can only miss, never alias another buffer.
 */
#ifndef MOK_REGION_H
#define MOK_REGION_H

#include <stddef.h>
#include <stdint.h>

typedef enum mok_region_kind {
  MOK_REGION_HOST_MEMFD = 1,
  MOK_REGION_CUDA_IPC = 2,
  MOK_REGION_CUDA_VMM = 3,
} mok_region_kind;

/* What backs a region, so that two registrations of the same memory are
 * seen as one (the overlap checks of job_check.c): (object, object2) name
 * the backing object (a memfd's st_dev and st_ino; the CUDA allocation the
 * engine imported), offset is where r->base lies in it. object == 0: unknown
 * (never overlaps another region). */
typedef struct mok_region_backing {
  uint64_t object, object2;
  uint64_t offset;
} mok_region_backing;

typedef struct mok_region {
  uint32_t id;
  mok_region_kind kind;
  void *base;     /* where the engine addresses it (host or device) */
  uint64_t bytes; /* usable bytes from base */
  void *map_base; /* what to unmap (host: the mmap) */
  uint64_t map_bytes;
  void *engine_handle; /* engine-private (cuda: the import) */
  mok_region_backing backing;
} mok_region;

typedef struct mok_region_table {
  mok_region *items;
  size_t count, cap;
  uint32_t next_id;
  uint64_t total_bytes;
} mok_region_table;

/* Map a host memfd. Requires a shmem memfd (hugetlbfs and other file
 * systems are refused: sealing does not stop hole punching there, and a
 * punched page would fault the daemon), F_SEAL_SHRINK (or the client could
 * truncate it under us) and a size >= offset + bytes; fills r->backing.
 * Takes no ownership of fd. Returns a mok_status; fills err. */
int mok_region_map_memfd(int fd, uint64_t offset, uint64_t bytes, mok_region *ret,
                         char *err, size_t errlen);
void mok_region_unmap_host(mok_region *r);

/* Add r to the table (assigns r->id). Returns MOK_OK or MOK_ENOMEM. */
int mok_region_table_add(mok_region_table *t, mok_region *r);
mok_region *mok_region_table_find(mok_region_table *t, uint32_t id);
/* Remove by id into *ret (the caller releases it). MOK_OK or MOK_ENOENT. */
int mok_region_table_remove(mok_region_table *t, uint32_t id, mok_region *ret);
void mok_region_table_free(mok_region_table *t);

#endif
