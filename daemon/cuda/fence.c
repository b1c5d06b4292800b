/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda engine's client fences: a job's stream waits for its client's
 * fence word, and a fence the client never writes (it died, or its stream
 * stalled) is released by the engine once the fence timeout passed, so the
 * stream moves on and the job fails (MOK_ETIMEOUT). Two paths release it,
 * both here: the watchdog, a thread that makes no CUDA calls, and the
 * engine thread's own check in poll(). The engine thread's check alone
 * cannot be relied on: some CUDA calls (cudaHostUnregister,
 * cudaIpcCloseMemHandle) wait for the device, and while a stream is parked
 * on a dead client's fence they would hold the engine thread - and the lock
 * they take blocks its other CUDA calls - for ever. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include "cuda/internal.h"
#include "clock.h"
#include "log.h"
#include "mok_slots.h"
#include "mok_wire.h"

#define MAX_FENCE_WATCHES 4096
enum { WATCH_FREE = 0, WATCH_ARMED, WATCH_CHECKING, WATCH_FORCED };
struct fence_watch {
  _Atomic int state;
  volatile uint64_t *word; /* the client's fence word (the session's sync page) */
  uint64_t value;          /* what the job waits for */
  uint64_t deadline_ns;
};

/* Write the awaited value into a fence word the client left behind. */
static void release(volatile uint64_t *word, uint64_t value) {
  atomic_thread_fence(memory_order_seq_cst);
  *word = value;
  atomic_thread_fence(memory_order_seq_cst);
}

static void *watchdog_main(void *arg) {
  mok_engine *e = arg;
  while (!atomic_load(&e->watchdog_stop)) {
    uint64_t now = mok_clock_ns();
    for (int i = 0; i < MAX_FENCE_WATCHES; i++) {
      fence_watch *w = &e->watches[i];
      int armed = WATCH_ARMED;
      if (atomic_load_explicit(&w->state, memory_order_acquire) != WATCH_ARMED) continue;
      if (now <= w->deadline_ns) continue;
      /* hold the slot while we touch the word: the job cannot be freed meanwhile */
      if (!atomic_compare_exchange_strong(&w->state, &armed, WATCH_CHECKING)) continue;
      int next = WATCH_ARMED;
      if (*w->word < w->value) {
        release(w->word, w->value);
        next = WATCH_FORCED;
        log_warn("cuda engine: a client fence (%llu) was not written within the timeout; "
                 "released, its job fails", (unsigned long long)w->value);
      }
      atomic_store_explicit(&w->state, next, memory_order_release);
    }
    usleep(5000);
  }
  return NULL;
}

void mok__cuda_fence_watch(mok_engine *e, mok_engine_job *j, volatile uint64_t *word,
                           uint64_t value) {
  j->watch = -1;
  if (!e->watchdog_started) return;
  for (int i = 0; i < MAX_FENCE_WATCHES; i++) {
    fence_watch *w = &e->watches[i];
    if (atomic_load_explicit(&w->state, memory_order_acquire) != WATCH_FREE) continue;
    w->word = word;
    w->value = value;
    w->deadline_ns = mok_clock_ns() + e->fence_timeout_ns;
    atomic_store_explicit(&w->state, WATCH_ARMED, memory_order_release);
    j->watch = i;
    return;
  }
}

bool mok__cuda_fence_unwatch(mok_engine *e, mok_engine_job *j) {
  if (j->watch < 0) return false;
  fence_watch *w = &e->watches[j->watch];
  j->watch = -1;
  for (;;) {
    int st = atomic_load_explicit(&w->state, memory_order_acquire);
    if (st == WATCH_CHECKING) continue; /* the watchdog is looking at it: a moment */
    if (atomic_compare_exchange_strong(&w->state, &st, WATCH_FREE)) return st == WATCH_FORCED;
  }
}

void mok__cuda_fence_watchdog_start(mok_engine *e) {
  e->watches = calloc(MAX_FENCE_WATCHES, sizeof *e->watches);
  /* without the watchdog the engine thread's own check still times fences out */
  e->watchdog_started = e->watches && pthread_create(&e->watchdog, NULL, watchdog_main, e) == 0;
}

void mok__cuda_fence_watchdog_stop(mok_engine *e) {
  if (e->watchdog_started) {
    atomic_store(&e->watchdog_stop, true);
    pthread_join(e->watchdog, NULL);
  }
  free(e->watches);
}

void mok__cuda_fence_check(mok_engine *e, mok_engine_job *j, uint64_t now) {
  mok_engine_session *s = j->s;
  if (j->fence_wait && !j->fence_forced && s->sync_dev) {
    if (!j->head_since) {
      j->head_since = now == UINT64_MAX ? 1 : now;
      log_debug("cuda engine: a %s job waits for client fence %llu (word %llu now)",
                mok_op_name(j->op), (unsigned long long)j->fence_wait,
                (unsigned long long)*mok_shm_sync_fence(s->sync_host, j->fence_wait));
    }
    if (now == UINT64_MAX || now - j->head_since > e->fence_timeout_ns) {
      volatile uint64_t *w = mok_shm_sync_fence(s->sync_host, j->fence_wait);
      if (*w < j->fence_wait) {
        /* the client never wrote its fence (it died, or its stream stalled):
         * release the wait ourselves so the stream moves on; the job fails */
        release(w, j->fence_wait);
        j->fence_forced = true;
        log_warn("cuda engine: a job waited %.1f s for its client's fence %llu; released",
                 now == UINT64_MAX ? 0.0 : (double)(now - j->head_since) / 1e9,
                 (unsigned long long)j->fence_wait);
      }
    }
  }
}
