/* SPDX-License-Identifier: Apache-2.0 */
/* CUDA device memory and stream ordering in libmok (docs/cuda.md).
 *
 * libmok never links libcuda: the driver is opened with dlopen only when a
 * job names memory that is not a mok_host_alloc region, or a stream is
 * used, so libmok loads and works on machines without a GPU.
 *
 * Device memory: the allocation holding a pointer is found with
 * cuMemGetAddressRange and registered once (a legacy IPC handle for
 * cudaMalloc memory, a POSIX fd for cuMemCreate memory); the cache entry
 * remembers the allocation's buffer id, so memory freed and allocated again
 * at the same address is registered anew.
 *
 * Streams: the session header page (mapped from the session memfd) holds the
 * GPU sync words of proto/mok_wire.h; libmok registers it with
 * cuMemHostRegister (device-mapped) on first use.
 */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"
#include "rpc.h"

/* The few driver types and values used here (cuda.h, CUDA 12/13 ABI). */
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef int CUstreamCaptureMode; /* CU_STREAM_CAPTURE_MODE_{GLOBAL,THREAD_LOCAL,RELAXED} */
typedef struct {
  char reserved[64];
} CUipcMemHandle;
enum {
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
  CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
  CU_MEMORYTYPE_DEVICE = 2,
  CU_MEMHOSTREGISTER_PORTABLE = 1,
  CU_MEMHOSTREGISTER_DEVICEMAP = 2,
  CU_STREAM_WAIT_VALUE_GEQ = 0,
  CU_STREAM_WAIT_VALUE_EQ = 1,
  CU_STREAM_WRITE_VALUE_DEFAULT = 0,
  CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
  CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
  CU_STREAM_CAPTURE_MODE_RELAXED = 2,
};

typedef struct cuda_api {
  void *dl;
  CUresult (*init)(unsigned);
  CUresult (*error_string)(CUresult, const char **);
  CUresult (*ctx_get_current)(CUcontext *);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*stream_get_ctx)(CUstream, CUcontext *);
  CUresult (*pointer_get_attribute)(void *, int, CUdeviceptr);
  CUresult (*get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*ipc_get_mem_handle)(CUipcMemHandle *, CUdeviceptr);
  CUresult (*retain_allocation_handle)(CUmemGenericAllocationHandle *, void *);
  CUresult (*export_to_shareable_handle)(void *, CUmemGenericAllocationHandle, int,
                                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*host_register)(void *, size_t, unsigned);
  CUresult (*host_unregister)(void *);
  CUresult (*host_get_device_pointer)(CUdeviceptr *, void *, unsigned);
  CUresult (*write64)(CUstream, CUdeviceptr, unsigned long long, unsigned);
  CUresult (*wait64)(CUstream, CUdeviceptr, unsigned long long, unsigned);
  CUresult (*exchange_capture_mode)(CUstreamCaptureMode *);
} cuda_api;

static cuda_api api;
static int api_state; /* 0 untried, 1 loaded, -1 failed */
static char api_error[200];
static pthread_mutex_t api_lock = PTHREAD_MUTEX_INITIALIZER;

static int load_api(void) {
  pthread_mutex_lock(&api_lock);
  if (api_state != 0) {
    pthread_mutex_unlock(&api_lock);
    return api_state;
  }
  api_state = -1;
  void *dl = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    snprintf(api_error, sizeof api_error, "cannot load the CUDA driver (libcuda.so.1): %s",
             dlerror());
    pthread_mutex_unlock(&api_lock);
    return -1;
  }
  struct {
    const char *name;
    void **fn;
  } syms[] = {
      {"cuInit", (void **)&api.init},
      {"cuGetErrorString", (void **)&api.error_string},
      {"cuCtxGetCurrent", (void **)&api.ctx_get_current},
      {"cuCtxSetCurrent", (void **)&api.ctx_set_current},
      {"cuStreamGetCtx", (void **)&api.stream_get_ctx},
      {"cuPointerGetAttribute", (void **)&api.pointer_get_attribute},
      {"cuMemGetAddressRange_v2", (void **)&api.get_address_range},
      {"cuIpcGetMemHandle", (void **)&api.ipc_get_mem_handle},
      {"cuMemRetainAllocationHandle", (void **)&api.retain_allocation_handle},
      {"cuMemExportToShareableHandle", (void **)&api.export_to_shareable_handle},
      {"cuMemRelease", (void **)&api.mem_release},
      {"cuMemHostRegister_v2", (void **)&api.host_register},
      {"cuMemHostUnregister", (void **)&api.host_unregister},
      {"cuMemHostGetDevicePointer_v2", (void **)&api.host_get_device_pointer},
      {"cuStreamWriteValue64_v2", (void **)&api.write64},
      {"cuStreamWaitValue64_v2", (void **)&api.wait64},
      {"cuThreadExchangeStreamCaptureMode", (void **)&api.exchange_capture_mode},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    *syms[i].fn = dlsym(dl, syms[i].name);
    if (!*syms[i].fn) {
      snprintf(api_error, sizeof api_error, "the CUDA driver lacks %s", syms[i].name);
      dlclose(dl);
      pthread_mutex_unlock(&api_lock);
      return -1;
    }
  }
  CUresult r = api.init(0);
  if (r != 0) {
    snprintf(api_error, sizeof api_error, "cuInit failed (CUDA error %d): no usable GPU", r);
    pthread_mutex_unlock(&api_lock);
    return -1;
  }
  api.dl = dl;
  api_state = 1;
  pthread_mutex_unlock(&api_lock);
  return 1;
}

/* A registration may come while this thread captures a CUDA graph (the first
 * capture of a standing job names memory the graph's pool just handed out,
 * and the session's words are registered then). Host registration and IPC
 * export are not stream work, but the driver refuses them during a global or
 * thread-local capture; relaxed mode, for this thread and for the call only,
 * lets them through without touching the capture. */
static CUstreamCaptureMode capture_relax(void) {
  CUstreamCaptureMode m = CU_STREAM_CAPTURE_MODE_RELAXED;
  api.exchange_capture_mode(&m);
  return m;
}

static void capture_restore(CUstreamCaptureMode m) { api.exchange_capture_mode(&m); }

static CUresult host_register_relaxed(void *p, size_t bytes) {
  CUstreamCaptureMode m = capture_relax();
  CUresult r = api.host_register(p, bytes, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
  capture_restore(m);
  return r;
}

static const char *cu_error(CUresult r) {
  const char *s = NULL;
  if (api.error_string && api.error_string(r, &s) == 0 && s) return s;
  return "unknown CUDA error";
}

struct mok_cuda_state {
  dev_region *regions;
  size_t n, cap;
  void *sync_host;       /* registered header page (c->shm), NULL until first stream use */
  CUdeviceptr sync_dev;
  uint64_t next_signal;  /* the last done value handed out */
  void *standing_host;   /* the registered standing-job words, NULL until first used */
  CUdeviceptr standing_dev;
};

static mok_cuda_state *state(mok_client *c) {
  if (!c->cuda) c->cuda = calloc(1, sizeof *c->cuda);
  return c->cuda;
}

/* Is p device memory? (without loading the driver when no GPU use happened) */
static bool is_device_pointer(const void *p) {
  if (load_api() != 1) return false;
  unsigned int type = 0;
  if (api.pointer_get_attribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)p) != 0)
    return false;
  return type == CU_MEMORYTYPE_DEVICE;
}

static int register_device(mok_client *c, CUdeviceptr base, size_t size, uint32_t *ret_id) {
  int legacy = 0;
  CUresult r = api.pointer_get_attribute(&legacy, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                         base);
  Mok__RegisterBuffer rb = MOK__REGISTER_BUFFER__INIT;
  rb.bytes = size;
  CUipcMemHandle h;
  int fd = -1;
  if (r == 0 && legacy) {
    CUstreamCaptureMode m = capture_relax();
    r = api.ipc_get_mem_handle(&h, base);
    capture_restore(m);
    if (r != 0)
      return mok_set_error(MOK_EINVAL, "cuIpcGetMemHandle of device memory at 0x%llx: %s",
                           (unsigned long long)base, cu_error(r));
    rb.kind = MOK__BUFFER_KIND__BUFFER_CUDA_IPC;
    rb.cuda_ipc_handle.data = (uint8_t *)&h;
    rb.cuda_ipc_handle.len = sizeof h;
  } else {
    CUmemGenericAllocationHandle ah;
    r = api.retain_allocation_handle(&ah, (void *)base);
    if (r != 0)
      return mok_set_error(MOK_EINVAL,
                           "device memory at 0x%llx is neither cudaMalloc memory nor a cuMem "
                           "allocation (%s)",
                           (unsigned long long)base, cu_error(r));
    CUstreamCaptureMode m = capture_relax();
    r = api.export_to_shareable_handle(&fd, ah, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    capture_restore(m);
    api.mem_release(ah);
    if (r != 0)
      return mok_set_error(MOK_EINVAL,
                           "cannot export the cuMem allocation at 0x%llx as a POSIX fd (create "
                           "it with requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_"
                           "DESCRIPTOR): %s",
                           (unsigned long long)base, cu_error(r));
    rb.kind = MOK__BUFFER_KIND__BUFFER_CUDA_VMM_FD;
  }
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Mok__Reply *reply = NULL;
  int st = mok_rpc(c, &req, fd >= 0 ? &fd : NULL, fd >= 0 ? 1 : 0, &reply, NULL, NULL);
  if (fd >= 0) close(fd);
  if (st != MOK_OK) return st;
  if (reply->body_case != MOK__REPLY__BODY_REGISTER_BUFFER) st = MOK_EPROTO;
  else *ret_id = reply->register_buffer->region_id;
  mok__reply__free_unpacked(reply, NULL);
  return st == MOK_OK ? st : mok_set_error(st, "register reply without a region id");
}

static void unregister_id(mok_client *c, uint32_t id) {
  Mok__UnregisterBuffer ub = MOK__UNREGISTER_BUFFER__INIT;
  ub.region_id = id;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_UNREGISTER_BUFFER;
  req.unregister_buffer = &ub;
  Mok__Reply *reply = NULL;
  if (mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL) == MOK_OK)
    mok__reply__free_unpacked(reply, NULL);
}

int mok_cuda_resolve_locked(mok_client *c, const void *p, uint64_t bytes, uint32_t *ret_region,
                            uint64_t *ret_offset) {
  if (!is_device_pointer(p))
    return MOK_ENOENT;
  mok_cuda_state *cs = state(c);
  if (!cs) return mok_set_error(MOK_ENOMEM, "out of memory");
  CUdeviceptr a = (CUdeviceptr)p;
  unsigned long long bufid = 0;
  CUresult r = api.pointer_get_attribute(&bufid, CU_POINTER_ATTRIBUTE_BUFFER_ID, a);
  if (r != 0) return mok_set_error(MOK_EINVAL, "device pointer %p: %s", p, cu_error(r));
  for (size_t i = 0; i < cs->n; i++) {
    dev_region *d = &cs->regions[i];
    if (a < d->base || a - d->base >= d->size) continue;
    if (d->buffer_id != bufid) { /* freed and allocated again: the daemon maps the old one */
      unregister_id(c, d->id);
      cs->regions[i] = cs->regions[--cs->n];
      break;
    }
    if (bytes > d->size - (a - d->base))
      return mok_set_error(MOK_EBOUNDS, "%llu bytes at %p run past the end of its CUDA "
                           "allocation (%zu bytes from 0x%llx)",
                           (unsigned long long)bytes, p, d->size, (unsigned long long)d->base);
    *ret_region = d->id;
    *ret_offset = a - d->base;
    return MOK_OK;
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  r = api.get_address_range(&base, &size, a);
  if (r != 0) return mok_set_error(MOK_EINVAL, "cuMemGetAddressRange(%p): %s", p, cu_error(r));
  if (bytes > size - (a - base))
    return mok_set_error(MOK_EBOUNDS, "%llu bytes at %p run past the end of its CUDA "
                         "allocation (%zu bytes from 0x%llx)",
                         (unsigned long long)bytes, p, size, (unsigned long long)base);
  if (cs->n == cs->cap) {
    size_t cap = cs->cap ? 2 * cs->cap : 16;
    dev_region *n = realloc(cs->regions, cap * sizeof *n);
    if (!n) return mok_set_error(MOK_ENOMEM, "out of memory");
    cs->regions = n;
    cs->cap = cap;
  }
  uint32_t id = 0;
  int st = register_device(c, base, size, &id);
  if (st != MOK_OK) return st;
  cs->regions[cs->n++] = (dev_region){.base = base, .size = size, .buffer_id = bufid, .id = id};
  *ret_region = id;
  *ret_offset = a - base;
  return MOK_OK;
}

const char *mok_cuda_load_error(void) { return api_state == -1 ? api_error : ""; }

int mok_cuda_forget(mok_client *c, const void *dev_ptr) {
  pthread_mutex_lock(&c->lock);
  int st = mok_set_error(MOK_ENOENT, "%p is not in device memory registered with mokd", dev_ptr);
  mok_cuda_state *cs = c->cuda;
  CUdeviceptr a = (CUdeviceptr)dev_ptr;
  for (size_t i = 0; cs && i < cs->n; i++) {
    dev_region *d = &cs->regions[i];
    if (a < d->base || a - d->base >= d->size) continue;
    unregister_id(c, d->id);
    cs->regions[i] = cs->regions[--cs->n];
    st = MOK_OK;
    break;
  }
  pthread_mutex_unlock(&c->lock);
  return st;
}

/* ---- stream ordering ------------------------------------------------------------ */

static int sync_page_locked(mok_client *c, CUstream stream) {
  mok_cuda_state *cs = state(c);
  if (!cs) return mok_set_error(MOK_ENOMEM, "out of memory");
  if (cs->sync_host) return MOK_OK;
  if (load_api() != 1) return mok_set_error(MOK_EUNSUPPORTED, "%s", api_error);
  CUcontext ctx = NULL;
  api.ctx_get_current(&ctx);
  if (!ctx && stream && api.stream_get_ctx(stream, &ctx) == 0 && ctx) api.ctx_set_current(ctx);
  if (!ctx)
    return mok_set_error(MOK_EINVAL, "no current CUDA context on this thread (initialise CUDA, "
                         "e.g. cudaSetDevice, before submitting on a stream)");
  CUresult r = host_register_relaxed(c->shm, MOK_SHM_SQ_OFFSET);
  if (r != 0 && r != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
    return mok_set_error(MOK_EUNSUPPORTED, "cannot register the session's GPU sync page "
                         "(cuMemHostRegister: %s)", cu_error(r));
  CUdeviceptr d = 0;
  r = api.host_get_device_pointer(&d, c->shm, 0);
  if (r != 0) {
    api.host_unregister(c->shm);
    return mok_set_error(MOK_EUNSUPPORTED, "cuMemHostGetDevicePointer of the sync page: %s",
                         cu_error(r));
  }
  cs->sync_host = c->shm;
  cs->sync_dev = d;
  return MOK_OK;
}

int mok_cuda_fence_prepare_locked(mok_client *c, void *stream, uint64_t *ret_signal) {
  int st = sync_page_locked(c, (CUstream)stream);
  if (st != MOK_OK) return st;
  *ret_signal = c->cuda->next_signal + 1;
  return MOK_OK;
}

int mok_cuda_fence_release_locked(mok_client *c, void *stream, uint64_t ticket) {
  mok_cuda_state *cs = c->cuda;
  CUresult r = api.write64((CUstream)stream,
                           cs->sync_dev + MOK_SHM_SYNC_OFFSET + 8u * (ticket % MOK_RING_ENTRIES),
                           ticket, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r == 0) return MOK_OK;
  /* the job is in the ring already: release it from here, so that the
   * session's stream does not wait for a fence that will never come */
  *mok_shm_sync_fence(cs->sync_host, ticket) = ticket;
  return mok_set_error(MOK_EINVAL, "cuStreamWriteValue64 on the stream: %s (the job ran "
                       "unordered with the stream)", cu_error(r));
}

int mok_cuda_fence_after_locked(mok_client *c, void *stream, uint64_t signal) {
  mok_cuda_state *cs = c->cuda;
  cs->next_signal = signal;
  CUresult r = api.wait64((CUstream)stream, cs->sync_dev + MOK_SHM_SYNC_DONE_OFFSET, signal,
                          CU_STREAM_WAIT_VALUE_GEQ);
  if (r != 0) return mok_set_error(MOK_EIO, "cuStreamWaitValue64 on the stream: %s", cu_error(r));
  return MOK_OK;
}

int mok_cuda_standing_ops_locked(mok_client *c, void *stream, uint32_t slot) {
  int st = sync_page_locked(c, (CUstream)stream); /* the driver, a context */
  if (st != MOK_OK) return st;
  mok_cuda_state *cs = c->cuda;
  if (!cs->standing_host) {
    void *p = (char *)c->shm + MOK_SHM_STANDING_OFFSET;
    CUresult r = host_register_relaxed(p, MOK_SHM_STANDING_BYTES);
    if (r != 0 && r != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
      return mok_set_error(MOK_EUNSUPPORTED, "cannot register the session's standing-job words "
                           "(cuMemHostRegister: %s)", cu_error(r));
    CUdeviceptr d = 0;
    r = api.host_get_device_pointer(&d, p, 0);
    if (r != 0) {
      api.host_unregister(p);
      return mok_set_error(MOK_EUNSUPPORTED, "cuMemHostGetDevicePointer of the standing-job "
                           "words: %s", cu_error(r));
    }
    cs->standing_host = p;
    cs->standing_dev = d;
  }
  CUdeviceptr w = cs->standing_dev + (CUdeviceptr)slot * sizeof(mok_standing_words);
  CUdeviceptr trigger = w + offsetof(mok_standing_words, trigger);
  CUdeviceptr flag = w + offsetof(mok_standing_words, flag);
  /* the same three operations every time: what a graph capture may record */
  CUresult r = api.write64((CUstream)stream, trigger, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r == 0) r = api.wait64((CUstream)stream, flag, 1, CU_STREAM_WAIT_VALUE_EQ);
  if (r == 0) r = api.write64((CUstream)stream, flag, 0, CU_STREAM_WRITE_VALUE_DEFAULT);
  if (r != 0)
    return mok_set_error(MOK_EIO, "stream memory operation of a standing job: %s", cu_error(r));
  return MOK_OK;
}

void mok_cuda_client_free(mok_client *c) {
  mok_cuda_state *cs = c->cuda;
  if (!cs) return;
  if (cs->standing_host && api_state == 1) api.host_unregister(cs->standing_host);
  if (cs->sync_host && api_state == 1) api.host_unregister(cs->sync_host);
  free(cs->regions);
  free(cs);
  c->cuda = NULL;
}
