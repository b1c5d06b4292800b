/* SPDX-License-Identifier: Apache-2.0 */
/* mok kernels: the sm_90a CUDA kernels of one MoE layer, behind a C API.
 *
 * Plain C (C11 or C++), no CUDA headers needed: the engine (daemon/
 * cuda/engine.c) calls these launchers with device pointers and a stream.
 * The math and its rounding points are docs/math.md; the schedule, acts
 * and ctx layouts are proto/mok_wire.h. bf16 layers, and fp8 layers on Hopper.
 *
 * Conventions of every launcher:
 *  - It only enqueues work on `stream`: no host reads of device values, no
 *    synchronisation. Grids are sized from the host-known dims (the job's
 *    T and the layer), so a job can be captured in a CUDA graph.
 *  - `status` is one int32 on the device, 0 at the start of the job. A
 *    kernel that finds bad input (a routing id outside [0,E) and not -1, a
 *    corrupt client schedule) raises it to a mok_status code with an
 *    atomic max (so the reported code does not depend on timing) and never
 *    traps or reads or writes out of bounds. Every kernel that consumes a
 *    schedule returns at once when *status is nonzero, so after a failed
 *    build or validate the remaining kernels of the job do nothing. The
 *    engine reads the word when the job completes.
 *  - The return value is a mok_status for the launch itself: MOK_OK,
 *    MOK_EINVAL (dims unsupported, a pointer not 16-byte aligned, a
 *    required pointer NULL) or MOK_EENGINE (the CUDA launch failed; see
 *    mok_k_last_cuda_error()).
 *  - Every tensor pointer must be 16-byte aligned (the kernels move rows in
 *    16-byte vectors). Tensors are row-major with the shapes of
 *    docs/math.md; "R" below is the row capacity mok_k_rows_capacity().
 *  - Deterministic: no float atomics; every output element has one owner
 *    and a fixed summation order, so results are bitwise repeatable.
 *  - The products on CUTLASS (kernels/cutlass_gemm/) also take their
 *    groups' arguments and CUTLASS's workspace, tens of KB, from the
 *    device's default memory pool on `stream` (cudaMallocAsync, freed by
 *    cudaFreeAsync behind the launch): stream-ordered, no synchronisation.
 *  - `workspace` is device scratch of mok_k_workspace_bytes(dims) bytes
 *    (16-byte aligned). Launchers that take it use it only while their own
 *    kernels run (stream order), so one workspace serves a whole chain on
 *    one stream; two streams running at once need one each.
 */
#ifndef MOK_KERNELS_H
#define MOK_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

struct CUstream_st; /* cudaStream_t is `struct CUstream_st *` */
typedef struct CUstream_st *mok_k_stream;

/* bf16 values travel as their 16-bit patterns. */
typedef uint16_t mok_k_bf16;

/* The layer at one job's T. E_loc local experts are the global ids
 * first_expert .. first_expert+E_loc-1 of E. I_s = 0: no shared expert. */
typedef struct mok_k_dims {
  int T, H, I, E, E_loc, first_expert, K, I_s;
  int row_align; /* must be mok_k_row_align() */
  int has_limit;
  float limit;   /* SwiGLU clamp L (> 0) when has_limit */
  int rows_limit; /* 0, or a routed-row capacity below the worst case (a group's) */
  int no_tail;    /* 1: routed rows past the schedule's used rows are neither read nor
                     written (nobody needs them: a group's rows, where the capacity is
                     far above the rows in use); 0: they are written as zeros */
} mok_k_dims;

/* The routed-row group alignment these kernels need (the GEMM M tile). */
int mok_k_row_align(void);

/* Checks that the kernels support these dims: H, I, I_s multiples of 8,
 * sizes within int32 index ranges, row_align = mok_k_row_align(), ...
 * Returns a mok_status and fills err (may be NULL). */
int mok_k_check_dims(const mok_k_dims *d, char *err, size_t errlen);

/* What the library runs, each by name (NULL or "": its default). The
 * library reads no environment: its callers pass what they were told (mokd:
 * MOK_GEMM, MOK_GEMM_VARIANT, MOK_GATHER_BESIDE and MOK_GEMM_CUTLASS; the tests
 * and benches likewise, tests/harness/kernel_choices.h).
 *   gemm           "hmma": every product on mma.sync; "sm90" (the default):
 *                  the Hopper kernels where the device has them
 *   variant        the Hopper tile variant (mok_gemm_sm90.h: rows, expert,
 *                  cluster, pingpong, quad, cutlass (the default))
 *   gather_beside  where the backward gathers x (mok_k_set_gather_host)
 *   cutlass        what the cutlass variant runs on CUTLASS (mok_gemm_sm90.h,
 *                  mok_k_sm90_set_cutlass_choice): "table" (the default),
 *                  "every" or "every-pp" (tests: every CUTLASS product at
 *                  every size) */
typedef struct mok_k_choices {
  const char *gemm, *variant, *gather_beside, *cutlass;
} mok_k_choices;

/* Once per device (after cudaSetDevice) before any launch: raises the
 * kernels' shared-memory limits and takes the choices (NULL: every
 * default). Returns a mok_status: MOK_EINVAL for a name it does not know
 * (mok_k_choice_error says which), MOK_EENGINE for a CUDA failure. */
int mok_k_init_with(const mok_k_choices *c);
int mok_k_init(void); /* mok_k_init_with(NULL) */
/* After MOK_EINVAL from mok_k_init_with: "MOK_GEMM_VARIANT=..." style text
 * naming the refused choice and the names it takes. */
const char *mok_k_choice_error(void);

/* The cudaError_t of the last failed launch on this thread (0: none). */
int mok_k_last_cuda_error(void);

/* 1 when every backward GEMM of these dims runs on the Hopper (TMA) kernels
 * (not forced onto mma.sync by the gemm choice "hmma" at mok_k_init_with, I and I_s
 * multiples of 16):
 * those read weights through any mapping at full speed, so the engine need
 * not copy a client's weights first. */
int mok_k_backward_on_hopper(const mok_k_dims *d);

/* Layout sizes; equal to mok_rows_capacity() / mok_schedule_ints() of
 * proto/mok_wire.h for the same dims (the engine can assert that). */
int64_t mok_k_rows_capacity(const mok_k_dims *d);
int64_t mok_k_schedule_ints(const mok_k_dims *d);

/* Device scratch needed by any launcher below at these dims (size it with
 * the layer's max tokens as T). */
size_t mok_k_workspace_bytes(const mok_k_dims *d);

/* ---- routing ---------------------------------------------------------------
 *
 * schedule_build: topk_ids [T,K] -> schedule (mok_k_schedule_ints int32):
 * per-expert counts from per-chunk histograms, padded offsets from prefix
 * sums, rows within an expert in ascending t*K+k (integer ranks, nothing
 * decided by arrival order). Every entry is written. An id outside [0,E)
 * and not -1 raises MOK_EROUTE (the slot is then treated as dropped, so the
 * schedule stays consistent). */
int mok_k_schedule_build(const mok_k_dims *d, const int32_t *topk_ids, int32_t *schedule,
                         void *workspace, int32_t *status, mok_k_stream stream);
/* The same from ids another process may change meanwhile: each of
 * topk_ids is read once, and that value, kept in ids_copy [T,K], is what the
 * rest of the build reads, so the schedule is consistent whatever the ids
 * do (copy, check, use in one step; ids_copy is left holding the ids used). */
int mok_k_schedule_build_snapshot(const mok_k_dims *d, const int32_t *topk_ids,
                                  int32_t *ids_copy, int32_t *schedule, void *workspace,
                                  int32_t *status, mok_k_stream stream);

/* ---- FP8 quantisers (mok_fp8.cu; docs/math.md "FP8") -------------------------
 * quantize_weight: w [experts][n][k] bf16 (n, k multiples of 128) into its
 * packed form (mok_fp8_weight_bytes of proto/mok_layout.h, 4-byte aligned):
 * the e4m3 bytes [experts][n][k], zeros to the 256-byte boundary, their
 * transpose [experts][k][n], zeros to the 256-byte boundary, then one f32
 * scale per 128 x 128 block. quantize_rows: x [rows][k] into e4m3 bytes q [rows][k]
 * and scales [rows][k/128] (one per 128 of a row). Bytes and scales equal
 * the cpu engine's (kernels/common/fp8_e4m3.h). */
int mok_k_fp8_quantize_weight(const mok_k_bf16 *w, int experts, int n, int k, void *packed,
                              mok_k_stream stream);
int mok_k_fp8_quantize_rows(const mok_k_bf16 *x, int rows, int k, uint8_t *q, float *scales,
                            mok_k_stream stream);

/* ---- fp8 layers (docs/math.md "FP8"; Hopper only) ----------------------------
 * An fp8 layer's weights are packed (proto/mok_layout.h: the e4m3 bytes,
 * their transpose, the 128 x 128 block scales); its activations and
 * gradients bf16. The launchers below need H, I and I_s multiples of 128,
 * the Hopper kernels (mok_k_fp8_supported) and a workspace of
 * mok_k_fp8_workspace_bytes(d) (the bf16 launchers' pieces and the
 * quantised h, dg | du). Quantised activation rows come as e4m3 bytes
 * [rows][k] and f32 scales [rows][k/128] (mok_k_fp8_quantize_rows). */
int mok_k_fp8_supported(const mok_k_dims *d);
size_t mok_k_fp8_workspace_bytes(const mok_k_dims *d);

/* fp8_gather_rows: routed row r of q [R][H], s [R][H/128] = its slot's
 * token's row of tok_q [T][H], tok_s [T][H/128] (zeros for padding rows,
 * scale 0 there). */
int mok_k_fp8_gather_rows(const mok_k_dims *d, const int32_t *schedule, const uint8_t *tok_q,
                          const float *tok_s, uint8_t *q, float *s, int32_t *status,
                          mok_k_stream stream);

/* fp8_gate_up: acts_g, acts_u [R][I] (bf16, pre-clamp) from the quantised
 * routed x (xq, xs) and the packed w_gate, w_up; h quantised into the
 * workspace (what fp8_expert_forward's down product reads). */
int mok_k_fp8_gate_up(const mok_k_dims *d, const int32_t *schedule, const uint8_t *xq,
                      const float *xs, const void *w_gate, const void *w_up, mok_k_bf16 *acts_g,
                      mok_k_bf16 *acts_u, void *workspace, int32_t *status, mok_k_stream stream);

/* fp8_expert_forward: fp8_gate_up, then routed_y [R][H] = rnd(h W_d^T) in FP8. */
int mok_k_fp8_expert_forward(const mok_k_dims *d, const int32_t *schedule, const uint8_t *xq,
                             const float *xs, const void *w_gate, const void *w_up,
                             const void *w_down, mok_k_bf16 *acts_g, mok_k_bf16 *acts_u,
                             mok_k_bf16 *routed_y, void *workspace, int32_t *status,
                             mok_k_stream stream);

/* fp8_shared_forward: the shared expert on the quantised tokens (xq, xs
 * [T][H]): acts_gs, acts_us [T][I_s], shared_y [T][H]. MOK_OK at once when
 * I_s = 0. */
int mok_k_fp8_shared_forward(const mok_k_dims *d, const uint8_t *xq, const float *xs,
                             const void *s_gate, const void *s_up, const void *s_down,
                             mok_k_bf16 *acts_gs, mok_k_bf16 *acts_us, mok_k_bf16 *shared_y,
                             void *workspace, int32_t *status, mok_k_stream stream);

/* fp8_expert_backward: as expert_backward, the two dgrads in FP8 from the
 * quantised routed d_out (dq, ds [R][H]) and the weights' transposed bytes,
 * the weight gradients the bf16 products of routed_d_out, h, dg | du and
 * routed_x. x non-NULL: routed_x is written from x's rows by the backward
 * itself (as expert_backward_gathering); NULL: routed_x holds them. */
int mok_k_fp8_expert_backward(const mok_k_dims *d, const int32_t *schedule,
                              const mok_k_bf16 *acts_g, const mok_k_bf16 *acts_u,
                              const mok_k_bf16 *x, mok_k_bf16 *routed_x,
                              const mok_k_bf16 *routed_d_out, const uint8_t *dq, const float *ds,
                              const float *router_weights, const void *w_gate, const void *w_up,
                              const void *w_down, mok_k_bf16 *routed_d_x, float *d_rw,
                              mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down,
                              void *workspace, int32_t *status, mok_k_stream stream);

/* fp8_shared_backward: the same for the shared expert (rw = 1, rows =
 * tokens) from x, d_out [T][H] and d_out quantised (dq, ds [T][H]). */
int mok_k_fp8_shared_backward(const mok_k_dims *d, const mok_k_bf16 *x, const mok_k_bf16 *d_out,
                              const uint8_t *dq, const float *ds, const mok_k_bf16 *acts_gs,
                              const mok_k_bf16 *acts_us, const void *s_gate, const void *s_up,
                              const void *s_down, mok_k_bf16 *shared_d_x, mok_k_bf16 *d_s_gate,
                              mok_k_bf16 *d_s_up, mok_k_bf16 *d_s_down, void *workspace,
                              int32_t *status, mok_k_stream stream);

/* ---- small moves (mok_moves.cu) ---------------------------------------------
 * Copies (src) or zero fills (src NULL) of up to MOK_K_MOVE_BYTES_MAX bytes
 * each, up to MOK_K_MOVES_MAX in one kernel launch: a job's small moves
 * between its kernels without copy-engine operations. The moves of one call
 * must not overlap each other (they run at once). A take moves its bytes
 * and leaves zeros at src (each word cleared by the thread that copied it),
 * so a job's status word goes out and is reset for the next job in one step;
 * it needs a src that does not overlap its dst. */
#define MOK_K_MOVES_MAX 8
#define MOK_K_MOVE_BYTES_MAX ((size_t)4 << 20)
typedef struct mok_k_move {
  void *dst;
  const void *src; /* NULL: zeros */
  size_t bytes;
  int take; /* nonzero: src is zeroed once copied */
} mok_k_move;
int mok_k_moves(const mok_k_move *moves, int n, mok_k_stream stream);

/* schedule_validate: checks a schedule the engine did not write, as
 * docs/math.md "Untrusted inputs" (header, offsets = prefix sums of the
 * padded counts, used rows <-> slots a bijection in ascending slot order,
 * padding rows -1). Raises MOK_EINVAL on any failure. Reads only inside
 * the mok_k_schedule_ints entries. */
int mok_k_schedule_validate(const mok_k_dims *d, const int32_t *schedule, int32_t *status,
                            mok_k_stream stream);

/* gather_rows: dst[r] = src[t] for the slot (t,k) of row r, zeros for
 * padding rows (all R rows written). dispatch: src = x, dst = routed_x;
 * combine_backward: src = d_out, dst = routed_d_out. src [T,H], dst [R,H]. */
int mok_k_gather_rows(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *src,
                      mok_k_bf16 *dst, int32_t *status, mok_k_stream stream);

/* ---- expert FFN, forward ----------------------------------------------------
 *
 * gate_up_swiglu: for every routed row r of expert e (grouped GEMM, gate
 * and up fused): g = rnd(x_r W_g[e]^T), u = rnd(x_r W_u[e]^T) saved to
 * acts_g/acts_u [R,I] (pre-clamp), h = rnd(silu(g') u') to h [R,I].
 * Padding rows (and rows past the last group) get zeros in all three. */
int mok_k_gate_up_swiglu(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *routed_x,
                         const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up, mok_k_bf16 *acts_g,
                         mok_k_bf16 *acts_u, mok_k_bf16 *h, int32_t *status, mok_k_stream stream);

/* down: routed_y [R,H] = rnd(h W_d[e]^T) per routed row, zeros on padding. */
int mok_k_down(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *h,
               const mok_k_bf16 *w_down, mok_k_bf16 *routed_y, int32_t *status,
               mok_k_stream stream);

/* expert_forward = gate_up_swiglu then down, h in the workspace (the
 * "compute" step's routed part). routed_y may be routed_x itself: the
 * gate/up product has read every row before down writes one. */
int mok_k_expert_forward(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *routed_x,
                         const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
                         const mok_k_bf16 *w_down, mok_k_bf16 *acts_g, mok_k_bf16 *acts_u,
                         mok_k_bf16 *routed_y, void *workspace, int32_t *status,
                         mok_k_stream stream);

/* expert_forward's acts again, for a backward that recomputes them: its
 * gate/up product alone (the same kernel, so the same bits), h left in the
 * workspace. */
int mok_k_expert_recompute_acts(const mok_k_dims *d, const int32_t *schedule,
                                const mok_k_bf16 *routed_x, const mok_k_bf16 *w_gate,
                                const mok_k_bf16 *w_up, mok_k_bf16 *acts_g, mok_k_bf16 *acts_u,
                                void *workspace, int32_t *status, mok_k_stream stream);

/* expert_forward from x [T,H] itself: gather_rows fills routed_x [R,H]
 * first, or, where the Hopper kernels are set to (mok_gemm_sm90.h,
 * mok_k_sm90_set_gather_a), the gate/up product's producer reads each routed
 * row from x through the schedule and routed_x is not written. Outputs
 * bitwise equal to gather_rows then expert_forward. */
int mok_k_expert_forward_gathering(const mok_k_dims *d, const int32_t *schedule,
                                   const mok_k_bf16 *x, mok_k_bf16 *routed_x,
                                   const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
                                   const mok_k_bf16 *w_down, mok_k_bf16 *acts_g,
                                   mok_k_bf16 *acts_u, mok_k_bf16 *routed_y, void *workspace,
                                   int32_t *status, mok_k_stream stream);

/* shared_forward: the shared expert on x [T,H] with s_gate, s_up [I_s,H],
 * s_down [H,I_s]: acts_gs/acts_us [T,I_s] (pre-clamp g, u), shared_y [T,H].
 * Nothing to do (MOK_OK) when I_s = 0. */
int mok_k_shared_forward(const mok_k_dims *d, const mok_k_bf16 *x, const mok_k_bf16 *s_gate,
                         const mok_k_bf16 *s_up, const mok_k_bf16 *s_down, mok_k_bf16 *acts_gs,
                         mok_k_bf16 *acts_us, mok_k_bf16 *shared_y, void *workspace,
                         int32_t *status, mok_k_stream stream);

/* combine: out[t] = rnd(shared_y[t] + sum_k rw[t,k] routed_y[slot_row[t,k]])
 * in f32, k ascending, each term multiplied and rounded before the add.
 * shared_y may be NULL (no shared expert) or out itself (each element read
 * before it is written). rw [T,K] f32, out [T,H]. */
int mok_k_combine(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *routed_y,
                  const float *router_weights, const mok_k_bf16 *shared_y, mok_k_bf16 *out,
                  int32_t *status, mok_k_stream stream);

/* ---- backward ---------------------------------------------------------------
 *
 * expert_backward (compute_backward's routed part), per used row r = slot
 * (t,k) of expert e, with g, u from acts:
 *   a = routed_d_out[r] W_d[e] (f32); d_rw[t,k] = <a, h> (0 for slots not
 *   local); dh = rw a; dg, du by the SwiGLU(+clamp) backward, rounded;
 *   routed_d_x[r] = rnd(dg W_g[e] + du W_u[e]) (zeros on padding rows);
 *   d_w_down[e] = rnd(sum_r rnd(rw routed_d_out[r])^T h_r),
 *   d_w_gate[e] = rnd(sum_r dg_r^T routed_x[r]), d_w_up likewise with du.
 * Each weight-gradient tile is owned by one block that runs the whole
 * reduction over the expert's rows; experts without rows get zeros.
 * routed_d_x [R,H], d_rw [T,K] f32, d_w_* shaped as the weights. */
int mok_k_expert_backward(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *acts_g,
                          const mok_k_bf16 *acts_u, const mok_k_bf16 *routed_x,
                          const mok_k_bf16 *routed_d_out, const float *router_weights,
                          const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
                          const mok_k_bf16 *w_down, mok_k_bf16 *routed_d_x, float *d_rw,
                          mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down,
                          void *workspace, int32_t *status, mok_k_stream stream);
/* The same, writing the weight gradients of the local experts in the
 * device range expert_range[0] <= e < expert_range[1] only (NULL: all):
 * a ring's macrobatch, whose schedule gives the other experts no rows,
 * must leave their gradients (written by other macrobatches) alone. */
int mok_k_expert_backward_experts(const mok_k_dims *d, const int32_t *schedule,
                                  const mok_k_bf16 *acts_g, const mok_k_bf16 *acts_u,
                                  const mok_k_bf16 *routed_x, const mok_k_bf16 *routed_d_out,
                                  const float *router_weights, const mok_k_bf16 *w_gate,
                                  const mok_k_bf16 *w_up, const mok_k_bf16 *w_down,
                                  mok_k_bf16 *routed_d_x, float *d_rw, mok_k_bf16 *d_w_gate,
                                  mok_k_bf16 *d_w_up, mok_k_bf16 *d_w_down,
                                  const int32_t *expert_range, void *workspace, int32_t *status,
                                  mok_k_stream stream);

/* The same for a caller that keeps no routed x from the forward (mokd,
 * whose ctx holds the schedule and g, u): routed_x [R,H] is written from x
 * [T,H] by the backward itself, every row as gather_rows(x) writes it,
 * before the gate/up weight gradient reads it. On the Hopper kernels the
 * copy runs beside an earlier product (mok_k_set_gather_host), so its
 * memory traffic overlaps the tensor cores' work; elsewhere a gather_rows
 * comes first. routed_x must not alias any other argument. */
int mok_k_expert_backward_gathering(const mok_k_dims *d, const int32_t *schedule,
                                    const mok_k_bf16 *acts_g, const mok_k_bf16 *acts_u,
                                    const mok_k_bf16 *x, mok_k_bf16 *routed_x,
                                    const mok_k_bf16 *routed_d_out, const float *router_weights,
                                    const mok_k_bf16 *w_gate, const mok_k_bf16 *w_up,
                                    const mok_k_bf16 *w_down, mok_k_bf16 *routed_d_x,
                                    float *d_rw, mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up,
                                    mok_k_bf16 *d_w_down, void *workspace, int32_t *status,
                                    mok_k_stream stream);

/* The routed backward and dispatch_backward in one [R,H] buffer, for a
 * caller that keeps no routed copies (mokd: one such buffer a job, where
 * the chain above takes three). On entry routed holds
 * gather_rows(d_out)'s rows; the down dgrad and the down weight gradient
 * read them, the gate/up dgrad writes routed d_x over them, one pass gives
 * d_x = dispatch_backward(routed d_x, shared_d_x) and writes x's rows back
 * (gather_rows(x)'s bytes, padding rows zeros), and the gate/up weight
 * gradient reads those. Every output (d_x, d_rw, d_w_*) is bitwise
 * expert_backward_gathering's + dispatch_backward's, and routed ends as
 * their routed_x. shared_d_x may be NULL (no shared expert) or d_x itself
 * (its rows read before written); routed must alias nothing else. */
int mok_k_expert_backward_in_place(const mok_k_dims *d, const int32_t *schedule,
                                   const mok_k_bf16 *acts_g, const mok_k_bf16 *acts_u,
                                   const mok_k_bf16 *x, mok_k_bf16 *routed,
                                   const float *router_weights, const mok_k_bf16 *w_gate,
                                   const mok_k_bf16 *w_up, const mok_k_bf16 *w_down,
                                   const mok_k_bf16 *shared_d_x, mok_k_bf16 *d_x, float *d_rw,
                                   mok_k_bf16 *d_w_gate, mok_k_bf16 *d_w_up,
                                   mok_k_bf16 *d_w_down, void *workspace, int32_t *status,
                                   mok_k_stream stream);

/* Where expert_backward_gathering copies x's rows: a kernel of its own
 * before the products, or beside the down dgrad, the gate/up dgrad, the
 * down weight gradient, half beside each dgrad, or a third beside each of
 * those three (the default); each precedes the gate/up weight gradient (a
 * kernel first where a host product runs on mma.sync). The results are the same bytes wherever it
 * runs. The gather_beside choice kernel|down_dgrad|gu_dgrad|down_wgrad|
 * both_dgrads|three at mok_k_init_with (a bench knob), or the setter
 * (MOK_EINVAL for anything else). */
enum {
  MOK_K_GATHER_KERNEL = 0,
  MOK_K_GATHER_DOWN_DGRAD = 1,
  MOK_K_GATHER_GU_DGRAD = 2,
  MOK_K_GATHER_DOWN_WGRAD = 3,
  MOK_K_GATHER_BOTH_DGRADS = 4,
  MOK_K_GATHER_THREE = 5,
  MOK_K_GATHER_HOSTS = 6
};
int mok_k_set_gather_host(int host);
int mok_k_gather_host(void);
int mok_k_gather_host_parse(const char *name); /* -1: not a host's name */
const char *mok_k_gather_host_name(int host);

/* shared_backward: the same with rw = 1, rows = tokens, from x, d_out and
 * acts_gs/acts_us: shared_d_x [T,H], d_s_gate, d_s_up [I_s,H],
 * d_s_down [H,I_s]. Nothing to do when I_s = 0. */
int mok_k_shared_backward(const mok_k_dims *d, const mok_k_bf16 *x, const mok_k_bf16 *d_out,
                          const mok_k_bf16 *acts_gs, const mok_k_bf16 *acts_us,
                          const mok_k_bf16 *s_gate, const mok_k_bf16 *s_up,
                          const mok_k_bf16 *s_down, mok_k_bf16 *shared_d_x,
                          mok_k_bf16 *d_s_gate, mok_k_bf16 *d_s_up, mok_k_bf16 *d_s_down,
                          void *workspace, int32_t *status, mok_k_stream stream);

/* dispatch_backward: d_x[t] = rnd(shared_d_x[t] + sum_k routed_d_x[slot_row[t,k]])
 * in f32, k ascending; shared_d_x may be NULL. */
int mok_k_dispatch_backward(const mok_k_dims *d, const int32_t *schedule,
                            const mok_k_bf16 *routed_d_x, const mok_k_bf16 *shared_d_x,
                            mok_k_bf16 *d_x, int32_t *status, mok_k_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* MOK_KERNELS_H */
