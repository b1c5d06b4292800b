/* SPDX-License-Identifier: Apache-2.0 */
/* The engine interface: what mokd asks of a compute engine.
 *
 * One engine thread owns an engine. The daemon validates every job descriptor
 * against the session's regions and the layer (job_check.c) before an engine
 * sees it, so an engine receives resolved, bounds-checked tensor views whose
 * shapes match the layer. What the daemon cannot check without reading
 * tensor contents (routing ids, the contents of a schedule or ctx a client
 * passed in) the engine checks, failing the job with a status and message.
 *
 * Engines: cpu (daemon/cpu/; reference, f32 and bf16) and cuda
 * (daemon/cuda/; sm_90a kernels, bf16). Both compute docs/math.md exactly.
 */
#ifndef MOK_ENGINE_H
#define MOK_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "mok_wire.h"

/* One tensor argument, resolved to memory the engine can address. */
typedef struct mok_tensor_view {
  void *ptr; /* NULL: slot absent */
  uint64_t bytes;
  uint32_t dtype;
  uint32_t ndim;
  uint32_t shape[MOK_MAX_DIMS];
} mok_tensor_view;

/* Engine-private objects the engine thread carries for an engine (opaque). */
typedef struct mok_engine_session mok_engine_session; /* per client session */
typedef struct mok_engine_layer mok_engine_layer;     /* per layer */
typedef struct mok_engine_job mok_engine_job;         /* a job still running */

typedef struct mok_job_args {
  uint32_t op;     /* mok_op */
  uint32_t flags;  /* MOK_JOB_* */
  uint32_t tokens; /* T */
  const mok_layer_config *layer; /* NULL for NOP */
  mok_tensor_view t[MOK_SLOT_COUNT_];
  uint64_t fence_wait, fence_signal; /* GPU ordering (cuda engine; docs/cuda.md) */
  mok_engine_session *session;       /* from session_open (NULL without it) */
  mok_engine_layer *layer_state;     /* from layer_open (NULL without it) */
  /* start() of a NOP on a group whose job posts travel on the device
   * (formed through NCCL): this member's job failed its checks with this
   * status; the NOP (fences only) still takes the member's turn so its
   * peers fail too */
  int group_failed;
  /* an instance of a standing job (docs/cuda.md "Capture and replay"): an
   * engine with writes_standing_flag writes 1 here (host address of the
   * slot's flag word in the session memory) on its stream after the job's
   * work; NULL: not a standing instance */
  volatile uint64_t *standing_flag;
  uint32_t standing_slot;
  uint64_t taken_ns; /* when the engine thread took the job (mok_clock_ns; profiling) */
} mok_job_args;

typedef struct mok_engine mok_engine;
struct mok_ep_group;      /* daemon/ep/group.h */
struct mok_ep_group_form; /* daemon/ep/group.h */

typedef struct mok_engine_config {
  int device;      /* GPU ordinal (cuda); ignored by cpu */
  int threads;     /* worker threads (cpu); 0: one per online core */
  uint32_t fence_timeout_ms; /* cuda: a client fence unwritten this long fails its job; 0: default */
  /* cuda: a job whose kernels run this long after its client fence was
   * released is reported and its session's later jobs fail at once until it
   * ends (a running kernel cannot be stopped); 0: the default (120 s) */
  uint32_t job_timeout_ms;
  /* expert-parallel groups (the engine thread's table; docs/ep.md) */
  bool group_linger_set;     /* else the default (MOK_GROUP_LINGER_MS) */
  uint32_t group_linger_ms;  /* a group no session holds is kept this long (0: not kept) */
  const char *group_dir;     /* where group segments live; NULL: $MOK_GROUP_DIR or /dev/shm */
  /* a session's workspace (device scratch, cpu scratch) unused this long is
   * given back; 0: the default (MOK_WORKSPACE_IDLE_MS) */
  uint32_t workspace_idle_ms;
  /* the engine thread polls the rings this long after its last work before
   * it sleeps (a job submitted meanwhile starts without a wake-up); 0: the
   * default (MOK_IDLE_SPIN_US) */
  uint32_t idle_spin_us;
  /* asynchronous engines call wake(wake_arg), from any thread, when a job
   * they run finished, so the engine thread polls at once instead of on its
   * next turn; NULL: none (the engine thread polls while jobs run) */
  void (*wake)(void *arg);
  void *wake_arg;
} mok_engine_config;

#define MOK_WORKSPACE_IDLE_MS 30000u
#define MOK_IDLE_SPIN_US 20000u

/* What a layer costs the daemon, before it exists (mok_layer_bytes). */
typedef struct mok_engine_layer_cost {
  uint64_t layer_bytes;     /* kept for the layer itself as long as it exists */
  uint64_t workspace_bytes; /* the session workspace a job at max_tokens needs; one
                               workspace serves every layer of a session */
  uint64_t ctx_bytes;       /* the ctx a forward at max_tokens saves (client memory) */
} mok_engine_layer_cost;

/* What a session holds in the engine now (mokctl status, metrics). */
typedef struct mok_session_memory {
  uint64_t mapped_device_bytes; /* client device memory mapped (IPC, VMM imports) */
  uint64_t workspace_bytes;     /* the session's workspace (daemon memory) */
  uint64_t layer_bytes;         /* per-layer state (daemon memory) */
  uint64_t scratch_bytes;       /* other daemon memory held for the session */
} mok_session_memory;

/* Results of start()/poll(): status plus a message a person can act on. */
typedef struct mok_engine_result {
  int status; /* mok_status */
  char message[MOK_JOB_MESSAGE_MAX]; /* reaches the client whole (mok_wire.h) */
  int fatal;  /* the engine is broken for good (a sticky device error): mokd exits */
  bool flag_written; /* a standing instance: the engine wrote (enqueued) its flag */
} mok_engine_result;

/* Where a client buffer comes from (RegisterBuffer). */
typedef struct mok_region_source {
  int kind;                 /* mok_region_kind */
  int fd;                   /* HOST_MEMFD, CUDA_VMM: the fd (the caller keeps it) */
  uint64_t offset, bytes;   /* usable bytes [offset, offset+bytes) of the allocation */
  uint8_t ipc_handle[64];   /* CUDA_IPC: cudaIpcMemHandle_t */
  mok_engine_session *session; /* the registering session's engine state (NULL: none) */
} mok_region_source;

struct mok_region;

/* How an engine runs the jobs of a layer on an expert-parallel group
 * (docs/ep.md): start() with the group. */
typedef enum mok_engine_groups {
  MOK_ENGINE_NO_GROUPS = 0, /* JoinGroup is refused */
  /* start() runs the job to its end on the calling thread (cpu): the engine
   * thread first waits for the session's earlier jobs, whose outputs it may
   * read, and the job runs on the session's scratch */
  MOK_ENGINE_GROUPS_ON_CALLER,
  /* start() runs the group's host protocol (job order, signatures, first
   * barrier) on the calling thread and enqueues the rest, with device
   * barriers, on the session's stream (cuda); poll() follows it like any job */
  MOK_ENGINE_GROUPS_ON_STREAM,
} mok_engine_groups;

typedef struct mok_engine_ops {
  const char *name;
  mok_engine_groups groups;
  /* the engine calls cfg->wake when an asynchronous job finishes (so the
   * engine thread may sleep while jobs run) */
  bool wakes_when_done;
  /* a standing instance's flag (mok_job_args.standing_flag) is written by
   * the engine's stream right after the job's work (cuda), so a waiting
   * client stream moves on without a host in between; else the engine
   * thread writes it once poll() saw the instance finish (cpu) */
  bool writes_standing_flag;
  /* Create an engine. On failure returns a mok_status and fills err. */
  int (*open)(const mok_engine_config *cfg, mok_engine **ret, char *err, size_t errlen);
  /* Release everything; accepts NULL. */
  void (*close)(mok_engine *e);
  /* Device description for Hello ("cpu: 2 threads", "NVIDIA H200 ..."). */
  const char *(*describe)(const mok_engine *e);
  /* Check that the engine can run this layer (dtype, sizes); fills
   * cfg->row_align. Returns a mok_status. */
  int (*prepare_layer)(mok_engine *e, mok_layer_config *cfg, char *err, size_t errlen);
  /* Start a validated job: returns a handle for poll(), or NULL when it
   * finished already (res filled; synchronous work, a job without a session,
   * a job refused at once). g: the job is of a layer on that
   * expert-parallel group (forward or backward, or the NOP of a failed one:
   * args.group_failed), run with the group's other members through g
   * (daemon/ep/group.h) as `groups` says; NULL: any other job. The engine
   * thread then calls poll() (oldest job of each session first; jobs of one
   * session finish in order) until it returns 1 with res filled. now_ns is
   * CLOCK_MONOTONIC; UINT64_MAX means "shutting down: give up on anything
   * the job still waits for". While a job runs, its session, layer and
   * regions stay alive. A job that failed validation is still started as a
   * NOP carrying its fences, so that GPU fence values are written in order.
   * A group job that fails with MOK_ETIMEOUT found a peer missing on the
   * device; the caller then breaks the group. */
  mok_engine_job *(*start)(mok_engine *e, struct mok_ep_group *g, const mok_job_args *args,
                           mok_engine_result *res);
  int (*poll)(mok_engine *e, mok_engine_job *job, uint64_t now_ns, mok_engine_result *res);

  /* ---- optional (NULL: not used); the cuda engine has them all ----------
   *
   * Sessions: session_open when a client attaches; sync_page is the
   * session's shared header page (MOK_SHM_SYNC_* words, mapped by both
   * sides). session_close only once no job of the session is running. */
  int (*session_open)(mok_engine *e, void *sync_page, mok_engine_session **ret, char *err,
                      size_t errlen);
  void (*session_close)(mok_engine *e, mok_engine_session *s);
  /* Per-layer state (device workspace sized for cfg->max_tokens), after
   * prepare_layer succeeded. layer_close only once no job of it runs. */
  int (*layer_open)(mok_engine *e, const mok_layer_config *cfg, mok_engine_layer **ret,
                    char *err, size_t errlen);
  void (*layer_close)(mok_engine *e, mok_engine_layer *l);
  /* Make client memory addressable. For HOST_MEMFD the engine thread has
   * mapped the memfd into r already (r->base is a host address): the engine
   * may pin it and set r->base to the address its kernels use. For the CUDA
   * kinds the engine imports src and fills r (base, bytes, map_*,
   * engine_handle). Without region_import only HOST_MEMFD is accepted.
   * region_release undoes it (the thread then unmaps host memory); it is
   * called only when no job that could use the region is running. */
  int (*region_import)(mok_engine *e, const mok_region_source *src, struct mok_region *r,
                       char *err, size_t errlen);
  void (*region_release)(mok_engine *e, struct mok_region *r);
  /* Expert parallelism through NCCL (cuda; docs/ep_nccl.md); NULL: the
   * engine forms groups through this host's shared memory only.
   * group_new_id makes the id every member joins with (the process that
   * made it must stay up while the group forms). group_attach after each
   * successful join: the engine makes its share of the group's buffers and
   * publishes it (mok_ep_group_set_engine_state); a rejoin finds it there.
   * A group that must still be formed (mok_ep_group_needs_forming) waits
   * for every rank (at most the group's timeout), so the engine thread runs
   * group_form on a thread of its own, with a copy of what it needs
   * (thread-safe: it touches no group); it returns the engine's state for
   * the group (NULL: *status and err say why). On the engine thread,
   * group_install hangs a formed state on its group, or group_discard frees
   * one whose group or session went meanwhile. */
  int (*group_new_id)(mok_engine *e, uint8_t *id /* MOK_GROUP_NCCL_ID_BYTES */, char *err,
                      size_t errlen);
  int (*group_attach)(mok_engine *e, struct mok_ep_group *g, char *err, size_t errlen);
  void *(*group_form)(mok_engine *e, const struct mok_ep_group_form *f, int *status, char *err,
                      size_t errlen);
  void (*group_install)(mok_engine *e, struct mok_ep_group *g, void *state);
  void (*group_discard)(mok_engine *e, void *state);

  /* ---- memory (optional) -----------------------------------------------------
   * layer_cost: what a prepared layer (prepare_layer succeeded on cfg)
   * would cost; fills ret, returns a mok_status. session_memory: what s
   * holds now. idle: the engine thread calls it about every 100 ms with
   * CLOCK_MONOTONIC; the engine gives back workspaces unused for
   * workspace_idle_ms. */
  int (*layer_cost)(mok_engine *e, const mok_layer_config *cfg, mok_engine_layer_cost *ret,
                    char *err, size_t errlen);
  void (*session_memory)(mok_engine *e, mok_engine_session *s, mok_session_memory *ret);
  void (*idle)(mok_engine *e, uint64_t now_ns);
} mok_engine_ops;

extern const mok_engine_ops mok_engine_cpu;
/* NULL when the build has no CUDA. */
const mok_engine_ops *mok_engine_find(const char *name);

/* Run one validated job without a session (args->session NULL) to
 * completion on the calling thread: start(), then poll() until it is done
 * (tools and tests; the engine thread starts and polls jobs itself). */
void mok_engine_run(const mok_engine_ops *ops, mok_engine *e, const mok_job_args *args,
                    mok_engine_result *res);

#endif /* MOK_ENGINE_H */
