/* SPDX-License-Identifier: Apache-2.0 */
/* The FP8 products: cooperative 128x128x128 tiles in 1x2 clusters (two
 * column tiles of one row block sharing the activation tile). */
#include "cutlass_gemm/fp8.cuh"

using F8CoopC12 = mok_cg_f8::F8Config<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                      cute::Shape<cute::_1, cute::_2, cute::_1>, false>;

int mok__cg_f8_coop_128x128_c12(const mok__cg_f8 *p, int ctas, cudaStream_t stream) {
  return mok_cg_f8::run<F8CoopC12>(*p, ctas, stream);
}
