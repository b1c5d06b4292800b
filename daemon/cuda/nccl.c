/* SPDX-License-Identifier: Apache-2.0 */
/* Symmetric memory for an expert-parallel group through NCCL (cuda/nccl.h).
 *
 * NCCL is reached through dlopen/dlsym only: the types below mirror the few
 * of nccl.h that are used (ABI of NCCL 2.28: ncclResult_t is an int-sized
 * enum, ncclUniqueId 128 bytes passed by value, ncclConfig_v22800, ncclTeam
 * three ints returned by value), so mokd needs neither nccl.h nor libnccl
 * to build. The device side (ncclGetLsaPointer) is header-inline and lives
 * in kernels/mok_nccl.cu.
 *
 * Creation, rank r of W:
 *   ncclCommInitRankConfig (config.blocking = 0), then ncclCommGetAsyncError
 *     polled until ncclSuccess or the deadline (ncclCommAbort on either
 *     failure: a missing peer never hangs the caller);
 *   ncclMemAlloc of the bytes rounded up to NCCL_WIN_REQUIRED_ALIGNMENT plus
 *     one private page (the alias check below), zeroed, then
 *     ncclCommWindowRegister(NCCL_WIN_COLL_SYMMETRIC), polled likewise (the
 *     registration is collective: it completes once every member registered,
 *     so every buffer is zeroed before anyone returns);
 *   ncclTeamLsa: every world rank must be in this member's LSA team;
 *   one kernel reads ncclGetLsaPointer(window, 0, i) for each LSA index i,
 *     copied to the host once: base[p] = pointer of p's LSA index;
 *   a check that base[rank] is the allocation (a word written through one
 *     is read through the other, in the private page).
 */
#include "cuda/nccl.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "mok_ep_kernels.h"
#include "mok_status.h"

#ifdef MOK_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "mok_nccl.h"
#endif

/* ---- the NCCL ABI used here ---------------------------------------------------- */

enum {
  NCCL_SUCCESS = 0,
  NCCL_IN_PROGRESS = 7,
};
#define NCCL_WIN_COLL_SYMMETRIC_ 0x01
#define NCCL_WIN_REQUIRED_ALIGNMENT_ 4096u
#define NCCL_CONFIG_UNDEF_INT_ (-2147483647 - 1)

typedef int nccl_result; /* ncclResult_t */
typedef struct nccl_comm_s *nccl_comm;
typedef struct nccl_window_s *nccl_window; /* a device pointer (struct ncclWindow_vidmem *) */

typedef struct nccl_unique_id {
  char internal[MOK_NCCL_ID_BYTES];
} nccl_unique_id;

typedef struct nccl_team {
  int nRanks, rank, stride;
} nccl_team;

/* ncclConfig_v22800 */
typedef struct nccl_config {
  size_t size;
  unsigned int magic;
  unsigned int version;
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
  int splitShare;
  int trafficClass;
  const char *commName;
  int collnetEnable;
  int CTAPolicy;
  int shrinkShare;
  int nvlsCTAs;
  int nChannelsPerNetPeer;
  int nvlinkCentricSched;
} nccl_config;

typedef struct nccl_api {
  nccl_result (*get_version)(int *);
  nccl_result (*get_unique_id)(nccl_unique_id *);
  nccl_result (*comm_init_rank_config)(nccl_comm *, int, nccl_unique_id, int, nccl_config *);
  nccl_result (*comm_get_async_error)(nccl_comm, nccl_result *);
  nccl_result (*comm_abort)(nccl_comm);
  nccl_result (*comm_finalize)(nccl_comm);
  nccl_result (*comm_destroy)(nccl_comm);
  nccl_result (*mem_alloc)(void **, size_t);
  nccl_result (*mem_free)(void *);
  nccl_result (*window_register)(nccl_comm, void *, size_t, nccl_window *, int);
  nccl_result (*window_deregister)(nccl_comm, nccl_window);
  const char *(*get_error_string)(nccl_result);
  const char *(*get_last_error)(nccl_comm);
  nccl_team (*team_lsa)(nccl_comm);
} nccl_api;

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;
static int load_state; /* 0 not tried, 1 loaded, -1 failed */
static int load_version;
static char load_err[320];
#ifdef MOK_HAVE_CUDA
static nccl_api api;
#endif

static void copy_err(char *err, size_t errlen, const char *msg) {
  if (err && errlen) snprintf(err, errlen, "%s", msg);
}

/* Loads NCCL once. Returns a mok_status; the reason in load_err. */
static int nccl_load(void) {
  pthread_mutex_lock(&load_lock);
  if (load_state != 0) {
    int st = load_state > 0 ? MOK_OK : MOK_EUNSUPPORTED;
    pthread_mutex_unlock(&load_lock);
    return st;
  }
  load_state = -1;
#ifndef MOK_HAVE_CUDA
  snprintf(load_err, sizeof load_err, "NCCL groups need a build with CUDA (this mokd has none)");
#else
  if (!mok_k_nccl_device_api()) {
    snprintf(load_err, sizeof load_err,
             "NCCL groups: the kernels were built without NCCL's device headers (nccl_device.h)");
    goto out;
  }
  mok_nccl_no_multicast(); /* mokd did at start; in-process users (tests) get it here */
  const char *name = getenv("MOK_NCCL_LIB");
  if (!name || !*name) name = "libnccl.so.2";
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char *why = dlerror();
    snprintf(load_err, sizeof load_err, "NCCL is not available: dlopen(\"%s\") failed: %s", name,
             why ? why : "unknown error");
    goto out;
  }
  struct {
    const char *sym;
    void *slot;
  } syms[] = {
      {"ncclGetVersion", &api.get_version},
      {"ncclGetUniqueId", &api.get_unique_id},
      {"ncclCommInitRankConfig", &api.comm_init_rank_config},
      {"ncclCommGetAsyncError", &api.comm_get_async_error},
      {"ncclCommAbort", &api.comm_abort},
      {"ncclCommFinalize", &api.comm_finalize},
      {"ncclCommDestroy", &api.comm_destroy},
      {"ncclMemAlloc", &api.mem_alloc},
      {"ncclMemFree", &api.mem_free},
      {"ncclCommWindowRegister", &api.window_register},
      {"ncclCommWindowDeregister", &api.window_deregister},
      {"ncclGetErrorString", &api.get_error_string},
      {"ncclGetLastError", &api.get_last_error},
      {"ncclTeamLsa", &api.team_lsa},
  };
  /* the version first: an old library lacks the newer symbols, and saying
   * "too old" is clearer than naming the first missing one */
  void *gv = dlsym(h, "ncclGetVersion");
  if (!gv) {
    snprintf(load_err, sizeof load_err, "NCCL: \"%s\" has no ncclGetVersion (not NCCL?)", name);
    dlclose(h);
    goto out;
  }
  memcpy(&api.get_version, &gv, sizeof gv);
  int v = 0;
  nccl_result r = api.get_version(&v);
  if (r != NCCL_SUCCESS || v < MOK_NCCL_MIN_VERSION) {
    snprintf(load_err, sizeof load_err,
             "NCCL \"%s\" is too old: version %d, NCCL groups need %d (2.28: windows and the "
             "device API)%s",
             name, v, MOK_NCCL_MIN_VERSION, r != NCCL_SUCCESS ? " (ncclGetVersion failed)" : "");
    dlclose(h);
    goto out;
  }
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    void *p = dlsym(h, syms[i].sym);
    if (!p) {
      snprintf(load_err, sizeof load_err, "NCCL \"%s\" (version %d) lacks %s", name, v,
               syms[i].sym);
      dlclose(h);
      goto out;
    }
    memcpy(syms[i].slot, &p, sizeof p);
  }
  load_version = v;
  load_state = 1;
  load_err[0] = 0;
out:
#endif
  {
    int st = load_state > 0 ? MOK_OK : MOK_EUNSUPPORTED;
    pthread_mutex_unlock(&load_lock);
    return st;
  }
}

int mok_nccl_available(char *err, size_t errlen) {
  int st = nccl_load();
  if (st != MOK_OK) copy_err(err, errlen, load_err);
  return st;
}

int mok_nccl_version(void) {
  pthread_mutex_lock(&load_lock);
  int v = load_state > 0 ? load_version : 0;
  pthread_mutex_unlock(&load_lock);
  return v;
}

#ifndef MOK_HAVE_CUDA

int mok_nccl_unique_id(uint8_t out[MOK_NCCL_ID_BYTES], char *err, size_t errlen) {
  (void)out;
  return mok_nccl_available(err, errlen);
}

int mok_nccl_group_create(const uint8_t id[MOK_NCCL_ID_BYTES], int rank, int world, int device,
                          uint64_t bytes, uint32_t timeout_ms, mok_nccl_group **out, char *err,
                          size_t errlen) {
  (void)id, (void)rank, (void)world, (void)device, (void)bytes, (void)timeout_ms;
  if (out) *out = NULL;
  return mok_nccl_available(err, errlen);
}

const uint64_t *mok_nccl_group_bases(const mok_nccl_group *g) { return (void)g, NULL; }
void *mok_nccl_group_local(const mok_nccl_group *g) { return (void)g, NULL; }
uint64_t mok_nccl_group_bytes(const mok_nccl_group *g) { return (void)g, 0; }
int mok_nccl_group_world(const mok_nccl_group *g) { return (void)g, 0; }
int mok_nccl_group_rank(const mok_nccl_group *g) { return (void)g, -1; }
int mok_nccl_group_device(const mok_nccl_group *g) { return (void)g, -1; }
int mok_nccl_group_lsa_size(const mok_nccl_group *g) { return (void)g, 0; }
void mok_nccl_group_timings(const mok_nccl_group *g, double *init_ms, double *register_ms) {
  (void)g;
  if (init_ms) *init_ms = 0;
  if (register_ms) *register_ms = 0;
}
int mok_nccl_group_check(mok_nccl_group *g, char *err, size_t errlen) {
  (void)g;
  copy_err(err, errlen, "NCCL groups need a build with CUDA");
  return MOK_EUNSUPPORTED;
}
void mok_nccl_group_abort(mok_nccl_group *g) { (void)g; }
void mok_nccl_group_destroy(mok_nccl_group *g) { (void)g; }

#else /* MOK_HAVE_CUDA */

struct mok_nccl_group {
  nccl_comm comm;
  nccl_window win;
  void *local;
  size_t alloc_bytes; /* registered: usable bytes + the private page */
  uint64_t bytes;     /* usable */
  int rank, world, device, lsa_size, lsa_rank;
  uint32_t timeout_ms;
  bool aborted;
  double init_ms, register_ms;
  uint64_t base[MOK_K_EP_MAX_WORLD];
};

static void sleep_us(long us) {
  struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* "call: NCCL's string (NCCL's last error)" */
static void nccl_err(char *err, size_t errlen, const char *what, nccl_comm comm, nccl_result r) {
  const char *s = api.get_error_string ? api.get_error_string(r) : NULL;
  const char *last = api.get_last_error ? api.get_last_error(comm) : NULL;
  snprintf(err, errlen, "NCCL group: %s failed: %s (ncclResult %d)%s%s", what,
           s ? s : "unknown error", r, last && *last ? "; NCCL's last error: " : "",
           last && *last ? last : "");
}

static int cuda_err(char *err, size_t errlen, const char *what, cudaError_t r) {
  snprintf(err, errlen, "NCCL group: %s failed: %s (CUDA error %d)", what, cudaGetErrorString(r),
           (int)r);
  return r == cudaErrorMemoryAllocation ? MOK_ENOMEM : MOK_EENGINE;
}

/* Polls the communicator until the operation started by `what` completes
 * (ncclSuccess), fails, or the deadline passes. A mok_status. */
static int wait_ready(nccl_comm comm, const char *what, uint64_t deadline_ns, uint32_t timeout_ms,
                      int rank, int world, char *err, size_t errlen) {
  long pause = 50; /* us, doubling to 2 ms */
  for (;;) {
    nccl_result state = NCCL_IN_PROGRESS;
    nccl_result r = api.comm_get_async_error(comm, &state);
    if (r != NCCL_SUCCESS) {
      nccl_err(err, errlen, "ncclCommGetAsyncError", comm, r);
      return MOK_EENGINE;
    }
    if (state == NCCL_SUCCESS) return MOK_OK;
    if (state != NCCL_IN_PROGRESS) {
      nccl_err(err, errlen, what, comm, state);
      return MOK_EENGINE;
    }
    if (mok_clock_ns() >= deadline_ns) {
      snprintf(err, errlen,
               "NCCL group: %s did not complete within %u ms (rank %d of %d: a member is missing, "
               "stalled or unreachable); the communicator was aborted",
               what, timeout_ms, rank, world);
      return MOK_ETIMEOUT;
    }
    sleep_us(pause);
    if (pause < 2000) pause *= 2;
  }
}

int mok_nccl_unique_id(uint8_t out[MOK_NCCL_ID_BYTES], char *err, size_t errlen) {
  int st = mok_nccl_available(err, errlen);
  if (st != MOK_OK) return st;
  if (!out) {
    copy_err(err, errlen, "NCCL unique id: no output buffer");
    return MOK_EINVAL;
  }
  nccl_unique_id id;
  memset(&id, 0, sizeof id);
  nccl_result r = api.get_unique_id(&id);
  if (r != NCCL_SUCCESS) {
    nccl_err(err, errlen, "ncclGetUniqueId", NULL, r);
    return MOK_EENGINE;
  }
  memcpy(out, id.internal, MOK_NCCL_ID_BYTES);
  return MOK_OK;
}

static void group_free(mok_nccl_group *g, bool abort_comm) {
  if (g->comm) {
    if (abort_comm || g->aborted) {
      if (!g->aborted) api.comm_abort(g->comm); /* also drops a window still registered */
    } else {
      if (g->win) api.window_deregister(g->comm, g->win);
    }
  }
  g->win = NULL;
  if (g->local) api.mem_free(g->local);
  g->local = NULL;
  if (g->comm && !(abort_comm || g->aborted)) {
    /* nonblocking communicator: finalize, poll (bounded), destroy */
    char tmp[256];
    nccl_result r = api.comm_finalize(g->comm);
    int st = (r == NCCL_SUCCESS || r == NCCL_IN_PROGRESS)
                 ? wait_ready(g->comm, "ncclCommFinalize",
                              mok_clock_ns() + (uint64_t)g->timeout_ms * 1000000ull, g->timeout_ms,
                              g->rank, g->world, tmp, sizeof tmp)
                 : MOK_EENGINE;
    if (st == MOK_OK)
      api.comm_destroy(g->comm);
    else
      api.comm_abort(g->comm);
  }
  g->comm = NULL;
}

int mok_nccl_group_create(const uint8_t id[MOK_NCCL_ID_BYTES], int rank, int world, int device,
                          uint64_t bytes, uint32_t timeout_ms, mok_nccl_group **out, char *err,
                          size_t errlen) {
  char scratch[8];
  if (!err || !errlen) err = scratch, errlen = sizeof scratch;
  if (out) *out = NULL;
  if (!id || !out || world < 1 || world > MOK_K_EP_MAX_WORLD || rank < 0 || rank >= world ||
      device < 0 || bytes == 0 || bytes > ((uint64_t)1 << 46) || timeout_ms == 0) {
    snprintf(err, errlen,
             "NCCL group: invalid arguments (rank %d of world %d, at most %d; device %d; %llu "
             "bytes; timeout %u ms)",
             rank, world, MOK_K_EP_MAX_WORLD, device, (unsigned long long)bytes, timeout_ms);
    return MOK_EINVAL;
  }
  int st = mok_nccl_available(err, errlen);
  if (st != MOK_OK) return st;

  mok_nccl_group *g = calloc(1, sizeof *g);
  if (!g) {
    copy_err(err, errlen, "NCCL group: out of memory");
    return MOK_ENOMEM;
  }
  g->rank = rank;
  g->world = world;
  g->device = device;
  g->timeout_ms = timeout_ms;
  g->lsa_rank = -1;
  const uint64_t t0 = mok_clock_ns(), deadline = t0 + (uint64_t)timeout_ms * 1000000ull;
  uint64_t *d_ptrs = NULL;
  int saved_dev = -1;
  cudaError_t cr = cudaGetDevice(&saved_dev);
  if (cr != cudaSuccess) {
    (void)cudaGetLastError();
    saved_dev = -1; /* no device yet on this thread: nothing to restore */
  }
  cr = cudaSetDevice(device);
  if (cr != cudaSuccess) {
    st = cuda_err(err, errlen, "cudaSetDevice", cr);
    if (st == MOK_EENGINE) st = MOK_EUNSUPPORTED;
    goto fail;
  }

  /* 1. the communicator, nonblocking */
  nccl_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.size = sizeof cfg;
  cfg.magic = 0xcafebeef;
  cfg.version = 22800;
  cfg.blocking = 0;
  cfg.cgaClusterSize = cfg.minCTAs = cfg.maxCTAs = NCCL_CONFIG_UNDEF_INT_;
  cfg.netName = NULL;
  cfg.splitShare = cfg.trafficClass = NCCL_CONFIG_UNDEF_INT_;
  cfg.commName = "mok-ep";
  cfg.collnetEnable = cfg.CTAPolicy = cfg.shrinkShare = cfg.nvlsCTAs = NCCL_CONFIG_UNDEF_INT_;
  cfg.nChannelsPerNetPeer = cfg.nvlinkCentricSched = NCCL_CONFIG_UNDEF_INT_;
  nccl_unique_id uid;
  memcpy(uid.internal, id, MOK_NCCL_ID_BYTES);
  nccl_result r = api.comm_init_rank_config(&g->comm, world, uid, rank, &cfg);
  if (r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS) {
    nccl_err(err, errlen, "ncclCommInitRankConfig", g->comm, r);
    st = MOK_EENGINE;
    goto fail;
  }
  if (!g->comm) {
    snprintf(err, errlen, "NCCL group: ncclCommInitRankConfig returned no communicator");
    st = MOK_EENGINE;
    goto fail;
  }
  st = wait_ready(g->comm, "forming the communicator (ncclCommInitRankConfig)", deadline,
                  timeout_ms, rank, world, err, errlen);
  if (st != MOK_OK) goto fail;
  const uint64_t t1 = mok_clock_ns();
  g->init_ms = (double)(t1 - t0) * 1e-6;

  /* 2. the symmetric buffer: usable bytes, then one private page */
  g->bytes = (bytes + NCCL_WIN_REQUIRED_ALIGNMENT_ - 1) & ~(uint64_t)(NCCL_WIN_REQUIRED_ALIGNMENT_ - 1);
  g->alloc_bytes = (size_t)g->bytes + NCCL_WIN_REQUIRED_ALIGNMENT_;
  r = api.mem_alloc(&g->local, g->alloc_bytes);
  if (r != NCCL_SUCCESS || !g->local) {
    nccl_err(err, errlen, "ncclMemAlloc", g->comm, r);
    g->local = NULL;
    st = MOK_ENOMEM;
    goto fail;
  }
  cr = cudaMemset(g->local, 0, g->alloc_bytes);
  if (cr == cudaSuccess) cr = cudaDeviceSynchronize();
  if (cr != cudaSuccess) {
    st = cuda_err(err, errlen, "cudaMemset of the symmetric buffer", cr);
    goto fail;
  }
  r = api.window_register(g->comm, g->local, g->alloc_bytes, &g->win, NCCL_WIN_COLL_SYMMETRIC_);
  if (r != NCCL_SUCCESS && r != NCCL_IN_PROGRESS) {
    nccl_err(err, errlen, "ncclCommWindowRegister", g->comm, r);
    st = MOK_EENGINE;
    goto fail;
  }
  st = wait_ready(g->comm, "registering the symmetric window (ncclCommWindowRegister)", deadline,
                  timeout_ms, rank, world, err, errlen);
  if (st != MOK_OK) goto fail;
  if (!g->win) {
    /* NCCL gives no symmetric memory to some communicators (no direct P2P,
     * cuMem off, and in some versions members on several nodes): those land
     * here rather than at the LSA check below */
    snprintf(err, errlen,
             "NCCL group: ncclCommWindowRegister gave no window: NCCL %d has no symmetric memory "
             "for this communicator (a member on another host or outside this GPU's NVLink "
             "domain, no direct P2P between the GPUs, or NCCL_CUMEM_ENABLE=0 / "
             "NCCL_WIN_ENABLE=0); the network path is not built",
             load_version);
    st = MOK_EUNSUPPORTED;
    goto fail;
  }
  g->register_ms = (double)(mok_clock_ns() - t1) * 1e-6;

  /* 3. who is reachable by load/store */
  nccl_team lsa = api.team_lsa(g->comm);
  g->lsa_size = lsa.nRanks;
  g->lsa_rank = lsa.rank;
  if (lsa.nRanks < 1 || lsa.rank < 0 || lsa.rank >= lsa.nRanks || lsa.nRanks > world) {
    snprintf(err, errlen, "NCCL group: ncclTeamLsa gave a bad team (%d ranks, rank %d)",
             lsa.nRanks, lsa.rank);
    st = MOK_EENGINE;
    goto fail;
  }
  for (int p = 0; p < world; p++) {
    int i = lsa.rank + (p - rank);
    if (i < 0 || i >= lsa.nRanks) {
      snprintf(err, errlen,
               "NCCL group: peer %d is outside this GPU's NVLink domain (NCCL's LSA team of rank "
               "%d holds ranks %d..%d of %d); the network path is not built",
               p, rank, rank - lsa.rank, rank - lsa.rank + lsa.nRanks - 1, world);
      st = MOK_EUNSUPPORTED;
      goto fail;
    }
  }

  /* 4. the peers' addresses, read once on the device */
  uint64_t h_ptrs[MOK_K_EP_MAX_WORLD];
  cr = cudaMalloc((void **)&d_ptrs, sizeof(uint64_t) * (size_t)lsa.nRanks);
  if (cr != cudaSuccess) {
    d_ptrs = NULL;
    st = cuda_err(err, errlen, "cudaMalloc", cr);
    goto fail;
  }
  int kst = mok_k_nccl_lsa_pointers(g->win, 0, lsa.nRanks, d_ptrs, NULL);
  if (kst != MOK_OK) {
    snprintf(err, errlen, "NCCL group: the LSA pointer kernel failed to launch (mok status %d, "
             "CUDA error %d: %s)", kst, mok_k_last_cuda_error(),
             cudaGetErrorString((cudaError_t)mok_k_last_cuda_error()));
    st = kst == MOK_EINVAL ? MOK_EENGINE : kst;
    goto fail;
  }
  cr = cudaMemcpy(h_ptrs, d_ptrs, sizeof(uint64_t) * (size_t)lsa.nRanks, cudaMemcpyDeviceToHost);
  if (cr != cudaSuccess) {
    st = cuda_err(err, errlen, "reading the LSA pointers (cudaMemcpy)", cr);
    goto fail;
  }
  cudaFree(d_ptrs);
  d_ptrs = NULL;
  for (int p = 0; p < world; p++) {
    g->base[p] = h_ptrs[lsa.rank + (p - rank)];
    if (!g->base[p] || (g->base[p] & 255u)) {
      snprintf(err, errlen, "NCCL group: ncclGetLsaPointer gave 0x%llx for peer %d",
               (unsigned long long)g->base[p], p);
      st = MOK_EENGINE;
      goto fail;
    }
  }

  /* 5. base[rank] must be our allocation: write through one, read through the other
   * (the private page: peers never touch it) */
  {
    const uint64_t magic = 0x6d6f6b2d6e63636cull ^ ((uint64_t)rank << 32) ^ t0;
    uint64_t back = 0;
    char *mine = (char *)g->local + g->bytes;
    char *via = (char *)(uintptr_t)g->base[rank] + g->bytes;
    cr = cudaMemcpy(mine, &magic, sizeof magic, cudaMemcpyHostToDevice);
    if (cr == cudaSuccess) cr = cudaMemcpy(&back, via, sizeof back, cudaMemcpyDeviceToHost);
    if (cr != cudaSuccess) {
      st = cuda_err(err, errlen, "the window's alias check (cudaMemcpy)", cr);
      goto fail;
    }
    if (back != magic) {
      snprintf(err, errlen,
               "NCCL group: the window's own mapping (0x%llx) does not show this member's "
               "buffer (0x%llx): NCCL ABI mismatch?",
               (unsigned long long)g->base[rank], (unsigned long long)(uintptr_t)g->local);
      st = MOK_EENGINE;
      goto fail;
    }
  }
  if (saved_dev >= 0) cudaSetDevice(saved_dev);
  *out = g;
  return MOK_OK;

fail:
  if (d_ptrs) cudaFree(d_ptrs);
  (void)cudaGetLastError();
  group_free(g, true);
  free(g);
  if (saved_dev >= 0) cudaSetDevice(saved_dev);
  return st;
}

const uint64_t *mok_nccl_group_bases(const mok_nccl_group *g) { return g ? g->base : NULL; }
void *mok_nccl_group_local(const mok_nccl_group *g) { return g ? g->local : NULL; }
uint64_t mok_nccl_group_bytes(const mok_nccl_group *g) { return g ? g->bytes : 0; }
int mok_nccl_group_world(const mok_nccl_group *g) { return g ? g->world : 0; }
int mok_nccl_group_rank(const mok_nccl_group *g) { return g ? g->rank : -1; }
int mok_nccl_group_device(const mok_nccl_group *g) { return g ? g->device : -1; }
int mok_nccl_group_lsa_size(const mok_nccl_group *g) { return g ? g->lsa_size : 0; }

void mok_nccl_group_timings(const mok_nccl_group *g, double *init_ms, double *register_ms) {
  if (init_ms) *init_ms = g ? g->init_ms : 0;
  if (register_ms) *register_ms = g ? g->register_ms : 0;
}

int mok_nccl_group_check(mok_nccl_group *g, char *err, size_t errlen) {
  if (!g || !g->comm) {
    copy_err(err, errlen, "NCCL group: no communicator");
    return MOK_EINVAL;
  }
  if (g->aborted) {
    copy_err(err, errlen, "NCCL group: the communicator was aborted");
    return MOK_ECLOSED;
  }
  nccl_result state = NCCL_SUCCESS;
  nccl_result r = api.comm_get_async_error(g->comm, &state);
  if (r != NCCL_SUCCESS) {
    nccl_err(err, errlen, "ncclCommGetAsyncError", g->comm, r);
    return MOK_EENGINE;
  }
  if (state != NCCL_SUCCESS && state != NCCL_IN_PROGRESS) {
    nccl_err(err, errlen, "the communicator", g->comm, state);
    return MOK_EENGINE;
  }
  return MOK_OK;
}

void mok_nccl_group_abort(mok_nccl_group *g) {
  if (!g || !g->comm || g->aborted) return;
  api.comm_abort(g->comm);
  g->aborted = true;
}

void mok_nccl_group_destroy(mok_nccl_group *g) {
  if (!g) return;
  int saved_dev = -1;
  if (cudaGetDevice(&saved_dev) != cudaSuccess) saved_dev = -1;
  if (cudaSetDevice(g->device) == cudaSuccess) cudaDeviceSynchronize();
  (void)cudaGetLastError();
  group_free(g, false);
  if (g->aborted) g->comm = NULL; /* freed by ncclCommAbort */
  free(g);
  if (saved_dev >= 0) cudaSetDevice(saved_dev);
  (void)cudaGetLastError();
}

#endif /* MOK_HAVE_CUDA */
