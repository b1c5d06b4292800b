/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda engine: docs/math.md on an sm_90a GPU through the kernel library
 * (kernels/mok_kernels.h), bf16 layers only. Design notes: docs/cuda.md.
 *
 * Jobs are asynchronous. start() enqueues a job on its session's stream:
 *   [wait for the client's fence] -> event0 -> reset the status word ->
 *   the steps of the op (the same chain as cpu/engine.c) -> copy the status
 *   word to pinned host memory -> [write the job's done value] -> event1
 * and returns at once; poll() asks event1 (cudaEventQuery) and only then
 * reads the job's status word. No host read of a device value happens
 * before the job completed. Each session owns its stream, status word, job
 * records and one workspace (everything a job needs that is not the
 * client's, for every layer of the session), sized by the jobs it runs and
 * grown stream-ordered at the start of a job that needs more, so a steady
 * loop allocates nothing; idle workspaces go back to the device. A layer
 * keeps only its config.
 *
 * Client memory is never trusted to steer the kernels (docs/cuda.md, "Copy,
 * check, use"): the job's routing ids are copied into the workspace and the
 * schedule is built there from the copy, then copied out to the client's
 * ctx or schedule tensor; a schedule the client brings is copied in and
 * validated there. Every kernel indexes only with the workspace's copies.
 *
 * Linking: only libcudart_static (which loads the driver lazily), never
 * -lcuda; the driver functions the runtime lacks (stream memory operations,
 * VMM import, address ranges) come from cudaGetDriverEntryPointByVersion.
 * On a machine without a GPU, open() fails with a message and mokd exits.
 *
 * Errors: a bad routing id or schedule raises the job's status word and
 * fails that job only. Any CUDA error that the context keeps (sticky: an
 * illegal address, a trap) marks the result fatal: the engine thread logs
 * it and mokd exits non-zero (docs/design.md, Operation).
 */
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda/internal.h"
#include "clock.h"
#include "engine.h"
#include "job_check.h"
#include "layer.h"
#include "log.h"
#include "mok_ep_kernels.h"
#include "mok_kernels.h"
#include "mok_slots.h"
#include "region.h"
#include "schedule.h"

static int drv_load(drv_api *d, char *err, size_t errlen) {
  struct {
    const char *name;
    void **fn;
  } syms[] = {
      {"cuStreamWaitValue64", (void **)&d->wait64},
      {"cuStreamWriteValue64", (void **)&d->write64},
      {"cuMemGetAddressRange", (void **)&d->get_address_range},
      {"cuMemImportFromShareableHandle", (void **)&d->import_handle},
      {"cuMemGetAllocationPropertiesFromHandle", (void **)&d->props_from_handle},
      {"cuMemGetAllocationGranularity", (void **)&d->granularity},
      {"cuMemAddressReserve", (void **)&d->address_reserve},
      {"cuMemAddressFree", (void **)&d->address_free},
      {"cuMemMap", (void **)&d->map},
      {"cuMemUnmap", (void **)&d->unmap},
      {"cuMemSetAccess", (void **)&d->set_access},
      {"cuMemRelease", (void **)&d->release},
      {"cuDeviceGetAttribute", (void **)&d->device_attribute},
      {"cuGetErrorString", (void **)&d->error_string},
      {"cuMemCreate", (void **)&d->mem_create},
      {"cuMemExportToShareableHandle", (void **)&d->export_handle},
  };
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
    enum cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSuccess;
    cudaError_t r =
        cudaGetDriverEntryPointByVersion(syms[i].name, syms[i].fn, 12000, cudaEnableDefault, &q);
    if (r != cudaSuccess || q != cudaDriverEntryPointSuccess || !*syms[i].fn) {
      snprintf(err, errlen, "cuda engine: the driver lacks %s (%s)", syms[i].name,
               r != cudaSuccess ? cudaGetErrorString(r) : "symbol not found");
      return MOK_EENGINE;
    }
  }
  return MOK_OK;
}

static _Thread_local int current_device = -1;

const char *mok__cuda_drv_error(const mok_engine *e, CUresult r) {
  const char *s = NULL;
  if (e->drv.error_string && e->drv.error_string(r, &s) == CUDA_SUCCESS && s) return s;
  return "unknown driver error";
}

int mok__cuda_use_device(mok_engine *e) {
  if (current_device == e->device) return MOK_OK;
  if (cudaSetDevice(e->device) != cudaSuccess) return MOK_EENGINE;
  current_device = e->device;
  return MOK_OK;
}

int mok__cuda_select(mok_engine *e, char *err, size_t errlen) {
  if (mok__cuda_use_device(e) == MOK_OK) return MOK_OK;
  snprintf(err, errlen, "cuda engine: cannot select GPU %d", e->device);
  return MOK_EENGINE;
}

/* After a failed CUDA call: does the context still work? A sticky error
 * (illegal address, trap, ...) poisons it for good. */
bool mok__cuda_context_broken(cudaStream_t stream) {
  cudaError_t r = stream ? cudaStreamQuery(stream) : cudaDeviceSynchronize();
  if (r == cudaSuccess || r == cudaErrorNotReady) {
    (void)cudaGetLastError();
    return false;
  }
  return true;
}

/* ---- regions' imports ------------------------------------------------------------ */

struct ipc_entry {
  uint8_t handle[64];
  void *ptr;      /* cudaIpcOpenMemHandle's mapping */
  CUdeviceptr alloc_base; /* the allocation's first byte in that mapping (its identity) */
  size_t size;    /* bytes from ptr to the allocation's end (cuMemGetAddressRange) */
  int refs;
  struct ipc_entry *next;
};

typedef struct vmm_import {
  CUdeviceptr va;
  size_t size;
  CUmemGenericAllocationHandle handle;
} vmm_import;

/* r->engine_handle of a CUDA region: the import and who registered it */
typedef struct cuda_region {
  mok_engine_session *s; /* counted in s->mapped_bytes (NULL: no session said) */
  uint64_t bytes;
  ipc_entry *ipc;        /* MOK_REGION_CUDA_IPC */
  vmm_import *vmm;       /* MOK_REGION_CUDA_VMM */
} cuda_region;

/* ---- open / close ---------------------------------------------------------------- */

/* A setting in ms as ns: the config's (its MOK_*_MS environment override
 * applied by config.c), else the default (0 means "the default"). */
static uint64_t ms_setting(uint32_t configured, uint32_t dflt) {
  return (uint64_t)(configured ? configured : dflt) * 1000000ull;
}

/* The pool session workspaces come from. Its memory is kept across frees
 * (a workspace that grows frees the old one and takes a new one) and given
 * back to the device by idle()'s trims. No reuse that inserts a dependency
 * on another stream: a session parked on its client's fence must never
 * hold another session's allocation. */
static int ws_pool_create(mok_engine *e, char *err, size_t errlen) {
  struct cudaMemPoolProps pp;
  memset(&pp, 0, sizeof pp);
  pp.allocType = cudaMemAllocationTypePinned;
  pp.handleTypes = cudaMemHandleTypeNone;
  pp.location.type = cudaMemLocationTypeDevice;
  pp.location.id = e->device;
  uint64_t keep = UINT64_MAX;
  int no = 0;
  cudaError_t r = cudaMemPoolCreate(&e->ws_pool, &pp);
  if (r == cudaSuccess)
    r = cudaMemPoolSetAttribute(e->ws_pool, cudaMemPoolAttrReleaseThreshold, &keep);
  if (r == cudaSuccess)
    r = cudaMemPoolSetAttribute(e->ws_pool, cudaMemPoolReuseAllowInternalDependencies, &no);
  if (r != cudaSuccess) {
    (void)cudaGetLastError();
    if (e->ws_pool) cudaMemPoolDestroy(e->ws_pool);
    e->ws_pool = NULL;
    snprintf(err, errlen, "cuda engine: cannot create the workspace memory pool: %s",
             cudaGetErrorString(r));
    return MOK_EENGINE;
  }
  return MOK_OK;
}

/* Does a VMM export's file name its allocation? Two exports of one
 * allocation (the first closed before the second is made) must give the
 * same (st_dev, st_ino), another allocation's export another one. Checked
 * on this driver with two small allocations; false: VMM regions get a
 * backing of their own import (aliasing between them is not seen). */
CUmemAllocationProp mok__cuda_vmm_fd_prop(const mok_engine *e) {
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = e->device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

static bool vmm_fds_name_allocations(mok_engine *e) {
  CUmemAllocationProp prop = mok__cuda_vmm_fd_prop(e);
  size_t gran = 0;
  if (e->drv.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) != CUDA_SUCCESS)
    return false;
  CUmemGenericAllocationHandle h[2] = {0, 0};
  struct stat st[3];
  bool ok = true;
  for (int i = 0; i < 3 && ok; i++) {
    int a = i < 2 ? 0 : 1, fd = -1; /* exports: A, A again, B */
    if (!h[a]) ok = e->drv.mem_create(&h[a], gran, &prop, 0) == CUDA_SUCCESS;
    ok = ok && e->drv.export_handle(&fd, h[a], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0) ==
                   CUDA_SUCCESS;
    ok = ok && fstat(fd, &st[i]) == 0;
    if (fd >= 0) close(fd);
  }
  for (int a = 0; a < 2; a++)
    if (h[a]) e->drv.release(h[a]);
  (void)cudaGetLastError();
  bool same = ok && st[0].st_dev == st[1].st_dev && st[0].st_ino == st[1].st_ino;
  bool other = ok && (st[0].st_dev != st[2].st_dev || st[0].st_ino != st[2].st_ino);
  log_info("cuda engine: VMM exports %s their allocation (one allocation twice: %s; another: %s)",
           same && other ? "name" : "do not name", !ok ? "?" : same ? "same file" : "other files",
           !ok ? "?" : other ? "another file" : "the same file");
  return same && other;
}

static int cuda_open(const mok_engine_config *cfg, mok_engine **ret, char *err, size_t errlen) {
  *ret = NULL;
  /* Load every kernel now, before the first CUDA call initialises the driver:
   * with lazy loading, a kernel's first launch loads its module, which waits
   * for the device, and a session stream parked on a client fence would hold
   * the engine thread (and every other tenant) until that fence came. */
  setenv("CUDA_MODULE_LOADING", "EAGER", 1);
  int n = 0;
  cudaError_t r = cudaGetDeviceCount(&n);
  if (r != cudaSuccess || n == 0) {
    snprintf(err, errlen,
             "cuda engine: no usable GPU (%s); run mokd with --engine cpu on machines "
             "without one",
             r != cudaSuccess ? cudaGetErrorString(r) : "no CUDA device");
    return MOK_EUNSUPPORTED;
  }
  int dev = cfg ? cfg->device : 0;
  if (dev < 0 || dev >= n) {
    snprintf(err, errlen, "cuda engine: --device %d, this machine has GPUs 0..%d", dev, n - 1);
    return MOK_EINVAL;
  }
  struct cudaDeviceProp p;
  if ((r = cudaGetDeviceProperties(&p, dev)) != cudaSuccess ||
      (r = cudaSetDevice(dev)) != cudaSuccess || (r = cudaFree(NULL)) != cudaSuccess) {
    snprintf(err, errlen, "cuda engine: cannot use GPU %d: %s", dev, cudaGetErrorString(r));
    return MOK_EENGINE;
  }
  if (p.major != 9 || p.minor != 0) {
    snprintf(err, errlen,
             "cuda engine: GPU %d (%s) is sm_%d%d; the kernels are built for sm_90a (Hopper)",
             dev, p.name, p.major, p.minor);
    return MOK_EUNSUPPORTED;
  }
  mok_engine *e = calloc(1, sizeof *e);
  if (!e) {
    snprintf(err, errlen, "cuda engine: out of memory");
    return MOK_ENOMEM;
  }
  e->device = dev;
  current_device = dev;
  int st = drv_load(&e->drv, err, errlen);
  if (st != MOK_OK) {
    free(e);
    return st;
  }
  int mem64 = 0;
  CUresult cr = e->drv.device_attribute(&mem64, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS,
                                        (CUdevice)dev);
  if (cr != CUDA_SUCCESS || !mem64)
    log_warn("cuda engine: GPU %d reports no 64-bit stream memory operations (%s): jobs "
             "with GPU fences will fail",
             dev, cr != CUDA_SUCCESS ? mok__cuda_drv_error(e, cr) : "attribute 0");
  /* Without MPS the trainer's context and mokd's time-slice: an empty job
   * through mokd measured +285 us on an H200 against +10 us under MPS
   * (tests/bench/bench_fence.cu; docs/cuda.md). Said once, at start. */
  int mps = 0;
  if (cudaDeviceGetAttribute(&mps, cudaDevAttrMpsEnabled, dev) == cudaSuccess && !mps)
    log_warn("cuda engine: GPU %d is not shared through MPS: the trainers' kernels and mokd's "
             "take turns on it (about 0.3 ms a job, and more on busy GPUs); run the MPS "
             "control daemon for full speed (README, 'Operating mokd')",
             dev);
  (void)cudaGetLastError();
  if (cudaStreamCreateWithFlags(&e->mem_stream, cudaStreamNonBlocking) != cudaSuccess) {
    snprintf(err, errlen, "cuda engine: cannot create a stream");
    free(e);
    return MOK_EENGINE;
  }
  /* the kernel library's choices, from mokd's environment (docs/cuda.md):
   * the library itself reads none */
  const mok_k_choices kc = {getenv("MOK_GEMM"), getenv("MOK_GEMM_VARIANT"),
                            getenv("MOK_GATHER_BESIDE"), getenv("MOK_GEMM_CUTLASS")};
  st = mok_k_init_with(&kc);
  if (st == MOK_OK) st = ws_pool_create(e, err, errlen);
  else if (st == MOK_EINVAL)
    snprintf(err, errlen, "cuda engine: %s", mok_k_choice_error());
  else
    snprintf(err, errlen, "cuda engine: kernel set-up failed (CUDA error %d: %s)",
             mok_k_last_cuda_error(), cudaGetErrorString((cudaError_t)mok_k_last_cuda_error()));
  if (st != MOK_OK) {
    cudaStreamDestroy(e->mem_stream);
    free(e);
    return st;
  }
  e->vmm_fd_identity = vmm_fds_name_allocations(e);
  /* mokd.conf's keys (the environment's overrides are in them: config.c) */
  e->fence_timeout_ns = ms_setting(cfg ? cfg->fence_timeout_ms : 0, DEFAULT_FENCE_TIMEOUT_MS);
  e->job_timeout_ns = ms_setting(cfg ? cfg->job_timeout_ms : 0, DEFAULT_JOB_TIMEOUT_MS);
  e->workspace_idle_ns = ms_setting(cfg ? cfg->workspace_idle_ms : 0, MOK_WORKSPACE_IDLE_MS);
  char bus[32] = "";
  cudaDeviceGetPCIBusId(bus, sizeof bus, dev);
  snprintf(e->description, sizeof e->description, "%.64s (sm_%d%d, %d SMs, %.0f GiB) GPU %d %.32s",
           p.name, p.major, p.minor, p.multiProcessorCount,
           (double)p.totalGlobalMem / (1024.0 * 1024.0 * 1024.0), dev, bus);
  mok__cuda_fence_watchdog_start(e);
  *ret = e;
  return MOK_OK;
}

static void cuda_close(mok_engine *e) {
  if (!e) return;
  mok__cuda_fence_watchdog_stop(e);
  if (mok__cuda_use_device(e) == MOK_OK) cudaDeviceSynchronize();
  while (e->ipc) { /* every region was released; nothing should be left */
    ipc_entry *n = e->ipc->next;
    cudaIpcCloseMemHandle(e->ipc->ptr);
    free(e->ipc);
    e->ipc = n;
  }
  if (e->mem_stream) {
    cudaStreamSynchronize(e->mem_stream);
    cudaStreamDestroy(e->mem_stream);
  }
  if (e->ws_pool) cudaMemPoolDestroy(e->ws_pool);
  free(e);
}

static const char *cuda_describe(const mok_engine *e) { return e ? e->description : "cuda"; }

/* ---- layers ------------------------------------------------------------------------- */

mok_k_dims mok__cuda_dims_of(const mok_layer_config *c, uint32_t tokens) {
  mok_k_dims d;
  d.T = (int)tokens;
  d.H = (int)c->hidden;
  d.I = (int)c->intermediate;
  d.E = (int)c->experts;
  d.E_loc = (int)c->local_experts;
  d.first_expert = (int)c->first_expert;
  d.K = (int)c->topk;
  d.I_s = (int)c->shared_intermediate;
  d.row_align = (int)c->row_align;
  d.has_limit = c->has_limit ? 1 : 0;
  d.limit = c->has_limit ? c->swiglu_limit : 0.0f;
  d.rows_limit = 0;
  d.no_tail = 0;
  return d;
}

/* The routed part of a group layer: the virtual batch of every member's
 * tokens, no shared expert, the group's capacity. */
mok_k_dims mok__cuda_group_dims(const mok_layer_config *c) {
  mok_k_dims d = mok__cuda_dims_of(c, c->group_world * c->group_tokens);
  d.I_s = 0;
  d.rows_limit = (int)c->group_rows;
  /* a member's rows in use are a fraction of the capacity: the kernels skip
   * the rest (the ctx's activation rows past them are zeroed on their own) */
  d.no_tail = 1;
  return d;
}

mok_k_dims mok__cuda_ring_dims(const mok_layer_config *c) {
  mok_k_dims d = mok__cuda_group_dims(c);
  d.rows_limit = (int)c->group_ring;
  return d;
}

/* Rows of a group layer's ring, 0 when one pass fits (no ring, or a ring
 * at least the capacity). */
static int ring_rows_of(const mok_layer_config *c) {
  if (!c->group_world || !c->group_ring) return 0;
  mok_k_dims dv = mok__cuda_group_dims(c);
  return (int64_t)c->group_ring < mok_k_rows_capacity(&dv) ? (int)c->group_ring : 0;
}

static int cuda_prepare_layer(mok_engine *e, mok_layer_config *cfg, char *err, size_t errlen) {
  (void)e;
  const bool fp8 = cfg->dtype == MOK_DTYPE_FP8_E4M3;
  if (cfg->dtype != MOK_DTYPE_BF16 && !fp8) {
    snprintf(err, errlen,
             "the cuda engine runs bfloat16 and fp8 layers (this one is %s); use dtype "
             "bfloat16, or the cpu engine for float32",
             cfg->dtype == MOK_DTYPE_F32 ? "float32" : "of an unknown dtype");
    return MOK_EUNSUPPORTED;
  }
  cfg->row_align = (uint32_t)mok_k_row_align();
  mok_k_dims d = mok__cuda_dims_of(cfg, cfg->max_tokens);
  char kerr[160];
  if (mok_k_check_dims(&d, kerr, sizeof kerr) != MOK_OK) {
    snprintf(err, errlen, "the cuda engine cannot run this layer: %s", kerr);
    return MOK_EUNSUPPORTED;
  }
  if (fp8) {
    int r = mok_layer_check_fp8_blocks(cfg, err, errlen);
    if (r != MOK_OK) return r;
    if (!mok_k_fp8_supported(&d)) {
      snprintf(err, errlen, "fp8 layers need the Hopper (sm_90a) FP8 kernels, which this GPU "
               "or driver cannot run");
      return MOK_EUNSUPPORTED;
    }
  }
  mok_sched_shape shape = {mok_layer_dims(cfg, cfg->max_tokens), cfg->experts, cfg->first_expert};
  int st = mok_schedule_shape_check(&shape, err, errlen);
  if (st != MOK_OK) return st;
  mok_layout_dims ld = mok_layer_dims(cfg, cfg->max_tokens);
  if ((uint64_t)mok_k_rows_capacity(&d) != mok_rows_capacity(&ld) ||
      (uint64_t)mok_k_schedule_ints(&d) != mok_schedule_ints(&ld)) {
    snprintf(err, errlen, "cuda engine: kernel and wire layouts disagree (build mismatch)");
    return MOK_EENGINE;
  }
  if (cfg->group_world) {
    /* the routed part runs on the group's virtual batch */
    mok_k_dims dv = mok__cuda_group_dims(cfg);
    if (mok_k_check_dims(&dv, kerr, sizeof kerr) != MOK_OK) {
      snprintf(err, errlen, "the cuda engine cannot run this layer on its group: %s", kerr);
      return MOK_EUNSUPPORTED;
    }
    mok_sched_shape vs = {mok_group_routed_dims(cfg), cfg->experts, cfg->first_expert};
    if ((st = mok_schedule_shape_check(&vs, err, errlen)) != MOK_OK) return st;
  }
  return MOK_OK;
}

void mok__cuda_free_async(void *p, cudaStream_t st) {
  if (p) cudaFreeAsync(p, st);
}

/* A layer keeps its config and the ring's sizes: nothing on the device. */
static int cuda_layer_open(mok_engine *e, const mok_layer_config *cfg, mok_engine_layer **ret,
                           char *err, size_t errlen) {
  (void)e;
  *ret = NULL;
  mok_engine_layer *l = calloc(1, sizeof *l);
  if (!l) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  l->cfg = *cfg;
  if (cfg->group_world && (l->ring_rows = ring_rows_of(cfg)) > 0) {
    mok_k_dims dv = mok__cuda_group_dims(cfg);
    l->ring_batches = mok_k_ring_batches(mok_k_rows_capacity(&dv), l->ring_rows, dv.E_loc);
  }
  *ret = l;
  return MOK_OK;
}

static void cuda_layer_close(mok_engine *e, mok_engine_layer *l) {
  (void)e;
  if (!l) return;
  if (l->owner) l->owner->layer_bytes -= sizeof *l;
  free(l);
}

/* ---- the session workspace's layout ----------------------------------------------------- */

static void take(size_t *at, size_t bytes, char *base, void **p) {
  if (!bytes) return; /* *p stays NULL */
  size_t off = (*at + 255u) & ~(size_t)255u;
  *at = off + bytes;
  if (base) *p = base + off;
}
#define TAKE(at, bytes, base, field) take((at), (bytes), (base), (void **)&(field))

static bool stage_weights_enabled(const mok_k_dims *d);

size_t mok__cuda_job_space(const mok_layer_config *cfg, uint32_t T, uint32_t op, uint32_t flags,
                           bool brings_acts, bool staging, char *base, job_ws *w) {
  job_ws none;
  if (!w) w = &none;
  memset(w, 0, sizeof *w);
  const bool fwd = op == MOK_OP_FORWARD, bwd = op == MOK_OP_BACKWARD, whole = fwd || bwd;
  const bool builds = fwd || (bwd && (flags & MOK_JOB_RECOMPUTE)) || op == MOK_OP_DISPATCH;
  const bool group = cfg->group_world != 0 && whole;
  mok_k_dims d = mok__cuda_dims_of(cfg, T);
  mok_layout_dims ld = mok_layer_dims(cfg, T);
  size_t H = cfg->hidden, I = cfg->intermediate, K = cfg->topk, I_s = cfg->shared_intermediate;
  size_t R = (size_t)mok_rows_capacity(&ld), sched = (size_t)mok_schedule_bytes(&ld);
  const bool fp8 = cfg->dtype == MOK_DTYPE_FP8_E4M3;
  size_t kernels = fp8 ? mok_k_fp8_workspace_bytes(&d) : mok_k_workspace_bytes(&d);
  size_t acts = (size_t)mok_acts_bytes(&ld);
  size_t kernels_aux = 0, ids = builds ? T * K * 4 : 0, ep = 0, ep_own = 0;
  size_t ring_acts = 0, ring_sched = 0, ring_plan = 0;
  if (group) {
    /* the routed part runs on the group's virtual batch (or a ring of it);
     * the own routing ids are copied into the group's buffer instead */
    mok_k_dims dv = mok__cuda_group_dims(cfg);
    mok_layout_dims lv = mok_group_routed_dims(cfg);
    R = (size_t)mok_rows_capacity(&lv);
    sched = (size_t)mok_schedule_bytes(&lv);
    /* fp8: the kernels' pieces and the quantised h, dg | du of the group's
     * rows; its routed rows' bytes and scales (f8_rq, f8_rs) below take R */
    kernels = fp8 ? mok_k_fp8_workspace_bytes(&dv) : mok_k_workspace_bytes(&dv);
    int ring = ring_rows_of(cfg); /* never for fp8 (engine_groups.c) */
    if (ring > 0) {
      /* the GEMMs' workspace for a macrobatch; the schedule build still
       * needs its histogram of the whole batch (dims of one row of capacity) */
      mok_k_dims dr = mok__cuda_ring_dims(cfg), hist_only = dv;
      hist_only.rows_limit = 1;
      R = (size_t)ring;
      kernels = mok_k_workspace_bytes(&dr);
      if (mok_k_workspace_bytes(&hist_only) > kernels) kernels = mok_k_workspace_bytes(&hist_only);
      ring_acts = R * I * 2;
      ring_sched = (size_t)mok_k_schedule_ints(&dr) * 4;
      ring_plan = (size_t)mok_k_ring_batches(mok_k_rows_capacity(&dv), ring, dv.E_loc) * 16;
    }
    acts = (size_t)(2 * mok_acts_routed_bytes(&lv) + 2 * mok_acts_shared_bytes(&ld));
    ids = 0;
    ep = (size_t)cfg->group_world * cfg->group_tokens * K * 4;
    ep_own = (size_t)T * K * 4;
    /* the shared expert on the side stream: its own workspace (fp8: it
     * quantises the own tokens into f8_tq, f8_ts, which only it uses) */
    if (I_s) kernels_aux = fp8 ? mok_k_fp8_workspace_bytes(&d) : mok_k_workspace_bytes(&d);
  }
  const bool uses_kernels = whole || op == MOK_OP_DISPATCH || op == MOK_OP_COMPUTE ||
                            op == MOK_OP_COMPUTE_BWD;
  const bool needs_acts = !brings_acts && (whole || op == MOK_OP_COMPUTE);
  size_t at = 0;
  TAKE(&at, op == MOK_OP_NOP ? 0 : sched, base, w->sched);
  TAKE(&at, ids, base, w->ids);
  TAKE(&at, uses_kernels ? kernels : 0, base, w->kernels);
  TAKE(&at, kernels_aux, base, w->kernels_aux);
  TAKE(&at, needs_acts ? acts : 0, base, w->acts);
  /* A bf16 layer of one GPU keeps one routed buffer (op_forward, op_backward):
   * x's rows, then y's over them; d_out's, then d_x's, then x's again
   * (mok_k_expert_backward_in_place). Its shared expert writes into the
   * client's out or d_x, which the K-sum reads back. */
  const bool one_buffer = !group && !fp8;
  TAKE(&at, whole ? R * H * 2 : 0, base, w->routed_a);
  TAKE(&at, whole && !one_buffer ? R * H * 2 : 0, base, w->routed_b);
  TAKE(&at, bwd && !one_buffer ? R * (H > I ? H : I) * 2 : 0, base, w->routed_c);
  TAKE(&at, whole && I_s && !one_buffer ? (size_t)T * H * 2 : 0, base, w->shared);
  TAKE(&at, ep, base, w->ep_ids);
  TAKE(&at, ep, base, w->ep_rw);
  TAKE(&at, ep, base, w->ep_drw);
  TAKE(&at, ep_own, base, w->ep_own);
  TAKE(&at, ring_acts, base, w->ring_g);
  TAKE(&at, ring_acts, base, w->ring_u);
  TAKE(&at, ring_sched, base, w->ring_sched);
  TAKE(&at, ring_plan, base, w->ring_plan);
  /* fp8: x or d_out quantised per token, and their routed rows */
  const bool quantises = fp8 && uses_kernels && op != MOK_OP_DISPATCH;
  TAKE(&at, quantises ? (size_t)T * H : 0, base, w->f8_tq);
  TAKE(&at, quantises ? (size_t)T * (H / 128) * 4 : 0, base, w->f8_ts);
  TAKE(&at, quantises ? R * H : 0, base, w->f8_rq);
  TAKE(&at, quantises ? R * (H / 128) * 4 : 0, base, w->f8_rs);
  const bool stages = !fp8 && staging && (bwd || op == MOK_OP_COMPUTE_BWD);
  TAKE(&at, stages ? 3 * (size_t)cfg->local_experts * I * H * 2 : 0, base, w->wstage);
  return (at + 255u) & ~(size_t)255u;
}

/* What a layer costs: nothing on the device for itself; the largest job
 * (a recomputing backward without a ctx, at max_tokens) sets the session
 * workspace it needs. */
static int cuda_layer_cost(mok_engine *e, const mok_layer_config *cfg,
                           mok_engine_layer_cost *ret, char *err, size_t errlen) {
  (void)e, (void)err, (void)errlen;
  mok_k_dims d = mok__cuda_dims_of(cfg, cfg->max_tokens);
  mok_layout_dims ld = mok_layer_dims(cfg, cfg->max_tokens);
  ret->layer_bytes = sizeof(mok_engine_layer);
  ret->workspace_bytes =
      mok__cuda_job_space(cfg, cfg->max_tokens, MOK_OP_BACKWARD, MOK_JOB_RECOMPUTE, false,
                          stage_weights_enabled(&d), NULL, NULL);
  ret->ctx_bytes = cfg->group_world ? mok_group_ctx_bytes(cfg, cfg->max_tokens)
                                    : mok_ctx_bytes(&ld);
  return MOK_OK;
}

/* ---- sessions ------------------------------------------------------------------------ */

/* The session's workspace goes back (no job of it runs or is queued). */
static void ws_release(mok_engine *e, mok_engine_session *s, cudaStream_t st) {
  if (!s->ws) return;
  mok__cuda_free_async(s->ws, st);
  s->ws = NULL;
  s->ws_bytes = 0;
  e->trim_until_ns = mok_clock_ns() + 10000000000ull; /* idle() trims the pool meanwhile */
}

static void session_free(mok_engine *e, mok_engine_session *s) {
  for (mok_engine_session **p = &e->sessions; *p; p = &(*p)->next)
    if (*p == s) {
      *p = s->next;
      break;
    }
  ws_release(e, s, e->mem_stream);
  for (int i = 0; i < MAX_JOBS; i++) {
    if (s->jobs[i].ev_start) cudaEventDestroy(s->jobs[i].ev_start);
    if (s->jobs[i].ev_done) cudaEventDestroy(s->jobs[i].ev_done);
    for (int m = 0; m < CUDA_MAX_MARKS; m++)
      if (s->jobs[i].marks[m]) cudaEventDestroy(s->jobs[i].marks[m]);
  }
  if (s->stream) cudaStreamDestroy(s->stream);
  if (s->aux) cudaStreamDestroy(s->aux);
  if (s->fork_ev) cudaEventDestroy(s->fork_ev);
  if (s->join_ev) cudaEventDestroy(s->join_ev);
  if (s->sync_dev) cudaHostUnregister(s->sync_host);
  if (s->standing_dev) cudaHostUnregister(s->standing_host);
  mok__cuda_free_async(s->d_status, s->mem_stream);
  /* the pool counts a stream-ordered free as done only once its stream was
   * synchronised; the memory stream carries nothing but frees */
  cudaStreamSynchronize(s->mem_stream);
  (void)cudaGetLastError();
  if (s->h_status_own) cudaFreeHost((void *)s->h_status);
  free(s);
}

static int cuda_session_open(mok_engine *e, void *sync_page, mok_engine_session **ret, char *err,
                             size_t errlen) {
  *ret = NULL;
  if (mok__cuda_select(e, err, errlen) != MOK_OK) return MOK_EENGINE;
  mok_engine_session *s = calloc(1, sizeof *s);
  if (!s) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  s->sync_host = sync_page;
  s->mem_stream = e->mem_stream;
  s->serial = ++e->next_session;
  s->next = e->sessions;
  e->sessions = s;
  cudaError_t r = cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking);
  if (r == cudaSuccess) r = cudaStreamCreateWithFlags(&s->aux, cudaStreamNonBlocking);
  if (r == cudaSuccess) r = cudaEventCreateWithFlags(&s->fork_ev, cudaEventDisableTiming);
  if (r == cudaSuccess) r = cudaEventCreateWithFlags(&s->join_ev, cudaEventDisableTiming);
  if (r == cudaSuccess) r = cudaMallocAsync((void **)&s->d_status, sizeof(int32_t), e->mem_stream);
  if (r == cudaSuccess) r = cudaStreamSynchronize(e->mem_stream);
  for (int i = 0; r == cudaSuccess && i < MAX_JOBS; i++) {
    s->jobs[i].slot = i;
    s->jobs[i].s = s;
    r = cudaEventCreate(&s->jobs[i].ev_start);
    if (r == cudaSuccess) r = cudaEventCreate(&s->jobs[i].ev_done);
  }
  if (r != cudaSuccess) {
    (void)cudaGetLastError();
    snprintf(err, errlen, "cuda engine: cannot set up the session's stream: %s",
             cudaGetErrorString(r));
    session_free(e, s);
    return MOK_EENGINE;
  }
  /* the GPU sync words: device-mapped host memory both processes see */
  void *dp = NULL;
  r = cudaHostRegister(sync_page, MOK_SHM_SQ_OFFSET, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (r == cudaSuccess) {
    r = cudaHostGetDevicePointer(&dp, sync_page, 0);
    if (r != cudaSuccess) cudaHostUnregister(sync_page);
  }
  if (r == cudaSuccess) {
    /* the standing-job words (docs/cuda.md "Capture and replay"): a
     * standing instance's stream writes its flag there */
    void *sp = (char *)sync_page + MOK_SHM_STANDING_OFFSET, *sdp = NULL;
    cudaError_t sr = cudaHostRegister(sp, MOK_SHM_STANDING_BYTES,
                                      cudaHostRegisterMapped | cudaHostRegisterPortable);
    if (sr == cudaSuccess && cudaHostGetDevicePointer(&sdp, sp, 0) != cudaSuccess) {
      cudaHostUnregister(sp);
      sr = cudaErrorUnknown;
    }
    if (sr == cudaSuccess) {
      s->standing_host = sp;
      s->standing_dev = (CUdeviceptr)(uintptr_t)sdp;
    } else {
      (void)cudaGetLastError();
      log_warn("cuda engine: the session's standing-job words cannot be registered (%s); "
               "standing jobs signal from the host", cudaGetErrorString(sr));
    }
    s->sync_dev = (CUdeviceptr)(uintptr_t)dp;
    /* the status words live in the pinned sync page too: no cudaFreeHost
     * (which waits for the device) when the session goes */
    s->h_status = (volatile int32_t *)((char *)sync_page + MOK_SHM_STATUS_OFFSET);
  } else {
    (void)cudaGetLastError();
    snprintf(s->sync_error, sizeof s->sync_error, "cudaHostRegister of the sync page: %s",
             cudaGetErrorString(r));
    log_warn("cuda engine: a session runs without GPU fences (%s)", s->sync_error);
    r = cudaHostAlloc((void **)&s->h_status, MAX_JOBS * sizeof(int32_t), 0);
    if (r != cudaSuccess) {
      (void)cudaGetLastError();
      snprintf(err, errlen, "cuda engine: cannot allocate pinned memory: %s",
               cudaGetErrorString(r));
      session_free(e, s);
      return MOK_ENOMEM;
    }
    s->h_status_own = true;
  }
  *ret = s;
  return MOK_OK;
}

static void cuda_session_close(mok_engine *e, mok_engine_session *s) {
  if (!s) return;
  mok__cuda_use_device(e);
  cudaStreamSynchronize(s->stream); /* nothing should be left; never free under running work */
  session_free(e, s);
}

static void cuda_session_memory(mok_engine *e, mok_engine_session *s, mok_session_memory *ret) {
  (void)e;
  memset(ret, 0, sizeof *ret);
  if (!s) return;
  ret->mapped_device_bytes = s->mapped_bytes;
  ret->workspace_bytes = s->ws_bytes;
  ret->layer_bytes = s->layer_bytes;
  ret->scratch_bytes = sizeof(int32_t); /* the job status word */
}

/* The pool's unused memory back to the device. A stream-ordered free counts
 * as done for the pool only once its stream was synchronised (H200, CUDA 13:
 * a trim left such a block held), and this runs about once a second for a
 * while after the last free. */
static void ws_pool_trim(mok_engine *e, uint64_t now) {
  if (now >= e->trim_until_ns || now < e->next_trim_ns) return;
  e->next_trim_ns = now + 1000000000ull;
  uint64_t reserved = 0, used = 0, after = 0;
  if (cudaMemPoolGetAttribute(e->ws_pool, cudaMemPoolAttrReservedMemCurrent, &reserved) !=
          cudaSuccess ||
      cudaMemPoolGetAttribute(e->ws_pool, cudaMemPoolAttrUsedMemCurrent, &used) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  if (reserved <= used) return;
  cudaError_t r = cudaMemPoolTrimTo(e->ws_pool, 0);
  if (r == cudaSuccess)
    r = cudaMemPoolGetAttribute(e->ws_pool, cudaMemPoolAttrReservedMemCurrent, &after);
  if (r != cudaSuccess) {
    log_warn("cuda engine: trimming the workspace pool: %s", cudaGetErrorString(r));
    (void)cudaGetLastError();
    return;
  }
  if (after < reserved)
    log_info("cuda engine: %llu MiB of workspace memory back to the device (%llu MiB held, %llu "
             "in use)",
             (unsigned long long)((reserved - after) >> 20), (unsigned long long)(after >> 20),
             (unsigned long long)(used >> 20));
}

/* The engine thread's housekeeping turn: workspaces of sessions with no job
 * running that were not used for workspace_idle_ms go back, and the pool
 * returns what it no longer holds for anyone to the device. */
static void cuda_idle(mok_engine *e, uint64_t now) {
  if (mok__cuda_use_device(e) != MOK_OK) return;
  bool freed = false;
  for (mok_engine_session *s = e->sessions; s; s = s->next) {
    bool running = false;
    for (int i = 0; i < MAX_JOBS && !running; i++) running = s->jobs[i].used;
    if (running) continue;
    if (s->free_pending) { /* a grown workspace's old one: its stream has nothing left */
      cudaStreamSynchronize(s->stream);
      (void)cudaGetLastError();
      s->free_pending = false;
      freed = true;
    }
    if (!s->ws || now < s->ws_used_ns || now - s->ws_used_ns < e->workspace_idle_ns) continue;
    log_info("cuda engine: session #%u: workspace of %zu MiB unused for %llu ms, given back",
             s->serial, s->ws_bytes >> 20, (unsigned long long)(e->workspace_idle_ns / 1000000));
    /* its last job completed: no stream still uses it, so the engine's
     * memory stream frees it and is waited for (it carries only frees of
     * memory nothing uses, never a fence) */
    ws_release(e, s, e->mem_stream);
    freed = true;
  }
  if (freed) {
    cudaStreamSynchronize(e->mem_stream);
    (void)cudaGetLastError();
    e->next_trim_ns = 0;
    if (e->trim_until_ns < now + 10000000000ull) e->trim_until_ns = now + 10000000000ull;
  }
  ws_pool_trim(e, now);
}

/* ---- regions --------------------------------------------------------------------------- */

/* r->backing.object2 of the CUDA kinds (object: the allocation's device
 * address, below 2^57; host memfds and VMM fds whose files name their
 * allocation use st_dev with a high bit set, and st_ino) */
#define BACKING_CUDA_IPC 0x6d6f6b2d69706300ull /* "mok-ipc" */
#define BACKING_CUDA_VMM 0x6d6f6b2d766d6d00ull /* "mok-vmm": object is the import's mapping */

static int import_ipc(mok_engine *e, const mok_region_source *src, mok_region *r, char *err,
                      size_t errlen) {
  cuda_region *cr = calloc(1, sizeof *cr);
  if (!cr) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  ipc_entry *en = e->ipc;
  while (en && memcmp(en->handle, src->ipc_handle, 64) != 0) en = en->next;
  if (!en) {
    en = calloc(1, sizeof *en);
    if (!en) {
      free(cr);
      snprintf(err, errlen, "out of memory");
      return MOK_ENOMEM;
    }
    cudaIpcMemHandle_t h;
    memcpy(&h, src->ipc_handle, sizeof h);
    cudaError_t ce = cudaIpcOpenMemHandle(&en->ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (ce != cudaSuccess) {
      (void)cudaGetLastError();
      free(en);
      free(cr);
      snprintf(err, errlen,
               "cannot open the CUDA IPC handle: %s (is the client on this machine, and its "
               "memory from cudaMalloc?)",
               cudaGetErrorString(ce));
      return MOK_EINVAL;
    }
    CUdeviceptr base = 0;
    size_t size = 0;
    CUresult dr = e->drv.get_address_range(&base, &size, (CUdeviceptr)(uintptr_t)en->ptr);
    if (dr != CUDA_SUCCESS) {
      cudaIpcCloseMemHandle(en->ptr);
      free(en);
      free(cr);
      snprintf(err, errlen, "cuMemGetAddressRange of an IPC mapping: %s",
               mok__cuda_drv_error(e, dr));
      return MOK_EENGINE;
    }
    en->alloc_base = base;
    en->size = size - (size_t)((CUdeviceptr)(uintptr_t)en->ptr - base);
    /* An allocation that is not whole 2 MiB pages is mapped here with small
     * pages: the layer's GEMMs on it ran up to 25 % slower (TLB misses;
     * docs/cuda.md, "The daemon boundary, measured"). PyTorch rounds its
     * segments to 2 MiB; a C client may not. Said once at warn level. */
    static bool warned_small_pages;
    if (size > (2u << 20) && size % (2u << 20) != 0) {
      if (!warned_small_pages)
        log_warn("cuda engine: a client's cudaMalloc allocation of %zu bytes is not a multiple of "
                 "2 MiB; mokd maps it with small pages and its jobs run slower (up to 25 %%): "
                 "round device allocations up to 2 MiB (further ones are logged at debug level)",
                 size);
      else
        log_debug("cuda engine: IPC allocation of %zu bytes is not a multiple of 2 MiB", size);
      warned_small_pages = true;
    }
    memcpy(en->handle, src->ipc_handle, 64);
    en->next = e->ipc;
    e->ipc = en;
  }
  if (src->offset > en->size || src->bytes > en->size - src->offset || src->bytes == 0) {
    snprintf(err, errlen,
             "buffer offset %llu + %llu bytes is outside the CUDA allocation of %zu bytes",
             (unsigned long long)src->offset, (unsigned long long)src->bytes, en->size);
    if (en->refs == 0) { /* just opened for this: close again */
      for (ipc_entry **p = &e->ipc; *p; p = &(*p)->next)
        if (*p == en) {
          *p = en->next;
          break;
        }
      cudaIpcCloseMemHandle(en->ptr);
      free(en);
    }
    free(cr);
    return MOK_EBOUNDS;
  }
  en->refs++;
  cr->ipc = en;
  r->kind = MOK_REGION_CUDA_IPC;
  r->base = (char *)en->ptr + src->offset;
  r->bytes = src->bytes;
  r->engine_handle = cr;
  /* one mapping per allocation in this process (handles are cached), so its
   * base names the allocation for as long as any region of it lives */
  r->backing.object = (uint64_t)en->alloc_base;
  r->backing.object2 = BACKING_CUDA_IPC;
  r->backing.offset = (uint64_t)((CUdeviceptr)(uintptr_t)r->base - en->alloc_base);
  return MOK_OK;
}

static int import_vmm(mok_engine *e, const mok_region_source *src, mok_region *r, char *err,
                      size_t errlen) {
  const drv_api *d = &e->drv;
  struct stat fst;
  if (e->vmm_fd_identity && fstat(src->fd, &fst) != 0) {
    snprintf(err, errlen, "fstat of the VMM fd: %s", strerror(errno));
    return MOK_EINVAL;
  }
  cuda_region *rec = calloc(1, sizeof *rec);
  vmm_import *v = calloc(1, sizeof *v);
  if (!v || !rec) {
    free(v);
    free(rec);
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  CUresult cr = d->import_handle(&v->handle, (void *)(intptr_t)src->fd,
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
  if (cr != CUDA_SUCCESS) {
    free(v);
    free(rec);
    snprintf(err, errlen, "cannot import the VMM fd: %s", mok__cuda_drv_error(e, cr));
    return MOK_EINVAL;
  }
  CUmemAllocationProp prop;
  memset(&prop, 0, sizeof prop);
  size_t gran = 0;
  const char *step = "cuMemGetAllocationPropertiesFromHandle";
  cr = d->props_from_handle(&prop, v->handle);
  if (cr == CUDA_SUCCESS) {
    step = "cuMemGetAllocationGranularity";
    cr = d->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
  }
  if (cr == CUDA_SUCCESS && (src->bytes == 0 || src->offset + src->bytes < src->offset)) {
    d->release(v->handle);
    free(v);
    free(rec);
    snprintf(err, errlen, "bad VMM buffer range");
    return MOK_EINVAL;
  }
  if (cr == CUDA_SUCCESS) {
    v->size = (size_t)((src->offset + src->bytes + gran - 1) / gran * gran);
    step = "cuMemAddressReserve";
    cr = d->address_reserve(&v->va, v->size, 0, 0, 0);
  }
  if (cr == CUDA_SUCCESS) {
    step = "cuMemMap (is the buffer larger than the allocation?)";
    cr = d->map(v->va, v->size, 0, v->handle, 0);
    if (cr != CUDA_SUCCESS) {
      d->address_free(v->va, v->size);
      v->va = 0;
    }
  }
  if (cr == CUDA_SUCCESS) {
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = e->device;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    step = "cuMemSetAccess";
    cr = d->set_access(v->va, v->size, &a, 1);
    if (cr != CUDA_SUCCESS) {
      d->unmap(v->va, v->size);
      d->address_free(v->va, v->size);
      v->va = 0;
    }
  }
  if (cr != CUDA_SUCCESS) {
    d->release(v->handle);
    free(v);
    free(rec);
    snprintf(err, errlen, "importing the VMM buffer: %s: %s", step, mok__cuda_drv_error(e, cr));
    return cr == CUDA_ERROR_INVALID_VALUE ? MOK_EBOUNDS : MOK_EINVAL;
  }
  rec->vmm = v;
  r->kind = MOK_REGION_CUDA_VMM;
  r->base = (void *)(uintptr_t)(v->va + src->offset);
  r->bytes = src->bytes;
  r->engine_handle = rec;
  if (e->vmm_fd_identity) { /* the fd's file names the allocation (checked at open) */
    r->backing.object = (uint64_t)fst.st_dev | (1ull << 62); /* nonzero; not a memfd's */
    r->backing.object2 = (uint64_t)fst.st_ino;
  } else { /* only this import: aliasing with another registration is not seen */
    r->backing.object = (uint64_t)v->va;
    r->backing.object2 = BACKING_CUDA_VMM;
  }
  r->backing.offset = src->offset;
  return MOK_OK;
}

static int cuda_region_import(mok_engine *e, const mok_region_source *src, mok_region *r,
                              char *err, size_t errlen) {
  if (mok__cuda_select(e, err, errlen) != MOK_OK) return MOK_EENGINE;
  int st;
  switch (src->kind) {
  case MOK_REGION_HOST_MEMFD: {
    /* the backing (the memfd's file) was filled when the engine thread mapped it */
    cudaError_t cr = cudaHostRegister(r->map_base, r->map_bytes,
                                      cudaHostRegisterMapped | cudaHostRegisterPortable);
    void *dp = NULL;
    if (cr == cudaSuccess) {
      cr = cudaHostGetDevicePointer(&dp, r->map_base, 0);
      if (cr != cudaSuccess) cudaHostUnregister(r->map_base);
    }
    if (cr != cudaSuccess) {
      (void)cudaGetLastError();
      snprintf(err, errlen, "cannot map %llu bytes of host memory for the GPU: %s",
               (unsigned long long)r->map_bytes, cudaGetErrorString(cr));
      return MOK_ENOMEM;
    }
    r->base = (char *)dp + ((char *)r->base - (char *)r->map_base);
    r->engine_handle = r->map_base; /* registered */
    return MOK_OK;
  }
  case MOK_REGION_CUDA_IPC: st = import_ipc(e, src, r, err, errlen); break;
  case MOK_REGION_CUDA_VMM: st = import_vmm(e, src, r, err, errlen); break;
  default:
    snprintf(err, errlen, "unknown buffer kind %d", src->kind);
    return MOK_EINVAL;
  }
  if (st == MOK_OK) {
    cuda_region *rec = r->engine_handle;
    rec->s = src->session;
    rec->bytes = r->bytes;
    if (rec->s) rec->s->mapped_bytes += rec->bytes;
  }
  return st;
}

static void cuda_region_release(mok_engine *e, mok_region *r) {
  if (!r->engine_handle) return;
  mok__cuda_use_device(e);
  if (r->kind == MOK_REGION_HOST_MEMFD) {
    cudaHostUnregister(r->map_base);
    (void)cudaGetLastError();
    r->engine_handle = NULL;
    return;
  }
  cuda_region *rec = r->engine_handle;
  if (rec->s) rec->s->mapped_bytes -= rec->bytes;
  if (rec->ipc && --rec->ipc->refs == 0) {
    ipc_entry *en = rec->ipc;
    for (ipc_entry **p = &e->ipc; *p; p = &(*p)->next)
      if (*p == en) {
        *p = en->next;
        break;
      }
    cudaIpcCloseMemHandle(en->ptr);
    free(en);
  }
  if (rec->vmm) {
    vmm_import *v = rec->vmm;
    e->drv.unmap(v->va, v->size);
    e->drv.address_free(v->va, v->size);
    e->drv.release(v->handle);
    free(v);
  }
  free(rec);
  (void)cudaGetLastError();
  r->engine_handle = NULL;
}

/* ---- one job ----------------------------------------------------------------------------- */

void mok__cuda_job_fail(job_ctx *c, int status, const char *fmt, ...) {
  if (c->failed) return;
  c->failed = true;
  c->j->status = status;
  int n = snprintf(c->j->message, sizeof c->j->message, "%s: ", mok_op_name(c->a->op));
  if (n < 0 || n >= (int)sizeof c->j->message) n = 0;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->j->message + n, sizeof c->j->message - (size_t)n, fmt, ap);
  va_end(ap);
}

/* A launcher's result: MOK_EINVAL means the kernels refused the arguments. */
void mok__cuda_launched(job_ctx *c, int st, const char *what) {
  if (st == MOK_OK && c->mark_steps) mok__cuda_mark(c, what);
  if (st == MOK_OK || c->failed) return;
  if (st == MOK_EENGINE) {
    int ce = mok_k_last_cuda_error();
    mok__cuda_job_fail(c, MOK_EENGINE, "%s: CUDA launch failed: %s", what,
             cudaGetErrorString((cudaError_t)ce));
  } else {
    mok__cuda_job_fail(c, st, "%s: the kernels refused the arguments (alignment or dims)", what);
  }
}


static bool ranges_overlap(const void *a, size_t an, const void *b, size_t bn) {
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return b && an && bn && x < y + bn && y < x + an;
}

void mok__cuda_flush_moves(job_ctx *c) {
  if (!c->n_moves) return;
  int n = c->n_moves;
  c->n_moves = 0;
  if (c->failed) return;
  int st = mok_k_moves(c->moves, n, c->st);
  if (st != MOK_OK) mok__cuda_launched(c, st, "mok_k_moves");
  else if (c->mark_steps) mok__cuda_mark(c, "moves");
  mok__cuda_record_start(c);
}

void mok__cuda_record_start(job_ctx *c) {
  if (!c->start_pending) return;
  c->start_pending = false;
  if (cudaEventRecord(c->j->ev_start, c->st) != cudaSuccess) (void)cudaGetLastError();
}

/* Into the batch when small (true), after the pending moves if it depends
 * on them (a move of one batch runs beside the others); take: src is
 * zeroed once copied (mok_k_move). */
static bool batch_move(job_ctx *c, void *dst, const void *src, size_t bytes, bool take) {
  if (!c->batch_moves || bytes > MOK_K_MOVE_BYTES_MAX) {
    mok__cuda_flush_moves(c); /* the copy engine's operation comes after them */
    return false;
  }
  for (int i = 0; i < c->n_moves; i++) {
    const mok_k_move *m = &c->moves[i];
    if (ranges_overlap(dst, bytes, m->dst, m->bytes) || ranges_overlap(dst, bytes, m->src, m->bytes) ||
        (src && ranges_overlap(src, bytes, m->dst, m->bytes))) {
      mok__cuda_flush_moves(c);
      break;
    }
  }
  if (c->n_moves == MOK_K_MOVES_MAX) mok__cuda_flush_moves(c);
  c->moves[c->n_moves++] = (mok_k_move){.dst = dst, .src = src, .bytes = bytes, .take = take};
  return true;
}

void mok__cuda_memset_async(job_ctx *c, void *p, size_t bytes) {
  if (c->failed || !bytes) return;
  if (batch_move(c, p, NULL, bytes, false)) return;
  mok__cuda_record_start(c);
  cudaError_t r = cudaMemsetAsync(p, 0, bytes, c->st);
  if (r != cudaSuccess)
    mok__cuda_job_fail(c, MOK_EENGINE, "cudaMemsetAsync: %s", cudaGetErrorString(r));
  else if (c->mark_steps) mok__cuda_mark(c, "memset");
}

/* On the job's stream, between any of the client's memory (device or
 * device-mapped host) and the workspace. */
void mok__cuda_copy_async(job_ctx *c, void *dst, const void *src, size_t bytes) {
  if (c->failed || !bytes) return;
  if (batch_move(c, dst, src, bytes, false)) return;
  mok__cuda_record_start(c);
  cudaError_t r = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, c->st);
  if (r != cudaSuccess)
    mok__cuda_job_fail(c, MOK_EENGINE, "cudaMemcpyAsync: %s", cudaGetErrorString(r));
  else if (c->mark_steps) mok__cuda_mark(c, "copy");
}

/* acts at T (mok_wire.h); the bytes between each array's end and its
 * 256-byte boundary are zeroed as the cpu engine does */
acts_ptrs mok__cuda_acts_split(job_ctx *c, void *acts, bool zero_gaps) {
  acts_ptrs p = {0};
  uint64_t routed = mok_acts_routed_bytes(&c->ld), shared = mok_acts_shared_bytes(&c->ld);
  char *b = acts;
  p.g = (uint16_t *)b;
  p.u = (uint16_t *)(b + routed);
  p.gs = (uint16_t *)(b + 2 * routed);
  p.us = (uint16_t *)(b + 2 * routed + shared);
  if (zero_gaps) {
    size_t ru = (size_t)mok_rows_capacity(&c->ld) * c->ld.intermediate * 2;
    size_t su = (size_t)c->ld.tokens * c->ld.shared_intermediate * 2;
    mok__cuda_memset_async(c, (char *)p.g + ru, routed - ru);
    mok__cuda_memset_async(c, (char *)p.u + ru, routed - ru);
    mok__cuda_memset_async(c, (char *)p.gs + su, shared - su);
    mok__cuda_memset_async(c, (char *)p.us + su, shared - su);
  }
  return p;
}

/* The acts of a ctx (= schedule, zeros to 256, acts). */
acts_ptrs mok__cuda_ctx_acts(job_ctx *c, void *ctx) {
  return mok__cuda_acts_split(c, (char *)ctx + mok_align256(mok_schedule_bytes(&c->ld)), false);
}

/* ---- copy, check, use (docs/cuda.md) ----------------------------------------------------
 * The schedule every kernel reads is the workspace's: built there from the
 * workspace's copy of the routing ids, or copied there from the client and
 * validated there. The client's copies are written, never read back. */

/* The schedule from the job's topk_ids, each read once into the
 * workspace's copy, which is what the build uses. */
void mok__cuda_sched_build(job_ctx *c) {
  LAUNCH(c, mok_k_schedule_build_snapshot(&c->d, T_(c, MOK_SLOT_TOPK_IDS), c->w.ids, c->w.sched,
                                          c->w.kernels, c->status, c->st));
}

/* The workspace's schedule out to the client's (ctx or schedule tensor). */
void mok__cuda_sched_out(job_ctx *c, void *dst) {
  mok__cuda_copy_async(c, dst, c->w.sched, (size_t)mok_schedule_bytes(&c->ld));
}

/* The rest of a ctx a job writes beside its acts: the schedule and the
 * zeros of every gap. Nothing in the job reads them, so they go last, in
 * the one batch of moves that also takes the status word back (job_end):
 * one launch at the end instead of one before the first kernel and one
 * after the schedule build. */
void mok__cuda_ctx_out(job_ctx *c, void *ctx) {
  uint64_t sb = mok_schedule_bytes(&c->ld);
  mok__cuda_sched_out(c, ctx);
  mok__cuda_memset_async(c, (char *)ctx + sb, mok_align256(sb) - sb);
  (void)mok__cuda_acts_split(c, (char *)ctx + mok_align256(sb), true);
}

/* A schedule the client brings: copied in, validated, and only the copy used. */
const int32_t *mok__cuda_sched_in(job_ctx *c, const void *src) {
  mok__cuda_copy_async(c, c->w.sched, src, (size_t)mok_schedule_bytes(&c->ld));
  LAUNCH(c, mok_k_schedule_validate(&c->d, c->w.sched, c->status, c->st));
  return c->w.sched;
}

/* gather_x non-NULL: routed_x is the workspace's buffer and the routed rows
 * come from gather_x's (the Hopper gate/up producer reads them itself,
 * else the library copies them into routed_x first) */
static void step_compute(job_ctx *c, const int32_t *sched, const uint16_t *gather_x,
                         uint16_t *routed_x, const acts_ptrs *a, uint16_t *routed_y,
                         uint16_t *shared_y) {
  if (gather_x)
    LAUNCH(c, mok_k_expert_forward_gathering(&c->d, sched, gather_x, routed_x, BF(c, W_GATE),
                                             BF(c, W_UP), BF(c, W_DOWN), a->g, a->u, routed_y,
                                             c->w.kernels, c->status, c->st));
  else
    LAUNCH(c, mok_k_expert_forward(&c->d, sched, routed_x, BF(c, W_GATE), BF(c, W_UP),
                                   BF(c, W_DOWN), a->g, a->u, routed_y, c->w.kernels, c->status,
                                   c->st));
  if (c->d.I_s)
    LAUNCH(c, mok_k_shared_forward(&c->d, BF(c, X), BF(c, S_GATE), BF(c, S_UP), BF(c, S_DOWN),
                                   a->gs, a->us, shared_y, c->w.kernels, c->status, c->st));
}

/* The mma.sync dgrad GEMMs read the routed weights in column stripes
 * (N-major B). Through a client's CUDA IPC mapping that ran ~8x slower than
 * on memory the daemon allocated (H200: kimi-k2.7 backward 148 ms against
 * 18 ms staged), so a backward on that path first copies the weights into a
 * per-session buffer with a streaming device-to-device copy (a few ms at
 * these shapes). The Hopper kernels' TMA boxes read the mapping at full
 * speed (H200, kimi T=2048 through mokd: +11 % over in-process without the
 * copy, +40 % with it), so by default only the mma.sync path stages. The
 * staged weights are a piece of the session's workspace (mok__cuda_job_space).
 * MOK_CUDA_STAGE_WEIGHTS=1 / 0 forces staging on / off. */
static bool stage_weights_enabled(const mok_k_dims *d) {
  static int forced = -2; /* -1: not forced */
  if (forced == -2) {
    const char *v = getenv("MOK_CUDA_STAGE_WEIGHTS");
    forced = v && strcmp(v, "0") == 0 ? 0 : v && strcmp(v, "1") == 0 ? 1 : -1;
  }
  if (forced >= 0) return forced > 0;
  return !mok_k_backward_on_hopper(d);
}

void mok__cuda_stage_weights(job_ctx *c, const uint16_t **wg, const uint16_t **wu,
                             const uint16_t **wd) {
  size_t n = (size_t)c->d.E_loc * c->d.I * c->d.H * 2; /* bytes of one of the three */
  /* no staging piece: not enabled, or no room for it (the client's memory
   * then, slower but right) */
  if (c->failed || !c->w.wstage || n == 0) return;
  uint16_t *dst[3] = {c->w.wstage, c->w.wstage + n / 2, c->w.wstage + n};
  const uint16_t **src[3] = {wg, wu, wd};
  for (int i = 0; i < 3; i++) {
    mok__cuda_copy_async(c, dst[i], *src[i], n);
    *src[i] = dst[i];
  }
}

/* The routed and shared backward from the single-step jobs' tensors. */
static void step_compute_bwd(job_ctx *c, const int32_t *sched, const acts_ptrs *a,
                             const uint16_t *routed_x, const uint16_t *routed_dout,
                             uint16_t *routed_dx, uint16_t *shared_dx) {
  const uint16_t *wg = BF(c, W_GATE), *wu = BF(c, W_UP), *wd = BF(c, W_DOWN);
  mok__cuda_stage_weights(c, &wg, &wu, &wd);
  LAUNCH(c, mok_k_expert_backward(&c->d, sched, a->g, a->u, routed_x, routed_dout,
                                  (const float *)T_(c, MOK_SLOT_ROUTER_W), wg, wu, wd, routed_dx,
                                  (float *)T_(c, MOK_SLOT_D_RW), BF(c, D_W_GATE), BF(c, D_W_UP),
                                  BF(c, D_W_DOWN), c->w.kernels, c->status, c->st));
  if (c->d.I_s)
    LAUNCH(c, mok_k_shared_backward(&c->d, BF(c, X), BF(c, D_OUT), a->gs, a->us, BF(c, S_GATE),
                                    BF(c, S_UP), BF(c, S_DOWN), shared_dx, BF(c, D_S_GATE),
                                    BF(c, D_S_UP), BF(c, D_S_DOWN), c->w.kernels, c->status,
                                    c->st));
}

/* The whole forward in the workspace's one routed buffer: x's rows (or
 * none, where the gate/up producer reads x), then y's over them; the
 * shared expert's y goes into out, which combine reads back. */
static void op_forward(job_ctx *c) {
  void *ctx = T_(c, MOK_SLOT_CTX);
  const job_ws *w = &c->w;
  acts_ptrs a = ctx ? mok__cuda_ctx_acts(c, ctx) : mok__cuda_acts_split(c, w->acts, false);
  uint16_t *shared_y = c->d.I_s ? BF(c, OUT) : NULL;
  mok__cuda_sched_build(c);
  step_compute(c, w->sched, BF(c, X), w->routed_a, &a, w->routed_a, shared_y);
  LAUNCH(c, mok_k_combine(&c->d, w->sched, w->routed_a, (const float *)T_(c, MOK_SLOT_ROUTER_W),
                          shared_y, BF(c, OUT), c->status, c->st));
  if (ctx) mok__cuda_ctx_out(c, ctx);
}

/* The whole backward in the same one buffer: d_out's rows, the routed
 * backward in place over them (mok_k_expert_backward_in_place), the shared
 * expert's d_x first into d_x, which the K-sum reads back. */
static void op_backward(job_ctx *c) {
  void *ctx = T_(c, MOK_SLOT_CTX);
  const job_ws *w = &c->w;
  const int32_t *sched = w->sched;
  acts_ptrs a;
  if (c->a->flags & MOK_JOB_RECOMPUTE) {
    /* dispatch + compute again, bitwise as forward: acts from the same
     * kernel (the shared expert's y is not needed: d_x takes it, to be
     * overwritten) */
    a = ctx ? mok__cuda_ctx_acts(c, ctx) : mok__cuda_acts_split(c, w->acts, false);
    mok__cuda_sched_build(c);
    LAUNCH(c, mok_k_gather_rows(&c->d, sched, BF(c, X), w->routed_a, c->status, c->st));
    LAUNCH(c, mok_k_expert_recompute_acts(&c->d, sched, w->routed_a, BF(c, W_GATE), BF(c, W_UP),
                                          a.g, a.u, w->kernels, c->status, c->st));
    if (c->d.I_s)
      LAUNCH(c, mok_k_shared_forward(&c->d, BF(c, X), BF(c, S_GATE), BF(c, S_UP), BF(c, S_DOWN),
                                     a.gs, a.us, BF(c, D_X), w->kernels, c->status, c->st));
  } else if (!ctx) {
    mok__cuda_job_fail(c, MOK_EINVAL, "backward needs the forward's ctx, or the recompute flag");
    return;
  } else {
    a = mok__cuda_ctx_acts(c, ctx);
    sched = mok__cuda_sched_in(c, ctx);
  }
  const uint16_t *wg = BF(c, W_GATE), *wu = BF(c, W_UP), *wd = BF(c, W_DOWN);
  mok__cuda_stage_weights(c, &wg, &wu, &wd);
  uint16_t *shared_dx = c->d.I_s ? BF(c, D_X) : NULL;
  if (c->d.I_s)
    LAUNCH(c, mok_k_shared_backward(&c->d, BF(c, X), BF(c, D_OUT), a.gs, a.us, BF(c, S_GATE),
                                    BF(c, S_UP), BF(c, S_DOWN), shared_dx, BF(c, D_S_GATE),
                                    BF(c, D_S_UP), BF(c, D_S_DOWN), w->kernels, c->status, c->st));
  LAUNCH(c, mok_k_gather_rows(&c->d, sched, BF(c, D_OUT), w->routed_a, c->status, c->st));
  LAUNCH(c, mok_k_expert_backward_in_place(
                &c->d, sched, a.g, a.u, BF(c, X), w->routed_a,
                (const float *)T_(c, MOK_SLOT_ROUTER_W), wg, wu, wd, shared_dx, BF(c, D_X),
                (float *)T_(c, MOK_SLOT_D_RW), BF(c, D_W_GATE), BF(c, D_W_UP), BF(c, D_W_DOWN),
                w->kernels, c->status, c->st));
  if ((c->a->flags & MOK_JOB_RECOMPUTE) && ctx)
    mok__cuda_ctx_out(c, ctx); /* as the forward writes it */
}

void mok__cuda_op_step(job_ctx *c) {
  const void *client_sched = T_(c, MOK_SLOT_SCHEDULE);
  switch (c->a->op) {
  case MOK_OP_DISPATCH: {
    mok__cuda_sched_build(c);
    mok__cuda_sched_out(c, T_(c, MOK_SLOT_SCHEDULE));
    LAUNCH(c, mok_k_gather_rows(&c->d, c->w.sched, BF(c, X), BF(c, ROUTED_X), c->status, c->st));
    break;
  }
  case MOK_OP_COMPUTE: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    void *acts = T_(c, MOK_SLOT_ACTS);
    acts_ptrs a = mok__cuda_acts_split(c, acts ? acts : c->w.acts, acts != NULL);
    step_compute(c, s, NULL, BF(c, ROUTED_X), &a, BF(c, ROUTED_Y), BF(c, SHARED_Y));
    break;
  }
  case MOK_OP_COMBINE: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    LAUNCH(c, mok_k_combine(&c->d, s, BF(c, ROUTED_Y), (const float *)T_(c, MOK_SLOT_ROUTER_W),
                            BF(c, SHARED_Y), BF(c, OUT), c->status, c->st));
    break;
  }
  case MOK_OP_COMBINE_BWD: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    LAUNCH(c, mok_k_gather_rows(&c->d, s, BF(c, D_OUT), BF(c, ROUTED_DOUT), c->status, c->st));
    break;
  }
  case MOK_OP_COMPUTE_BWD: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    acts_ptrs a = mok__cuda_acts_split(c, T_(c, MOK_SLOT_ACTS), false);
    step_compute_bwd(c, s, &a, BF(c, ROUTED_X), BF(c, ROUTED_DOUT), BF(c, ROUTED_DX),
                     BF(c, SHARED_DX));
    break;
  }
  case MOK_OP_DISPATCH_BWD: {
    const int32_t *s = mok__cuda_sched_in(c, client_sched);
    LAUNCH(c, mok_k_dispatch_backward(&c->d, s, BF(c, ROUTED_DX), BF(c, SHARED_DX), BF(c, D_X),
                                      c->status, c->st));
    break;
  }
  default:
    mok__cuda_job_fail(c, MOK_EUNSUPPORTED, "op %u is not known to the cuda engine", c->a->op);
  }
}

/* ---- the job watchdog ------------------------------------------------------------------
 * A kernel cannot be stopped without ending the context (and every
 * tenant's work with it), so a job that runs far past its client fence is
 * reported, and its session's later jobs fail at once instead of queuing
 * behind it on the session's stream. Their done values are owed to the
 * client's stream and written, in stream order, once the job ends. */
static void stuck_message(const mok_engine *e, const mok_engine_session *s, char *m, size_t n) {
  snprintf(m, n, "the session's %s job is past job-timeout-ms (%llu ms): jobs fail until it ends",
           mok_op_name(s->stuck->op), (unsigned long long)(e->job_timeout_ns / 1000000ull));
}

static void watch_job_time(mok_engine *e, mok_engine_job *j, uint64_t now) {
  mok_engine_session *s = j->s;
  if (now == UINT64_MAX || j->overdue) return;
  if (!j->started_ns) { /* ev_start: after the fence wait (a single job: its first step) */
    cudaError_t q = cudaEventQuery(j->ev_start);
    if (q == cudaSuccess) j->started_ns = now;
    else if (q != cudaErrorNotReady) (void)cudaGetLastError();
    return;
  }
  if (now - j->started_ns <= e->job_timeout_ns) return;
  j->overdue = true;
  if (!s->stuck) s->stuck = j;
  log_error("cuda engine: session #%u: a %s job has run %.3f s since its client fence was "
            "released (job-timeout-ms %llu); its kernels cannot be stopped, the session's "
            "later jobs fail until it ends",
            s->serial, mok_op_name(j->op), (double)(now - j->started_ns) / 1e9,
            (unsigned long long)(e->job_timeout_ns / 1000000ull));
}

/* The overdue job j ended: the session takes jobs again, and the done
 * values its failed jobs owed go out after the jobs still on the stream. */
static void unstick(mok_engine *e, mok_engine_session *s, mok_engine_job *j, uint64_t now) {
  log_warn("cuda engine: session #%u: the overdue %s job ended after %.3f s; the session runs "
           "jobs again",
           s->serial, mok_op_name(j->op),
           now == UINT64_MAX || now < j->started_ns ? 0.0 : (double)(now - j->started_ns) / 1e9);
  s->stuck = NULL;
  if (!s->owed_signal) return;
  CUresult cr = e->drv.write64(s->stream, s->sync_dev + MOK_SHM_SYNC_DONE_OFFSET, s->owed_signal,
                               CU_STREAM_WRITE_VALUE_DEFAULT);
  if (cr != CUDA_SUCCESS) {
    /* in order from the host instead: after everything on the stream */
    log_warn("cuda engine: session #%u: writing the owed done value on the stream: %s",
             s->serial, mok__cuda_drv_error(e, cr));
    cudaStreamSynchronize(s->stream);
    volatile uint64_t *w = mok_shm_sync_done(s->sync_host);
    atomic_thread_fence(memory_order_seq_cst);
    if (*w < s->owed_signal) *w = s->owed_signal;
  }
  s->owed_signal = 0;
}

/* Host-side checks the daemon's generic validation does not make. */
bool mok__cuda_check_job(job_ctx *c) {
  const mok_job_args *a = c->a;
  if (c->s->stuck) {
    char m[MOK_JOB_MESSAGE_MAX];
    stuck_message(c->e, c->s, m, sizeof m);
    mok__cuda_job_fail(c, MOK_EBUSY, "%s", m);
    return false;
  }
  if (!c->l) {
    mok__cuda_job_fail(c, MOK_EINVAL, "the layer has no device state");
    return false;
  }
  if ((a->layer->dtype != MOK_DTYPE_BF16 && a->layer->dtype != MOK_DTYPE_FP8_E4M3) ||
      a->layer->row_align != (uint32_t)mok_k_row_align()) {
    mok__cuda_job_fail(c, MOK_EUNSUPPORTED, "the layer was not prepared by the cuda engine");
    return false;
  }
  char err[MOK_JOB_MESSAGE_MAX];
  int st = mok_job_check_tokens_op(a->layer, a->op, a->tokens, MOK_ELIMIT, err, sizeof err);
  if (st == MOK_OK) st = mok_job_check_flags_op(a->layer, a->op, a->flags, err, sizeof err);
  if (st != MOK_OK) {
    mok__cuda_job_fail(c, st, "%s", err);
    return false;
  }
  for (int s = 0; s < MOK_SLOT_COUNT_; s++) {
    const mok_tensor_view *t = &a->t[s];
    if (t->ptr && ((uintptr_t)t->ptr & 15u)) {
      mok__cuda_job_fail(c, MOK_EINVAL,
               "tensor '%s' is not 16-byte aligned (address ...%02x): the cuda engine needs "
               "every tensor at a multiple of 16 bytes in its buffer",
               mok_slot_name((uint32_t)s), (unsigned)((uintptr_t)t->ptr & 0xffu));
      return false;
    }
  }
  return true;
}

static mok_engine_job *take_job(mok_engine_session *s) {
  for (int i = 0; i < MAX_JOBS; i++)
    if (!s->jobs[i].used) return &s->jobs[i];
  return NULL;
}

/* lazy_start: the start event waits for the job's first kernel or moves
 * (job_ctx.start_pending); a group job, whose stream operations include
 * waits on its peers, records it at once. */
static mok_engine_job *job_begin(mok_engine *e, const mok_job_args *a, job_ctx *c,
                                 mok_engine_result *res, bool lazy_start) {
  const uint64_t entered_ns = mok__cuda_profiling() ? mok_clock_ns() : 0;
  res->status = MOK_OK;
  res->message[0] = '\0';
  mok_engine_session *s = a->session;
  if (!s || mok__cuda_use_device(e) != MOK_OK) {
    res->status = MOK_EENGINE;
    snprintf(res->message, sizeof res->message, "cuda engine: job without a session or device");
    return NULL;
  }
  mok_engine_job *j = take_job(s);
  if (!j) {
    res->status = MOK_EBUSY;
    snprintf(res->message, sizeof res->message, "too many jobs running in this session");
    return NULL;
  }
  j->used = true;
  j->op = a->op;
  j->fence_wait = a->fence_wait;
  j->fence_signal = a->fence_signal;
  j->host_signal = false;
  j->fence_forced = false;
  j->watch = -1;
  j->head_since = 0;
  j->started_ns = 0;
  j->overdue = false;
  j->reads_status = false;
  j->status = MOK_OK;
  j->message[0] = '\0';
  j->n_marks = 0;
  j->mark_label[0] = '\0';
  j->taken_ns = 0;
  memset(j->begin_ns, 0, sizeof j->begin_ns);
  j->device_posts = false;
  j->flag_written = false;
  *c = (job_ctx){.e = e, .s = s, .j = j, .a = a, .l = a->layer_state, .st = s->stream,
                 .status = s->d_status, .status_zero = s->status_zero};
  s->status_zero = false; /* until this job takes its word back */

  if ((a->fence_wait || a->fence_signal) && !s->sync_dev) {
    mok__cuda_job_fail(c, MOK_EUNSUPPORTED, "GPU fences are not available in this session (%s)",
             s->sync_error);
    j->host_signal = a->fence_signal != 0; /* still release the client's stream, in order */
  }
  log_debug("cuda engine: start %s, fence_wait %llu, fence_signal %llu", mok_op_name(a->op),
            (unsigned long long)a->fence_wait, (unsigned long long)a->fence_signal);
  CUresult cr = CUDA_SUCCESS;
  if (a->fence_wait && s->sync_dev)
    cr = e->drv.wait64(s->stream,
                       s->sync_dev + MOK_SHM_SYNC_OFFSET + 8u * (a->fence_wait % MOK_RING_ENTRIES),
                       a->fence_wait, CU_STREAM_WAIT_VALUE_GEQ);
  const uint64_t waited_ns = entered_ns ? mok_clock_ns() : 0;
  if (cr != CUDA_SUCCESS)
    mok__cuda_job_fail(c, MOK_EENGINE, "cuStreamWaitValue64: %s", mok__cuda_drv_error(e, cr));
  else if (a->fence_wait && s->sync_dev)
    mok__cuda_fence_watch(e, j, mok_shm_sync_fence(s->sync_host, a->fence_wait), a->fence_wait);
  if (lazy_start) c->start_pending = true;
  else cudaEventRecord(j->ev_start, s->stream);
  j->begin_ns[0] = entered_ns;
  j->begin_ns[1] = waited_ns;
  j->begin_ns[2] = entered_ns ? mok_clock_ns() : 0;
  return j;
}

bool mok__cuda_profiling(void) {
  static int on = -1;
  if (on < 0) {
    const char *v = getenv("MOK_CUDA_PROFILE");
    on = v && strcmp(v, "1") == 0;
  }
  return on > 0;
}

void mok__cuda_mark(job_ctx *c, const char *name) {
  mok_engine_job *j = c->j;
  if (c->failed || j->n_marks >= CUDA_MAX_MARKS) return;
  if (c->n_moves && strcmp(name, "moves") != 0) mok__cuda_flush_moves(c); /* marks them */
  cudaEvent_t *ev = &j->marks[j->n_marks];
  if (!*ev && cudaEventCreate(ev) != cudaSuccess) {
    (void)cudaGetLastError();
    *ev = NULL;
    return;
  }
  if (cudaEventRecord(*ev, c->st) != cudaSuccess) {
    (void)cudaGetLastError();
    return;
  }
  j->mark_cpu_ns[j->n_marks] = mok_clock_ns();
  j->mark_names[j->n_marks++] = name;
}

/* A mark's name for the log: a launch's text up to its '(' without the
 * library's prefix ("mok_k_gather_rows(&c->d, ..." -> "gather_rows"). */
static int mark_name_len(const char **name) {
  const char *s = *name;
  if (strncmp(s, "mok_k_", 6) == 0) s += 6;
  *name = s;
  const char *paren = strchr(s, '(');
  return paren ? (int)(paren - s) : (int)strlen(s);
}

/* "copy-in 0.12, barrier-1 0.03, ..." (ms from the previous mark; a single
 * job's marks also give the host's time to enqueue each step, in us, and
 * from taking the job to its first mark: "cpu: take 12.3, copy 4.1, ...") */
static void log_marks(mok_engine_job *j) {
  char buf[1024], cpu[768];
  size_t nc = 0;
  cpu[0] = '\0';
  const uint64_t *b = j->begin_ns;
  if (j->taken_ns && j->mark_cpu_ns[0] >= j->taken_ns && b[0] >= j->taken_ns && b[1] >= b[0] &&
      b[2] >= b[1] && j->mark_cpu_ns[0] >= b[2])
    nc += (size_t)snprintf(cpu, sizeof cpu,
                           "; cpu (us): take %.1f, to_start %.1f, fence_wait %.1f, "
                           "start_event %.1f, first_mark %.1f",
                           (double)(j->mark_cpu_ns[0] - j->taken_ns) / 1e3,
                           (double)(b[0] - j->taken_ns) / 1e3, (double)(b[1] - b[0]) / 1e3,
                           (double)(b[2] - b[1]) / 1e3, (double)(j->mark_cpu_ns[0] - b[2]) / 1e3);
  if (nc && b[3] >= j->mark_cpu_ns[0] && b[4] >= b[3] && b[5] >= b[4])
    nc += (size_t)snprintf(cpu + nc, sizeof cpu - nc, ", prepare_checks %.1f, prepare_workspace %.1f",
                           (double)(b[4] - b[3]) / 1e3, (double)(b[5] - b[4]) / 1e3);
  for (int i = 1; j->taken_ns && i < j->n_marks && nc < sizeof cpu - 48; i++) {
    const char *name = j->mark_names[i];
    int len = mark_name_len(&name);
    nc += (size_t)snprintf(cpu + nc, sizeof cpu - nc, ", %.*s %.1f", len, name,
                           (double)(j->mark_cpu_ns[i] - j->mark_cpu_ns[i - 1]) / 1e3);
  }
  size_t n = 0;
  float total = 0;
  for (int i = 1; i < j->n_marks && n < sizeof buf - 48; i++) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, j->marks[i - 1], j->marks[i]) != cudaSuccess) {
      (void)cudaGetLastError();
      return;
    }
    total += ms;
    const char *name = j->mark_names[i];
    int len = mark_name_len(&name);
    n += (size_t)snprintf(buf + n, sizeof buf - n, "%s%.*s %.4f", i > 1 ? ", " : "", len, name,
                          (double)ms);
  }
  log_info("cuda engine: %s phases (ms)%s: %s; total %.4f%s", mok_op_name(j->op), j->mark_label,
           buf, (double)total, cpu);
}

/* What a fresh workspace is filled with: 0, or MOK_CUDA_WS_FILL (a byte; for
 * tests: results must not change with it, so no kernel reads a workspace
 * byte its job did not write first). */
static int ws_fill_byte(void) {
  static int fill = -1;
  if (fill < 0) {
    const char *v = getenv("MOK_CUDA_WS_FILL");
    fill = v && *v ? (int)(strtoul(v, NULL, 0) & 0xffu) : 0;
  }
  return fill;
}

size_t mok__cuda_ws_roomy(size_t need, size_t most) {
  const size_t round = (size_t)2 << 20;
  size_t roomy = (need + need / 8 + round - 1) / round * round;
  if (roomy > most) roomy = most > need ? most : need;
  return roomy;
}

/* The session's workspace holds at least need bytes, stream-ordered on its
 * stream: the old one is freed after the jobs before this one, the new one
 * is taken (with headroom, so that a loop of similar jobs never grows it
 * again, but never past most: what the layer's job of this kind needs at its
 * max_tokens, which no later one of them passes) and zeroed, so no byte
 * another tenant used before is ever seen. */
static cudaError_t ws_reserve(job_ctx *c, size_t need, size_t most) {
  mok_engine_session *s = c->s;
  if (s->ws_bytes >= need) return cudaSuccess;
  size_t tries[2] = {mok__cuda_ws_roomy(need, most), need};
  if (s->ws) s->free_pending = true; /* freed after the jobs before this one: idle() syncs */
  ws_release(c->e, s, c->st);
  cudaError_t r = cudaSuccess;
  for (int i = 0; i < 2; i++) {
    void *p = NULL;
    r = cudaMallocFromPoolAsync(&p, tries[i], c->e->ws_pool, c->st);
    if (r != cudaSuccess) {
      (void)cudaGetLastError();
      continue;
    }
    r = cudaMemsetAsync(p, ws_fill_byte(), tries[i], c->st);
    if (r != cudaSuccess) {
      cudaFreeAsync(p, c->st);
      return r;
    }
    s->ws = p;
    s->ws_bytes = tries[i];
    s->ws_grows++;
    log_debug("cuda engine: session #%u: workspace %zu MiB for a %s job of %u tokens (grown %u "
              "times)",
              s->serial, s->ws_bytes >> 20, mok_op_name(c->a->op), c->a->tokens, s->ws_grows);
    return cudaSuccess;
  }
  return r;
}

/* The job's pieces of the session's workspace (grown when it needs more). */
/* The workspace a job of this kind needs at T tokens: its own layout and,
 * for a forward that saves its ctx, the backward's from it (training: the
 * backward follows; take its room now rather than grow, as a growth holds
 * both sizes until the session next idles). */
static size_t job_room(const job_ctx *c, uint32_t T, bool brings_acts, bool staging) {
  const mok_job_args *a = c->a;
  size_t need = mok__cuda_job_space(a->layer, T, a->op, a->flags, brings_acts, staging, NULL, NULL);
  if (a->op == MOK_OP_FORWARD && brings_acts) {
    const size_t bwd = mok__cuda_job_space(a->layer, T, MOK_OP_BACKWARD, 0, true,
                                           stage_weights_enabled(&c->d), NULL, NULL);
    if (bwd > need) need = bwd;
  }
  return need;
}

static bool job_workspace(job_ctx *c) {
  const mok_job_args *a = c->a;
  const bool whole = a->op == MOK_OP_FORWARD || a->op == MOK_OP_BACKWARD;
  const bool brings_acts = whole ? T_(c, MOK_SLOT_CTX) != NULL
                                 : a->op != MOK_OP_COMPUTE || T_(c, MOK_SLOT_ACTS) != NULL;
  bool staging = (a->op == MOK_OP_BACKWARD || a->op == MOK_OP_COMPUTE_BWD) &&
                 stage_weights_enabled(&c->d);
  size_t need = job_room(c, a->tokens, brings_acts, staging);
  cudaError_t r = cudaSuccess;
  if (c->s->ws_bytes < need) { /* its headroom stops at the same job at max_tokens */
    const uint32_t T_max = a->layer->max_tokens > a->tokens ? a->layer->max_tokens : a->tokens;
    r = ws_reserve(c, need, job_room(c, T_max, brings_acts, staging));
  }
  if (r != cudaSuccess && staging) { /* without the staged weights: slower, but it runs */
    staging = false;
    need =
        mok__cuda_job_space(a->layer, a->tokens, a->op, a->flags, brings_acts, false, NULL, NULL);
    r = ws_reserve(c, need, need);
  }
  if (r != cudaSuccess) {
    mok__cuda_job_fail(
        c, r == cudaErrorMemoryAllocation ? MOK_ENOMEM : MOK_EENGINE,
        "the session's workspace cannot grow to %zu MiB for this job (%u tokens): %s", need >> 20,
        a->tokens, cudaGetErrorString(r));
    return false;
  }
  mok__cuda_job_space(a->layer, a->tokens, a->op, a->flags, brings_acts, staging, c->s->ws, &c->w);
  c->s->ws_used_ns = mok_clock_ns();
  if (c->l->owner != c->s) { /* the session whose jobs run the layer holds it */
    if (c->l->owner) c->l->owner->layer_bytes -= sizeof *c->l;
    c->l->owner = c->s;
    c->s->layer_bytes += sizeof *c->l;
  }
  return true;
}

bool mok__cuda_job_prepare(job_ctx *c) {
  const mok_job_args *a = c->a;
  uint64_t *stamp = c->mark_steps ? c->j->begin_ns : NULL;
  if (stamp) stamp[3] = mok_clock_ns();
  if (a->op == MOK_OP_NOP || c->failed || !mok__cuda_check_job(c)) return false;
  c->d = mok__cuda_dims_of(a->layer, a->tokens);
  c->ld = mok_layer_dims(a->layer, a->tokens);
  if (stamp) stamp[4] = mok_clock_ns();
  if (!job_workspace(c)) return false;
  if (stamp) stamp[5] = mok_clock_ns();
  /* the status word from 0: already so when the session's last job took it
   * back (job_end), else reset here */
  if (!c->status_zero && !batch_move(c, c->s->d_status, NULL, sizeof(int32_t), false)) {
    cudaError_t r = cudaMemsetAsync(c->s->d_status, 0, sizeof(int32_t), c->st);
    if (r != cudaSuccess)
      mok__cuda_job_fail(c, MOK_EENGINE, "cudaMemsetAsync: %s", cudaGetErrorString(r));
  }
  /* read back at completion only: the word lands in pinned memory before ev_done */
  c->j->reads_status = true;
  return !c->failed;
}

static mok_engine_job *job_end(job_ctx *c, mok_engine_result *res) {
  mok_engine *e = c->e;
  mok_engine_session *s = c->s;
  mok_engine_job *j = c->j;
  const mok_job_args *a = c->a;
  /* the status word back: into the sync page through its device address
   * with the last moves when it is registered, and taken (left 0 for the
   * next job, which then needs no reset); else by the copy engine */
  if (j->reads_status && s->sync_dev && !c->failed &&
      batch_move(c, (void *)(uintptr_t)(s->sync_dev + MOK_SHM_STATUS_OFFSET + 4u * (unsigned)j->slot),
                 s->d_status, sizeof(int32_t), true)) {
    mok__cuda_flush_moves(c);
    if (c->failed) j->reads_status = false;
    else s->status_zero = true;
  } else if (j->reads_status) {
    mok__cuda_flush_moves(c);
    mok__cuda_record_start(c);
    cudaError_t r = cudaMemcpyAsync((void *)&s->h_status[j->slot], s->d_status, sizeof(int32_t),
                                    cudaMemcpyDeviceToHost, s->stream);
    if (r != cudaSuccess) {
      j->reads_status = false;
      mok__cuda_job_fail(c, MOK_EENGINE, "cudaMemcpyAsync: %s", cudaGetErrorString(r));
    } else if (c->mark_steps) {
      mok__cuda_mark(c, "status_out");
    }
  }
  CUresult cr;
  mok__cuda_flush_moves(c);
  mok__cuda_record_start(c); /* a job with no kernels: before its done value */
  if (a->fence_signal && s->sync_dev) {
    cr = e->drv.write64(s->stream, s->sync_dev + MOK_SHM_SYNC_DONE_OFFSET, a->fence_signal,
                        CU_STREAM_WRITE_VALUE_DEFAULT);
    if (cr != CUDA_SUCCESS) {
      mok__cuda_job_fail(c, MOK_EENGINE, "cuStreamWriteValue64: %s", mok__cuda_drv_error(e, cr));
      j->host_signal = true;
    }
  }
  if (a->standing_flag && s->standing_dev) {
    /* a standing instance: its client's stream waits for this flag (EQ 1) */
    CUdeviceptr f = s->standing_dev + (CUdeviceptr)((const volatile char *)a->standing_flag -
                                                    (const char *)s->standing_host);
    cr = e->drv.write64(s->stream, f, 1, CU_STREAM_WRITE_VALUE_DEFAULT);
    if (cr == CUDA_SUCCESS) j->flag_written = true;
    else mok__cuda_job_fail(c, MOK_EENGINE, "cuStreamWriteValue64 (standing flag): %s",
                            mok__cuda_drv_error(e, cr));
  }
  cudaError_t r = cudaEventRecord(j->ev_done, s->stream);
  if (r != cudaSuccess) {
    /* without the event the job cannot be followed: give up on the device */
    res->status = MOK_EENGINE;
    res->fatal = mok__cuda_context_broken(s->stream);
    snprintf(res->message, sizeof res->message, "cudaEventRecord: %s", cudaGetErrorString(r));
    res->flag_written = j->flag_written;
    if (!res->fatal) {
      cudaStreamSynchronize(s->stream);
      mok__cuda_fence_unwatch(e, j);
      j->used = false;
      if (j->host_signal) *mok_shm_sync_done(s->sync_host) = j->fence_signal;
      return NULL;
    }
    mok__cuda_fence_unwatch(e, j);
    j->used = false;
    return NULL;
  }
  if (c->failed && j->status == MOK_EENGINE && mok__cuda_context_broken(s->stream)) {
    res->status = MOK_EENGINE;
    res->fatal = 1;
    snprintf(res->message, sizeof res->message, "%s", j->message);
  }
  return j;
}

static mok_engine_job *start_single(mok_engine *e, const mok_job_args *a,
                                    mok_engine_result *res) {
  mok_engine_session *s = a->session;
  if (s && s->stuck) { /* fail at once; the done value goes out once the stuck job ends */
    res->status = MOK_EBUSY;
    res->fatal = 0;
    stuck_message(e, s, res->message, sizeof res->message);
    if (a->fence_signal && s->sync_dev && a->fence_signal > s->owed_signal)
      s->owed_signal = a->fence_signal;
    else if (a->fence_signal && !s->sync_dev && *mok_shm_sync_done(s->sync_host) < a->fence_signal)
      *mok_shm_sync_done(s->sync_host) = a->fence_signal; /* no GPU fences: nothing waits */
    return NULL;
  }
  job_ctx c;
  mok_engine_job *j = job_begin(e, a, &c, res, true);
  if (!j) return NULL;
  c.batch_moves = true;
  if (mok__cuda_profiling()) {
    /* every step's time, from here (the client's fence passed) */
    c.mark_steps = true;
    j->taken_ns = a->taken_ns;
    mok__cuda_mark(&c, "start");
  }
  if (mok__cuda_job_prepare(&c)) {
    if (c.mark_steps)
      snprintf(j->mark_label, sizeof j->mark_label, " T=%d H=%d I=%d E_loc=%d K=%d I_s=%d",
               (int)c.d.T, (int)c.d.H, (int)c.d.I, (int)c.d.E_loc, (int)c.d.K, (int)c.d.I_s);
    if (a->layer->dtype == MOK_DTYPE_FP8_E4M3) mok__cuda_fp8_job(&c);
    else if (a->op == MOK_OP_FORWARD) op_forward(&c);
    else if (a->op == MOK_OP_BACKWARD) op_backward(&c);
    else mok__cuda_op_step(&c);
  }
  return job_end(&c, res);
}

/* A job of this daemon alone, or of a layer on group g: the same frame, the
 * group job's work from cuda/ep.c. */
static mok_engine_job *cuda_start(mok_engine *e, struct mok_ep_group *g, const mok_job_args *a,
                                  mok_engine_result *res) {
  if (!g) return start_single(e, a, res);
  job_ctx c;
  if (!job_begin(e, a, &c, res, false)) return NULL;
  mok__cuda_group_job(&c, g, a);
  return job_end(&c, res);
}

static const char *status_text(int st, bool device_posts) {
  if (st == MOK_EINVAL && device_posts)
    return "members ran different jobs (op, layer tag, sizes or order), or a bad ctx";
  switch (st) {
  case MOK_EROUTE: return "a routing id is outside [0, experts) and not -1";
  case MOK_EINVAL: return "the schedule (or ctx) given failed validation";
  case MOK_EOVERFLOW:
    return "more routed rows than the group's capacity or ring: raise capacity or ring_rows";
  case MOK_ETIMEOUT:
    return "a group member missed a device barrier (timeout); group broken, re-join";
  default: return "the kernels reported an error";
  }
}

static int cuda_poll(mok_engine *e, mok_engine_job *j, uint64_t now, mok_engine_result *res) {
  mok_engine_session *s = j->s;
  mok__cuda_use_device(e);
  cudaError_t q = cudaEventQuery(j->ev_done);
  if (q == cudaErrorNotReady) {
    watch_job_time(e, j, now);
    mok__cuda_fence_check(e, j, now);
    return 0;
  }
  if (mok__cuda_fence_unwatch(e, j)) j->fence_forced = true; /* the watchdog released the wait */
  if (s->stuck == j) unstick(e, s, j, now);
  s->ws_used_ns = mok_clock_ns();
  res->fatal = 0;
  res->flag_written = j->flag_written;
  if (q != cudaSuccess) {
    res->status = MOK_EENGINE;
    res->fatal = 1;
    snprintf(res->message, sizeof res->message, "CUDA error while a %s job ran: %s",
             mok_op_name(j->op), cudaGetErrorString(q));
    j->used = false;
    return 1;
  }
  if (j->n_marks > 1) log_marks(j);
  if (j->host_signal && j->fence_signal) {
    volatile uint64_t *w = mok_shm_sync_done(s->sync_host);
    atomic_thread_fence(memory_order_seq_cst);
    if (*w < j->fence_signal) *w = j->fence_signal;
  }
  res->status = MOK_OK;
  res->message[0] = '\0';
  if (j->status != MOK_OK) {
    res->status = j->status;
    snprintf(res->message, sizeof res->message, "%s", j->message);
  } else if (j->reads_status && s->h_status[j->slot] != 0) {
    int st = s->h_status[j->slot];
    res->status = st;
    snprintf(res->message, sizeof res->message, "%s: %s", mok_op_name(j->op),
             status_text(st, j->device_posts));
  }
  if (j->fence_forced) {
    res->status = MOK_ETIMEOUT;
    snprintf(res->message, sizeof res->message,
             "%s: client fence %llu not written in %llu ms; wait released, outputs undefined",
             mok_op_name(j->op), (unsigned long long)j->fence_wait,
             (unsigned long long)(e->fence_timeout_ns / 1000000ull));
  }
  j->used = false;
  return 1;
}

const mok_engine_ops mok_engine_cuda = {
    .name = "cuda",
    .groups = MOK_ENGINE_GROUPS_ON_STREAM,
    .writes_standing_flag = true,
    .open = cuda_open,
    .close = cuda_close,
    .describe = cuda_describe,
    .prepare_layer = cuda_prepare_layer,
    .session_open = cuda_session_open,
    .session_close = cuda_session_close,
    .layer_open = cuda_layer_open,
    .layer_close = cuda_layer_close,
    .region_import = cuda_region_import,
    .region_release = cuda_region_release,
    .layer_cost = cuda_layer_cost,
    .session_memory = cuda_session_memory,
    .idle = cuda_idle,
    .start = cuda_start,
    .poll = cuda_poll,
    .group_new_id = mok__cuda_group_new_id,
    .group_attach = mok__cuda_group_attach,
    .group_form = mok__cuda_group_form,
    .group_install = mok__cuda_group_install,
    .group_discard = mok__cuda_group_discard,
};
