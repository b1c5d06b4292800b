/* SPDX-License-Identifier: Apache-2.0 */
/* One client, several threads (mok.h: "its calls are serialised inside").
 *
 * A thread asleep in mok_wait must not hold up the other threads' calls:
 * serialised means one at a time, not queued behind a wait. The long job
 * is a forward on a group of two ranks whose second rank never comes: it
 * runs until the group's timeout and uses no CPU meanwhile. The bounds are
 * the order of events (the other thread's calls return while the waiter
 * still waits) and times measured here, never fixed short ones, so a
 * sanitizer's slowdown does not change the verdict.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <time.h>
#include <unistd.h>

#include "job_bufs.h"
#include "mok.h"

enum { W = 2, H = 32, I = 32, E = 4, K = 2, T = 16 };

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* every token routed to experts 0..K-1 (the job never runs: any valid ids) */
static void first_experts(int32_t *ids, uint64_t n, const mok_layer *l, unsigned *s) {
  (void)l, (void)s;
  for (uint64_t i = 0; i < n; i++) ids[i] = (int32_t)(i % K);
}

/* A forward on rank 0 of a group whose rank 1 never joins: it completes
 * with MOK_ETIMEOUT after stall_ms. */
typedef struct stalled_job {
  mok_group *g;
  mok_layer *l;
  job_bufs b;
  uint64_t ticket;
} stalled_job;

static void stalled_job_submit(mok_client *c, stalled_job *s, uint32_t stall_ms) {
  char key[96];
  snprintf(key, sizeof key, "test-threads-%d-%ld-%u", (int)getpid(), (long)time(NULL), stall_ms);
  mok_group_sizing sz = {.max_tokens = T, .hidden = H, .topk = K, .experts = E,
                         .dtype = test_dtype(), .timeout_ms = stall_ms};
  CHECK_MSG(mok_group_join(c, key, 0, W, &sz, &s->g) == MOK_OK, "join: %s", mok_last_error());
  mok_layer_desc d = {.hidden = H, .intermediate = I, .experts = E, .topk = K, .max_tokens = T,
                      .dtype = test_dtype(), .group = s->g};
  CHECK_MSG(mok_layer_create(c, &d, &s->l) == MOK_OK, "layer: %s", mok_last_error());
  job_bufs_alloc(c, s->l, MOK_OP_FORWARD, T, &s->b, 7, first_experts);
  mok_tensor t[MOK_SLOT_COUNT_];
  job_bufs_tensors(s->l, MOK_OP_FORWARD, T, &s->b, t);
  CHECK_MSG(mok_submit(s->l, MOK_OP_FORWARD, 0, T, t, &s->ticket) == MOK_OK, "submit: %s",
            mok_last_error());
}

typedef struct waiter {
  mok_client *c;
  uint64_t ticket;
  int status;
  double entered, left;
  atomic_int done;
  char message[256];
} waiter;

static void *waiter_main(void *arg) {
  waiter *w = arg;
  w->entered = now_s();
  w->status = mok_wait(w->c, w->ticket, 120000);
  w->left = now_s();
  snprintf(w->message, sizeof w->message, "%s", mok_last_error());
  atomic_store(&w->done, 1);
  return NULL;
}

/* A layer description mokd refuses as it reads the request (topk > experts):
 * answered at once by its loop, while the session's engine thread is busy
 * with the stalled job. */
static int refused_request(mok_client *c) {
  mok_layer_desc bad = {.hidden = H, .intermediate = I, .experts = E, .topk = E + 1,
                        .max_tokens = T, .dtype = test_dtype()};
  mok_layer_cost_info info;
  return mok_layer_cost(c, &bad, &info);
}

/* The time the calls made meanwhile take here, when nobody waits. */
static double quiet_call_s(mok_client *c) {
  double best = 1e9;
  for (int i = 0; i < 5; i++) {
    double t0 = now_s();
    CHECK_EQ_INT(refused_request(c), MOK_EINVAL);
    CHECK_EQ_INT(mok_async_error(c), MOK_OK);
    double took = now_s() - t0;
    if (took < best) best = took;
  }
  return best;
}

/* Sleep long enough that a thread just started is inside mok_wait: many
 * times what a call takes here (at least 50 ms). */
static void let_waiter_settle(double call_s) {
  double s = 50 * call_s > 0.05 ? 50 * call_s : 0.05;
  usleep((useconds_t)(s * 1e6));
}

static void test_a_waiting_thread_does_not_block_other_calls(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c = NULL;
  CHECK_MSG(mok_connect(d.sock, "threads", &c) == MOK_OK, "%s", mok_last_error());
  double call_s = quiet_call_s(c);
  /* the stall: far longer than the calls made meanwhile (at least 3 s) */
  uint32_t stall_ms = (uint32_t)(1000 * 400 * call_s);
  if (stall_ms < 3000) stall_ms = 3000;
  stalled_job s = {0};
  stalled_job_submit(c, &s, stall_ms);
  waiter w = {.c = c, .ticket = s.ticket};
  pthread_t th;
  double t0 = now_s();
  CHECK(pthread_create(&th, NULL, waiter_main, &w) == 0);
  let_waiter_settle(call_s);
  /* this thread's calls while the other waits: a request to mokd (its
   * reply makes the socket readable under the sleeper: not a hang-up), the
   * completion ring's state and the ticket's */
  CHECK_EQ_INT(refused_request(c), MOK_EINVAL);
  int request_before_wait_ended = !atomic_load(&w.done);
  CHECK_EQ_INT(mok_async_error(c), MOK_OK);
  int still_pending = mok_job_pending(c, s.ticket);
  int local_before_wait_ended = !atomic_load(&w.done);
  double calls_took = now_s() - t0;
  CHECK_MSG(request_before_wait_ended, "a request returned only after the other thread's wait");
  CHECK_MSG(local_before_wait_ended, "mok_async_error returned only after the other thread's wait");
  CHECK(still_pending);
  printf("# calls while another thread waits: %.1f ms (quiet: %.2f ms, stall %u ms)\n",
         1e3 * calls_took, 1e3 * call_s, stall_ms);
  CHECK(pthread_join(th, NULL) == 0);
  CHECK_MSG(w.status == MOK_ETIMEOUT, "the stalled job: %d (%s)", w.status, w.message);
  CHECK(!mok_job_pending(c, s.ticket));
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* mok_close while another thread sleeps in mok_wait: the sleeper leaves
 * (with the job's status, or MOK_ECLOSED when the close woke it first)
 * before the descriptors it polls close, and nothing is touched after the
 * free (the sanitizer builds check that). */
static void test_close_while_a_thread_waits(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c = NULL;
  CHECK_MSG(mok_connect(d.sock, "threads", &c) == MOK_OK, "%s", mok_last_error());
  double call_s = quiet_call_s(c);
  /* longer than mok_close's own wait for jobs in flight (5 s) */
  uint32_t stall_ms = 6000;
  stalled_job s = {0};
  stalled_job_submit(c, &s, stall_ms);
  waiter w = {.c = c, .ticket = s.ticket};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, waiter_main, &w) == 0);
  let_waiter_settle(call_s);
  double t0 = now_s();
  mok_close(c);
  double close_took = now_s() - t0;
  CHECK(pthread_join(th, NULL) == 0);
  CHECK_MSG(w.status == MOK_ECLOSED || w.status == MOK_ETIMEOUT, "the waiter: %d (%s)", w.status,
            w.message);
  /* the waiter stamps its leaving after mok_wait returned, so the stamp
   * may trail the close's end by a scheduling delay; leaving at a later
   * event (a timeout seconds on) is what this catches */
  CHECK_MSG(w.left - t0 <= close_took + 0.05, "the waiter left %.3f s after the close began, the "
            "close took %.3f s", w.left - t0, close_took);
  printf("# mok_close with a thread waiting: %.1f s, the waiter got %s\n", close_took,
         mok_status_name(w.status));
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_a_waiting_thread_does_not_block_other_calls),
    CHECK_CASE(test_close_while_a_thread_waits),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
