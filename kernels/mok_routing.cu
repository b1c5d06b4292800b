/* SPDX-License-Identifier: Apache-2.0 */
/* Routing kernels: schedule build and validation, row gathers, the ordered
 * K-sums of combine and dispatch_backward, and the host-side helpers of the
 * C API (dims checks, layout sizes, workspace, launch errors). */
#include <stdio.h>
#include <string.h>

#include "mok_kernels_internal.cuh"

#define FULL_MASK 0xffffffffu
#define SCHED_CHUNK 512   /* slots per schedule-build block (one warp) */
#define ROWS_PER_BLOCK 8  /* row kernels: one warp per row, 8 warps a block */
#define MAX_E_LOC 12288   /* per-block expert counters live in 48 KB of shared memory */

/* ---- host helpers ---------------------------------------------------------- */

static thread_local int last_cuda_error = 0;

extern "C" int mok_k_last_cuda_error(void) { return last_cuda_error; }

void mok_k_set_cuda_error(int err) { last_cuda_error = err; }

int mok_k_launch_status(void) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return MOK_OK;
  last_cuda_error = (int)err;
  return MOK_EENGINE;
}

int mok_k_sched_chunk(void) { return SCHED_CHUNK; }

extern "C" int mok_k_row_align(void) { return MOK_K_ROW_ALIGN; }

/* The layout of proto/mok_layout.h, the one the daemon and clients use. */
extern "C" int64_t mok_k_rows_capacity(const mok_k_dims *d) {
  const mok_layout_dims l = mok_k_layout_dims(d);
  return (int64_t)mok_rows_capacity(&l);
}

extern "C" int64_t mok_k_schedule_ints(const mok_k_dims *d) {
  const mok_layout_dims l = mok_k_layout_dims(d);
  return (int64_t)mok_schedule_ints(&l);
}

#define DIMS_ERR(...)                                                          \
  do {                                                                         \
    if (err && errlen) snprintf(err, errlen, __VA_ARGS__);                     \
    return MOK_EINVAL;                                                         \
  } while (0)

extern "C" int mok_k_check_dims(const mok_k_dims *d, char *err, size_t errlen) {
  if (!d) DIMS_ERR("kernels: no dims");
  if (d->T < 0 || d->K < 1 || d->E < 1 || d->E_loc < 1 || d->first_expert < 0 ||
      (int64_t)d->first_expert + d->E_loc > d->E)
    DIMS_ERR("kernels: bad routing dims T=%d K=%d E=%d E_loc=%d first_expert=%d", d->T, d->K,
             d->E, d->E_loc, d->first_expert);
  if (d->H < 8 || d->I < 8 || d->H % 8 || d->I % 8 || d->I_s < 0 || d->I_s % 8)
    DIMS_ERR("kernels: H=%d, I=%d and I_s=%d must be multiples of 8 (H, I at least 8)", d->H,
             d->I, d->I_s);
  if (d->row_align != MOK_K_ROW_ALIGN)
    DIMS_ERR("kernels: row_align %d, the cuda kernels need %d", d->row_align, MOK_K_ROW_ALIGN);
  if (d->rows_limit < 0) DIMS_ERR("kernels: rows_limit %d is negative", d->rows_limit);
  if (d->no_tail != 0 && d->no_tail != 1) DIMS_ERR("kernels: no_tail %d is not 0 or 1", d->no_tail);
  if (d->E_loc > MAX_E_LOC) DIMS_ERR("kernels: E_loc %d above %d", d->E_loc, MAX_E_LOC);
  if (d->has_limit && !(d->limit > 0.0f && d->limit < 3.0e38f))
    DIMS_ERR("kernels: SwiGLU limit %g must be finite and > 0", (double)d->limit);
  /* int32 schedule entries and int32 row/column indices inside the kernels */
  const int64_t big = 0x7fffffffLL;
  int64_t wide = d->H > 2 * (int64_t)d->I ? d->H : 2 * (int64_t)d->I;
  if (2 * (int64_t)d->I_s > wide) wide = 2 * (int64_t)d->I_s;
  if ((int64_t)d->T * d->K > big || mok_k_schedule_ints(d) > big || wide > big ||
      d->H > (1 << 22) || d->I > (1 << 22) || d->I_s > (1 << 22))
    DIMS_ERR("kernels: T=%d K=%d H=%d I=%d too large", d->T, d->K, d->H, d->I);
  return MOK_OK;
}

static size_t bf16_bytes(int64_t rows, int64_t cols) { return (size_t)(rows * cols * 2); }

ws_layout mok_k_ws_layout(const mok_k_dims *d) {
  ws_layout w;
  memset(&w, 0, sizeof w);
  int64_t R = mok_k_rows_capacity(d);
  int64_t chunks = ((int64_t)d->T * d->K + SCHED_CHUNK - 1) / SCHED_CHUNK;
  size_t sched = mok_k_align256((size_t)(chunks * d->E_loc * 4));
  /* routed backward holds h~, dgu and the d_rw partials at once */
  w.h = 0;
  w.dgu = mok_k_align256(bf16_bytes(R, d->I));
  w.partial = w.dgu + mok_k_align256(bf16_bytes(R, 2 * (int64_t)d->I));
  size_t routed = w.partial + mok_k_align256((size_t)(R * mok_k_partial_tiles(d) * 4));
  /* shared forward/backward: h_s, dgu_s */
  w.hs = 0;
  w.dgus = mok_k_align256(bf16_bytes(d->T, d->I_s));
  size_t shared = w.dgus + mok_k_align256(bf16_bytes(d->T, 2 * (int64_t)d->I_s));
  w.hist = 0;
  w.total = routed;
  if (shared > w.total) w.total = shared;
  if (sched > w.total) w.total = sched;
  return w;
}

extern "C" size_t mok_k_workspace_bytes(const mok_k_dims *d) { return mok_k_ws_layout(d).total; }

/* ---- schedule build ---------------------------------------------------------
 *
 * Four small kernels, all integer, nothing decided by arrival order:
 *  count: one warp per chunk of SCHED_CHUNK slots counts its slots per
 *         expert (ranks inside a 32-slot step from __match_any_sync);
 *  scan:  one block turns the chunk counts into per-chunk bases, expert
 *         counts and the padded offsets (prefix sums), writes the header;
 *  place: each chunk re-walks its slots and writes slot_row / row_slot at
 *         offset + chunk base + rank;
 *  pad:   rows no slot lands in get row_slot = -1. */

/* Local expert of a routing id, -1 for dropped or another rank's expert;
 * an id outside [0,E) and not -1 raises EROUTE and counts as dropped. */
__device__ static inline int local_expert(int id, int E, int first, int E_loc, int32_t *status) {
  if (id < -1 || id >= E) {
    if (status) raise_status(status, MOK_EROUTE);
    return -1;
  }
  int e = id - first;
  return (id >= 0 && e >= 0 && e < E_loc) ? e : -1;
}

/* copy: NULL, or where each id read is kept (the snapshot build) */
__global__ void sched_count_kernel(const int32_t *ids, int32_t *copy, int n_slots, int E,
                                   int first, int E_loc, int32_t *hist, int32_t *status) {
  extern __shared__ int32_t counter[];
  const int lane = threadIdx.x;
  for (int e = lane; e < E_loc; e += 32) counter[e] = 0;
  __syncwarp();
  const int s0 = blockIdx.x * SCHED_CHUNK, s1 = min(s0 + SCHED_CHUNK, n_slots);
  for (int base = s0; base < s1; base += 32) {
    int s = base + lane;
    int id = -1;
    if (s < s1) {
      id = ids[s];
      if (copy) copy[s] = id;
    }
    int e = s < s1 ? local_expert(id, E, first, E_loc, status) : -1;
    unsigned same = __match_any_sync(FULL_MASK, e);
    int before = e >= 0 ? counter[e] : 0;
    __syncwarp();
    if (e >= 0 && lane == __ffs(same) - 1) counter[e] = before + __popc(same);
    __syncwarp();
  }
  for (int e = lane; e < E_loc; e += 32) hist[(size_t)blockIdx.x * E_loc + e] = counter[e];
}

/* Exclusive prefix sum over the block of one int64 per thread. */
__device__ static long long block_exclusive_scan(long long v, long long *total) {
  __shared__ long long warp_sums[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  long long incl = v;
  for (int o = 1; o < 32; o <<= 1) {
    long long n = __shfl_up_sync(FULL_MASK, incl, o);
    if (lane >= o) incl += n;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    long long w = lane < nwarps ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      long long n = __shfl_up_sync(FULL_MASK, w, o);
      if (lane >= o) w += n;
    }
    warp_sums[lane] = w; /* inclusive over warps */
  }
  __syncthreads();
  long long warp_base = warp > 0 ? warp_sums[warp - 1] : 0;
  *total = warp_sums[nwarps - 1];
  return warp_base + incl - v;
}

__global__ void __launch_bounds__(1024) sched_scan_kernel(int32_t *hist, int n_chunks, int T, int K,
                                                          int E_loc, int first, int row_align,
                                                          int capacity, int32_t *header,
                                                          int32_t *counts, int32_t *offsets,
                                                          int32_t *status) {
  /* per expert: chunk counts -> chunk bases, total count */
  for (int e = threadIdx.x; e < E_loc; e += blockDim.x) {
    int run = 0;
    for (int c = 0; c < n_chunks; c++) {
      int v = hist[(size_t)c * E_loc + e];
      hist[(size_t)c * E_loc + e] = run;
      run += v;
    }
    counts[e] = run;
  }
  __syncthreads();
  /* offsets: each thread owns a contiguous run of experts */
  const int per = (E_loc + blockDim.x - 1) / blockDim.x;
  const int e0 = min((int)threadIdx.x * per, E_loc), e1 = min(e0 + per, E_loc);
  long long mine = 0;
  for (int e = e0; e < e1; e++) mine += ((long long)counts[e] + row_align - 1) / row_align * row_align;
  long long total;
  long long at = block_exclusive_scan(mine, &total);
  /* Past the capacity (a group's capacity multiplier) the schedule is empty:
   * every later kernel then moves and computes nothing, and the job fails. */
  const bool over = total > capacity;
  for (int e = e0; e < e1; e++) {
    offsets[e] = over ? 0 : (int32_t)at;
    at += ((long long)counts[e] + row_align - 1) / row_align * row_align;
    if (over) counts[e] = 0;
  }
  if (threadIdx.x == 0) {
    if (over) raise_status(status, MOK_EOVERFLOW);
    offsets[E_loc] = over ? 0 : (int32_t)total;
    header[MOK_SCHED_H_MAGIC] = (int32_t)MOK_SCHED_MAGIC;
    header[MOK_SCHED_H_TOKENS] = T;
    header[MOK_SCHED_H_TOPK] = K;
    header[MOK_SCHED_H_LOCAL_EXPERTS] = E_loc;
    header[MOK_SCHED_H_ROW_ALIGN] = row_align;
    header[MOK_SCHED_H_ROWS_CAPACITY] = capacity;
    header[MOK_SCHED_H_ROWS_USED] = over ? 0 : (int32_t)total;
    header[MOK_SCHED_H_FIRST_EXPERT] = first;
  }
}

__global__ void sched_place_kernel(const int32_t *ids, int n_slots, int E, int first, int E_loc,
                                   const int32_t *hist, const int32_t *offsets, int capacity,
                                   int32_t *row_slot, int32_t *slot_row) {
  extern __shared__ int32_t cursor[];
  const int lane = threadIdx.x;
  for (int e = lane; e < E_loc; e += 32)
    cursor[e] = offsets[e] + hist[(size_t)blockIdx.x * E_loc + e];
  __syncwarp();
  const unsigned lanes_below = (1u << lane) - 1u;
  const int s0 = blockIdx.x * SCHED_CHUNK, s1 = min(s0 + SCHED_CHUNK, n_slots);
  for (int base = s0; base < s1; base += 32) {
    int s = base + lane;
    int e = s < s1 ? local_expert(ids[s], E, first, E_loc, NULL) : -1;
    unsigned same = __match_any_sync(FULL_MASK, e);
    int before = e >= 0 ? cursor[e] : 0;
    __syncwarp();
    if (s < s1) {
      int row = e >= 0 ? before + __popc(same & lanes_below) : -1;
      if (row >= offsets[E_loc]) row = -1; /* only past the capacity: an empty schedule */
      slot_row[s] = row;
      if (row >= 0) row_slot[row] = s;
    }
    if (e >= 0 && lane == __ffs(same) - 1) cursor[e] = before + __popc(same);
    __syncwarp();
  }
}

__global__ void sched_pad_kernel(const int32_t *counts, const int32_t *offsets, int E_loc,
                                 int capacity, int32_t *row_slot) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= capacity) return;
  int e = find_group(offsets, E_loc, r);
  bool used = r < offsets[E_loc] && r >= offsets[e] && r < offsets[e] + counts[e];
  if (!used) row_slot[r] = -1;
}

static int schedule_build(const mok_k_dims *d, const int32_t *topk_ids, int32_t *ids_copy,
                          int32_t *schedule, void *workspace, int32_t *status,
                          mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !workspace ||
      (d->T > 0 && !topk_ids))
    return MOK_EINVAL;
  sched_ptrs s = sched_view(d, schedule);
  int32_t *hist = (int32_t *)((char *)workspace + mok_k_ws_layout(d).hist);
  const int n_chunks = (s.n_slots + SCHED_CHUNK - 1) / SCHED_CHUNK;
  const size_t counter_bytes = (size_t)d->E_loc * sizeof(int32_t);
  if (n_chunks > 0)
    sched_count_kernel<<<n_chunks, 32, counter_bytes, stream>>>(
        topk_ids, ids_copy, s.n_slots, d->E, d->first_expert, d->E_loc, hist, status);
  /* the snapshot build places from the ids it counted */
  const int32_t *placed = ids_copy ? ids_copy : topk_ids;
  sched_scan_kernel<<<1, 1024, 0, stream>>>(hist, n_chunks, d->T, d->K, d->E_loc,
                                            d->first_expert, d->row_align, s.capacity, s.header,
                                            s.counts, s.offsets, status);
  if (n_chunks > 0)
    sched_place_kernel<<<n_chunks, 32, counter_bytes, stream>>>(
        placed, s.n_slots, d->E, d->first_expert, d->E_loc, hist, s.offsets, s.capacity,
        s.row_slot, s.slot_row);
  if (s.capacity > 0)
    sched_pad_kernel<<<(s.capacity + 255) / 256, 256, 0, stream>>>(s.counts, s.offsets, d->E_loc,
                                                                  s.capacity, s.row_slot);
  return mok_k_launch_status();
}

extern "C" int mok_k_schedule_build(const mok_k_dims *d, const int32_t *topk_ids,
                                    int32_t *schedule, void *workspace, int32_t *status,
                                    mok_k_stream stream) {
  return schedule_build(d, topk_ids, NULL, schedule, workspace, status, stream);
}

extern "C" int mok_k_schedule_build_snapshot(const mok_k_dims *d, const int32_t *topk_ids,
                                             int32_t *ids_copy, int32_t *schedule,
                                             void *workspace, int32_t *status,
                                             mok_k_stream stream) {
  if (d && d->T > 0 && !ids_copy) return MOK_EINVAL;
  return schedule_build(d, topk_ids, ids_copy, schedule, workspace, status, stream);
}

/* ---- schedule validation ----------------------------------------------------
 * One thread per check item (header, expert, row, slot); any failure raises
 * EINVAL. Indices come from the job's dims, never from the schedule. */
__global__ void sched_validate_kernel(const int32_t *header, const int32_t *counts,
                                      const int32_t *offsets, const int32_t *row_slot,
                                      const int32_t *slot_row, int T, int K, int E_loc, int first,
                                      int row_align, int capacity, int32_t *status) {
  const int n_slots = T * K;
  const int items = max(max(capacity, n_slots), E_loc + 1);
  bool bad = false;
  const int rows_used = min(max(header[MOK_SCHED_H_ROWS_USED], 0), capacity);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < items; i += gridDim.x * blockDim.x) {
    if (i == 0) {
      bad |= header[MOK_SCHED_H_MAGIC] != (int32_t)MOK_SCHED_MAGIC ||
             header[MOK_SCHED_H_TOKENS] != T || header[MOK_SCHED_H_TOPK] != K ||
             header[MOK_SCHED_H_LOCAL_EXPERTS] != E_loc ||
             header[MOK_SCHED_H_ROW_ALIGN] != row_align ||
             header[MOK_SCHED_H_ROWS_CAPACITY] != capacity ||
             header[MOK_SCHED_H_FIRST_EXPERT] != first || header[MOK_SCHED_H_ROWS_USED] < 0 ||
             header[MOK_SCHED_H_ROWS_USED] > capacity || offsets[0] != 0 ||
             offsets[E_loc] != header[MOK_SCHED_H_ROWS_USED];
    }
    if (i < E_loc) { /* offsets are the prefix sums of the padded counts */
      long long c = counts[i];
      long long next = (long long)offsets[i] + (c + row_align - 1) / row_align * row_align;
      bad |= c < 0 || c > capacity || offsets[i + 1] != next || next > capacity;
    }
    if (i < capacity) { /* used rows name a slot naming them back, in ascending order */
      int e = find_group(offsets, E_loc, i);
      long long begin = offsets[e], used_end = begin + (long long)counts[e];
      bool used = i < rows_used && i >= begin && i < used_end;
      int s = row_slot[i];
      if (!used) {
        bad |= s != -1;
      } else {
        bad |= s < 0 || s >= n_slots;
        if (s >= 0 && s < n_slots) bad |= slot_row[s] != i;
        if (i > begin) bad |= row_slot[i - 1] >= s;
      }
    }
    if (i < n_slots) {
      int r = slot_row[i];
      if (r != -1) {
        bad |= r < 0 || r >= rows_used;
        if (r >= 0 && r < capacity) bad |= row_slot[r] != i;
      }
    }
  }
  if (bad) raise_status(status, MOK_EINVAL);
}

extern "C" int mok_k_schedule_validate(const mok_k_dims *d, const int32_t *schedule,
                                       int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status) return MOK_EINVAL;
  sched_ptrs s = sched_view(d, schedule);
  int items = s.capacity > s.n_slots ? s.capacity : s.n_slots;
  if (items < d->E_loc + 1) items = d->E_loc + 1;
  int blocks = (items + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  sched_validate_kernel<<<blocks, 256, 0, stream>>>(s.header, s.counts, s.offsets, s.row_slot,
                                                    s.slot_row, d->T, d->K, d->E_loc,
                                                    d->first_expert, d->row_align, s.capacity,
                                                    status);
  return mok_k_launch_status();
}

/* ---- row movement -------------------------------------------------------------
 * One warp per row, 16-byte vectors (8 bf16). */

/* dst[r] = src[token of row r's slot], zeros on padding rows. */
__global__ void gather_rows_kernel(const uint4 *src, const int32_t *row_slot, int capacity, int K,
                                   int n_slots, int vecs, uint4 *dst, const int32_t *status) {
  if (job_failed(status)) return;
  const int r = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= capacity) return;
  const int s = row_slot[r];
  const uint4 *srow = (s >= 0 && s < n_slots) ? src + (size_t)(s / K) * vecs : NULL;
  uint4 *drow = dst + (size_t)r * vecs;
  for (int c = lane; c < vecs; c += 32) drow[c] = srow ? srow[c] : make_uint4(0, 0, 0, 0);
}

/* Column vector c of rnd(base[t] + sum_k (rw[t,k] *) routed[slot_row[t,k]]),
 * f32, k ascending; base and rw optional (rw absent: plain sum). The one
 * arithmetic of every K-sum, so that each sums as the others do. */
__device__ static inline uint4 ksum_vec(const uint4 *routed, const int32_t *slots,
                                        const float *rw_t, const uint4 *base_row, int K,
                                        int capacity, int vecs, int c) {
  float acc[8];
  if (base_row) {
    uint4 b = base_row[c];
    const __nv_bfloat162 *bv = (const __nv_bfloat162 *)&b;
    for (int j = 0; j < 4; j++) {
      float2 f = __bfloat1622float2(bv[j]);
      acc[2 * j] = f.x;
      acc[2 * j + 1] = f.y;
    }
  } else {
    for (int j = 0; j < 8; j++) acc[j] = 0.0f;
  }
  for (int k = 0; k < K; k++) {
    const int r = slots[k];
    if (r < 0 || r >= capacity) continue;
    uint4 v = routed[(size_t)r * vecs + c];
    const __nv_bfloat162 *vv = (const __nv_bfloat162 *)&v;
    if (rw_t) {
      const float w = rw_t[k];
      for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(vv[j]);
        acc[2 * j] = __fadd_rn(acc[2 * j], __fmul_rn(w, f.x));
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], __fmul_rn(w, f.y));
      }
    } else {
      for (int j = 0; j < 4; j++) {
        float2 f = __bfloat1622float2(vv[j]);
        acc[2 * j] = __fadd_rn(acc[2 * j], f.x);
        acc[2 * j + 1] = __fadd_rn(acc[2 * j + 1], f.y);
      }
    }
  }
  uint4 o;
  __nv_bfloat162 *ov = (__nv_bfloat162 *)&o;
  for (int j = 0; j < 4; j++) ov[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return o;
}

/* out[t] = rnd(base[t] + sum_k (rw[t,k] *) routed[slot_row[t,k]]) (ksum_vec) */
__global__ void ordered_ksum_kernel(const uint4 *routed, const int32_t *slot_row, const float *rw,
                                    const uint4 *base, int T, int K, int capacity, int vecs,
                                    uint4 *out, const int32_t *status) {
  if (job_failed(status)) return;
  const int t = blockIdx.x * ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (t >= T) return;
  const int32_t *slots = slot_row + (size_t)t * K;
  const float *rw_t = rw ? rw + (size_t)t * K : NULL;
  const uint4 *base_row = base ? base + (size_t)t * vecs : NULL;
  for (int c = lane; c < vecs; c += 32)
    out[(size_t)t * vecs + c] = ksum_vec(routed, slots, rw_t, base_row, K, capacity, vecs, c);
}

/* The routed backward's K-sum and x's gather in one pass over one buffer:
 * the first token_blocks blocks give d_x[t] = rnd(base[t] + sum_k
 * routed[slot_row[t,k]]) (ksum_vec) and then write x[t] over each of those
 * rows; the blocks after them write zeros on the rows no slot names. The
 * buffer then holds gather_rows(x)'s bytes. A used row is named by one slot
 * (the schedule is validated or built here), so the thread that reads a
 * column of it is the only one that writes it. base may be d_x itself. */
__global__ void ksum_regather_kernel(uint4 *routed, const int32_t *slot_row,
                                     const int32_t *row_slot, const uint4 *base, const uint4 *x,
                                     int T, int K, int n_slots, int capacity, int token_blocks,
                                     int vecs, uint4 *d_x, const int32_t *status) {
  if (job_failed(status)) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if ((int)blockIdx.x >= token_blocks) {
    const int r = ((int)blockIdx.x - token_blocks) * ROWS_PER_BLOCK + warp;
    if (r >= capacity) return;
    const int s = row_slot[r];
    if (s >= 0 && s < n_slots) return; /* a used row: its token's warp writes it */
    uint4 *drow = routed + (size_t)r * vecs;
    for (int c = lane; c < vecs; c += 32) drow[c] = make_uint4(0, 0, 0, 0);
    return;
  }
  const int t = blockIdx.x * ROWS_PER_BLOCK + warp;
  if (t >= T) return;
  const int32_t *slots = slot_row + (size_t)t * K;
  const uint4 *base_row = base ? base + (size_t)t * vecs : NULL;
  for (int c = lane; c < vecs; c += 32) {
    d_x[(size_t)t * vecs + c] = ksum_vec(routed, slots, NULL, base_row, K, capacity, vecs, c);
    const uint4 xv = x[(size_t)t * vecs + c];
    for (int k = 0; k < K; k++) {
      const int r = slots[k];
      if (r >= 0 && r < capacity) routed[(size_t)r * vecs + c] = xv;
    }
  }
}

/* d_rw[s] = sum over the down-dgrad column tiles of row slot_row[s]'s
 * partial <a, h>, ascending; 0 for slots not local. */
__global__ void drw_reduce_kernel(const float *partial, const int32_t *slot_row, int n_slots,
                                  int n_partial, int capacity, float *d_rw,
                                  const int32_t *status) {
  if (job_failed(status)) return;
  const int s = blockIdx.x * blockDim.x + threadIdx.x;
  if (s >= n_slots) return;
  const int r = slot_row[s];
  float acc = 0.0f;
  if (r >= 0 && r < capacity)
    for (int j = 0; j < n_partial; j++) acc = __fadd_rn(acc, partial[(size_t)r * n_partial + j]);
  d_rw[s] = acc;
}

extern "C" int mok_k_gather_rows(const mok_k_dims *d, const int32_t *schedule,
                                 const mok_k_bf16 *src, mok_k_bf16 *dst, int32_t *status,
                                 mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !dst ||
      (d->T > 0 && !src) || !mok_k_aligned16(src) || !mok_k_aligned16(dst))
    return MOK_EINVAL;
  sched_ptrs s = sched_view(d, schedule);
  if (s.capacity == 0) return MOK_OK;
  gather_rows_kernel<<<(s.capacity + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 32 * ROWS_PER_BLOCK, 0,
                       stream>>>((const uint4 *)src, s.row_slot, s.capacity, d->K, s.n_slots,
                                 d->H / 8, (uint4 *)dst, status);
  return mok_k_launch_status();
}

int mok_k_drw_reduce(const mok_k_dims *d, const int32_t *schedule, const float *partial,
                     float *d_rw, int32_t *status, cudaStream_t stream) {
  sched_ptrs s = sched_view(d, schedule);
  if (s.n_slots == 0) return MOK_OK;
  drw_reduce_kernel<<<(s.n_slots + 255) / 256, 256, 0, stream>>>(
      partial, s.slot_row, s.n_slots, mok_k_partial_tiles(d), s.capacity, d_rw, status);
  return mok_k_launch_status();
}

static int ordered_ksum(const mok_k_dims *d, const int32_t *schedule, const mok_k_bf16 *routed,
                        const float *rw, const mok_k_bf16 *base, mok_k_bf16 *out,
                        int32_t *status, cudaStream_t stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !routed ||
      (d->T > 0 && !out) || !mok_k_aligned16(routed) || !mok_k_aligned16(base) ||
      !mok_k_aligned16(out))
    return MOK_EINVAL;
  if (d->T == 0) return MOK_OK;
  sched_ptrs s = sched_view(d, schedule);
  ordered_ksum_kernel<<<(d->T + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 32 * ROWS_PER_BLOCK, 0,
                        stream>>>((const uint4 *)routed, s.slot_row, rw, (const uint4 *)base,
                                  d->T, d->K, s.capacity, d->H / 8, (uint4 *)out, status);
  return mok_k_launch_status();
}

/* The ordered K-sum over rows named by any slot_row (mok_ep.cu's own-token
 * view of the landing slots uses it, so that EP sums exactly as EP=1). */
int mok_k_ksum_rows(const mok_k_dims *d, const int32_t *slot_row, int capacity,
                    const mok_k_bf16 *routed, const float *rw, const mok_k_bf16 *base,
                    mok_k_bf16 *out, int32_t *status, cudaStream_t stream) {
  if (d->T == 0) return MOK_OK;
  ordered_ksum_kernel<<<(d->T + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK, 32 * ROWS_PER_BLOCK, 0,
                        stream>>>((const uint4 *)routed, slot_row, rw, (const uint4 *)base, d->T,
                                  d->K, capacity, d->H / 8, (uint4 *)out, status);
  return mok_k_launch_status();
}

extern "C" int mok_k_combine(const mok_k_dims *d, const int32_t *schedule,
                             const mok_k_bf16 *routed_y, const float *router_weights,
                             const mok_k_bf16 *shared_y, mok_k_bf16 *out, int32_t *status,
                             mok_k_stream stream) {
  if (d && d->T > 0 && !router_weights) return MOK_EINVAL;
  return ordered_ksum(d, schedule, routed_y, router_weights, shared_y, out, status, stream);
}

extern "C" int mok_k_dispatch_backward(const mok_k_dims *d, const int32_t *schedule,
                                       const mok_k_bf16 *routed_d_x,
                                       const mok_k_bf16 *shared_d_x, mok_k_bf16 *d_x,
                                       int32_t *status, mok_k_stream stream) {
  return ordered_ksum(d, schedule, routed_d_x, NULL, shared_d_x, d_x, status, stream);
}

int mok_k_ksum_regather(const mok_k_dims *d, const int32_t *schedule, mok_k_bf16 *routed,
                        const mok_k_bf16 *base, const mok_k_bf16 *x, mok_k_bf16 *d_x,
                        int32_t *status, cudaStream_t stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || !schedule || !status || !routed ||
      (d->T > 0 && (!x || !d_x)) || !mok_k_aligned16(routed) || !mok_k_aligned16(base) ||
      !mok_k_aligned16(x) || !mok_k_aligned16(d_x))
    return MOK_EINVAL;
  sched_ptrs s = sched_view(d, schedule);
  const long long token_blocks = ((long long)d->T + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  const long long row_blocks = ((long long)s.capacity + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
  if (token_blocks + row_blocks == 0) return MOK_OK;
  ksum_regather_kernel<<<(unsigned)(token_blocks + row_blocks), 32 * ROWS_PER_BLOCK, 0, stream>>>(
      (uint4 *)routed, s.slot_row, s.row_slot, (const uint4 *)base, (const uint4 *)x, d->T, d->K,
      s.n_slots, s.capacity, (int)token_blocks, d->H / 8, (uint4 *)d_x, status);
  return mok_k_launch_status();
}
