/* SPDX-License-Identifier: Apache-2.0 */
/* The GPU test programs' check that goes on (plain C and CUDA C++ alike):
 * EXPECT prints the failure with its place and counts it in `failures`,
 * which the program's main turns into its exit status. Included by one
 * source file of each program. */
#ifndef MOK_TESTS_EXPECT_H
#define MOK_TESTS_EXPECT_H

#include <stdio.h>

static int failures __attribute__((unused)) = 0;
#define EXPECT(cond, ...)                         \
  do {                                            \
    if (!(cond)) {                                \
      failures++;                                 \
      printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      printf(__VA_ARGS__);                        \
      printf("\n");                               \
      fflush(stdout);                             \
    }                                             \
  } while (0)

#endif
