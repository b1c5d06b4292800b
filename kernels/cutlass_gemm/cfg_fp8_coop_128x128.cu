/* SPDX-License-Identifier: Apache-2.0 */
/* The FP8 products: cooperative 128x128x128 tiles (two consumer warpgroups
 * of 64 rows, one weight-scale block wide), plain CTAs. */
#include "cutlass_gemm/fp8.cuh"

using F8Coop = mok_cg_f8::F8Config<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                   cute::Shape<cute::_1, cute::_1, cute::_1>, false>;

int mok__cg_f8_coop_128x128(const mok__cg_f8 *p, int ctas, cudaStream_t stream) {
  return mok_cg_f8::run<F8Coop>(*p, ctas, stream);
}
