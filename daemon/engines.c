/* SPDX-License-Identifier: Apache-2.0 */
/* The engines this build has, and what every engine is driven by alike. */
#include <string.h>
#include <time.h>

#include "engine.h"

#ifdef MOK_HAVE_CUDA
extern const mok_engine_ops mok_engine_cuda;
#endif

const mok_engine_ops *mok_engine_find(const char *name) {
  if (strcmp(name, "cpu") == 0) return &mok_engine_cpu;
#ifdef MOK_HAVE_CUDA
  if (strcmp(name, "cuda") == 0) return &mok_engine_cuda;
#endif
  return NULL;
}

void mok_engine_run(const mok_engine_ops *ops, mok_engine *e, const mok_job_args *args,
                    mok_engine_result *res) {
  mok_engine_job *j = ops->start(e, NULL, args, res);
  if (!j) return;
  struct timespec ts = {0, 20000}, now;
  for (;;) {
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (ops->poll(e, j, (uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec, res)) break;
    nanosleep(&ts, NULL);
  }
}
