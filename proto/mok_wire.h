/* SPDX-License-Identifier: Apache-2.0 */
/* mok wire formats shared by mokd and libmok (not part of the public API).
 *
 *  - the control-socket frame header (a protobuf message follows it);
 *  - the per-session shared-memory region: submission and completion rings
 *    of fixed-size descriptors, head/tail as C11 atomics on their own lines;
 *  - the job descriptor (operation, layer, tensors by region + offset);
 *  - the layouts of the schedule and context buffers that jobs exchange.
 *
 * Everything here is read by a process that must not trust the other side:
 * readers copy a descriptor out of shared memory once, then validate the copy.
 */
#ifndef MOK_WIRE_H
#define MOK_WIRE_H

#include <stdalign.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "mok_enums.h"
#include "mok_layout.h"
#include "mok_status.h"

#define MOK_PROTOCOL_VERSION 1u

/* ---- control socket framing ------------------------------------------- */

#define MOK_FRAME_MAGIC 0x464b4f4du /* "MOKF" little-endian */
#define MOK_FRAME_MAX (1u << 20)    /* whole frame, header included */
#define MOK_FRAME_MAX_PRE_HELLO 4096u
#define MOK_FRAME_MAX_FDS 4u

typedef struct mok_frame_header {
  uint32_t magic;
  uint16_t version;    /* MOK_PROTOCOL_VERSION */
  uint16_t flags;      /* reserved, must be 0 */
  uint32_t request_id; /* echoed in the reply */
  uint32_t length;     /* protobuf payload bytes after this header */
} mok_frame_header;
_Static_assert(sizeof(mok_frame_header) == 16, "frame header is 16 bytes");

/* ---- job and completion descriptors --------------------------------------- */

#define MOK_JOB_VERSION 1u
#define MOK_MAX_TENSORS 24u
#define MOK_MAX_DIMS 4u

typedef struct mok_tensor_ref {
  uint32_t region; /* session-local region id; 0 is never valid */
  uint16_t slot;   /* mok_slot */
  uint8_t dtype;   /* mok_dtype */
  uint8_t ndim;    /* 1..MOK_MAX_DIMS */
  uint64_t offset; /* bytes from the start of the region */
  uint64_t bytes;  /* must equal prod(shape) * dtype size */
  uint32_t shape[MOK_MAX_DIMS];
} mok_tensor_ref;
_Static_assert(sizeof(mok_tensor_ref) == 40, "tensor ref is 40 bytes");

typedef struct mok_job_desc {
  uint32_t version; /* MOK_JOB_VERSION */
  uint16_t op;      /* mok_op */
  uint16_t flags;   /* MOK_JOB_* */
  uint32_t layer;   /* layer id from CreateLayer (0 for NOP) */
  uint32_t tokens;  /* T of this job */
  uint32_t n_tensors;
  uint32_t reserved0;
  uint64_t user_data;    /* echoed in the completion */
  uint64_t fence_wait;   /* GPU engine: wait for this value first (0: none) */
  uint64_t fence_signal; /* GPU engine: write this value when done (0: none) */
  uint64_t reserved[2];
  mok_tensor_ref tensors[MOK_MAX_TENSORS];
} mok_job_desc;
_Static_assert(sizeof(mok_job_desc) == 1024, "job descriptor is 1 KiB");

/* A completion carries the first MOK_COMPLETION_MSG - 1 bytes of a failed
 * job's message; the whole message (up to MOK_JOB_MESSAGE_MAX - 1 bytes)
 * sits in the session's message area at the completion's ring index
 * (mok_shm_msg_entry), written before the completion is posted and left
 * alone until the client has moved cq_head past it. Only failed jobs write
 * it, so the ring's hot path stays 128 bytes a job. */
#define MOK_COMPLETION_MSG 96u
#define MOK_JOB_MESSAGE_MAX 512u
typedef struct mok_completion {
  uint64_t user_data; /* from the job */
  uint64_t seq;       /* the session's job sequence number, from 1 */
  int32_t status;     /* mok_status */
  uint32_t reserved0;
  uint64_t engine_ns; /* time the engine spent on the job */
  char message[MOK_COMPLETION_MSG]; /* NUL-terminated */
} mok_completion;
_Static_assert(sizeof(mok_completion) == 128, "completion is 128 bytes");

/* ---- the session's shared-memory region ------------------------------------ */

#define MOK_SHM_MAGIC 0x524b4f4du /* "MOKR" */
#define MOK_SHM_LAYOUT_VERSION 2u /* 2: standing-job words after the rings */
#define MOK_RING_ENTRIES 64u /* power of two */

#define MOK_RING_NEED_WAKEUP 0x1u /* consumer sleeps: producer must ring */

/* One line per index, so producer and consumer never share a cache line. */
typedef struct mok_ring_index {
  alignas(64) _Atomic uint32_t value;
  char pad_[60];
} mok_ring_index;

typedef struct mok_shm_header {
  uint32_t magic;
  uint32_t layout_version;
  uint32_t entries;    /* both rings */
  uint32_t sq_entry_size;
  uint32_t cq_entry_size;
  uint32_t reserved0;
  uint64_t sq_offset;  /* bytes from region start */
  uint64_t cq_offset;
  uint64_t region_bytes;
  char pad_[16];
  mok_ring_index sq_head;  /* daemon consumes */
  mok_ring_index sq_tail;  /* client produces */
  mok_ring_index sq_flags; /* daemon sets NEED_WAKEUP before sleeping */
  mok_ring_index cq_head;  /* client consumes */
  mok_ring_index cq_tail;  /* daemon produces */
  mok_ring_index cq_flags; /* client sets NEED_WAKEUP before sleeping */
} mok_shm_header;

#define MOK_SHM_SQ_OFFSET 4096u
#define MOK_SHM_CQ_OFFSET (MOK_SHM_SQ_OFFSET + MOK_RING_ENTRIES * sizeof(mok_job_desc))
/* the message area: a failed job's whole message, by completion ring index */
#define MOK_SHM_MSG_OFFSET (MOK_SHM_CQ_OFFSET + MOK_RING_ENTRIES * sizeof(mok_completion))
/* The standing-job words follow the message area, from a page boundary (both
 * sides register them with CUDA, device-mapped; docs/cuda.md "Capture and
 * replay"). */
#define MOK_SHM_STANDING_OFFSET \
  ((MOK_SHM_MSG_OFFSET + MOK_RING_ENTRIES * MOK_JOB_MESSAGE_MAX + 4095u) & ~(size_t)4095u)
#define MOK_STANDING_MAX 128u /* standing jobs a session holds at once */
#define MOK_SHM_STANDING_BYTES ((size_t)MOK_STANDING_MAX * 512u)
#define MOK_SHM_BYTES (MOK_SHM_STANDING_OFFSET + MOK_SHM_STANDING_BYTES)
_Static_assert(sizeof(mok_shm_header) <= MOK_SHM_SQ_OFFSET, "header fits its page");

/* GPU sync words (docs/design.md, Fences; docs/cuda.md), in the header page of the
 * session region, which both processes map and register with CUDA
 * (cuMemHostRegister, device-mapped):
 *   client fence [MOK_RING_ENTRIES]: a job with fence_wait = v != 0 waits
 *     (on the daemon's stream, GEQ) until word [v % MOK_RING_ENTRIES] >= v;
 *     the client's stream writes v there after producing the job's inputs;
 *   done: the daemon's stream writes a job's fence_signal (!= 0) here after
 *     the job's work, in job order; the client's stream waits on it (GEQ).
 * The client picks v = the job's ticket (so slots never collide among the
 * jobs in flight) and increasing fence_signal values. */
#define MOK_SHM_SYNC_OFFSET 2048u
#define MOK_SHM_SYNC_DONE_OFFSET (MOK_SHM_SYNC_OFFSET + MOK_RING_ENTRIES * 8u)
_Static_assert(sizeof(mok_shm_header) <= MOK_SHM_SYNC_OFFSET, "sync words after the header");
/* The daemon's per-job status words (int32 [MOK_RING_ENTRIES]), in the same
 * registered page: the client may read them but has no reason to. */
#define MOK_SHM_STATUS_OFFSET 3072u
_Static_assert(MOK_SHM_SYNC_DONE_OFFSET + 64u <= MOK_SHM_STATUS_OFFSET, "sync words first");
_Static_assert(MOK_SHM_STATUS_OFFSET + 4u * MOK_RING_ENTRIES <= MOK_SHM_SQ_OFFSET,
               "status words in the header page");

static inline volatile uint64_t *mok_shm_sync_fence(void *page, uint64_t v) {
  return (volatile uint64_t *)((char *)page + MOK_SHM_SYNC_OFFSET) + (v % MOK_RING_ENTRIES);
}
static inline volatile uint64_t *mok_shm_sync_done(void *page) {
  return (volatile uint64_t *)((char *)page + MOK_SHM_SYNC_DONE_OFFSET);
}

/* ---- standing jobs (docs/cuda.md, "Capture and replay") --------------------
 *
 * A standing job is a job descriptor the daemon validated once and keeps,
 * run again each time the client triggers it, with no descriptor in the
 * ring: what a CUDA graph replay needs (its work cannot carry new values).
 * Created by a descriptor with MOK_JOB_STANDING in its flags (op forward or
 * backward, tensors as for a normal job) and reserved[0] = the slot
 * (< MOK_STANDING_MAX) the client chose; destroyed by a NOP descriptor with
 * MOK_JOB_STANDING and reserved[0] = the slot. Both complete through the
 * completion ring like any job. Per slot, in the session memory:
 *   trigger: the client writes 1 (its CUDA stream, or the host) to run the
 *     job once; the daemon takes it (writes 0) and starts one instance. Any
 *     value but 0 and 1 cancels the standing job.
 *   flag: written 1 after each instance (by the daemon's CUDA stream on the
 *     cuda engine, by the engine thread on the cpu engine); a client stream
 *     waits for 1 (EQ) and writes 0: the replay-invariant wait of a graph.
 *   done: the daemon writes the count of instances finished.
 *   error, message: the daemon writes the first failure (status, text);
 *     libmok writes ECLOSED when the daemon went away.
 * The daemon reads only trigger (once a turn, one word, copied before use);
 * flag, done, error and message it writes and never reads back to
 * decide anything; a client rewriting them fools only itself. */
#define MOK_JOB_STANDING 0x8000u /* descriptor flag: create / destroy a standing job */
#define MOK_STANDING_MSG 480u /* a failed run's message, whole as a job's (MOK_JOB_MESSAGE_MAX) but for its tail */

typedef struct mok_standing_words {
  alignas(64) volatile uint64_t trigger;
  volatile uint64_t flag;
  volatile uint64_t done;
  volatile int32_t error;
  volatile uint32_t generation; /* the daemon: +1 at each creation in the slot */
  char message[MOK_STANDING_MSG];
} mok_standing_words;
_Static_assert(sizeof(mok_standing_words) == 512, "standing words are 512 bytes");

static inline mok_standing_words *mok_shm_standing(void *shm, uint32_t slot) {
  return (mok_standing_words *)((char *)shm + MOK_SHM_STANDING_OFFSET) + slot;
}

/* The rings sit at fixed offsets: neither side trusts the offsets written in
 * the (shared, writable) header. */
static inline mok_job_desc *mok_shm_sq_entries(mok_shm_header *h) {
  return (mok_job_desc *)((char *)h + MOK_SHM_SQ_OFFSET);
}
static inline mok_completion *mok_shm_cq_entries(mok_shm_header *h) {
  return (mok_completion *)((char *)h + MOK_SHM_CQ_OFFSET);
}
/* The daemon only writes here and the client only reads: the client's own
 * scribbles can change nothing but what it reads back. */
static inline char *mok_shm_msg_entry(mok_shm_header *h, uint32_t cq_index) {
  return (char *)h + MOK_SHM_MSG_OFFSET + (size_t)(cq_index & (MOK_RING_ENTRIES - 1)) *
                                              MOK_JOB_MESSAGE_MAX;
}

/* ---- buffer layouts a job exchanges (schedule, acts, ctx) ------------------
 *
 * In mok_layout.h (plain arithmetic the CUDA kernels include as well):
 * MOK_SCHED_MAGIC, the MOK_SCHED_H_* header fields, mok_layout_dims,
 * mok_rows_capacity, mok_schedule_ints/bytes, mok_acts_*_bytes,
 * mok_ctx_bytes, mok_align256.
 */
/* A layer, as daemon and client both describe it (validated by daemon/layer.c). */
typedef struct mok_layer_config {
  uint32_t hidden;              /* H */
  uint32_t intermediate;        /* I */
  uint32_t experts;             /* E, global */
  uint32_t local_experts;       /* E_loc (== E without a group) */
  uint32_t first_expert;        /* global id of local expert 0 */
  uint32_t topk;                /* K */
  uint32_t shared_intermediate; /* I_s; 0: no shared expert */
  uint32_t max_tokens;          /* largest T a job may carry */
  uint32_t dtype;               /* MOK_DTYPE_F32, MOK_DTYPE_BF16 or MOK_DTYPE_FP8_E4M3 */
  uint32_t row_align;           /* routed-row group alignment (engine's) */
  bool has_limit;               /* SwiGLU clamp on */
  float swiglu_limit;           /* L, > 0 when has_limit */
  /* expert parallelism (docs/ep.md); all 0 for a layer without a group */
  uint32_t group_id;            /* the daemon's group id */
  uint32_t group_world;         /* W */
  uint32_t group_rank;          /* this member's rank */
  uint32_t group_tokens;        /* T_max per rank of the group */
  uint32_t group_tag;           /* names the layer in the group's job signature */
  uint32_t group_rows;          /* routed-row capacity of the virtual batch, 0: worst case */
  uint32_t group_ring;          /* ring rows for the routed buffers, 0: one pass */
} mok_layer_config;

/* The dtype of a layer's activations and gradients (x, out, acts, d_*): the
 * layer dtype, but bf16 for an fp8 layer (only its GEMM operands are e4m3). */
static inline uint32_t mok_layer_act_dtype(uint32_t layer_dtype) {
  return layer_dtype == MOK_DTYPE_FP8_E4M3 ? MOK_DTYPE_BF16 : layer_dtype;
}

/* Layout dimensions of a layer at T tokens (the shared formulas in mok_wire.h). */
static inline mok_layout_dims mok_layer_dims(const mok_layer_config *l, uint32_t tokens) {
  mok_layout_dims d;
  d.tokens = tokens;
  d.topk = l->topk;
  d.local_experts = l->local_experts;
  d.row_align = l->row_align;
  d.intermediate = l->intermediate;
  d.shared_intermediate = l->shared_intermediate;
  d.elem_size = mok_dtype_size(mok_layer_act_dtype(l->dtype));
  d.rows_limit = 0;
  return d;
}

/* the packed weight of an fp8 layer (its e4m3 bytes, their transpose, its
 * scales): mok_fp8_transposed_offset, mok_fp8_scales_offset and
 * mok_fp8_weight_bytes in mok_layout.h (the kernels size it too) */

/* ---- the context of a layer on an expert-parallel group (docs/ep.md) ----
 *
 * A group layer's schedule covers its local experts' rows of the group's
 * virtual batch: all ranks' token slots back to back, W * T_max tokens
 * (rank p's token t is virtual token p*T_max + t). Its ctx:
 *   schedule of the virtual batch (mok_group_routed_dims), padded to 256
 *   own topk_ids [T,K] int32, padded to 256
 *   g_routed, u_routed [rows_capacity of the virtual batch, I] (acts layout)
 *   g_shared, u_shared [T, I_s]
 */
static inline mok_layout_dims mok_group_routed_dims(const mok_layer_config *l) {
  mok_layout_dims d = mok_layer_dims(l, l->group_world * l->group_tokens);
  d.shared_intermediate = 0;
  d.rows_limit = l->group_rows;
  return d;
}

/* The routed-row capacity of a member's schedule for a group's capacity
 * multiplier m (the share of all W*T_max*K routes that may land on one
 * member's experts, as MoK's schedule_capacity_multiplier): ceil(m * routes)
 * plus every local expert's padding, at most the worst case. m <= 0 or
 * m >= 1: the worst case (returned as 0, no limit). Client and daemon both
 * size the ctx from this, so it is integer arithmetic on m in millionths. */
static inline uint32_t mok_group_rows_limit(uint32_t capacity_ppm, uint32_t world,
                                            uint32_t max_tokens, uint32_t topk,
                                            uint32_t local_experts, uint32_t row_align) {
  uint64_t routes = (uint64_t)world * max_tokens * topk;
  if (capacity_ppm == 0 || capacity_ppm >= 1000000u || row_align == 0) return 0;
  uint64_t rows = (routes * capacity_ppm + 999999u) / 1000000u +
                  (uint64_t)local_experts * (row_align - 1u);
  uint64_t worst = routes + (uint64_t)local_experts * (row_align - 1u);
  return rows >= worst || rows > UINT32_MAX ? 0 : (uint32_t)rows;
}
static inline uint64_t mok_group_ctx_ids_offset(const mok_layer_config *l) {
  mok_layout_dims v = mok_group_routed_dims(l);
  return mok_align256(mok_schedule_bytes(&v));
}
static inline uint64_t mok_group_ctx_acts_offset(const mok_layer_config *l, uint32_t tokens) {
  return mok_group_ctx_ids_offset(l) + mok_align256(4ull * tokens * l->topk);
}
static inline uint64_t mok_group_ctx_bytes(const mok_layer_config *l, uint32_t tokens) {
  mok_layout_dims v = mok_group_routed_dims(l), t = mok_layer_dims(l, tokens);
  return mok_group_ctx_acts_offset(l, tokens) + 2u * mok_acts_routed_bytes(&v) +
         2u * mok_acts_shared_bytes(&t);
}

#endif /* MOK_WIRE_H */
