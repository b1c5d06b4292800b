/* SPDX-License-Identifier: Apache-2.0 */
/* The engine thread's state, shared by its files: engine_thread.c (the
 * rings, the commands, the jobs, the resources a job touches) and
 * engine_groups.c (expert-parallel groups: joins, forming through NCCL off
 * the thread, a group job's turn). Not an interface: both files are the
 * engine thread. */
#ifndef MOK_ENGINE_THREAD_INTERNAL_H
#define MOK_ENGINE_THREAD_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <unistd.h>

#include "engine.h"
#include "engine_thread.h"
#include "ep/group.h"
#include "job_sink.h"
#include "region.h"
#include "session_shm.h"
#include "standing.h"

#define LATENCY_WINDOW 1024u

typedef struct layer_entry {
  uint32_t id;
  mok_layer_config cfg;
  mok_engine_layer *state; /* the engine's (layer_open), or NULL */
} layer_entry;

/* A job the engine is still running (asynchronous engines). */
typedef struct pend {
  mok_engine_job *job;
  uint64_t user_data, seq, t0;
  uint16_t op;
  int fail_status; /* != MOK_OK: the job failed validation and runs as a fence-only NOP */
  uint32_t group_id; /* a job of a layer on this group (0: none) */
  char fail_message[MOK_JOB_MESSAGE_MAX];
  struct pend *next;
} pend;
_Static_assert(sizeof(((pend *)0)->fail_message) == sizeof(((mok_engine_result *)0)->message),
               "a refused job's message is copied whole");

/* One uid's jobs as max-jobs-per-uid counts them. Engine thread only: the
 * jobs are taken, completed and the sessions attached, faulted and freed on
 * it, so the counts need no lock. held is a running count (the jobs its
 * sessions' running lists hold, refused ones left out), changed as a job is
 * taken or completes and as a session faults or goes; the jobs still queued
 * in its sessions' rings are read from their tails at the check, because a
 * client moves its tail without telling the engine (the doorbell is a wake-up,
 * not a count). */
typedef struct uid_jobs {
  uint32_t uid;
  uint32_t held;
  struct esession *sessions; /* its sessions, through uid_next */
  struct uid_jobs *next;
} uid_jobs;

/* The engine-side half of a session. */
typedef struct esession {
  uint64_t id;
  mok_session_shm shm;
  mok_session_limits limits;
  uint32_t uid;
  mok_region_table regions;
  layer_entry *layers;
  size_t n_layers, cap_layers;
  uint32_t next_layer_id;
  uint32_t sq_head, cq_tail; /* our private copies: never read back from shared memory */
  uint64_t seq;
  uint64_t jobs_done, jobs_failed;
  mok_job_sink *sink; /* the metrics' (NULL: off) */
  bool faulted;
  mok_engine_session *es; /* the engine's (session_open), or NULL */
  pend *pend_head, *pend_tail;
  uint32_t n_pend;
  uint32_t n_pend_refused; /* of those, jobs that failed their checks (fence-only NOPs) */
  bool detaching; /* the client is gone: freed once its jobs finished */
  /* released once no job of the session runs any more */
  mok_region *dead_regions;
  size_t n_dead_regions, cap_dead_regions;
  mok_engine_layer **dead_layers;
  size_t n_dead_layers, cap_dead_layers;
  uint32_t *groups; /* group ids this session joined (one entry per join) */
  size_t n_groups, cap_groups;
  mok_standing_set standing; /* standing jobs (standing.h) */
  mok_standing_group_ops standing_group; /* their group layers' turns (ctx: this session) */
  struct mok_engine_thread *thread;      /* the one that serves it */
  uid_jobs *uid_jobs;      /* its uid's */
  uint32_t uid_counted;    /* what it adds to uid_jobs->held now */
  struct esession *uid_next;
  struct esession *next;
} esession;

/* A group being formed through NCCL on a thread of its own (the join waits
 * for every rank: the engine thread must not). */
typedef struct former {
  pthread_t thread;
  struct mok_engine_thread *t;
  mok_cmd *cmd;        /* the JoinGroup, answered when the group formed */
  uint64_t session_id;
  uint32_t group_id;
  bool rejoined;
  mok_ep_group_form form;
  void *state;         /* the engine's, NULL on failure */
  int status;
  char message[256];
  _Atomic bool done;
  struct former *next;
} former;

struct mok_engine_thread {
  const mok_engine_ops *ops;
  mok_engine *engine;
  pthread_t thread;
  int epfd;
  int cmd_efd; /* wakes the thread for commands */
  pthread_mutex_t lock;
  mok_cmd *cmd_head, *cmd_tail;   /* loop -> engine */
  mok_cmd *done_head, *done_tail; /* engine -> loop */
  void (*on_done)(void *);
  void *on_done_arg;
  _Atomic bool stopping;
  uint32_t drain_ms;
  esession *sessions;
  esession *rr_next; /* where the next round-robin turn starts */
  uint64_t jobs_done, jobs_failed;
  uint64_t latency[LATENCY_WINDOW];
  uint64_t latency_count;
  char describe[256];
  mok_ep_group_table *groups; /* expert-parallel groups this daemon serves a rank of */
  uint64_t ticked_ns;         /* the last 100 ms housekeeping turn */
  uint64_t spin_ns;           /* poll this long after the last work before sleeping */
  former *forming;            /* groups being formed through NCCL */
  uint64_t fence_timeout_ns;  /* a standing job's trigger not taken this long cancels it */
  uid_jobs *uids;             /* of the attached sessions */
};

static inline void ring_doorbell(int efd) {
  uint64_t one = 1;
  ssize_t r = write(efd, &one, sizeof one);
  (void)r; /* EAGAIN means the counter is already non-zero: the peer will wake */
}

/* ---- engine_thread.c ---------------------------------------------------- */

/* Hand a finished command back to the loop. */
void mok__thread_post_done(mok_engine_thread *t, mok_cmd *c);
esession *mok__thread_find_session(mok_engine_thread *t, uint64_t id);

/* ---- engine_groups.c ---------------------------------------------------- */

/* Commands: GroupId, JoinGroup (answered later, c->deferred, when the group
 * must first form through NCCL), LeaveGroup. */
void mok__group_cmd_id(mok_engine_thread *t, mok_cmd *c);
void mok__group_cmd_join(mok_engine_thread *t, esession *s, mok_cmd *c);
void mok__group_cmd_leave(mok_engine_thread *t, esession *s, mok_cmd *c);
/* Joins whose group finished forming (wait: every one, at shutdown). */
void mok__group_poll_formers(mok_engine_thread *t, bool wait);
/* A layer on a group: its shapes must fit the group's sizing (fills the
 * group fields); then, once the engine prepared it, its rows. */
int mok__group_layer_config(mok_engine_thread *t, esession *s, mok_layer_config *cfg, char *err,
                            size_t errlen);
int mok__group_layer_rows(mok_engine_thread *t, esession *s, mok_layer_config *cfg, char *err,
                          size_t errlen);
/* The group a job of a group layer goes to (start()'s g), or NULL. */
mok_ep_group *mok__group_of_job(mok_engine_thread *t, esession *s, const mok_job_desc *desc,
                                const mok_layer_config *layer, mok_engine_result *res);
/* The turns of s's standing instances of group layers (standing.h). */
mok_standing_group_ops mok__group_standing_ops(esession *s);
/* Stats: the groups session s joined (o->groups); every group of this
 * daemon, lingering ones included (st->groups, allocated). */
void mok__group_session_stats(mok_engine_thread *t, const esession *s, mok_session_stats *o);
void mok__group_daemon_stats(mok_engine_thread *t, mok_engine_stats *st);

#endif /* MOK_ENGINE_THREAD_INTERNAL_H */
