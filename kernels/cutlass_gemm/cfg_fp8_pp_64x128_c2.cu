/* SPDX-License-Identifier: Apache-2.0 */
/* The FP8 products: ping-pong 64x128x128 tiles (a consumer warpgroup a
 * tile, its promotion and epilogue under the other's products) in 2-CTA
 * clusters sharing the weight tile. */
#include "cutlass_gemm/fp8.cuh"

using F8PP = mok_cg_f8::F8Config<cute::Shape<cute::_64, cute::_128, cute::_128>,
                                 cute::Shape<cute::_2, cute::_1, cute::_1>, true>;

int mok__cg_f8_pp_64x128_c2(const mok__cg_f8 *p, int ctas, cudaStream_t stream) {
  return mok_cg_f8::run<F8PP>(*p, ctas, stream);
}
