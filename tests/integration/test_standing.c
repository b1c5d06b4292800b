/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: standing jobs (mok.h mok_standing_*; docs/cuda.md "Capture
 * and replay") on a real mokd, triggered from the host (the cpu engine).
 *
 *  - runs: each trigger runs the job once on the tensors' current values,
 *    bitwise equal to the same job submitted through the ring; done counts
 *    the runs; forward and backward standing jobs of one step chain;
 *  - validation: bad slots, ops, shapes, a slot in use, destroying nothing;
 *  - hostile: bogus trigger values cancel the job (and answer the client),
 *    a thread scribbling over every standing word of one slot while another
 *    slot's runs must stay right and mokd alive;
 *  - failures end in an error, never a hang: a trigger not taken within the
 *    fence timeout, a region unregistered, a layer destroyed, mokd killed;
 *  - fp8: the quantising forward (MOK_JOB_QUANTIZE_WEIGHTS) as a standing job
 *    re-quantises the masters at every run, bitwise the ring's quantize_weight
 *    chain (packed forms, out, ctx), after in-place changes too; a standing
 *    backward on its packed forms; the checks of its packed tensor.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/wait.h>

#include "harness/daemon.h"
#include "job_bufs.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

/* ids uniform over the experts */
static void uniform_ids(int32_t *ids, uint64_t n, const mok_layer *l, unsigned *s) {
  for (uint64_t i = 0; i < n; i++) ids[i] = (int32_t)(job_rng(s) % l->cfg.experts);
}

static void alloc_bufs(mok_client *c, mok_layer *l, uint32_t op, uint32_t T, job_bufs *b,
                       unsigned seed) {
  job_bufs_alloc(c, l, op, T, b, seed, uniform_ids);
}

static void tensors_of(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b, mok_tensor *t) {
  job_bufs_tensors(l, op, T, b, t);
}

static mok_layer *small_layer(mok_client *c, uint32_t T) {
  mok_layer_desc d = {.hidden = 32, .intermediate = 32, .experts = 4, .topk = 2,
                      .shared_intermediate = 16, .max_tokens = T, .dtype = test_dtype()};
  mok_layer *l = NULL;
  CHECK_EQ_INT(mok_layer_create(c, &d, &l), MOK_OK);
  return l;
}

static void run_ring(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b) {
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(l, op, T, b, t);
  uint64_t tk;
  CHECK_EQ_INT(mok_submit(l, op, 0, T, t, &tk), MOK_OK);
  CHECK_EQ_INT(mok_wait(l->client, tk, 10000), MOK_OK);
}

static void test_runs_equal_ring_jobs(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  const uint32_t T = 40;
  mok_layer *l = small_layer(c, T);
  job_bufs f = {0}, ref = {0};
  alloc_bufs(c, l, MOK_OP_FORWARD, T, &f, 7);
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(l, MOK_OP_FORWARD, T, &f, t);
  mok_standing *sf;
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, T, t, &sf), MOK_OK);
  CHECK(mok_standing_done(sf) == 0);
  /* the ring job's outputs go elsewhere: same inputs, own out and ctx */
  memcpy(ref.p, f.p, sizeof ref.p);
  ref.p[MOK_SLOT_OUT] = mok_host_alloc(c, f.bytes[MOK_SLOT_OUT]);
  ref.p[MOK_SLOT_CTX] = mok_host_alloc(c, f.bytes[MOK_SLOT_CTX]);
  unsigned s = 99;
  for (int i = 0; i < 5; i++) {
    uint8_t *x = f.p[MOK_SLOT_X];
    x[job_rng(&s) % f.bytes[MOK_SLOT_X]] ^= 0x10; /* values are read at each run */
    CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
    CHECK_EQ_INT(mok_standing_wait(sf, 10000), MOK_OK);
    run_ring(l, MOK_OP_FORWARD, T, &ref);
    CHECK(memcmp(f.p[MOK_SLOT_OUT], ref.p[MOK_SLOT_OUT], f.bytes[MOK_SLOT_OUT]) == 0);
    CHECK(memcmp(f.p[MOK_SLOT_CTX], ref.p[MOK_SLOT_CTX], f.bytes[MOK_SLOT_CTX]) == 0);
    CHECK(mok_standing_done(sf) == (uint64_t)i + 1);
  }
  /* a backward standing job from the forward's ctx: one step, chained */
  job_bufs bw = {0};
  memcpy(bw.p, f.p, sizeof bw.p);
  memcpy(bw.bytes, f.bytes, sizeof bw.bytes);
  bw.p[MOK_SLOT_OUT] = NULL;
  alloc_bufs(c, l, MOK_OP_BACKWARD, T, &bw, 11);
  tensors_of(l, MOK_OP_BACKWARD, T, &bw, t);
  t[MOK_SLOT_TOPK_IDS].data = NULL; /* the ctx's schedule replaces them */
  mok_standing *sb;
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_BACKWARD, 0, T, t, &sb), MOK_OK);
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sf, 10000), MOK_OK);
  CHECK_EQ_INT(mok_standing_trigger(sb), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sb, 10000), MOK_OK);
  job_bufs rb = {0};
  memcpy(rb.p, bw.p, sizeof rb.p);
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (bw.p[slot] && mok_job_slot_is_output(MOK_OP_BACKWARD, 0, slot)) {
      rb.p[slot] = mok_host_alloc(c, bw.bytes[slot]);
      rb.bytes[slot] = bw.bytes[slot];
    }
  rb.p[MOK_SLOT_TOPK_IDS] = NULL;
  run_ring(l, MOK_OP_BACKWARD, T, &rb);
  int outs = 0;
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (rb.bytes[slot] && rb.p[slot] != bw.p[slot]) {
      CHECK_MSG(memcmp(rb.p[slot], bw.p[slot], bw.bytes[slot]) == 0, "slot %s differs",
                mok_slot_name(slot));
      outs++;
    }
  CHECK(outs >= 5);
  /* a busy trigger is refused; destroying frees the slot */
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sf, 10000), MOK_OK);
  mok_standing_destroy(sb);
  mok_standing_destroy(sf);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* A raw standing descriptor (slot, op) built from valid tensors. */
static int raw_standing(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b, uint64_t slot,
                        uint16_t extra_flags, char *msg, size_t msglen) {
  mok_client *c = l->client;
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(l, op == MOK_OP_DISPATCH ? MOK_OP_FORWARD : op, T, b, t);
  mok_job_desc desc;
  pthread_mutex_lock(&c->lock);
  int r = mok_build_desc_locked(l, op, 0, T, t, &desc);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) return r;
  desc.flags = (uint16_t)(MOK_JOB_STANDING | extra_flags);
  desc.reserved[0] = slot;
  uint64_t tk;
  CHECK_EQ_INT(mok_submit_desc(c, &desc, &tk), MOK_OK);
  r = mok_wait(c, tk, 10000);
  snprintf(msg, msglen, "%s", mok_last_error());
  return r;
}

static void test_validation(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  const uint32_t T = 16;
  mok_layer *l = small_layer(c, T);
  job_bufs f = {0};
  alloc_bufs(c, l, MOK_OP_FORWARD, T, &f, 3);
  char m[256];
  CHECK_EQ_INT(raw_standing(l, MOK_OP_FORWARD, T, &f, MOK_STANDING_MAX, 0, m, sizeof m),
               MOK_EINVAL);
  CHECK_STR_CONTAINS(m, "standing slot 128");
  CHECK_EQ_INT(raw_standing(l, MOK_OP_FORWARD, T, &f, 1ull << 40, 0, m, sizeof m), MOK_EINVAL);
  CHECK_EQ_INT(raw_standing(l, MOK_OP_FORWARD, T, &f, 5, 0, m, sizeof m), MOK_OK);
  CHECK_EQ_INT(raw_standing(l, MOK_OP_FORWARD, T, &f, 5, 0, m, sizeof m), MOK_EBUSY);
  CHECK_STR_CONTAINS(m, "holds a standing job already");
  /* unknown flags beside the standing one: the usual job checks */
  CHECK_EQ_INT(raw_standing(l, MOK_OP_FORWARD, T, &f, 6, 0x40, m, sizeof m), MOK_EINVAL);
  CHECK_STR_CONTAINS(m, "unknown job flags");
  /* a tensor too small for T: the usual shape check */
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(l, MOK_OP_FORWARD, T, &f, t);
  t[MOK_SLOT_X].shape[0] = T - 1;
  mok_standing *s = NULL;
  CHECK(mok_standing_create(l, MOK_OP_FORWARD, 0, T, t, &s) != MOK_OK);
  CHECK(s == NULL);
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_DISPATCH, 0, T, t, &s), MOK_EINVAL);
  /* destroying a slot that holds nothing */
  mok_job_desc desc;
  memset(&desc, 0, sizeof desc);
  desc.version = MOK_JOB_VERSION;
  desc.op = MOK_OP_NOP;
  desc.flags = MOK_JOB_STANDING;
  desc.reserved[0] = 77;
  uint64_t tk;
  CHECK_EQ_INT(mok_submit_desc(c, &desc, &tk), MOK_OK);
  CHECK_EQ_INT(mok_wait(c, tk, 5000), MOK_ENOENT);
  CHECK_STR_CONTAINS(mok_last_error(), "holds no standing job");
  /* a standing job the daemon holds in slot 5 of a client that never
   * knew it (raw): triggering it through the words runs it */
  mok_standing_words *w = mok_shm_standing(c->shm, 5);
  CHECK(w->generation >= 1);
  w->trigger = 1;
  for (int i = 0; i < 2000 && w->flag != 1; i++) usleep(1000);
  CHECK(w->flag == 1);
  CHECK(w->done == 1);
  CHECK_EQ_INT(w->error, 0);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void wait_flag(mok_standing_words *w, int ms) {
  for (int i = 0; i < ms && w->flag != 1; i++) usleep(1000);
}

typedef struct scribbler {
  mok_standing_words *w;
  _Atomic bool stop;
  unsigned seed;
} scribbler;

static void *scribble(void *arg) {
  scribbler *sc = arg;
  unsigned s = sc->seed;
  while (!atomic_load(&sc->stop)) {
    uint64_t v = job_rng(&s) % 4 == 0 ? ((uint64_t)job_rng(&s) << 32 | job_rng(&s)) : job_rng(&s) % 3;
    switch (job_rng(&s) % 5) {
    case 0: sc->w->trigger = v; break;
    case 1: sc->w->flag = v; break;
    case 2: sc->w->done = v; break;
    case 3: sc->w->error = (int32_t)v; break;
    default: memset((void *)sc->w->message, (int)v, sizeof sc->w->message); break;
    }
  }
  return NULL;
}

static void test_hostile_words(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  const uint32_t T = 24;
  mok_layer *l = small_layer(c, T);
  job_bufs a = {0}, b = {0}, ref = {0};
  alloc_bufs(c, l, MOK_OP_FORWARD, T, &a, 5);
  alloc_bufs(c, l, MOK_OP_FORWARD, T, &b, 6);
  mok_tensor t[MOK_SLOT_COUNT_];
  mok_standing *sa, *sb;
  tensors_of(l, MOK_OP_FORWARD, T, &a, t);
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, T, t, &sa), MOK_OK);
  tensors_of(l, MOK_OP_FORWARD, T, &b, t);
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, T, t, &sb), MOK_OK);
  /* a trigger of 7: cancelled, answered, the error says why */
  mok_standing_words *wa = mok_shm_standing(c->shm, 0);
  wa->trigger = 7;
  wait_flag(wa, 3000);
  CHECK(wa->flag == 1);
  CHECK_EQ_INT(mok_standing_status(sa), MOK_EPROTO);
  CHECK_STR_CONTAINS(mok_last_error(), "trigger word holds 7");
  wa->flag = 0;
  CHECK_EQ_INT(mok_standing_trigger(sa), MOK_OK); /* a cancelled job is answered at once */
  CHECK_EQ_INT(mok_standing_wait(sa, 3000), MOK_EPROTO);
  CHECK(mok_standing_done(sa) == 0);
  /* slot 0's words scribbled on by a thread while slot 1 runs: slot 1 stays right */
  memcpy(ref.p, b.p, sizeof ref.p);
  ref.p[MOK_SLOT_OUT] = mok_host_alloc(c, b.bytes[MOK_SLOT_OUT]);
  ref.p[MOK_SLOT_CTX] = mok_host_alloc(c, b.bytes[MOK_SLOT_CTX]);
  run_ring(l, MOK_OP_FORWARD, T, &ref);
  scribbler sc = {.w = wa, .seed = 1234};
  pthread_t th;
  CHECK(pthread_create(&th, NULL, scribble, &sc) == 0);
  for (int i = 0; i < 200; i++) {
    memset(b.p[MOK_SLOT_OUT], 0xff, b.bytes[MOK_SLOT_OUT]);
    CHECK_EQ_INT(mok_standing_trigger(sb), MOK_OK);
    CHECK_EQ_INT(mok_standing_wait(sb, 10000), MOK_OK);
    CHECK(memcmp(b.p[MOK_SLOT_OUT], ref.p[MOK_SLOT_OUT], b.bytes[MOK_SLOT_OUT]) == 0);
  }
  atomic_store(&sc.stop, true);
  pthread_join(th, NULL);
  CHECK(mok_standing_done(sb) == 200);
  CHECK(harness_alive(&d));
  mok_standing_destroy(sa);
  mok_standing_destroy(sb);
  /* a fresh client is served */
  mok_close(c);
  CHECK_EQ_INT(mok_connect(d.sock, "after", &c), MOK_OK);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_failures_end_in_errors(void) {
  daemon_proc d = harness_start("fence-timeout-ms = 60\nthreads = 1\n");
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  mok_tensor t[MOK_SLOT_COUNT_];
  struct timespec t0, t1;
  /* a slow job: a second trigger written while it runs waits past the timeout
   * (the cpu engine; on a GPU the job is too fast for this part) */
  const uint32_t T = 1024;
  if (!harness_engine_is_cuda()) {
  /* ~4 GFLOP: 280-460 ms on one thread of the CI machines seen (half of it
   * took 142 ms on a fast one, under the check below) */
  mok_layer_desc ld = {.hidden = 384, .intermediate = 1536, .experts = 4, .topk = 2,
                       .max_tokens = T, .dtype = test_dtype()};
  mok_layer *big;
  CHECK_EQ_INT(mok_layer_create(c, &ld, &big), MOK_OK);
  job_bufs g = {0};
  alloc_bufs(c, big, MOK_OP_FORWARD, T, &g, 8);
  tensors_of(big, MOK_OP_FORWARD, T, &g, t);
  mok_standing *slow;
  CHECK_EQ_INT(mok_standing_create(big, MOK_OP_FORWARD, 0, T, t, &slow), MOK_OK);
  double job_ms = 0;
  { /* the job must outlast the fence timeout (60 ms) for this check */
    uint64_t tk;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    CHECK_EQ_INT(mok_submit(big, MOK_OP_FORWARD, 0, T, t, &tk), MOK_OK);
    CHECK_EQ_INT(mok_wait(c, tk, 60000), MOK_OK);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    job_ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
    CHECK_MSG(job_ms > 150, "the slow job took only %.0f ms", job_ms);
  }
  clock_gettime(CLOCK_MONOTONIC, &t0);
  CHECK_EQ_INT(mok_standing_trigger(slow), MOK_OK);
  mok_standing_words *w = mok_shm_standing(c->shm, 0);
  for (int i = 0; i < 1000 && w->trigger != 0; i++) usleep(100); /* taken */
  w->trigger = 1; /* early: the first instance still runs */
  /* the early trigger waits for the running instance past the fence
   * timeout: the job is cancelled and the client answered (the first
   * wait may already see that answer) */
  int first = mok_standing_wait(slow, 20000);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double ms = (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6;
  CHECK_MSG(first == MOK_OK || first == MOK_ETIMEOUT, "first wait: %d", first);
  for (int i = 0; i < 5000 && w->error == 0; i++) usleep(1000);
  CHECK_EQ_INT(mok_standing_status(slow), MOK_ETIMEOUT);
  CHECK_STR_CONTAINS(mok_last_error(), "waited");
  /* the running instance ends, then the early trigger's wait is past the
   * timeout: a job's time and a margin (a sanitizer build runs it 10x slower) */
  CHECK_MSG(ms < 2 * job_ms + 5000, "answered after %.0f ms (the job takes %.0f ms)", ms, job_ms);
  mok_standing_destroy(slow);
  mok_layer_destroy(big);
  }

  /* a region it names unregistered: cancelled with the region's number */
  const uint32_t Ts = 16;
  mok_layer *l = small_layer(c, Ts);
  job_bufs f = {0};
  alloc_bufs(c, l, MOK_OP_FORWARD, Ts, &f, 4);
  tensors_of(l, MOK_OP_FORWARD, Ts, &f, t);
  mok_standing *s;
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, Ts, t, &s), MOK_OK);
  CHECK_EQ_INT(mok_standing_trigger(s), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(s, 5000), MOK_OK);
  CHECK_EQ_INT(mok_host_free(c, f.p[MOK_SLOT_ROUTER_W]), MOK_OK);
  CHECK_EQ_INT(mok_standing_trigger(s), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(s, 5000), MOK_ENOENT);
  CHECK_STR_CONTAINS(mok_last_error(), "was unregistered");
  CHECK(mok_standing_done(s) == 1); /* it did not run again */
  mok_standing_destroy(s);

  /* its layer destroyed: cancelled */
  f.p[MOK_SLOT_ROUTER_W] = NULL;
  alloc_bufs(c, l, MOK_OP_FORWARD, Ts, &f, 4);
  tensors_of(l, MOK_OP_FORWARD, Ts, &f, t);
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, Ts, t, &s), MOK_OK);
  mok_layer_destroy(l);
  CHECK_EQ_INT(mok_standing_trigger(s), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(s, 5000), MOK_ECLOSED);
  CHECK_STR_CONTAINS(mok_last_error(), "layer was destroyed");
  mok_standing_destroy(s);

  /* mokd killed: the client's trigger is answered by libmok with ECLOSED */
  l = small_layer(c, Ts);
  job_bufs h = {0};
  alloc_bufs(c, l, MOK_OP_FORWARD, Ts, &h, 9);
  tensors_of(l, MOK_OP_FORWARD, Ts, &h, t);
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, 0, Ts, t, &s), MOK_OK);
  kill(d.pid, SIGKILL);
  int st;
  waitpid(d.pid, &st, 0);
  d.pid = 0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  CHECK_EQ_INT(mok_standing_trigger(s), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(s, 5000), MOK_ECLOSED);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  CHECK_STR_CONTAINS(mok_last_error(), "mokd went away");
  CHECK((t1.tv_sec - t0.tv_sec) < 2);
  mok_standing_destroy(s);
  mok_close(c);
}

/* ---- fp8: the quantising forward (MOK_JOB_QUANTIZE_WEIGHTS) ------------------
 *
 * What a replayed fp8 forward runs: each run quantises the bf16 masters as
 * they are then into the packed-weights tensor and runs the forward on
 * those forms. Held against the ring's chain: quantize_weight of each
 * master into a buffer of its own, then a forward on those. */

static const uint32_t fp8_weights[] = {MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN,
                                       MOK_SLOT_S_GATE, MOK_SLOT_S_UP, MOK_SLOT_S_DOWN};
#define N_FP8_WEIGHTS (sizeof fp8_weights / sizeof fp8_weights[0])

static mok_layer *fp8_layer(mok_client *c, uint32_t T) {
  mok_layer_desc d = {.hidden = 128, .intermediate = 128, .experts = 4, .topk = 2,
                      .shared_intermediate = 128, .max_tokens = T,
                      .dtype = MOK_DTYPE_FP8_E4M3};
  mok_layer *l = NULL;
  CHECK_EQ_INT(mok_layer_create(c, &d, &l), MOK_OK);
  return l;
}

static void *host_fill(mok_client *c, uint64_t bytes, int byte) {
  void *p = mok_host_alloc(c, bytes);
  CHECK_MSG(p != NULL, "mok_host_alloc: %s", mok_last_error());
  if (p) memset(p, byte, bytes);
  return p;
}

/* A bf16 master of weight slot s in mok memory, values in [-0.25, 0.25]. */
static void *fp8_master(mok_client *c, mok_layer *l, uint32_t s, uint64_t *ret_bytes,
                        unsigned seed) {
  mok_tensor m = mok_tensor_for_job(l, MOK_OP_FORWARD, MOK_JOB_QUANTIZE_WEIGHTS, 1, s, NULL);
  CHECK_EQ_INT(m.dtype, MOK_DTYPE_BF16);
  uint64_t n = 1;
  for (uint32_t i = 0; i < m.ndim; i++) n *= m.shape[i];
  *ret_bytes = n * 2;
  uint16_t *h = host_fill(c, n * 2, 0);
  for (uint64_t i = 0; h && i < n; i++) {
    float v = (float)((int)(job_rng(&seed) % 2001) - 1000) / 4000.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    h[i] = (uint16_t)(u >> 16);
  }
  return h;
}

typedef struct fp8_step {
  job_bufs f;                       /* x, topk_ids, router_weights, out, ctx */
  void *master[N_FP8_WEIGHTS];      /* bf16 */
  uint64_t master_bytes[N_FP8_WEIGHTS];
  void *packed;                     /* every weight's packed form (the standing job's) */
  uint64_t packed_bytes;
} fp8_step;

static void fp8_step_alloc(mok_client *c, mok_layer *l, uint32_t T, fp8_step *st) {
  memset(st, 0, sizeof *st);
  alloc_bufs(c, l, MOK_OP_FORWARD, T, &st->f, 21);
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++) {
    st->f.p[fp8_weights[i]] = NULL; /* packed u8 by job_bufs: the masters instead */
    st->master[i] = fp8_master(c, l, fp8_weights[i], &st->master_bytes[i], 31 + (unsigned)i);
  }
  st->packed_bytes = mok_layer_packed_weights_bytes(l);
  CHECK(st->packed_bytes > 0);
  st->packed = host_fill(c, st->packed_bytes, 0xab); /* gaps must come out zero */
}

/* The quantising forward's tensors (masters in the weight slots). */
static void fp8_forward_tensors(mok_layer *l, uint32_t T, const fp8_step *st, void *out,
                                void *ctx, void *packed, mok_tensor *t) {
  const uint32_t fl = MOK_JOB_QUANTIZE_WEIGHTS;
  memset(t, 0, sizeof(mok_tensor) * MOK_SLOT_COUNT_);
  const uint32_t io[] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_ROUTER_W};
  for (size_t i = 0; i < 3; i++)
    t[io[i]] = mok_tensor_for_job(l, MOK_OP_FORWARD, fl, T, io[i], st->f.p[io[i]]);
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++)
    t[fp8_weights[i]] = mok_tensor_for_job(l, MOK_OP_FORWARD, fl, T, fp8_weights[i],
                                           st->master[i]);
  t[MOK_SLOT_OUT] = mok_tensor_for_job(l, MOK_OP_FORWARD, fl, T, MOK_SLOT_OUT, out);
  t[MOK_SLOT_CTX] = mok_tensor_for_job(l, MOK_OP_FORWARD, fl, T, MOK_SLOT_CTX, ctx);
  t[MOK_SLOT_PACKED_WEIGHT] =
      mok_tensor_for_job(l, MOK_OP_FORWARD, fl, T, MOK_SLOT_PACKED_WEIGHT, packed);
}

/* The ring's chain: quantize_weight of each master into pw[i], then a plain
 * forward on them into out and ctx. */
static void fp8_ring_chain(mok_layer *l, uint32_t T, const fp8_step *st, void *pw[],
                           void *out, void *ctx) {
  mok_client *c = l->client;
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++) {
    uint64_t tk;
    CHECK_EQ_INT(mok_quantize_weight(l, fp8_weights[i], st->master[i], pw[i], &tk), MOK_OK);
    CHECK_EQ_INT(mok_wait(c, tk, 10000), MOK_OK);
  }
  mok_forward_args a = {.x = st->f.p[MOK_SLOT_X], .topk_ids = st->f.p[MOK_SLOT_TOPK_IDS],
                        .router_weights = st->f.p[MOK_SLOT_ROUTER_W], .w_gate = pw[0],
                        .w_up = pw[1], .w_down = pw[2], .s_gate = pw[3], .s_up = pw[4],
                        .s_down = pw[5], .out = out, .ctx = ctx};
  uint64_t tk;
  CHECK_EQ_INT(mok_forward(l, T, &a, &tk), MOK_OK);
  CHECK_EQ_INT(mok_wait(c, tk, 10000), MOK_OK);
}

/* packed holds pw[i] at each weight's offset and zeros between them. */
static void check_packed_forms(mok_layer *l, const uint8_t *packed, uint64_t packed_bytes,
                               void *pw[]) {
  uint64_t end = 0;
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++) {
    uint64_t at = mok_layer_packed_weights_offset(l, fp8_weights[i]);
    uint64_t n = mok_layer_packed_weight_bytes(l, fp8_weights[i]);
    CHECK_MSG(at != UINT64_MAX && at % 256 == 0 && at >= end && at + n <= packed_bytes,
              "%s at %llu", mok_slot_name(fp8_weights[i]), (unsigned long long)at);
    for (uint64_t k = end; k < at; k++) CHECK_MSG(packed[k] == 0, "gap byte %llu", (unsigned long long)k);
    CHECK_MSG(memcmp(packed + at, pw[i], n) == 0, "the packed form of %s differs from "
              "quantize_weight's", mok_slot_name(fp8_weights[i]));
    end = at + n;
  }
  for (uint64_t k = end; k < packed_bytes; k++)
    CHECK_MSG(packed[k] == 0, "tail byte %llu", (unsigned long long)k);
}

static void test_fp8_quantizing_forward(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  const uint32_t T = 40;
  mok_layer *l = fp8_layer(c, T);
  fp8_step st;
  fp8_step_alloc(c, l, T, &st);
  /* the layout: every weight's form, 256-aligned, in slot order; none without a weight */
  CHECK(mok_layer_packed_weights_offset(l, MOK_SLOT_W_GATE) == 0);
  CHECK(mok_layer_packed_weights_offset(l, MOK_SLOT_X) == UINT64_MAX);
  uint64_t ob = st.f.bytes[MOK_SLOT_OUT], cb = st.f.bytes[MOK_SLOT_CTX];
  void *pw[N_FP8_WEIGHTS], *ref_out = host_fill(c, ob, 0), *ref_ctx = host_fill(c, cb, 0);
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++)
    pw[i] = host_fill(c, mok_layer_packed_weight_bytes(l, fp8_weights[i]), 0);

  mok_forward_args a = {.x = st.f.p[MOK_SLOT_X], .topk_ids = st.f.p[MOK_SLOT_TOPK_IDS],
                        .router_weights = st.f.p[MOK_SLOT_ROUTER_W], .w_gate = st.master[0],
                        .w_up = st.master[1], .w_down = st.master[2], .s_gate = st.master[3],
                        .s_up = st.master[4], .s_down = st.master[5],
                        .out = st.f.p[MOK_SLOT_OUT], .ctx = st.f.p[MOK_SLOT_CTX]};
  mok_standing *sf;
  CHECK_EQ_INT(mok_standing_forward_quantized(l, T, &a, st.packed, &sf), MOK_OK);
  unsigned s = 5;
  uint8_t *prev_out = malloc(ob);
  for (int run = 0; run < 4; run++) {
    if (run > 0) { /* an optimizer step between runs: masters changed in place */
      for (size_t i = 0; i < N_FP8_WEIGHTS; i++) {
        uint16_t *m = st.master[i];
        for (int k = 0; k < 64; k++) m[job_rng(&s) % (st.master_bytes[i] / 2)] ^= 0x0040;
      }
      memcpy(prev_out, st.f.p[MOK_SLOT_OUT], ob);
    }
    CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
    CHECK_EQ_INT(mok_standing_wait(sf, 20000), MOK_OK);
    fp8_ring_chain(l, T, &st, pw, ref_out, ref_ctx);
    check_packed_forms(l, st.packed, st.packed_bytes, pw);
    CHECK_MSG(memcmp(st.f.p[MOK_SLOT_OUT], ref_out, ob) == 0, "run %d: out differs", run);
    CHECK_MSG(memcmp(st.f.p[MOK_SLOT_CTX], ref_ctx, cb) == 0, "run %d: ctx differs", run);
    /* the run saw the masters as they were then, not the first run's */
    if (run > 0) CHECK_MSG(memcmp(prev_out, ref_out, ob) != 0, "run %d: out unchanged", run);
    CHECK(mok_standing_done(sf) == (uint64_t)run + 1);
  }

  /* the same flag on a ring job: the same bytes */
  void *ring_out = host_fill(c, ob, 0), *ring_ctx = host_fill(c, cb, 0),
       *ring_packed = host_fill(c, st.packed_bytes, 0x5a);
  mok_tensor t[MOK_SLOT_COUNT_];
  fp8_forward_tensors(l, T, &st, ring_out, ring_ctx, ring_packed, t);
  uint64_t tk;
  CHECK_EQ_INT(mok_submit(l, MOK_OP_FORWARD, MOK_JOB_QUANTIZE_WEIGHTS, T, t, &tk), MOK_OK);
  CHECK_EQ_INT(mok_wait(c, tk, 10000), MOK_OK);
  CHECK(memcmp(ring_out, ref_out, ob) == 0);
  CHECK(memcmp(ring_ctx, ref_ctx, cb) == 0);
  check_packed_forms(l, ring_packed, st.packed_bytes, pw);

  /* a standing backward on the forms inside the packed tensor, chained after
   * the forward: bitwise the ring backward on quantize_weight's buffers */
  job_bufs bw = {0};
  const uint32_t ins[] = {MOK_SLOT_X, MOK_SLOT_ROUTER_W, MOK_SLOT_CTX};
  for (size_t i = 0; i < 3; i++) bw.p[ins[i]] = st.f.p[ins[i]], bw.bytes[ins[i]] = st.f.bytes[ins[i]];
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++) {
    bw.p[fp8_weights[i]] = (uint8_t *)st.packed + mok_layer_packed_weights_offset(l, fp8_weights[i]);
    bw.bytes[fp8_weights[i]] = mok_layer_packed_weight_bytes(l, fp8_weights[i]);
  }
  alloc_bufs(c, l, MOK_OP_BACKWARD, T, &bw, 41);
  tensors_of(l, MOK_OP_BACKWARD, T, &bw, t);
  t[MOK_SLOT_TOPK_IDS].data = NULL; /* the ctx's schedule replaces them */
  mok_standing *sb;
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_BACKWARD, 0, T, t, &sb), MOK_OK);
  uint16_t *m0 = st.master[0];
  m0[3] ^= 0x0100; /* once more a change: forward and backward of this step see it */
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sf, 20000), MOK_OK);
  CHECK_EQ_INT(mok_standing_trigger(sb), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sb, 20000), MOK_OK);
  fp8_ring_chain(l, T, &st, pw, ref_out, ref_ctx);
  job_bufs rb = {0};
  memcpy(rb.p, bw.p, sizeof rb.p);
  rb.p[MOK_SLOT_CTX] = ref_ctx;
  for (size_t i = 0; i < N_FP8_WEIGHTS; i++) rb.p[fp8_weights[i]] = pw[i];
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (bw.p[slot] && mok_job_slot_is_output(MOK_OP_BACKWARD, 0, slot)) {
      rb.p[slot] = host_fill(c, bw.bytes[slot], 0);
      rb.bytes[slot] = bw.bytes[slot];
    }
  rb.p[MOK_SLOT_TOPK_IDS] = NULL;
  run_ring(l, MOK_OP_BACKWARD, T, &rb);
  int outs = 0;
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (rb.bytes[slot] && mok_job_slot_is_output(MOK_OP_BACKWARD, 0, slot)) {
      CHECK_MSG(memcmp(rb.p[slot], bw.p[slot], bw.bytes[slot]) == 0, "backward %s differs",
                mok_slot_name(slot));
      outs++;
    }
  CHECK(outs == 8);

  /* the packed tensor unregistered: the forward is cancelled, never a stale run */
  mok_standing_destroy(sb);
  mok_host_free(c, st.packed);
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  CHECK_EQ_INT(mok_standing_wait(sf, 5000), MOK_ENOENT);
  CHECK_STR_CONTAINS(mok_last_error(), "was unregistered");
  mok_standing_destroy(sf);
  free(prev_out);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* A quantising standing forward (tensors t, flags) refused at creation with
 * status, its message naming what. */
static void expect_refused(mok_layer *l, uint32_t op, uint32_t flags, uint32_t T,
                           const mok_tensor *t, int status, const char *what) {
  mok_standing *s = NULL;
  CHECK_EQ_INT(mok_standing_create(l, op, flags, T, t, &s), status);
  CHECK(s == NULL);
  CHECK_STR_CONTAINS(mok_last_error(), what);
}

static void test_fp8_quantizing_forward_refusals(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_EQ_INT(mok_connect(d.sock, "standing", &c), MOK_OK);
  const uint32_t T = 16, fl = MOK_JOB_QUANTIZE_WEIGHTS;
  mok_layer *l = fp8_layer(c, T);
  fp8_step st;
  fp8_step_alloc(c, l, T, &st);
  mok_tensor t[MOK_SLOT_COUNT_], good[MOK_SLOT_COUNT_];
  fp8_forward_tensors(l, T, &st, st.f.p[MOK_SLOT_OUT], st.f.p[MOK_SLOT_CTX], st.packed, good);
  /* the checks pass as given (the refusals below are each one change) */
  mok_standing *s = NULL;
  CHECK_EQ_INT(mok_standing_create(l, MOK_OP_FORWARD, fl, T, good, &s), MOK_OK);
  mok_standing_destroy(s);

  memcpy(t, good, sizeof t); /* without the packed tensor */
  t[MOK_SLOT_PACKED_WEIGHT].data = NULL;
  expect_refused(l, MOK_OP_FORWARD, fl, T, t, MOK_EINVAL, "needs packed_weight");
  memcpy(t, good, sizeof t); /* one byte short */
  t[MOK_SLOT_PACKED_WEIGHT].shape[0] -= 1;
  expect_refused(l, MOK_OP_FORWARD, fl, T, t, MOK_ESHAPE, "packed_weight");
  { /* a descriptor whose packed tensor lies past the end of its region (libmok
     * would not build it: the daemon's own bounds check) */
    mok_job_desc desc;
    pthread_mutex_lock(&c->lock);
    CHECK_EQ_INT(mok_build_desc_locked(l, MOK_OP_FORWARD, fl, T, good, &desc), MOK_OK);
    pthread_mutex_unlock(&c->lock);
    for (uint32_t i = 0; i < desc.n_tensors; i++)
      if (desc.tensors[i].slot == MOK_SLOT_PACKED_WEIGHT) desc.tensors[i].offset += 1ull << 30;
    desc.flags = (uint16_t)(desc.flags | MOK_JOB_STANDING);
    desc.reserved[0] = 9;
    uint64_t tk;
    CHECK_EQ_INT(mok_submit_desc(c, &desc, &tk), MOK_OK);
    CHECK_EQ_INT(mok_wait(c, tk, 10000), MOK_EBOUNDS);
    CHECK_STR_CONTAINS(mok_last_error(), "packed_weight");
  }
  void *small = host_fill(c, 4096, 0);
  memcpy(t, good, sizeof t); /* a weight given packed, not as its bf16 master */
  t[MOK_SLOT_W_UP] = mok_tensor_for(
      l, T, MOK_SLOT_W_UP, host_fill(c, mok_layer_packed_weight_bytes(l, MOK_SLOT_W_UP), 0));
  expect_refused(l, MOK_OP_FORWARD, fl, T, t, MOK_ESHAPE, "w_up");
  memcpy(t, good, sizeof t); /* packed_weight over a master: an output overlapping an input */
  uint64_t big = st.packed_bytes + st.master_bytes[0];
  uint8_t *both = host_fill(c, big, 0);
  t[MOK_SLOT_W_GATE].data = both;
  t[MOK_SLOT_PACKED_WEIGHT].data = both + 256;
  expect_refused(l, MOK_OP_FORWARD, fl, T, t, MOK_EINVAL, "overlaps");
  memcpy(t, good, sizeof t); /* the plain forward takes no packed_weight */
  expect_refused(l, MOK_OP_FORWARD, 0, T, t, MOK_EINVAL, "packed_weight is not an argument");
  /* the flag on a backward */
  expect_refused(l, MOK_OP_BACKWARD, fl, T, good, MOK_EINVAL, "only valid on forward");
  /* the flag on a layer that is not fp8 */
  mok_layer *lb = small_layer(c, T);
  job_bufs f = {0};
  alloc_bufs(c, lb, MOK_OP_FORWARD, T, &f, 3);
  tensors_of(lb, MOK_OP_FORWARD, T, &f, t);
  expect_refused(lb, MOK_OP_FORWARD, fl, T, t, MOK_EINVAL, "needs an fp8 layer");
  CHECK(mok_layer_packed_weights_bytes(lb) == 0);
  CHECK_EQ_INT(mok_standing_forward_quantized(lb, T, &(mok_forward_args){0}, small, &s),
               MOK_EINVAL);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_runs_equal_ring_jobs),
    CHECK_CASE(test_fp8_quantizing_forward),
    CHECK_CASE(test_fp8_quantizing_forward_refusals),
    CHECK_CASE(test_validation),
    CHECK_CASE(test_hostile_words),
    CHECK_CASE(test_failures_end_in_errors),
    {0},
};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
