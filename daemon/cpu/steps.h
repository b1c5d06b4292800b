/* SPDX-License-Identifier: Apache-2.0 */
/* The cpu engine's steps, shared by its whole-layer ops (cpu/engine.c) and
 * its expert-parallel path (cpu/ep.c): both call the same functions, so
 * they give the same bits. Internal to the cpu engine (mok__cpu_ prefix).
 * Every step runs on one job's scratch; a failure fills env->res and
 * returns its status.
 */
#ifndef MOK_CPU_STEPS_H
#define MOK_CPU_STEPS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cpu/pool.h"
#include "engine.h"
#include "schedule.h"

/* Scratch buffers, cached and grown; one purpose per id within a job. */
enum scratch_id {
  /* daemon copies of what the client gave that steers addresses: the
   * routing ids and the schedule (copied once, checked, then used; the
   * client's buffers are only ever written after that) */
  SCR_IDS,
  SCR_SCHED,
  /* whole-layer buffers (layer dtype or raw bytes) */
  SCR_LAYER_CTX,
  SCR_LAYER_ROUTED_X,
  SCR_LAYER_ROUTED_Y,
  SCR_LAYER_SHARED_Y,
  SCR_LAYER_ROUTED_DOUT,
  SCR_LAYER_ROUTED_DX,
  SCR_LAYER_SHARED_DX,
  /* step temporaries (f32 unless noted) */
  SCR_X,
  SCR_DO,
  SCR_W1,
  SCR_W2,
  SCR_W3,
  SCR_GU,
  SCR_A,
  SCR_H,
  SCR_DG,
  SCR_DU,
  SCR_OUT1,
  SCR_OUT2,
  SCR_OUT3,
  SCR_RW_ROW,
  SCR_DRW_ROW,
  SCR_GROUPS,
  SCR_GEMM_JOBS,
  SCR_GEMM_TASKS,
  /* fp8 layers (docs/math.md, "FP8"): operands as decoded e4m3 values (f32)
   * and their block scales */
  SCR_FP8_QA,
  SCR_FP8_SA,
  SCR_FP8_WB,
  SCR_FP8_SB,
  SCR_FP8_PARTIAL,
  SCR_FP8_GEMM_JOBS,
  SCR_FP8_TASKS,
  /* expert-parallel jobs (cpu/ep.c) */
  SCR_EP_OWN_IDS, /* the daemon's copy of the rank's own routing ids */
  SCR_EP_SLOT_ROW,
  SCR_EP_DRW,
  SCR_EP_RING_ACTS, /* a macrobatch's g and u rows */
  SCR_EP_MB_OFFSETS,
  SCR_EP_MB_SLOT_ROW,
  SCR_EP_MB_DRW,
  SCR_COUNT_
};

typedef struct cpu_scratch_buf {
  void *ptr;
  size_t cap;
} cpu_scratch_buf;

/* The scratch of one job at a time: a session's (its jobs run in order on
 * its runner), or the engine's own for direct run() calls. */
typedef struct cpu_scratch_set {
  cpu_scratch_buf buf[SCR_COUNT_];
  _Atomic uint64_t bytes; /* held, for stats (read by the engine thread) */
} cpu_scratch_set;

/* Everything a job's functions need, resolved once. */
typedef struct job_env {
  mok_engine *eng;
  cpu_scratch_set *scr;
  const mok_job_args *args;
  const mok_layer_config *cfg;
  mok_engine_result *res;
  const char *op_name;
  uint32_t dtype; /* dtype of activations and gradients (mok_layer_act_dtype) */
  size_t es;      /* its size in bytes */
  bool fp8;       /* an fp8 layer: packed weights, FP8 GEMMs (cpu/fp8.c) */
  uint32_t quant_source; /* quantize_weight: the source weight's slot */
  size_t T, H, I, Is, K, E_loc;
  size_t rows_cap; /* R_cap */
  mok_layout_dims dims;
  mok_sched_shape shape;
  void *tensors[MOK_SLOT_COUNT_]; /* resolved by check_tensors() */
} job_env;

/* Rows [row0, row0+rows) of a row buffer that use one weight set. */
typedef struct ffn_group {
  size_t row0, rows;
} ffn_group;

typedef struct ffn_set {
  size_t n_rows;           /* rows of the row buffers */
  size_t n_w;              /* weight sets = groups */
  const ffn_group *groups; /* [n_w] */
  const int32_t *row_slot; /* row used iff row_slot[r] >= 0; NULL: all used */
  size_t I;                /* intermediate of these weights */
  const void *wg, *wu;     /* [n_w, I, H] layer dtype (fp8 layers: packed, mok_wire.h) */
  const void *wd;          /* [n_w, H, I] */
} ffn_set;

/* Where the last expert-parallel forward of an engine spent its time
 * (benchmarks: tests/bench/bench_ep_cpu.c asks mok__cpu_ep_last_timing).
 * rows: routed rows pulled and pushed, row_bytes each. */
typedef struct mok_ep_cpu_timing {
  uint64_t copy_in_ns, barrier1_ns, pull_ns, compute_ns, push_ns, barrier2_ns, local_ns;
  uint64_t rows, row_bytes;
} mok_ep_cpu_timing;

struct mok_engine {
  cpu_pool *pool; /* shared by every session's runner (cpu/pool.h) */
  char description[64];
  cpu_scratch_set direct; /* run() without a session (tools, tests) */
  /* scratch of every set together may not pass the limit: a job that would
   * fails with ENOMEM (only that job) instead of mokd running out of memory */
  _Atomic uint64_t scratch_total;
  uint64_t scratch_limit;
  uint32_t idle_ms; /* a session's scratch unused this long is given back */
  void (*wake)(void *);
  void *wake_arg;
  mok_ep_cpu_timing ep_timing; /* written by expert-parallel forwards (cpu/ep.c) */
};

/* ---- cpu/engine.c ------------------------------------------------------- */

/* job_env for a job (layer checks, tensors resolved for args->op). */
mok_status mok__cpu_env_init(job_env *env, mok_engine *e, const mok_job_args *a,
                             mok_engine_result *res);
__attribute__((format(printf, 3, 4))) mok_status mok__cpu_job_fail(job_env *env, mok_status st,
                                                                   const char *fmt, ...);
void *mok__cpu_scratch(job_env *env, int id, size_t bytes);
void mok__cpu_par_for(job_env *env, size_t n, void (*fn)(void *, size_t, size_t), void *arg);

/* ---- cpu/steps.c -------------------------------------------------------- */

/* dispatch: the schedule of ids (copied out to sched_out when given) and the
 * routed rows; *ret views the daemon's schedule. */
mok_status mok__cpu_step_dispatch(job_env *env, const void *x, const int32_t *ids,
                                  int32_t *sched_out, void *routed_x, mok_sched_view *ret);
/* routed[r] = src[token of row r], padding rows 0 (dispatch's data movement). */
void mok__cpu_gather_rows(job_env *env, const mok_sched_view *v, const void *src, void *routed);
/* compute on routed rows (and the shared expert when env->Is > 0). */
mok_status mok__cpu_step_compute(job_env *env, const mok_sched_view *v, const void *routed_x,
                                 const void *x, void *routed_y, void *shared_y, void *acts);
/* out[t] = rnd(shared_y[t] + sum_k rw[t,k] * rows[slot_row[t,k]]), k ascending. */
mok_status mok__cpu_step_combine(job_env *env, const mok_sched_view *v, const void *routed_y,
                                 const float *rw, const void *shared_y, void *out);
/* d_x[t] = rnd(shared_dx[t] + sum_k rows[slot_row[t,k]]), k ascending. */
mok_status mok__cpu_step_dispatch_bwd(job_env *env, const mok_sched_view *v, const void *routed_dx,
                                      const void *shared_dx, void *d_x);
mok_status mok__cpu_step_compute_bwd(job_env *env, const mok_sched_view *v, const void *acts,
                                     const void *routed_x, const void *routed_dout, const float *rw,
                                     const void *x, const void *d_out, void *routed_dx, float *d_rw,
                                     void *shared_dx);
/* The shared expert alone, over env->T tokens (forward; backward). */
mok_status mok__cpu_shared_forward(job_env *env, const void *x, void *acts_g, void *acts_u,
                                   void *shared_y);
mok_status mok__cpu_shared_backward(job_env *env, const void *x, const void *acts_g,
                                    const void *acts_u, const void *d_out, void *shared_dx);
/* A schedule the engine did not write: copied into scratch once, the copy
 * validated against env->shape, *ret a view of the copy (the client may
 * change its buffer meanwhile: nothing reads it again). */
mok_status mok__cpu_schedule_in(job_env *env, const void *sched, mok_sched_view *ret);
/* The schedule of ids (copied into scratch first, then read only there),
 * built in scratch, *ret a view of it; copied out to out (a client buffer,
 * written, never read back) unless out is NULL. */
mok_status mok__cpu_schedule_build(job_env *env, const int32_t *ids, int32_t *out,
                                   mok_sched_view *ret);

/* ---- cpu/fp8.c: the e4m3 format's side of fp8 layers (docs/math.md, "FP8") ---- */

/* quantize_weight: the bf16 weight in env->quant_source -> its packed form. */
mok_status mok__cpu_op_quantize_weight(job_env *env);
/* A quantising forward (MOK_JOB_QUANTIZE_WEIGHTS): every weight's bf16 master
 * into its packed form in PACKED_WEIGHT (mok_packed_weights_offset), then
 * env->tensors' weight slots point at those forms for the rest of the job. */
mok_status mok__cpu_fp8_quantize_weights(job_env *env);
/* Rows of src [rows, K] (f32 holding bf16 values; K a multiple of 128),
 * each 1x128 block quantised: q [rows, ld_q] the decoded e4m3 values, s
 * [rows, ld_s] the scales. Unused rows of set (set may be NULL: all used) get
 * zeros. */
void mok__cpu_fp8_quantize_rows(job_env *env, const ffn_set *set, const float *src, size_t rows,
                                size_t K, float *q, size_t ld_q, float *s, size_t ld_s);
/* One e4m3 section of a packed weight [n_w, N, K] decoded into dst as a
 * GEMM's K-major operand: the first section [N, K] (transposed false) or
 * the transposed one [K, N]; the section's rows are the GEMM's output
 * columns, its columns the contraction, and element (r, c) of matrix w goes
 * to dst[w*w_stride + (k0 + c)*ld + n0 + r]. The weight's scales [N/128,
 * K/128] (the one scales section) are copied to scales + w*s_stride +
 * s_row0*(K/128). Weight sets whose group has no rows are skipped. */
void mok__cpu_fp8_unpack(job_env *env, const ffn_group *groups, size_t n_w, const void *packed,
                         size_t N, size_t K, bool transposed, float *dst, size_t w_stride,
                         size_t n0, size_t k0, size_t ld, float *scales, size_t s_stride,
                         size_t s_row0);

/* ---- cpu/ep.c ----------------------------------------------------------- */

/* The expert-parallel job: forward or backward of a group layer. */
struct mok_ep_group;
void mok__cpu_run_group(mok_engine *e, struct mok_ep_group *g, const mok_job_args *a,
                        mok_engine_result *res);
/* The timing of e's last expert-parallel forward. */
const mok_ep_cpu_timing *mok__cpu_ep_last_timing(const mok_engine *e);

#endif /* MOK_CPU_STEPS_H */
