/* SPDX-License-Identifier: Apache-2.0 */
/* The input layout of fuzz_job_check (shared with gen_corpus.c). */
#ifndef MOK_FUZZ_JOB_CHECK_H
#define MOK_FUZZ_JOB_CHECK_H

#include <stdint.h>

#include "mok_wire.h"

#define FUZZ_REGIONS 4u

typedef struct fuzz_job_input {
  /* the layer, as a client asks for it (validated by mok_layer_validate) */
  uint32_t hidden, intermediate, experts, topk, shared_intermediate, max_tokens, dtype;
  uint8_t has_limit, row_align, layer_present, pad_;
  /* the session's regions (ids 1..FUZZ_REGIONS); sizes as the client
   * registered them (below 2^47, as an mmap can be) */
  uint64_t region_bytes[FUZZ_REGIONS];
  mok_job_desc desc;
  /* what backs each region (region.h's mok_region_backing): object 0 is
   * unknown (the region is only itself), 1..FUZZ_OBJECTS a memfd that
   * several regions may share (one buffer registered twice), at this
   * offset in it. Last, so that inputs without them mean what they did. */
  uint8_t region_object[FUZZ_REGIONS];
  uint64_t region_backing_offset[FUZZ_REGIONS];
} fuzz_job_input;

#define FUZZ_OBJECTS 3u

#endif
