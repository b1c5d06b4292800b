/* SPDX-License-Identifier: Apache-2.0 */
/* The kernel library's choices as the tests and benches take them: from
 * their environment, as mokd does (MOK_GEMM, MOK_GEMM_VARIANT,
 * MOK_GATHER_BESIDE, MOK_GEMM_CUTLASS; kernels/mok_kernels.h,
 * mok_k_init_with). The library
 * itself reads no environment. */
#ifndef MOK_TEST_KERNEL_CHOICES_H
#define MOK_TEST_KERNEL_CHOICES_H

#include <stdio.h>
#include <stdlib.h>

#include "../../kernels/mok_kernels.h"
#include "../../proto/mok_status.h"

static inline mok_k_choices kernel_choices_from_env(void) {
  mok_k_choices c;
  c.gemm = getenv("MOK_GEMM");
  c.variant = getenv("MOK_GEMM_VARIANT");
  c.gather_beside = getenv("MOK_GATHER_BESIDE");
  c.cutlass = getenv("MOK_GEMM_CUTLASS");
  return c;
}

/* mok_k_init_with the environment's choices; a refused one is named. */
static inline int kernel_init_from_env(void) {
  const mok_k_choices c = kernel_choices_from_env();
  const int st = mok_k_init_with(&c);
  if (st == MOK_EINVAL) fprintf(stderr, "kernel choices: %s\n", mok_k_choice_error());
  return st;
}

#endif /* MOK_TEST_KERNEL_CHOICES_H */
