/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: memory a job may not be pointed at.
 *
 * One memfd registered twice is one memory: a job whose output lies over
 * another of its tensors through the second registration is refused,
 * whatever the offsets (daemon/job_check.c compares backings, filled by
 * daemon/region.c from fstat). Only shmem memfds are accepted: a hugetlbfs
 * memfd's seals do not stop hole punching (a punched page would fault
 * mokd), and a file elsewhere is not a memfd at all.
 */
#include <sys/mman.h>
#include <sys/vfs.h>

#include "harness/daemon.h"
#include "internal.h"
#include "rpc.h"
#include "mok.h"
#include "mok_slots.h"

#ifndef MFD_HUGETLB
#define MFD_HUGETLB 0x0004U
#endif

enum { T = 8, H = 32, I = 16, E = 4, K = 2 };
#define MEMFD_BYTES (1u << 20)

/* Register [offset, offset + bytes) of fd as one region; returns the
 * status, the region id in *id. */
static int register_range(mok_client *c, int fd, uint64_t offset, uint64_t bytes, uint32_t *id) {
  Mok__RegisterBuffer rb = MOK__REGISTER_BUFFER__INIT;
  rb.kind = MOK__BUFFER_KIND__BUFFER_HOST_MEMFD;
  rb.offset = offset;
  rb.bytes = bytes;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Mok__Reply *rep = NULL;
  pthread_mutex_lock(&c->lock);
  int r = mok_rpc(c, &req, &fd, 1, &rep, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) return r;
  CHECK(rep->body_case == MOK__REPLY__BODY_REGISTER_BUFFER);
  *id = rep->register_buffer->region_id;
  mok__reply__free_unpacked(rep, NULL);
  return MOK_OK;
}

/* A sealed memfd, registered twice: region A is all of it, region B starts
 * at b_offset. Both are mapped here and known to libmok, so that jobs name
 * tensors by address in either mapping. */
typedef struct twice {
  int fd;
  char *a, *b; /* the two mappings: a = memfd offset 0, b = memfd offset b_offset */
  uint64_t b_offset;
} twice;

static void know_region(mok_client *c, void *ptr, size_t bytes, uint32_t id) {
  pthread_mutex_lock(&c->lock);
  if (c->n_regions == c->cap_regions) {
    c->cap_regions = c->cap_regions ? 2 * c->cap_regions : 16;
    c->regions = realloc(c->regions, c->cap_regions * sizeof *c->regions);
    CHECK(c->regions != NULL);
  }
  c->regions[c->n_regions++] = (host_region){.ptr = ptr, .bytes = bytes, .id = id};
  pthread_mutex_unlock(&c->lock);
}

static twice register_twice(mok_client *c, uint64_t b_offset) {
  twice t = {.b_offset = b_offset};
  t.fd = memfd_create("mok-twice", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  CHECK(t.fd >= 0);
  CHECK(ftruncate(t.fd, MEMFD_BYTES) == 0);
  CHECK(fcntl(t.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
  uint32_t ia, ib;
  CHECK_MSG(register_range(c, t.fd, 0, MEMFD_BYTES, &ia) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(register_range(c, t.fd, b_offset, MEMFD_BYTES - b_offset, &ib) == MOK_OK, "%s",
            mok_last_error());
  CHECK(ia != ib);
  t.a = mmap(NULL, MEMFD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, t.fd, 0);
  t.b = mmap(NULL, MEMFD_BYTES - b_offset, PROT_READ | PROT_WRITE, MAP_SHARED, t.fd,
             (off_t)b_offset);
  CHECK(t.a != MAP_FAILED && t.b != MAP_FAILED);
  know_region(c, t.a, MEMFD_BYTES, ia);
  know_region(c, t.b, MEMFD_BYTES - b_offset, ib);
  return t;
}

/* Forward arguments: every tensor in mapping a at 16 KiB steps from 0,
 * valid routing ids, zero weights (the status is what is tested). */
static mok_forward_args forward_in_a(const twice *t) {
  char *m = t->a;
  memset(m, 0, 16 * 16384);
  int32_t *ids = (int32_t *)(m + 1 * 16384);
  for (int i = 0; i < T * K; i++) ids[i] = i % E;
  return (mok_forward_args){.x = m, .topk_ids = ids, .router_weights = (float *)(m + 2 * 16384),
                            .w_gate = m + 3 * 16384, .w_up = m + 4 * 16384,
                            .w_down = m + 5 * 16384, .out = m + 6 * 16384};
}

static int run_forward(mok_layer *l, const mok_forward_args *fa) {
  uint64_t ticket;
  int r = mok_forward(l, T, fa, &ticket);
  return r != MOK_OK ? r : mok_wait(l->client, ticket, 10000);
}

static void test_one_memfd_registered_twice_is_one_memory(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "twice", &c) == MOK_OK);
  mok_layer_desc ld = {.hidden = H, .intermediate = I, .experts = E, .topk = K, .max_tokens = T,
                       .dtype = MOK_DTYPE_F32};
  mok_layer *l;
  CHECK(mok_layer_create(c, &ld, &l) == MOK_OK);
  twice t = register_twice(c, 512 * 1024); /* A's tensors lie below 128 KiB */
  mok_forward_args fa = forward_in_a(&t);
  CHECK_MSG(run_forward(l, &fa) == MOK_OK, "%s", mok_last_error());

  /* out at B's first byte, x at the same memfd byte through A */
  mok_forward_args bad = fa;
  bad.x = t.a + t.b_offset;
  bad.out = t.b;
  CHECK_EQ_INT(run_forward(l, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "output out overlaps x");
  CHECK_STR_CONTAINS(mok_last_error(), "the same memory (one buffer registered twice)");
  /* a partial overlap: out's last element over x's first */
  bad.out = t.b + 4096;
  bad.x = t.a + t.b_offset + 4096 + (uint64_t)T * H * 4 - 4;
  CHECK_EQ_INT(run_forward(l, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "same memory");
  /* the same memfd, other bytes: fine */
  bad.x = t.a + t.b_offset + 4096 + (uint64_t)T * H * 4;
  CHECK_MSG(run_forward(l, &bad) == MOK_OK, "%s", mok_last_error());
  /* an input read through both registrations: fine */
  bad = fa;
  bad.w_up = t.b;
  bad.w_gate = t.a + t.b_offset;
  CHECK_MSG(run_forward(l, &bad) == MOK_OK, "%s", mok_last_error());

  /* the ctx a forward saves, through B over its own routing ids in A */
  uint64_t ctx_bytes = mok_layer_ctx_bytes(l, T);
  CHECK(ctx_bytes < 256 * 1024);
  bad = fa;
  bad.ctx = t.b + 7 * 16384;
  CHECK_MSG(run_forward(l, &bad) == MOK_OK, "%s", mok_last_error()); /* apart: saved */
  bad.topk_ids = (const int32_t *)(t.a + t.b_offset + 7 * 16384 + 64);
  memcpy((void *)bad.topk_ids, fa.topk_ids, 4u * T * K);
  CHECK_EQ_INT(run_forward(l, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "output ctx overlaps topk_ids");

  /* both at any offset: B at an odd page, tensors inside it */
  twice u = register_twice(c, 3 * 4096);
  bad = forward_in_a(&u);
  bad.out = u.b + 5 * 16384 - 3 * 4096; /* memfd 5*16K: w_down's first byte */
  CHECK_EQ_INT(run_forward(l, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "output out overlaps w_down");
  /* the session is served as before */
  fa = forward_in_a(&t);
  CHECK_MSG(run_forward(l, &fa) == MOK_OK, "%s", mok_last_error());
  close(t.fd);
  close(u.fd);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* A hugetlbfs memfd, sealed: refused (F_SEAL_SHRINK does not stop hole
 * punching there). Skipped where no hugetlbfs memfd can be made. */
static void test_hugetlbfs_memfds_are_refused(void) {
  int fd = memfd_create("mok-huge", MFD_CLOEXEC | MFD_ALLOW_SEALING | MFD_HUGETLB);
  if (fd < 0) {
    printf("# skipped: memfd_create(MFD_HUGETLB) failed (%s): no huge pages here\n",
           strerror(errno));
    return;
  }
  size_t huge = 2u << 20;
  if (ftruncate(fd, (off_t)huge) < 0 ||
      fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
    printf("# skipped: a hugetlbfs memfd cannot be sized or sealed here (%s)\n", strerror(errno));
    close(fd);
    return;
  }
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "huge", &c) == MOK_OK);
  uint32_t id;
  CHECK_EQ_INT(register_range(c, fd, 0, huge, &id), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "hugetlbfs");
  CHECK_STR_CONTAINS(mok_last_error(), "without MFD_HUGETLB");
  close(fd);
  /* the session goes on */
  CHECK(mok_host_alloc(c, 4096) != NULL);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* Files that are not shmem memfds: a file on another filesystem, and a
 * shmem file that was never a memfd (it cannot be sealed). */
static void test_files_that_are_not_memfds_are_refused(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "files", &c) == MOK_OK);
  uint32_t id;
  char path[160];
  snprintf(path, sizeof path, "%s/plain-file", d.dir);
  int fd = open(path, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  CHECK(fd >= 0 && ftruncate(fd, 65536) == 0);
  struct statfs fs;
  CHECK(fstatfs(fd, &fs) == 0);
  if (fs.f_type != 0x01021994) { /* /tmp on a disk: not shmem */
    CHECK_EQ_INT(register_range(c, fd, 0, 65536, &id), MOK_EINVAL);
    CHECK_STR_CONTAINS(mok_last_error(), "plain memfd (shmem)");
  } else {
    printf("# /tmp is a tmpfs: the other-filesystem case is covered by hugetlbfs only\n");
  }
  close(fd);
  unlink(path);
  snprintf(path, sizeof path, "/dev/shm/mok-test-notmemfd-%d", (int)getpid());
  fd = open(path, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd >= 0) {
    unlink(path);
    CHECK(ftruncate(fd, 65536) == 0);
    CHECK_EQ_INT(register_range(c, fd, 0, 65536, &id), MOK_EINVAL);
    CHECK_STR_CONTAINS(mok_last_error(), "F_SEAL_SHRINK");
    close(fd);
  } else {
    printf("# skipped: no /dev/shm to make a shmem file in (%s)\n", strerror(errno));
  }
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_one_memfd_registered_twice_is_one_memory),
    CHECK_CASE(test_hugetlbfs_memfds_are_refused),
    CHECK_CASE(test_files_that_are_not_memfds_are_refused),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
