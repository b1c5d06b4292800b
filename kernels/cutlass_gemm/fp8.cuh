/* SPDX-License-Identifier: Apache-2.0 */
/* The FP8 products (launch.h's mok__cg_f8) on CUTLASS's sm90 ptr-array
 * grouped GEMM with blockwise-scaled accumulation: e4m3 A and B, K-major;
 * one scale per row per 128 of K for A and per 128 x 128 block for B, both
 * K-major in memory (mok's layouts as they are: [rows][K/128] and the packed
 * weight's [N/128][K/128]). Within each 128 of K the tensor cores sum four
 * k32 products from zero; CUTLASS then adds that partial times sa * sb into
 * f32 registers, in k order: the arithmetic of mok_gemm_sm90_fp8.cu's
 * kernel, so the two are bitwise equal (tests/gpu/test_gemm_sm90.cu).
 *
 * A group is an expert (GATE_UP: an expert's gate, then its up; two groups
 * an expert, next to each other so that its rows are read from L2 the
 * second time); shapes and pointers are written on the device from the
 * validated schedule, as grouped.cuh does for the bf16 products.
 *
 * DOWN_DGRAD: B is W_d's transposed section ([E][I][H], K = H contiguous)
 * whose block scales lie [H/128][I/128] (N-major, as the packed form keeps
 * them), with mok's SwiGLU-backward epilogue (dgrad_epilogue.cuh, Fp8). */
#ifndef MOK_CUTLASS_FP8_CUH
#define MOK_CUTLASS_FP8_CUH

#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass_gemm/dgrad_epilogue.cuh"
#include "cutlass_gemm/grouped.cuh"

namespace mok_cg_f8 {

using namespace cute;
using e4m3 = cutlass::float_e4m3_t;
using mok_cg::bfloat16_t;

/* The mainloop: e4m3 A and B (K-major), A's scales one a row per 128 of K
 * (K-major), B's one a 128 x 128 block (K-major, or N-major: MajorSFB). */
template <class Tile, class Cluster, bool PingPong, class EpilogueCarveout,
          cute::GMMA::Major MajorSFB = cute::GMMA::Major::K>
struct F8Mainloop {
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, 128, 128, cute::GMMA::Major::K, MajorSFB>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using KernelSchedule = std::conditional_t<
      PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum>;
  using Op = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, e4m3,
      cute::tuple<cutlass::layout::RowMajor *, LayoutSFA *>, 16, e4m3,
      cute::tuple<cutlass::layout::ColumnMajor *, LayoutSFB *>, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename EpilogueCarveout::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
};

template <class Tile, class Cluster, bool PingPong> struct F8Config {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Epilogue = typename mok_cg::StoreEpilogue<Tile, Cluster, PingPong>::Op;
  using MainloopOf = F8Mainloop<Tile, Cluster, PingPong, Epilogue>;
  using ScaleConfig = typename MainloopOf::ScaleConfig;
  using LayoutSFA = typename MainloopOf::LayoutSFA;
  using LayoutSFB = typename MainloopOf::LayoutSFB;
  using Mainloop = typename MainloopOf::Op;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

/* DOWN_DGRAD: cooperative 128x128 tiles (one scale block wide), the g and
 * u of a whole tile in four stages, Cluster as the forward's. */
template <class Tile, class Cluster> struct F8DgradConfig {
  using Epilogue = mok_cg::DgradEpilogue<4, 128, true, true>;
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using MainloopOf = F8Mainloop<Tile, Cluster, false, Epilogue, cute::GMMA::Major::MN>;
  using ScaleConfig = typename MainloopOf::ScaleConfig;
  using LayoutSFA = typename MainloopOf::LayoutSFA;
  using LayoutSFB = typename MainloopOf::LayoutSFB;
  using Mainloop = typename MainloopOf::Op;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
};

/* The groups' operands in device memory (the mainloop's arguments), the
 * first part of each launch's block. */
template <class C> struct Operands {
  typename C::Shape3 *shape;
  const e4m3 **a;
  const e4m3 **b;
  const float **sfa;
  const float **sfb;
  typename C::StrideA *sa;
  typename C::StrideB *sb;
  typename C::LayoutSFA *lsfa;
  typename C::LayoutSFB *lsfb;

  void carve_operands(mok_cg::GroupArrays &g) {
    shape = g.take<typename C::Shape3>();
    a = g.take<const e4m3 *>();
    b = g.take<const e4m3 *>();
    sfa = g.take<const float *>();
    sfb = g.take<const float *>();
    sa = g.take<typename C::StrideA>();
    sb = g.take<typename C::StrideB>();
    lsfa = g.take<typename C::LayoutSFA>();
    lsfb = g.take<typename C::LayoutSFB>();
  }
  template <class Args> void to(Args &args, int n) const {
    args.problem_shape = {n, shape, nullptr};
    args.mainloop = {a, sa, b, sb, sfa, lsfa, sfb, lsfb};
  }
};

/* The plain products' block: the operands, then each group's D. */
template <class C> struct Args : Operands<C> {
  bfloat16_t **d;
  typename C::StrideD *sd;

  static Args carve(mok_cg::GroupArrays &g) {
    Args r;
    r.carve_operands(g);
    r.d = g.take<bfloat16_t *>();
    r.sd = g.take<typename C::StrideD>();
    return r;
  }
};

/* DOWN_DGRAD's block: the operands, then each group's first row for the epilogue. */
template <class C> struct DgradArgs : Operands<C> {
  int *first;

  static DgradArgs carve(mok_cg::GroupArrays &g) {
    DgradArgs r;
    r.carve_operands(g);
    r.first = g.take<int>();
    return r;
  }
};

/* Group i's operands: expert e's rows of A (their scales) times set s's
 * B[e] (its scales); a failed job's groups have no rows. Returns the rows. */
template <class C>
__device__ inline mok__cg_rows group_operands(const mok__cg_f8 &p, const Operands<C> &a, int i,
                                              int e, int s, bool failed) {
  const long long kb = p.K / 128, nb = p.N / 128;
  const mok__cg_rows r = mok__cg_rows_of(p.offsets, p.counts, e, p.M);
  const int rows = failed ? 0 : r.count;
  a.shape[i] = typename C::Shape3(rows, p.N, p.K);
  a.a[i] = (const e4m3 *)(p.a + (long long)r.first * p.K);
  a.sfa[i] = p.sa + (long long)r.first * kb;
  a.b[i] = (const e4m3 *)(p.b[s] + (long long)e * p.N * p.K);
  a.sfb[i] = p.sb[s] + (long long)e * nb * kb;
  a.sa[i] = mok_cg::ld_stride<typename C::StrideA>(p.K);
  a.sb[i] = mok_cg::ld_stride<typename C::StrideB>(p.K);
  a.lsfa[i] = C::ScaleConfig::tile_atom_to_shape_SFA(make_shape(rows, p.N, p.K, 1));
  a.lsfb[i] = C::ScaleConfig::tile_atom_to_shape_SFB(make_shape(rows, p.N, p.K, 1));
  return r;
}

/* Group i = expert i / sets, set i % sets: its rows of A times that set's
 * B[e], into C[set]'s rows. */
template <class C> __global__ void f8_args(const mok__cg_f8 p, Args<C> a) {
  const bool failed = job_failed(p.status);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < p.groups * p.sets;
       i += gridDim.x * blockDim.x) {
    const int s = i % p.sets;
    const mok__cg_rows r = group_operands<C>(p, a, i, i / p.sets, s, failed);
    a.d[i] = (bfloat16_t *)(p.c[s] + (long long)r.first * p.N);
    a.sd[i] = mok_cg::ld_stride<typename C::StrideD>(p.N);
  }
}

/* Group e: a [rows of e][N] = dq [rows][K] (d_out quantised) times W_d[e]'s
 * transposed bytes [N][K]. */
template <class C> __global__ void f8_dgrad_args(const mok__cg_f8 p, DgradArgs<C> a) {
  const bool failed = job_failed(p.status);
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.groups; e += gridDim.x * blockDim.x)
    a.first[e] = group_operands<C>(p, a, e, e, 0, failed).first;
}

/* The product on configuration C on `ctas` persistent CTAs (0: every SM),
 * through grouped.cuh's run_groups. Returns a mok_status. */
template <class C> int run(const mok__cg_f8 &p, int ctas, cudaStream_t stream) {
  const int n = p.groups * p.sets;
  return mok_cg::run_groups<C, Args<C>>(n, ctas, stream, [&](const Args<C> &a, auto &args) {
    f8_args<C><<<mok_cg::args_blocks(n), mok_cg::ARGS_THREADS, 0, stream>>>(p, a);
    a.to(args, n);
    mok_cg::store_args(args.epilogue, a.d, a.sd);
  });
}

/* The FP8 down dgrad on configuration C: the TMA maps of g and u, then the
 * grouped GEMM, as dgrad.cuh's run. */
template <class C> int run_dgrad(const mok__cg_f8 &p, int ctas, cudaStream_t stream) {
  using Epi = typename C::Epilogue;
  const int n = p.groups;
  if (n <= 0) return MOK_OK;
  typename Epi::Arguments epi{};
  epi.out = mok_cg::DgradOut{nullptr, p.row_slot, p.rw, p.n_slots, p.dgu, p.h, p.partial,
                             p.n_partial, p.N, p.has_limit, p.limit, p.hq, p.hs};
  const int st = Epi::map_saved(epi, p.g, p.u, p.N, p.M);
  if (st != MOK_OK) return st;
  return mok_cg::run_groups<C, DgradArgs<C>>(n, ctas, stream, [&](const DgradArgs<C> &a,
                                                                  auto &args) {
    f8_dgrad_args<C><<<mok_cg::args_blocks(n), mok_cg::ARGS_THREADS, 0, stream>>>(p, a);
    epi.out.first = a.first;
    a.to(args, n);
    args.epilogue = epi;
  });
}

} // namespace mok_cg_f8

#endif /* MOK_CUTLASS_FP8_CUH */
