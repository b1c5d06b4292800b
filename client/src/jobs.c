/* SPDX-License-Identifier: Apache-2.0 */
/* Jobs: descriptors into the submission ring, completions out of the other. */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

#define SPIN_NS 20000ull /* a job often completes within this: skip the syscalls */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int mok_submit_desc_locked(mok_client *c, mok_job_desc *desc, uint64_t *ret_ticket) {
  if (c->broken) return mok_set_error(MOK_ECLOSED, "the connection to mokd is closed");
  if (c->outstanding >= MOK_RING_ENTRIES)
    return mok_set_error(MOK_EBUSY, "%u jobs submitted and not waited for: wait for some first",
                         c->outstanding);
  uint64_t ticket = c->next_ticket++;
  job_result *jr = &c->results[ticket % MOK_RING_ENTRIES];
  *jr = (job_result){.ticket = ticket};
  desc->user_data = ticket;
  mok_shm_header *h = c->shm;
  memcpy(&mok_shm_sq_entries(h)[c->sq_tail & (MOK_RING_ENTRIES - 1)], desc, sizeof *desc);
  c->sq_tail++;
  atomic_store_explicit(&h->sq_tail.value, c->sq_tail, memory_order_release);
  c->outstanding++;
  /* pairs with the daemon's fence between setting NEED_WAKEUP and re-reading the tail */
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&h->sq_flags.value, memory_order_relaxed) & MOK_RING_NEED_WAKEUP) {
    uint64_t one = 1;
    ssize_t w = write(c->doorbell_in, &one, sizeof one);
    (void)w; /* EAGAIN: the counter is already set, the daemon wakes anyway */
  }
  *ret_ticket = ticket;
  return MOK_OK;
}

int mok_submit_desc(mok_client *c, mok_job_desc *desc, uint64_t *ret_ticket) {
  pthread_mutex_lock(&c->lock);
  int r = mok_submit_desc_locked(c, desc, ret_ticket);
  pthread_mutex_unlock(&c->lock);
  return r;
}

/* Fill desc from the tensors (the client lock held): host regions first,
 * then CUDA device memory (registered on first use). */
int mok_build_desc_locked(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                          const mok_tensor tensors[MOK_SLOT_COUNT_], mok_job_desc *desc) {
  mok_client *c = l->client;
  memset(desc, 0, sizeof *desc);
  desc->version = MOK_JOB_VERSION;
  desc->op = (uint16_t)op;
  desc->flags = (uint16_t)flags;
  desc->layer = l->id;
  desc->tokens = tokens;
  for (uint32_t s = 0; s < MOK_SLOT_COUNT_; s++) {
    const mok_tensor *t = &tensors[s];
    if (!t->data) continue;
    uint64_t esz = mok_dtype_size(t->dtype), elems = 1;
    if (t->ndim < 1 || t->ndim > MOK_MAX_DIMS || esz == 0)
      return mok_set_error(MOK_ESHAPE, "tensor %u: bad dtype or rank", s);
    for (uint32_t i = 0; i < t->ndim; i++) {
      if (t->shape[i] > UINT32_MAX || (t->shape[i] && elems > UINT64_MAX / t->shape[i]))
        return mok_set_error(MOK_ESHAPE, "tensor %u: dimension %u too large", s, i);
      elems *= t->shape[i];
    }
    uint64_t bytes = elems * esz;
    uint32_t region;
    uint64_t offset;
    const host_region *hr = mok_find_region(c, t->data, bytes);
    if (hr) {
      region = hr->id;
      offset = (uint64_t)((const char *)t->data - (const char *)hr->ptr);
    } else {
      int st = mok_cuda_resolve_locked(c, t->data, bytes, &region, &offset);
      if (st == MOK_ENOENT) {
        const char *why = mok_cuda_load_error();
        return mok_set_error(MOK_ENOENT,
                             "tensor %u (%llu bytes at %p) is not inside memory registered with "
                             "mokd (use mok_host_alloc, or CUDA device memory)%s%s",
                             s, (unsigned long long)bytes, t->data, *why ? "; " : "", why);
      }
      if (st != MOK_OK) return st;
    }
    mok_tensor_ref *ref = &desc->tensors[desc->n_tensors++];
    ref->region = region;
    ref->slot = (uint16_t)s;
    ref->dtype = (uint8_t)t->dtype;
    ref->ndim = (uint8_t)t->ndim;
    ref->offset = offset;
    ref->bytes = bytes;
    for (uint32_t i = 0; i < t->ndim; i++) ref->shape[i] = (uint32_t)t->shape[i];
  }
  return MOK_OK;
}

int mok_submit(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
               const mok_tensor tensors[MOK_SLOT_COUNT_], uint64_t *ret_ticket) {
  mok_client *c = l->client;
  mok_job_desc desc;
  pthread_mutex_lock(&c->lock);
  int r = mok_build_desc_locked(l, op, flags, tokens, tensors, &desc);
  if (r == MOK_OK) r = mok_submit_desc_locked(c, &desc, ret_ticket);
  pthread_mutex_unlock(&c->lock);
  return r;
}

static bool drain_completions(mok_client *c);
static void park_locked(mok_client *c, int timeout_ms, bool release);

/* The stream-ordered part of a submission: room in the ring, the fence the
 * job waits for, the job, the wait for its done value (c->lock held). */
static int submit_on_stream_locked(mok_client *c, mok_job_desc *desc, void *stream,
                                   uint64_t *ret_ticket) {
  int r = MOK_OK;
  /* room in the ring: wait for running jobs (bounded: a minute) */
  uint64_t give_up = now_ns() + 60000000000ull;
  while (c->outstanding >= MOK_RING_ENTRIES) {
    if (!drain_completions(c) || c->broken) {
      r = mok_set_error(MOK_ECLOSED, "the connection to mokd is closed");
      break;
    }
    if (c->outstanding < MOK_RING_ENTRIES) break;
    if (now_ns() > give_up) {
      r = mok_set_error(MOK_EBUSY, "%u jobs in flight for a minute: wait for some first",
                        c->outstanding);
      break;
    }
    park_locked(c, 10, false); /* the descriptor built names regions: keep them */
  }
  uint64_t ticket = c->next_ticket, signal = 0;
  if (r == MOK_OK) r = mok_cuda_fence_prepare_locked(c, stream, &signal);
  if (r == MOK_OK) {
    desc->fence_wait = ticket;
    desc->fence_signal = signal;
    uint64_t got = 0;
    /* the job first, then the stream's fence write: mokd takes the job and
     * enqueues its wait while this thread is in the driver, so a GPU that
     * reaches the fence early waits less for mokd's kernels */
    r = mok_submit_desc_locked(c, desc, &got);
    if (r == MOK_OK) {
      r = mok_cuda_fence_release_locked(c, stream, got);
      /* the wait for its done value in any case: what follows on the
       * stream stays after the job */
      const int after = mok_cuda_fence_after_locked(c, stream, signal);
      if (r == MOK_OK) r = after;
      if (ret_ticket && r == MOK_OK) *ret_ticket = got;
      else c->results[got % MOK_RING_ENTRIES].detached = true;
    }
  }
  return r;
}

int mok_submit_on_stream(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                         const mok_tensor tensors[MOK_SLOT_COUNT_], void *stream,
                         uint64_t *ret_ticket) {
  mok_client *c = l->client;
  mok_job_desc desc;
  pthread_mutex_lock(&c->lock);
  int r = mok_build_desc_locked(l, op, flags, tokens, tensors, &desc);
  if (r == MOK_OK) r = submit_on_stream_locked(c, &desc, stream, ret_ticket);
  pthread_mutex_unlock(&c->lock);
  return r;
}

int mok_submit_nop_on_stream(mok_client *c, void *stream, uint64_t *ret_ticket) {
  mok_job_desc desc;
  memset(&desc, 0, sizeof desc);
  desc.version = MOK_JOB_VERSION;
  desc.op = MOK_OP_NOP;
  pthread_mutex_lock(&c->lock);
  int r = submit_on_stream_locked(c, &desc, stream, ret_ticket);
  pthread_mutex_unlock(&c->lock);
  return r;
}

int mok_async_error(mok_client *c) {
  pthread_mutex_lock(&c->lock);
  if (!c->broken) (void)drain_completions(c);
  int st = c->async_status;
  if (st != MOK_OK) mok_set_error(st, "%s", c->async_message);
  c->async_status = MOK_OK;
  pthread_mutex_unlock(&c->lock);
  return st;
}

int mok_sync(mok_client *c, int timeout_ms) {
  uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : now_ns() + (uint64_t)timeout_ms * 1000000ull;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    if (!drain_completions(c)) c->broken = true;
    bool busy = false;
    for (uint32_t i = 0; i < MOK_RING_ENTRIES; i++)
      if (c->results[i].ticket && !c->results[i].done) busy = true;
    if (!busy) break;
    if (c->broken) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ECLOSED, "mokd went away with jobs in flight");
    }
    if (c->closing) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ECLOSED, "the client was closed with jobs in flight");
    }
    uint64_t now = now_ns();
    if (now >= deadline) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ETIMEOUT, "jobs still running after %d ms", timeout_ms);
    }
    park_locked(c, 10, true);
  }
  pthread_mutex_unlock(&c->lock);
  return mok_async_error(c);
}

int mok_submit_nop(mok_client *c, uint64_t *ret_ticket) {
  mok_job_desc desc;
  memset(&desc, 0, sizeof desc);
  desc.version = MOK_JOB_VERSION;
  desc.op = MOK_OP_NOP;
  return mok_submit_desc(c, &desc, ret_ticket);
}

/* Move every posted completion into its result slot. Returns false if the
 * daemon broke the ring protocol. */
static bool drain_completions(mok_client *c) {
  mok_shm_header *h = c->shm;
  uint32_t tail = atomic_load_explicit(&h->cq_tail.value, memory_order_acquire);
  if (tail - c->cq_head > MOK_RING_ENTRIES) return false;
  while (c->cq_head != tail) {
    mok_completion comp;
    uint32_t index = c->cq_head;
    memcpy(&comp, &mok_shm_cq_entries(h)[index & (MOK_RING_ENTRIES - 1)], sizeof comp);
    c->cq_head++;
    job_result *jr = &c->results[comp.user_data % MOK_RING_ENTRIES];
    if (jr->ticket == comp.user_data && !jr->done) {
      jr->done = true;
      jr->status = comp.status;
      jr->message[0] = '\0';
      if (comp.status != MOK_OK) {
        /* the whole message, from the area beside the ring (mok_wire.h);
         * read before cq_head moves past it, which frees it for the daemon */
        memcpy(jr->message, mok_shm_msg_entry(h, index), sizeof jr->message);
        jr->message[sizeof jr->message - 1] = '\0';
      }
      if (jr->detached) { /* nobody waits for it: reap it now */
        if (comp.status != MOK_OK && c->async_status == MOK_OK) {
          c->async_status = comp.status;
          memcpy(c->async_message, jr->message, sizeof c->async_message);
        }
        *jr = (job_result){0};
        c->outstanding--;
      }
    }
  }
  atomic_store_explicit(&h->cq_head.value, c->cq_head, memory_order_release);
  return true;
}

/* Is mokd gone? Asked with the client lock held, so no request of ours is
 * in flight: mokd never speaks unasked, so a readable or hung-up socket
 * means it went away. */
static bool daemon_gone_locked(const mok_client *c) {
  struct pollfd p = {.fd = c->sock, .events = POLLIN};
  return poll(&p, 1, 0) > 0 && (p.revents & (POLLHUP | POLLERR | POLLIN));
}

/* Sleep until the daemon rings, the socket shows it went away, mok_close
 * starts or timeout_ms pass. Called and returns with the client lock held;
 * with release, the lock is dropped for the sleep so that other threads'
 * calls go on meanwhile. NEED_WAKEUP stays set while any thread sleeps. */
static void park_locked(mok_client *c, int timeout_ms, bool release) {
  mok_shm_header *h = c->shm;
  if (c->parked++ == 0)
    atomic_store_explicit(&h->cq_flags.value, MOK_RING_NEED_WAKEUP, memory_order_relaxed);
  /* pairs with the daemon's fence between posting a completion and reading the flag */
  atomic_thread_fence(memory_order_seq_cst);
  uint32_t tail = atomic_load_explicit(&h->cq_tail.value, memory_order_acquire);
  if (tail == c->cq_head && !c->closing) {
    struct pollfd p[2] = {{.fd = c->doorbell_out, .events = POLLIN},
                          {.fd = c->sock, .events = POLLIN}};
    if (release) pthread_mutex_unlock(&c->lock);
    int r = poll(p, 2, timeout_ms);
    if (release) pthread_mutex_lock(&c->lock);
    /* unlocked, the socket may have been readable with another thread's
     * reply: ask again now that no request can be in flight */
    if (r > 0 && (p[1].revents & (POLLHUP | POLLERR | POLLIN)) && (!release || daemon_gone_locked(c)))
      c->broken = true;
    if (r > 0 && (p[0].revents & POLLIN)) {
      uint64_t v;
      ssize_t n = read(c->doorbell_out, &v, sizeof v);
      (void)n; /* EAGAIN: another sleeper took the ring's count */
    }
  }
  if (--c->parked == 0) {
    atomic_store_explicit(&h->cq_flags.value, 0, memory_order_relaxed);
    if (c->closing) pthread_cond_broadcast(&c->unparked);
  }
}

void mok_jobs_wake_sleepers_locked(mok_client *c) {
  c->closing = true;
  if (!c->parked) return;
  uint64_t one = 1; /* the doorbell is an eventfd: our write wakes our own pollers */
  ssize_t n = write(c->doorbell_out, &one, sizeof one);
  (void)n;
  while (c->parked) pthread_cond_wait(&c->unparked, &c->lock);
}

int mok_job_pending(mok_client *c, uint64_t ticket) {
  pthread_mutex_lock(&c->lock);
  const job_result *jr = &c->results[ticket % MOK_RING_ENTRIES];
  int pending = ticket != 0 && jr->ticket == ticket && !jr->detached;
  pthread_mutex_unlock(&c->lock);
  return pending;
}

int mok_wait(mok_client *c, uint64_t ticket, int timeout_ms) {
  pthread_mutex_lock(&c->lock);
  job_result *jr = &c->results[ticket % MOK_RING_ENTRIES];
  if (ticket == 0 || jr->ticket != ticket || jr->detached) {
    pthread_mutex_unlock(&c->lock);
    return mok_set_error(MOK_ENOENT, "ticket %llu is not pending", (unsigned long long)ticket);
  }
  uint64_t start = now_ns();
  uint64_t deadline = timeout_ms < 0 ? UINT64_MAX : start + (uint64_t)timeout_ms * 1000000ull;
  for (;;) {
    if (!drain_completions(c)) {
      c->broken = true;
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_EPROTO, "the completion ring is corrupt");
    }
    /* while this thread slept unlocked, another may have waited for it */
    if (jr->ticket != ticket) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ENOENT, "ticket %llu was waited for by another thread",
                           (unsigned long long)ticket);
    }
    if (jr->done) break;
    /* the daemon may have died after posting: check completions before giving up */
    if (c->broken) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ECLOSED, "mokd went away before job %llu completed",
                           (unsigned long long)ticket);
    }
    if (c->closing) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ECLOSED, "the client was closed before job %llu completed",
                           (unsigned long long)ticket);
    }
    uint64_t now = now_ns();
    if (now >= deadline) {
      pthread_mutex_unlock(&c->lock);
      return mok_set_error(MOK_ETIMEOUT, "job %llu still running after %d ms",
                           (unsigned long long)ticket, timeout_ms);
    }
    if (now - start < SPIN_NS) continue;
    uint64_t left_ms = (deadline - now) / 1000000ull;
    park_locked(c, deadline == UINT64_MAX ? 1000 : (int)(left_ms < 1000 ? left_ms + 1 : 1000),
                true);
  }
  int status = jr->status;
  if (status != MOK_OK) mok_set_error(status, "%s", jr->message);
  jr->ticket = 0;
  jr->done = false;
  c->outstanding--;
  pthread_mutex_unlock(&c->lock);
  return status;
}

/* ---- typed whole-layer jobs ---- */



static void put(mok_tensor *t, const mok_layer *l, uint32_t tokens, uint32_t slot,
                const void *data) {
  if (data) t[slot] = mok_tensor_for(l, tokens, slot, data);
}

/* The inputs forward and backward share: tokens, routing and weights. */
static void put_layer_inputs(mok_tensor *t, const mok_layer *l, uint32_t tokens, const void *x,
                             const int32_t *ids, const float *rw, const void *w_gate,
                             const void *w_up, const void *w_down, const void *s_gate,
                             const void *s_up, const void *s_down) {
  memset(t, 0, sizeof(mok_tensor) * MOK_SLOT_COUNT_);
  put(t, l, tokens, MOK_SLOT_X, x);
  put(t, l, tokens, MOK_SLOT_TOPK_IDS, ids);
  put(t, l, tokens, MOK_SLOT_ROUTER_W, rw);
  put(t, l, tokens, MOK_SLOT_W_GATE, w_gate);
  put(t, l, tokens, MOK_SLOT_W_UP, w_up);
  put(t, l, tokens, MOK_SLOT_W_DOWN, w_down);
  put(t, l, tokens, MOK_SLOT_S_GATE, s_gate);
  put(t, l, tokens, MOK_SLOT_S_UP, s_up);
  put(t, l, tokens, MOK_SLOT_S_DOWN, s_down);
}

int mok_forward(mok_layer *l, uint32_t tokens, const mok_forward_args *a, uint64_t *ret_ticket) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_forward_tensors(l, tokens, a, t);
  return mok_submit(l, MOK_OP_FORWARD, 0, tokens, t, ret_ticket);
}

void mok_forward_tensors(mok_layer *l, uint32_t tokens, const mok_forward_args *a,
                            mok_tensor *t) {
  put_layer_inputs(t, l, tokens, a->x, a->topk_ids, a->router_weights, a->w_gate, a->w_up,
                   a->w_down, a->s_gate, a->s_up, a->s_down);
  put(t, l, tokens, MOK_SLOT_OUT, a->out);
  put(t, l, tokens, MOK_SLOT_CTX, a->ctx);
}


int mok_forward_on_stream(mok_layer *l, uint32_t tokens, const mok_forward_args *a, void *stream,
                          uint64_t *ret_ticket) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_forward_tensors(l, tokens, a, t);
  return mok_submit_on_stream(l, MOK_OP_FORWARD, 0, tokens, t, stream, ret_ticket);
}

int mok_backward_on_stream(mok_layer *l, uint32_t tokens, uint32_t flags,
                           const mok_backward_args *a, void *stream, uint64_t *ret_ticket) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_backward_tensors(l, tokens, a, t);
  return mok_submit_on_stream(l, MOK_OP_BACKWARD, flags, tokens, t, stream, ret_ticket);
}

int mok_backward(mok_layer *l, uint32_t tokens, uint32_t flags, const mok_backward_args *a,
                 uint64_t *ret_ticket) {
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_backward_tensors(l, tokens, a, t);
  return mok_submit(l, MOK_OP_BACKWARD, flags, tokens, t, ret_ticket);
}

void mok_backward_tensors(mok_layer *l, uint32_t tokens, const mok_backward_args *a,
                             mok_tensor *t) {
  put_layer_inputs(t, l, tokens, a->x, a->topk_ids, a->router_weights, a->w_gate, a->w_up,
                   a->w_down, a->s_gate, a->s_up, a->s_down);
  put(t, l, tokens, MOK_SLOT_D_OUT, a->d_out);
  put(t, l, tokens, MOK_SLOT_CTX, a->ctx);
  put(t, l, tokens, MOK_SLOT_D_X, a->d_x);
  put(t, l, tokens, MOK_SLOT_D_RW, a->d_router_weights);
  put(t, l, tokens, MOK_SLOT_D_W_GATE, a->d_w_gate);
  put(t, l, tokens, MOK_SLOT_D_W_UP, a->d_w_up);
  put(t, l, tokens, MOK_SLOT_D_W_DOWN, a->d_w_down);
  put(t, l, tokens, MOK_SLOT_D_S_GATE, a->d_s_gate);
  put(t, l, tokens, MOK_SLOT_D_S_UP, a->d_s_up);
  put(t, l, tokens, MOK_SLOT_D_S_DOWN, a->d_s_down);
}
