/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda engine's internals, shared by cuda/engine.c (single-daemon jobs)
 * and cuda/ep.c (jobs of a layer on an expert-parallel group). Not an
 * interface: both files are one engine. */
#ifndef MOK_ENGINE_CUDA_INTERNAL_H
#define MOK_ENGINE_CUDA_INTERNAL_H

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <time.h>

#include "engine.h"
#include "mok_kernels.h"

#define MAX_JOBS ((int)MOK_RING_ENTRIES) /* running jobs per session (the completion ring's size) */
#define DEFAULT_FENCE_TIMEOUT_MS 30000u
#define DEFAULT_JOB_TIMEOUT_MS 120000u
#define CUDA_MAX_MARKS 32

/* ---- driver entry points ---------------------------------------------------- */

typedef struct drv_api {
  CUresult (*wait64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  CUresult (*write64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
  CUresult (*get_address_range)(CUdeviceptr *, size_t *, CUdeviceptr);
  CUresult (*import_handle)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
  CUresult (*props_from_handle)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
  CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
  CUresult (*address_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
  CUresult (*release)(CUmemGenericAllocationHandle);
  CUresult (*device_attribute)(int *, CUdevice_attribute, CUdevice);
  CUresult (*error_string)(CUresult, const char **);
  CUresult (*mem_create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                         unsigned long long);
  CUresult (*export_handle)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long);
} drv_api;

/* ---- engine state ------------------------------------------------------------- */

typedef struct ipc_entry ipc_entry; /* an opened IPC handle (cuda/engine.c) */

/* A watch on a parked job's client fence (cuda/fence.c). */
typedef struct fence_watch fence_watch;

struct mok_engine {
  int device;
  char description[192];
  drv_api drv;
  uint64_t fence_timeout_ns;
  uint64_t job_timeout_ns;       /* a job running this long past its fence is reported */
  uint64_t workspace_idle_ns;    /* a session's workspace unused this long goes back */
  /* session workspaces come from this pool (stream-ordered; no reuse that
   * would make one session's stream wait for another's) */
  cudaMemPool_t ws_pool;
  uint64_t trim_until_ns;        /* idle() trims the pool until then (after frees) */
  uint64_t next_trim_ns;         /* ... at most once a second */
  /* two exports of one VMM allocation name one file, and other allocations
   * other files (checked at open): a VMM region's backing is its fd's file */
  bool vmm_fd_identity;
  mok_engine_session *sessions;  /* every open session (idle() walks them) */
  uint32_t next_session;         /* the engine's session numbers (logs) */
  /* allocations and frees of device scratch go through this stream (stream-
   * ordered: cudaFree would wait for the whole device, and a session parked
   * on a client fence would then hold the engine thread) */
  cudaStream_t mem_stream;
  ipc_entry *ipc; /* opened IPC handles, shared by every session of this daemon */
  fence_watch *watches; /* MAX_FENCE_WATCHES */
  pthread_t watchdog;
  bool watchdog_started;
  _Atomic bool watchdog_stop;
};

struct mok_engine_job {
  mok_engine_session *s;
  bool used;
  int slot;
  cudaEvent_t ev_start, ev_done;
  uint32_t op;
  uint64_t fence_wait, fence_signal;
  bool host_signal;   /* no device-mapped sync page: write the done value from the host */
  bool fence_forced;  /* the fence timed out and the engine released the wait itself */
  int watch;          /* index in e->watches, -1: none */
  uint64_t head_since;
  uint64_t started_ns; /* when poll() first saw ev_start done (the fence released) */
  bool overdue;       /* ran past the job timeout: reported, the session fails fast */
  bool reads_status;  /* the status word was copied back */
  int status;         /* a host-side failure found while enqueueing */
  bool device_posts;  /* a group job whose members' posts are compared on the device */
  bool flag_written;  /* a standing instance whose flag write is on the stream */
  char message[MOK_JOB_MESSAGE_MAX];
  /* phase marks when MOK_CUDA_PROFILE=1 (logged at completion): a group
   * job's phases, or a single job's every kernel, copy and memset */
  int n_marks;
  cudaEvent_t marks[CUDA_MAX_MARKS];
  const char *mark_names[CUDA_MAX_MARKS];
  uint64_t mark_cpu_ns[CUDA_MAX_MARKS]; /* the host clock when each was enqueued */
  uint64_t taken_ns;   /* when the engine thread took the job */
  /* host clock (profiling): start() entered, the fence wait and the start
   * event enqueued; mok__cuda_job_prepare entered, its checks and the
   * workspace done */
  uint64_t begin_ns[6];
  char mark_label[96]; /* the job's shape, for the log line */
};

struct mok_engine_session {
  cudaStream_t stream;
  void *sync_host;       /* the session's header page */
  CUdeviceptr sync_dev;  /* its device address; 0 when it could not be registered */
  char sync_error[80];
  void *standing_host;      /* the session's standing-job words (mok_shm_standing) */
  CUdeviceptr standing_dev; /* their device address; 0 when not registered */
  int32_t *d_status;     /* the running job's status word */
  bool status_zero;      /* d_status is 0 after the stream's queued work: the last
                          * job took it back (job_end), so the next skips its reset */
  volatile int32_t *h_status; /* pinned, one per job slot (in the sync page when it is registered) */
  bool h_status_own;     /* from cudaHostAlloc */
  cudaStream_t mem_stream;
  cudaStream_t aux;      /* side stream: a group job's shared expert runs beside the exchange */
  cudaEvent_t fork_ev, join_ev;
  /* the workspace: one device allocation for everything a job needs that
   * is not the client's (mok__cuda_job_space); jobs of a session run in order on
   * its stream, so one serves every layer of the session */
  char *ws;
  size_t ws_bytes;
  uint64_t ws_used_ns;   /* the last job that used it started or ended then */
  uint32_t ws_grows;     /* times it grew (a steady loop: once per larger job kind) */
  bool free_pending;     /* the grown one's predecessor was freed on the stream (idle() syncs) */
  /* accounting (session_memory) */
  uint64_t mapped_bytes; /* the session's CUDA IPC / VMM regions */
  uint64_t layer_bytes;  /* the layers it ran jobs of */
  /* the job watchdog: a job past the job timeout; until it ends, the
   * session's new jobs fail at once (owed_signal: the highest done value
   * they owe the client's stream, written in order once it ends) */
  mok_engine_job *stuck;
  uint64_t owed_signal;
  uint32_t serial;       /* the engine's number for the session (logs) */
  mok_engine_session *next;
  mok_engine_job jobs[MAX_JOBS];
};

/* Per-layer state: the layer's config and what is derived from it; every
 * buffer a job needs is in its session's workspace. */
struct mok_engine_layer {
  mok_layer_config cfg;
  /* a group's ring (mok_ring.cu): the routed buffers then hold ring rows */
  int ring_rows;     /* 0: one pass over the whole capacity */
  int ring_batches;  /* macrobatches launched per job (the worst case) */
  mok_engine_session *owner; /* the session whose jobs ran it (layer_bytes) */
};

/* A job's pieces of its session's workspace (NULL: the job needs none).
 * For a layer on a group the routed buffers are sized for the virtual
 * batch of W*T_max tokens (or the ring's rows). */
typedef struct job_ws {
  void *kernels;      /* mok_k_workspace_bytes of the job's (routed) dims */
  void *kernels_aux;  /* the shared expert's, on the side stream (group layers) */
  int32_t *ids;       /* [T, K] the daemon's copy of the job's topk_ids */
  int32_t *sched;     /* the schedule every kernel reads: built here, or a validated copy */
  void *acts;         /* acts (layout of mok_wire.h) when the job brings none */
  uint16_t *routed_a; /* routed_x; a bf16 layer of one GPU: every routed row, in turn */
  uint16_t *routed_b; /* routed_y / routed_d_out (group and fp8 layers) */
  uint16_t *routed_c; /* routed_d_x, and h while a recompute runs: [R, max(H, I)] (same) */
  uint16_t *shared;   /* shared_y / shared_d_x [T, H] (same; else out and d_x hold them) */
  int32_t *ep_ids;    /* [W*T_max, K] every member's ids */
  float *ep_rw;       /* [W*T_max, K] every member's router weights */
  float *ep_drw;      /* [W*T_max*K] d_rw of the local experts' slots, before the push */
  int32_t *ep_own;    /* [T*K] the own tokens' view of the landing slots */
  uint16_t *ring_g, *ring_u; /* [ring_rows, I] a macrobatch's acts */
  int32_t *ring_sched; /* a macrobatch's schedule */
  int32_t *ring_plan;  /* [ring_batches, 4] */
  uint16_t *wstage;   /* the routed weights, staged for the mma.sync backward */
  /* fp8 layers: x or d_out quantised per token [T, H] and scales [T, H/128],
   * their routed rows [R, H], [R, H/128] (cuda/fp8.c) */
  uint8_t *f8_tq, *f8_rq;
  float *f8_ts, *f8_rs;
} job_ws;

/* The workspace layout of a job (op, flags, T of layer cfg; brings_acts:
 * the job brings its ctx or acts; staging: a backward stages the routed
 * weights). Returns its bytes; with base, fills w with pointers into
 * [base, base + bytes). The one function that both sizes and carves. */
size_t mok__cuda_job_space(const mok_layer_config *cfg, uint32_t T, uint32_t op, uint32_t flags,
                           bool brings_acts, bool staging, char *base, job_ws *w);
/* What the workspace grows to for a job that needs need bytes: an eighth
 * more (2 MiB steps), never past most (the layer's job of that kind at its
 * max_tokens) unless need is. */
size_t mok__cuda_ws_roomy(size_t need, size_t most);

typedef struct job_ctx {
  mok_engine *e;
  mok_engine_session *s;
  mok_engine_job *j;
  const mok_job_args *a;
  mok_engine_layer *l;
  mok_k_dims d;
  mok_layout_dims ld;
  cudaStream_t st;
  int32_t *status;
  bool status_zero; /* the session's status_zero when the job began */
  job_ws w;    /* the job's pieces of the session's workspace (mok__cuda_job_prepare) */
  bool failed; /* stop enqueueing kernels */
  bool mark_steps; /* MOK_CUDA_PROFILE=1 on a single job: a mark after each step */
  /* a single job's small copies and zero fills, batched into one kernel
   * launched before the next kernel or stream operation (mok_k_moves;
   * mok__cuda_flush_moves); a group job moves with the copy engine */
  bool batch_moves;
  int n_moves;
  mok_k_move moves[MOK_K_MOVES_MAX];
  /* a single job's start event is not on the stream yet: it goes after the
   * job's first kernel or batch of moves (neither waits on anything), before
   * any other stream operation, so that its host cost is not paid between
   * the client's fence and the first kernel (mok__cuda_record_start) */
  bool start_pending;
} job_ctx;

/* The job's tensor in a slot (NULL: not given), and a bf16 one by slot name. */
static inline void *T_(const job_ctx *c, int slot) { return c->a->t[slot].ptr; }
#define BF(c, slot) ((uint16_t *)T_((c), MOK_SLOT_##slot))

typedef struct acts_ptrs {
  uint16_t *g, *u, *gs, *us;
} acts_ptrs;

/* ---- helpers (cuda/engine.c) ---- */
int mok__cuda_use_device(mok_engine *e);
/* mok__cuda_use_device, or err says why */
int mok__cuda_select(mok_engine *e, char *err, size_t errlen);
const char *mok__cuda_drv_error(const mok_engine *e, CUresult r);
bool mok__cuda_context_broken(cudaStream_t stream);
/* The properties of a pinned device allocation exportable as a POSIX fd. */
CUmemAllocationProp mok__cuda_vmm_fd_prop(const mok_engine *e);
void mok__cuda_free_async(void *p, cudaStream_t st);
mok_k_dims mok__cuda_dims_of(const mok_layer_config *c, uint32_t tokens);
mok_k_dims mok__cuda_group_dims(const mok_layer_config *c);
/* A ring's macrobatch: the group dims with the ring's capacity. */
mok_k_dims mok__cuda_ring_dims(const mok_layer_config *c);
__attribute__((format(printf, 3, 4))) void mok__cuda_job_fail(job_ctx *c, int status,
                                                              const char *fmt, ...);
void mok__cuda_launched(job_ctx *c, int st, const char *what);
#define LAUNCH(c, call)                                                                       \
  do {                                                                                        \
    if (!(c)->failed) {                                                                       \
      mok__cuda_flush_moves(c);                                                               \
      mok__cuda_launched((c), (call), #call);                                                 \
      mok__cuda_record_start(c); /* after a first kernel, not before it */                    \
    }                                                                                         \
  } while (0)

/* The job's start event (the watchdog's clock) onto the stream, once. */
void mok__cuda_record_start(job_ctx *c);

/* the batched moves onto the stream now (before any other stream work) */
void mok__cuda_flush_moves(job_ctx *c);

void mok__cuda_memset_async(job_ctx *c, void *p, size_t bytes);
void mok__cuda_copy_async(job_ctx *c, void *dst, const void *src, size_t bytes);
acts_ptrs mok__cuda_acts_split(job_ctx *c, void *acts, bool zero_gaps);
void mok__cuda_stage_weights(job_ctx *c, const uint16_t **wg, const uint16_t **wu,
                             const uint16_t **wd);
bool mok__cuda_check_job(job_ctx *c);
/* The schedule: built from the job's ids into the workspace; out to a
 * client tensor; a client's copied in and validated (the copy returned). */
void mok__cuda_sched_build(job_ctx *c);
void mok__cuda_sched_out(job_ctx *c, void *dst);
const int32_t *mok__cuda_sched_in(job_ctx *c, const void *src);
/* A ctx's acts; the rest of a ctx a job writes (schedule, gap zeros), last. */
acts_ptrs mok__cuda_ctx_acts(job_ctx *c, void *ctx);
void mok__cuda_ctx_out(job_ctx *c, void *ctx);

/* A single step of a bf16 layer (cuda/engine.c), within its frame: the fp8
 * layer's steps without products run it too */
void mok__cuda_op_step(job_ctx *c);
/* cuda/fp8.c: every op of an fp8 layer, within its frame */
void mok__cuda_fp8_job(job_ctx *c);

/* A job's frame (cuda/engine.c start()): the job's record, the wait for
 * the client's fence and the start event, then the op's work (single-daemon
 * ops in cuda/engine.c, group jobs in cuda/ep.c; c->failed: none), then the
 * status word's read-back, the done fence and the done event; poll()
 * follows the job. Within the frame, mok__cuda_job_prepare checks the job,
 * carves its workspace (growing the session's) and resets the status word;
 * false: the job failed (c says why). */
bool mok__cuda_job_prepare(job_ctx *c);
/* Profiling (MOK_CUDA_PROFILE=1): a timing event after the work enqueued so
 * far, named; the intervals are logged when the job completes. A name may be
 * a launch's text ("mok_k_gather_rows(...)"): the log keeps the function's
 * name without its prefix. */
bool mok__cuda_profiling(void);
void mok__cuda_mark(job_ctx *c, const char *name);

/* cuda/fence.c: client fences a client never writes, released after the
 * fence timeout by the watchdog (a thread without CUDA calls, started with
 * the engine) or by the engine thread's check in poll() */
void mok__cuda_fence_watchdog_start(mok_engine *e); /* none started: poll()'s check alone */
void mok__cuda_fence_watchdog_stop(mok_engine *e);
/* watch j's fence (word, the value it waits for); j->watch = -1 when no
 * watch is free (then only poll()'s check covers it) */
void mok__cuda_fence_watch(mok_engine *e, mok_engine_job *j, volatile uint64_t *word,
                           uint64_t value);
/* stop watching j's fence; true if the watchdog released it */
bool mok__cuda_fence_unwatch(mok_engine *e, mok_engine_job *j);
/* poll()'s check of a job still running: releases its fence once the
 * timeout passed (now UINT64_MAX: at once), setting j->fence_forced */
void mok__cuda_fence_check(mok_engine *e, mok_engine_job *j, uint64_t now);

/* cuda/ep.c: expert-parallel groups */
int mok__cuda_group_new_id(mok_engine *e, uint8_t *id, char *err, size_t errlen);
int mok__cuda_group_attach(mok_engine *e, struct mok_ep_group *g, char *err, size_t errlen);
void *mok__cuda_group_form(mok_engine *e, const struct mok_ep_group_form *f, int *status,
                           char *err, size_t errlen);
void mok__cuda_group_install(mok_engine *e, struct mok_ep_group *g, void *state);
void mok__cuda_group_discard(mok_engine *e, void *state);
/* a job of a layer on g, within its frame */
void mok__cuda_group_job(job_ctx *c, struct mok_ep_group *g, const mok_job_args *a);

#endif /* MOK_ENGINE_CUDA_INTERNAL_H */
