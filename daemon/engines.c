/* SPDX-License-Identifier: Apache-2.0 */
/* The engines this build has. */
#include <string.h>

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
