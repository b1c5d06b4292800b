/* SPDX-License-Identifier: Apache-2.0 */
/* Expert-parallel groups: membership, the shared segment, job ordering and
 * the host barriers (docs/ep.md).
 *
 * A group is W daemons, one rank each, that serve the layers of one
 * training job across W GPUs. On one host its members share one segment
 * (a file in the group directory, which only the daemons' uid can write,
 * named from the joining client's uid and the group key):
 * a header with the group's sizing, per-rank membership, barrier words and
 * posted job signatures, then the symmetric buffers of every rank, laid out
 * by kind so that all ranks' x rows form one [W*T_max, H] array.
 *
 * Everything here runs on the engine thread (the group table belongs to it).
 * Engine-neutral: the cpu engine moves data through the segment's buffers
 * (cpu/ep.c); a GPU engine would keep its symmetric buffers in device
 * memory and use the same membership, ordering and failure rules.
 */
#ifndef MOK_GROUP_H
#define MOK_GROUP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "mok_enums.h"
#include "mok_wire.h"

#define MOK_GROUP_MAX_WORLD 64u
#define MOK_GROUP_KEY_MAX 128u
#define MOK_GROUP_DEFAULT_TIMEOUT_MS 30000u
#define MOK_GROUP_MAX_TIMEOUT_MS 3600000u
#define MOK_GROUP_LINGER_MS 60000u /* a group no session holds is kept this long */
#define MOK_GROUP_MAX_BYTES (64ull << 30)
#define MOK_GROUP_MAX_RING_ROWS (1u << 26)
#define MOK_GROUP_NCCL_ID_BYTES MOK_NCCL_ID_BYTES /* an NCCL unique id (mok_enums.h) */
#define MOK_GROUP_DIR_DEFAULT "/run/mok/groups" /* where segments live (group-dir) */

typedef struct mok_ep_group_sizing {
  uint32_t world, max_tokens, hidden, topk, experts, dtype;
  uint32_t capacity_ppm; /* mok_group_rows_limit (mok_wire.h); 0: the worst case */
  uint32_t ring_rows;    /* rows of the routed buffers; 0: one pass */
} mok_ep_group_sizing;

typedef struct mok_ep_group_join_args {
  uid_t uid; /* the joining client's (SO_PEERCRED) */
  char key[MOK_GROUP_KEY_MAX + 1];
  uint32_t rank;
  uint32_t timeout_ms;
  mok_ep_group_sizing sizing;
  bool nccl;     /* formed through NCCL with nccl_id (no shared segment) */
  uint8_t nccl_id[MOK_GROUP_NCCL_ID_BYTES];
} mok_ep_group_join_args;

/* What a member posts for each group job; every member compares every
 * post with its own before any data moves. */
typedef struct mok_ep_group_post {
  uint64_t seq;
  uint32_t op, flags, tokens;
  uint32_t tag, intermediate, shared_intermediate, has_limit;
  float swiglu_limit;
  uint32_t dtype; /* the layer's: an fp8 layer and a bf16 one share a bf16 group */
  int32_t status; /* this member's own checks before barrier 1 */
  char msg[MOK_JOB_MESSAGE_MAX]; /* its whole message: a peer's failure reaches every client */
} mok_ep_group_post;

/* The segment's buffers, as the cpu engine addresses them (host memory). */
typedef struct mok_ep_group_buffers {
  void *x;     /* [W*T_max, H] layer dtype */
  void *d_out; /* [W*T_max, H] */
  int32_t *ids;  /* [W*T_max, K] */
  float *rw;     /* [W*T_max, K] */
  void *land;    /* [W*T_max*K, H]: the (t,k) slots combine pushes into (y, then d_x) */
  float *d_rw;   /* [W*T_max*K]: the (t,k) slots of d_router_weights */
} mok_ep_group_buffers;

typedef struct mok_ep_group mok_ep_group;
typedef struct mok_ep_group_table mok_ep_group_table;

/* abort: polled while waiting (the engine thread's stop flag). */
mok_ep_group_table *mok_ep_group_table_create(const _Atomic bool *abort);
/* Leaves and releases every group (daemon exit). */
void mok_ep_group_table_destroy(mok_ep_group_table *t);

/* Join (or re-join) a group; the session holds a reference until it
 * leaves or goes. rejoined: this daemon held the group already. */
int mok_ep_group_join(mok_ep_group_table *t, const mok_ep_group_join_args *a, mok_ep_group **ret,
                   bool *rejoined, char *err, size_t errlen);
mok_ep_group *mok_ep_group_find(mok_ep_group_table *t, uint32_t id);
/* The group this daemon holds under (uid, key), or NULL. */
mok_ep_group *mok_ep_group_find_key(mok_ep_group_table *t, uid_t uid, const char *key);
/* Drop a session's reference. leave: the client left on purpose, so a
 * group nobody holds goes at once; otherwise it lingers for a re-join. */
void mok_ep_group_unref(mok_ep_group_table *t, mok_ep_group *g, bool leave);
/* Release groups that nobody held for MOK_GROUP_LINGER_MS. */
void mok_ep_group_tick(mok_ep_group_table *t);
void mok_ep_group_set_linger_ms(mok_ep_group_table *t, uint32_t ms);
/* Where segments live (NULL or "": mok_ep_group_dir_of(NULL)). Every
 * member of a group must use the same directory. */
void mok_ep_group_set_dir(mok_ep_group_table *t, const char *dir);

/* ---- the segments' directory (docs/security.md) ----------------------------
 *
 * The directory: configured (group-dir), else $MOK_GROUP_DIR (a fallback
 * for tests), else MOK_GROUP_DIR_DEFAULT. */
const char *mok_ep_group_dir_of(const char *configured);
/* Is dir fit for segments? A real directory (not a link) owned by the
 * daemon's euid (or root, the euid able to write it), not writable by
 * group or others, in a parent others cannot write (unless sticky).
 * create: make it 0700 (and a missing parent 0755) when absent. Returns a
 * mok_status; err says what is wrong and how to fix it. */
int mok_ep_group_dir_check(const char *dir, bool create, char *err, size_t errlen);
/* At start: check (create) dir, then remove the segments nobody can be
 * using (every member's mokd gone, none attached) and anything under a
 * segment's name that mokd did not make (links, other modes or owners).
 * *removed counts them. */
int mok_ep_group_dir_sweep(const char *dir, unsigned *removed, char *err, size_t errlen);
/* The bytes of a segment of this sizing (0: the sizing is invalid; the
 * join would be refused). Groups formed through NCCL have no segment; their
 * device buffers are of the same size. */
uint64_t mok_ep_group_segment_bytes(const mok_ep_group_sizing *s);
/* The segment of (uid, key) in dir. MOK_OK, or MOK_EINVAL if len is short. */
int mok_ep_group_segment_path(const char *dir, uid_t uid, const char *key, char *buf,
                              size_t len);

/* Walk the table: the first group (prev NULL) or the one after prev. */
mok_ep_group *mok_ep_group_next(mok_ep_group_table *t, mok_ep_group *prev);
const char *mok_ep_group_key(const mok_ep_group *g);
uint32_t mok_ep_group_refs(const mok_ep_group *g); /* joins holding it (0: lingering) */
bool mok_ep_group_is_broken(const mok_ep_group *g);
uint32_t mok_ep_group_id(const mok_ep_group *g);
uid_t mok_ep_group_uid(const mok_ep_group *g);
uint32_t mok_ep_group_rank(const mok_ep_group *g);
const mok_ep_group_sizing *mok_ep_group_get_sizing(const mok_ep_group *g);
uint64_t mok_ep_group_generation(const mok_ep_group *g);
uint64_t mok_ep_group_sequence(const mok_ep_group *g);
const mok_ep_group_buffers *mok_ep_group_bufs(const mok_ep_group *g);
uint32_t mok_ep_group_timeout_ms(const mok_ep_group *g);

/* ---- the engine's part of a group ------------------------------------------
 *
 * An engine that keeps its buffers outside the segment (cuda: one device
 * allocation per member, shared as a VMM fd) hangs its state on the group;
 * the group frees it (state_free) when this daemon leaves the group, before
 * it gives up its rank. dev_serial (random, nonzero) names the member's
 * buffer in the segment, so peers notice when a rank's buffer was replaced
 * (its mokd restarted) and map the new one. */
void *mok_ep_group_engine_state(const mok_ep_group *g);

/* What an engine needs to form a group through NCCL, copied out of the
 * group so that it can be formed off the engine thread. */
typedef struct mok_ep_group_form {
  uid_t uid;
  uint32_t rank, timeout_ms;
  mok_ep_group_sizing sizing;
  uint8_t nccl_id[MOK_GROUP_NCCL_ID_BYTES];
} mok_ep_group_form;
mok_ep_group_form mok_ep_group_form_of(const mok_ep_group *g);
/* Formed through NCCL (no segment; the engine forms the communicator with
 * the id, and compares the job posts on the device). */
bool mok_ep_group_is_nccl(const mok_ep_group *g);
/* Formed through NCCL and not formed yet on this daemon (no engine state):
 * the engine's group_form must form it before it is used. */
bool mok_ep_group_needs_forming(const mok_ep_group *g);
/* The engine could not attach to g after a join (why: its message): a
 * group without a segment (formed through NCCL) lost its old state, so it
 * is broken until a join succeeds; a group with one is left as it is. */
void mok_ep_group_attach_failed(mok_ep_group *g, const char *why);
const uint8_t *mok_ep_group_nccl_id(const mok_ep_group *g); /* NULL: not NCCL */
void mok_ep_group_set_engine_state(mok_ep_group *g, void *state, void (*state_free)(void *),
                                   uint64_t dev_serial);

typedef struct mok_ep_group_peer {
  int32_t pid;         /* the member's mokd (0: none) */
  uint64_t dev_serial; /* its device buffer's name (0: none yet) */
  bool joined;         /* a member of this daemon's generation */
} mok_ep_group_peer;
mok_ep_group_peer mok_ep_group_peer_of(const mok_ep_group *g, uint32_t p);

/* Break the group (a device-side barrier timed out): every member's later
 * jobs fail until its clients re-join. */
void mok_ep_group_mark_broken(mok_ep_group *g, const char *why);

/* Health counters (the metrics): barriers of this group that timed out on
 * this member, host ones counted by the barrier itself and device ones by
 * the engine thread (count_timeout); and how often rank p was missing when
 * a host barrier timed out. */
void mok_ep_group_count_timeout(mok_ep_group *g);
uint64_t mok_ep_group_timeouts(const mok_ep_group *g);
uint64_t mok_ep_group_rank_missed(const mok_ep_group *g, uint32_t p);

/* Tokens rank p posted for the current job (after barrier 1). */
uint32_t mok_ep_group_peer_tokens(const mok_ep_group *g, uint32_t p);

/* ---- one group job (an engine's start() on a group calls these in order) --
 *
 *   mok_ep_group_job_start   may this member write its slots? (group healthy)
 *   ... the engine copies its inputs into its slots ...
 *   mok_ep_group_job_post    post (seq, op, layer, own status), barrier 1, and
 *                         compare every member's post: MOK_OK means every
 *                         member will go on with the same job
 *   ... pull, compute, push ...
 *   mok_ep_group_job_finish  barrier 2 with this member's status: MOK_OK
 *                         means every member's pushes are in place
 *
 * A failure fills err with a message for the client. ETIMEOUT (a missing or
 * stalled peer) marks the group broken: every member's later jobs fail until
 * its clients re-join. A mismatch fails the job on every member and leaves
 * the group usable. */
int mok_ep_group_job_start(mok_ep_group *g, char *err, size_t errlen);
int mok_ep_group_job_post(mok_ep_group *g, mok_ep_group_post *mine, char *err, size_t errlen);
int mok_ep_group_job_finish(mok_ep_group *g, int status, const char *msg, char *err, size_t errlen);

/* The signature of a job on a layer (status/msg left 0). */
mok_ep_group_post mok_ep_group_post_for(const mok_layer_config *l, uint32_t op, uint32_t flags,
                                  uint32_t tokens);

/* A job of a layer on g (op, flags, tokens) failed before it ran (status,
 * msg): it still takes this member's turn, so that every member fails it
 * with the same message instead of waiting for this one until the timeout.
 * Posted through the host segment here (forward and backward only; true);
 * false: the group's posts travel on the device (formed through NCCL), and
 * the engine takes the turn with a NOP (mok_job_args.group_failed). */
bool mok_ep_group_post_failure(mok_ep_group *g, const mok_layer_config *l, uint32_t op,
                               uint32_t flags, uint32_t tokens, int status, const char *msg);

/* Check a join against a segment's recorded owner and sizing (the tenant
 * and sizing rules, exposed for unit tests). */
int mok_ep_group_check_join(uid_t seg_uid, const mok_ep_group_sizing *seg, const char *seg_key,
                         const mok_ep_group_join_args *a, char *err, size_t errlen);

#endif /* MOK_GROUP_H */
