/* SPDX-License-Identifier: Apache-2.0 */
/* Where mok_bench's operands live (--memory), to separate the cost of the
 * memory a kernel reads from the kernel itself:
 *
 *   own       one cudaMalloc per tensor, in this process (the default)
 *   pool      one cudaMalloc in this process, tensors carved from it (as torch's
 *             caching allocator and mok_bench_daemon's pool do)
 *   ipc       one cudaMalloc made by a child process, opened here through a legacy
 *             CUDA IPC handle (how mokd sees a client's cudaMalloc memory)
 *   vmm       cuMemCreate memory (2 MiB granularity) made and mapped here
 *   vmm-ipc   cuMemCreate memory made by a child process, exported as a POSIX fd,
 *             imported and mapped here (how mokd sees a client's cuMem memory)
 *   ipc-touched  as ipc, the child writing the whole pool first (a client fills
 *             its tensors before mokd reads them)
 *
 * The "client" tensors (x, ids, rw, weights, out, gradients, the saved
 * activations) come from the pool; the rest (schedule, routed rows,
 * workspace) stays cudaMalloc'd here, as mokd's own workspace does. The child
 * is forked before this process touches CUDA (bench_pool_start must be the
 * first CUDA-related call) and lives until bench_pool_stop. */
#ifndef MOK_BENCH_POOL_H
#define MOK_BENCH_POOL_H

#include <cuda.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>

enum { POOL_OWN, POOL_LOCAL, POOL_IPC, POOL_VMM, POOL_VMM_IPC, POOL_IPC_TOUCHED };

typedef struct bench_pool {
  int kind;
  size_t size, used;
  char *base;
  pid_t child;
  int sock;                 /* to the child; closing it ends the child */
  CUmemGenericAllocationHandle vmm;
} bench_pool;

/* --memory's names and what bench_pool_start says it made */
static const struct {
  const char *name, *made;
} POOL_KINDS[] = {
    [POOL_OWN] = {"own", "one cudaMalloc per tensor"},
    [POOL_LOCAL] = {"pool", "local cudaMalloc"},
    [POOL_IPC] = {"ipc", "IPC-imported cudaMalloc"},
    [POOL_VMM] = {"vmm", "local cuMemCreate"},
    [POOL_VMM_IPC] = {"vmm-ipc", "fd-imported cuMemCreate"},
    [POOL_IPC_TOUCHED] = {"ipc-touched", "IPC-imported cudaMalloc (written by its owner)"},
};

static int bench_pool_kind(const char *s) {
  for (int k = 0; k < (int)(sizeof POOL_KINDS / sizeof POOL_KINDS[0]); k++)
    if (!strcmp(s, POOL_KINDS[k].name)) return k;
  return -1;
}

/* legacy CUDA IPC of a cudaMalloc another process made */
static int pool_is_ipc(int kind) { return kind == POOL_IPC || kind == POOL_IPC_TOUCHED; }
static int pool_is_vmm(int kind) { return kind == POOL_VMM || kind == POOL_VMM_IPC; }
static int pool_has_child(int kind) { return pool_is_ipc(kind) || kind == POOL_VMM_IPC; }

static void pool_die(const char *what, int r) {
  fprintf(stderr, "bench_pool: %s failed (%d)\n", what, r);
  exit(1);
}
#define CU_OK(call)                       \
  do {                                    \
    CUresult r_ = (call);                 \
    if (r_ != CUDA_SUCCESS) pool_die(#call, (int)r_); \
  } while (0)

/* device 0 memory a POSIX fd can export (how libmok exports cuMem memory) */
static CUmemAllocationProp vmm_prop(void) {
  CUmemAllocationProp p;
  memset(&p, 0, sizeof p);
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = 0;
  p.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return p;
}

static size_t vmm_granularity(void) {
  CUmemAllocationProp p = vmm_prop();
  size_t g = 0;
  CU_OK(cuMemGetAllocationGranularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return g;
}

static CUmemGenericAllocationHandle vmm_create(size_t size) {
  CUmemAllocationProp p = vmm_prop();
  CUmemGenericAllocationHandle h;
  CU_OK(cuMemCreate(&h, size, &p, 0));
  return h;
}

static char *vmm_map(CUmemGenericAllocationHandle h, size_t size) {
  CUdeviceptr va = 0;
  CU_OK(cuMemAddressReserve(&va, size, 2u << 20, 0, 0));
  CU_OK(cuMemMap(va, size, 0, h, 0));
  CUmemAccessDesc a;
  memset(&a, 0, sizeof a);
  a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  a.location.id = 0;
  a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CU_OK(cuMemSetAccess(va, size, &a, 1));
  return (char *)(uintptr_t)va;
}

/* undoes vmm_map and vmm_create (or the import) */
static void vmm_unmap_release(char *base, size_t size, CUmemGenericAllocationHandle h) {
  CU_OK(cuMemUnmap((CUdeviceptr)(uintptr_t)base, size));
  CU_OK(cuMemAddressFree((CUdeviceptr)(uintptr_t)base, size));
  CU_OK(cuMemRelease(h));
}

static void send_fd(int sock, int fd) {
  char byte = 'f';
  struct iovec iov = {&byte, 1};
  char cbuf[CMSG_SPACE(sizeof(int))];
  memset(cbuf, 0, sizeof cbuf);
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = cbuf;
  m.msg_controllen = sizeof cbuf;
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (sendmsg(sock, &m, 0) != 1) pool_die("sendmsg", errno);
}

static int recv_fd(int sock) {
  char byte;
  struct iovec iov = {&byte, 1};
  char cbuf[CMSG_SPACE(sizeof(int))];
  struct msghdr m;
  memset(&m, 0, sizeof m);
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  m.msg_control = cbuf;
  m.msg_controllen = sizeof cbuf;
  if (recvmsg(sock, &m, 0) != 1) pool_die("recvmsg", errno);
  struct cmsghdr *c = CMSG_FIRSTHDR(&m);
  if (!c || c->cmsg_type != SCM_RIGHTS) pool_die("recvmsg: no fd", 0);
  int fd;
  memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

static void read_all(int fd, void *p, size_t n) {
  for (size_t got = 0; got < n;) {
    ssize_t r = read(fd, (char *)p + got, n - got);
    if (r <= 0) pool_die("read from the pool's child", r < 0 ? errno : 0);
    got += (size_t)r;
  }
}

/* The child: make the memory, hand it over, wait for EOF, free it. */
static void pool_child(int kind, size_t size, int sock) {
  if (pool_is_ipc(kind)) {
    void *p = NULL;
    if (cudaMalloc(&p, size) != cudaSuccess) _exit(3);
    if (kind == POOL_IPC_TOUCHED &&
        (cudaMemset(p, 0x3c, size) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess))
      _exit(3);
    cudaIpcMemHandle_t h;
    if (cudaIpcGetMemHandle(&h, p) != cudaSuccess) _exit(3);
    if (write(sock, &h, sizeof h) != (ssize_t)sizeof h) _exit(3);
  } else {
    CU_OK(cuInit(0));
    CUdevice dev;
    CUcontext ctx;
    CU_OK(cuDeviceGet(&dev, 0));
    CU_OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU_OK(cuCtxSetCurrent(ctx));
    CUmemGenericAllocationHandle h = vmm_create(size);
    int fd = -1;
    CU_OK(cuMemExportToShareableHandle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
    send_fd(sock, fd);
    close(fd);
  }
  char b;
  while (read(sock, &b, 1) > 0) {
  }
  _exit(0);
}

/* Call before any other CUDA call of this process. size: bytes of the pool. */
static void bench_pool_start(bench_pool *P, int kind, size_t size) {
  memset(P, 0, sizeof *P);
  P->kind = kind;
  P->sock = -1;
  if (kind == POOL_OWN) return;
  if (pool_is_vmm(kind)) {
    /* the granularity query would initialise the driver before the fork: take
     * 2 MiB (every GPU this runs on), checked against the driver's answer below */
    size = (size + (2u << 20) - 1) & ~(size_t)((2u << 20) - 1);
  }
  P->size = size;
  if (pool_has_child(kind)) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) pool_die("socketpair", errno);
    pid_t pid = fork();
    if (pid < 0) pool_die("fork", errno);
    if (pid == 0) {
      close(sv[0]);
      pool_child(kind, size, sv[1]);
    }
    close(sv[1]);
    P->child = pid;
    P->sock = sv[0];
  }
  CU_OK(cuInit(0));
  CUDA_CHECK(cudaSetDevice(0));
  CUDA_CHECK(cudaFree(0)); /* the runtime's primary context, current from here on */
  if (kind == POOL_LOCAL) {
    CUDA_CHECK(cudaMalloc((void **)&P->base, size));
  } else if (pool_is_ipc(kind)) {
    cudaIpcMemHandle_t h;
    read_all(P->sock, &h, sizeof h);
    CUDA_CHECK(cudaIpcOpenMemHandle((void **)&P->base, h, cudaIpcMemLazyEnablePeerAccess));
  } else {
    if (size % vmm_granularity() != 0) pool_die("pool size is not a multiple of the granularity", 0);
    if (kind == POOL_VMM) {
      P->vmm = vmm_create(size);
    } else {
      int fd = recv_fd(P->sock);
      CU_OK(cuMemImportFromShareableHandle(&P->vmm, (void *)(uintptr_t)fd,
                                           CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
      close(fd);
    }
    P->base = vmm_map(P->vmm, size);
  }
  fprintf(stderr, "bench_pool: %s pool of %.1f GiB at %p\n", POOL_KINDS[kind].made,
          size / 1073741824.0, (void *)P->base);
}

/* A carve of the pool (512-byte aligned, as torch's allocator rounds), or NULL
 * for POOL_OWN (the caller then cudaMallocs). */
static void *bench_pool_take(bench_pool *P, size_t bytes) {
  if (P->kind == POOL_OWN) return NULL;
  size_t at = (P->used + 511) & ~(size_t)511;
  if (at + bytes > P->size) {
    fprintf(stderr, "bench_pool: pool of %zu bytes too small (need %zu more); raise --pool-gib\n",
            P->size, at + bytes - P->size);
    exit(1);
  }
  P->used = at + bytes;
  return P->base + at;
}

static void bench_pool_reset(bench_pool *P) { P->used = 0; }

static void bench_pool_stop(bench_pool *P) {
  if (P->kind == POOL_OWN) return;
  CUDA_CHECK(cudaDeviceSynchronize());
  if (P->kind == POOL_LOCAL) CUDA_CHECK(cudaFree(P->base));
  else if (pool_is_ipc(P->kind))
    CUDA_CHECK(cudaIpcCloseMemHandle(P->base));
  else {
    vmm_unmap_release(P->base, P->size, P->vmm);
  }
  if (P->sock >= 0) close(P->sock);
  if (P->child > 0) waitpid(P->child, NULL, 0);
}

#endif
