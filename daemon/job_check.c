/* SPDX-License-Identifier: Apache-2.0 */
#include "job_check.h"

#include <stdio.h>
#include <string.h>

#include "mok_status.h"

/* Where a tensor's bytes lie in the memory behind its region: the region's
 * backing object (a memfd's identity; region.h) at the backing offset, so
 * that two registrations of one memfd name the same bytes. A region whose
 * backing is unknown (object 0) is its own object, named by its id. */
typedef struct backed_range {
  uint64_t object, object2;
  uint64_t start, bytes; /* start may exceed 2^64 - bytes only in a corrupt table */
  int known;             /* 0: object is the region id */
} backed_range;

static backed_range backed_range_of(const mok_tensor_ref *ref, const mok_region *r) {
  backed_range b = {.start = ref->offset, .bytes = ref->bytes};
  if (r->backing.object != 0) {
    b.known = 1;
    b.object = r->backing.object;
    b.object2 = r->backing.object2;
    b.start += r->backing.offset;
  } else {
    b.object = r->id;
  }
  return b;
}

/* Both refs passed check_ref (inside their regions), so the offsets and
 * sizes are bounded by the regions' sizes; a backing offset comes from a
 * file offset (below 2^63). Compared in 128 bits anyway: no wrap-around
 * can hide an overlap. */
static int ranges_overlap(const backed_range *a, const backed_range *b) {
  if (a->known != b->known || a->object != b->object) return 0;
  if (a->known && a->object2 != b->object2) return 0;
  unsigned __int128 a0 = a->start, a1 = a0 + a->bytes, b0 = b->start, b1 = b0 + b->bytes;
  return a0 < b1 && b0 < a1;
}

static int check_ref(const mok_tensor_ref *ref, mok_region_table *regions,
                     const mok_layer_config *layer, uint16_t op, uint32_t flags, uint32_t source,
                     uint32_t tokens, mok_tensor_view *view, char *err, size_t errlen) {
  const char *name = mok_slot_name(ref->slot);
  mok_region *r = mok_region_table_find(regions, ref->region);
  if (!r) {
    snprintf(err, errlen, "%s: region %u is not registered by this session", name, ref->region);
    return MOK_ENOENT;
  }
  if (ref->offset > r->bytes || ref->bytes > r->bytes - ref->offset) {
    snprintf(err, errlen, "%s: offset %llu + %llu bytes is outside region %u of %llu bytes",
             name, (unsigned long long)ref->offset, (unsigned long long)ref->bytes, ref->region,
             (unsigned long long)r->bytes);
    return MOK_EBOUNDS;
  }
  uint32_t want_dt, want_nd;
  uint64_t want[MOK_MAX_DIMS];
  mok_job_slot_shape_job(layer, op, flags, source, tokens, ref->slot, &want_dt, &want_nd, want);
  uint32_t esz = mok_dtype_size(ref->dtype);
  if (ref->dtype != want_dt) {
    snprintf(err, errlen, "%s: dtype %u, the layer needs dtype %u", name, ref->dtype, want_dt);
    return MOK_ESHAPE;
  }
  if (ref->ndim != want_nd) {
    snprintf(err, errlen, "%s: %u dimensions, expected %u", name, ref->ndim, want_nd);
    return MOK_ESHAPE;
  }
  uint64_t elems = 1;
  for (uint32_t i = 0; i < want_nd; i++) {
    if ((uint64_t)ref->shape[i] != want[i]) {
      /* both whole shapes: a person sees at once which tensor is which */
      char given[64], needed[96];
      int g = 0, w = 0;
      for (uint32_t d = 0; d < want_nd; d++) {
        g += snprintf(given + g, sizeof given - (size_t)g, "%s%u", d ? ", " : "", ref->shape[d]);
        w += snprintf(needed + w, sizeof needed - (size_t)w, "%s%llu", d ? ", " : "",
                      (unsigned long long)want[d]);
      }
      snprintf(err, errlen, "%s: dimension %u is %u, expected %llu (shape [%s]; a %s job of %u "
               "tokens on this layer needs [%s])",
               name, i, ref->shape[i], (unsigned long long)want[i], given, mok_op_name(op),
               tokens, needed);
      return MOK_ESHAPE;
    }
    elems *= want[i]; /* bounded by the layer limits: no overflow */
  }
  for (uint32_t i = want_nd; i < MOK_MAX_DIMS; i++) {
    if (ref->shape[i] != 0) {
      snprintf(err, errlen, "%s: unused dimension %u must be 0", name, i);
      return MOK_ESHAPE;
    }
  }
  if (elems * esz != ref->bytes) {
    snprintf(err, errlen, "%s: %llu bytes declared, its shape needs %llu", name,
             (unsigned long long)ref->bytes, (unsigned long long)(elems * esz));
    return MOK_ESHAPE;
  }
  if (ref->offset % esz != 0) {
    snprintf(err, errlen, "%s: offset %llu is not aligned to its %u-byte elements", name,
             (unsigned long long)ref->offset, esz);
    return MOK_EINVAL;
  }
  view->ptr = (char *)r->base + ref->offset;
  view->bytes = ref->bytes;
  view->dtype = ref->dtype;
  view->ndim = ref->ndim;
  memcpy(view->shape, ref->shape, sizeof view->shape);
  return MOK_OK;
}

int mok_job_check_flags_op(const mok_layer_config *layer, uint32_t op, uint32_t flags,
                           char *err, size_t errlen) {
  if ((flags & MOK_JOB_RECOMPUTE) && op != MOK_OP_BACKWARD) {
    snprintf(err, errlen, "flag 0x%x (recompute) is only valid on backward", MOK_JOB_RECOMPUTE);
    return MOK_EINVAL;
  }
  if (flags & MOK_JOB_QUANTIZE_WEIGHTS) {
    if (op != MOK_OP_FORWARD) {
      snprintf(err, errlen, "flag 0x%x (quantize weights) is only valid on forward",
               MOK_JOB_QUANTIZE_WEIGHTS);
      return MOK_EINVAL;
    }
    if (layer && layer->dtype != MOK_DTYPE_FP8_E4M3) {
      snprintf(err, errlen, "flag 0x%x (quantize weights) needs an fp8 layer (this layer's "
               "weights are used as they are)", MOK_JOB_QUANTIZE_WEIGHTS);
      return MOK_EINVAL;
    }
    if (layer && layer->group_id) {
      snprintf(err, errlen, "flag 0x%x (quantize weights) is for layers without a group: a "
               "group layer's forward takes the packed weights (quantize_weight first)",
               MOK_JOB_QUANTIZE_WEIGHTS);
      return MOK_EUNSUPPORTED;
    }
  }
  return MOK_OK;
}

int mok_job_check_tokens(const mok_layer_config *layer, uint32_t tokens, int refusal, char *err,
                         size_t errlen) {
  if (tokens == 0 || tokens > layer->max_tokens) {
    snprintf(err, errlen, "tokens = %u, the layer takes 1..%u (max_tokens)", tokens,
             layer->max_tokens);
    return refusal;
  }
  return MOK_OK;
}

int mok_job_check_tokens_op(const mok_layer_config *layer, uint32_t op, uint32_t tokens,
                            int refusal, char *err, size_t errlen) {
  if (op != MOK_OP_QUANTIZE_WEIGHT) return mok_job_check_tokens(layer, tokens, refusal, err, errlen);
  if (tokens != 0) {
    snprintf(err, errlen, "tokens = %u: quantize_weight works on a weight, it takes 0 tokens",
             tokens);
    return MOK_EINVAL;
  }
  return MOK_OK;
}

int mok_job_check(const mok_job_desc *desc, mok_region_table *regions,
                  const mok_layer_config *layer, mok_job_args *ret, char *err, size_t errlen) {
  memset(ret, 0, sizeof *ret);
  if (desc->version != MOK_JOB_VERSION) {
    snprintf(err, errlen, "job descriptor version %u, this daemon speaks %u", desc->version,
             MOK_JOB_VERSION);
    return MOK_EVERSION;
  }
  if (desc->op >= MOK_OP_COUNT_) {
    snprintf(err, errlen, "unknown op %u", desc->op);
    return MOK_EINVAL;
  }
  if (desc->flags & ~MOK_JOB_FLAGS_ALL) {
    snprintf(err, errlen, "unknown job flags 0x%x", desc->flags);
    return MOK_EINVAL;
  }
  int st = mok_job_check_flags_op(layer, desc->op, desc->flags, err, errlen);
  if (st != MOK_OK) return st;
  if (desc->n_tensors > MOK_MAX_TENSORS) {
    snprintf(err, errlen, "%u tensors, at most %u", desc->n_tensors, MOK_MAX_TENSORS);
    return MOK_EINVAL;
  }
  ret->op = desc->op;
  ret->flags = desc->flags;
  ret->tokens = desc->tokens;
  ret->fence_wait = desc->fence_wait;
  ret->fence_signal = desc->fence_signal;
  if (desc->op == MOK_OP_NOP) {
    if (desc->n_tensors != 0) {
      snprintf(err, errlen, "nop takes no tensors");
      return MOK_EINVAL;
    }
    return MOK_OK;
  }
  if (!layer) {
    snprintf(err, errlen, "layer %u does not exist in this session", desc->layer);
    return MOK_ENOENT;
  }
  ret->layer = layer;
  st = mok_job_check_tokens_op(layer, desc->op, desc->tokens, MOK_EINVAL, err, errlen);
  if (st != MOK_OK) return st;
  uint64_t seen = 0;
  for (uint32_t i = 0; i < desc->n_tensors; i++) {
    const mok_tensor_ref *ref = &desc->tensors[i];
    if (ref->slot >= MOK_SLOT_COUNT_) {
      snprintf(err, errlen, "tensor %u: unknown slot %u", i, ref->slot);
      return MOK_EINVAL;
    }
    if (seen & (1ull << ref->slot)) {
      snprintf(err, errlen, "%s given twice", mok_slot_name(ref->slot));
      return MOK_EINVAL;
    }
    seen |= 1ull << ref->slot;
    if (mok_job_slot_need(layer, desc->op, desc->flags, ref->slot) == MOK_NEED_NONE) {
      snprintf(err, errlen, "%s is not an argument of %s%s", mok_slot_name(ref->slot),
               mok_op_name(desc->op),
               mok_slot_is_shared(ref->slot) ? " (the layer has no shared expert)" : "");
      return MOK_EINVAL;
    }
  }
  /* quantize_weight's shapes follow its source weight */
  uint32_t source = MOK_SLOT_COUNT_;
  if (desc->op == MOK_OP_QUANTIZE_WEIGHT &&
      (st = mok_quantize_check(layer, seen, &source, err, errlen)) != MOK_OK)
    return st;
  for (uint32_t i = 0; i < desc->n_tensors; i++) {
    const mok_tensor_ref *ref = &desc->tensors[i];
    int r = check_ref(ref, regions, layer, desc->op, desc->flags, source, desc->tokens,
                      &ret->t[ref->slot], err, errlen);
    if (r != MOK_OK) return r;
  }
  for (uint32_t s = 0; s < MOK_SLOT_COUNT_; s++) {
    if (mok_job_slot_need(layer, desc->op, desc->flags, s) == MOK_NEED_REQUIRED &&
        !(seen & (1ull << s))) {
      snprintf(err, errlen, "%s needs %s", mok_op_name(desc->op), mok_slot_name(s));
      return MOK_EINVAL;
    }
  }
  /* an output may not share bytes with any other tensor of the job, in
   * whatever region (registration) of the same memory either is named */
  backed_range where[MOK_MAX_TENSORS];
  for (uint32_t i = 0; i < desc->n_tensors; i++)
    where[i] = backed_range_of(&desc->tensors[i],
                               mok_region_table_find(regions, desc->tensors[i].region));
  for (uint32_t i = 0; i < desc->n_tensors; i++) {
    const mok_tensor_ref *a = &desc->tensors[i];
    if (!mok_job_slot_is_output(desc->op, desc->flags, a->slot)) continue;
    for (uint32_t j = 0; j < desc->n_tensors; j++) {
      if (j == i || !ranges_overlap(&where[i], &where[j])) continue;
      const mok_tensor_ref *b = &desc->tensors[j];
      if (a->region == b->region)
        snprintf(err, errlen, "output %s overlaps %s", mok_slot_name(a->slot),
                 mok_slot_name(b->slot));
      else
        snprintf(err, errlen,
                 "output %s overlaps %s: regions %u and %u are the same memory (one buffer "
                 "registered twice)",
                 mok_slot_name(a->slot), mok_slot_name(b->slot), a->region, b->region);
      return MOK_EINVAL;
    }
  }
  return MOK_OK;
}
