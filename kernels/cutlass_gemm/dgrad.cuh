/* SPDX-License-Identifier: Apache-2.0 */
/* DOWN_DGRAD on CUTLASS's sm90 ptr-array grouped GEMM with the epilogue of
 * dgrad_epilogue.cuh: a = d_out W_d[e] (A: routed d_out [rows][H], K-major;
 * B(k = h, n = i) = W_d[e][h][i], N-major), each group an expert, its shape
 * and pointers written on the device from the validated schedule as in
 * grouped.cuh. One configuration per translation unit (cfg_down_dgrad_*.cu). */
#ifndef MOK_CUTLASS_DGRAD_CUH
#define MOK_CUTLASS_DGRAD_CUH

#include "cutlass_gemm/dgrad_epilogue.cuh"

namespace mok_cg_dgrad {

using namespace cute;
using mok_cg::bfloat16_t;

template <class Epi, class Tile, class Cluster, bool PingPong> struct DgradConfig {
  using Epilogue = Epi;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bfloat16_t, cutlass::layout::RowMajor *, 8,
      bfloat16_t, cutlass::layout::RowMajor *, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epi::SharedStorage))>,
      std::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
};

/* The groups' arguments in device memory, one block per launch (laid out
 * as grouped.cuh's), with each group's first row for the epilogue. */
template <class C> struct Args {
  typename C::Shape3 *shape;
  const bfloat16_t **a;
  const bfloat16_t **b;
  typename C::StrideA *sa;
  typename C::StrideB *sb;
  int *first;

  static Args carve(mok_cg::GroupArrays &g) {
    Args r;
    r.shape = g.take<typename C::Shape3>();
    r.a = g.take<const bfloat16_t *>();
    r.b = g.take<const bfloat16_t *>();
    r.sa = g.take<typename C::StrideA>();
    r.sb = g.take<typename C::StrideB>();
    r.first = g.take<int>();
    return r;
  }
};

/* Group e: a[rows of e] [count, N] = d_out[rows] [count, H] W_d[e] ([H, N]);
 * a failed job's groups have no rows. */
template <class C> __global__ void dgrad_args(const mok_gemm_params p, Args<C> a) {
  const bool failed = job_failed(p.status);
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.groups; e += gridDim.x * blockDim.x) {
    a.first[e] = mok_cg::row_group_args<C>(p, e, failed, a).first;
  }
}

/* The product on configuration C, on `ctas` persistent CTAs (0: every SM):
 * the TMA maps of g and u, then the grouped GEMM (grouped.cuh's
 * run_groups). Returns a mok_status. */
template <class C> int run(const mok_gemm_params &p, int ctas, cudaStream_t stream) {
  using Epi = typename C::Epilogue;
  const int n = p.groups;
  if (n <= 0) return MOK_OK;
  typename Epi::Arguments epi{};
  epi.out = mok_cg::DgradOut{nullptr, p.row_slot, p.rw, p.n_slots, p.C0, p.C1, p.partial,
                             p.n_partial, p.N, p.has_limit, p.limit, nullptr, nullptr};
  const int st = Epi::map_saved(epi, p.G, p.U, p.N, p.M);
  if (st != MOK_OK) return st;
  return mok_cg::run_groups<C, Args<C>>(n, ctas, stream, [&](const Args<C> &a, auto &args) {
    dgrad_args<C><<<mok_cg::args_blocks(n), mok_cg::ARGS_THREADS, 0, stream>>>(p, a);
    epi.out.first = a.first;
    args.problem_shape = {n, a.shape, nullptr};
    args.mainloop = {a.a, a.sa, a.b, a.sb};
    args.epilogue = epi;
  });
}

} // namespace mok_cg_dgrad

#endif /* MOK_CUTLASS_DGRAD_CUH */
