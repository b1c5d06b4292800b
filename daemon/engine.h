/* The engine interface: what mokd asks of a compute engine.
 *
 * One engine thread owns an engine. The daemon validates every job descriptor
 * against the session's regions and the layer (job_check.c) before an engine
 * sees it, so an engine receives resolved, bounds-checked tensor views whose
 * shapes match the layer. What the daemon cannot check without reading
 * tensor contents (routing ids, the contents of a schedule or ctx a client
 * passed in) the engine checks, failing the job with a status and message.
 *
 * Engines: cpu (engine_cpu.c; reference, f32 and bf16) and cuda
 * (engine_cuda.c; sm_90a kernels, bf16). Both compute docs/math.md exactly.
 */
#ifndef MOK_ENGINE_H
#define MOK_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "mok_wire.h"

/* One tensor argument, resolved to memory the engine can address. */
typedef struct mok_tensor_view {
  void *ptr; /* NULL: slot absent */
  uint64_t bytes;
  uint32_t dtype;
  uint32_t ndim;
  uint32_t shape[MOK_MAX_DIMS];
} mok_tensor_view;

typedef struct mok_job_args {
  uint32_t op;     /* mok_op */
  uint32_t flags;  /* MOK_JOB_* */
  uint32_t tokens; /* T */
  const mok_layer_config *layer; /* NULL for NOP */
  mok_tensor_view t[MOK_SLOT_COUNT_];
  uint64_t fence_wait, fence_signal; /* GPU ordering (cuda engine) */
} mok_job_args;

typedef struct mok_engine mok_engine;

typedef struct mok_engine_config {
  int device;      /* GPU ordinal (cuda); ignored by cpu */
  int threads;     /* worker threads (cpu); 0: one per online core */
} mok_engine_config;

/* Results of run(): status plus a message a person can act on. */
typedef struct mok_engine_result {
  int status; /* mok_status */
  char message[MOK_COMPLETION_MSG];
} mok_engine_result;

typedef struct mok_engine_ops {
  const char *name;
  /* Create an engine. On failure returns a mok_status and fills err. */
  int (*open)(const mok_engine_config *cfg, mok_engine **ret, char *err, size_t errlen);
  /* Release everything; accepts NULL. */
  void (*close)(mok_engine *e);
  /* Device description for Hello ("cpu: 2 threads", "NVIDIA H200 ..."). */
  const char *(*describe)(const mok_engine *e);
  /* Check that the engine can run this layer (dtype, sizes); fills
   * cfg->row_align. Returns a mok_status. */
  int (*prepare_layer)(mok_engine *e, mok_layer_config *cfg, char *err, size_t errlen);
  /* Run one validated job to completion (the cpu engine is synchronous). */
  void (*run)(mok_engine *e, const mok_job_args *args, mok_engine_result *res);
} mok_engine_ops;

extern const mok_engine_ops mok_engine_cpu;
/* NULL when the build has no CUDA. */
const mok_engine_ops *mok_engine_find(const char *name);

#endif /* MOK_ENGINE_H */
