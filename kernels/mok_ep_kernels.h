/* SPDX-License-Identifier: Apache-2.0 */
/* mok kernels for expert parallelism on the GPU (docs/ep.md), behind a C API.
 *
 * Every member of a group owns one device buffer of the same layout (the
 * "symmetric" buffer, mok_k_ep_layout); every member maps every other
 * member's buffer (VMM fds, daemon/cuda/ep.c) and passes the addresses in
 * mok_k_ep.peers. Rank r's token t of the group's virtual batch is virtual
 * token v = r*T_max + t; a schedule over the virtual batch (T = W*T_max,
 * mok_k_dims of the routed part) names rows by virtual slot v*K + k.
 *
 * Data moves with plain loads and stores through the peers' mappings:
 *  pull:  a member reads its routed rows from the owners' x / d_out;
 *  push:  it writes each result row into the owner's unique (t,k) landing
 *         slot, so no two members ever write the same bytes;
 *  barrier: each member stores its arrival (a value that grows with every
 *         job: generation, sequence, phase) into every member's arrive
 *         word for it, with release semantics at system scope, and waits
 *         for all W arrivals in its own buffer (acquire). No multicast, no
 *         atomics on peers' memory. A barrier never returns early on a
 *         failed job (peers would wait for it); it raises MOK_ETIMEOUT in
 *         the status word when a member has not arrived in timeout_ns, and
 *         (share_status) publishes the job's status word so that a member
 *         whose job failed fails it everywhere.
 * Conventions as mok_kernels.h: enqueue only, status word, 16-byte aligned
 * rows, deterministic (each byte written by one thread of one member).
 */
#ifndef MOK_EP_KERNELS_H
#define MOK_EP_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include "mok_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_K_EP_MAX_WORLD 64

/* Byte offsets inside every member's buffer (each a multiple of 256). */
typedef struct mok_k_ep_layout {
  uint64_t arrive; /* uint64 [MAX_WORLD]: member p's arrival, written by p */
  uint64_t status; /* int32 [MAX_WORLD]: member p's job status at the last barrier */
  uint64_t post;   /* mok_k_ep_post: this member's signature of the current job */
  uint64_t x;      /* bf16 [T_max, H] */
  uint64_t d_out;  /* bf16 [T_max, H] */
  uint64_t ids;    /* int32 [T_max, K] (tokens past the job's T: -1) */
  uint64_t rw;     /* f32 [T_max, K] */
  uint64_t land;   /* bf16 [T_max*K, H]: the (t,k) rows pushed here */
  uint64_t drw;    /* f32 [T_max*K]: the (t,k) d_rw values pushed here */
  uint64_t bytes;  /* total */
} mok_k_ep_layout;

mok_k_ep_layout mok_k_ep_layout_of(int T_max, int H, int K);

typedef struct mok_k_ep {
  int world, rank, T_max;
  int max_ctas; /* pull and push on at most this many CTAs of 1024 threads (0: no cap) */
  mok_k_ep_layout off;
  uint64_t base[MOK_K_EP_MAX_WORLD]; /* member p's buffer as mapped by this one */
} mok_k_ep;

/* A job's signature, posted by every member into its own buffer before
 * barrier 1 and compared by every member after it (groups without a host
 * segment: formed through NCCL). words[0, MOK_K_EP_POST_MATCH) must be
 * equal on every member (sequence, op, flags, layer tag, I, I_s, clamp);
 * words[MOK_K_EP_POST_MATCH] is the member's own status before any device
 * work (0: ok), which every member then fails the job with. */
#define MOK_K_EP_POST_WORDS 16
#define MOK_K_EP_POST_MATCH 8
typedef struct mok_k_ep_post {
  int32_t w[MOK_K_EP_POST_WORDS];
} mok_k_ep_post;

/* Write this member's post (and raise its own status into *status). */
int mok_k_ep_post_write(const mok_k_ep *g, mok_k_ep_post post, int32_t *status,
                        mok_k_stream stream);
/* After barrier 1: every member's post against this one's. A member that
 * failed raises its status here; a different job raises MOK_EINVAL. */
int mok_k_ep_post_check(const mok_k_ep *g, int32_t *status, mok_k_stream stream);

/* See above. value must grow from one barrier to the next. */
int mok_k_ep_barrier(const mok_k_ep *g, uint64_t value, uint64_t timeout_ns, int share_status,
                     int32_t *status, mok_k_stream stream);

/* dst[p*bytes ..] = member p's [off, off+bytes) for every p (bytes a
 * multiple of 4): the all-gather of ids or router weights. */
int mok_k_ep_allgather(const mok_k_ep *g, uint64_t off, size_t bytes, void *dst,
                       mok_k_stream stream);

/* dst[r] = the row of virtual token v of row r's slot, read from its
 * owner's buffer at off (x or d_out); zeros on padding rows. dv: the
 * virtual batch's routed dims (T = W*T_max). */
int mok_k_ep_pull_rows(const mok_k_ep *g, const mok_k_dims *dv, const int32_t *schedule,
                       uint64_t off, mok_k_bf16 *dst, int32_t *status, mok_k_stream stream);

/* For each used row r of slot (v,k): the owner's land[t*K+k] = rows[r],
 * and with drw_virtual its drw[t*K+k] = drw_virtual[v*K+k]. */
int mok_k_ep_push_rows(const mok_k_ep *g, const mok_k_dims *dv, const int32_t *schedule,
                       const mok_k_bf16 *rows, const float *drw_virtual, int32_t *status,
                       mok_k_stream stream);

/* The member's own tokens (d: T = its tokens, E the global experts):
 * slot_row[t*K+k] = t*K+k for a routed slot, -1 for a dropped one; an id
 * outside [0,E) and not -1 raises MOK_EROUTE. */
int mok_k_ep_own_slots(const mok_k_dims *d, const int32_t *ids, int32_t *slot_row,
                       int32_t *status, mok_k_stream stream);

/* out[t] = rnd(base[t] + sum_k (rw[t,k] *) land[slot_row[t,k]]) in f32,
 * k ascending: the same arithmetic as mok_k_combine (rw given) and
 * mok_k_dispatch_backward (rw NULL). base may be NULL. */
int mok_k_ep_ksum(const mok_k_dims *d, const int32_t *slot_row, const mok_k_bf16 *land,
                  const float *rw, const mok_k_bf16 *base, mok_k_bf16 *out, int32_t *status,
                  mok_k_stream stream);

/* d_rw[i] = slot_row[i] >= 0 ? drw_land[i] : 0 for i < T*K. */
int mok_k_ep_own_drw(const mok_k_dims *d, const int32_t *slot_row, const float *drw_land,
                     float *d_rw, int32_t *status, mok_k_stream stream);

/* ---- the ring (mok_ring.cu) --------------------------------------------------
 *
 * With a ring of R rows, a member's schedule over the virtual batch (dv,
 * capacity C) runs in macrobatches of whole local experts that fit R. The
 * plan is int32 [batches][4] = {e0, e1, base, rows}: local experts
 * [e0, e1), schedule rows [base, base + rows); macrobatches past the last
 * are {E_loc, E_loc, 0, 0}. An expert with more padded rows than R raises
 * MOK_EOVERFLOW and leaves every macrobatch empty. plan + 4*m is also the
 * expert range for mok_k_expert_backward_experts. */

/* Host: how many macrobatches the worst case needs (1: no ring needed). */
int mok_k_ring_batches(long long capacity_rows, int ring_rows, int E_loc);

int mok_k_ring_plan(const mok_k_dims *dv, const int32_t *schedule, int ring_rows, int batches,
                    int32_t *plan, int32_t *status, mok_k_stream stream);

/* Macrobatch m's schedule: dims dr = dv with rows_limit R; its rows are the
 * macrobatch's rows renumbered from 0; other experts have no rows; slots
 * of other macrobatches map to -1. */
int mok_k_ring_schedule(const mok_k_dims *dv, const int32_t *schedule, const int32_t *plan, int m,
                        const mok_k_dims *dr, int32_t *sub, mok_k_stream stream);

/* Rows [0, rows) of the ring's acts g, u [R, I] <-> rows [base, base+rows)
 * of the ctx's g, u [C, I] (to_ctx: ring -> ctx). */
int mok_k_ring_copy_acts(const int32_t *plan, int m, int ring_rows, int I, mok_k_bf16 *ctx_g,
                         mok_k_bf16 *ctx_u, mok_k_bf16 *ring_g, mok_k_bf16 *ring_u, int to_ctx,
                         mok_k_stream stream);

/* ctx g, u rows [rows_used, C) = 0 (rows_used from the schedule's header):
 * the rows a ring, or GEMMs on dims with no_tail, leave unwritten. */
int mok_k_acts_zero_tail(const mok_k_dims *dv, const int32_t *schedule, mok_k_bf16 *ctx_g,
                         mok_k_bf16 *ctx_u, mok_k_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* MOK_EP_KERNELS_H */
