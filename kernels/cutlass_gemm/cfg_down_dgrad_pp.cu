/* SPDX-License-Identifier: Apache-2.0 */
/* DOWN_DGRAD, a = d_out W_d[e] and the SwiGLU backward: ping-pong
 * 128x128x64 tiles in 2-CTA clusters sharing the weight tile (one
 * warpgroup's epilogue under the other's k loop); a whole tile's g and u in
 * four stages. */
#include "cutlass_gemm/dgrad.cuh"

using DgradPP = mok_cg_dgrad::DgradConfig<mok_cg::DgradEpilogue<4, 128, false>,
                                          cute::Shape<cute::_128, cute::_128, cute::_64>,
                                          cute::Shape<cute::_2, cute::_1, cute::_1>, true>;

int mok__cg_down_dgrad_pp_128x128_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream) {
  return mok_cg_dgrad::run<DgradPP>(*p, ctas, stream);
}
