/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine's steps: docs/math.md on the host, in f32 (cpu/steps.h).
 *
 * Every op is built from the six steps (dispatch, compute, combine and their
 * backward forms), here; the whole-layer ops (cpu/engine.c) and the
 * expert-parallel path (cpu/ep.c) call the same functions, so the
 * single-step chain gives the same bits.
 *
 * Determinism: work is split over the pool's threads by output element,
 * each element computed by exactly one task, and every sum runs serially in
 * ascending index order starting from +0 (or from the value math.md names).
 * The task decomposition does not depend on the thread count. The GEMM
 * kernels vectorise across output columns only, so each lane is the scalar
 * sum. The build uses -ffp-contract=off: no fused multiply-add anywhere.
 *
 * Internally everything is computed in f32: bf16 tensors are widened
 * (exactly) to f32 scratch, results are rounded where math.md says rnd().
 */
#include <math.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "common/fp8_e4m3.h"
#include "cpu/pool.h"
#include "cpu/steps.h"
#include "mok_slots.h"
#include "schedule.h"

static float *scratch_f32(job_env *env, int id, size_t n) {
  if (n > SIZE_MAX / sizeof(float)) {
    mok__cpu_job_fail(env, MOK_ENOMEM, "scratch of %zu floats is too large", n);
    return NULL;
  }
  return mok__cpu_scratch(env, id, n * sizeof(float));
}

/* ---- element conversion --------------------------------------------------- */

static inline float rnd(uint32_t dt, float v) {
  return dt == MOK_DTYPE_BF16 ? mok_round_bf16(v) : v;
}

/* dst[0..n) = src[off..off+n) widened to f32 (exact). */
static void load_f32(uint32_t dt, const void *src, size_t off, size_t n, float *dst) {
  if (dt == MOK_DTYPE_F32) {
    memcpy(dst, (const float *)src + off, n * sizeof(float));
    return;
  }
  const mok_bf16 *s = (const mok_bf16 *)src + off;
  for (size_t i = 0; i < n; i++) dst[i] = mok_bf16_to_f32(s[i]);
}

/* dst[off..off+n) = rnd(src[0..n)) in the layer dtype. */
static void store_rnd(uint32_t dt, const float *src, void *dst, size_t off, size_t n) {
  if (dt == MOK_DTYPE_F32) {
    memcpy((float *)dst + off, src, n * sizeof(float));
    return;
  }
  mok_bf16 *d = (mok_bf16 *)dst + off;
  for (size_t i = 0; i < n; i++) d[i] = mok_f32_to_bf16(src[i]);
}

#define CONVERT_BLOCK 16384u

typedef struct convert_arg {
  uint32_t dt;
  const void *src; /* layer dtype (widen) or f32 (narrow) */
  void *dst;
  size_t n;
} convert_arg;

static void widen_blocks(void *p, size_t b0, size_t b1) {
  const convert_arg *c = p;
  for (size_t b = b0; b < b1; b++) {
    size_t off = b * CONVERT_BLOCK, n = c->n - off < CONVERT_BLOCK ? c->n - off : CONVERT_BLOCK;
    load_f32(c->dt, c->src, off, n, (float *)c->dst + off);
  }
}

static void narrow_blocks(void *p, size_t b0, size_t b1) {
  const convert_arg *c = p;
  for (size_t b = b0; b < b1; b++) {
    size_t off = b * CONVERT_BLOCK, n = c->n - off < CONVERT_BLOCK ? c->n - off : CONVERT_BLOCK;
    store_rnd(c->dt, (const float *)c->src + off, c->dst, off, n);
  }
}

static size_t n_blocks(size_t n) { return (n + CONVERT_BLOCK - 1) / CONVERT_BLOCK; }

/* A layer-dtype input as f32: the tensor itself for f32 layers, else a
 * widened copy in scratch. NULL after failing the job. */
static const float *f32_in(job_env *env, int id, const void *src, size_t n) {
  if (env->dtype == MOK_DTYPE_F32) return src;
  float *dst = scratch_f32(env, id, n);
  if (!dst) return NULL;
  convert_arg c = {env->dtype, src, dst, n};
  mok__cpu_par_for(env, n_blocks(n), widen_blocks, &c);
  return dst;
}

/* Where to write an f32 result bound for a layer-dtype output: the output
 * itself for f32 layers, else scratch that f32_out_finish() rounds into it. */
static float *f32_out(job_env *env, int id, void *dst, size_t n) {
  if (env->dtype == MOK_DTYPE_F32) return dst;
  return scratch_f32(env, id, n);
}

static void f32_out_finish(job_env *env, const float *src, void *dst, size_t n) {
  if (env->dtype == MOK_DTYPE_F32) return;
  convert_arg c = {env->dtype, src, dst, n};
  mok__cpu_par_for(env, n_blocks(n), narrow_blocks, &c);
}

/* ---- GEMM: C[m,n] = Σ_k A[m,k]·B[k,n] (+ A2[m,k]·B2[k,n]), k ascending ------
 *
 * Each C element is one serial f32 sum from +0 in ascending k; with the
 * second operand pair every term is (a·b + a2·b2), rounded, then added.
 * Tiles of 4x8 keep 8 four-lane accumulators in registers; lanes are
 * independent output columns, so vector and scalar paths give equal bits. */

typedef struct gemm_job {
  size_t M, N, K;
  const float *A; /* A[m,k] = A[m*a_m + k*a_k] */
  const float *A2;
  size_t a_m, a_k;
  const float *B; /* B[k,n] = B[k*ldb + n] */
  const float *B2;
  size_t ldb;
  float *C; /* C[m,n] = C[m*ldc + n] */
  size_t ldc;
} gemm_job;

typedef struct gemm_task {
  size_t job, m0, m1, n0, n1;
} gemm_task;

#define GEMM_MB 32u  /* rows per task */
#define GEMM_NB 128u /* columns per task */

typedef float v4f __attribute__((vector_size(16)));

static inline v4f v4_load(const float *p) {
  v4f v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline void v4_store(float *p, v4f v) { memcpy(p, &v, sizeof v); }
static inline v4f v4_splat(float a) { return (v4f){a, a, a, a}; }

/* Four rows by eight columns at (m, n). */
static inline __attribute__((always_inline)) void gemm_tile_4x8(const gemm_job *j, size_t m,
                                                                size_t n, bool two) {
  const size_t am = j->a_m, ak = j->a_k, ldb = j->ldb;
  const float *a = j->A + m * am, *a2 = two ? j->A2 + m * am : a;
  const float *b = j->B + n, *b2 = two ? j->B2 + n : b;
  v4f c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
  for (size_t k = 0; k < j->K; k++, a += ak, a2 += ak, b += ldb, b2 += ldb) {
    v4f b0 = v4_load(b), b1 = v4_load(b + 4);
    v4f x0 = v4_splat(a[0]), x1 = v4_splat(a[am]), x2 = v4_splat(a[2 * am]),
        x3 = v4_splat(a[3 * am]);
    if (two) {
      v4f d0 = v4_load(b2), d1 = v4_load(b2 + 4);
      v4f y0 = v4_splat(a2[0]), y1 = v4_splat(a2[am]), y2 = v4_splat(a2[2 * am]),
          y3 = v4_splat(a2[3 * am]);
      c00 += x0 * b0 + y0 * d0;
      c01 += x0 * b1 + y0 * d1;
      c10 += x1 * b0 + y1 * d0;
      c11 += x1 * b1 + y1 * d1;
      c20 += x2 * b0 + y2 * d0;
      c21 += x2 * b1 + y2 * d1;
      c30 += x3 * b0 + y3 * d0;
      c31 += x3 * b1 + y3 * d1;
    } else {
      c00 += x0 * b0;
      c01 += x0 * b1;
      c10 += x1 * b0;
      c11 += x1 * b1;
      c20 += x2 * b0;
      c21 += x2 * b1;
      c30 += x3 * b0;
      c31 += x3 * b1;
    }
  }
  float *c = j->C + m * j->ldc + n;
  v4_store(c, c00);
  v4_store(c + 4, c01);
  c += j->ldc;
  v4_store(c, c10);
  v4_store(c + 4, c11);
  c += j->ldc;
  v4_store(c, c20);
  v4_store(c + 4, c21);
  c += j->ldc;
  v4_store(c, c30);
  v4_store(c + 4, c31);
}

/* One row by eight columns. */
static inline __attribute__((always_inline)) void gemm_tile_1x8(const gemm_job *j, size_t m,
                                                                size_t n, bool two) {
  const size_t ak = j->a_k, ldb = j->ldb;
  const float *a = j->A + m * j->a_m, *a2 = two ? j->A2 + m * j->a_m : a;
  const float *b = j->B + n, *b2 = two ? j->B2 + n : b;
  v4f c0 = {0}, c1 = {0};
  for (size_t k = 0; k < j->K; k++, a += ak, a2 += ak, b += ldb, b2 += ldb) {
    v4f x = v4_splat(a[0]);
    if (two) {
      v4f y = v4_splat(a2[0]);
      c0 += x * v4_load(b) + y * v4_load(b2);
      c1 += x * v4_load(b + 4) + y * v4_load(b2 + 4);
    } else {
      c0 += x * v4_load(b);
      c1 += x * v4_load(b + 4);
    }
  }
  float *c = j->C + m * j->ldc + n;
  v4_store(c, c0);
  v4_store(c + 4, c1);
}

/* Any rows, columns [n0, n1) one at a time (the ragged right edge). */
static void gemm_scalar(const gemm_job *j, size_t m0, size_t m1, size_t n0, size_t n1) {
  for (size_t m = m0; m < m1; m++)
    for (size_t n = n0; n < n1; n++) {
      const float *a = j->A + m * j->a_m, *b = j->B + n;
      float acc = 0.0f;
      if (j->A2) {
        const float *a2 = j->A2 + m * j->a_m, *b2 = j->B2 + n;
        for (size_t k = 0; k < j->K; k++)
          acc += a[k * j->a_k] * b[k * j->ldb] + a2[k * j->a_k] * b2[k * j->ldb];
      } else {
        for (size_t k = 0; k < j->K; k++) acc += a[k * j->a_k] * b[k * j->ldb];
      }
      j->C[m * j->ldc + n] = acc;
    }
}

static inline __attribute__((always_inline)) void gemm_block(const gemm_job *j, const gemm_task *t,
                                                             bool two) {
  size_t n_full = t->n0 + (t->n1 - t->n0) / 8 * 8;
  for (size_t n = t->n0; n < n_full; n += 8) { /* B panel stays in L1 across rows */
    size_t m = t->m0;
    for (; m + 4 <= t->m1; m += 4) gemm_tile_4x8(j, m, n, two);
    for (; m < t->m1; m++) gemm_tile_1x8(j, m, n, two);
  }
  if (n_full < t->n1) gemm_scalar(j, t->m0, t->m1, n_full, t->n1);
}

typedef struct gemm_batch {
  const gemm_job *jobs;
  const gemm_task *tasks;
} gemm_batch;

static void gemm_tasks(void *p, size_t begin, size_t end) {
  const gemm_batch *g = p;
  for (size_t i = begin; i < end; i++) {
    const gemm_task *t = &g->tasks[i];
    const gemm_job *j = &g->jobs[t->job];
    if (j->A2)
      gemm_block(j, t, true);
    else
      gemm_block(j, t, false);
  }
}

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Runs every job, split into fixed blocks that do not depend on the thread
 * count. */
static mok_status gemm_run(job_env *env, const gemm_job *jobs, size_t n_jobs) {
  size_t n_tasks = 0;
  for (size_t i = 0; i < n_jobs; i++)
    n_tasks += ceil_div(jobs[i].M, GEMM_MB) * ceil_div(jobs[i].N, GEMM_NB);
  if (n_tasks == 0) return MOK_OK;
  gemm_task *tasks = mok__cpu_scratch(env, SCR_GEMM_TASKS, n_tasks * sizeof *tasks);
  if (!tasks) return env->res->status;
  size_t t = 0;
  for (size_t i = 0; i < n_jobs; i++)
    for (size_t m0 = 0; m0 < jobs[i].M; m0 += GEMM_MB)
      for (size_t n0 = 0; n0 < jobs[i].N; n0 += GEMM_NB) {
        size_t m1 = m0 + GEMM_MB < jobs[i].M ? m0 + GEMM_MB : jobs[i].M;
        size_t n1 = n0 + GEMM_NB < jobs[i].N ? n0 + GEMM_NB : jobs[i].N;
        tasks[t++] = (gemm_task){i, m0, m1, n0, n1};
      }
  gemm_batch g = {jobs, tasks};
  mok__cpu_par_for(env, n_tasks, gemm_tasks, &g);
  return MOK_OK;
}

static gemm_job *gemm_jobs(job_env *env, size_t n) {
  return mok__cpu_scratch(env, SCR_GEMM_JOBS, (n ? n : 1) * sizeof(gemm_job));
}

/* ---- FP8 GEMM: K in blocks of 128, each block's sum scaled (docs/math.md) --
 *
 * C[m,n] = Σ_kb (sa[m,kb]·sb(n,kb))·P_kb[m,n], kb ascending from +0, where
 * P_kb[m,n] = Σ_{k in kb} A[m,k]·B[k,n] is the GEMM above on one block (one
 * f32 sum from +0, k ascending). A and B hold decoded e4m3 values, so every
 * product is exact; sb(n,kb) = sb[(n/128)·sb_n + kb·sb_k] reads a weight's
 * 128x128 scales as they serve the matrix or its transpose. */

typedef struct fp8_gemm_job {
  size_t M, N, K;
  const float *A, *sa; /* A[m,k] = A[m*lda + k], sa[m,kb] = sa[m*ld_sa + kb] */
  size_t lda, ld_sa;
  const float *B, *sb; /* B[k,n] = B[k*ldb + n] */
  size_t ldb, sb_n, sb_k;
  float *C, *P; /* [M, ldc] each: the result, one block's partial sums */
  size_t ldc;
} fp8_gemm_job;

typedef struct fp8_accumulate_arg {
  const fp8_gemm_job *jobs;
  const gemm_task *tasks; /* row ranges of jobs (columns unused) */
  size_t kb;
} fp8_accumulate_arg;

static void fp8_accumulate(void *p, size_t i0, size_t i1) {
  const fp8_accumulate_arg *a = p;
  const size_t kb = a->kb;
  for (size_t i = i0; i < i1; i++) {
    const gemm_task *t = &a->tasks[i];
    const fp8_gemm_job *j = &a->jobs[t->job];
    for (size_t m = t->m0; m < t->m1; m++) {
      const float s_a = j->sa[m * j->ld_sa + kb];
      float *c = j->C + m * j->ldc;
      const float *pk = j->P + m * j->ldc;
      for (size_t n = 0; n < j->N; n++) {
        const float scale = s_a * j->sb[(n / MOK_FP8_BLOCK) * j->sb_n + kb * j->sb_k];
        c[n] = (kb ? c[n] : 0.0f) + scale * pk[n];
      }
    }
  }
}

static mok_status fp8_gemm_run(job_env *env, const fp8_gemm_job *jobs, size_t n_jobs) {
  if (n_jobs == 0) return MOK_OK;
  gemm_job *g = mok__cpu_scratch(env, SCR_FP8_GEMM_JOBS, n_jobs * sizeof *g);
  size_t n_tasks = 0;
  for (size_t i = 0; i < n_jobs; i++) n_tasks += ceil_div(jobs[i].M, GEMM_MB);
  gemm_task *tasks = mok__cpu_scratch(env, SCR_FP8_TASKS, (n_tasks ? n_tasks : 1) * sizeof *tasks);
  if (!g || !tasks) return env->res->status;
  size_t t = 0;
  for (size_t i = 0; i < n_jobs; i++)
    for (size_t m0 = 0; m0 < jobs[i].M; m0 += GEMM_MB)
      tasks[t++] = (gemm_task){i, m0, m0 + GEMM_MB < jobs[i].M ? m0 + GEMM_MB : jobs[i].M, 0, 0};
  const size_t n_kb = jobs[0].K / MOK_FP8_BLOCK; /* every job of a call shares K */
  for (size_t kb = 0; kb < n_kb; kb++) {
    for (size_t i = 0; i < n_jobs; i++) {
      const fp8_gemm_job *j = &jobs[i];
      g[i] = (gemm_job){j->M, j->N, MOK_FP8_BLOCK, j->A + kb * MOK_FP8_BLOCK, NULL, j->lda, 1,
                        j->B + kb * MOK_FP8_BLOCK * j->ldb, NULL, j->ldb, j->P, j->ldc};
    }
    mok_status st = gemm_run(env, g, n_jobs);
    if (st != MOK_OK) return st;
    fp8_accumulate_arg acc = {jobs, tasks, kb};
    mok__cpu_par_for(env, n_tasks, fp8_accumulate, &acc);
  }
  return MOK_OK;
}

/* ---- transposes (weights into the layout the GEMMs stream) ----------------- */


typedef struct transpose_arg {
  uint32_t dt;
  const void *src1, *src2; /* [n_w, rows, cols] each, layer dtype */
  size_t rows, cols;       /* of one source matrix */
  float *dst;              /* [n_w, cols, rows (x2 with src2)] */
  const ffn_group *groups; /* weight sets whose group has no rows are skipped */
} transpose_arg;

/* dst[w][c][r] = src1[w][r][c] and, with src2, dst[w][c][rows + r] = src2[w][r][c].
 * Items are output rows (w, c). */
static void transpose_rows(void *p, size_t i0, size_t i1) {
  const transpose_arg *t = p;
  size_t width = t->src2 ? 2 * t->rows : t->rows;
  for (size_t item = i0; item < i1; item++) {
    size_t w = item / t->cols, c = item % t->cols;
    if (t->groups[w].rows == 0) continue; /* idle expert: never read */
    float *d = t->dst + item * width;
    size_t base = w * t->rows * t->cols + c;
    if (t->dt == MOK_DTYPE_F32) {
      const float *s1 = t->src1, *s2 = t->src2;
      for (size_t r = 0; r < t->rows; r++) d[r] = s1[base + r * t->cols];
      if (s2)
        for (size_t r = 0; r < t->rows; r++) d[t->rows + r] = s2[base + r * t->cols];
    } else {
      const mok_bf16 *s1 = t->src1, *s2 = t->src2;
      for (size_t r = 0; r < t->rows; r++) d[r] = mok_bf16_to_f32(s1[base + r * t->cols]);
      if (s2)
        for (size_t r = 0; r < t->rows; r++)
          d[t->rows + r] = mok_bf16_to_f32(s2[base + r * t->cols]);
    }
  }
}

/* ---- SwiGLU pieces, in f32 exactly as docs/math.md writes them ------------ */

static inline float silu_f32(float v) { return v / (1.0f + expf(-v)); }

static inline float dsilu_f32(float v) {
  float s = 1.0f / (1.0f + expf(-v));
  return s * (1.0f + v * (1.0f - s));
}

typedef struct swiglu_clamp {
  bool on;
  float limit;
} swiglu_clamp;

/* NaN stays NaN (no fminf). */
static inline float clamp_gate(swiglu_clamp c, float g) {
  return c.on && g > c.limit ? c.limit : g;
}
static inline float clamp_up(swiglu_clamp c, float u) {
  if (!c.on) return u;
  if (u > c.limit) return c.limit;
  if (u < -c.limit) return -c.limit;
  return u;
}
static inline float pass_gate(swiglu_clamp c, float g) {
  return !c.on || g <= c.limit ? 1.0f : 0.0f;
}
static inline float pass_up(swiglu_clamp c, float u) {
  return !c.on || (u >= -c.limit && u <= c.limit) ? 1.0f : 0.0f;
}

/* ---- a grouped SwiGLU FFN (the routed experts, or the shared expert) -------
 *
 * Rows [row0, row0+rows) of the row buffers use weight set w = the group's
 * index; every other row (padding) is unused. */


static inline bool row_used(const ffn_set *s, size_t r) {
  return !s->row_slot || s->row_slot[r] >= 0;
}

typedef struct zero_rows_arg {
  const ffn_set *set;
  float *buf;
  size_t width;
} zero_rows_arg;

static void zero_unused_rows(void *p, size_t r0, size_t r1) {
  const zero_rows_arg *z = p;
  for (size_t r = r0; r < r1; r++)
    if (!row_used(z->set, r)) memset(z->buf + r * z->width, 0, z->width * sizeof(float));
}

typedef struct fwd_epilogue_arg {
  const ffn_set *set;
  uint32_t dt;
  swiglu_clamp clamp;
  float *gu;            /* [n_rows, 2I]: f32 sums in, rounded g|u out */
  float *h;             /* [n_rows, I] */
  void *acts_g, *acts_u; /* [n_rows, I] layer dtype, or NULL */
} fwd_epilogue_arg;

/* g = rnd(sum), u = rnd(sum) (saved pre-clamp), h = rnd(silu(g')·u'). */
static void fwd_epilogue_rows(void *p, size_t r0, size_t r1) {
  const fwd_epilogue_arg *a = p;
  const size_t I = a->set->I, es = mok_dtype_size(a->dt);
  for (size_t r = r0; r < r1; r++) {
    if (!row_used(a->set, r)) {
      if (a->acts_g) {
        memset((char *)a->acts_g + r * I * es, 0, I * es);
        memset((char *)a->acts_u + r * I * es, 0, I * es);
      }
      continue;
    }
    float *g = a->gu + r * 2 * I, *u = g + I, *h = a->h + r * I;
    for (size_t i = 0; i < I; i++) {
      g[i] = rnd(a->dt, g[i]);
      u[i] = rnd(a->dt, u[i]);
      h[i] = rnd(a->dt, silu_f32(clamp_gate(a->clamp, g[i])) * clamp_up(a->clamp, u[i]));
    }
    if (a->acts_g) {
      store_rnd(a->dt, g, a->acts_g, r * I, I);
      store_rnd(a->dt, u, a->acts_u, r * I, I);
    }
  }
}

static swiglu_clamp layer_clamp(const job_env *env) {
  swiglu_clamp c = {env->cfg->has_limit, env->cfg->swiglu_limit};
  return c;
}

/* ---- the FFN GEMMs of an fp8 layer (docs/math.md, "FP8") ------------------ */

/* The four GEMMs: which weight, and which section of its packed form. Every
 * one reads a K-major [N, K] matrix (mok_layout.h): the forward kinds the
 * weight's e4m3 bytes, the dgrads their transposed copy. */
enum fp8_gemm_kind {
  FP8_GATE_UP_FWD,   /* [x] · [W_gate; W_up]^T: K = H, N = 2I */
  FP8_DOWN_FWD,      /* h · W_down^T: K = I, N = H */
  FP8_DOWN_DGRAD,    /* d_out · W_down: K = H, N = I (W_down's transposed section) */
  FP8_GATE_UP_DGRAD, /* [dg | du] · [W_gate; W_up]: K = 2I, N = H (their transposed sections) */
};

/* C [n_rows, N] = the FP8 GEMM of rows act (| act2, the second half of K)
 * [n_rows, K1], each quantised in 1x128 blocks, with the set's packed
 * weight decoded; rows of each group against its weight set. */
static mok_status fp8_ffn_gemm(job_env *env, const ffn_set *s, enum fp8_gemm_kind kind,
                               const float *act, const float *act2, size_t K1, float *C) {
  const size_t H = env->H, I = s->I, R = s->n_rows, B = MOK_FP8_BLOCK;
  const bool gate_up = kind == FP8_GATE_UP_FWD || kind == FP8_GATE_UP_DGRAD;
  const bool dgrad = kind == FP8_DOWN_DGRAD || kind == FP8_GATE_UP_DGRAD;
  const size_t K = act2 ? 2 * K1 : K1, N = kind == FP8_GATE_UP_FWD ? 2 * I
                                           : kind == FP8_DOWN_DGRAD ? I : H;
  const size_t w_per = (gate_up ? 2 * I : I) * H, s_per = w_per / (B * B);
  float *qa = scratch_f32(env, SCR_FP8_QA, R * K), *sa = scratch_f32(env, SCR_FP8_SA, R * K / B);
  float *wb = scratch_f32(env, SCR_FP8_WB, s->n_w * w_per);
  float *sb = scratch_f32(env, SCR_FP8_SB, s->n_w * s_per);
  float *partial = scratch_f32(env, SCR_FP8_PARTIAL, R * N);
  fp8_gemm_job *jobs = mok__cpu_scratch(env, SCR_GEMM_JOBS, (s->n_w ? s->n_w : 1) * sizeof *jobs);
  if (!qa || !sa || !wb || !sb || !partial || !jobs) return env->res->status;
  mok__cpu_fp8_quantize_rows(env, s, act, R, K1, qa, K, sa, K / B);
  if (act2) mok__cpu_fp8_quantize_rows(env, s, act2, R, K1, qa + K1, K, sa + K1 / B, K / B);

  /* the weight as B[k,n] = B[k*ldb + n] (k the contraction), its scales as
   * they serve it (the dgrads read them transposed) */
  size_t ldb, sb_n, sb_k;
  if (gate_up) { /* [W_gate; W_up]: [2I, H], scales [2I/128, H/128] */
    /* forward: W_up's rows after W_gate's along N; dgrad: along K */
    ldb = dgrad ? H : 2 * I;
    mok__cpu_fp8_unpack(env, s->groups, s->n_w, s->wg, I, H, dgrad, wb, w_per, 0, 0, ldb, sb,
                        s_per, 0);
    mok__cpu_fp8_unpack(env, s->groups, s->n_w, s->wu, I, H, dgrad, wb, w_per, dgrad ? 0 : I,
                        dgrad ? I : 0, ldb, sb, s_per, I / B);
    sb_n = dgrad ? 1 : H / B, sb_k = dgrad ? H / B : 1;
  } else { /* W_down: [H, I], scales [H/128, I/128] */
    ldb = dgrad ? I : H;
    mok__cpu_fp8_unpack(env, s->groups, s->n_w, s->wd, H, I, dgrad, wb, w_per, 0, 0, ldb, sb,
                        s_per, 0);
    sb_n = dgrad ? 1 : I / B, sb_k = dgrad ? I / B : 1;
  }
  size_t n = 0;
  for (size_t w = 0; w < s->n_w; w++) {
    const ffn_group *g = &s->groups[w];
    if (!g->rows) continue;
    jobs[n++] = (fp8_gemm_job){g->rows, N, K, qa + g->row0 * K, sa + g->row0 * (K / B), K, K / B,
                               wb + w * w_per, sb + w * s_per, ldb, sb_n, sb_k,
                               C + g->row0 * N, partial + g->row0 * N, N};
  }
  return fp8_gemm_run(env, jobs, n);
}

/* For each weight set w with rows: C rows = A rows · B[w] (+ A2 rows · B2[w],
 * one sum), A [n_rows, K], B [n_w][K, N] (w_stride floats apart), C
 * [n_rows, N]: the grouped GEMMs of bf16 and f32 layers. */
static mok_status gemm_groups(job_env *env, const ffn_set *s, size_t N, size_t K, const float *A,
                              const float *A2, const float *B, const float *B2, size_t w_stride,
                              float *C) {
  gemm_job *jobs = gemm_jobs(env, s->n_w);
  if (!jobs) return env->res->status;
  size_t n = 0;
  for (size_t w = 0; w < s->n_w; w++) {
    const ffn_group *g = &s->groups[w];
    if (!g->rows) continue;
    jobs[n++] = (gemm_job){g->rows, N, K, A + g->row0 * K, A2 ? A2 + g->row0 * K : NULL, K, 1,
                           B + w * w_stride, B2 ? B2 + w * w_stride : NULL, N, C + g->row0 * N,
                           N};
  }
  return gemm_run(env, jobs, n);
}

/* gu [n_rows, 2I] = x rows · [W_gate; W_up]^T, f32 sums (bf16 and f32 layers). */
static mok_status gate_up_gemm(job_env *env, const ffn_set *s, const float *X, float *gu) {
  const size_t H = env->H, I = s->I;
  float *wgu_t = scratch_f32(env, SCR_W1, s->n_w * H * 2 * I);
  if (!wgu_t) return env->res->status;
  /* gate and up side by side: wgu_t[w] = [H, 2I] */
  transpose_arg tr = {env->dtype, s->wg, s->wu, I, H, wgu_t, s->groups};
  mok__cpu_par_for(env, s->n_w * H, transpose_rows, &tr);
  return gemm_groups(env, s, 2 * I, H, X, NULL, wgu_t, NULL, H * 2 * I, gu);
}

/* Y [n_rows, H] = h rows · W_down^T (bf16 and f32 layers). */
static mok_status down_gemm(job_env *env, const ffn_set *s, const float *hm, float *Y) {
  const size_t H = env->H, I = s->I;
  float *wd_t = scratch_f32(env, SCR_W2, s->n_w * I * H);
  if (!wd_t) return env->res->status;
  transpose_arg td = {env->dtype, s->wd, NULL, H, I, wd_t, s->groups};
  mok__cpu_par_for(env, s->n_w * I, transpose_rows, &td);
  return gemm_groups(env, s, H, I, hm, NULL, wd_t, NULL, I * H, Y);
}

/* compute: x rows -> acts (g, u) and, when y != NULL, y rows. */
static mok_status ffn_forward(job_env *env, const ffn_set *s, const void *x, void *acts_g,
                              void *acts_u, void *y) {
  const size_t H = env->H, I = s->I;
  const float *X = f32_in(env, SCR_X, x, s->n_rows * H);
  float *gu = scratch_f32(env, SCR_GU, s->n_rows * 2 * I);
  float *hm = scratch_f32(env, SCR_H, s->n_rows * I);
  if (!X || !gu || !hm) return env->res->status;
  mok_status st = env->fp8 ? fp8_ffn_gemm(env, s, FP8_GATE_UP_FWD, X, NULL, H, gu)
                           : gate_up_gemm(env, s, X, gu);
  if (st != MOK_OK) return st;

  fwd_epilogue_arg ep = {s, env->dtype, layer_clamp(env), gu, hm, acts_g, acts_u};
  mok__cpu_par_for(env, s->n_rows, fwd_epilogue_rows, &ep);
  if (!y) return MOK_OK;

  float *Y = f32_out(env, SCR_OUT1, y, s->n_rows * H);
  if (!Y) return env->res->status;
  st = env->fp8 ? fp8_ffn_gemm(env, s, FP8_DOWN_FWD, hm, NULL, I, Y) : down_gemm(env, s, hm, Y);
  if (st != MOK_OK) return st;
  zero_rows_arg z = {s, Y, H};
  mok__cpu_par_for(env, s->n_rows, zero_unused_rows, &z);
  f32_out_finish(env, Y, y, s->n_rows * H);
  return MOK_OK;
}

typedef struct bwd_epilogue_arg {
  const ffn_set *set;
  uint32_t dt;
  swiglu_clamp clamp;
  const void *acts_g, *acts_u; /* [n_rows, I] layer dtype */
  const float *a;              /* [n_rows, I] = d_out rows · w_down */
  const float *rw_row;         /* router weight per row; NULL: 1 (shared expert) */
  float *dg, *du, *h;          /* [n_rows, I]; h leaves as rw·h (the down wgrad's operand) */
  float *drw_row;              /* per row, or NULL */
} bwd_epilogue_arg;

/* Per used row: h recomputed as in compute, d_rw = Σ_i a·h, dg, du, then
 * h~ = rnd(rw·h) in h's place: d_w_down = Σ_r d_out_r·h~_r. */
static void bwd_epilogue_rows(void *p, size_t r0, size_t r1) {
  const bwd_epilogue_arg *a = p;
  const size_t I = a->set->I;
  const swiglu_clamp c = a->clamp;
  for (size_t r = r0; r < r1; r++) {
    if (!row_used(a->set, r)) {
      if (a->drw_row) a->drw_row[r] = 0.0f;
      continue;
    }
    float *dg = a->dg + r * I, *du = a->du + r * I, *h = a->h + r * I;
    const float *ar = a->a + r * I;
    load_f32(a->dt, a->acts_g, r * I, I, dg); /* g and u first, overwritten in place */
    load_f32(a->dt, a->acts_u, r * I, I, du);
    const float rw = a->rw_row ? a->rw_row[r] : 1.0f;
    float drw = 0.0f;
    for (size_t i = 0; i < I; i++) {
      const float g = dg[i], u = du[i];
      const float gc = clamp_gate(c, g), uc = clamp_up(c, u);
      const float s = silu_f32(gc);
      h[i] = rnd(a->dt, s * uc);
      drw += ar[i] * h[i];
      const float dh = a->rw_row ? rw * ar[i] : ar[i];
      dg[i] = rnd(a->dt, dh * uc * dsilu_f32(gc) * pass_gate(c, g));
      du[i] = rnd(a->dt, dh * s * pass_up(c, u));
      if (a->rw_row) h[i] = rnd(a->dt, rw * h[i]);
    }
    if (a->drw_row) a->drw_row[r] = drw;
  }
}

/* A [n_rows, I] = d_out rows · W_down (bf16 and f32 layers). */
static mok_status down_dgrad_gemm(job_env *env, const ffn_set *s, const float *DO, float *A) {
  const size_t H = env->H, I = s->I;
  const float *wd = f32_in(env, SCR_W1, s->wd, s->n_w * H * I);
  if (!wd) return env->res->status;
  return gemm_groups(env, s, I, H, DO, NULL, wd, NULL, H * I, A);
}

/* DX [n_rows, H] = dg · W_gate + du · W_up, one sum over i (bf16 and f32 layers). */
static mok_status gate_up_dgrad_gemm(job_env *env, const ffn_set *s, const float *dg,
                                     const float *du, float *DX) {
  const size_t H = env->H, I = s->I;
  const float *wg = f32_in(env, SCR_W2, s->wg, s->n_w * I * H);
  const float *wu = f32_in(env, SCR_W3, s->wu, s->n_w * I * H);
  if (!wg || !wu) return env->res->status;
  return gemm_groups(env, s, H, I, dg, du, wg, wu, I * H, DX);
}

/* compute_backward of one FFN: rows of dx, per-row d_rw, weight gradients
 * (every weight set written; an idle one gets zeros). An fp8 layer's two
 * dgrad GEMMs are FP8 GEMMs; its weight gradients are the same bf16 GEMMs
 * on the unquantised operands. */
static mok_status ffn_backward(job_env *env, const ffn_set *s, const void *x, const void *acts_g,
                               const void *acts_u, const void *dout, const float *rw_row, void *dx,
                               float *drw_row, void *d_wg, void *d_wu, void *d_wd) {
  const size_t H = env->H, I = s->I, R = s->n_rows;
  const float *DO = f32_in(env, SCR_DO, dout, R * H);
  float *A = scratch_f32(env, SCR_A, R * I);
  float *dg = scratch_f32(env, SCR_DG, R * I), *du = scratch_f32(env, SCR_DU, R * I);
  float *hm = scratch_f32(env, SCR_H, R * I);
  if (!DO || !A || !dg || !du || !hm) return env->res->status;

  /* a = d_out · w_down  ([rows,H] x [H,I]) */
  mok_status st = env->fp8 ? fp8_ffn_gemm(env, s, FP8_DOWN_DGRAD, DO, NULL, H, A)
                           : down_dgrad_gemm(env, s, DO, A);
  if (st != MOK_OK) return st;

  bwd_epilogue_arg ep = {s, env->dtype, layer_clamp(env), acts_g, acts_u, A, rw_row,
                         dg, du, hm, drw_row};
  mok__cpu_par_for(env, R, bwd_epilogue_rows, &ep);

  /* dx = dg · w_gate + du · w_up, one sum over i (fp8: over [dg | du]'s blocks) */
  float *DX = f32_out(env, SCR_OUT1, dx, R * H);
  if (!DX) return env->res->status;
  st = env->fp8 ? fp8_ffn_gemm(env, s, FP8_GATE_UP_DGRAD, dg, du, I, DX)
                : gate_up_dgrad_gemm(env, s, dg, du, DX);
  if (st != MOK_OK) return st;
  zero_rows_arg z = {s, DX, H};
  mok__cpu_par_for(env, R, zero_unused_rows, &z);
  f32_out_finish(env, DX, dx, R * H);

  /* weight gradients: sums over the group's rows, ascending */
  const float *X = f32_in(env, SCR_X, x, R * H);
  float *dWd = f32_out(env, SCR_OUT1, d_wd, s->n_w * H * I);
  float *dWg = f32_out(env, SCR_OUT2, d_wg, s->n_w * I * H);
  float *dWu = f32_out(env, SCR_OUT3, d_wu, s->n_w * I * H);
  gemm_job *jobs = gemm_jobs(env, 3 * s->n_w);
  if (!X || !dWd || !dWg || !dWu || !jobs) return env->res->status;
  size_t n = 0;
  for (size_t w = 0; w < s->n_w; w++) {
    const ffn_group *g = &s->groups[w];
    size_t r0 = g->row0, k = g->rows;
    jobs[n++] = (gemm_job){H, I, k, DO + r0 * H, NULL, 1, H, hm + r0 * I, NULL, I,
                           dWd + w * H * I, I};
    jobs[n++] = (gemm_job){I, H, k, dg + r0 * I, NULL, 1, I, X + r0 * H, NULL, H,
                           dWg + w * I * H, H};
    jobs[n++] = (gemm_job){I, H, k, du + r0 * I, NULL, 1, I, X + r0 * H, NULL, H,
                           dWu + w * I * H, H};
  }
  st = gemm_run(env, jobs, n);
  if (st != MOK_OK) return st;
  f32_out_finish(env, dWd, d_wd, s->n_w * H * I);
  f32_out_finish(env, dWg, d_wg, s->n_w * I * H);
  f32_out_finish(env, dWu, d_wu, s->n_w * I * H);
  return MOK_OK;
}

/* ---- the steps ------------------------------------------------------------- */

static void *tensor(const job_env *env, int slot) { return env->tensors[slot]; }

static mok_status routed_set(job_env *env, const mok_sched_view *v, ffn_set *ret) {
  ffn_group *groups = mok__cpu_scratch(env, SCR_GROUPS, env->E_loc * sizeof *groups);
  if (!groups) return env->res->status;
  for (size_t e = 0; e < env->E_loc; e++)
    groups[e] = (ffn_group){(size_t)v->offsets[e], (size_t)v->counts[e]};
  *ret = (ffn_set){env->rows_cap, env->E_loc, groups, v->row_slot, env->I,
                   tensor(env, MOK_SLOT_W_GATE), tensor(env, MOK_SLOT_W_UP),
                   tensor(env, MOK_SLOT_W_DOWN)};
  return MOK_OK;
}

static ffn_set shared_set(const job_env *env, const ffn_group *one_group) {
  return (ffn_set){env->T, 1, one_group, NULL, env->Is, tensor(env, MOK_SLOT_S_GATE),
                   tensor(env, MOK_SLOT_S_UP), tensor(env, MOK_SLOT_S_DOWN)};
}

typedef struct gather_arg {
  const mok_sched_view *v;
  const char *src; /* [T,H] */
  char *dst;       /* [R_cap,H] */
  size_t row_bytes;
} gather_arg;

static void gather_rows_fn(void *p, size_t r0, size_t r1) {
  const gather_arg *g = p;
  for (size_t r = r0; r < r1; r++) {
    int32_t slot = g->v->row_slot[r];
    char *d = g->dst + r * g->row_bytes;
    if (slot < 0)
      memset(d, 0, g->row_bytes);
    else
      memcpy(d, g->src + (size_t)slot / g->v->topk * g->row_bytes, g->row_bytes);
  }
}

/* routed[r] = src[t of row r] (exact copy), padding rows zero: the data
 * movement of dispatch and of combine_backward. */
void mok__cpu_gather_rows(job_env *env, const mok_sched_view *v, const void *src, void *routed) {
  gather_arg g = {v, src, routed, env->H * env->es};
  mok__cpu_par_for(env, env->rows_cap, gather_rows_fn, &g);
}

/* The schedule of ids, as docs/math.md builds it: the ids are copied into
 * scratch first and read only there (the client may change its buffer at
 * any moment), the schedule is built in scratch and copied out to out (a
 * client buffer: written, never read back) when out != NULL. *ret views
 * the daemon's copy, which is all that later steps read. */
mok_status mok__cpu_schedule_build(job_env *env, const int32_t *ids, int32_t *out,
                                   mok_sched_view *ret) {
  size_t n_ids = (size_t)(env->dims.tokens * env->dims.topk);
  size_t ints = (size_t)mok_schedule_ints(&env->dims);
  int32_t *ids_copy = mok__cpu_scratch(env, SCR_IDS, n_ids * sizeof(int32_t));
  int32_t *sched = mok__cpu_scratch(env, SCR_SCHED, ints * sizeof(int32_t));
  if (!ids_copy || !sched) return env->res->status;
  memcpy(ids_copy, ids, n_ids * sizeof(int32_t));
  char msg[MOK_JOB_MESSAGE_MAX];
  mok_status st = mok_schedule_build(&env->shape, ids_copy, sched, ints, msg, sizeof msg);
  if (st != MOK_OK) return mok__cpu_job_fail(env, st, "%s", msg);
  if (out) memcpy(out, sched, ints * sizeof(int32_t));
  *ret = mok_schedule_view(&env->shape, sched);
  return MOK_OK;
}

/* A schedule the client brought (a ctx, a single step's input): copied into
 * scratch once, the copy validated, *ret a view of the copy. */
mok_status mok__cpu_schedule_in(job_env *env, const void *sched, mok_sched_view *ret) {
  size_t ints = (size_t)mok_schedule_ints(&env->dims);
  int32_t *copy = mok__cpu_scratch(env, SCR_SCHED, ints * sizeof(int32_t));
  if (!copy) return env->res->status;
  memcpy(copy, sched, ints * sizeof(int32_t));
  char msg[MOK_JOB_MESSAGE_MAX];
  mok_status st = mok_schedule_validate(&env->shape, copy, ints, msg, sizeof msg);
  if (st != MOK_OK) return mok__cpu_job_fail(env, st, "%s", msg);
  *ret = mok_schedule_view(&env->shape, copy);
  return MOK_OK;
}

/* dispatch: the schedule (copied out to sched_out when given) and the
 * routed rows; *ret views the daemon's schedule. */
mok_status mok__cpu_step_dispatch(job_env *env, const void *x, const int32_t *ids,
                                  int32_t *sched_out, void *routed_x, mok_sched_view *ret) {
  mok_status st = mok__cpu_schedule_build(env, ids, sched_out, ret);
  if (st != MOK_OK) return st;
  mok__cpu_gather_rows(env, ret, x, routed_x);
  return MOK_OK;
}

typedef struct acts_layout {
  char *g_routed, *u_routed, *g_shared, *u_shared;
} acts_layout;

static acts_layout acts_split(const job_env *env, const void *acts) {
  acts_layout a = {0};
  if (!acts) return a;
  uint64_t routed = mok_acts_routed_bytes(&env->dims), shared = mok_acts_shared_bytes(&env->dims);
  a.g_routed = (char *)acts;
  a.u_routed = a.g_routed + routed;
  a.g_shared = a.u_routed + routed;
  a.u_shared = a.g_shared + shared;
  return a;
}

/* The bytes between each acts array's end and its 256-byte boundary. */
static void acts_zero_padding(const job_env *env, const acts_layout *a) {
  size_t routed_used = env->rows_cap * env->I * env->es, shared_used = env->T * env->Is * env->es;
  size_t routed = mok_acts_routed_bytes(&env->dims), shared = mok_acts_shared_bytes(&env->dims);
  memset(a->g_routed + routed_used, 0, routed - routed_used);
  memset(a->u_routed + routed_used, 0, routed - routed_used);
  memset(a->g_shared + shared_used, 0, shared - shared_used);
  memset(a->u_shared + shared_used, 0, shared - shared_used);
}

/* compute. routed_y / shared_y may be NULL (recompute needs only acts). */
mok_status mok__cpu_step_compute(job_env *env, const mok_sched_view *v, const void *routed_x,
                                 const void *x, void *routed_y, void *shared_y, void *acts) {
  acts_layout a = acts_split(env, acts);
  if (acts) acts_zero_padding(env, &a);
  ffn_set rs;
  mok_status st = routed_set(env, v, &rs);
  if (st == MOK_OK) st = ffn_forward(env, &rs, routed_x, a.g_routed, a.u_routed, routed_y);
  if (st != MOK_OK || env->Is == 0 || (!shared_y && !acts)) return st;
  ffn_group all_tokens = {0, env->T};
  ffn_set ss = shared_set(env, &all_tokens);
  return ffn_forward(env, &ss, x, a.g_shared, a.u_shared, shared_y);
}

typedef struct reduce_arg {
  const job_env *env;
  const mok_sched_view *v;
  const void *rows;  /* [R_cap,H] layer dtype */
  const float *rw;   /* [T,K]; NULL: plain sum */
  const void *base;  /* [T,H] start value, or NULL for 0 */
  void *out;         /* [T,H] */
} reduce_arg;

#define REDUCE_CHUNK 256u

/* out[t] = rnd(base[t] + Σ_k (rw[t,k]·rows[slot_row[t,k]])), k ascending,
 * local slots only: combine (with rw) and dispatch_backward (without). */
static void reduce_tokens(void *p, size_t t0, size_t t1) {
  const reduce_arg *a = p;
  const uint32_t dt = a->env->dtype;
  const size_t H = a->env->H, K = a->v->topk;
  float acc[REDUCE_CHUNK], row[REDUCE_CHUNK];
  for (size_t t = t0; t < t1; t++)
    for (size_t j0 = 0; j0 < H; j0 += REDUCE_CHUNK) {
      size_t n = H - j0 < REDUCE_CHUNK ? H - j0 : REDUCE_CHUNK;
      if (a->base)
        load_f32(dt, a->base, t * H + j0, n, acc);
      else
        memset(acc, 0, n * sizeof(float));
      for (size_t k = 0; k < K; k++) {
        int32_t r = a->v->slot_row[t * K + k];
        if (r < 0) continue;
        load_f32(dt, a->rows, (size_t)r * H + j0, n, row);
        if (a->rw) {
          const float w = a->rw[t * K + k];
          for (size_t j = 0; j < n; j++) acc[j] = acc[j] + w * row[j];
        } else {
          for (size_t j = 0; j < n; j++) acc[j] = acc[j] + row[j];
        }
      }
      store_rnd(dt, acc, a->out, t * H + j0, n);
    }
}

mok_status mok__cpu_step_combine(job_env *env, const mok_sched_view *v, const void *routed_y,
                                 const float *rw, const void *shared_y, void *out) {
  reduce_arg a = {env, v, routed_y, rw, shared_y, out};
  mok__cpu_par_for(env, env->T, reduce_tokens, &a);
  return MOK_OK;
}

mok_status mok__cpu_step_dispatch_bwd(job_env *env, const mok_sched_view *v, const void *routed_dx,
                                      const void *shared_dx, void *d_x) {
  reduce_arg a = {env, v, routed_dx, NULL, shared_dx, d_x};
  mok__cpu_par_for(env, env->T, reduce_tokens, &a);
  return MOK_OK;
}

mok_status mok__cpu_step_compute_bwd(job_env *env, const mok_sched_view *v, const void *acts,
                                     const void *routed_x, const void *routed_dout, const float *rw,
                                     const void *x, const void *d_out, void *routed_dx, float *d_rw,
                                     void *shared_dx) {
  const size_t R = env->rows_cap, n_slots = env->T * env->K;
  float *rw_row = scratch_f32(env, SCR_RW_ROW, R);
  float *drw_row = scratch_f32(env, SCR_DRW_ROW, R);
  if (!rw_row || !drw_row) return env->res->status;
  for (size_t r = 0; r < R; r++) rw_row[r] = v->row_slot[r] >= 0 ? rw[v->row_slot[r]] : 0.0f;

  acts_layout a = acts_split(env, acts);
  ffn_set rs;
  mok_status st = routed_set(env, v, &rs);
  if (st == MOK_OK)
    st = ffn_backward(env, &rs, routed_x, a.g_routed, a.u_routed, routed_dout, rw_row, routed_dx,
                      drw_row, tensor(env, MOK_SLOT_D_W_GATE), tensor(env, MOK_SLOT_D_W_UP),
                      tensor(env, MOK_SLOT_D_W_DOWN));
  if (st != MOK_OK) return st;
  for (size_t i = 0; i < n_slots; i++)
    d_rw[i] = v->slot_row[i] >= 0 ? drw_row[v->slot_row[i]] : 0.0f;
  if (env->Is == 0) return MOK_OK;
  ffn_group all_tokens = {0, env->T};
  ffn_set ss = shared_set(env, &all_tokens);
  return ffn_backward(env, &ss, x, a.g_shared, a.u_shared, d_out, NULL, shared_dx, NULL,
                      tensor(env, MOK_SLOT_D_S_GATE), tensor(env, MOK_SLOT_D_S_UP),
                      tensor(env, MOK_SLOT_D_S_DOWN));
}

/* The shared expert alone, over env->T tokens: exactly the shared-expert
 * calls of mok__cpu_step_compute and mok__cpu_step_compute_bwd. */
mok_status mok__cpu_shared_forward(job_env *env, const void *x, void *acts_g, void *acts_u,
                                   void *shared_y) {
  ffn_group all_tokens = {0, env->T};
  ffn_set ss = shared_set(env, &all_tokens);
  return ffn_forward(env, &ss, x, acts_g, acts_u, shared_y);
}

mok_status mok__cpu_shared_backward(job_env *env, const void *x, const void *acts_g,
                                    const void *acts_u, const void *d_out, void *shared_dx) {
  ffn_group all_tokens = {0, env->T};
  ffn_set ss = shared_set(env, &all_tokens);
  return ffn_backward(env, &ss, x, acts_g, acts_u, d_out, NULL, shared_dx, NULL,
                      tensor(env, MOK_SLOT_D_S_GATE), tensor(env, MOK_SLOT_D_S_UP),
                      tensor(env, MOK_SLOT_D_S_DOWN));
}
