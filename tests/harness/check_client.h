/* SPDX-License-Identifier: Apache-2.0 */
/* The status checks that the GPU tests' and benches' clients (plain C and
 * CUDA C++ alike) share: a CUDA runtime call (CK) and a libmok call (MK),
 * each stopping the program with what failed and why. */
#ifndef MOK_TESTS_CHECK_CLIENT_H
#define MOK_TESTS_CHECK_CLIENT_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "mok.h"

#define CK(call)                                                                             \
  do {                                                                                       \
    cudaError_t e_ = (call);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                               \
    }                                                                                        \
  } while (0)

#define MK(call)                                                                             \
  do {                                                                                       \
    int s_ = (call);                                                                         \
    if (s_ != MOK_OK) {                                                                      \
      fprintf(stderr, "%s:%d: %s: %s: %s\n", __FILE__, __LINE__, #call, mok_status_name(s_), \
              mok_last_error());                                                             \
      exit(2);                                                                               \
    }                                                                                        \
  } while (0)

#endif /* MOK_TESTS_CHECK_CLIENT_H */
