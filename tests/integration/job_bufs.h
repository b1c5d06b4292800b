/* SPDX-License-Identifier: Apache-2.0 */
/* Host buffers for one job of a layer, as the standing-job tests make them:
 * every required slot (and the ctx) in mok memory with random values, the
 * routing ids left to the caller's recipe. Included by one test file each. */
#ifndef MOK_TEST_JOB_BUFS_H
#define MOK_TEST_JOB_BUFS_H

#include <stdint.h>
#include <string.h>

#include "harness/daemon.h"
#include "internal.h"
#include "mok.h"
#include "mok_slots.h"

typedef struct job_bufs {
  void *p[MOK_SLOT_COUNT_];
  uint64_t bytes[MOK_SLOT_COUNT_];
} job_bufs;

static inline unsigned job_rng(unsigned *s) {
  *s ^= *s << 13, *s ^= *s >> 17, *s ^= *s << 5;
  return *s;
}

/* f32 on the cpu engine; bf16 (all it runs) on the cuda engine */
static inline uint32_t test_dtype(void) {
  return harness_engine_is_cuda() ? MOK_DTYPE_BF16 : MOK_DTYPE_F32;
}

/* ids(ids, n, &seed): the routing ids of a fresh topk_ids buffer of n entries */
typedef void (*job_ids_fn)(int32_t *ids, uint64_t n, const mok_layer *l, unsigned *seed);

/* Buffers for op at T (required slots, and ctx) that b lacks: values in
 * [-0.25, 0.25] (bf16: their upper halves), out zeroed, ids from ids_of. */
static inline void job_bufs_alloc(mok_client *c, mok_layer *l, uint32_t op, uint32_t T,
                                  job_bufs *b, unsigned seed, job_ids_fn ids_of) {
  unsigned s = seed;
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++) {
    int need = mok_job_slot_need(&l->cfg, op, 0, slot);
    if (need != MOK_NEED_REQUIRED && !(slot == MOK_SLOT_CTX && need != MOK_NEED_NONE)) continue;
    if (b->p[slot]) continue;
    uint32_t dt, nd;
    uint64_t shape[MOK_MAX_DIMS], n = 1;
    mok_job_slot_shape(&l->cfg, T, slot, &dt, &nd, shape);
    for (uint32_t i = 0; i < nd; i++) n *= shape[i];
    b->bytes[slot] = n * mok_dtype_size(dt);
    b->p[slot] = mok_host_alloc(c, b->bytes[slot]);
    CHECK_MSG(b->p[slot] != NULL, "mok_host_alloc: %s", mok_last_error());
    if (!b->p[slot]) return;
    if (slot == MOK_SLOT_TOPK_IDS) {
      ids_of(b->p[slot], n, l, &s);
    } else if (dt == MOK_DTYPE_F32) {
      float *f = b->p[slot];
      for (uint64_t i = 0; i < n; i++) f[i] = (float)((int)(job_rng(&s) % 2001) - 1000) / 4000.0f;
    } else if (dt == MOK_DTYPE_BF16 && slot != MOK_SLOT_OUT) {
      uint16_t *h = b->p[slot];
      for (uint64_t i = 0; i < n; i++) {
        float v = (float)((int)(job_rng(&s) % 2001) - 1000) / 4000.0f;
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        h[i] = (uint16_t)(u >> 16);
      }
    } else {
      memset(b->p[slot], 0, b->bytes[slot]);
    }
  }
}

/* The tensors op names, from b. */
static inline void job_bufs_tensors(mok_layer *l, uint32_t op, uint32_t T, const job_bufs *b,
                                    mok_tensor *t) {
  memset(t, 0, sizeof(mok_tensor) * MOK_SLOT_COUNT_);
  for (uint32_t slot = 0; slot < MOK_SLOT_COUNT_; slot++)
    if (b->p[slot] && mok_job_slot_need(&l->cfg, op, 0, slot) != MOK_NEED_NONE)
      t[slot] = mok_tensor_for(l, T, slot, b->p[slot]);
}

#endif
