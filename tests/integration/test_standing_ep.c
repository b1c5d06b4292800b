/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: standing jobs (mok_standing_*) of layers on an expert-parallel
 * group (docs/ep.md "Capture and replay on a group"), on two real mokd
 * processes (cpu engine, host-triggered) and one client process per rank.
 *
 *  - runs: standing forward and backward instances of an EP=2 layer,
 *    bitwise equal to the same group jobs through the ring, five steps with
 *    new inputs each; a standing job of a layer without a group triggered
 *    at the same time (its instance runs first, the group's waits for it);
 *  - a member that never triggers: its peer's instance fails with ETIMEOUT
 *    within the group's timeout, the late member's with ECLOSED at once
 *    (the group is broken), both daemons serve, a re-join runs again;
 *  - hostile trigger words: a member writing 7 or 2^40 into its trigger
 *    word cancels its own slot (EPROTO) and still takes its turn, so its
 *    peer fails that job at once with the member's message; the group goes
 *    on (new standing jobs run bitwise right);
 *  - a member's mokd killed: its own trigger is answered by libmok with
 *    ECLOSED, its peer's instance fails with ETIMEOUT; never a hang.
 *
 * On the GPU machine the same runs on the cuda engine (MOK_TEST_ENGINE=cuda,
 * under MPS: bf16, host memory).
 */
#include <signal.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>

#include "harness/daemon.h"
#include "job_bufs.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

#define W_ 2u
#define H_ 32u
#define I_ 32u
#define IS_ 16u
#define E_ 4u
#define K_ 2u
#define TMAX 24u
#define STEPS 5

static const uint32_t T_RANK[W_] = {20, 13};

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* distinct pairs within each token; every 5th slot dropped */
static void pair_ids(int32_t *ids, uint64_t n, const mok_layer *l, unsigned *s) {
  (void)l;
  for (uint64_t i = 0; i < n; i++)
    ids[i] = i % 5 == 4 ? -1
                        : (int32_t)((i % K_ ? ids[i - 1] + 1 + job_rng(s) % (E_ - 1)
                                             : job_rng(s)) % E_);
}

/* Buffers for op at T (required slots, and ctx): random values, valid ids. */
static void alloc_bufs(mok_client *c, mok_layer *l, uint32_t op, uint32_t T, job_bufs *b,
                       unsigned seed) {
  job_bufs_alloc(c, l, op, T, b, seed, pair_ids);
}

static void tensors_of(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b, mok_tensor *t) {
  job_bufs_tensors(l, op, T, b, t);
  if (op == MOK_OP_BACKWARD) t[MOK_SLOT_TOPK_IDS].data = NULL; /* the ctx's schedule */
}

static void run_ring(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b) {
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(l, op, T, b, t);
  uint64_t tk;
  CHECK_MSG(mok_submit(l, op, 0, T, t, &tk) == MOK_OK, "%s", mok_last_error());
  int r = mok_wait(l->client, tk, 20000);
  CHECK_MSG(r == MOK_OK, "ring %s: %d %s", mok_op_name(op), r, mok_last_error());
}

/* What the parent and the ranks share (an anonymous shared mapping). */
typedef struct shared_state {
  _Atomic int phase[W_];
  _Atomic int go; /* the parent's word to the ranks */
} shared_state;

static shared_state *shared_new(void) {
  shared_state *s = mmap(NULL, sizeof *s, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  CHECK(s != MAP_FAILED);
  memset(s, 0, sizeof *s);
  return s;
}

static void wait_phase(_Atomic int *w, int v, int ms) {
  for (int i = 0; i < ms && atomic_load(w) < v; i++) usleep(1000);
  CHECK_MSG(atomic_load(w) >= v, "a peer did not reach phase %d within %d ms", v, ms);
}

/* One rank: its client, group, layer and the buffers of a training step
 * (forward, then backward from the forward's ctx), plus a second set of
 * outputs for the ring jobs it is held against. */
typedef struct rank_state {
  mok_client *c;
  mok_group *g;
  mok_layer *l;
  uint32_t rank, T;
  job_bufs f, b;       /* the standing jobs' */
  job_bufs rf, rb;     /* the ring jobs': same inputs, own outputs and ctx */
} rank_state;

static void rank_open(rank_state *rs, const char *sock, const char *key, uint32_t rank,
                      uint32_t timeout_ms) {
  memset(rs, 0, sizeof *rs);
  rs->rank = rank;
  rs->T = T_RANK[rank];
  CHECK_MSG(mok_connect(sock, "standing-ep", &rs->c) == MOK_OK, "%s", mok_last_error());
  CHECK_STR_CONTAINS(mok_client_engine(rs->c), harness_engine());
  mok_group_sizing sz = {.max_tokens = TMAX, .hidden = H_, .topk = K_, .experts = E_,
                         .dtype = test_dtype(), .timeout_ms = timeout_ms};
  CHECK_MSG(mok_group_join(rs->c, key, rank, W_, &sz, &rs->g) == MOK_OK, "join: %s",
            mok_last_error());
  mok_layer_desc d = {.hidden = H_, .intermediate = I_, .experts = E_, .topk = K_,
                      .shared_intermediate = IS_, .max_tokens = TMAX, .dtype = test_dtype(),
                      .group = rs->g, .group_tag = 3};
  CHECK_MSG(mok_layer_create(rs->c, &d, &rs->l) == MOK_OK, "layer: %s", mok_last_error());
  CHECK_EQ_INT(mok_layer_local_experts(rs->l), E_ / W_);
  alloc_bufs(rs->c, rs->l, MOK_OP_FORWARD, rs->T, &rs->f, 17 + rank);
  memcpy(&rs->b, &rs->f, sizeof rs->b);
  rs->b.p[MOK_SLOT_OUT] = NULL;
  rs->b.bytes[MOK_SLOT_OUT] = 0;
  alloc_bufs(rs->c, rs->l, MOK_OP_BACKWARD, rs->T, &rs->b, 31 + rank);
  /* the ring jobs: the same inputs, their own outputs and ctx */
  memcpy(&rs->rf, &rs->f, sizeof rs->rf);
  memcpy(&rs->rb, &rs->b, sizeof rs->rb);
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    if (rs->f.p[slot] && (slot == MOK_SLOT_CTX || mok_job_slot_is_output(MOK_OP_FORWARD, 0, slot))) {
      rs->rf.p[slot] = mok_host_alloc(rs->c, rs->f.bytes[slot]);
      CHECK(rs->rf.p[slot] != NULL);
    }
    if (rs->b.p[slot] && slot != MOK_SLOT_CTX && mok_job_slot_is_output(MOK_OP_BACKWARD, 0, slot)) {
      rs->rb.p[slot] = mok_host_alloc(rs->c, rs->b.bytes[slot]);
      CHECK(rs->rb.p[slot] != NULL);
    }
  }
  rs->rb.p[MOK_SLOT_CTX] = rs->rf.p[MOK_SLOT_CTX];
}

static mok_standing *standing_of(rank_state *rs, uint32_t op) {
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(rs->l, op, rs->T, op == MOK_OP_FORWARD ? &rs->f : &rs->b, t);
  mok_standing *s = NULL;
  CHECK_MSG(mok_standing_create(rs->l, op, 0, rs->T, t, &s) == MOK_OK, "standing %s: %s",
            mok_op_name(op), mok_last_error());
  return s;
}

/* A run expected to fail: its outcome. On the cuda engine the slot's flag is
 * written by mokd's stream after the instance's work, before the engine
 * thread has read the work's status and posted the failure, so the wait may
 * end with OK and the error follow within a poll of the engine thread. */
static int failed_outcome(mok_standing *s, int timeout_ms) {
  int r = mok_standing_wait(s, timeout_ms);
  for (int i = 0; r == MOK_OK && i < 3000; i++) {
    r = mok_standing_status(s);
    if (r == MOK_OK) usleep(1000);
  }
  return r;
}

static void run_standing(mok_standing *s, const char *what) {
  CHECK_EQ_INT(mok_standing_trigger(s), MOK_OK);
  int r = mok_standing_wait(s, 20000);
  CHECK_MSG(r == MOK_OK, "standing %s: %d %s", what, r, mok_last_error());
}

/* A new input each step (the values are read at each run). */
static void new_inputs(rank_state *rs, unsigned *seed) {
  uint8_t *x = rs->f.p[MOK_SLOT_X], *dout = rs->b.p[MOK_SLOT_D_OUT];
  for (int i = 0; i < 4; i++) {
    x[job_rng(seed) % rs->f.bytes[MOK_SLOT_X]] ^= 0x10;
    dout[job_rng(seed) % rs->b.bytes[MOK_SLOT_D_OUT]] ^= 0x08;
  }
}

/* The standing outputs (forward: out and ctx; backward: every gradient)
 * against the ring jobs' outputs, bitwise. Returns the outputs compared. */
static int same_outputs(const rank_state *rs, int step) {
  int n = 0;
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    if (rs->f.p[slot] && rs->rf.p[slot] != rs->f.p[slot]) {
      CHECK_MSG(memcmp(rs->f.p[slot], rs->rf.p[slot], rs->f.bytes[slot]) == 0,
                "rank %u step %d: forward %s differs from the ring job's", rs->rank, step,
                mok_slot_name(slot));
      n++;
    }
    if (slot != MOK_SLOT_CTX && rs->b.p[slot] && rs->rb.p[slot] != rs->b.p[slot]) {
      CHECK_MSG(memcmp(rs->b.p[slot], rs->rb.p[slot], rs->b.bytes[slot]) == 0,
                "rank %u step %d: backward %s differs from the ring job's", rs->rank, step,
                mok_slot_name(slot));
      n++;
    }
  }
  return n;
}

/* One step each way: standing forward and backward, then the ring's. */
static void step_and_compare(rank_state *rs, mok_standing *sf, mok_standing *sb, int step) {
  run_standing(sf, "forward");
  run_standing(sb, "backward");
  run_ring(rs->l, MOK_OP_FORWARD, rs->T, &rs->rf);
  run_ring(rs->l, MOK_OP_BACKWARD, rs->T, &rs->rb);
  CHECK(same_outputs(rs, step) >= 8); /* out, ctx, d_x, d_rw, 3 routed + 3 shared grads */
}

/* ---- the ranks' scenarios ---------------------------------------------------- */

typedef struct rank_args {
  const char *sock, *key;
  uint32_t rank;
  shared_state *sh;
} rank_args;

static void rank_equal(const rank_args *a) {
  rank_state rs;
  rank_open(&rs, a->sock, a->key, a->rank, 10000);
  /* a layer without a group, in the same session: its standing job's
   * instance and the group's are triggered together */
  mok_layer_desc nd = {.hidden = H_, .intermediate = I_, .experts = E_, .topk = K_,
                       .max_tokens = TMAX, .dtype = test_dtype()};
  mok_layer *nl;
  CHECK_EQ_INT(mok_layer_create(rs.c, &nd, &nl), MOK_OK);
  job_bufs nb = {0};
  alloc_bufs(rs.c, nl, MOK_OP_FORWARD, TMAX, &nb, 5);
  mok_tensor t[MOK_SLOT_COUNT_];
  tensors_of(nl, MOK_OP_FORWARD, TMAX, &nb, t);
  mok_standing *sn;
  CHECK_EQ_INT(mok_standing_create(nl, MOK_OP_FORWARD, 0, TMAX, t, &sn), MOK_OK);
  mok_standing *sf = standing_of(&rs, MOK_OP_FORWARD), *sb = standing_of(&rs, MOK_OP_BACKWARD);
  unsigned seed = 1000 + a->rank;
  for (int step = 0; step < STEPS; step++) {
    new_inputs(&rs, &seed);
    if (step % 2) {
      CHECK_EQ_INT(mok_standing_trigger(sn), MOK_OK);
      run_standing(sf, "forward");
      CHECK_EQ_INT(mok_standing_wait(sn, 20000), MOK_OK);
      run_standing(sb, "backward");
    } else {
      run_standing(sf, "forward");
      run_standing(sb, "backward");
    }
    run_ring(rs.l, MOK_OP_FORWARD, rs.T, &rs.rf);
    run_ring(rs.l, MOK_OP_BACKWARD, rs.T, &rs.rb);
    CHECK(same_outputs(&rs, step) >= 8);
  }
  CHECK(mok_standing_done(sf) == STEPS);
  CHECK(mok_standing_done(sb) == STEPS);
  CHECK(mok_standing_done(sn) == STEPS / 2);
  mok_standing_destroy(sf);
  mok_standing_destroy(sb);
  mok_standing_destroy(sn);
  mok_close(rs.c);
}

static void rank_missing(const rank_args *a) {
  const uint32_t timeout_ms = 1500;
  rank_state rs;
  rank_open(&rs, a->sock, a->key, a->rank, timeout_ms);
  mok_standing *sf = standing_of(&rs, MOK_OP_FORWARD);
  run_standing(sf, "forward"); /* both members: it runs */
  atomic_store(&a->sh->phase[a->rank], 1);
  wait_phase(&a->sh->phase[1 - a->rank], 1, 20000);
  if (a->rank == 0) {
    /* rank 1 never triggers: the barrier gives up after the group's timeout */
    double t0 = now_s();
    CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
    int r = failed_outcome(sf, 20000);
    double dt = now_s() - t0;
    CHECK_MSG(r == MOK_ETIMEOUT, "rank 0: %d %s", r, mok_last_error());
    CHECK_STR_CONTAINS(mok_last_error(), "rank(s) 1 did not arrive");
    CHECK_MSG(dt >= timeout_ms / 1e3 * 0.9 && dt < timeout_ms / 1e3 + 3.0,
              "rank 0 failed after %.2f s (timeout %.1f s)", dt, timeout_ms / 1e3);
    atomic_store(&a->sh->phase[0], 2);
  } else {
    wait_phase(&a->sh->phase[0], 2, 20000);
    /* late: the group is broken, the instance fails at once */
    double t0 = now_s();
    CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
    int r = failed_outcome(sf, 20000);
    double dt = now_s() - t0;
    CHECK_MSG(r == MOK_ECLOSED, "rank 1: %d %s", r, mok_last_error());
    CHECK_STR_CONTAINS(mok_last_error(), "broken");
    CHECK_MSG(dt < 1.0, "rank 1 failed after %.2f s", dt);
  }
  /* the slot's first failure stays; later triggers are answered at once */
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  CHECK(failed_outcome(sf, 5000) != MOK_OK);
  mok_standing_destroy(sf);
  mok_close(rs.c);
}

static void hostile_round(rank_state *rs, const rank_args *a, uint32_t bad_rank, uint64_t value,
                          int round) {
  mok_standing *sf = standing_of(rs, MOK_OP_FORWARD); /* slot 0: the client's only one */
  char want[64];
  snprintf(want, sizeof want, "trigger word holds %llu", (unsigned long long)value);
  double t0 = now_s();
  int r;
  if (a->rank == bad_rank) {
    mok_standing_words *w = mok_shm_standing(rs->c->shm, 0);
    w->trigger = value;
    r = failed_outcome(sf, 5000);
    CHECK_MSG(r == MOK_EPROTO, "rank %u (bogus trigger): %d %s", a->rank, r, mok_last_error());
    CHECK_STR_CONTAINS(mok_last_error(), want);
  } else {
    CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
    r = failed_outcome(sf, 5000);
    CHECK_MSG(r == MOK_EPROTO, "rank %u (peer of the bogus trigger): %d %s", a->rank, r,
              mok_last_error());
    CHECK_STR_CONTAINS(mok_last_error(), want);
    char who[32];
    snprintf(who, sizeof who, "failed on rank %u", bad_rank);
    CHECK_STR_CONTAINS(mok_last_error(), who);
  }
  double dt = now_s() - t0;
  CHECK_MSG(dt < 2.0, "round %d rank %u: answered after %.2f s (the group's timeout is 8 s)",
            round, a->rank, dt);
  CHECK(mok_standing_done(sf) == 0 || a->rank != bad_rank);
  mok_standing_destroy(sf);
  /* the group goes on: a new standing step runs bitwise right */
  mok_standing *nf = standing_of(rs, MOK_OP_FORWARD), *nb = standing_of(rs, MOK_OP_BACKWARD);
  step_and_compare(rs, nf, nb, round);
  mok_standing_destroy(nf);
  mok_standing_destroy(nb);
}

static void rank_hostile(const rank_args *a) {
  rank_state rs;
  rank_open(&rs, a->sock, a->key, a->rank, 8000);
  hostile_round(&rs, a, 0, 7, 0);
  hostile_round(&rs, a, 1, 1ull << 40, 1);
  mok_close(rs.c);
}

static void rank_mokd_dies(const rank_args *a) {
  const uint32_t timeout_ms = 1500;
  rank_state rs;
  rank_open(&rs, a->sock, a->key, a->rank, timeout_ms);
  mok_standing *sf = standing_of(&rs, MOK_OP_FORWARD);
  run_standing(sf, "forward");
  atomic_store(&a->sh->phase[a->rank], 1);
  while (!atomic_load(&a->sh->go)) usleep(1000); /* the parent killed rank 1's mokd */
  double t0 = now_s();
  CHECK_EQ_INT(mok_standing_trigger(sf), MOK_OK);
  int r = failed_outcome(sf, 20000);
  double dt = now_s() - t0;
  if (a->rank == 1) {
    CHECK_MSG(r == MOK_ECLOSED, "rank 1 (its mokd killed): %d %s", r, mok_last_error());
    CHECK_STR_CONTAINS(mok_last_error(), "mokd went away");
    CHECK_MSG(dt < 2.0, "rank 1 answered after %.2f s", dt);
  } else {
    CHECK_MSG(r == MOK_ETIMEOUT, "rank 0 (its peer's mokd killed): %d %s", r, mok_last_error());
    CHECK_MSG(dt < timeout_ms / 1e3 + 3.0, "rank 0 answered after %.2f s", dt);
  }
  mok_standing_destroy(sf);
  mok_close(rs.c);
}

/* ---- the tests ------------------------------------------------------------------- */

static void start_daemons(daemon_proc *d) {
  for (uint32_t r = 0; r < W_; r++) d[r] = harness_start("threads = 1\n");
}

/* a key as long as a trainer's might be: the whole failure message, which
 * names it, reaches the client */
static void unique_key(char *buf, size_t n, const char *what) {
  snprintf(buf, n, "standing-ep-test-%s-with-a-realistic-job-name-%d-%ld", what, (int)getpid(),
           (long)time(NULL));
}

/* Run fn on every rank (one client process each); returns once all ended,
 * each exit checked. before_go, if set, runs once every rank reached phase 1. */
static void run_ranks(daemon_proc *d, const char *key, void (*fn)(const rank_args *),
                      shared_state *sh, void (*before_go)(daemon_proc *)) {
  pid_t pid[W_];
  for (uint32_t r = 0; r < W_; r++) {
    pid[r] = fork();
    CHECK(pid[r] >= 0);
    if (pid[r] == 0) {
      rank_args a = {.sock = d[r].sock, .key = key, .rank = r, .sh = sh};
      fn(&a);
      _exit(0);
    }
  }
  if (before_go) {
    for (uint32_t r = 0; r < W_; r++) wait_phase(&sh->phase[r], 1, 30000);
    before_go(d);
    atomic_store(&sh->go, 1);
  }
  for (uint32_t r = 0; r < W_; r++) {
    int st;
    CHECK(waitpid(pid[r], &st, 0) == pid[r]);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "rank %u's client process failed", r);
  }
}

static void test_standing_group_jobs_equal_ring_jobs(void) {
  daemon_proc d[W_];
  start_daemons(d);
  char key[96];
  unique_key(key, sizeof key, "equal");
  run_ranks(d, key, rank_equal, shared_new(), NULL);
  for (uint32_t r = 0; r < W_; r++) CHECK_EQ_INT(harness_stop(&d[r]), 0);
}

static void test_member_that_never_triggers(void) {
  daemon_proc d[W_];
  start_daemons(d);
  char key[96];
  unique_key(key, sizeof key, "missing");
  run_ranks(d, key, rank_missing, shared_new(), NULL);
  for (uint32_t r = 0; r < W_; r++) CHECK_MSG(harness_alive(&d[r]), "mokd %u died", r);
  /* everyone re-joins (new clients): standing jobs run again, bitwise right */
  run_ranks(d, key, rank_equal, shared_new(), NULL);
  for (uint32_t r = 0; r < W_; r++) CHECK_EQ_INT(harness_stop(&d[r]), 0);
}

static void test_hostile_trigger_words(void) {
  daemon_proc d[W_];
  start_daemons(d);
  char key[96];
  unique_key(key, sizeof key, "hostile");
  run_ranks(d, key, rank_hostile, shared_new(), NULL);
  for (uint32_t r = 0; r < W_; r++) CHECK_EQ_INT(harness_stop(&d[r]), 0);
}

static void kill_rank1(daemon_proc *d) {
  kill(d[1].pid, SIGKILL);
  int st;
  waitpid(d[1].pid, &st, 0);
  d[1].pid = 0;
}

static void test_member_mokd_killed(void) {
  daemon_proc d[W_];
  start_daemons(d);
  char key[96];
  unique_key(key, sizeof key, "killed");
  run_ranks(d, key, rank_mokd_dies, shared_new(), kill_rank1);
  CHECK_MSG(harness_alive(&d[0]), "mokd 0 died");
  CHECK_EQ_INT(harness_stop(&d[0]), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_standing_group_jobs_equal_ring_jobs),
    CHECK_CASE(test_member_that_never_triggers),
    CHECK_CASE(test_hostile_trigger_words),
    CHECK_CASE(test_member_mokd_killed),
    {0},
};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
