/* SPDX-License-Identifier: Apache-2.0 */
/* The layer's plain grouped products on CUTLASS's sm90 grouped GEMM
 * (GemmUniversal over a GroupProblemShape: persistent, warp-specialised,
 * TMA + wgmma, per-group TMA descriptors made on the device).
 *
 * A product is a list of groups; each group's shape and base pointers are
 * written on the device, by one small kernel on the job's stream, from the
 * schedule's offsets and counts (the validated copy the launcher is given,
 * never client memory) and the job's status word: a failed job gets groups
 * of no rows, so the GEMM writes nothing. No host reads a device value.
 *
 * Every output element is one accumulation over k in ascending order from
 * zero, rounded once to bf16, as in the mma.sync kernels: results are
 * bitwise equal to theirs (tests/gpu/test_gemm_sm90.cu checks).
 *
 * Each configuration is instantiated in a translation unit of its own
 * (kernels/cutlass_gemm/cfg_NAME.cu); launch.h is what the rest of the library sees. */
#ifndef MOK_CUTLASS_GROUPED_CUH
#define MOK_CUTLASS_GROUPED_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "common/gemm_params.cuh"
#include "cutlass_gemm/launch.h"
#include "mok_kernels_internal.cuh"

namespace mok_cg {

using namespace cute;
using cutlass::bfloat16_t;

/* The plain products' epilogue: D = the f32 accumulator rounded to bf16,
 * row-major, through TMA stores (no C). */
template <class Tile, class Cluster, bool PingPong> struct StoreEpilogue {
  using Schedule =
      std::conditional_t<PingPong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
  using LayoutD = cutlass::layout::RowMajor;
  using Op = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD *, 8,
      bfloat16_t, LayoutD *, 8, Schedule,
      cutlass::epilogue::fusion::LinearCombination<bfloat16_t, float, void, float>>::CollectiveOp;
};

/* One configuration: operand layouts (CUTLASS's names: RowMajor A is
 * K-major, ColumnMajor B is K-major), the CTA tile, the cluster and the
 * kernel schedule (cooperative or ping-pong). D is row-major bf16. */
template <class LayoutA, class LayoutB, class Tile, class Cluster, bool PingPong>
struct Config {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using KernelSchedule =
      std::conditional_t<PingPong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using Epilogue = typename StoreEpilogue<Tile, Cluster, PingPong>::Op;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bfloat16_t, LayoutA *, 8, bfloat16_t,
      LayoutB *, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

/* A stride of one operand: its leading dimension in the one dynamic mode
 * (the other is the unit stride, the batch mode unused). */
template <class S> __host__ __device__ inline S ld_stride(int64_t ld) {
  S s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(get<0>(s))>>::value)
    get<1>(s) = ld;
  else
    get<0>(s) = ld;
  return s;
}

/* Per-group arrays carved from one block of device memory, in the order
 * they are taken, each at a 256-byte boundary; over a null block it only
 * measures. Every launch's arguments (Args here, dgrad.cuh's) are laid out
 * by one of these, so bytes and addresses cannot disagree. */
class GroupArrays {
public:
  GroupArrays(void *mem, int groups) : base_((uintptr_t)mem), groups_((size_t)groups) {}
  template <class T> T *take() {
    T *p = reinterpret_cast<T *>(base_ + used_);
    used_ += (groups_ * sizeof(T) + 255) & ~(size_t)255;
    return p;
  }
  size_t bytes() const { return used_; }

private:
  uintptr_t base_;
  size_t groups_;
  size_t used_ = 0;
};

/* A launch's argument arrays (A: a struct with static A carve(GroupArrays &)). */
template <class A> inline size_t group_args_bytes(int groups) {
  GroupArrays g(nullptr, groups);
  (void)A::carve(g);
  return g.bytes();
}

template <class A> inline A group_args_at(void *mem, int groups) {
  GroupArrays g(mem, groups);
  return A::carve(g);
}

/* The groups' arguments in device memory, one block per launch. */
template <class C> struct Args {
  typename C::Shape3 *shape;
  const bfloat16_t **a;
  const bfloat16_t **b;
  bfloat16_t **d;
  typename C::StrideA *sa;
  typename C::StrideB *sb;
  typename C::StrideD *sd;

  static Args carve(GroupArrays &g) {
    Args r;
    r.shape = g.take<typename C::Shape3>();
    r.a = g.take<const bfloat16_t *>();
    r.b = g.take<const bfloat16_t *>();
    r.d = g.take<bfloat16_t *>();
    r.sa = g.take<typename C::StrideA>();
    r.sb = g.take<typename C::StrideB>();
    r.sd = g.take<typename C::StrideD>();
    return r;
  }
};

/* Group e of a row-mode product (DOWN, the down dgrad): its shape (no
 * rows when the job failed), the A rows and B weights it reads and their
 * strides, into a launch's arrays (an Args with shape, a, b, sa, sb).
 * Returns the group's rows. */
template <class C, class A>
__device__ inline mok__cg_rows row_group_args(const mok_gemm_params &p, int e, bool failed, A &a) {
  const mok__cg_rows r = mok__cg_group_rows(p, e, p.M);
  a.shape[e] = typename C::Shape3(failed ? 0 : r.count, p.N, p.K);
  a.a[e] = (const bfloat16_t *)(p.A + (long long)r.first * p.lda);
  a.b[e] = (const bfloat16_t *)(p.B0 + (long long)e * p.b_expert_stride);
  a.sa[e] = ld_stride<typename C::StrideA>(p.lda);
  a.sb[e] = ld_stride<typename C::StrideB>(p.ldb);
  return r;
}

/* DOWN: group e is y[rows] [count, H] = h[rows] [count, I] W_d[e]^T. */
template <class C> __global__ void down_args(const mok_gemm_params p, Args<C> a) {
  const bool failed = job_failed(p.status);
  for (int e = blockIdx.x * blockDim.x + threadIdx.x; e < p.groups; e += gridDim.x * blockDim.x) {
    const mok__cg_rows r = row_group_args<C>(p, e, failed, a);
    a.d[e] = (bfloat16_t *)(p.C0 + (long long)r.first * p.ldc);
    a.sd[e] = ld_stride<typename C::StrideD>(p.ldc);
  }
}

/* WGRAD: per expert e (in e_range) and output half s (rows < c_split to
 * C0, the rest to C1): D [m, N] = a[rows, cols of the half]^T b[rows, :],
 * K = the expert's rows. An expert without rows gets no group (CUTLASS's
 * k loop needs one k tile); wgrad_zero writes its zeros. */
template <class C> __global__ void wgrad_args(const mok_gemm_params p, Args<C> a, int halves) {
  const bool failed = job_failed(p.status);
  int e0 = 0, e1 = p.groups;
  if (p.e_range) {
    e0 = max(0, min(p.e_range[0], p.groups));
    e1 = max(e0, min(p.e_range[1], p.groups));
  }
  const int n = p.groups * halves;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int e = i / halves, s = i % halves;
    const mok__cg_rows r = mok__cg_group_rows(p, e, p.K);
    const int m0 = s ? p.c_split : 0, m = s ? p.M - p.c_split : (halves > 1 ? p.c_split : p.M);
    const bool live = !failed && e >= e0 && e < e1 && r.count > 0;
    a.shape[i] = typename C::Shape3(live ? m : 0, p.N, live ? r.count : 0);
    a.a[i] = (const bfloat16_t *)(p.A + (long long)r.first * p.lda + m0);
    a.b[i] = (const bfloat16_t *)(p.B0 + (long long)r.first * p.ldb);
    a.d[i] = (bfloat16_t *)((s ? p.C1 : p.C0) + (long long)e * p.c_expert_stride);
    a.sa[i] = ld_stride<typename C::StrideA>(p.lda);
    a.sb[i] = ld_stride<typename C::StrideB>(p.ldb);
    a.sd[i] = ld_stride<typename C::StrideD>(p.ldc);
  }
}

/* The device's SMs and the most clusters of this kernel that run at once,
 * asked once per configuration (the device is the process's current one). */
template <class C> inline cutlass::KernelHardwareInfo hw_info() {
  static const cutlass::KernelHardwareInfo info = [] {
    int dev = 0;
    cudaGetDevice(&dev);
    return cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename C::Kernel>(dev);
  }();
  return info;
}

/* The grouped GEMM's arguments for n groups on `ctas` persistent CTAs (0:
 * every SM; tests: fewer, in whole clusters), and the bytes of CUTLASS's
 * workspace for them (the groups' pointers are known before the allocation
 * only as an offset: sized from arguments of the same shape). */
template <class C>
typename C::Gemm::Arguments grouped_args(int ctas, int n, size_t *workspace_bytes) {
  using Gemm = typename C::Gemm;
  typename Gemm::Arguments args;
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.hw_info = hw_info<C>();
  if (ctas > 0) {
    const int cs = (int)cute::size(typename C::Kernel::ClusterShape{});
    const int clusters = (ctas + cs - 1) / cs;
    args.hw_info.sm_count = clusters * cs;
    args.hw_info.max_active_clusters = clusters;
  }
  typename Gemm::Arguments probe = args;
  probe.problem_shape = {n, nullptr, nullptr};
  *workspace_bytes = Gemm::get_workspace_size(probe);
  return args;
}

/* One stream-ordered allocation for a launch's groups and workspace.
 * Returns a mok_status. */
inline int alloc_launch(void **mem, size_t bytes, cudaStream_t stream) {
  const cudaError_t ce = cudaMallocAsync(mem, bytes, stream);
  if (ce == cudaSuccess) return MOK_OK;
  mok_k_set_cuda_error((int)ce);
  return MOK_EENGINE;
}

/* The GEMM on args, CUTLASS's workspace at mem + ab; then mem is freed
 * (stream-ordered) whatever happened. Returns a mok_status. */
template <class Gemm>
int run_and_free(const typename Gemm::Arguments &args, void *mem, size_t ab, cudaStream_t stream) {
  Gemm gemm;
  int st = MOK_OK;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) st = MOK_EINVAL;
  if (st == MOK_OK && gemm.initialize(args, (char *)mem + ab, stream) != cutlass::Status::kSuccess)
    st = MOK_EENGINE;
  if (st == MOK_OK && gemm.run(stream) != cutlass::Status::kSuccess) st = MOK_EENGINE;
  const cudaError_t ce = cudaFreeAsync(mem, stream);
  if (st == MOK_OK && ce != cudaSuccess) {
    mok_k_set_cuda_error((int)ce);
    st = MOK_EENGINE;
  }
  if (st == MOK_OK) st = mok_k_launch_status();
  return st;
}

/* A grouped GEMM of n groups on configuration C with arguments laid out by
 * A, on `ctas` persistent CTAs (0: every SM): the groups' arguments and
 * CUTLASS's workspace in one stream-ordered allocation; prepare(a, args)
 * launches the kernel that writes the groups' arguments into a and fills
 * CUTLASS's args from it; then the GEMM. Returns a mok_status. */
template <class C, class A, class Prepare>
int run_groups(int n, int ctas, cudaStream_t stream, Prepare prepare) {
  using Gemm = typename C::Gemm;
  if (n <= 0) return MOK_OK;
  const size_t ab = group_args_bytes<A>(n);
  size_t ws = 0;
  typename Gemm::Arguments args = grouped_args<C>(ctas, n, &ws);
  void *mem = nullptr;
  const int st = alloc_launch(&mem, ab + ws, stream);
  if (st != MOK_OK) return st;
  prepare(group_args_at<A>(mem, n), args);
  return run_and_free<Gemm>(args, mem, ab, stream);
}

/* StoreEpilogue's arguments: D = acc, to each group's d with stride sd. */
template <class EpilogueArgs, class D, class SD> void store_args(EpilogueArgs &e, D d, SD sd) {
  e.thread.alpha = 1.0f;
  e.thread.beta = 0.0f;
  e.ptr_C = nullptr;
  e.dC = nullptr;
  e.ptr_D = d;
  e.dD = sd;
}

/* The threads and blocks of an arguments kernel over n groups. */
constexpr int ARGS_THREADS = 128;
inline int args_blocks(int n) { return (n + ARGS_THREADS - 1) / ARGS_THREADS; }

/* One product on configuration C (WGRAD: a weight gradient in `halves`
 * output halves; else DOWN) on `ctas` persistent CTAs (0: every SM).
 * Returns a mok_status. */
template <class C, bool Wgrad>
int run(const mok_gemm_params &p, int halves, int ctas, cudaStream_t stream) {
  const int n = p.groups * (Wgrad ? halves : 1);
  return run_groups<C, Args<C>>(n, ctas, stream, [&](const Args<C> &a, auto &args) {
    if constexpr (Wgrad)
      wgrad_args<C><<<args_blocks(n), ARGS_THREADS, 0, stream>>>(p, a, halves);
    else
      down_args<C><<<args_blocks(n), ARGS_THREADS, 0, stream>>>(p, a);
    args.problem_shape = {n, a.shape, nullptr};
    args.mainloop = {a.a, a.sa, a.b, a.sb};
    store_args(args.epilogue, a.d, a.sd);
  });
}

} // namespace mok_cg

#endif /* MOK_CUTLASS_GROUPED_CUH */
