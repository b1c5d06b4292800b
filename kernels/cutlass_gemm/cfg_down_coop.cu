/* SPDX-License-Identifier: Apache-2.0 */
/* DOWN, y = h W_d[e]^T: cooperative 128x256x64 tiles, 2-CTA clusters
 * sharing the weight tile (the forward's shape of the fastest layers). */
#include "cutlass_gemm/grouped.cuh"

using DownCoop = mok_cg::Config<cutlass::layout::RowMajor, cutlass::layout::ColumnMajor,
                                cute::Shape<cute::_128, cute::_256, cute::_64>,
                                cute::Shape<cute::_2, cute::_1, cute::_1>, false>;

int mok__cg_down_coop_128x256_c2(const mok_gemm_params *p, int ctas, cudaStream_t stream) {
  return mok_cg::run<DownCoop, false>(*p, 1, ctas, stream);
}
