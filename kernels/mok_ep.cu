/* SPDX-License-Identifier: Apache-2.0 */
/* Expert-parallel data movement and barriers (mok_ep_kernels.h). */
#include "mok_ep_kernels.h"
#include "mok_kernels_internal.cuh"

#define EP_ROWS_PER_BLOCK 8 /* row kernels: one warp per row, 8 warps a CTA ... */
#define EP_CAPPED_WARPS 32 /* ... or 32 when the CTAs are capped (more loads in flight each) */

/* Grid and CTA size of a row kernel over `rows` rows. */
static void row_launch(const mok_k_ep *g, int rows, dim3 *grid, dim3 *block) {
  int warps = EP_ROWS_PER_BLOCK;
  int ctas = (rows + warps - 1) / warps;
  if (g->max_ctas > 0) {
    warps = EP_CAPPED_WARPS;
    ctas = (rows + warps - 1) / warps;
    if (ctas > g->max_ctas) ctas = g->max_ctas;
  }
  *grid = dim3((unsigned)(ctas > 0 ? ctas : 1));
  *block = dim3(32u * (unsigned)warps);
}

static uint64_t up256(uint64_t v) { return (v + 255u) & ~(uint64_t)255u; }

extern "C" mok_k_ep_layout mok_k_ep_layout_of(int T_max, int H, int K) {
  mok_k_ep_layout l;
  uint64_t T = (uint64_t)T_max, rows = T * (uint64_t)H * 2u, slots = T * (uint64_t)K;
  l.arrive = 0;
  l.status = up256(8u * MOK_K_EP_MAX_WORLD);
  l.post = l.status + up256(4u * MOK_K_EP_MAX_WORLD);
  l.x = l.post + up256(sizeof(mok_k_ep_post));
  l.d_out = l.x + up256(rows);
  l.ids = l.d_out + up256(rows);
  l.rw = l.ids + up256(4u * slots);
  l.land = l.rw + up256(4u * slots);
  l.drw = l.land + up256(slots * (uint64_t)H * 2u);
  l.bytes = l.drw + up256(4u * slots);
  return l;
}

/* ---- system-scope ordering between members ---------------------------------- */

__device__ static inline uint64_t ld_acquire_u64(const void *p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ static inline int32_t ld_acquire_s32(const void *p) {
  int32_t v;
  asm volatile("ld.acquire.sys.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ static inline void st_release_u64(void *p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ static inline void st_release_s32(void *p, int32_t v) {
  asm volatile("st.release.sys.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ static inline uint64_t globaltimer_ns(void) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* One block, thread p talks to member p. The previous kernels of the
 * stream have finished (stream order), so their stores to peers are
 * performed; the fence makes them visible before the arrival. */
__global__ void ep_barrier_kernel(mok_k_ep g, uint64_t value, uint64_t timeout_ns,
                                  int share_status, int32_t *status) {
  const int p = threadIdx.x;
  const int32_t mine = *(volatile int32_t *)status;
  if (p < g.world) {
    char *peer = (char *)g.base[p];
    char *own = (char *)g.base[g.rank];
    if (share_status) st_release_s32(peer + g.off.status + 4u * (unsigned)g.rank, mine);
    __threadfence_system();
    st_release_u64(peer + g.off.arrive + 8u * (unsigned)g.rank, value);
    const uint64_t start = globaltimer_ns();
    bool late = false;
    /* after a timeout in this job, arrive (peers may still wait) but do not wait again */
    while (mine != MOK_ETIMEOUT && ld_acquire_u64(own + g.off.arrive + 8u * (unsigned)p) < value) {
      if (globaltimer_ns() - start > timeout_ns) {
        late = true;
        break;
      }
      __nanosleep(200);
    }
    if (late) {
      raise_status(status, MOK_ETIMEOUT);
    } else if (share_status) {
      int32_t theirs = ld_acquire_s32(own + g.off.status + 4u * (unsigned)p);
      if (theirs > 0) raise_status(status, theirs);
    }
  }
  __threadfence_system();
}

extern "C" int mok_k_ep_barrier(const mok_k_ep *g, uint64_t value, uint64_t timeout_ns,
                                int share_status, int32_t *status, mok_k_stream stream) {
  if (!g || !status || g->world < 1 || g->world > MOK_K_EP_MAX_WORLD || g->rank < 0 ||
      g->rank >= g->world)
    return MOK_EINVAL;
  ep_barrier_kernel<<<1, 32 * ((g->world + 31) / 32), 0, stream>>>(*g, value, timeout_ns,
                                                                   share_status, status);
  return mok_k_launch_status();
}

/* ---- job signatures (groups formed through NCCL) ------------------------------ */

__global__ void ep_post_write_kernel(mok_k_ep g, mok_k_ep_post post, int32_t *status) {
  const int i = threadIdx.x;
  int32_t *own = (int32_t *)((char *)g.base[g.rank] + g.off.post);
  if (i < MOK_K_EP_POST_WORDS) own[i] = post.w[i];
  if (i == 0 && post.w[MOK_K_EP_POST_MATCH] > 0) raise_status(status, post.w[MOK_K_EP_POST_MATCH]);
}

extern "C" int mok_k_ep_post_write(const mok_k_ep *g, mok_k_ep_post post, int32_t *status,
                                   mok_k_stream stream) {
  if (!g || !status || g->world < 1 || g->world > MOK_K_EP_MAX_WORLD || g->rank < 0 ||
      g->rank >= g->world)
    return MOK_EINVAL;
  ep_post_write_kernel<<<1, 32, 0, stream>>>(*g, post, status);
  return mok_k_launch_status();
}

/* Thread p reads member p's post (barrier 1 ordered it before this). */
__global__ void ep_post_check_kernel(mok_k_ep g, int32_t *status) {
  const int p = threadIdx.x;
  if (p >= g.world) return;
  const int32_t *mine = (const int32_t *)((const char *)g.base[g.rank] + g.off.post);
  const volatile int32_t *theirs = (const volatile int32_t *)((const char *)g.base[p] + g.off.post);
  const int32_t failed = theirs[MOK_K_EP_POST_MATCH];
  if (failed > 0) {
    raise_status(status, failed);
    return;
  }
  for (int i = 0; i < MOK_K_EP_POST_MATCH; i++)
    if (theirs[i] != mine[i]) {
      raise_status(status, MOK_EINVAL);
      return;
    }
}

extern "C" int mok_k_ep_post_check(const mok_k_ep *g, int32_t *status, mok_k_stream stream) {
  if (!g || !status || g->world < 1 || g->world > MOK_K_EP_MAX_WORLD || g->rank < 0 ||
      g->rank >= g->world)
    return MOK_EINVAL;
  ep_post_check_kernel<<<1, 32 * ((g->world + 31) / 32), 0, stream>>>(*g, status);
  return mok_k_launch_status();
}

/* ---- all-gather of small per-member arrays ------------------------------------ */

__global__ void ep_allgather_kernel(mok_k_ep g, uint64_t off, size_t words, uint32_t *dst) {
  const int p = blockIdx.y;
  const uint32_t *src = (const uint32_t *)((const char *)g.base[p] + off);
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words;
       i += (size_t)gridDim.x * blockDim.x)
    dst[(size_t)p * words + i] = src[i];
}

extern "C" int mok_k_ep_allgather(const mok_k_ep *g, uint64_t off, size_t bytes, void *dst,
                                  mok_k_stream stream) {
  if (!g || !dst || (bytes & 3u) || (off & 3u) || g->world < 1 || g->world > MOK_K_EP_MAX_WORLD)
    return MOK_EINVAL;
  size_t words = bytes / 4u;
  if (!words) return MOK_OK;
  unsigned blocks = (unsigned)((words + 255u) / 256u);
  if (blocks > 64u) blocks = 64u;
  ep_allgather_kernel<<<dim3(blocks, (unsigned)g->world), 256, 0, stream>>>(*g, off, words,
                                                                          (uint32_t *)dst);
  return mok_k_launch_status();
}

/* ---- pull and push ---------------------------------------------------------------- */

/* Copy one row of vecs 16-byte vectors by one warp; src NULL: zeros. Four
 * loads are issued before their stores, so a warp keeps several requests in
 * flight (rows are read from other GPUs: latency, not bandwidth, bounds a
 * warp that waits for each load). */
__device__ static inline void warp_copy_row(uint4 *dst, const uint4 *src, int vecs, int lane) {
  int c = lane;
  for (; c + 96 < vecs; c += 128) {
    uint4 a = src ? src[c] : make_uint4(0, 0, 0, 0), b = src ? src[c + 32] : a,
          d = src ? src[c + 64] : a, e = src ? src[c + 96] : a;
    dst[c] = a;
    dst[c + 32] = b;
    dst[c + 64] = d;
    dst[c + 96] = e;
  }
  for (; c < vecs; c += 32) dst[c] = src ? src[c] : make_uint4(0, 0, 0, 0);
}

/* Where virtual token v's data lives: member v / T_max, token v % T_max. */
__device__ static inline const char *owner_base(const mok_k_ep &g, int v, int *t) {
  const int p = v / g.T_max;
  *t = v - p * g.T_max;
  return (const char *)g.base[p];
}

/* The rows a row kernel walks: all (capacity), or with no_tail those in
 * use (*used: the schedule's offsets[E_loc]). */
__device__ static inline int rows_walked(const int32_t *used, int capacity) {
  return used ? min(max(*used, 0), capacity) : capacity;
}

__global__ void ep_pull_rows_kernel(mok_k_ep g, const int32_t *row_slot, int capacity,
                                    const int32_t *used, int K, int n_slots, int vecs,
                                    uint64_t off, uint4 *dst, const int32_t *status) {
  if (job_failed(status)) return;
  const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int rows = rows_walked(used, capacity);
  for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < rows; r += gridDim.x * warps) {
    const int s = row_slot[r];
    const uint4 *src = NULL;
    if (s >= 0 && s < n_slots) {
      int t;
      const char *b = owner_base(g, s / K, &t);
      src = (const uint4 *)(b + off) + (size_t)t * vecs;
    }
    warp_copy_row(dst + (size_t)r * vecs, src, vecs, lane);
  }
}

static bool ep_ok(const mok_k_ep *g, const mok_k_dims *dv) {
  return g && dv && g->world >= 1 && g->world <= MOK_K_EP_MAX_WORLD && g->T_max > 0 &&
         dv->T == g->world * g->T_max && mok_k_check_dims(dv, NULL, 0) == MOK_OK;
}

extern "C" int mok_k_ep_pull_rows(const mok_k_ep *g, const mok_k_dims *dv,
                                  const int32_t *schedule, uint64_t off, mok_k_bf16 *dst,
                                  int32_t *status, mok_k_stream stream) {
  if (!ep_ok(g, dv) || !schedule || !dst || !status || !mok_k_aligned16(dst) || (off & 15u))
    return MOK_EINVAL;
  sched_ptrs s = sched_view(dv, schedule);
  if (s.capacity == 0) return MOK_OK;
  dim3 grid, block;
  row_launch(g, s.capacity, &grid, &block);
  ep_pull_rows_kernel<<<grid, block, 0, stream>>>(
      *g, s.row_slot, s.capacity, dv->no_tail ? s.offsets + dv->E_loc : NULL, dv->K, s.n_slots,
      dv->H / 8, off, (uint4 *)dst, status);
  return mok_k_launch_status();
}

__global__ void ep_push_rows_kernel(mok_k_ep g, const int32_t *row_slot, int capacity,
                                    const int32_t *used, int K, int n_slots, int vecs,
                                    const uint4 *rows, const float *drw_virtual,
                                    const int32_t *status) {
  if (job_failed(status)) return;
  const int warps = blockDim.x >> 5, lane = threadIdx.x & 31;
  const int n_rows = rows_walked(used, capacity);
  for (int r = blockIdx.x * warps + (threadIdx.x >> 5); r < n_rows; r += gridDim.x * warps) {
    const int s = row_slot[r];
    if (s < 0 || s >= n_slots) continue;
    int t;
    char *b = (char *)owner_base(g, s / K, &t);
    const size_t slot = (size_t)t * K + (size_t)(s % K);
    warp_copy_row((uint4 *)(b + g.off.land) + slot * vecs, rows + (size_t)r * vecs, vecs, lane);
    if (drw_virtual && lane == 0) ((float *)(b + g.off.drw))[slot] = drw_virtual[s];
  }
}

extern "C" int mok_k_ep_push_rows(const mok_k_ep *g, const mok_k_dims *dv,
                                  const int32_t *schedule, const mok_k_bf16 *rows,
                                  const float *drw_virtual, int32_t *status,
                                  mok_k_stream stream) {
  if (!ep_ok(g, dv) || !schedule || !rows || !status || !mok_k_aligned16(rows)) return MOK_EINVAL;
  sched_ptrs s = sched_view(dv, schedule);
  if (s.capacity == 0) return MOK_OK;
  dim3 grid, block;
  row_launch(g, s.capacity, &grid, &block);
  ep_push_rows_kernel<<<grid, block, 0, stream>>>(
      *g, s.row_slot, s.capacity, dv->no_tail ? s.offsets + dv->E_loc : NULL, dv->K, s.n_slots,
      dv->H / 8, (const uint4 *)rows, drw_virtual, status);
  return mok_k_launch_status();
}

/* ---- the member's own tokens ---------------------------------------------------------- */

__global__ void ep_own_slots_kernel(const int32_t *ids, int n, int E, int32_t *slot_row,
                                    int32_t *status) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int id = ids[i];
  if (id < -1 || id >= E) raise_status(status, MOK_EROUTE);
  slot_row[i] = (id >= 0 && id < E) ? i : -1;
}

extern "C" int mok_k_ep_own_slots(const mok_k_dims *d, const int32_t *ids, int32_t *slot_row,
                                  int32_t *status, mok_k_stream stream) {
  if (!d || !ids || !slot_row || !status || d->T < 0 || d->K < 1) return MOK_EINVAL;
  int n = d->T * d->K;
  if (!n) return MOK_OK;
  ep_own_slots_kernel<<<(n + 255) / 256, 256, 0, stream>>>(ids, n, d->E, slot_row, status);
  return mok_k_launch_status();
}

extern "C" int mok_k_ep_ksum(const mok_k_dims *d, const int32_t *slot_row,
                             const mok_k_bf16 *land, const float *rw, const mok_k_bf16 *base,
                             mok_k_bf16 *out, int32_t *status, mok_k_stream stream) {
  if (!d || !slot_row || !land || !out || !status || (d->H & 7) || !mok_k_aligned16(land) ||
      !mok_k_aligned16(base) || !mok_k_aligned16(out))
    return MOK_EINVAL;
  return mok_k_ksum_rows(d, slot_row, d->T * d->K, land, rw, base, out, status, stream);
}

__global__ void ep_own_drw_kernel(const int32_t *slot_row, const float *drw_land, int n,
                                  float *d_rw, const int32_t *status) {
  if (job_failed(status)) return;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) d_rw[i] = slot_row[i] >= 0 ? drw_land[i] : 0.0f;
}

extern "C" int mok_k_ep_own_drw(const mok_k_dims *d, const int32_t *slot_row,
                                const float *drw_land, float *d_rw, int32_t *status,
                                mok_k_stream stream) {
  if (!d || !slot_row || !drw_land || !d_rw || !status) return MOK_EINVAL;
  int n = d->T * d->K;
  if (!n) return MOK_OK;
  ep_own_drw_kernel<<<(n + 255) / 256, 256, 0, stream>>>(slot_row, drw_land, n, d_rw, status);
  return mok_k_launch_status();
}
