/* SPDX-License-Identifier: Apache-2.0 */
/* The NCCL group module (daemon/cuda/nccl.h, docs/ep_nccl.md) on the GPU machine.
 *
 *   test_nccl_group all W [FAKE_OLD_LIB]
 *     W = GPUs (>= 2). The parent never touches CUDA or NCCL; it forks the
 *     members, one process per GPU, and relays the unique id that rank 0
 *     makes (rank 0's process hosts NCCL's bootstrap root, as rank 0's mokd
 *     would). Scenarios, each checked and reported:
 *       absent   MOK_NCCL_LIB=/nonexistent/...: clear EUNSUPPORTED errors
 *       old      (FAKE_OLD_LIB given) a library whose ncclGetVersion is too old
 *       group    W members form a group (twice, with fresh ids); each runs the
 *                EP kernels over the NCCL window: device barrier, all-gather
 *                of routing ids, schedule, PULL of x rows, PUSH of the rows
 *                and d_rw back into the owners' (t,k) slots, barrier; every
 *                byte checked against the host reference, two jobs in a row
 *       missing  W-1 members of a world of W: creation fails with ETIMEOUT
 *                within the timeout (no hang), CUDA still usable after
 *       split    NCCL_HOSTID differs per member (NCCL sees W hosts): creation
 *                fails with a clear error (no symmetric window / a peer
 *                outside the NVLink domain; the network path is not built)
 *     Exit 0 only when every check passed.
 *   test_nccl_group one SCENARIO W [FAKE_OLD_LIB]   one of them (absent, old, group,
 *     split, missing)
 *   test_nccl_group absent [FAKE_OLD_LIB]   the two that need no GPU and no NCCL
 *
 *   test_nccl_group bench W [T] [H] [K]
 *     One process, one thread per GPU: the same pull/push kernels of rank 0
 *     over the NCCL window's addresses and over plain cudaMalloc buffers
 *     with cudaDeviceEnablePeerAccess, same data, same run (median of 20),
 *     and a W-member device barrier over both.
 */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cuda_check.cuh"
#include "mok_ep_kernels.h"
#include "mok_status.h"
#include "cuda/nccl.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint32_t mix(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7feb352du;
  h ^= h >> 15;
  h *= 0x846ca68bu;
  h ^= h >> 16;
  return h;
}

/* ---- the reference: data and routing of a job ------------------------------------ */

typedef struct shape {
  int W, T_max, H, K, E, E_loc;
} shape;

/* member p's token t, element h, in job `seed` (any 16 bits: the kernels copy bits) */
static uint16_t x_val(int seed, int p, int t, int h) {
  return (uint16_t)mix((uint32_t)seed * 0x9e3779b9u ^ mix((uint32_t)p * 7919u + (uint32_t)t) ^
                       (uint32_t)h * 0x85ebca6bu);
}

static int t_job(const shape *s, int seed, int p) { /* the job's tokens on member p */
  int t = s->T_max - 5 * p - seed % 3;
  return t < 1 ? 1 : t;
}

/* routing id of virtual token v, choice k: -1 past the member's tokens and
 * for some dropped slots; else K distinct experts (stride 7, E a power of 2) */
static int32_t route(const shape *s, int seed, int v, int k) {
  int p = v / s->T_max, t = v % s->T_max;
  if (t >= t_job(s, seed, p)) return -1;
  if (mix((uint32_t)(v * 31 + k) ^ (uint32_t)seed * 977u) % 11u == 0) return -1;
  int base = (int)(mix((uint32_t)v ^ (uint32_t)seed << 20) % (uint32_t)s->E);
  return (base + 7 * k) % s->E;
}

static float drw_val(int pusher, int slot) { return (float)(pusher * 100000 + slot) + 0.5f; }

/* ---- a member's job over a group's addresses ------------------------------------ */

typedef struct member {
  shape s;
  int rank;
  mok_k_ep ep;
  char *local; /* own buffer (as allocated) */
  mok_k_dims dv;
  int32_t *ids_all, *sched, *status;
  void *ws;
  uint16_t *rows;
  float *drw_virtual;
  size_t R;
  cudaStream_t st;
} member;

static int member_setup(member *m, const shape *s, int rank, const uint64_t *bases, void *local) {
  memset(m, 0, sizeof *m);
  m->s = *s;
  m->rank = rank;
  m->ep.world = s->W;
  m->ep.rank = rank;
  m->ep.T_max = s->T_max;
  m->ep.max_ctas = 0;
  m->ep.off = mok_k_ep_layout_of(s->T_max, s->H, s->K);
  for (int p = 0; p < s->W; p++) m->ep.base[p] = bases[p];
  m->local = (char *)local;
  mok_k_dims dv = {s->W * s->T_max, s->H, 1024, s->E, s->E_loc, rank * s->E_loc, s->K, 0,
                   mok_k_row_align(), 0, 0.0f};
  m->dv = dv;
  char err[200];
  if (mok_k_check_dims(&m->dv, err, sizeof err) != MOK_OK) {
    printf("[rank %d] dims: %s\n", rank, err);
    return 1;
  }
  const size_t n_slots = (size_t)s->W * s->T_max * s->K;
  m->R = (size_t)mok_k_rows_capacity(&m->dv);
  CUDA_CHECK(cudaStreamCreateWithFlags(&m->st, cudaStreamNonBlocking));
  CUDA_CHECK(cudaMalloc((void **)&m->ids_all, 4 * n_slots));
  CUDA_CHECK(cudaMalloc((void **)&m->sched, 4 * (size_t)mok_k_schedule_ints(&m->dv)));
  CUDA_CHECK(cudaMalloc(&m->ws, mok_k_workspace_bytes(&m->dv)));
  CUDA_CHECK(cudaMalloc((void **)&m->rows, m->R * s->H * 2));
  CUDA_CHECK(cudaMalloc((void **)&m->drw_virtual, 4 * n_slots));
  CUDA_CHECK(cudaMalloc((void **)&m->status, 4));
  return 0;
}

static void member_free(member *m) {
  cudaFree(m->ids_all);
  cudaFree(m->sched);
  cudaFree(m->ws);
  cudaFree(m->rows);
  cudaFree(m->drw_virtual);
  cudaFree(m->status);
  cudaStreamDestroy(m->st);
}

/* One EP job, every byte checked. Returns the number of failed checks. */
static int run_job(member *m, int seed, uint64_t barrier_base) {
  const shape *s = &m->s;
  const int r = m->rank, W = s->W, T = s->T_max, H = s->H, K = s->K;
  const mok_k_ep_layout *L = &m->ep.off;
  const size_t n_slots = (size_t)W * T * K;
  int bad = 0;
  /* 1. own tokens into the own buffer (through the allocation's address; the
   *    peers and this member read them through the window's), landing poisoned */
  uint16_t *x = (uint16_t *)malloc((size_t)T * H * 2);
  int32_t *ids = (int32_t *)malloc(4u * T * K);
  float *drwv = (float *)malloc(4 * n_slots);
  for (int t = 0; t < T; t++)
    for (int h = 0; h < H; h++) x[(size_t)t * H + h] = x_val(seed, r, t, h);
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) ids[t * K + k] = route(s, seed, r * T + t, k);
  for (size_t i = 0; i < n_slots; i++) drwv[i] = drw_val(r, (int)i);
  CUDA_CHECK(cudaMemcpy(m->local + L->x, x, (size_t)T * H * 2, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemcpy(m->local + L->ids, ids, 4u * T * K, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(m->local + L->land, 0xff, (size_t)T * K * H * 2));
  CUDA_CHECK(cudaMemset(m->local + L->drw, 0xff, 4u * T * K));
  CUDA_CHECK(cudaMemcpy(m->drw_virtual, drwv, 4 * n_slots, cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(m->status, 0, 4));
  CUDA_CHECK(cudaMemset(m->rows, 0xee, m->R * H * 2)); /* poison: padding rows must become 0 */
  CUDA_CHECK(cudaDeviceSynchronize());

  /* 2. the job as the engine runs it */
  const uint64_t timeout_ns = 20ull * 1000000000ull;
  MOK_CHECK(mok_k_ep_barrier(&m->ep, barrier_base + 1, timeout_ns, 1, m->status, m->st));
  MOK_CHECK(mok_k_ep_allgather(&m->ep, L->ids, 4u * T * K, m->ids_all, m->st));
  MOK_CHECK(mok_k_schedule_build(&m->dv, m->ids_all, m->sched, m->ws, m->status, m->st));
  MOK_CHECK(mok_k_ep_pull_rows(&m->ep, &m->dv, m->sched, L->x, m->rows, m->status, m->st));
  MOK_CHECK(mok_k_ep_push_rows(&m->ep, &m->dv, m->sched, m->rows, m->drw_virtual, m->status,
                               m->st));
  MOK_CHECK(mok_k_ep_barrier(&m->ep, barrier_base + 2, timeout_ns, 1, m->status, m->st));
  CUDA_CHECK(cudaStreamSynchronize(m->st));
  CUDA_CHECK(cudaGetLastError());

  /* 3. checks */
  int32_t status = -1;
  CUDA_CHECK(cudaMemcpy(&status, m->status, 4, cudaMemcpyDeviceToHost));
  EXPECT(status == 0, "[rank %d] job %d: status %d", r, seed, status);
  bad += status != 0;

  int32_t *all = (int32_t *)malloc(4 * n_slots);
  CUDA_CHECK(cudaMemcpy(all, m->ids_all, 4 * n_slots, cudaMemcpyDeviceToHost));
  int id_bad = 0;
  for (int v = 0; v < W * T; v++)
    for (int k = 0; k < K; k++) id_bad += all[(size_t)v * K + k] != route(s, seed, v, k);
  EXPECT(id_bad == 0, "[rank %d] job %d: all-gather: %d ids differ", r, seed, id_bad);
  bad += id_bad != 0;

  const size_t sched_n = (size_t)mok_k_schedule_ints(&m->dv);
  int32_t *sc = (int32_t *)malloc(4 * sched_n);
  CUDA_CHECK(cudaMemcpy(sc, m->sched, 4 * sched_n, cudaMemcpyDeviceToHost));
  const int32_t *row_slot = sc + 8 + s->E_loc + s->E_loc + 1;
  uint16_t *rows = (uint16_t *)malloc(m->R * H * 2);
  CUDA_CHECK(cudaMemcpy(rows, m->rows, m->R * H * 2, cudaMemcpyDeviceToHost));
  const int lo = r * s->E_loc, hi = lo + s->E_loc;
  char *seen = (char *)calloc(n_slots, 1);
  int pulled = 0, remote = 0, row_bad = 0, pad_bad = 0, expected = 0;
  for (size_t i = 0; i < n_slots; i++) expected += all[i] >= lo && all[i] < hi;
  for (size_t i = 0; i < m->R; i++) {
    const int sl = row_slot[i];
    const uint16_t *row = rows + i * H;
    if (sl >= 0 && (size_t)sl < n_slots) {
      const int v = sl / K, p = v / T, t = v % T;
      const int32_t id = route(s, seed, v, sl % K);
      if (id < lo || id >= hi || seen[sl]) row_bad++;
      seen[sl] = 1;
      for (int h = 0; h < H; h++)
        if (row[h] != x_val(seed, p, t, h)) {
          row_bad++;
          break;
        }
      pulled++;
      remote += p != r;
    } else {
      for (int h = 0; h < H; h++)
        if (row[h] != 0) {
          pad_bad++;
          break;
        }
    }
  }
  EXPECT(pulled == expected && row_bad == 0 && pad_bad == 0,
         "[rank %d] job %d: pull: %d rows of %d expected, %d wrong, %d padding rows not zero", r,
         seed, pulled, expected, row_bad, pad_bad);
  bad += !(pulled == expected && row_bad == 0 && pad_bad == 0);

  uint16_t *land = (uint16_t *)malloc((size_t)T * K * H * 2);
  float *drw = (float *)malloc(4u * T * K);
  CUDA_CHECK(cudaMemcpy(land, m->local + L->land, (size_t)T * K * H * 2, cudaMemcpyDeviceToHost));
  CUDA_CHECK(cudaMemcpy(drw, m->local + L->drw, 4u * T * K, cudaMemcpyDeviceToHost));
  int landed = 0, dropped = 0, land_bad = 0, from_peer = 0;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      const int v = r * T + t, slot = t * K + k;
      const int32_t id = route(s, seed, v, k);
      const uint16_t *row = land + (size_t)slot * H;
      uint32_t dbits;
      memcpy(&dbits, &drw[slot], 4);
      if (id >= 0) {
        const int q = id / s->E_loc; /* the member that pulled and pushed it */
        int ok = drw[slot] == drw_val(q, v * K + k);
        for (int h = 0; h < H && ok; h++) ok = row[h] == x_val(seed, r, t, h);
        land_bad += !ok;
        landed++;
        from_peer += q != r;
      } else {
        int ok = dbits == 0xffffffffu;
        for (int h = 0; h < H && ok; h++) ok = row[h] == 0xffffu;
        land_bad += !ok;
        dropped++;
      }
    }
  EXPECT(land_bad == 0, "[rank %d] job %d: push: %d of %d landing slots wrong", r, seed, land_bad,
         T * K);
  bad += land_bad != 0;
  printf("[rank %d] job %d: %s: all-gather %d ids from %d members; pull %d rows (%d from a peer "
         "GPU), padding zero; push: %d landing slots + d_rw from their pushers (%d from a peer), "
         "%d dropped slots untouched; status %d\n",
         r, seed, bad ? "FAIL" : "ok", (int)n_slots, W, pulled, remote, landed, from_peer,
         dropped, status);
  free(x), free(ids), free(drwv), free(all), free(sc), free(rows), free(seen), free(land),
      free(drw);
  return bad;
}

/* ---- processes: members forked by the parent, the id relayed --------------------- */

typedef int (*member_fn)(int rank, int world, int gpus, int id_up, int id_down, int rounds);

/* rank 0 makes an id per round and sends it up; the others read theirs */
static int get_id(int rank, int id_up, int id_down, uint8_t id[MOK_NCCL_ID_BYTES]) {
  if (rank == 0) {
    char err[320];
    int st = mok_nccl_unique_id(id, err, sizeof err);
    if (st != MOK_OK) {
      printf("[rank 0] mok_nccl_unique_id: %s\n", err);
      return 1;
    }
    return write(id_up, id, MOK_NCCL_ID_BYTES) == MOK_NCCL_ID_BYTES ? 0 : 1;
  }
  size_t got = 0;
  while (got < MOK_NCCL_ID_BYTES) {
    struct pollfd pf = {id_down, POLLIN, 0};
    if (poll(&pf, 1, 60000) <= 0) return 1;
    ssize_t n = read(id_down, id + got, MOK_NCCL_ID_BYTES - got);
    if (n <= 0) return 1;
    got += (size_t)n;
  }
  return 0;
}

/* Forks n members of a world (ranks 0..n-1), relays `rounds` ids from rank 0,
 * waits at most limit_s. Returns the number of members that failed. */
static int spawn(member_fn fn, int n, int world, int gpus, int rounds, double limit_s) {
  int up[2], down[MOK_K_EP_MAX_WORLD][2];
  pid_t pid[MOK_K_EP_MAX_WORLD];
  if (pipe(up) != 0) return n;
  for (int r = 0; r < n; r++)
    if (pipe(down[r]) != 0) return n;
  fflush(stdout);
  for (int r = 0; r < n; r++) {
    pid[r] = fork();
    if (pid[r] == 0) {
      close(up[0]);
      for (int q = 0; q < n; q++) close(down[q][1]);
      int rc = fn(r, world, gpus, up[1], down[r][0], rounds);
      fflush(stdout);
      _exit(rc ? 1 : 0);
    }
  }
  close(up[1]);
  for (int r = 0; r < n; r++) close(down[r][0]);
  for (int round = 0; round < rounds; round++) {
    uint8_t id[MOK_NCCL_ID_BYTES];
    size_t got = 0;
    while (got < sizeof id) {
      struct pollfd pf = {up[0], POLLIN, 0};
      if (poll(&pf, 1, (int)(limit_s * 1000)) <= 0) break;
      ssize_t k = read(up[0], id + got, sizeof id - got);
      if (k <= 0) break;
      got += (size_t)k;
    }
    if (got < sizeof id) break; /* rank 0 failed: the others time out reading */
    for (int r = 1; r < n; r++)
      if (write(down[r][1], id, sizeof id) != (ssize_t)sizeof id) break;
  }
  close(up[0]);
  for (int r = 0; r < n; r++) close(down[r][1]);
  int failed = 0, left = n;
  const double end = now_s() + limit_s;
  int done[MOK_K_EP_MAX_WORLD] = {0};
  while (left > 0) {
    for (int r = 0; r < n; r++) {
      if (done[r]) continue;
      int wst;
      pid_t w = waitpid(pid[r], &wst, WNOHANG);
      if (w == pid[r]) {
        done[r] = 1;
        left--;
        if (!WIFEXITED(wst) || WEXITSTATUS(wst) != 0) {
          failed++;
          printf("  member %d: %s %d\n", r, WIFEXITED(wst) ? "exit" : "signal",
                 WIFEXITED(wst) ? WEXITSTATUS(wst) : WTERMSIG(wst));
        }
      }
    }
    if (left > 0 && now_s() > end) {
      for (int r = 0; r < n; r++)
        if (!done[r]) {
          printf("  member %d: still running after %.0f s (hung): killed\n", r, limit_s);
          kill(pid[r], SIGKILL);
          waitpid(pid[r], NULL, 0);
          done[r] = 1;
          failed++;
          left--;
        }
    }
    usleep(20000);
  }
  return failed;
}

/* ---- scenarios ---------------------------------------------------------------------- */

static int m_absent(int rank, int world, int gpus, int up, int down, int rounds) {
  setenv("MOK_NCCL_LIB", "/nonexistent/libnccl.so.2", 1);
  char err[320] = "";
  int st = mok_nccl_available(err, sizeof err);
  printf("  mok_nccl_available: status %d: %s\n", st, err);
  EXPECT(st == MOK_EUNSUPPORTED && strstr(err, "/nonexistent/libnccl.so.2") &&
             strstr(err, "not available"),
         "absent: status %d, message '%s'", st, err);
  uint8_t id[MOK_NCCL_ID_BYTES];
  err[0] = 0;
  st = mok_nccl_unique_id(id, err, sizeof err);
  EXPECT(st == MOK_EUNSUPPORTED && strstr(err, "not available"), "absent: unique id: %d '%s'", st,
         err);
  mok_nccl_group *g = (mok_nccl_group *)1;
  memset(id, 0, sizeof id);
  err[0] = 0;
  st = mok_nccl_group_create(id, 0, 2, 0, 1 << 20, 1000, &g, err, sizeof err);
  EXPECT(st == MOK_EUNSUPPORTED && g == NULL && strstr(err, "not available"),
         "absent: create: %d '%s'", st, err);
  printf("  mok_nccl_group_create: status %d: %s\n", st, err);
  EXPECT(mok_nccl_version() == 0, "absent: version %d", mok_nccl_version());
  return failures;
}

static const char *fake_old_lib;

static int m_old(int rank, int world, int gpus, int up, int down, int rounds) {
  setenv("MOK_NCCL_LIB", fake_old_lib, 1);
  char err[320] = "";
  int st = mok_nccl_available(err, sizeof err);
  printf("  mok_nccl_available: status %d: %s\n", st, err);
  EXPECT(st == MOK_EUNSUPPORTED && strstr(err, "too old") && strstr(err, "22800"),
         "old: status %d, message '%s'", st, err);
  return failures;
}

static shape group_shape(int world) {
  shape s = {world, 256, 1024, 4, 16 * world, 16};
  return s;
}

static int m_group(int rank, int world, int gpus, int up, int down, int rounds) {
  CUDA_CHECK(cudaSetDevice(rank % gpus));
  shape s = group_shape(world);
  mok_k_ep_layout lay = mok_k_ep_layout_of(s.T_max, s.H, s.K);
  int bad = 0;
  for (int round = 0; round < rounds; round++) {
    uint8_t id[MOK_NCCL_ID_BYTES];
    if (get_id(rank, up, down, id)) {
      printf("[rank %d] round %d: no id\n", rank, round);
      return 1;
    }
    char err[320] = "";
    mok_nccl_group *g = NULL;
    double t0 = now_s();
    int st = mok_nccl_group_create(id, rank, world, rank % gpus, lay.bytes, 30000, &g, err,
                                   sizeof err);
    double t1 = now_s();
    if (st != MOK_OK) {
      printf("[rank %d] round %d: mok_nccl_group_create: status %d: %s\n", rank, round, st, err);
      return 1;
    }
    double ims, rms;
    mok_nccl_group_timings(g, &ims, &rms);
    const uint64_t *b = mok_nccl_group_bases(g);
    printf("[rank %d] round %d: group of %d formed in %.1f ms (communicator %.1f ms, window %.1f "
           "ms), NCCL %d, LSA team %d, %llu bytes/member, local %p, base[self] 0x%llx",
           rank, round, world, (t1 - t0) * 1e3, ims, rms, mok_nccl_version(),
           mok_nccl_group_lsa_size(g), (unsigned long long)mok_nccl_group_bytes(g),
           mok_nccl_group_local(g), (unsigned long long)b[rank]);
    for (int p = 0; p < world; p++) printf(" base[%d] 0x%llx", p, (unsigned long long)b[p]);
    printf("\n");
    EXPECT(mok_nccl_group_lsa_size(g) == world, "lsa size %d", mok_nccl_group_lsa_size(g));
    EXPECT(mok_nccl_group_bytes(g) >= lay.bytes, "bytes");
    EXPECT(mok_nccl_group_world(g) == world && mok_nccl_group_rank(g) == rank, "world/rank");
    member m;
    if (member_setup(&m, &s, rank, b, mok_nccl_group_local(g))) return 1;
    const int jobs = round == 0 ? 2 : 1;
    for (int j = 0; j < jobs; j++) bad += run_job(&m, 1 + j + 10 * round, 10u * (j + 1));
    err[0] = 0;
    st = mok_nccl_group_check(g, err, sizeof err);
    EXPECT(st == MOK_OK, "[rank %d] check: %d %s", rank, st, err);
    member_free(&m);
    t0 = now_s();
    if (round == 1) { /* the watchdog's path: abort, then destroy */
      CUDA_CHECK(cudaDeviceSynchronize());
      mok_nccl_group_abort(g);
      st = mok_nccl_group_check(g, err, sizeof err);
      EXPECT(st == MOK_ECLOSED, "[rank %d] check after abort: %d %s", rank, st, err);
    }
    mok_nccl_group_destroy(g);
    printf("[rank %d] round %d: %sdestroyed in %.1f ms\n", rank, round,
           round == 1 ? "aborted and " : "", (now_s() - t0) * 1e3);
  }
  return bad || failures;
}

static int m_missing(int rank, int world, int gpus, int up, int down, int rounds) {
  CUDA_CHECK(cudaSetDevice(rank % gpus));
  uint8_t id[MOK_NCCL_ID_BYTES];
  if (get_id(rank, up, down, id)) return 1;
  char err[320] = "";
  mok_nccl_group *g = NULL;
  const uint32_t timeout_ms = 3000;
  double t0 = now_s();
  int st = mok_nccl_group_create(id, rank, world, rank % gpus, 1 << 22, timeout_ms, &g, err,
                                 sizeof err);
  double dt = now_s() - t0;
  printf("[rank %d] missing peer: status %d after %.2f s (timeout %.1f s): %s\n", rank, st, dt,
         timeout_ms * 1e-3, err);
  EXPECT(st == MOK_ETIMEOUT && g == NULL && strstr(err, "within 3000 ms"),
         "[rank %d] missing: status %d '%s'", rank, st, err);
  EXPECT(dt < timeout_ms * 1e-3 + 3.0, "[rank %d] missing: took %.2f s", rank, dt);
  /* this process keeps working: CUDA and NCCL still usable */
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, 1 << 20));
  CUDA_CHECK(cudaMemset(p, 1, 1 << 20));
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaFree(p));
  uint8_t id2[MOK_NCCL_ID_BYTES];
  EXPECT(mok_nccl_unique_id(id2, err, sizeof err) == MOK_OK, "unique id after: %s", err);
  printf("[rank %d] missing peer: CUDA and NCCL still usable afterwards\n", rank);
  return failures;
}

/* Each member claims a host of its own (NCCL_HOSTID): to NCCL the group spans
 * two hosts, as a group across NVLink domains would. Creation must fail with
 * a clear error (no symmetric window, or a peer outside the LSA team), never
 * form a group that the kernels cannot reach, never hang. */
static int m_split(int rank, int world, int gpus, int up, int down, int rounds) {
  char host[64];
  snprintf(host, sizeof host, "mok-test-host-%d", rank);
  setenv("NCCL_HOSTID", host, 1);
  CUDA_CHECK(cudaSetDevice(rank % gpus));
  uint8_t id[MOK_NCCL_ID_BYTES];
  if (get_id(rank, up, down, id)) return 1;
  char err[320] = "";
  mok_nccl_group *g = NULL;
  double t0 = now_s();
  int st = mok_nccl_group_create(id, rank, world, rank % gpus, 1 << 22, 30000, &g, err,
                                 sizeof err);
  printf("[rank %d] NCCL_HOSTID=%s: status %d after %.2f s: %s\n", rank, host, st, now_s() - t0,
         st ? err : "(formed)");
  if (st == MOK_OK) {
    printf("[rank %d] FAIL: a group formed across 'hosts' (LSA team %d)\n", rank,
           mok_nccl_group_lsa_size(g));
    mok_nccl_group_destroy(g);
    return 1;
  }
  EXPECT(st == MOK_EUNSUPPORTED && g == NULL &&
             (strstr(err, "outside this GPU's NVLink domain") || strstr(err, "gave no window")) &&
             strstr(err, "network path is not built"),
         "[rank %d] split: status %d '%s'", rank, st, err);
  return failures;
}

/* The scenarios in order (the ones that could hang last); `only` picks one. */
static int run_all(int W, const char *old_lib, const char *only) {
  int total = 0, bad = 0;
  struct {
    const char *key, *name;
    member_fn fn;
    int n, world, rounds;
    double limit_s;
  } sc[] = {
      {"absent", "absent: MOK_NCCL_LIB=/nonexistent/libnccl.so.2 -> clear errors", m_absent, 1, 1,
       0, 20},
      {"old", "old: a library reporting NCCL 2.27.3 -> 'too old'", m_old, 1, 1, 0, 20},
      {"group", "group: W members, EP kernels over the NCCL window, 2 rounds", m_group, W, W, 2,
       90},
      {"split", "split: NCCL_HOSTID differs per member (two 'hosts') -> clear error, no group",
       m_split, W, W, 1, 45},
      {"missing", "missing: W-1 members of W -> ETIMEOUT within the timeout, no hang", m_missing,
       W - 1, W, 1, 25},
  };
  fake_old_lib = old_lib;
  for (size_t i = 0; i < sizeof sc / sizeof sc[0]; i++) {
    if (only && strcmp(only, sc[i].key) != 0) continue;
    if (sc[i].fn == m_old && !old_lib) {
      printf("== %s: SKIP (no fake library given)\n", sc[i].name);
      continue;
    }
    if (sc[i].n < 1) continue;
    printf("== %s\n", sc[i].name);
    double t0 = now_s();
    int f = spawn(sc[i].fn, sc[i].n, sc[i].world, W, sc[i].rounds, sc[i].limit_s);
    printf("== %s: %s (%.1f s)\n", sc[i].name, f ? "FAIL" : "PASS", now_s() - t0);
    total++;
    bad += f != 0;
  }
  printf("%d passed, %d failed\n", total - bad, bad);
  return bad ? 1 : 0;
}

/* ---- bench: NCCL window vs cudaMalloc + peer access, one process ---------------- */

typedef struct bench_ctx {
  int W, T, H, K;
  uint8_t id[MOK_NCCL_ID_BYTES];
  pthread_barrier_t bar;
  uint64_t nccl_base[MOK_K_EP_MAX_WORLD], plain_base[MOK_K_EP_MAX_WORLD];
  int fail;
} bench_ctx;

typedef struct bench_arg {
  bench_ctx *c;
  int rank;
} bench_arg;

static void *bench_thread(void *arg) {
  bench_arg *a = (bench_arg *)arg;
  bench_ctx *c = a->c;
  const int r = a->rank, W = c->W, T = c->T, H = c->H, K = c->K;
  CUDA_CHECK(cudaSetDevice(r));
  mok_k_ep_layout lay = mok_k_ep_layout_of(T, H, K);
  char err[320];
  mok_nccl_group *g = NULL;
  double t0 = now_s();
  int st = mok_nccl_group_create(c->id, r, W, r, lay.bytes, 60000, &g, err, sizeof err);
  if (st != MOK_OK) {
    printf("[rank %d] create: %s\n", r, err);
    c->fail = 1;
    exit(2);
  }
  double ims, rms;
  mok_nccl_group_timings(g, &ims, &rms);
  printf("[rank %d] group formed in %.1f ms (communicator %.1f, window %.1f), %.2f GiB/member\n",
         r, (now_s() - t0) * 1e3, ims, rms, lay.bytes / 1073741824.0);
  void *plain;
  CUDA_CHECK(cudaMalloc(&plain, lay.bytes));
  CUDA_CHECK(cudaMemset(plain, 0, lay.bytes));
  for (int d = 0; d < W; d++)
    if (d != r) {
      cudaError_t e = cudaDeviceEnablePeerAccess(d, 0);
      if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();
      else CUDA_CHECK(e);
    }
  /* the same x in both buffers */
  char *local = (char *)mok_nccl_group_local(g);
  fill_bf16<<<1024, 256>>>((uint16_t *)(local + lay.x), (size_t)T * H, 11u + (unsigned)r, 1.0f);
  fill_bf16<<<1024, 256>>>((uint16_t *)((char *)plain + lay.x), (size_t)T * H, 11u + (unsigned)r,
                           1.0f);
  CUDA_CHECK(cudaDeviceSynchronize());
  c->nccl_base[r] = mok_nccl_group_bases(g)[r];
  c->plain_base[r] = (uint64_t)(uintptr_t)plain;
  /* every member's NCCL addresses equal rank 0's view? (each member has its own VA) */
  const uint64_t *b = mok_nccl_group_bases(g);
  uint64_t my_nccl[MOK_K_EP_MAX_WORLD];
  for (int p = 0; p < W; p++) my_nccl[p] = b[p];
  pthread_barrier_wait(&c->bar);

  mok_k_ep ep_n, ep_p;
  memset(&ep_n, 0, sizeof ep_n);
  ep_n.world = W, ep_n.rank = r, ep_n.T_max = T, ep_n.off = lay;
  ep_p = ep_n;
  for (int p = 0; p < W; p++) ep_n.base[p] = my_nccl[p], ep_p.base[p] = c->plain_base[p];
  cudaStream_t s;
  CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  int32_t *status;
  CUDA_CHECK(cudaMalloc((void **)&status, 4));
  CUDA_CHECK(cudaMemset(status, 0, 4));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  const int N = 20;

  /* device barriers of all members, both address sets */
  double bar_us[2];
  for (int variant = 0; variant < 2; variant++) {
    const mok_k_ep *ep = variant == 0 ? &ep_n : &ep_p;
    pthread_barrier_wait(&c->bar);
    for (int it = 0; it < 3; it++)
      MOK_CHECK(mok_k_ep_barrier(ep, 1000u * (variant + 1) + it, 5000000000ull, 0, status, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
    pthread_barrier_wait(&c->bar);
    CUDA_CHECK(cudaEventRecord(e0, s));
    for (int it = 0; it < N; it++)
      MOK_CHECK(mok_k_ep_barrier(ep, 1000u * (variant + 1) + 10 + it, 5000000000ull, 0, status,
                                 s));
    CUDA_CHECK(cudaEventRecord(e1, s));
    CUDA_CHECK(cudaEventSynchronize(e1));
    float ms;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    bar_us[variant] = ms * 1e3 / N;
  }
  int32_t hst = -1;
  CUDA_CHECK(cudaMemcpy(&hst, status, 4, cudaMemcpyDeviceToHost));
  if (hst != 0) {
    printf("[rank %d] barrier status %d\n", r, hst);
    c->fail = 1;
  }

  if (r == 0) {
    const int E = 64 * W, E_loc = 64, Tv = W * T;
    int32_t *h_ids = (int32_t *)malloc(sizeof(int32_t) * Tv * K);
    srand(7);
    for (int t = 0; t < Tv; t++)
      for (int k = 0; k < K; k++) {
        int e, dup;
        do {
          e = rand() % E;
          dup = 0;
          for (int j = 0; j < k; j++) dup |= h_ids[t * K + j] == e;
        } while (dup);
        h_ids[t * K + k] = e;
      }
    int32_t *ids, *sched;
    void *ws;
    CUDA_CHECK(cudaMalloc((void **)&ids, sizeof(int32_t) * Tv * K));
    CUDA_CHECK(cudaMemcpy(ids, h_ids, sizeof(int32_t) * Tv * K, cudaMemcpyHostToDevice));
    mok_k_dims dv = {Tv, H, 1024, E, E_loc, 0, K, 0, mok_k_row_align(), 0, 0.0f};
    size_t R = (size_t)mok_k_rows_capacity(&dv);
    uint16_t *rows[2];
    CUDA_CHECK(cudaMalloc((void **)&sched, sizeof(int32_t) * mok_k_schedule_ints(&dv)));
    CUDA_CHECK(cudaMalloc(&ws, mok_k_workspace_bytes(&dv)));
    CUDA_CHECK(cudaMalloc((void **)&rows[0], R * H * 2));
    CUDA_CHECK(cudaMalloc((void **)&rows[1], R * H * 2));
    MOK_CHECK(mok_k_schedule_build(&dv, ids, sched, ws, status, s));
    int routed = 0, remote = 0;
    for (int i = 0; i < Tv * K; i++) {
      routed += h_ids[i] < E_loc;
      remote += h_ids[i] < E_loc && i / K / T != 0;
    }
    const double bytes = (double)routed * H * 2;
    printf("bench: EP=%d over %d GPUs, T=%d tokens/rank, H=%d, K=%d, E=%d (%d/rank); rank 0 "
           "pulls/pushes %d rows (%.1f MiB, %d of them on a peer GPU); median of %d\n",
           W, W, T, H, K, E, E_loc, routed, bytes / 1048576.0, remote, N);
    const int caps[] = {0, 16};
    double res[2][2][2]; /* cap, variant, pull/push GB/s */
    for (int ci = 0; ci < 2; ci++)
      for (int variant = 0; variant < 2; variant++) {
        mok_k_ep ep = variant == 0 ? ep_n : ep_p;
        ep.max_ctas = caps[ci];
        double pull[N], push[N];
        for (int it = -3; it < N; it++) {
          float ms;
          CUDA_CHECK(cudaEventRecord(e0, s));
          MOK_CHECK(mok_k_ep_pull_rows(&ep, &dv, sched, lay.x, rows[variant], status, s));
          CUDA_CHECK(cudaEventRecord(e1, s));
          CUDA_CHECK(cudaEventSynchronize(e1));
          CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= 0) pull[it] = ms * 1e-3;
          CUDA_CHECK(cudaEventRecord(e0, s));
          MOK_CHECK(mok_k_ep_push_rows(&ep, &dv, sched, rows[variant], NULL, status, s));
          CUDA_CHECK(cudaEventRecord(e1, s));
          CUDA_CHECK(cudaEventSynchronize(e1));
          CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
          if (it >= 0) push[it] = ms * 1e-3;
        }
        res[ci][variant][0] = bytes / median(pull, N) * 1e-9;
        res[ci][variant][1] = bytes / median(push, N) * 1e-9;
      }
    /* both address sets pulled the same bytes */
    uint16_t *h0 = (uint16_t *)malloc(R * H * 2), *h1 = (uint16_t *)malloc(R * H * 2);
    CUDA_CHECK(cudaMemcpy(h0, rows[0], R * H * 2, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(h1, rows[1], R * H * 2, cudaMemcpyDeviceToHost));
    int same = memcmp(h0, h1, R * H * 2) == 0;
    CUDA_CHECK(cudaMemcpy(&hst, status, 4, cudaMemcpyDeviceToHost));
    printf("bench: pulled rows identical over both address sets: %s; status %d\n",
           same ? "yes" : "NO", hst);
    if (!same || hst != 0) c->fail = 1;
    printf("| CTAs | pull NCCL window | pull cudaMalloc+peer | ratio | push NCCL window | push "
           "cudaMalloc+peer | ratio |\n|---|---|---|---|---|---|---|\n");
    for (int ci = 0; ci < 2; ci++)
      printf("| %s | %.0f GB/s | %.0f GB/s | %.3f | %.0f GB/s | %.0f GB/s | %.3f |\n",
             caps[ci] ? "16 x 1024 thr" : "all (8 warps/CTA)", res[ci][0][0], res[ci][1][0],
             res[ci][0][0] / res[ci][1][0], res[ci][0][1], res[ci][1][1],
             res[ci][0][1] / res[ci][1][1]);
    printf("bench: W-member device barrier: %.1f us over the NCCL window, %.1f us over "
           "cudaMalloc+peer\n",
           bar_us[0], bar_us[1]);
    printf("JSON {\"part\": \"nccl_vs_peer\", \"W\": %d, \"T\": %d, \"H\": %d, \"K\": %d, "
           "\"rows\": %d, \"remote_rows\": %d, \"pull_nccl\": %.1f, \"pull_peer\": %.1f, "
           "\"push_nccl\": %.1f, \"push_peer\": %.1f, \"pull16_nccl\": %.1f, \"pull16_peer\": "
           "%.1f, \"push16_nccl\": %.1f, \"push16_peer\": %.1f, \"barrier_us_nccl\": %.1f, "
           "\"barrier_us_peer\": %.1f}\n",
           W, T, H, K, routed, remote, res[0][0][0], res[0][1][0], res[0][0][1], res[0][1][1],
           res[1][0][0], res[1][1][0], res[1][0][1], res[1][1][1], bar_us[0], bar_us[1]);
    free(h0), free(h1), free(h_ids);
    cudaFree(ids), cudaFree(sched), cudaFree(ws), cudaFree(rows[0]), cudaFree(rows[1]);
  }
  pthread_barrier_wait(&c->bar);
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaFree(plain);
  cudaFree(status);
  cudaStreamDestroy(s);
  double t1 = now_s();
  mok_nccl_group_destroy(g);
  printf("[rank %d] destroyed in %.1f ms\n", r, (now_s() - t1) * 1e3);
  return NULL;
}

static int run_bench(int W, int T, int H, int K) {
  bench_ctx c;
  memset(&c, 0, sizeof c);
  c.W = W, c.T = T, c.H = H, c.K = K;
  char err[320];
  if (mok_nccl_unique_id(c.id, err, sizeof err) != MOK_OK) {
    printf("bench: %s\n", err);
    return 1;
  }
  pthread_barrier_init(&c.bar, NULL, (unsigned)W);
  pthread_t th[MOK_K_EP_MAX_WORLD];
  bench_arg a[MOK_K_EP_MAX_WORLD];
  for (int r = 0; r < W; r++) {
    a[r].c = &c, a[r].rank = r;
    pthread_create(&th[r], NULL, bench_thread, &a[r]);
  }
  for (int r = 0; r < W; r++) pthread_join(th[r], NULL);
  printf("bench: %s\n", c.fail ? "FAIL" : "ok");
  return c.fail;
}

int main(int argc, char **argv) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  setenv("NCCL_NVLS_ENABLE", "0", 1); /* never multicast on these machines */
  if (argc >= 2 && !strcmp(argv[1], "all")) {
    int W = argc >= 3 ? atoi(argv[2]) : 2;
    if (W < 2 || W > MOK_K_EP_MAX_WORLD) {
      printf("test_nccl_group: needs W >= 2 GPUs (got %d)\n", W);
      return 1;
    }
    return run_all(W, argc >= 4 ? argv[3] : NULL, NULL);
  }
  if (argc >= 4 && !strcmp(argv[1], "one")) {
    int W = atoi(argv[3]);
    if (W < 2 || W > MOK_K_EP_MAX_WORLD) return 1;
    return run_all(W, argc >= 5 ? argv[4] : NULL, argv[2]);
  }
  if (argc >= 2 && !strcmp(argv[1], "absent")) {
    /* no GPU needed: what CI-like machines can run */
    int f = spawn(m_absent, 1, 1, 1, 0, 30.0);
    if (argc >= 3) {
      fake_old_lib = argv[2];
      f += spawn(m_old, 1, 1, 1, 0, 30.0);
    }
    printf("absent/old: %s\n", f ? "FAIL" : "PASS");
    return f ? 1 : 0;
  }
  if (argc >= 3 && !strcmp(argv[1], "bench")) {
    int W = atoi(argv[2]);
    int T = argc >= 4 ? atoi(argv[3]) : 2048, H = argc >= 5 ? atoi(argv[4]) : 7168,
        K = argc >= 6 ? atoi(argv[5]) : 8;
    return run_bench(W, T, H, K);
  }
  fprintf(stderr, "usage: %s all W [FAKE_OLD_LIB] | one SCENARIO W [FAKE_OLD_LIB] | absent [FAKE_OLD_LIB] | "
          "bench W [T H K]\n",
          argv[0]);
  return 2;
}
