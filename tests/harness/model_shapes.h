/* SPDX-License-Identifier: Apache-2.0 */
/* The benchmark model shapes of docs/design.md, one table for every C and
 * CUDA test and bench: name, global experts E, hidden H, intermediate I,
 * top-k K. The benches run expert parallel over MOK_MODEL_EP GPUs, so one
 * GPU holds E / MOK_MODEL_EP experts. Each user expands the rows into its own
 * struct:
 *   #define ROW_(name, E, H, I, K) {name, (E) / MOK_MODEL_EP, H, I, K},
 *   static const my_shape shapes[] = {MOK_MODEL_SHAPES(ROW_)};
 * The Python benches' copies are held to this table by
 * tests/python/test_model_shapes.py. */
#ifndef MOK_TESTS_MODEL_SHAPES_H
#define MOK_TESTS_MODEL_SHAPES_H

#define MOK_MODEL_SHAPES(X)                                                    \
  X("kimi-k2.7", 384, 7168, 2048, 8)                                           \
  X("glm-5.2", 256, 6144, 2048, 8)                                             \
  X("qwen3.5-397b", 512, 4096, 1024, 10)                                       \
  X("deepseek-v4-pro", 384, 7168, 3072, 6)

#define MOK_MODEL_EP 8

#endif
