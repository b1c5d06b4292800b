/* SPDX-License-Identifier: Apache-2.0 */
/* The FP8 down dgrad with its SwiGLU backward and dg | du's quantisation:
 * cooperative 128x128x128 tiles (one scale block of dg and of du a tile)
 * in 1x2 clusters sharing d_out's tile, as the forward's products. */
#include "cutlass_gemm/fp8.cuh"

using F8Dgrad = mok_cg_f8::F8DgradConfig<cute::Shape<cute::_128, cute::_128, cute::_128>,
                                         cute::Shape<cute::_1, cute::_2, cute::_1>>;

int mok__cg_f8_dgrad_coop_128x128_c12(const mok__cg_f8 *p, int ctas, cudaStream_t stream) {
  return mok_cg_f8::run_dgrad<F8Dgrad>(*p, ctas, stream);
}
