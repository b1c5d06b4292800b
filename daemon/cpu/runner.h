/* SPDX-License-Identifier: Apache-2.0 */
/* cpu_runner: a session's jobs on a thread of their own (the cpu engine's
 * asynchronous jobs).
 *
 * The engine thread submits a session's validated jobs in order and polls
 * the oldest; the runner runs them one after the other, in that order, on
 * the session's scratch. Different sessions' runners run at the same time
 * and share the engine's cpu_pool, where none waits for another's run: a
 * tenant's huge job slows another tenant's small one down but never holds
 * it up until it ends.
 *
 * A submitted job owns a copy of its arguments and of its layer's config,
 * so the engine thread may change its tables while the job runs (the
 * tensors' memory stays mapped until no job of the session runs: the
 * engine thread's rule). A runner idle for idle_ms calls ops->idle (the
 * session gives back its scratch), and ops->wake after every job, so the
 * engine thread need not spin while jobs run.
 */
#ifndef MOK_CPU_RUNNER_H
#define MOK_CPU_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "engine.h"

typedef struct cpu_runner cpu_runner;

typedef struct cpu_runner_ops {
  /* run one job to completion on the runner's thread */
  void (*run)(void *arg, const mok_job_args *a, mok_engine_result *res);
  /* no job for idle_ms: give back what the jobs keep (may be NULL) */
  void (*idle)(void *arg);
  /* a job finished (from the runner's thread; may be NULL) */
  void (*wake)(void *wake_arg);
  void *wake_arg;
} cpu_runner_ops;

/* Start a runner; 0 or an errno value. idle_ms 0: never idle. */
int mok__cpu_runner_start(const cpu_runner_ops *ops, void *arg, uint32_t idle_ms, cpu_runner **ret);
/* Stop and join it; only once no job it took is unfinished. Accepts NULL. */
void mok__cpu_runner_stop(cpu_runner *r);

/* Queue a job (a copy of a, with a->layer copied too). NULL: the runner
 * already holds MOK_RING_ENTRIES unfinished jobs (res says so). */
mok_engine_job *mok__cpu_runner_submit(cpu_runner *r, const mok_job_args *a,
                                       mok_engine_result *res);
/* 1 and res filled when j finished (j is then free for reuse), else 0. */
int mok__cpu_runner_poll(mok_engine_job *j, mok_engine_result *res);

#endif /* MOK_CPU_RUNNER_H */
