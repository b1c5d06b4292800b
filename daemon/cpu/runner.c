/* SPDX-License-Identifier: Apache-2.0 */
/* cpu_runner: a FIFO of job records and one thread that empties it.
 *
 * Records live in a fixed ring of MOK_RING_ENTRIES (the most jobs a session
 * can have unfinished); job n uses record n % MOK_RING_ENTRIES. Three
 * counters order everything: submitted (engine thread), finished (runner),
 * reaped (engine thread, by poll, oldest first). All guarded by mu. */
#include "cpu/runner.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct mok_engine_job {
  struct cpu_runner *runner;
  uint64_t seq;
  mok_job_args args;
  mok_layer_config layer; /* args.layer points here */
  mok_engine_result res;
};

struct cpu_runner {
  cpu_runner_ops ops;
  void *arg;
  uint32_t idle_ms;
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  bool stopping;
  uint64_t submitted, finished, reaped;
  mok_engine_job jobs[MOK_RING_ENTRIES];
};

/* An absolute CLOCK_MONOTONIC time ms from now (the cv waits on it). */
static struct timespec deadline_in(uint32_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  ts.tv_sec += ms / 1000u;
  ts.tv_nsec += (long)(ms % 1000u) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  return ts;
}

static void *runner_main(void *p) {
  cpu_runner *r = p;
  bool holds = false; /* the jobs left something to give back */
  pthread_mutex_lock(&r->mu);
  for (;;) {
    if (r->stopping) break;
    if (r->finished == r->submitted) {
      if (holds && r->idle_ms) {
        struct timespec until = deadline_in(r->idle_ms);
        int rc = 0;
        while (!r->stopping && r->finished == r->submitted && rc != ETIMEDOUT)
          rc = pthread_cond_timedwait(&r->cv, &r->mu, &until);
        if (rc == ETIMEDOUT && r->finished == r->submitted && !r->stopping) {
          pthread_mutex_unlock(&r->mu);
          if (r->ops.idle) r->ops.idle(r->arg);
          pthread_mutex_lock(&r->mu);
          holds = false;
        }
      } else {
        pthread_cond_wait(&r->cv, &r->mu);
      }
      continue;
    }
    mok_engine_job *j = &r->jobs[r->finished % MOK_RING_ENTRIES];
    pthread_mutex_unlock(&r->mu);
    memset(&j->res, 0, sizeof j->res);
    r->ops.run(r->arg, &j->args, &j->res);
    holds = true;
    pthread_mutex_lock(&r->mu);
    r->finished++;
    pthread_mutex_unlock(&r->mu);
    if (r->ops.wake) r->ops.wake(r->ops.wake_arg);
    pthread_mutex_lock(&r->mu);
  }
  pthread_mutex_unlock(&r->mu);
  return NULL;
}

int mok__cpu_runner_start(const cpu_runner_ops *ops, void *arg, uint32_t idle_ms,
                          cpu_runner **ret) {
  *ret = NULL;
  cpu_runner *r = calloc(1, sizeof *r);
  if (!r) return ENOMEM;
  r->ops = *ops;
  r->arg = arg;
  r->idle_ms = idle_ms;
  pthread_condattr_t ca;
  int rc = pthread_condattr_init(&ca);
  if (rc == 0) rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  if (rc == 0) rc = pthread_cond_init(&r->cv, &ca);
  pthread_condattr_destroy(&ca);
  if (rc) {
    free(r);
    return rc;
  }
  if ((rc = pthread_mutex_init(&r->mu, NULL)) != 0) {
    pthread_cond_destroy(&r->cv);
    free(r);
    return rc;
  }
  if ((rc = pthread_create(&r->thread, NULL, runner_main, r)) != 0) {
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
    return rc;
  }
  *ret = r;
  return 0;
}

void mok__cpu_runner_stop(cpu_runner *r) {
  if (!r) return;
  pthread_mutex_lock(&r->mu);
  r->stopping = true;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  pthread_join(r->thread, NULL);
  pthread_mutex_destroy(&r->mu);
  pthread_cond_destroy(&r->cv);
  free(r);
}

mok_engine_job *mok__cpu_runner_submit(cpu_runner *r, const mok_job_args *a,
                                       mok_engine_result *res) {
  pthread_mutex_lock(&r->mu);
  if (r->submitted - r->reaped >= MOK_RING_ENTRIES) {
    pthread_mutex_unlock(&r->mu);
    res->status = MOK_EBUSY;
    snprintf(res->message, sizeof res->message, "too many jobs running in this session");
    return NULL;
  }
  mok_engine_job *j = &r->jobs[r->submitted % MOK_RING_ENTRIES];
  j->runner = r;
  j->seq = r->submitted;
  j->args = *a;
  if (a->layer) {
    j->layer = *a->layer;
    j->args.layer = &j->layer;
  }
  r->submitted++;
  pthread_cond_signal(&r->cv);
  pthread_mutex_unlock(&r->mu);
  return j;
}

int mok__cpu_runner_poll(mok_engine_job *j, mok_engine_result *res) {
  cpu_runner *r = j->runner;
  pthread_mutex_lock(&r->mu);
  bool done = j->seq < r->finished;
  if (done) {
    *res = j->res;
    if (j->seq == r->reaped) r->reaped++; /* the engine thread polls the oldest first */
  }
  pthread_mutex_unlock(&r->mu);
  return done ? 1 : 0;
}
