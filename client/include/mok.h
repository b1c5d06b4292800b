/* SPDX-License-Identifier: Apache-2.0 */
/* libmok: the client library of mokd, the Mixture-of-Experts daemon.
 *
 * A trainer connects to its GPU's mokd, registers the memory its tensors
 * live in, creates a layer (shapes, dtype, options) and submits jobs:
 * forward, backward, or the single steps dispatch / compute / combine and
 * their backward forms. Jobs go through a shared-memory ring; submission
 * returns at once with a ticket, mok_wait() returns the job's status.
 * Tensors are never copied: they are named by address inside registered
 * memory, and the daemon reads and writes them in place.
 *
 * Conventions (as libuv): functions return MOK_OK (0) or a positive
 * mok_status; mok_last_error() gives the message for the last failure on
 * the calling thread, written for a person. Objects are owned by the
 * caller: every mok_connect() needs a mok_close(), every layer a
 * mok_layer_destroy() (or the client's close). A mok_client may be used
 * from several threads; its calls are serialised inside, and a thread
 * waiting (mok_wait, mok_sync) does not hold up the others' calls. A thread
 * still inside mok_wait or mok_sync when mok_close begins returns
 * MOK_ECLOSED; no other call may overlap mok_close.
 *
 * The math of each job is docs/design.md ("The layer") and docs/math.md; shapes are those of
 * docs/math.md's slot table.
 */
#ifndef MOK_H
#define MOK_H

#include <stddef.h>
#include <stdint.h>

#include "mok_enums.h"
#include "mok_status.h"
#include "mok_version.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The library's interface: the only symbols libmok.so exports (it is built
 * with hidden visibility; client/libmok.map gives them the version MOK_1). */
#if defined(__GNUC__)
#define MOK_EXTERN __attribute__((visibility("default")))
#else
#define MOK_EXTERN
#endif

typedef struct mok_client mok_client;
typedef struct mok_layer mok_layer;
typedef struct mok_group mok_group;

/* ---- errors ---- */

/* The message of the last failed call on this thread ("" if none). */
MOK_EXTERN const char *mok_last_error(void);
/* "EINVAL" etc. for a status code. */
MOK_EXTERN const char *mok_status_name(int status);
/* This libmok's version, e.g. "0.1.0" (MOK_VERSION of the headers it was
 * built with; compare with MOK_VERSION to catch a mismatched library). */
MOK_EXTERN const char *mok_version(void);

/* ---- connection ---- */

/* Connect and say Hello. socket_path NULL: $MOK_SOCKET, else
 * MOK_DEFAULT_SOCKET. client_name is shown by mokctl. */
MOK_EXTERN int mok_connect(const char *socket_path, const char *client_name, mok_client **ret);
/* Say Goodbye, release every layer and registration; accepts NULL. Jobs
 * still in flight are waited for first (up to a few seconds). */
MOK_EXTERN void mok_close(mok_client *c);

MOK_EXTERN const char *mok_client_engine(const mok_client *c); /* "cpu" or "cuda" */
MOK_EXTERN const char *mok_client_device(const mok_client *c);
MOK_EXTERN uint64_t mok_client_session(const mok_client *c);

typedef struct mok_daemon_stats {
  uint64_t uptime_ms, jobs_done, jobs_failed, sessions_now, sessions_total;
  uint64_t latency_p50_ns, latency_p99_ns;
} mok_daemon_stats;
MOK_EXTERN int mok_stats(mok_client *c, mok_daemon_stats *ret);

/* ---- memory the daemon can address ---- */

/* Shared host memory (a sealed memfd), registered with the daemon: tensors
 * placed here travel without copies. Returns NULL on failure. */
MOK_EXTERN void *mok_host_alloc(mok_client *c, size_t bytes);
/* Unregister and unmap. Jobs using it must have completed. */
MOK_EXTERN int mok_host_free(mok_client *c, void *ptr);

/* ---- layers ---- */

typedef struct mok_layer_desc {
  uint32_t hidden;              /* H */
  uint32_t intermediate;        /* I */
  uint32_t experts;             /* E (global) */
  uint32_t topk;                /* K */
  uint32_t shared_intermediate; /* I_s; 0: no shared expert */
  uint32_t max_tokens;          /* the largest T a job will carry */
  uint32_t dtype;               /* MOK_DTYPE_F32, MOK_DTYPE_BF16 or MOK_DTYPE_FP8_E4M3 */
  int has_swiglu_limit;
  float swiglu_limit;           /* L, when has_swiglu_limit */
  /* Expert parallelism (docs/ep.md): a layer on a group holds the rank's
   * local experts (w_* are [experts/world, ...]); forward and backward
   * exchange tokens with the other ranks. NULL: all experts local. */
  mok_group *group;
  uint32_t group_tag; /* names the layer in the group's job signature */
} mok_layer_desc;

MOK_EXTERN int mok_layer_create(mok_client *c, const mok_layer_desc *desc, mok_layer **ret);
/* accepts NULL */
MOK_EXTERN void mok_layer_destroy(mok_layer *l);

/* What a layer of this description would cost, asked before creating it
 * (the same checks as mok_layer_create; nothing is created, no quota is
 * used). Bytes at desc->max_tokens. */
typedef struct mok_layer_cost_info {
  uint64_t layer_bytes;     /* daemon memory the layer itself keeps while it exists */
  uint64_t workspace_bytes; /* the session workspace a job needs (one per session,
                               shared by its layers; given back when idle) */
  uint64_t ctx_bytes;       /* the ctx a forward saves: client memory, as
                               mok_layer_ctx_bytes(layer, max_tokens) */
  uint32_t row_align;       /* as mok_layer_row_align */
  uint32_t local_experts;   /* experts this rank holds (all without a group) */
  uint32_t first_expert;
} mok_layer_cost_info;
/* An engine that does not account its memory reports layer_bytes and
 * workspace_bytes 0 (the cpu engine keeps no per-layer state). */
MOK_EXTERN int mok_layer_cost(mok_client *c, const mok_layer_desc *desc, mok_layer_cost_info *ret);

/* ---- expert-parallel groups (docs/ep.md) ---- */

/* What every rank of a group must agree on (a join that differs fails). */
typedef struct mok_group_sizing {
  uint32_t max_tokens; /* the largest T per rank of any job on the group */
  uint32_t hidden;     /* H */
  uint32_t topk;       /* K */
  uint32_t experts;    /* E, global, a multiple of world */
  uint32_t dtype;      /* MOK_DTYPE_F32 or MOK_DTYPE_BF16 */
  uint32_t timeout_ms; /* how long a job waits for the other ranks; 0: 30000 */
  /* The share of all world*max_tokens*topk routes one rank's experts may
   * receive, in (0, 1]; 0: all of them (the worst case). It sizes each
   * rank's schedule, ctx and routed buffers; a job whose routing needs more
   * fails with MOK_EOVERFLOW on every rank (the group stays usable). 2/world
   * leaves twice the balanced load. Kept to millionths. */
  float capacity;
  /* Rows of the daemon's routed buffers (a ring): the routed rows then run
   * in macrobatches of whole local experts that fit. 0: one pass. An expert
   * with more padded rows than the ring fails the job with MOK_EOVERFLOW, so
   * use at least world*max_tokens (the most rows distinct top-k ids send to
   * one expert). */
  uint32_t ring_rows;
  /* NULL: the ranks' mokds share this host (shared memory and VMM fds).
   * Else the group forms through NCCL (members on distinct GPUs, on one
   * host or several hosts of one NVLink domain; the cuda engine): the
   * MOK_NCCL_ID_BYTES id that mok_group_nccl_id gave rank 0, the same on
   * every rank. Joining then waits until every rank joined (timeout_ms). */
  const uint8_t *nccl_id;
} mok_group_sizing;

/* A fresh NCCL unique id for mok_group_sizing.nccl_id, from this client's
 * mokd (rank 0's: that mokd hosts NCCL's bootstrap until the group formed).
 * The trainer passes it to every rank by its own means. A new id forms a
 * new communicator: re-joining a broken group needs one. */
MOK_EXTERN int mok_group_nccl_id(mok_client *c, uint8_t id[MOK_NCCL_ID_BYTES]);

/* Join rank `rank` of the group `key` (scoped to this client's uid) through
 * this client's mokd; each rank joins through its own GPU's mokd. Joining a
 * group the daemon already holds (a restarted client) is cheap. Jobs of
 * layers on the group must be submitted in the same order on every rank:
 * a missing or stalled rank fails the job with MOK_ETIMEOUT and leaves the
 * group broken until every rank joins again (call mok_group_join again);
 * a rank running another op or layer fails the job with MOK_EINVAL. */
MOK_EXTERN int mok_group_join(mok_client *c, const char *key, uint32_t rank, uint32_t world,
                              const mok_group_sizing *sizing, mok_group **ret);
/* Leave: the daemon releases the group at once when no session holds it.
 * mok_close frees every group it did not leave, without leaving: the daemon
 * keeps such a group warm for a restarted client (60 s), then releases it.
 * Accepts NULL. Layers on the group must be destroyed first. */
MOK_EXTERN int mok_group_leave(mok_group *g);
MOK_EXTERN uint32_t mok_group_rank(const mok_group *g);
MOK_EXTERN uint32_t mok_group_world(const mok_group *g);
MOK_EXTERN uint32_t mok_group_local_experts(const mok_group *g);
MOK_EXTERN uint32_t mok_group_first_expert(const mok_group *g);
MOK_EXTERN uint64_t mok_group_generation(const mok_group *g);
MOK_EXTERN int mok_group_rejoined(const mok_group *g); /* the daemon already held it */

MOK_EXTERN uint32_t mok_layer_row_align(const mok_layer *l);
MOK_EXTERN uint32_t mok_layer_local_experts(const mok_layer *l);
/* Sizes of the buffers a job at T tokens exchanges (docs/math.md). */
MOK_EXTERN uint64_t mok_layer_ctx_bytes(const mok_layer *l, uint32_t tokens);
MOK_EXTERN uint64_t mok_layer_acts_bytes(const mok_layer *l, uint32_t tokens);
MOK_EXTERN uint64_t mok_layer_schedule_ints(const mok_layer *l, uint32_t tokens);
MOK_EXTERN uint64_t mok_layer_rows_capacity(const mok_layer *l, uint32_t tokens);

/* ---- jobs ---- */

/* A tensor argument: where it is and what it claims to be. The daemon
 * checks dtype and shape against the layer. data NULL: argument absent. */
typedef struct mok_tensor {
  const void *data;
  uint32_t dtype;
  uint32_t ndim;
  uint64_t shape[4];
} mok_tensor;

/* The tensor the layer expects in slot at T tokens, placed at data. */
MOK_EXTERN mok_tensor mok_tensor_for(const mok_layer *l, uint32_t tokens, uint32_t slot,
                                     const void *data);

/* Submit a job (op: MOK_OP_*; tensors indexed by MOK_SLOT_*). Returns at
 * once with a ticket for mok_wait(). MOK_EBUSY when the ring holds as many
 * un-waited jobs as it has entries (wait for some first). */
MOK_EXTERN int mok_submit(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                          const mok_tensor tensors[MOK_SLOT_COUNT_], uint64_t *ret_ticket);
/* An empty job through the rings (latency measurement). */
MOK_EXTERN int mok_submit_nop(mok_client *c, uint64_t *ret_ticket);
/* Wait for a job; returns its status (message in mok_last_error()).
 * timeout_ms < 0 waits for ever; MOK_ETIMEOUT leaves the job pending. */
MOK_EXTERN int mok_wait(mok_client *c, uint64_t ticket, int timeout_ms);
/* 1 while mok_wait has not yet returned the job's own status. A job can
 * itself fail with MOK_ETIMEOUT (a group peer that never came): after
 * mok_wait returned MOK_ETIMEOUT, this tells the two cases apart. */
MOK_EXTERN int mok_job_pending(mok_client *c, uint64_t ticket);

/* The whole layer, typed. Pointers into registered memory; s_* NULL
 * without a shared expert; ctx (mok_layer_ctx_bytes) NULL to not save it. */
typedef struct mok_forward_args {
  const void *x, *w_gate, *w_up, *w_down, *s_gate, *s_up, *s_down;
  const int32_t *topk_ids;
  const float *router_weights;
  void *out, *ctx;
} mok_forward_args;

typedef struct mok_backward_args {
  const void *x, *w_gate, *w_up, *w_down, *s_gate, *s_up, *s_down, *d_out;
  const int32_t *topk_ids; /* needed with MOK_JOB_RECOMPUTE */
  const float *router_weights;
  void *ctx; /* from forward; rebuilt in place with MOK_JOB_RECOMPUTE */
  void *d_x, *d_w_gate, *d_w_up, *d_w_down, *d_s_gate, *d_s_up, *d_s_down;
  float *d_router_weights;
} mok_backward_args;

MOK_EXTERN int mok_forward(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                           uint64_t *ret_ticket);
MOK_EXTERN int mok_backward(mok_layer *l, uint32_t tokens, uint32_t flags,
                            const mok_backward_args *a, uint64_t *ret_ticket);

/* ---- fp8 layers (docs/math.md, "FP8 (e4m3, block-scaled)") ----
 *
 * A layer of dtype MOK_DTYPE_FP8_E4M3 takes bf16 activations and gradients
 * and, in its weight slots (w_gate .. s_down), the weights' packed e4m3
 * form, which the client holds: the trainer keeps its bf16 master weights
 * and quantises each into its packed buffer after every optimizer step. */

/* The bytes of the packed form of weight_slot (MOK_SLOT_W_GATE ..
 * MOK_SLOT_S_DOWN) of an fp8 layer (its e4m3 bytes in both orientations,
 * then its block scales: proto/mok_layout.h); 0 for another layer or slot.
 * mok_tensor_for gives that slot's packed tensor too. */
MOK_EXTERN uint64_t mok_layer_packed_weight_bytes(const mok_layer *l, uint32_t weight_slot);
/* A quantize_weight job: the bf16 weight (in the shape a bf16 layer takes
 * in weight_slot) into packed (mok_layer_packed_weight_bytes bytes, not
 * overlapping it). Wait for the ticket as for any job. */
MOK_EXTERN int mok_quantize_weight(mok_layer *l, uint32_t weight_slot, const void *weight,
                                   void *packed, uint64_t *ret_ticket);

/* A forward that quantises first (flag MOK_JOB_QUANTIZE_WEIGHTS, fp8 layers):
 * its weight slots take the bf16 masters (shaped as quantize_weight's
 * source) and slot MOK_SLOT_PACKED_WEIGHT one uint8 tensor that receives
 * every weight's packed form, the bytes quantize_weight would write, before
 * the forward runs on them: one job instead of a quantize_weight per weight
 * and a forward, and what a CUDA graph replays (mok_standing_forward_
 * quantized). A backward then takes the packed forms inside that tensor
 * (at mok_layer_packed_weights_offset) in its weight slots. */

/* That tensor's bytes (0 on a layer that is not fp8), and where the packed
 * form of weight_slot starts in it (the forms of w_gate, w_up, w_down and,
 * with a shared expert, s_gate, s_up, s_down in that order, each from a
 * 256-byte boundary; UINT64_MAX for a slot the layer has no weight in). */
MOK_EXTERN uint64_t mok_layer_packed_weights_bytes(const mok_layer *l);
MOK_EXTERN uint64_t mok_layer_packed_weights_offset(const mok_layer *l, uint32_t weight_slot);
/* As mok_tensor_for, for a job of op with these flags (a quantising
 * forward's weight slots are bf16 masters, its packed_weight the tensor
 * above; any other job as mok_tensor_for). */
MOK_EXTERN mok_tensor mok_tensor_for_job(const mok_layer *l, uint32_t op, uint32_t flags,
                                         uint32_t tokens, uint32_t slot, const void *data);

/* ---- CUDA memory and streams (the cuda engine; docs/cuda.md) ----
 *
 * Any tensor may also be CUDA device memory: mok_submit and the calls
 * below find a device pointer's allocation and register it with mokd once
 * (legacy CUDA IPC for cudaMalloc memory, a POSIX fd for cuMemCreate
 * memory made exportable), then name it in place. libcuda.so.1 is loaded
 * (dlopen) at the first such use; libmok needs no GPU otherwise. */

/* Like mok_submit, ordered on a CUDA stream (a CUstream / cudaStream_t;
 * NULL: the legacy default stream) without any host wait: the job starts
 * after the work enqueued on `stream` so far, and work enqueued on `stream`
 * after this call starts after the job. Returns at once. With ret_ticket
 * the job is waited for with mok_wait as usual; with ret_ticket NULL it is
 * reaped by itself, and a failure is reported by mok_async_error(). A job
 * that fails still releases the stream (its outputs are then undefined).
 * When MOK_RING_ENTRIES jobs are in flight, the call waits for one. */
MOK_EXTERN int mok_submit_on_stream(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                                    const mok_tensor tensors[MOK_SLOT_COUNT_], void *stream,
                                    uint64_t *ret_ticket);
/* An empty job ordered on a stream: the fences alone, no kernels (what the
 * daemon boundary costs a job; tests/bench/bench_fence.cu). */
MOK_EXTERN int mok_submit_nop_on_stream(mok_client *c, void *stream, uint64_t *ret_ticket);
MOK_EXTERN int mok_forward_on_stream(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                                     void *stream, uint64_t *ret_ticket);
MOK_EXTERN int mok_backward_on_stream(mok_layer *l, uint32_t tokens, uint32_t flags,
                                      const mok_backward_args *a, void *stream,
                                      uint64_t *ret_ticket);
/* The first failure among the jobs submitted without a ticket since the
 * last call (MOK_OK if none; message in mok_last_error()); clears it. */
MOK_EXTERN int mok_async_error(mok_client *c);
/* Wait on the host until every job submitted so far has completed (those
 * with tickets stay waitable). Returns mok_async_error() after that. */
MOK_EXTERN int mok_sync(mok_client *c, int timeout_ms);
/* Drop the registration of the CUDA allocation holding dev_ptr (before
 * freeing it, to release the daemon's mapping early; libmok also notices
 * reallocations by itself). */
MOK_EXTERN int mok_cuda_forget(mok_client *c, const void *dev_ptr);

/* ---- standing jobs: capturable submissions (docs/cuda.md "Capture and replay") ----
 *
 * A standing job is a forward or backward with every tensor fixed (as CUDA
 * graph replays need): mokd validates it once and keeps it; each trigger
 * runs it once. mok_standing_enqueue records, on a stream, three
 * stream memory operations that never change (write the trigger word, wait
 * for the done flag, clear it), so a CUDA graph may capture them and every
 * replay runs the job once, in stream order. The host can trigger too
 * (mok_standing_trigger, mok_standing_wait): what the cpu engine runs.
 *
 * Failures never hang a stream: a standing job the daemon cancels (a
 * region it names unregistered or re-registered, its layer destroyed, a
 * bad trigger, a trigger not taken within mokd's fence timeout) answers
 * every later trigger at once with its error set; when mokd goes away,
 * libmok answers them itself. mok_standing_status reports the error (after
 * the stream or graph was synchronised): outputs of a failed instance are
 * undefined. At most MOK_STANDING_MAX (128) standing jobs a session. */
typedef struct mok_standing mok_standing;

MOK_EXTERN int mok_standing_create(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                                   const mok_tensor tensors[MOK_SLOT_COUNT_], mok_standing **ret);
/* Typed forms (the arguments of mok_forward / mok_backward). */
MOK_EXTERN int mok_standing_forward(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                                    mok_standing **ret);
MOK_EXTERN int mok_standing_backward(mok_layer *l, uint32_t tokens, uint32_t flags,
                                     const mok_backward_args *a, mok_standing **ret);
/* A standing quantising forward of an fp8 layer: a's weights (w_gate ..
 * s_down) are the bf16 masters, packed (mok_layer_packed_weights_bytes)
 * receives their packed forms at each run, before the forward reads them:
 * every replay quantises the masters as they are then (one read of each
 * master and one write of its packed form a run), so a graph replayed
 * after the optimizer changed them runs on the new weights. A standing
 * backward of the same step names the forms inside packed. */
MOK_EXTERN int mok_standing_forward_quantized(mok_layer *l, uint32_t tokens,
                                              const mok_forward_args *a, void *packed,
                                              mok_standing **ret);
/* Record one run on a CUDA stream (capturable; the same three operations
 * each time). Work enqueued after it starts after the job. */
MOK_EXTERN int mok_standing_enqueue(mok_standing *s, void *stream);
/* From the host: run it once (MOK_EBUSY while the previous trigger is not
 * taken yet), then wait for that run (timeout_ms < 0: for ever). wait
 * returns mok_standing_status(). */
MOK_EXTERN int mok_standing_trigger(mok_standing *s);
MOK_EXTERN int mok_standing_wait(mok_standing *s, int timeout_ms);
/* MOK_OK, or the first failure of the job (message in mok_last_error());
 * it stays set: a failed standing job is destroyed and created again. */
MOK_EXTERN int mok_standing_status(mok_standing *s);
/* Runs finished so far (mokd's count). */
MOK_EXTERN uint64_t mok_standing_done(const mok_standing *s);
/* Accepts NULL. Streams and graphs that still enqueue it must be done. */
MOK_EXTERN void mok_standing_destroy(mok_standing *s);

#ifdef __cplusplus
}
#endif

#endif /* MOK_H */
