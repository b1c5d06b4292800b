/* SPDX-License-Identifier: Apache-2.0 */
/* WGRAD, d_W[e] = a^T b over the expert's rows: both operands M/N-major
 * (the routed rows are the reduction), cooperative 128x256x64 tiles. */
#include "cutlass_gemm/grouped.cuh"

using WgradCoop = mok_cg::Config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                                 cute::Shape<cute::_128, cute::_256, cute::_64>,
                                 cute::Shape<cute::_1, cute::_1, cute::_1>, false>;

int mok__cg_wgrad_coop_128x256(const mok_gemm_params *p, int halves, int ctas, cudaStream_t stream) {
  return mok_cg::run<WgradCoop, true>(*p, halves, ctas, stream);
}
