/* SPDX-License-Identifier: Apache-2.0 */
/* DOWN_DGRAD, a = d_out W_d[e] and the SwiGLU backward: cooperative
 * 128x256x64 tiles in 2-CTA clusters sharing the weight tile; two stages of
 * g and u (the k loop keeps four). */
#include "cutlass_gemm/dgrad.cuh"

using DgradCoop = mok_cg_dgrad::DgradConfig<mok_cg::DgradEpilogue<2, 256, true>,
                                            cute::Shape<cute::_128, cute::_256, cute::_64>,
                                            cute::Shape<cute::_2, cute::_1, cute::_1>, false>;

int mok__cg_down_dgrad_coop_128x256_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream) {
  return mok_cg_dgrad::run<DgradCoop>(*p, ctas, stream);
}
