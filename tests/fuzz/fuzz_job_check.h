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
} fuzz_job_input;

#endif
