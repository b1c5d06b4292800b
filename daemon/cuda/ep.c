/* SPDX-License-Identifier: Apache-2.0 */
/* The cuda engine's expert-parallel layer (docs/ep.md): forward and backward
 * of a layer on a group, with the group's buffers in device memory.
 *
 * Each member allocates one device buffer (mok_k_ep_layout: arrival words,
 * status words, x, d_out, ids, rw, landing rows, landing d_rw) with the VMM
 * API, exportable as a POSIX fd, and serves the fd to its peers
 * (ep/fd_exchange.h). After the first host barrier of a job every member has
 * joined and published its buffer, so a member maps the peers' buffers it
 * does not hold yet (or holds from a mokd that since restarted).
 *
 * A job, rank r (the host part runs on the engine thread, the rest is
 * enqueued on the session's stream and the engine thread goes on):
 *   host:   group usable? post the job's signature; barrier 1 on the host
 *           (the same order and mismatch rules as the cpu engine); map peers
 *   device: copy x, ids (tokens past T: -1), rw [, d_out] into r's buffer;
 *           barrier 1; all-gather ids (and rw); the schedule of the virtual
 *           batch for the local experts; PULL the rows from their owners;
 *           the expert FFN (or its backward); PUSH each result row (and d_rw)
 *           into its owner's unique (t,k) slot; barrier 2 (statuses
 *           exchanged); the shared expert and the ordered K-sum over the own
 *           landing slots.
 * The routed rows go through the same kernels in the same order as a
 * single-daemon job on the members' tokens concatenated (rank-major), so
 * out, d_x, d_rw and the routed weight gradients equal EP=1's bits.
 *
 * An fp8 layer runs on a bf16 group: the buffers carry its bf16 rows, and
 * after the pull each member quantises the routed rows it computes on (one
 * row's 1x128 blocks: the bytes the single-daemon layer copies from its
 * token), runs the fp8 expert kernels on them and pushes bf16 results; its
 * shared expert quantises the own tokens on the side stream. No ring
 * (engine_groups.c refuses fp8 layers on a group with one).
 *
 * The device barriers wait at most the group's timeout; a member that does
 * not arrive fails the job with MOK_ETIMEOUT, and the engine thread then
 * breaks the group. Device barriers need the members' kernels to run at the
 * same time: on one GPU that takes MPS (without it, a waiting barrier only
 * advances when the GPU switches contexts).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "cuda/internal.h"
#include "ep/fd_exchange.h"
#include "ep/group.h"
#include "log.h"
#include "mok_ep_kernels.h"
#include "mok_slots.h"
#include "cuda/nccl.h"

typedef struct mapping {
  CUmemGenericAllocationHandle handle;
  CUdeviceptr va;
  size_t size;
  struct mapping *next; /* retired mappings */
} mapping;

typedef struct peer_map {
  int32_t pid;
  uint64_t serial;
  mapping *m; /* NULL: not mapped */
} peer_map;

typedef struct ep_state {
  mok_engine *e;
  mok_ep_group_sizing sz;
  uint32_t rank;
  uid_t uid;
  mok_k_ep_layout lay;
  mapping own;
  int own_fd;
  uint64_t serial;
  mok_fdx_server *server;
  peer_map peers[MOK_GROUP_MAX_WORLD];
  mapping *retired; /* peers' old buffers, unmapped when the group goes */
  mok_nccl_group *nccl; /* a group formed through NCCL: its window holds the buffers */
} ep_state;

#define FETCH_TIMEOUT_MS 5000u

static void unmap(mok_engine *e, mapping *m) {
  if (m->va) {
    e->drv.unmap(m->va, m->size);
    e->drv.address_free(m->va, m->size);
  }
  if (m->handle) e->drv.release(m->handle);
}

/* Reserve, map and open for this GPU: the one way both our own and the
 * peers' buffers become addressable. */
static CUresult map_here(mok_engine *e, mapping *m, const char **step) {
  *step = "cuMemAddressReserve";
  CUresult cr = e->drv.address_reserve(&m->va, m->size, 0, 0, 0);
  if (cr != CUDA_SUCCESS) {
    m->va = 0;
    return cr;
  }
  *step = "cuMemMap";
  cr = e->drv.map(m->va, m->size, 0, m->handle, 0);
  if (cr == CUDA_SUCCESS) {
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = e->device;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    *step = "cuMemSetAccess (can this GPU reach the peer's?)";
    cr = e->drv.set_access(m->va, m->size, &a, 1);
    if (cr != CUDA_SUCCESS) e->drv.unmap(m->va, m->size);
  }
  if (cr != CUDA_SUCCESS) {
    e->drv.address_free(m->va, m->size);
    m->va = 0;
  }
  return cr;
}

static void state_free(void *arg) {
  ep_state *st = arg;
  mok_engine *e = st->e;
  if (st->nccl) {
    /* a member leaves on its own (its clients left, the linger ran out, its
     * mokd exits): tearing the communicator down collectively would wait
     * for peers that may go on or be gone, so abort it; then destroy waits
     * for this GPU's work and frees the buffer (peers that mapped it keep
     * the memory until they unmap it) */
    mok__cuda_use_device(e);
    mok_nccl_group_abort(st->nccl);
    mok_nccl_group_destroy(st->nccl);
    free(st);
    return;
  }
  mok_fdx_stop(st->server);
  mok__cuda_use_device(e);
  /* nothing of ours may still run against these mappings (a device barrier
   * waits at most the group's timeout) */
  cudaDeviceSynchronize();
  (void)cudaGetLastError();
  for (uint32_t p = 0; p < MOK_GROUP_MAX_WORLD; p++)
    if (st->peers[p].m) {
      unmap(e, st->peers[p].m);
      free(st->peers[p].m);
    }
  while (st->retired) {
    mapping *m = st->retired;
    st->retired = m->next;
    unmap(e, m);
    free(m);
  }
  unmap(e, &st->own);
  if (st->own_fd >= 0) close(st->own_fd);
  free(st);
}

/* Why the cuda engine cannot run a group of this sizing (MOK_OK: it can). */
static int group_fits(const mok_ep_group_sizing *sz, char *err, size_t errlen) {
  if (sz->dtype != MOK_DTYPE_BF16) {
    snprintf(err, errlen, "the cuda engine runs bfloat16 groups only");
    return MOK_EUNSUPPORTED;
  }
  if (sz->world > MOK_K_EP_MAX_WORLD || (sz->hidden & 7u)) {
    snprintf(err, errlen, "the cuda engine runs groups of up to %d members with hidden a "
             "multiple of 8", MOK_K_EP_MAX_WORLD);
    return MOK_EUNSUPPORTED;
  }
  return MOK_OK;
}

/* A group formed through NCCL: every member creates the communicator with
 * the id and registers its buffer as a window; the peers' buffers come
 * mapped (NCCL's LSA pointers). Blocks until every rank joined, at most the
 * group's timeout: the engine thread runs it on a thread of its own. */
void *mok__cuda_group_form(mok_engine *e, const mok_ep_group_form *f, int *status, char *err,
                           size_t errlen) {
  if ((*status = group_fits(&f->sizing, err, errlen)) != MOK_OK) return NULL;
  ep_state *st = calloc(1, sizeof *st);
  if (!st) {
    snprintf(err, errlen, "out of memory");
    *status = MOK_ENOMEM;
    return NULL;
  }
  st->e = e;
  st->sz = f->sizing;
  st->rank = f->rank;
  st->uid = f->uid;
  st->own_fd = -1;
  st->lay = mok_k_ep_layout_of((int)st->sz.max_tokens, (int)st->sz.hidden, (int)st->sz.topk);
  *status = mok_nccl_group_create(f->nccl_id, (int)st->rank, (int)st->sz.world, e->device,
                                  st->lay.bytes, f->timeout_ms, &st->nccl, err, errlen);
  if (*status != MOK_OK) {
    free(st);
    return NULL;
  }
  st->own.va = (CUdeviceptr)mok_nccl_group_bases(st->nccl)[st->rank];
  st->own.size = (size_t)mok_nccl_group_bytes(st->nccl);
  double init_ms = 0, reg_ms = 0;
  mok_nccl_group_timings(st->nccl, &init_ms, &reg_ms);
  log_info("cuda engine: group rank %u of %u formed through NCCL %d (communicator %.0f ms, "
           "window %.0f ms, %zu MiB)",
           st->rank, st->sz.world, mok_nccl_version(), init_ms, reg_ms, st->own.size >> 20);
  return st;
}

/* The id of a group formed through NCCL (the bootstrap root runs in this
 * process until every member joined). */
int mok__cuda_group_new_id(mok_engine *e, uint8_t *id, char *err, size_t errlen) {
  (void)e;
  _Static_assert(MOK_GROUP_NCCL_ID_BYTES == MOK_NCCL_ID_BYTES, "an NCCL unique id");
  return mok_nccl_unique_id(id, err, errlen);
}

void mok__cuda_group_install(mok_engine *e, mok_ep_group *g, void *state) {
  (void)e;
  mok_ep_group_set_engine_state(g, state, state_free, 1);
}

void mok__cuda_group_discard(mok_engine *e, void *state) {
  (void)e;
  if (state) state_free(state);
}

int mok__cuda_group_attach(mok_engine *e, mok_ep_group *g, char *err, size_t errlen) {
  if (mok_ep_group_engine_state(g)) return MOK_OK; /* a re-join: the buffer is there */
  const mok_ep_group_sizing *sz = mok_ep_group_get_sizing(g);
  int fit = group_fits(sz, err, errlen);
  if (fit != MOK_OK) return fit;
  if (mok__cuda_select(e, err, errlen) != MOK_OK) return MOK_EENGINE;
  if (mok_ep_group_is_nccl(g)) { /* formed here, on the calling thread */
    mok_ep_group_form f = mok_ep_group_form_of(g);
    int st_form;
    void *state = mok__cuda_group_form(e, &f, &st_form, err, errlen);
    if (!state) return st_form;
    mok__cuda_group_install(e, g, state);
    return MOK_OK;
  }
  ep_state *st = calloc(1, sizeof *st);
  if (!st) {
    snprintf(err, errlen, "out of memory");
    return MOK_ENOMEM;
  }
  st->e = e;
  st->sz = *sz;
  st->rank = mok_ep_group_rank(g);
  st->uid = mok_ep_group_uid(g);
  st->own_fd = -1;
  st->lay = mok_k_ep_layout_of((int)sz->max_tokens, (int)sz->hidden, (int)sz->topk);

  CUmemAllocationProp prop = mok__cuda_vmm_fd_prop(e);
  size_t gran = 0;
  const char *step = "cuMemGetAllocationGranularity";
  CUresult cr = e->drv.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
  if (cr == CUDA_SUCCESS) {
    st->own.size = (size_t)((st->lay.bytes + gran - 1) / gran * gran);
    step = "cuMemCreate";
    cr = e->drv.mem_create(&st->own.handle, st->own.size, &prop, 0);
    if (cr != CUDA_SUCCESS) st->own.handle = 0;
  }
  if (cr == CUDA_SUCCESS) cr = map_here(e, &st->own, &step);
  if (cr == CUDA_SUCCESS) {
    step = "cuMemExportToShareableHandle";
    cr = e->drv.export_handle(&st->own_fd, st->own.handle,
                              CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (cr != CUDA_SUCCESS) st->own_fd = -1;
  }
  if (cr != CUDA_SUCCESS) {
    snprintf(err, errlen, "cuda engine: the group's device buffer (%zu MiB): %s: %s",
             st->own.size >> 20, step, mok__cuda_drv_error(e, cr));
    state_free(st);
    return cr == CUDA_ERROR_OUT_OF_MEMORY ? MOK_ENOMEM : MOK_EENGINE;
  }
  /* arrival words start at 0: below every barrier value */
  cudaError_t r = cudaMemsetAsync((void *)(uintptr_t)st->own.va, 0, st->own.size, e->mem_stream);
  if (r == cudaSuccess) r = cudaStreamSynchronize(e->mem_stream);
  if (r != cudaSuccess) {
    snprintf(err, errlen, "cuda engine: clearing the group's buffer: %s", cudaGetErrorString(r));
    state_free(st);
    return MOK_EENGINE;
  }
  while (st->serial == 0)
    if (getrandom(&st->serial, sizeof st->serial, 0) != sizeof st->serial) {
      snprintf(err, errlen, "getrandom: %s", strerror(errno));
      state_free(st);
      return MOK_EENGINE;
    }
  char name[MOK_FDX_NAME_MAX];
  mok_fdx_name(name, sizeof name, st->uid, st->rank, st->serial);
  int rc = mok_fdx_serve(name, st->own_fd, st->own.size, &st->server, err, errlen);
  if (rc != MOK_OK) {
    state_free(st);
    return rc;
  }
  mok_ep_group_set_engine_state(g, st, state_free, st->serial);
  log_info("cuda engine: group rank %u: %zu MiB device buffer, served as @%s", st->rank,
           st->own.size >> 20, name);
  return MOK_OK;
}

/* Map every peer's current buffer (after barrier 1: all have joined). */
static int map_peers(ep_state *st, mok_ep_group *g, mok_k_ep *kg, char *err, size_t errlen) {
  mok_engine *e = st->e;
  kg->world = (int)st->sz.world;
  kg->rank = (int)st->rank;
  kg->T_max = (int)st->sz.max_tokens;
  kg->off = st->lay;
  memset(kg->base, 0, sizeof kg->base);
  kg->base[st->rank] = st->own.va;
  for (uint32_t p = 0; p < st->sz.world; p++) {
    if (p == st->rank) continue;
    mok_ep_group_peer who = mok_ep_group_peer_of(g, p);
    peer_map *pm = &st->peers[p];
    if (!who.joined || !who.pid || !who.dev_serial) {
      snprintf(err, errlen, "rank %u has no device buffer (is its mokd a cuda engine?)", p);
      return MOK_EINVAL;
    }
    if (pm->m && pm->pid == who.pid && pm->serial == who.dev_serial) {
      kg->base[p] = pm->m->va;
      continue;
    }
    if (pm->m) { /* the rank's mokd was replaced: keep the old mapping until we go */
      pm->m->next = st->retired;
      st->retired = pm->m;
      pm->m = NULL;
    }
    char name[MOK_FDX_NAME_MAX];
    mok_fdx_name(name, sizeof name, st->uid, p, who.dev_serial);
    int fd = -1;
    uint64_t size = 0;
    int rc = mok_fdx_fetch(name, who.pid, FETCH_TIMEOUT_MS, &fd, &size, err, errlen);
    if (rc != MOK_OK) return rc;
    if (size != st->own.size) {
      close(fd);
      snprintf(err, errlen, "rank %u's device buffer has %llu bytes, ours %zu (mokd builds differ?)",
               p, (unsigned long long)size, st->own.size);
      return MOK_EINVAL;
    }
    mapping *m = calloc(1, sizeof *m);
    if (!m) {
      close(fd);
      snprintf(err, errlen, "out of memory");
      return MOK_ENOMEM;
    }
    m->size = size;
    const char *step = "cuMemImportFromShareableHandle";
    CUresult cr = e->drv.import_handle(&m->handle, (void *)(intptr_t)fd,
                                       CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    close(fd);
    if (cr == CUDA_SUCCESS) cr = map_here(e, m, &step);
    else m->handle = 0;
    if (cr != CUDA_SUCCESS) {
      unmap(e, m);
      free(m);
      snprintf(err, errlen, "mapping rank %u's device buffer: %s: %s", p, step,
               mok__cuda_drv_error(e, cr));
      return MOK_EENGINE;
    }
    pm->m = m;
    pm->pid = who.pid;
    pm->serial = who.dev_serial;
    kg->base[p] = m->va;
    log_info("cuda engine: group rank %u mapped rank %u's buffer (mokd %d)", st->rank, p,
             (int)who.pid);
  }
  return MOK_OK;
}

/* ---- one job --------------------------------------------------------------------------- */


typedef struct ep_job {
  job_ctx *c;
  mok_ep_group *g;
  ep_state *st;
  mok_k_ep kg;
  mok_k_dims dv;      /* the virtual batch's routed part */
  mok_layout_dims lv; /* its layout */
  char *own;          /* this member's buffer */
  int32_t *own_ids;   /* the own routing ids, copied into it: what this job routes by */
  int32_t *sched;     /* the virtual schedule every kernel reads (the workspace's) */
  int32_t *ctx_sched; /* the client's ctx: the schedule's copy (written, or copied in) */
  int32_t *ctx_ids;   /* the client's ctx: the own ids' copy */
  acts_ptrs acts;     /* routed acts of the virtual batch, shared acts of the own tokens */
  uint64_t timeout_ns;
  bool side; /* work is on the side stream: join before the job ends */
  bool profile; /* MOK_CUDA_PROFILE=1: phase marks */
} ep_job;

static void fill_async(job_ctx *c, void *dst, int byte, size_t bytes) {
  if (c->failed || !bytes) return;
  cudaError_t r = cudaMemsetAsync(dst, byte, bytes, c->st);
  if (r != cudaSuccess)
    mok__cuda_job_fail(c, MOK_EENGINE, "cudaMemsetAsync: %s", cudaGetErrorString(r));
}

/* ctx of a group layer (mok_wire.h): virtual schedule | own ids | acts.
 * The kernels read the schedule from the workspace only; ctx (NULL: the
 * job brings none, its acts go to the workspace) keeps copies. */
static void group_ctx(ep_job *j, void *ctx, bool writing) {
  job_ctx *c = j->c;
  const mok_layer_config *cfg = c->a->layer;
  uint32_t T = c->a->tokens;
  const mok_layout_dims lv = j->lv;
  uint64_t sched_bytes = mok_schedule_bytes(&lv), ids_off = mok_group_ctx_ids_offset(cfg),
           ids_bytes = 4ull * T * cfg->topk, acts_off = mok_group_ctx_acts_offset(cfg, T);
  uint64_t routed = mok_acts_routed_bytes(&lv), shared = mok_acts_shared_bytes(&c->ld);
  char *b = ctx ? (char *)ctx : NULL;
  char *acts = ctx ? b + acts_off : (char *)c->w.acts;
  j->sched = c->w.sched;
  j->ctx_sched = ctx ? (int32_t *)b : NULL;
  j->ctx_ids = ctx ? (int32_t *)(b + ids_off) : NULL;
  j->own_ids = (int32_t *)(j->own + j->kg.off.ids);
  j->acts.g = (uint16_t *)acts;
  j->acts.u = (uint16_t *)(acts + routed);
  j->acts.gs = (uint16_t *)(acts + 2 * routed);
  j->acts.us = (uint16_t *)(acts + 2 * routed + shared);
  if (writing && ctx) { /* the padding is part of the bytes a client keeps: define it */
    size_t routed_used = (size_t)mok_rows_capacity(&lv) * cfg->intermediate * 2;
    size_t shared_used = (size_t)T * cfg->shared_intermediate * 2;
    mok__cuda_memset_async(c, b + sched_bytes, ids_off - sched_bytes);
    mok__cuda_memset_async(c, b + ids_off + ids_bytes, acts_off - ids_off - ids_bytes);
    mok__cuda_memset_async(c, (char *)j->acts.g + routed_used, routed - routed_used);
    mok__cuda_memset_async(c, (char *)j->acts.u + routed_used, routed - routed_used);
    mok__cuda_memset_async(c, (char *)j->acts.gs + shared_used, shared - shared_used);
    mok__cuda_memset_async(c, (char *)j->acts.us + shared_used, shared - shared_used);
  }
}

/* This member's tokens into its buffer: rows, routing (tokens past T route
 * nowhere: ids -1, every byte 0xff) and router weights. From here on the
 * job routes by the buffer's ids (j->own_ids), never by the client's. */
static void copy_in(ep_job *j, const int32_t *ids, bool with_d_out) {
  job_ctx *c = j->c;
  size_t T = c->a->tokens, Tm = j->st->sz.max_tokens, H = c->d.H, K = c->d.K;
  mok__cuda_copy_async(c, j->own + j->kg.off.x, BF(c, X), T * H * 2);
  if (with_d_out) mok__cuda_copy_async(c, j->own + j->kg.off.d_out, BF(c, D_OUT), T * H * 2);
  mok__cuda_copy_async(c, j->own + j->kg.off.ids, ids, T * K * 4);
  fill_async(c, j->own + j->kg.off.ids + T * K * 4, 0xff, (Tm - T) * K * 4);
  mok__cuda_copy_async(c, j->own + j->kg.off.rw, T_(c, MOK_SLOT_ROUTER_W), T * K * 4);
}

/* After the virtual schedule was built in the workspace: the client's ctx
 * gets copies of it and of the own ids. */
static void ctx_out(ep_job *j) {
  job_ctx *c = j->c;
  if (!j->ctx_sched) return;
  mok__cuda_copy_async(c, j->ctx_sched, j->sched, (size_t)mok_schedule_bytes(&j->lv));
  mok__cuda_copy_async(c, j->ctx_ids, j->own_ids, (size_t)c->a->tokens * c->d.K * 4);
}

/* A group formed through NCCL gets a zeroed window and sequence 0 with
 * every formation, on every member alike: generation 1 names them all
 * (members' generation counters differ: they count this daemon's forms). */
static uint64_t barrier_value(const mok_ep_group *g, uint32_t phase) {
  uint64_t gen = mok_ep_group_is_nccl(g) ? 1 : mok_ep_group_generation(g);
  return gen << 40 | mok_ep_group_sequence(g) << 2 | phase;
}

/* The host half: signatures and barrier 1 on the host, then the peers'
 * buffers. false: the job failed (c says why) and nothing more is enqueued. */
static bool host_protocol(ep_job *j, int own_status, const char *own_msg) {
  job_ctx *c = j->c;
  char err[MOK_JOB_MESSAGE_MAX];
  mok_ep_group_post post =
      mok_ep_group_post_for(c->a->layer, c->a->op, c->a->flags, c->a->tokens);
  post.status = own_status;
  if (own_msg) snprintf(post.msg, sizeof post.msg, "%s", own_msg);
  int r = mok_ep_group_job_post(j->g, &post, err, sizeof err);
  if (r != MOK_OK) {
    c->failed = false; /* the group's verdict replaces a local message */
    mok__cuda_job_fail(c, r, "%s", err);
    return false;
  }
  if (own_status != MOK_OK) return false;
  r = map_peers(j->st, j->g, &j->kg, err, sizeof err);
  if (r != MOK_OK) {
    /* the peers passed barrier 1 and will wait for us on the device */
    mok_ep_group_mark_broken(j->g, err);
    mok__cuda_job_fail(c, r, "%s; the group is broken until its members re-join", err);
    return false;
  }
  return true;
}

/* A group formed through NCCL: the peers' buffers are the window's, mapped
 * for the group's life. */
static void nccl_peers(const ep_state *st, mok_k_ep *kg) {
  kg->world = (int)st->sz.world;
  kg->rank = (int)st->rank;
  kg->T_max = (int)st->sz.max_tokens;
  kg->off = st->lay;
  memset(kg->base, 0, sizeof kg->base);
  const uint64_t *b = mok_nccl_group_bases(st->nccl);
  for (uint32_t p = 0; p < st->sz.world; p++) kg->base[p] = b[p];
}

static void device_barrier(ep_job *j, uint32_t phase);

/* The protocol of a group formed through NCCL, on the device (no host
 * segment: members may be on other hosts): post the job's signature into
 * the own buffer; after barrier 1 every member compares every post
 * (mok_k_ep_post_check, in the job's flow). A member whose own checks
 * failed still takes its turn, both barriers with its status, so that its
 * peers fail the job with it instead of waiting. */
static bool device_protocol(ep_job *j, int own_status) {
  job_ctx *c = j->c;
  char err[MOK_JOB_MESSAGE_MAX];
  mok_ep_group_post post =
      mok_ep_group_post_for(c->a->layer, c->a->op, c->a->flags, c->a->tokens);
  int r = mok_ep_group_job_post(j->g, &post, err, sizeof err); /* usable? the sequence */
  if (r != MOK_OK) {
    c->failed = false;
    mok__cuda_job_fail(c, r, "%s", err);
    return false;
  }
  nccl_peers(j->st, &j->kg);
  c->j->device_posts = true;
  log_debug("cuda engine: group rank %u job %llu (%s tag %u): posted on the device%s",
            j->st->rank, (unsigned long long)post.seq, mok_op_name(post.op), post.tag,
            own_status == MOK_OK ? "" : ", failed here");
  mok_k_ep_post kp;
  memset(&kp, 0, sizeof kp);
  kp.w[0] = (int32_t)post.seq;
  kp.w[1] = (int32_t)(post.op | post.dtype << 16); /* the layer's dtype: one of the compared words */
  kp.w[2] = (int32_t)post.flags;
  kp.w[3] = (int32_t)post.tag;
  kp.w[4] = (int32_t)post.intermediate;
  kp.w[5] = (int32_t)post.shared_intermediate;
  kp.w[6] = (int32_t)post.has_limit;
  memcpy(&kp.w[7], &post.swiglu_limit, 4);
  kp.w[MOK_K_EP_POST_MATCH] = own_status;
  if (own_status == MOK_OK) {
    LAUNCH(c, mok_k_ep_post_write(&j->kg, kp, c->status, c->st));
    return true;
  }
  /* the job already failed here (c->failed, or a NOP taking the turn):
   * launch past LAUNCH's guard, from a clean status word (the post raises
   * this member's status into it, barrier 2 shares it) */
  j->timeout_ns = (uint64_t)mok_ep_group_timeout_ms(j->g) * 1000000ull;
  int a = cudaMemsetAsync(c->status, 0, sizeof(int32_t), c->st) == cudaSuccess ? MOK_OK
                                                                               : MOK_EENGINE;
  if (a == MOK_OK) a = mok_k_ep_post_write(&j->kg, kp, c->status, c->st);
  if (a == MOK_OK)
    a = mok_k_ep_barrier(&j->kg, barrier_value(j->g, 1), j->timeout_ns, 0, c->status, c->st);
  if (a == MOK_OK)
    a = mok_k_ep_barrier(&j->kg, barrier_value(j->g, 2), j->timeout_ns, 1, c->status, c->st);
  if (a != MOK_OK) log_warn("cuda engine: a failed group job could not take its turn (%d)", a);
  return false;
}

/* This member's turn in a job's protocol: on the host (a group on this
 * host's segment) or on the device (formed through NCCL). false: the job
 * failed (c says why) and nothing more is enqueued. */
static bool group_turn(ep_job *j, int own_status, const char *own_msg) {
  if (mok_ep_group_is_nccl(j->g)) return device_protocol(j, own_status);
  return host_protocol(j, own_status, own_msg);
}

/* The shared expert needs only the own tokens: it runs on the session's side
 * stream, beside the barriers, the exchange and the routed GEMMs, and joins
 * the main stream before the K-sum (its own workspace: the routed kernels
 * use the layer's). */
static void side_begin(ep_job *j) {
  job_ctx *c = j->c;
  if (c->failed || !c->d.I_s) return;
  cudaError_t r = cudaEventRecord(c->s->fork_ev, c->st);
  if (r == cudaSuccess) r = cudaStreamWaitEvent(c->s->aux, c->s->fork_ev, 0);
  if (r != cudaSuccess) mok__cuda_job_fail(c, MOK_EENGINE, "forking the side stream: %s",
                                           cudaGetErrorString(r));
  else j->side = true;
}

static void side_end(ep_job *j) {
  if (!j->side) return;
  job_ctx *c = j->c;
  j->side = false;
  cudaError_t r = cudaEventRecord(c->s->join_ev, c->s->aux);
  if (r == cudaSuccess) r = cudaStreamWaitEvent(c->st, c->s->join_ev, 0);
  if (r != cudaSuccess) {
    /* the main stream must not run ahead of the side stream's writes */
    cudaStreamSynchronize(c->s->aux);
    mok__cuda_job_fail(c, MOK_EENGINE, "joining the side stream: %s", cudaGetErrorString(r));
  }
}

#define MARK(j, name)                                                                         \
  do {                                                                                        \
    if ((j)->profile) mok__cuda_mark((j)->c, (name));                                              \
  } while (0)

static void device_barrier(ep_job *j, uint32_t phase) {
  LAUNCH(j->c, mok_k_ep_barrier(&j->kg, barrier_value(j->g, phase), j->timeout_ns, phase == 2,
                                j->c->status, j->c->st));
}

/* After the expert step: push the result rows (and d_rw) into their owners'
 * slots (rows NULL: a ring pushed each macrobatch already), wait for every
 * member's pushes, join the side stream, and view the own landing slots
 * through the own routing ids (into the workspace's ep_own). */
static void exchange_back(ep_job *j, const uint16_t *rows, const float *drw_virtual) {
  job_ctx *c = j->c;
  if (rows) {
    MARK(j, "experts");
    LAUNCH(c, mok_k_ep_push_rows(&j->kg, &j->dv, j->sched, rows, drw_virtual, c->status, c->st));
  }
  MARK(j, "push");
  device_barrier(j, 2);
  MARK(j, "barrier-2");
  side_end(j);
  MARK(j, "shared-join");
  LAUNCH(c, mok_k_ep_own_slots(&c->d, j->own_ids, c->w.ep_own, c->status, c->st));
}

/* ---- the ring: the routed part in macrobatches (mok_ring.cu) ----------------
 *
 * With a ring the routed buffers hold ring_rows rows. Every macrobatch the
 * worst case could need is launched; the plan (built on the device from the
 * schedule) leaves those past the last empty. Each one pulls its rows, runs
 * the experts on its own schedule and pushes its results; the activations
 * move between the ring and their rows of the ctx, which keeps them all. */
/* The plan of the job's macrobatches, from its schedule. */
static void ring_plan(ep_job *j) {
  job_ctx *c = j->c;
  LAUNCH(c, mok_k_ring_plan(&j->dv, j->sched, c->l->ring_rows, c->l->ring_batches,
                            c->w.ring_plan, c->status, c->st));
}

/* Macrobatch m's schedule, and its x rows pulled into routed_a. */
static void ring_batch_begin(ep_job *j, int m, const mok_k_dims *dr) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  LAUNCH(c, mok_k_ring_schedule(&j->dv, j->sched, w->ring_plan, m, dr, w->ring_sched, c->st));
  LAUNCH(c, mok_k_ep_pull_rows(&j->kg, dr, w->ring_sched, j->kg.off.x, w->routed_a, c->status,
                               c->st));
}

static void ring_forward(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  mok_k_dims dr = mok__cuda_ring_dims(c->a->layer);
  ring_plan(j);
  for (int m = 0; m < c->l->ring_batches && !c->failed; m++) {
    ring_batch_begin(j, m, &dr);
    LAUNCH(c, mok_k_expert_forward(&dr, w->ring_sched, w->routed_a, BF(c, W_GATE), BF(c, W_UP),
                                   BF(c, W_DOWN), w->ring_g, w->ring_u, w->routed_b, w->kernels,
                                   c->status, c->st));
    LAUNCH(c, mok_k_ring_copy_acts(w->ring_plan, m, c->l->ring_rows, dr.I, j->acts.g, j->acts.u,
                                   w->ring_g, w->ring_u, 1, c->st));
    LAUNCH(c, mok_k_ep_push_rows(&j->kg, &dr, w->ring_sched, w->routed_b, NULL, c->status,
                                 c->st));
  }
  LAUNCH(c, mok_k_acts_zero_tail(&j->dv, j->sched, j->acts.g, j->acts.u, c->st));
  MARK(j, "ring");
}

/* Backward's routed part: j->sched is built (recompute) or validated. */
static void ring_backward(ep_job *j, bool recompute, const uint16_t *wg, const uint16_t *wu,
                          const uint16_t *wd) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  mok_k_dims dr = mok__cuda_ring_dims(c->a->layer);
  ring_plan(j);
  for (int m = 0; m < c->l->ring_batches && !c->failed; m++) {
    ring_batch_begin(j, m, &dr);
    if (recompute) /* the gate/up GEMM again, bitwise as forward; acts back to the ctx */
      LAUNCH(c, mok_k_gate_up_swiglu(&dr, w->ring_sched, w->routed_a, BF(c, W_GATE), BF(c, W_UP),
                                     w->ring_g, w->ring_u, w->routed_c, c->status, c->st));
    LAUNCH(c, mok_k_ring_copy_acts(w->ring_plan, m, c->l->ring_rows, dr.I, j->acts.g, j->acts.u,
                                   w->ring_g, w->ring_u, recompute, c->st));
    LAUNCH(c, mok_k_ep_pull_rows(&j->kg, &dr, w->ring_sched, j->kg.off.d_out, w->routed_b,
                                 c->status, c->st));
    LAUNCH(c, mok_k_expert_backward_experts(&dr, w->ring_sched, w->ring_g, w->ring_u,
                                            w->routed_a, w->routed_b, w->ep_rw, wg, wu, wd,
                                            w->routed_c, w->ep_drw, BF(c, D_W_GATE),
                                            BF(c, D_W_UP), BF(c, D_W_DOWN), w->ring_plan + 4 * m,
                                            w->kernels, c->status, c->st));
    LAUNCH(c, mok_k_ep_push_rows(&j->kg, &dr, w->ring_sched, w->routed_c, w->ep_drw, c->status,
                                 c->st));
  }
  if (recompute) LAUNCH(c, mok_k_acts_zero_tail(&j->dv, j->sched, j->acts.g, j->acts.u, c->st));
  MARK(j, "ring");
}

/* ---- fp8 layers (docs/math.md "FP8"): the routed rows quantised after the pull ---- */

static bool fp8_layer(const job_ctx *c) { return c->a->layer->dtype == MOK_DTYPE_FP8_E4M3; }

/* The routed rows of the virtual batch (bf16, pulled) quantised per row into
 * the workspace's f8_rq, f8_rs. Every row of the capacity: those past the
 * rows in use hold whatever they held, and the fp8 products never read them
 * (a row past its expert's rows gets scale 0, a tile past the last expert
 * loads nothing). */
static void fp8_quantize_routed(ep_job *j, const uint16_t *rows) {
  job_ctx *c = j->c;
  LAUNCH(c, mok_k_fp8_quantize_rows(rows, (int)mok_k_rows_capacity(&j->dv), c->d.H, c->w.f8_rq,
                                    c->w.f8_rs, c->st));
}

/* The shared expert's forward on the side stream: bf16, or fp8 on the own
 * tokens quantised there (f8_tq, f8_ts: the side stream's alone). */
static void shared_forward_side(ep_job *j, uint16_t *y) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  if (!fp8_layer(c)) {
    LAUNCH(c, mok_k_shared_forward(&c->d, BF(c, X), BF(c, S_GATE), BF(c, S_UP), BF(c, S_DOWN),
                                   j->acts.gs, j->acts.us, y, w->kernels_aux, c->status,
                                   c->s->aux));
    return;
  }
  LAUNCH(c, mok_k_fp8_quantize_rows(BF(c, X), c->d.T, c->d.H, w->f8_tq, w->f8_ts, c->s->aux));
  LAUNCH(c, mok_k_fp8_shared_forward(&c->d, w->f8_tq, w->f8_ts, T_(c, MOK_SLOT_S_GATE),
                                     T_(c, MOK_SLOT_S_UP), T_(c, MOK_SLOT_S_DOWN), j->acts.gs,
                                     j->acts.us, y, w->kernels_aux, c->status, c->s->aux));
}

static void shared_backward_side(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  if (!fp8_layer(c)) {
    LAUNCH(c, mok_k_shared_backward(&c->d, BF(c, X), BF(c, D_OUT), j->acts.gs, j->acts.us,
                                    BF(c, S_GATE), BF(c, S_UP), BF(c, S_DOWN), w->shared,
                                    BF(c, D_S_GATE), BF(c, D_S_UP), BF(c, D_S_DOWN),
                                    w->kernels_aux, c->status, c->s->aux));
    return;
  }
  LAUNCH(c,
         mok_k_fp8_quantize_rows(BF(c, D_OUT), c->d.T, c->d.H, w->f8_tq, w->f8_ts, c->s->aux));
  LAUNCH(c, mok_k_fp8_shared_backward(&c->d, BF(c, X), BF(c, D_OUT), w->f8_tq, w->f8_ts,
                                      j->acts.gs, j->acts.us, T_(c, MOK_SLOT_S_GATE),
                                      T_(c, MOK_SLOT_S_UP), T_(c, MOK_SLOT_S_DOWN), w->shared,
                                      BF(c, D_S_GATE), BF(c, D_S_UP), BF(c, D_S_DOWN),
                                      w->kernels_aux, c->status, c->s->aux));
}

/* The local experts' forward on the pulled rows (routed_a) into routed_b. */
static void experts_forward(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  if (!fp8_layer(c)) {
    LAUNCH(c, mok_k_expert_forward(&j->dv, j->sched, w->routed_a, BF(c, W_GATE), BF(c, W_UP),
                                   BF(c, W_DOWN), j->acts.g, j->acts.u, w->routed_b, w->kernels,
                                   c->status, c->st));
    return;
  }
  fp8_quantize_routed(j, w->routed_a);
  LAUNCH(c, mok_k_fp8_expert_forward(&j->dv, j->sched, w->f8_rq, w->f8_rs, T_(c, MOK_SLOT_W_GATE),
                                     T_(c, MOK_SLOT_W_UP), T_(c, MOK_SLOT_W_DOWN), j->acts.g,
                                     j->acts.u, w->routed_b, w->kernels, c->status, c->st));
}

/* Backward with recompute: the gate/up product again on the pulled x rows,
 * bitwise as forward (g, u into the acts). */
static void experts_recompute(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  if (!fp8_layer(c)) {
    LAUNCH(c, mok_k_gate_up_swiglu(&j->dv, j->sched, w->routed_a, BF(c, W_GATE), BF(c, W_UP),
                                   j->acts.g, j->acts.u, w->routed_c, c->status, c->st));
    return;
  }
  fp8_quantize_routed(j, w->routed_a);
  LAUNCH(c, mok_k_fp8_gate_up(&j->dv, j->sched, w->f8_rq, w->f8_rs, T_(c, MOK_SLOT_W_GATE),
                              T_(c, MOK_SLOT_W_UP), j->acts.g, j->acts.u, w->kernels, c->status,
                              c->st));
}

/* The local experts' backward on the pulled x (routed_a) and d_out
 * (routed_b) rows: d_x rows into routed_c, d_rw per virtual slot. */
static void experts_backward(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  if (!fp8_layer(c)) {
    const uint16_t *wg = BF(c, W_GATE), *wu = BF(c, W_UP), *wd = BF(c, W_DOWN);
    mok__cuda_stage_weights(c, &wg, &wu, &wd);
    LAUNCH(c, mok_k_expert_backward(&j->dv, j->sched, j->acts.g, j->acts.u, w->routed_a,
                                    w->routed_b, w->ep_rw, wg, wu, wd, w->routed_c, w->ep_drw,
                                    BF(c, D_W_GATE), BF(c, D_W_UP), BF(c, D_W_DOWN), w->kernels,
                                    c->status, c->st));
    return;
  }
  fp8_quantize_routed(j, w->routed_b);
  LAUNCH(c, mok_k_fp8_expert_backward(
                &j->dv, j->sched, j->acts.g, j->acts.u, NULL, w->routed_a, w->routed_b, w->f8_rq,
                w->f8_rs, w->ep_rw, T_(c, MOK_SLOT_W_GATE), T_(c, MOK_SLOT_W_UP),
                T_(c, MOK_SLOT_W_DOWN), w->routed_c, w->ep_drw, BF(c, D_W_GATE), BF(c, D_W_UP),
                BF(c, D_W_DOWN), w->kernels, c->status, c->st));
}

static void ep_forward(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  void *ctx = T_(c, MOK_SLOT_CTX);
  group_ctx(j, ctx, ctx != NULL);
  MARK(j, "start");
  copy_in(j, (const int32_t *)T_(c, MOK_SLOT_TOPK_IDS), false);
  if (!group_turn(j, MOK_OK, NULL)) return;
  MARK(j, "copy-in");
  side_begin(j);
  if (j->side) shared_forward_side(j, w->shared);
  device_barrier(j, 1);
  if (mok_ep_group_is_nccl(j->g)) LAUNCH(c, mok_k_ep_post_check(&j->kg, c->status, c->st));
  MARK(j, "barrier-1");
  size_t Tm = j->st->sz.max_tokens, K = c->d.K;
  LAUNCH(c, mok_k_ep_allgather(&j->kg, j->kg.off.ids, Tm * K * 4, w->ep_ids, c->st));
  LAUNCH(c, mok_k_schedule_build(&j->dv, w->ep_ids, j->sched, w->kernels, c->status, c->st));
  ctx_out(j);
  MARK(j, "schedule");
  if (c->l->ring_rows) {
    ring_forward(j);
    exchange_back(j, NULL, NULL);
  } else {
    LAUNCH(c, mok_k_ep_pull_rows(&j->kg, &j->dv, j->sched, j->kg.off.x, w->routed_a, c->status,
                                 c->st));
    MARK(j, "pull");
    experts_forward(j);
    /* the kernels skip the rows past those in use (no_tail): define them */
    LAUNCH(c, mok_k_acts_zero_tail(&j->dv, j->sched, j->acts.g, j->acts.u, c->st));
    exchange_back(j, w->routed_b, NULL);
  }
  /* the own tokens: the ordered K-sum of the landing rows and the shared expert's */
  LAUNCH(c, mok_k_ep_ksum(&c->d, w->ep_own, (const uint16_t *)(j->own + j->kg.off.land),
                          (const float *)T_(c, MOK_SLOT_ROUTER_W), c->d.I_s ? w->shared : NULL,
                          BF(c, OUT), c->status, c->st));
  MARK(j, "k-sum");
}

static void ep_backward(ep_job *j) {
  job_ctx *c = j->c;
  const job_ws *w = &c->w;
  const bool recompute = (c->a->flags & MOK_JOB_RECOMPUTE) != 0;
  void *ctx = T_(c, MOK_SLOT_CTX);
  if (!recompute && !ctx) {
    mok__cuda_job_fail(c, MOK_EINVAL, "backward needs the forward's ctx, or the recompute flag");
    (void)group_turn(j, MOK_EINVAL, c->j->message); /* the peers fail it with us */
    return;
  }
  group_ctx(j, ctx, recompute && ctx);
  /* own routing: the job's ids with recompute, else the forward's copy in
   * ctx; either way copied into the buffer first, and used from there */
  const int32_t *ids = recompute ? (const int32_t *)T_(c, MOK_SLOT_TOPK_IDS) : j->ctx_ids;
  size_t Tm = j->st->sz.max_tokens, K = c->d.K;
  MARK(j, "start");
  copy_in(j, ids, true);
  /* a schedule from the ctx: copied in now, validated after barrier 1 */
  if (!recompute)
    mok__cuda_copy_async(c, j->sched, j->ctx_sched, (size_t)mok_schedule_bytes(&j->lv));
  if (!group_turn(j, MOK_OK, NULL)) return;
  MARK(j, "copy-in");
  side_begin(j);
  if (j->side) {
    if (recompute) shared_forward_side(j, w->shared); /* its y only a scratch */
    shared_backward_side(j);
  }
  device_barrier(j, 1);
  if (mok_ep_group_is_nccl(j->g)) LAUNCH(c, mok_k_ep_post_check(&j->kg, c->status, c->st));
  MARK(j, "barrier-1");
  LAUNCH(c, mok_k_ep_allgather(&j->kg, j->kg.off.rw, Tm * K * 4, w->ep_rw, c->st));
  if (recompute) { /* dispatch again, bitwise as forward */
    LAUNCH(c, mok_k_ep_allgather(&j->kg, j->kg.off.ids, Tm * K * 4, w->ep_ids, c->st));
    LAUNCH(c, mok_k_schedule_build(&j->dv, w->ep_ids, j->sched, w->kernels, c->status, c->st));
    ctx_out(j);
  } else {
    LAUNCH(c, mok_k_schedule_validate(&j->dv, j->sched, c->status, c->st));
  }
  if (c->l->ring_rows) {
    const uint16_t *wg = BF(c, W_GATE), *wu = BF(c, W_UP), *wd = BF(c, W_DOWN);
    mok__cuda_stage_weights(c, &wg, &wu, &wd);
    ring_backward(j, recompute, wg, wu, wd);
    exchange_back(j, NULL, w->ep_drw);
  } else {
    LAUNCH(c, mok_k_ep_pull_rows(&j->kg, &j->dv, j->sched, j->kg.off.x, w->routed_a, c->status,
                                 c->st));
    if (recompute) { /* the gate/up GEMM again, bitwise as forward */
      experts_recompute(j);
      LAUNCH(c, mok_k_acts_zero_tail(&j->dv, j->sched, j->acts.g, j->acts.u, c->st));
    }
    LAUNCH(c, mok_k_ep_pull_rows(&j->kg, &j->dv, j->sched, j->kg.off.d_out, w->routed_b,
                                 c->status, c->st));
    MARK(j, recompute ? "pull+recompute" : "pull");
    experts_backward(j);
    exchange_back(j, w->routed_c, w->ep_drw);
  }
  /* the own tokens: ordered K-sum of d_x (with the shared expert's), the own d_rw */
  LAUNCH(c, mok_k_ep_ksum(&c->d, w->ep_own, (const uint16_t *)(j->own + j->kg.off.land), NULL,
                          c->d.I_s ? w->shared : NULL, BF(c, D_X), c->status, c->st));
  LAUNCH(c, mok_k_ep_own_drw(&c->d, w->ep_own, (const float *)(j->own + j->kg.off.drw),
                             (float *)T_(c, MOK_SLOT_D_RW), c->status, c->st));
  MARK(j, "k-sum");
}

/* Why this job cannot run on g here (MOK_OK: it can). */
static int job_fits(const job_ctx *c, const mok_ep_group *g, const ep_state *st, char *msg,
                    size_t len) {
  const mok_layer_config *cfg = c->a->layer;
  const mok_ep_group_sizing *sz = mok_ep_group_get_sizing(g);
  if (!st) {
    snprintf(msg, len, "the group has no device buffer on this mokd");
    return MOK_EENGINE;
  }
  if (cfg->group_world != sz->world || cfg->group_tokens != sz->max_tokens ||
      cfg->group_rank != mok_ep_group_rank(g) || cfg->hidden != sz->hidden ||
      cfg->topk != sz->topk || cfg->experts != sz->experts ||
      mok_layer_act_dtype(cfg->dtype) != sz->dtype ||
      (cfg->dtype == MOK_DTYPE_FP8_E4M3 && sz->ring_rows)) { /* fp8: no ring */
    snprintf(msg, len, "the layer does not fit its group's sizing");
    return MOK_EINVAL;
  }
  return MOK_OK;
}

/* The work of a job of a layer on g, enqueued into the frame that the
 * engine's start() opened (internal.h): the group's host protocol on this
 * thread, the rest on the session's stream. A job that fails before its
 * exchange still takes the member's turn, so its peers fail it too. */
void mok__cuda_group_job(job_ctx *c, mok_ep_group *g, const mok_job_args *a) {
  if (a->group_failed) { /* a NOP: this member's job failed before the engine */
    ep_job j = {.c = c, .g = g, .st = mok_ep_group_engine_state(g)};
    if (mok_ep_group_is_nccl(g) && j.st && j.st->nccl) device_protocol(&j, a->group_failed);
    return;
  }
  if (a->op != MOK_OP_FORWARD && a->op != MOK_OP_BACKWARD) {
    mok__cuda_job_fail(c, MOK_EUNSUPPORTED,
                       "a layer on a group runs forward and backward; single steps need a layer "
                       "without a group");
    return;
  }
  ep_job j = {.c = c, .g = g, .st = mok_ep_group_engine_state(g)};
  char err[MOK_JOB_MESSAGE_MAX];
  int st = mok_ep_group_job_start(g, err, sizeof err);
  if (st != MOK_OK) {
    mok__cuda_job_fail(c, st, "%s", err);
    return;
  }
  bool ok = mok__cuda_job_prepare(c);
  int fit = MOK_OK;
  if (ok && (fit = job_fits(c, g, j.st, err, sizeof err)) != MOK_OK) {
    mok__cuda_job_fail(c, fit, "%s", err);
    ok = false;
  }
  if (!ok) {
    /* still take the turn, so that every member fails this job with our message */
    if (!mok_ep_group_is_nccl(g))
      host_protocol(&j, c->j->status != MOK_OK ? c->j->status : MOK_EINVAL, c->j->message);
    else if (j.st && j.st->nccl)
      device_protocol(&j, c->j->status != MOK_OK ? c->j->status : MOK_EINVAL);
    return;
  }
  j.dv = mok__cuda_group_dims(a->layer);
  j.lv = mok_group_routed_dims(a->layer);
  j.own = (char *)(uintptr_t)j.st->own.va;
  j.kg.off = j.st->lay;
  j.timeout_ns = (uint64_t)mok_ep_group_timeout_ms(g) * 1000000ull;
  j.profile = mok__cuda_profiling();
  if (a->op == MOK_OP_FORWARD) ep_forward(&j);
  else ep_backward(&j);
  side_end(&j); /* a job that stopped early still joins its side work */
}
