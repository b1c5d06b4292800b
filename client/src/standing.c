/* SPDX-License-Identifier: Apache-2.0 */
/* Standing jobs (mok.h; proto/mok_wire.h mok_standing_words; docs/cuda.md
 * "Capture and replay").
 *
 * Creation and destruction are descriptors through the ring, waited for.
 * A run is a trigger word set to 1, by the host here or by a CUDA stream
 * (cuda.c), answered by mokd with the flag word. While a client holds
 * standing jobs a watcher thread looks at its socket: when mokd goes away
 * it marks every standing job ECLOSED and answers their triggers itself,
 * so a stream (or a graph replay) waiting on a flag is released instead
 * of hanging until the process dies.
 */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define CREATE_WAIT_MS 60000

struct mok_standing {
  mok_client *c;
  uint32_t slot;
  uint32_t op;
};

typedef struct mok_standing_state {
  pthread_mutex_t lock; /* items and gone (the watcher and the API) */
  mok_standing *items[MOK_STANDING_MAX];
  bool gone;
  bool started;
  pthread_t thread;
  int stop_efd;
} mok_standing_state;

static mok_standing_words *words(const mok_standing *s) {
  return mok_shm_standing(s->c->shm, s->slot);
}

/* The words are shared with mokd (another process) and, in this process,
 * with the watcher thread: atomic accesses, sequentially consistent. */
static void store_u64(volatile uint64_t *w, uint64_t v) { __atomic_store_n(w, v, __ATOMIC_SEQ_CST); }
static uint64_t load_u64(const volatile uint64_t *w) { return __atomic_load_n(w, __ATOMIC_SEQ_CST); }

/* mokd is gone: every standing job fails with ECLOSED and every trigger is
 * answered here (the daemon that would have run it cannot). */
static void answer_for_gone_daemon(mok_standing_state *st, mok_client *c) {
  for (uint32_t i = 0; i < MOK_STANDING_MAX; i++) {
    if (!st->items[i]) continue;
    mok_standing_words *w = mok_shm_standing(c->shm, i);
    if (__atomic_load_n(&w->error, __ATOMIC_SEQ_CST) == 0) {
      static const char m[] = "mokd went away; the job did not run (connect again and "
                              "create the standing job again)";
      memcpy(w->message, m, sizeof m);
      __atomic_store_n(&w->error, MOK_ECLOSED, __ATOMIC_SEQ_CST);
    }
    if (load_u64(&w->trigger) != 0) {
      store_u64(&w->trigger, 0);
      store_u64(&w->flag, 1);
    }
  }
}

static void *watcher_main(void *arg) {
  mok_client *c = arg;
  mok_standing_state *st = c->standing;
  for (;;) {
    pthread_mutex_lock(&st->lock);
    bool gone = st->gone;
    if (gone) answer_for_gone_daemon(st, c);
    pthread_mutex_unlock(&st->lock);
    /* mokd never speaks unasked: a hang-up on the socket means it is gone */
    struct pollfd p[2] = {{.fd = c->sock, .events = gone ? 0 : POLLRDHUP},
                          {.fd = st->stop_efd, .events = POLLIN}};
    int r = poll(p, 2, gone ? 1 : 100);
    if (r > 0 && (p[1].revents & POLLIN)) break;
    if (r > 0 && !gone && (p[0].revents & (POLLHUP | POLLERR | POLLRDHUP))) {
      pthread_mutex_lock(&st->lock);
      st->gone = true;
      pthread_mutex_unlock(&st->lock);
    }
  }
  return NULL;
}

/* The client's state, with the watcher running (the client lock held). */
static mok_standing_state *state_locked(mok_client *c) {
  if (c->standing) return c->standing;
  mok_standing_state *st = calloc(1, sizeof *st);
  if (!st) return NULL;
  pthread_mutex_init(&st->lock, NULL);
  st->stop_efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  c->standing = st;
  if (st->stop_efd >= 0 && pthread_create(&st->thread, NULL, watcher_main, c) == 0)
    st->started = true;
  return st;
}

static int submit_and_wait(mok_client *c, mok_job_desc *desc) {
  uint64_t ticket = 0;
  int r = mok_submit_desc_locked(c, desc, &ticket);
  pthread_mutex_unlock(&c->lock);
  if (r == MOK_OK) r = mok_wait(c, ticket, CREATE_WAIT_MS);
  if (r == MOK_ETIMEOUT && mok_job_pending(c, ticket))
    r = mok_set_error(MOK_ETIMEOUT, "mokd did not answer a standing-job request in %d ms",
                      CREATE_WAIT_MS);
  return r;
}

int mok_standing_create(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                        const mok_tensor tensors[MOK_SLOT_COUNT_], mok_standing **ret) {
  mok_client *c = l->client;
  *ret = NULL;
  if (op != MOK_OP_FORWARD && op != MOK_OP_BACKWARD)
    return mok_set_error(MOK_EINVAL, "a standing job is a forward or a backward");
  mok_standing *s = calloc(1, sizeof *s);
  if (!s) return mok_set_error(MOK_ENOMEM, "out of memory");
  pthread_mutex_lock(&c->lock);
  mok_standing_state *st = state_locked(c);
  if (!st) {
    pthread_mutex_unlock(&c->lock);
    free(s);
    return mok_set_error(MOK_ENOMEM, "out of memory");
  }
  pthread_mutex_lock(&st->lock);
  uint32_t slot = MOK_STANDING_MAX;
  for (uint32_t i = 0; i < MOK_STANDING_MAX && slot == MOK_STANDING_MAX; i++)
    if (!st->items[i]) slot = i;
  if (slot < MOK_STANDING_MAX) st->items[slot] = s; /* reserved; filled below */
  pthread_mutex_unlock(&st->lock);
  if (slot == MOK_STANDING_MAX) {
    pthread_mutex_unlock(&c->lock);
    free(s);
    return mok_set_error(MOK_ELIMIT, "the session holds %u standing jobs already (destroy some)",
                         MOK_STANDING_MAX);
  }
  s->c = c;
  s->slot = slot;
  s->op = op;
  mok_job_desc desc;
  int r = mok_build_desc_locked(l, op, flags, tokens, tensors, &desc);
  if (r != MOK_OK) {
    pthread_mutex_unlock(&c->lock);
  } else {
    desc.flags = (uint16_t)(desc.flags | MOK_JOB_STANDING);
    desc.reserved[0] = slot;
    r = submit_and_wait(c, &desc); /* unlocks */
  }
  if (r != MOK_OK) {
    pthread_mutex_lock(&st->lock);
    st->items[slot] = NULL;
    pthread_mutex_unlock(&st->lock);
    free(s);
    return r;
  }
  *ret = s;
  return MOK_OK;
}

int mok_standing_forward(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                         mok_standing **ret) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_forward_tensors(l, tokens, a, t);
  return mok_standing_create(l, MOK_OP_FORWARD, 0, tokens, t, ret);
}

int mok_standing_forward_quantized(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                                   void *packed, mok_standing **ret) {
  *ret = NULL;
  if (!packed || mok_layer_packed_weights_bytes(l) == 0)
    return mok_set_error(MOK_EINVAL, "a quantising forward needs an fp8 layer and its packed "
                         "weights tensor (mok_layer_packed_weights_bytes)");
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_forward_tensors(l, tokens, a, t);
  const uint32_t flags = MOK_JOB_QUANTIZE_WEIGHTS;
  for (uint32_t s = MOK_SLOT_W_GATE; s <= MOK_SLOT_S_DOWN; s++) /* the bf16 masters */
    if (t[s].data) t[s] = mok_tensor_for_job(l, MOK_OP_FORWARD, flags, tokens, s, t[s].data);
  t[MOK_SLOT_PACKED_WEIGHT] =
      mok_tensor_for_job(l, MOK_OP_FORWARD, flags, tokens, MOK_SLOT_PACKED_WEIGHT, packed);
  return mok_standing_create(l, MOK_OP_FORWARD, flags, tokens, t, ret);
}

int mok_standing_backward(mok_layer *l, uint32_t tokens, uint32_t flags,
                          const mok_backward_args *a, mok_standing **ret) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_backward_tensors(l, tokens, a, t);
  return mok_standing_create(l, MOK_OP_BACKWARD, flags, tokens, t, ret);
}

int mok_standing_enqueue(mok_standing *s, void *stream) {
  mok_client *c = s->c;
  pthread_mutex_lock(&c->lock);
  int r = mok_cuda_standing_ops_locked(c, stream, s->slot);
  pthread_mutex_unlock(&c->lock);
  return r;
}

int mok_standing_trigger(mok_standing *s) {
  mok_client *c = s->c;
  mok_standing_words *w = words(s);
  if (load_u64(&w->trigger) != 0)
    return mok_set_error(MOK_EBUSY, "the standing job's previous trigger was not taken yet");
  store_u64(&w->trigger, 1);
  /* pairs with the daemon's fence between setting NEED_WAKEUP and looking again */
  if (atomic_load_explicit(&c->shm->sq_flags.value, memory_order_relaxed) &
      MOK_RING_NEED_WAKEUP) {
    uint64_t one = 1;
    ssize_t n = write(c->doorbell_in, &one, sizeof one);
    (void)n; /* EAGAIN: the counter is set, the daemon wakes anyway */
  }
  return MOK_OK;
}

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int mok_standing_wait(mok_standing *s, int timeout_ms) {
  mok_standing_words *w = words(s);
  uint64_t t0 = mono_ns();
  uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : t0 + (uint64_t)timeout_ms * 1000000ull;
  unsigned pause_us = 2;
  while (load_u64(&w->flag) != 1) {
    uint64_t now = mono_ns();
    if (now >= deadline)
      return mok_set_error(MOK_ETIMEOUT, "the standing job's run did not finish in %d ms",
                           timeout_ms);
    struct timespec ts = {0, (long)pause_us * 1000};
    nanosleep(&ts, NULL);
    if (pause_us < 1000) pause_us *= 2;
  }
  store_u64(&w->flag, 0);
  return mok_standing_status(s);
}

int mok_standing_status(mok_standing *s) {
  mok_standing_words *w = words(s);
  int st = __atomic_load_n(&w->error, __ATOMIC_SEQ_CST);
  if (st == MOK_OK) return MOK_OK;
  char m[MOK_STANDING_MSG];
  memcpy(m, w->message, sizeof m);
  m[sizeof m - 1] = '\0';
  if (st < 0 || st >= MOK_STATUS_COUNT_) st = MOK_EPROTO;
  return mok_set_error(st, "standing %s job: %s", s->op == MOK_OP_FORWARD ? "forward" : "backward",
                       m);
}

uint64_t mok_standing_done(const mok_standing *s) { return load_u64(&words(s)->done); }

void mok_standing_destroy(mok_standing *s) {
  if (!s) return;
  mok_client *c = s->c;
  pthread_mutex_lock(&c->lock);
  bool gone = c->broken;
  if (c->standing) {
    pthread_mutex_lock(&c->standing->lock);
    gone |= c->standing->gone;
    pthread_mutex_unlock(&c->standing->lock);
  }
  if (!gone) {
    mok_job_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.version = MOK_JOB_VERSION;
    desc.op = MOK_OP_NOP;
    desc.flags = MOK_JOB_STANDING;
    desc.reserved[0] = s->slot;
    (void)submit_and_wait(c, &desc); /* unlocks */
    pthread_mutex_lock(&c->lock);
  }
  if (c->standing) {
    pthread_mutex_lock(&c->standing->lock);
    c->standing->items[s->slot] = NULL;
    pthread_mutex_unlock(&c->standing->lock);
  }
  pthread_mutex_unlock(&c->lock);
  free(s);
}

void mok_standing_client_free(mok_client *c) {
  mok_standing_state *st = c->standing;
  if (!st) return;
  for (uint32_t i = 0; i < MOK_STANDING_MAX; i++)
    if (st->items[i]) mok_standing_destroy(st->items[i]);
  if (st->started) {
    uint64_t one = 1;
    ssize_t n = write(st->stop_efd, &one, sizeof one);
    (void)n;
    pthread_join(st->thread, NULL);
  }
  if (st->stop_efd >= 0) close(st->stop_efd);
  pthread_mutex_destroy(&st->lock);
  free(st);
  c->standing = NULL;
}
