/* SPDX-License-Identifier: Apache-2.0 */
/* WGRAD, d_W[e] = a^T b over the expert's rows: both operands M/N-major,
 * ping-pong 128x128x64 tiles (one consumer warpgroup a tile, its epilogue
 * under the other's k loop: at ~350 rows an expert the k loop is 6 blocks
 * and the epilogue a quarter of a cooperative tile, kernels/PERF.md). */
#include "cutlass_gemm/grouped.cuh"

using WgradPp = mok_cg::Config<cutlass::layout::ColumnMajor, cutlass::layout::RowMajor,
                               cute::Shape<cute::_128, cute::_128, cute::_64>,
                               cute::Shape<cute::_1, cute::_1, cute::_1>, true>;

int mok__cg_wgrad_pp_128x128(const mok_gemm_params *p, int halves, int ctas, cudaStream_t stream) {
  return mok_cg::run<WgradPp, true>(*p, halves, ctas, stream);
}
