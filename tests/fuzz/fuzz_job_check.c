/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer: job descriptor validation (daemon/job_check.c) against a
 * session's region table (daemon/region.c) and a layer, as the engine
 * thread runs it on each descriptor it copies out of a submission ring.
 *
 * Beyond "no crash, no UB", every accepted job must resolve to views that
 * lie inside their regions, whose bytes match their shapes, and whose
 * outputs overlap no other tensor's bytes in any backing: regions may be
 * registrations of one memfd (at any offsets), and an output must not lie
 * over another tensor through either. The isolation boundary of the engines.
 * Input: struct fuzz_job_input (shorter inputs are zero-padded).
 */
#include <stdlib.h>
#include <string.h>

#include "fuzz_job_check.h"
#include "job_check.h"
#include "layer.h"
#include "mok_status.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_job_input in;
  memset(&in, 0, sizeof in);
  memcpy(&in, data, size < sizeof in ? size : sizeof in);

  mok_layer_config layer = {.hidden = in.hidden, .intermediate = in.intermediate,
                            .experts = in.experts, .topk = in.topk,
                            .shared_intermediate = in.shared_intermediate,
                            .max_tokens = in.max_tokens, .dtype = in.dtype,
                            .has_limit = in.has_limit & 1, .swiglu_limit = 7.0f};
  char err[256];
  const mok_layer_config *lp = NULL;
  if (in.layer_present && mok_layer_validate(&layer, err, sizeof err) == MOK_OK) {
    layer.row_align = in.row_align ? in.row_align : 1;
    lp = &layer;
  }

  /* regions at fake addresses: job_check only computes pointers */
  mok_region_table t;
  memset(&t, 0, sizeof t);
  for (uint32_t i = 0; i < FUZZ_REGIONS; i++) {
    mok_region r;
    memset(&r, 0, sizeof r);
    r.kind = MOK_REGION_HOST_MEMFD;
    r.bytes = in.region_bytes[i] & ((1ull << 47) - 1);
    r.base = (void *)(uintptr_t)((uint64_t)(i + 1) << 48);
    uint32_t obj = in.region_object[i] % (FUZZ_OBJECTS + 1);
    if (obj) /* a file offset: below 2^63 */
      r.backing = (mok_region_backing){.object = obj, .object2 = 1,
                                       .offset = in.region_backing_offset[i] >> 1};
    if (mok_region_table_add(&t, &r) != MOK_OK) abort();
  }

  mok_job_args args;
  int st = mok_job_check(&in.desc, &t, lp, &args, err, sizeof err);
  if (st == MOK_OK && in.desc.op != MOK_OP_NOP) {
    if (!lp) abort();
    for (uint32_t s = 0; s < MOK_SLOT_COUNT_; s++) {
      const mok_tensor_view *v = &args.t[s];
      if (!v->ptr) continue;
      uintptr_t p = (uintptr_t)v->ptr;
      uint32_t id = (uint32_t)(p >> 48);
      if (id < 1 || id > FUZZ_REGIONS) abort();
      const mok_region *r = mok_region_table_find(&t, id);
      uintptr_t b = (uintptr_t)r->base;
      if (p < b || p - b > r->bytes || v->bytes > r->bytes - (p - b)) abort(); /* outside */
      uint64_t elems = mok_dtype_size(v->dtype);
      for (uint32_t d = 0; d < v->ndim; d++) elems *= v->shape[d];
      if (elems != v->bytes) abort();
      if (!mok_job_slot_is_output(args.op, args.flags, s)) continue;
      for (uint32_t o = 0; o < MOK_SLOT_COUNT_; o++) {
        const mok_tensor_view *w = &args.t[o];
        if (o == s || !w->ptr) continue;
        uintptr_t q = (uintptr_t)w->ptr;
        if (p < q + w->bytes && q < p + v->bytes) abort(); /* an output overlaps */
        /* through the memory behind the regions: the same memfd */
        const mok_region *rw = mok_region_table_find(&t, (uint32_t)(q >> 48));
        if (!rw || !r->backing.object || rw->backing.object != r->backing.object) continue;
        unsigned __int128 a0 = (unsigned __int128)r->backing.offset + (p - b);
        unsigned __int128 b0 = (unsigned __int128)rw->backing.offset + (q - (uintptr_t)rw->base);
        if (a0 < b0 + w->bytes && b0 < a0 + v->bytes) abort(); /* aliased through a backing */
      }
    }
  } else if (st != MOK_OK && !err[0]) {
    abort(); /* a refusal names what is wrong */
  }
  mok_region_table_free(&t);
  return 0;
}
