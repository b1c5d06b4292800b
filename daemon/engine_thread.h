/* SPDX-License-Identifier: Apache-2.0 */
/* The engine thread: owns the engine and everything a job touches.
 *
 * The loop thread never touches regions, layers or rings directly: it sends
 * commands (attach a session, register a buffer, create a layer, stats,
 * detach) and gets each command back, filled in, through the done queue
 * (on_done is called from the engine thread and must only wake the loop,
 * e.g. uv_async_send). Between commands the engine thread takes jobs from
 * every attached session's submission ring, round-robin, one job per session
 * per turn, validates each and runs it, and posts the completion.
 */
#ifndef MOK_ENGINE_THREAD_H
#define MOK_ENGINE_THREAD_H

#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "ep/group.h"
#include "session_shm.h"

struct mok_job_sink; /* job_sink.h: where finished jobs count for the metrics */

typedef enum mok_cmd_kind {
  MOK_CMD_ATTACH = 1,   /* engine takes over the session's shm and doorbells */
  MOK_CMD_REGISTER,     /* map a client buffer; takes ownership of reg.fd */
  MOK_CMD_UNREGISTER,
  MOK_CMD_CREATE_LAYER,
  MOK_CMD_DESTROY_LAYER,
  MOK_CMD_STATS,
  MOK_CMD_DETACH,       /* release everything of the session */
  MOK_CMD_SESSION_FAULT, /* engine -> loop only: the session broke its ring */
  MOK_CMD_JOIN_GROUP,    /* join (or re-join) an expert-parallel group (ep/group.h) */
  MOK_CMD_LEAVE_GROUP,
  MOK_CMD_GROUP_ID,      /* a fresh NCCL unique id for forming a group */
  MOK_CMD_LAYER_COST     /* what a layer would cost (CreateLayer's checks, no layer) */
} mok_cmd_kind;

#define MOK_STATS_GROUPS_MAX 8

typedef struct mok_group_stats {
  uint32_t group_id, rank, world;
  uint64_t generation, sequence;
} mok_group_stats;

typedef struct mok_session_stats {
  uint64_t session_id;
  mok_group_stats groups[MOK_STATS_GROUPS_MAX];
  uint32_t n_groups;
  uint32_t regions;
  uint64_t region_bytes;
  uint32_t layers;
  uint64_t jobs_done, jobs_failed;
  mok_session_memory memory; /* zeros: the engine does not say */
  uint32_t jobs_in_flight;   /* submitted, not yet completed (queued or running) */
  struct mok_job_sink *sink; /* the attach's (NULL once the session is detaching) */
} mok_session_stats;

/* A group of this daemon (mokctl lists them, lingering ones too). */
typedef struct mok_daemon_group_stats {
  uint32_t group_id, uid, rank, world, sessions;
  uint64_t generation, sequence;
  bool nccl, broken, forming;
  char key[MOK_GROUP_KEY_MAX + 1];
  uint64_t timeouts;                          /* barriers that timed out on this member */
  uint64_t rank_missed[MOK_GROUP_MAX_WORLD];  /* per rank: absent when a host barrier did */
} mok_daemon_group_stats;
#define MOK_STATS_DAEMON_GROUPS_MAX 64

typedef struct mok_engine_stats {
  uint64_t jobs_done, jobs_failed;
  mok_daemon_group_stats *groups; /* malloc'd; the receiver frees */
  size_t n_groups;
  uint64_t latency_p50_ns, latency_p99_ns; /* over the recent jobs */
  mok_session_stats *sessions;             /* malloc'd; the receiver frees */
  size_t n_sessions;
} mok_engine_stats;

typedef struct mok_session_limits {
  uint32_t max_regions;
  uint64_t max_region_bytes;
  uint32_t max_layers;
  uint32_t max_jobs_per_uid; /* jobs in flight across the uid's sessions; 0: no limit */
} mok_session_limits;

typedef struct mok_cmd {
  mok_cmd_kind kind;
  uint64_t session_id;
  uint32_t request_id; /* the client's, for the reply */
  union {
    struct {
      mok_session_shm shm;
      mok_session_limits limits;
      uint32_t uid; /* the client's (SO_PEERCRED), for per-uid limits */
      struct mok_job_sink *sink; /* its finished jobs count there (NULL: metrics off) */
    } attach;
    struct {
      int kind; /* mok_region_kind */
      int fd;   /* -1 when none; the engine closes it */
      uint64_t offset, bytes;
      uint8_t ipc_handle[64];
    } reg;
    uint32_t id; /* region, layer or group to drop */
    mok_layer_config layer;
    mok_ep_group_join_args join;
  } in;
  /* filled by the engine thread */
  int status;
  char message[256];
  struct {
    union {
      uint32_t region_id;
      mok_layer_config layer; /* with id in layer_id; MOK_CMD_LAYER_COST: the prepared layer */
      mok_engine_stats stats;
      struct {
        uint32_t id, local_experts, first_expert;
        uint64_t generation, sequence;
        bool rejoined;
      } group;
      uint8_t nccl_id[MOK_GROUP_NCCL_ID_BYTES];
    };
    mok_engine_layer_cost cost; /* MOK_CMD_LAYER_COST, beside its layer (not over it) */
  } out;
  uint32_t layer_id;
  bool deferred; /* the engine thread answers it later (a group forming) */
  struct mok_cmd *next;
} mok_cmd;

typedef struct mok_engine_thread mok_engine_thread;

/* Open the engine and start its thread. on_done(arg) is called (from the
 * engine thread) whenever commands are waiting in the done queue. */
int mok_engine_thread_start(const mok_engine_ops *ops, const mok_engine_config *cfg,
                            void (*on_done)(void *arg), void *arg, mok_engine_thread **ret,
                            char *err, size_t errlen);
const char *mok_engine_thread_describe(mok_engine_thread *t);
const char *mok_engine_thread_engine_name(mok_engine_thread *t);

/* Hand a command to the engine thread (it comes back through the done queue). */
void mok_engine_thread_submit(mok_engine_thread *t, mok_cmd *cmd);
/* Take every finished command, oldest first (a list through ->next). */
mok_cmd *mok_engine_thread_take_done(mok_engine_thread *t);

/* Drain: jobs already in the rings run (bounded by drain_ms), then the
 * thread exits and the engine closes. Commands still queued come back with
 * MOK_ESHUTDOWN. Safe to call once. */
void mok_engine_thread_stop(mok_engine_thread *t, uint32_t drain_ms);

#endif
