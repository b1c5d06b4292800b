/* SPDX-License-Identifier: Apache-2.0 */
/* The ring (kernels/mok_ring.cu) on the device: running the routed experts
 * macrobatch by macrobatch gives the bits of one pass, forward and backward,
 * on both GEMM backends (Hopper, in each of its tile variants, and mma.sync):
 *   y and d_x rows, the saved activations (ctx rows, zero tail), d_rw, and
 *   every expert's weight gradients (each written by its own macrobatch
 *   only: the buffers start poisoned);
 * the plan packs whole experts greedily and never needs more macrobatches
 * than mok_k_ring_batches; an expert larger than the ring fails the job
 * with MOK_EOVERFLOW and leaves every macrobatch empty.
 * With no_tail (a group's dims), the rows in use and every other result
 * equal those of a run that writes zeros past them.
 * Usage: test_ring (exit status 0: all passed). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "../../kernels/mok_ep_kernels.h"
#include "../../kernels/mok_gemm_sm90.h"
#include "../../kernels/mok_kernels.h"
#include "../harness/kernel_choices.h"
#include "../../proto/mok_status.h"
#include "../harness/cuda_check.cuh"

#define POISON 0x7fc1u /* a bf16 NaN no kernel writes */

static void *dev(size_t bytes) {
  void *p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes ? bytes : 16));
  return p;
}

static std::vector<uint16_t> down16(const void *p, size_t n) {
  std::vector<uint16_t> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost));
  return h;
}

static std::vector<int32_t> down32(const void *p, size_t n) {
  std::vector<int32_t> h(n);
  CUDA_CHECK(cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost));
  return h;
}

static void poison(void *p, size_t n16) {
  std::vector<uint16_t> h(n16, POISON);
  CUDA_CHECK(cudaMemcpy(p, h.data(), n16 * 2, cudaMemcpyHostToDevice));
}

static int32_t status_of(int32_t *status) {
  int32_t s;
  CUDA_CHECK(cudaDeviceSynchronize());
  CUDA_CHECK(cudaMemcpy(&s, status, 4, cudaMemcpyDeviceToHost));
  return s;
}

static bool same16(const uint16_t *a, const uint16_t *b, size_t n, size_t *at) {
  for (size_t i = 0; i < n; i++)
    if (a[i] != b[i]) {
      *at = i;
      return false;
    }
  return true;
}

/* A routing that loads the experts unevenly: expert e gets about (e+1)
 * shares, so macrobatches hold different numbers of experts. */
static std::vector<int32_t> skewed_ids(int T, int K, int E, uint32_t seed) {
  std::vector<int32_t> ids((size_t)T * K);
  uint32_t s = seed;
  const int total = E * (E + 1) / 2;
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      int e;
      bool dup;
      do {
        s = s * 1664525u + 1013904223u;
        int r = (int)((s >> 8) % (uint32_t)total);
        for (e = 0; r >= e + 1; e++) r -= e + 1;
        dup = false;
        for (int j = 0; j < k; j++) dup |= ids[(size_t)t * K + j] == e;
      } while (dup);
      ids[(size_t)t * K + k] = (t % 11 == 5 && k == K - 1) ? -1 : e; /* some dropped slots */
    }
  return ids;
}

/* gemm: NULL (the Hopper kernels, default variant), "hmma" (mma.sync) or
 * a Hopper variant's name ("expert", "cluster") */
static void run_case(const char *gemm, int ring_rows_wanted, int no_tail) {
  const int variant = gemm ? mok_k_sm90_variant_parse(gemm) : MOK_K_SM90_ROWS;
  const int backend = gemm && !strcmp(gemm, "hmma") ? MOK_K_GEMM_HMMA : MOK_K_GEMM_SM90;
  if (mok_k_set_gemm_backend(backend) != backend || (backend == MOK_K_GEMM_SM90 && variant < 0) ||
      (variant >= 0 && mok_k_sm90_set_variant(variant) != MOK_OK)) {
    EXPECT(0, "GEMM path %s not available", gemm ? gemm : "default");
    return;
  }
  char path[64];
  snprintf(path, sizeof path, "%s%s", gemm ? gemm : "default", no_tail ? " no_tail" : "");
  mok_k_dims d;
  memset(&d, 0, sizeof d);
  d.T = 1500;
  d.H = 256;
  d.I = 128;
  d.E = 12;
  d.E_loc = 12;
  d.K = 4;
  d.row_align = mok_k_row_align();
  d.no_tail = no_tail;
  const int T = d.T, H = d.H, I = d.I, K = d.K, E = d.E;
  const long long C = mok_k_rows_capacity(&d);
  std::vector<int32_t> ids = skewed_ids(T, K, E, 7);
  /* host counts: the ring must hold the largest expert, and the plan below
   * must need several macrobatches */
  std::vector<int> cnt(E, 0);
  for (int32_t id : ids)
    if (id >= 0) cnt[id]++;
  int largest = 0;
  long long used = 0;
  for (int e = 0; e < E; e++) {
    int padded = (cnt[e] + d.row_align - 1) / d.row_align * d.row_align;
    largest = padded > largest ? padded : largest;
    used += padded;
  }
  const int R = ring_rows_wanted > 0 ? ring_rows_wanted : largest;
  mok_k_dims dr = d;
  dr.rows_limit = R;
  const int batches = mok_k_ring_batches(C, R, E);
  printf("# %s: T=%d K=%d E=%d, %lld rows used of %lld, ring %d rows, %d macrobatches launched\n",
         path, T, K, E, used, C, R, batches);

  int32_t *status = (int32_t *)dev(4);
  CUDA_CHECK(cudaMemset(status, 0, 4));
  int32_t *d_ids = (int32_t *)dev(ids.size() * 4);
  CUDA_CHECK(cudaMemcpy(d_ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice));
  uint16_t *x = (uint16_t *)dev((size_t)T * H * 2), *dout = (uint16_t *)dev((size_t)T * H * 2);
  uint16_t *wg = (uint16_t *)dev((size_t)E * I * H * 2), *wu = (uint16_t *)dev((size_t)E * I * H * 2);
  uint16_t *wd = (uint16_t *)dev((size_t)E * H * I * 2);
  fill_bf16<<<64, 256>>>(x, (size_t)T * H, 1, 1.0f);
  fill_bf16<<<64, 256>>>(dout, (size_t)T * H, 2, 1.0f);
  fill_bf16<<<64, 256>>>(wg, (size_t)E * I * H, 3, 0.1f);
  fill_bf16<<<64, 256>>>(wu, (size_t)E * I * H, 4, 0.1f);
  fill_bf16<<<64, 256>>>(wd, (size_t)E * H * I, 5, 0.1f);
  std::vector<float> rw_h((size_t)T * K);
  for (size_t i = 0; i < rw_h.size(); i++) rw_h[i] = 0.1f + 0.05f * (float)(i % 13);
  float *rw = (float *)dev(rw_h.size() * 4);
  CUDA_CHECK(cudaMemcpy(rw, rw_h.data(), rw_h.size() * 4, cudaMemcpyHostToDevice));
  void *ws = dev(mok_k_workspace_bytes(&d));
  int32_t *sched = (int32_t *)dev((size_t)mok_k_schedule_ints(&d) * 4);
  MOK_CHECK(mok_k_schedule_build(&d, d_ids, sched, ws, status, 0));

  /* one pass */
  uint16_t *rx = (uint16_t *)dev((size_t)C * H * 2), *rdo = (uint16_t *)dev((size_t)C * H * 2);
  uint16_t *y = (uint16_t *)dev((size_t)C * H * 2), *dx = (uint16_t *)dev((size_t)C * H * 2);
  uint16_t *g = (uint16_t *)dev((size_t)C * I * 2), *u = (uint16_t *)dev((size_t)C * I * 2);
  float *drw = (float *)dev((size_t)T * K * 4);
  uint16_t *dwg = (uint16_t *)dev((size_t)E * I * H * 2), *dwu = (uint16_t *)dev((size_t)E * I * H * 2);
  uint16_t *dwd = (uint16_t *)dev((size_t)E * H * I * 2);
  MOK_CHECK(mok_k_gather_rows(&d, sched, x, rx, status, 0));
  MOK_CHECK(mok_k_gather_rows(&d, sched, dout, rdo, status, 0));
  MOK_CHECK(mok_k_expert_forward(&d, sched, rx, wg, wu, wd, g, u, y, ws, status, 0));
  MOK_CHECK(mok_k_expert_backward(&d, sched, g, u, rx, rdo, rw, wg, wu, wd, dx, drw, dwg, dwu,
                                  dwd, ws, status, 0));
  EXPECT(status_of(status) == 0, "%s: one pass failed: status %d", path, status_of(status));
  if (no_tail) {
    /* rows past those in use are skipped: the rows in use, d_rw and the
     * weight gradients are those of a run that zeroes the tail */
    MOK_CHECK(mok_k_acts_zero_tail(&d, sched, g, u, 0));
    mok_k_dims z = d;
    z.no_tail = 0;
    uint16_t *y0 = (uint16_t *)dev((size_t)C * H * 2), *dx0 = (uint16_t *)dev((size_t)C * H * 2);
    uint16_t *g0 = (uint16_t *)dev((size_t)C * I * 2), *u0 = (uint16_t *)dev((size_t)C * I * 2);
    uint16_t *w0 = (uint16_t *)dev((size_t)E * I * H * 2 * 3);
    float *drw0 = (float *)dev((size_t)T * K * 4);
    MOK_CHECK(mok_k_expert_forward(&z, sched, rx, wg, wu, wd, g0, u0, y0, ws, status, 0));
    MOK_CHECK(mok_k_expert_backward(&z, sched, g0, u0, rx, rdo, rw, wg, wu, wd, dx0, drw0, w0,
                                    w0 + (size_t)E * I * H, w0 + 2 * (size_t)E * I * H, ws,
                                    status, 0));
    EXPECT(status_of(status) == 0, "%s: zero-tail pass failed", path);
    size_t at, n = (size_t)used * H;
    std::vector<uint16_t> a0 = down16(y0, n), a1 = down16(y, n);
    EXPECT(same16(a1.data(), a0.data(), n, &at), "%s: y row %zu differs from a zero-tail run",
           path, at / H);
    a0 = down16(dx0, n), a1 = down16(dx, n);
    EXPECT(same16(a1.data(), a0.data(), n, &at), "%s: d_x row %zu differs from a zero-tail run",
           path, at / H);
    a0 = down16(g0, (size_t)C * I), a1 = down16(g, (size_t)C * I);
    EXPECT(same16(a1.data(), a0.data(), a0.size(), &at), "%s: g row %zu differs (tail zeroed)",
           path, at / I);
    a0 = down16(w0, (size_t)E * I * H), a1 = down16(dwg, (size_t)E * I * H);
    EXPECT(same16(a1.data(), a0.data(), a0.size(), &at), "%s: d_w_gate differs", path);
    a0 = down16(w0 + 2 * (size_t)E * I * H, (size_t)E * I * H), a1 = down16(dwd, (size_t)E * I * H);
    EXPECT(same16(a1.data(), a0.data(), a0.size(), &at), "%s: d_w_down differs", path);
    std::vector<float> r0((size_t)T * K), r1((size_t)T * K);
    CUDA_CHECK(cudaMemcpy(r0.data(), drw0, r0.size() * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(r1.data(), drw, r1.size() * 4, cudaMemcpyDeviceToHost));
    EXPECT(memcmp(r0.data(), r1.data(), r0.size() * 4) == 0, "%s: d_rw differs", path);
    void *zs[] = {y0, dx0, g0, u0, w0, drw0};
    for (void *q : zs) CUDA_CHECK(cudaFree(q));
  }

  /* the ring */
  void *wsr = dev(mok_k_workspace_bytes(&dr));
  int32_t *plan = (int32_t *)dev((size_t)batches * 16);
  int32_t *sub = (int32_t *)dev((size_t)mok_k_schedule_ints(&dr) * 4);
  uint16_t *qx = (uint16_t *)dev((size_t)R * H * 2), *qdo = (uint16_t *)dev((size_t)R * H * 2);
  uint16_t *qy = (uint16_t *)dev((size_t)R * H * 2), *qdx = (uint16_t *)dev((size_t)R * H * 2);
  uint16_t *qg = (uint16_t *)dev((size_t)R * I * 2), *qu = (uint16_t *)dev((size_t)R * I * 2);
  uint16_t *cg = (uint16_t *)dev((size_t)C * I * 2), *cu = (uint16_t *)dev((size_t)C * I * 2);
  float *qdrw = (float *)dev((size_t)T * K * 4);
  uint16_t *rwg = (uint16_t *)dev((size_t)E * I * H * 2), *rwu = (uint16_t *)dev((size_t)E * I * H * 2);
  uint16_t *rwd = (uint16_t *)dev((size_t)E * H * I * 2);
  poison(cg, (size_t)C * I);
  poison(cu, (size_t)C * I);
  poison(rwg, (size_t)E * I * H);
  poison(rwu, (size_t)E * I * H);
  poison(rwd, (size_t)E * H * I);
  MOK_CHECK(mok_k_ring_plan(&d, sched, R, batches, plan, status, 0));
  EXPECT(status_of(status) == 0, "%s: plan failed: status %d", path, status_of(status));
  std::vector<int32_t> pl = down32(plan, (size_t)batches * 4);
  std::vector<int32_t> full = down32(sched, (size_t)mok_k_schedule_ints(&d));
  const int32_t *offs = full.data() + 8 + E;
  /* the plan: greedy whole experts, contiguous, covering every expert */
  int e_next = 0, real = 0;
  for (int m = 0; m < batches; m++) {
    const int32_t *p = &pl[(size_t)m * 4];
    if (p[0] == E) {
      EXPECT(p[1] == E && p[3] == 0, "%s: empty macrobatch %d is {%d,%d,%d,%d}", path, m, p[0],
             p[1], p[2], p[3]);
      continue;
    }
    real++;
    EXPECT(p[0] == e_next && p[1] > p[0] && p[2] == offs[p[0]] && p[3] == offs[p[1]] - offs[p[0]] &&
               p[3] <= R && (p[1] == E || offs[p[1] + 1] - offs[p[0]] > R),
           "%s: macrobatch %d is {%d,%d,%d,%d}", path, m, p[0], p[1], p[2], p[3]);
    e_next = p[1];
  }
  EXPECT(e_next == E, "%s: the plan covers experts [0, %d) of %d", path, e_next, E);
  EXPECT(real >= 2 || ring_rows_wanted > 0, "%s: only %d macrobatch(es): the test needs more",
         path, real);
  printf("# %s: %d macrobatches ran\n", path, real);

  std::vector<uint16_t> y_h = down16(y, (size_t)C * H), dx_h = down16(dx, (size_t)C * H);
  /* with no_tail the ring's rows past each macrobatch's are not written:
   * compare the rows in use only (below) */
  std::vector<float> drw_ring((size_t)T * K, 0.0f);
  for (int m = 0; m < batches; m++) {
    MOK_CHECK(mok_k_ring_schedule(&d, sched, plan, m, &dr, sub, 0));
    MOK_CHECK(mok_k_gather_rows(&dr, sub, x, qx, status, 0));
    MOK_CHECK(mok_k_expert_forward(&dr, sub, qx, wg, wu, wd, qg, qu, qy, wsr, status, 0));
    MOK_CHECK(mok_k_ring_copy_acts(plan, m, R, I, cg, cu, qg, qu, 1, 0));
    /* backward from the ctx rows (as a job without recompute) */
    poison(qg, (size_t)R * I);
    poison(qu, (size_t)R * I);
    MOK_CHECK(mok_k_ring_copy_acts(plan, m, R, I, cg, cu, qg, qu, 0, 0));
    MOK_CHECK(mok_k_gather_rows(&dr, sub, dout, qdo, status, 0));
    MOK_CHECK(mok_k_expert_backward_experts(&dr, sub, qg, qu, qx, qdo, rw, wg, wu, wd, qdx, qdrw,
                                            rwg, rwu, rwd, plan + 4 * m, wsr, status, 0));
    EXPECT(status_of(status) == 0, "%s: macrobatch %d failed: status %d", path, m,
           status_of(status));
    const int32_t *p = &pl[(size_t)m * 4];
    std::vector<uint16_t> qy_h = down16(qy, (size_t)R * H), qdx_h = down16(qdx, (size_t)R * H);
    size_t at;
    EXPECT(same16(qy_h.data(), y_h.data() + (size_t)p[2] * H, (size_t)p[3] * H, &at),
           "%s: macrobatch %d: y row %zu differs", path, m, at / H);
    EXPECT(same16(qdx_h.data(), dx_h.data() + (size_t)p[2] * H, (size_t)p[3] * H, &at),
           "%s: macrobatch %d: d_x row %zu differs", path, m, at / H);
    std::vector<int32_t> sv = down32(sub, (size_t)mok_k_schedule_ints(&dr));
    const int32_t *slot_row = sv.data() + 8 + E + E + 1 + R;
    std::vector<float> q(T * K);
    CUDA_CHECK(cudaMemcpy(q.data(), qdrw, q.size() * 4, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < q.size(); i++)
      if (slot_row[i] >= 0) drw_ring[i] = q[i];
  }
  MOK_CHECK(mok_k_acts_zero_tail(&d, sched, cg, cu, 0));
  EXPECT(status_of(status) == 0, "%s: ring failed: status %d", path, status_of(status));
  size_t at;
  std::vector<uint16_t> a = down16(g, (size_t)C * I), b = down16(cg, (size_t)C * I);
  EXPECT(same16(b.data(), a.data(), a.size(), &at), "%s: ctx g row %zu differs", path, at / I);
  a = down16(u, (size_t)C * I), b = down16(cu, (size_t)C * I);
  EXPECT(same16(b.data(), a.data(), a.size(), &at), "%s: ctx u row %zu differs", path, at / I);
  std::vector<float> drw_h((size_t)T * K);
  CUDA_CHECK(cudaMemcpy(drw_h.data(), drw, drw_h.size() * 4, cudaMemcpyDeviceToHost));
  EXPECT(memcmp(drw_h.data(), drw_ring.data(), drw_h.size() * 4) == 0, "%s: d_rw differs", path);
  const struct {
    const char *name;
    uint16_t *one, *ring;
  } grads[] = {{"d_w_gate", dwg, rwg}, {"d_w_up", dwu, rwu}, {"d_w_down", dwd, rwd}};
  for (int i = 0; i < 3; i++) {
    a = down16(grads[i].one, (size_t)E * I * H);
    b = down16(grads[i].ring, (size_t)E * I * H);
    EXPECT(same16(b.data(), a.data(), a.size(), &at), "%s: %s expert %zu differs (%04x vs %04x)",
           path, grads[i].name, at / ((size_t)I * H), b[at], a[at]);
  }

  /* a ring smaller than the largest expert */
  CUDA_CHECK(cudaMemset(status, 0, 4));
  const int small = largest - d.row_align;
  const int nb = mok_k_ring_batches(C, small, E);
  int32_t *plan2 = (int32_t *)dev((size_t)nb * 16);
  MOK_CHECK(mok_k_ring_plan(&d, sched, small, nb, plan2, status, 0));
  EXPECT(status_of(status) == MOK_EOVERFLOW, "%s: ring %d < largest expert %d: status %d",
         path, small, largest, status_of(status));
  std::vector<int32_t> pl2 = down32(plan2, (size_t)nb * 4);
  for (int m = 0; m < nb; m++)
    EXPECT(pl2[(size_t)m * 4] == E && pl2[(size_t)m * 4 + 3] == 0,
           "%s: overflowing plan has macrobatch %d {%d,..,%d}", path, m, pl2[(size_t)m * 4],
           pl2[(size_t)m * 4 + 3]);
  void *all[] = {status, d_ids, x, dout, wg, wu, wd, rw, ws, sched, rx, rdo, y, dx, g, u, drw,
                 dwg, dwu, dwd, wsr, plan, sub, qx, qdo, qy, qdx, qg, qu, cg, cu, qdrw, rwg, rwu,
                 rwd, plan2};
  for (void *p : all) CUDA_CHECK(cudaFree(p));
  mok_k_sm90_set_variant(MOK_K_SM90_ROWS);
  mok_k_set_gemm_backend(MOK_K_GEMM_SM90);
}

int main(void) {
  MOK_CHECK(kernel_init_from_env());
  run_case(NULL, 0, 0);     /* Hopper kernels; the ring holds the largest expert */
  run_case("hmma", 0, 0);   /* mma.sync kernels */
  run_case(NULL, 2048, 0);  /* a larger ring: fewer, fuller macrobatches */
  run_case(NULL, 0, 1);     /* a group's dims: rows past those in use skipped */
  run_case("hmma", 2048, 1);
  run_case("cluster", 0, 0); /* 2-CTA clusters sharing the weight tiles */
  run_case("cluster", 0, 1);
  run_case("expert", 2048, 1); /* expert-major tile order */
  printf("test_ring: %s (%d failures)\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
