/* SPDX-License-Identifier: Apache-2.0 */
/* DOWN, y = h W_d[e]^T: ping-pong 128x128x64 tiles (one consumer
 * warpgroup a tile, its epilogue under the other's k loop), 2-CTA clusters. */
#include "cutlass_gemm/grouped.cuh"

using DownPp = mok_cg::Config<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                              cute::Shape<cute::_128, cute::_128, cute::_64>,
                              cute::Shape<cute::_2, cute::_1, cute::_1>, true>;

int mok__cg_down_pp_128x128_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream) {
  return mok_cg::run<DownPp, false>(*p, 1, ctas, stream);
}
