/* SPDX-License-Identifier: Apache-2.0 */
/* Standing jobs: a session's validated job descriptors kept by the engine
 * thread and run once per trigger (proto/mok_wire.h, mok_standing_words;
 * docs/cuda.md "Capture and replay").
 *
 * The engine thread owns a session's set. Each turn it reads every live
 * slot's trigger word once (a copy), and for a trigger of 1 with no
 * instance of that slot running it takes the trigger (writes 0) and starts
 * one instance through the engine's start(), with the arguments validated
 * at creation. When poll() reports the instance finished it counts it in
 * `done`, records a failure in `error`/`message`, and writes the flag
 * (unless the engine's stream wrote it already: writes_standing_flag).
 *
 * A standing job of a layer on an expert-parallel group runs the same way;
 * taking its trigger takes this member's turn in the group (its sequence
 * number, the group's barriers), so the members' triggers must come in the
 * same order (docs/ep.md "Capture and replay on a group").
 *
 * A standing job ends in a cancelled state, never silently: a trigger word
 * holding anything but 0 or 1, a region it names unregistered, its layer
 * destroyed, a trigger not taken within the fence timeout. A cancelled slot
 * keeps releasing its client (each trigger is answered with the flag and
 * the error stays set) until the client destroys it, so a captured graph
 * replayed after a failure never hangs; the error shows at the client's
 * next check.
 */
#ifndef MOK_STANDING_H
#define MOK_STANDING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine.h"
#include "mok_wire.h"

typedef struct mok_standing_entry {
  bool used;
  bool cancelled;
  uint32_t layer_id;
  uint32_t regions[MOK_MAX_TENSORS]; /* the regions its tensors live in */
  uint32_t n_regions;
  mok_layer_config layer; /* args.layer points here */
  mok_job_args args;      /* validated once, at creation */
  mok_engine_job *running; /* the instance in flight (one at a time) */
  uint64_t started, finished;
  uint64_t instance_t0;
  uint64_t trigger_seen_ns; /* a trigger waits since (0: none waits) */
  bool trigger_deferred;    /* it waits for the session's other work (a group slot) */
  bool turn_only;           /* running is a cancelled group slot's failed turn */
  bool failed;              /* error/message were written */
  int cancel_status;        /* why it was cancelled (MOK_OK: not cancelled) */
  char cancel_msg[MOK_STANDING_MSG]; /* and the message (never read back from the words) */
} mok_standing_entry;

typedef struct mok_standing_set {
  mok_standing_entry *items; /* MOK_STANDING_MAX, allocated at the first creation */
  uint32_t live;       /* used slots */
  uint32_t running;    /* instances in flight */
  uint64_t hot_until_ns; /* triggers came recently: the engine thread polls closely */
} mok_standing_set;

/* Instances of a standing job of a layer on an expert-parallel group
 * (layer.group_id) take this member's turn in the group's job order when
 * their trigger is taken: the engine thread runs them (engine_thread.c)
 * through these hooks. */
typedef struct mok_standing_group_ops {
  /* May an instance start now? false: the session's other work must end
   * first (the cpu engine runs a group job on the engine thread, on the
   * session's scratch); the trigger is kept for a later turn. */
  bool (*ready)(void *ctx, const mok_standing_entry *st);
  /* Start an instance: take the member's turn (res filled; NULL: it ended
   * already). */
  mok_engine_job *(*start)(void *ctx, const mok_standing_entry *st, const mok_job_args *a,
                           mok_engine_result *res);
  /* A trigger of a cancelled slot: the member still takes its turn as a
   * failed job (status, message), so that its peers fail it at once instead
   * of waiting out the group's timeout. Returns the job that takes the turn
   * on the device (writing the slot's flag), or NULL (the turn was taken on
   * the host, or cannot be: the session left the group). */
  mok_engine_job *(*fail_turn)(void *ctx, const mok_standing_entry *st, int status,
                               const char *msg, mok_engine_result *res);
  /* An instance ended (a device barrier's timeout breaks the group). */
  void (*ended)(void *ctx, const mok_standing_entry *st, const mok_engine_result *res);
  void *ctx;
} mok_standing_group_ops;

/* What the set needs of its session and engine. */
typedef struct mok_standing_env {
  const mok_engine_ops *ops;
  mok_engine *engine;
  mok_engine_session *es;
  void *shm;                 /* the session memory (mok_shm_standing) */
  uint64_t fence_timeout_ns; /* a trigger not taken this long cancels */
  uint64_t session_id;       /* for the log */
  const mok_standing_group_ops *group; /* NULL: group layers are refused */
} mok_standing_env;

/* Create slot `slot` from a validated job (args from mok_job_check on the
 * descriptor copy, flags without MOK_JOB_STANDING). Returns a mok_status. */
int mok_standing_add(mok_standing_set *set, const mok_standing_env *env, uint32_t slot,
                        uint32_t layer_id, const mok_layer_config *layer,
                        const mok_job_desc *desc, const mok_job_args *args, char *err,
                        size_t errlen);
/* Destroy a slot; an instance still running finishes first (the slot is
 * then freed by mok_standing_turn). Returns a mok_status. */
int mok_standing_remove(mok_standing_set *set, const mok_standing_env *env, uint32_t slot,
                         char *err, size_t errlen);

/* One turn: poll running instances, take triggers (take: else only poll
 * and answer cancelled slots), time out triggers left waiting. Returns true
 * when it started or finished an instance. *fatal is set (with why) when
 * the engine broke for good. */
bool mok_standing_turn(mok_standing_set *set, const mok_standing_env *env, uint64_t now,
                       bool take, bool *fatal, char *why, size_t whylen);

/* Cancel every live slot naming region `region` (0: every slot), or whose
 * layer is layer_id (when region is UINT32_MAX), with the reason given. */
void mok_standing_cancel_region(mok_standing_set *set, const mok_standing_env *env,
                                uint32_t region, const char *why);
void mok_standing_cancel_layer(mok_standing_set *set, const mok_standing_env *env,
                               uint32_t layer_id, const char *why);
void mok_standing_cancel_all(mok_standing_set *set, const mok_standing_env *env, const char *why);

/* A live slot's trigger is set and can be taken now (the engine thread
 * must not sleep). */
bool mok_standing_triggered(const mok_standing_set *set, void *shm);
/* Free a set whose instances all finished. */
void mok_standing_free(mok_standing_set *set);

#endif /* MOK_STANDING_H */
