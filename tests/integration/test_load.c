/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: load with faults.
 *
 * LOAD_CLIENTS checked client processes each run LOAD_JOBS forward jobs
 * (random small shapes, f32 and bf16 layers, with and without a shared
 * expert, up to 8 jobs in flight) against one mokd. Every result is
 * compared bitwise with the cpu engine run in-process on the same inputs
 * (the engine is deterministic across thread counts). Checked clients also
 * submit bad descriptors now and then (each must fail alone, with its
 * status). Meanwhile victim processes connect, register, queue jobs and
 * get SIGKILLed or vanish without Goodbye at random moments.
 * Afterwards the daemon's fd count and mappings return to their baseline
 * and its RSS to within a small margin.
 *
 * make test runs the full size, 16 clients x 1000 jobs and 120 victims (about
 * 10 s on 2 cores); MOK_LOAD_CLIENTS / MOK_LOAD_JOBS / MOK_LOAD_VICTIMS
 * change it (make sanitize runs a smaller one).
 */
#include <math.h>
#include <sys/mman.h>

#include "engine.h"
#include "harness.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

#define SETS 6     /* distinct input sets per layer */
#define INFLIGHT 8 /* jobs in flight per client */

static unsigned rng_next(unsigned *s) {
  *s ^= *s << 13, *s ^= *s >> 17, *s ^= *s << 5;
  return *s;
}
static float frand(unsigned *s) { return (float)(rng_next(s) % 2001) / 1000.0f - 1.0f; }

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One input set: every input of a forward at T tokens, and the expected out. */
typedef struct input_set {
  uint32_t T;
  void *slot[MOK_SLOT_COUNT_]; /* client shared memory */
  void *want;                  /* the in-process engine's out */
  uint64_t out_bytes;
} input_set;

typedef struct layer_case {
  mok_layer *l;
  mok_layer_config cfg; /* as the daemon prepared it (row_align filled) */
  input_set sets[SETS];
} layer_case;

static uint64_t slot_bytes(const mok_layer_config *cfg, uint32_t T, uint32_t slot) {
  uint32_t dt, nd;
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape(cfg, T, slot, &dt, &nd, shape);
  uint64_t b = mok_dtype_size(dt);
  for (uint32_t i = 0; i < nd; i++) b *= shape[i];
  return b;
}

static void fill(const mok_layer_config *cfg, uint32_t slot, void *p, uint32_t T, unsigned *s) {
  uint32_t dt, nd;
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape(cfg, T, slot, &dt, &nd, shape);
  uint64_t n = 1;
  for (uint32_t i = 0; i < nd; i++) n *= shape[i];
  if (slot == MOK_SLOT_TOPK_IDS) {
    int32_t *ids = p;
    for (uint64_t t = 0; t < T; t++)
      for (uint32_t k = 0; k < cfg->topk; k++) {
        int32_t e;
        int again;
        do { /* distinct experts per token, some dropped */
          e = rng_next(s) % 7 == 0 ? -1 : (int32_t)(rng_next(s) % cfg->experts);
          again = 0;
          for (uint32_t j = 0; j < k && e >= 0; j++) again |= ids[t * cfg->topk + j] == e;
        } while (again);
        ids[t * cfg->topk + k] = e;
      }
  } else if (dt == MOK_DTYPE_F32) {
    float *f = p;
    for (uint64_t i = 0; i < n; i++) f[i] = frand(s) * (slot == MOK_SLOT_ROUTER_W ? 1.0f : 0.5f);
  } else {
    uint16_t *h = p;
    for (uint64_t i = 0; i < n; i++) h[i] = to_bf16(frand(s) * 0.5f);
  }
}

static void *alloc_in(mok_client *c, uint64_t bytes) {
  void *p = mok_host_alloc(c, bytes);
  CHECK_MSG(p != NULL, "mok_host_alloc(%llu): %s", (unsigned long long)bytes, mok_last_error());
  return p;
}

static void setup_layer(mok_client *c, mok_engine *ref, layer_case *lc, unsigned *s, int bf16,
                        int shared) {
  mok_layer_desc d = {.hidden = 8 + 8 * (rng_next(s) % 4), .intermediate = 4 + 4 * (rng_next(s) % 4),
                      .experts = 2 + rng_next(s) % 7, .topk = 1 + rng_next(s) % 2,
                      .shared_intermediate = shared ? 8 : 0, .max_tokens = 24,
                      .dtype = bf16 ? MOK_DTYPE_BF16 : MOK_DTYPE_F32,
                      .has_swiglu_limit = (int)(rng_next(s) % 2), .swiglu_limit = 0.75f};
  CHECK_MSG(mok_layer_create(c, &d, &lc->l) == MOK_OK, "%s", mok_last_error());
  lc->cfg = lc->l->cfg;
  mok_layer_config rc = lc->cfg;
  char err[256];
  CHECK_MSG(mok_engine_cpu.prepare_layer(ref, &rc, err, sizeof err) == MOK_OK, "%s", err);
  CHECK_EQ_INT(rc.row_align, lc->cfg.row_align);
  for (int k = 0; k < SETS; k++) {
    input_set *in = &lc->sets[k];
    in->T = 1 + rng_next(s) % d.max_tokens;
    mok_job_args a;
    memset(&a, 0, sizeof a);
    a.op = MOK_OP_FORWARD, a.tokens = in->T, a.layer = &lc->cfg;
    for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
      if (mok_job_slot_need(&lc->cfg, MOK_OP_FORWARD, 0, slot) != MOK_NEED_REQUIRED) continue;
      uint64_t b = slot_bytes(&lc->cfg, in->T, slot);
      in->slot[slot] = alloc_in(c, b);
      if (slot != MOK_SLOT_OUT) fill(&lc->cfg, slot, in->slot[slot], in->T, s);
      uint32_t dt, nd;
      uint64_t shape[MOK_MAX_DIMS];
      mok_job_slot_shape(&lc->cfg, in->T, slot, &dt, &nd, shape);
      mok_tensor_view *v = &a.t[slot];
      v->ptr = in->slot[slot], v->bytes = b, v->dtype = dt, v->ndim = nd;
      for (uint32_t i = 0; i < nd; i++) v->shape[i] = (uint32_t)shape[i];
    }
    in->out_bytes = a.t[MOK_SLOT_OUT].bytes;
    in->want = malloc(in->out_bytes);
    a.t[MOK_SLOT_OUT].ptr = in->want;
    mok_engine_result res = {0};
    mok_engine_run(&mok_engine_cpu, ref, &a, &res);
    CHECK_MSG(res.status == MOK_OK, "reference: %s", res.message);
  }
}

/* Submit a forward of set k writing into out (same size as the set's). */
static int submit(layer_case *lc, int k, void *out, uint64_t *ticket) {
  input_set *in = &lc->sets[k];
  mok_tensor t[MOK_SLOT_COUNT_];
  memset(t, 0, sizeof t);
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (in->slot[slot])
      t[slot] = mok_tensor_for(lc->l, in->T, slot, slot == MOK_SLOT_OUT ? out : in->slot[slot]);
  return mok_submit(lc->l, MOK_OP_FORWARD, 0, in->T, t, ticket);
}

/* Bytes from p's region start to its end: added to an offset, it points past. */
static uint64_t hr_bytes_past_end(mok_client *c, const void *p) {
  const host_region *hr = mok_find_region(c, p, 1);
  CHECK(hr != NULL);
  return hr->bytes;
}

typedef struct flight {
  uint64_t ticket;
  int layer, set, bad;
  void *out;
} flight;

/* A checked client: exit 0 when every job came back right. */
static void checked_client(const char *sock, int id, int jobs) {
  unsigned s = 0x9e3779b9u * (unsigned)(id + 1);
  mok_client *c;
  CHECK_MSG(mok_connect(sock, "load", &c) == MOK_OK, "%s", mok_last_error());
  mok_engine_config ecfg = {.threads = 1};
  mok_engine *ref;
  char err[256];
  CHECK(mok_engine_cpu.open(&ecfg, &ref, err, sizeof err) == MOK_OK);
  layer_case lcs[2];
  memset(lcs, 0, sizeof lcs);
  setup_layer(c, ref, &lcs[0], &s, 0, id % 3 == 0);
  setup_layer(c, ref, &lcs[1], &s, 1, id % 3 == 1);
  mok_engine_cpu.close(ref);
  uint64_t max_out = 0;
  for (int l = 0; l < 2; l++)
    for (int k = 0; k < SETS; k++)
      if (lcs[l].sets[k].out_bytes > max_out) max_out = lcs[l].sets[k].out_bytes;
  flight fl[INFLIGHT];
  for (int i = 0; i < INFLIGHT; i++) fl[i] = (flight){.out = alloc_in(c, max_out), .ticket = 0};
  int submitted = 0, done = 0;
  while (done < jobs) {
    for (int i = 0; i < INFLIGHT; i++) {
      flight *f = &fl[i];
      if (f->ticket) {
        int st = mok_wait(c, f->ticket, 20000);
        input_set *in = &lcs[f->layer].sets[f->set];
        if (f->bad) {
          CHECK_MSG(st == MOK_EBOUNDS, "client %d: bad job got %d (%s)", id, st, mok_last_error());
        } else {
          CHECK_MSG(st == MOK_OK, "client %d job: %s", id, mok_last_error());
          CHECK_MSG(memcmp(f->out, in->want, in->out_bytes) == 0,
                    "client %d: result of layer %d set %d differs from the reference", id,
                    f->layer, f->set);
          done++;
        }
        f->ticket = 0;
      }
      if (submitted >= jobs) continue;
      f->layer = (int)(rng_next(&s) % 2), f->set = (int)(rng_next(&s) % SETS);
      f->bad = rng_next(&s) % 50 == 0;
      memset(f->out, 0xa5, max_out);
      if (f->bad) { /* out of its region's bounds: fails alone */
        mok_job_desc desc;
        memset(&desc, 0, sizeof desc);
        desc.version = MOK_JOB_VERSION, desc.op = MOK_OP_FORWARD;
        desc.layer = lcs[f->layer].l->id, desc.tokens = lcs[f->layer].sets[f->set].T;
        input_set *in = &lcs[f->layer].sets[f->set];
        for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
          if (!in->slot[slot]) continue;
          mok_tensor mt = mok_tensor_for(lcs[f->layer].l, in->T, slot, in->slot[slot]);
          uint64_t b = slot_bytes(&lcs[f->layer].cfg, in->T, slot);
          const host_region *hr = mok_find_region(c, in->slot[slot], b);
          mok_tensor_ref *r = &desc.tensors[desc.n_tensors++];
          r->region = hr->id, r->slot = (uint16_t)slot, r->dtype = (uint8_t)mt.dtype;
          r->ndim = (uint8_t)mt.ndim, r->bytes = b;
          r->offset = (uint64_t)((char *)in->slot[slot] - (char *)hr->ptr);
          for (uint32_t k = 0; k < mt.ndim; k++) r->shape[k] = (uint32_t)mt.shape[k];
        }
        desc.tensors[0].offset += hr_bytes_past_end(c, in->slot[desc.tensors[0].slot]);
        CHECK(mok_submit_desc(c, &desc, &f->ticket) == MOK_OK);
      } else {
        CHECK_MSG(submit(&lcs[f->layer], f->set, f->out, &f->ticket) == MOK_OK, "%s",
                  mok_last_error());
        submitted++;
      }
    }
  }
  mok_close(c);
}

/* A victim: connects, registers, queues jobs, and is killed by the parent
 * at a random moment, or leaves without Goodbye (how: 0 kill, 1 _exit). */
static void victim(const char *sock, unsigned seed) {
  unsigned s = seed;
  mok_client *c;
  if (mok_connect(sock, "victim", &c) != MOK_OK) _exit(0); /* e.g. killed daemon-side */
  mok_layer_desc d = {.hidden = 16, .intermediate = 8, .experts = 4, .topk = 2,
                      .max_tokens = 16, .dtype = MOK_DTYPE_F32};
  mok_layer *l;
  if (mok_layer_create(c, &d, &l) != MOK_OK) _exit(0);
  void *p[MOK_SLOT_COUNT_] = {0};
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    if (mok_job_slot_need(&l->cfg, MOK_OP_FORWARD, 0, slot) != MOK_NEED_REQUIRED) continue;
    p[slot] = mok_host_alloc(c, slot_bytes(&l->cfg, 16, slot));
    if (!p[slot]) _exit(0);
    memset(p[slot], 0, slot_bytes(&l->cfg, 16, slot));
  }
  for (int round = 0; round < 1000; round++) {
    mok_tensor t[MOK_SLOT_COUNT_];
    memset(t, 0, sizeof t);
    for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
      if (p[slot]) t[slot] = mok_tensor_for(l, 16, slot, p[slot]);
    uint64_t tk;
    for (int i = 0; i < 16; i++) (void)mok_submit(l, MOK_OP_FORWARD, 0, 16, t, &tk);
    if (rng_next(&s) % 8 == 0) _exit(0); /* gone without Goodbye, jobs queued */
    void *extra = mok_host_alloc(c, 4096 * (1 + rng_next(&s) % 8)); /* mid-registration */
    if (extra) mok_host_free(c, extra);
    for (uint64_t w = c->next_ticket - 16; w < c->next_ticket; w++) (void)mok_wait(c, w, 100);
  }
  _exit(0);
}

static int env_int(const char *name, int dflt) {
  const char *v = getenv(name);
  return v && *v ? atoi(v) : dflt;
}

static void test_clients_under_load_with_faults_lose_nothing(void) {
  int clients = env_int("MOK_LOAD_CLIENTS", 16), jobs = env_int("MOK_LOAD_JOBS", 1000);
  int victims_total = env_int("MOK_LOAD_VICTIMS", 120);
  daemon_proc d = harness_start("max-sessions-per-uid = 256\n");
  /* baseline after one client came and went (allocator pools warmed) */
  pid_t w = fork();
  if (w == 0) {
    checked_client(d.sock, 999, 50);
    _exit(0);
  }
  int st;
  waitpid(w, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  usleep(200000);
  int base_fds = harness_fd_count(d.pid), base_maps = harness_map_count(d.pid);
  long base_rss = harness_rss_kib(d.pid);

  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  pid_t *kids = calloc((size_t)clients, sizeof *kids);
  for (int k = 0; k < clients; k++) {
    kids[k] = fork();
    CHECK(kids[k] >= 0);
    if (kids[k] == 0) {
      checked_client(d.sock, k, jobs);
      _exit(0);
    }
  }
  /* victims, a few at a time, killed at random moments while the load runs */
  unsigned s = 12345;
  int killed = 0, left = 0;
  for (int v = 0; v < victims_total; v++) {
    pid_t vp = fork();
    CHECK(vp >= 0);
    if (vp == 0) victim(d.sock, 777u + (unsigned)v);
    usleep(1000 * (rng_next(&s) % 40));
    if (rng_next(&s) % 4 != 0) kill(vp, SIGKILL);
    waitpid(vp, &st, 0);
    if (WIFSIGNALED(st)) killed++;
    else left++;
  }
  int failures = 0;
  for (int k = 0; k < clients; k++) {
    waitpid(kids[k], &st, 0);
    if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0)) failures++;
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double secs = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  CHECK_MSG(failures == 0, "%d of %d checked clients failed", failures, clients);
  CHECK(harness_alive(&d));
  mok_client *c;
  mok_daemon_stats stats;
  CHECK(mok_connect(d.sock, "stats", &c) == MOK_OK);
  CHECK(mok_stats(c, &stats) == MOK_OK);
  mok_close(c);

  int fds = harness_wait_fds(d.pid, base_fds, 5000);
  usleep(100000);
  int maps = harness_map_count(d.pid);
  long rss = harness_rss_kib(d.pid);
  printf("# %d clients x %d jobs in %.1f s (%.0f jobs/s); %d victims: %d killed, %d left "
         "without goodbye; daemon: %llu jobs done, %llu failed\n",
         clients, jobs, secs, clients * jobs / secs, victims_total, killed, left,
         (unsigned long long)stats.jobs_done, (unsigned long long)stats.jobs_failed);
  printf("# daemon fds %d -> %d, memfd mappings %d -> %d, RSS %ld -> %ld KiB\n", base_fds, fds,
         base_maps, maps, base_rss, rss);
  CHECK_EQ_INT(fds, base_fds);
  CHECK_EQ_INT(maps, base_maps);
  CHECK_MSG(rss <= base_rss + harness_rss_slack_kib(), "RSS %ld KiB, baseline %ld KiB", rss,
            base_rss);
  CHECK_EQ_INT(harness_stop(&d), 0);
  free(kids);
}

static const check_case cases[] = {
    CHECK_CASE(test_clients_under_load_with_faults_lose_nothing),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
