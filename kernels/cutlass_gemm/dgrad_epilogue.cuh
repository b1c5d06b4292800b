/* SPDX-License-Identifier: Apache-2.0 */
/* The down dgrad's epilogue as a CUTLASS sm90 collective epilogue: the
 * SwiGLU backward of a = d_out W_d[e] (docs/math.md) on a 128x256 tile of
 * the cooperative ptr-array kernel, with the saved g and u brought in by
 * TMA ahead of use.
 *
 * The kernel's epilogue load warp runs ahead of the consumers: while they
 * still run a tile's k loop it loads the tile's g and u, 128 rows x 32
 * columns a stage (64-byte swizzle: the consumers' reads hit every bank
 * once), into a ring of Stages; the consumers take each stage in column
 * order, store dg, du (one row of dg | du, ld 2N) and h from registers,
 * and give the stage back. So the loads that stalled the hand-written
 * kernel's epilogue (long scoreboard on g and u) are in flight during the
 * k loop instead.
 *
 * Every value is the one the other kernels compute, in the same order
 * (swiglu.cuh's explicitly rounded steps); the d_rw partial of each
 * 128-column half sums, as theirs does, each thread's columns of a
 * 32-column slice (8-column groups ascending, the pair in order), then the
 * quad ((q0+q1)+(q2+q3)), then the four slices in order. The accumulator
 * of fragment index 4j + 2hh + c is row 16*warp + lane/4 + 8hh (of the
 * warpgroup's 64) and column 8j + 2(lane%4) + c: wgmma's m64n256 layout,
 * as in the hand-written kernels (the bitwise tests check it).
 *
 * Rows: a group's tile rows below its count; the rows of a group's padding
 * and past the last group are written by dgrad_zero_rows (launch.cu).
 *
 * Fp8 (the fp8 layer's down dgrad, on the FP8 mainloop of fp8.cuh; a tile of
 * 128 columns, one scale block): dg and du are also quantised per row per
 * 128 columns from their bf16 values (the amax a running max, then over the
 * quad), and the d_rw partial sums a thread's 32 columns of the row
 * ascending, then the quad: mok_gemm_sm90_fp8.cu's down dgrad epilogue, bit
 * for bit. The quantisation reads the bf16 values back from shared memory:
 * each thread writes its dg and du pairs over the g and u it just read in
 * the stage (the same bytes, its own), and the tile's stages (the ring holds
 * all of them) go back to the load warp only after the quantisation. Kept
 * in registers instead, the fully unrolled epilogue missed the instruction
 * cache on 31 % of its samples; read back from global memory (the stores
 * just made), the tile waited on L2 (ncu: half the stall cycles long
 * scoreboard, tensor pipe 27 %). */
#ifndef MOK_CUTLASS_DGRAD_EPILOGUE_CUH
#define MOK_CUTLASS_DGRAD_EPILOGUE_CUH

#include "cutlass_gemm/grouped.cuh"

#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/pipeline/pipeline.hpp"

#include "common/fp8_e4m3.h"
#include "common/ptx_sm90.cuh"
#include "common/swiglu.cuh"

namespace mok_cg {

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float2 bf2_to_f2(uint32_t w) {
  __nv_bfloat162 b;
  memcpy(&b, &w, 4);
  return __bfloat1622float2(b);
}

/* What the epilogue reads and writes beside the accumulators: device
 * pointers the launcher took from its validated parameters. */
struct DgradOut {
  const int *first;       /* per group: its first row in the routed buffer (dgrad_args) */
  const int32_t *row_slot; /* each row's slot, for its router weight */
  const float *rw;        /* router weight per slot (NULL: 1) */
  int n_slots;
  bf16 *dgu;              /* [rows][2N]: dg | du */
  bf16 *h;                /* [rows][N]: rw h, the down weight gradient's operand */
  float *partial;         /* [rows][n_partial] (NULL: none) */
  int n_partial;
  int N;
  int has_limit;
  float limit;
  uint8_t *q; /* Fp8: dg | du quantised, [rows][2N] bytes, scales qs [rows][2N/128] */
  float *qs;
};

/* Stages: the ring of g/u stages; BN: the tile's columns (256 on the
 * cooperative kernel, whose two warpgroups share a tile, 64 rows each; 128
 * on the ping-pong kernel, whose warpgroups take tiles in turn, 128 rows
 * each as two m64 blocks). */
template <int Stages, int BN_, bool Coop, bool Fp8 = false> class DgradEpilogue {
public:
  static constexpr int BM = 128, BN = BN_, SN = 32; /* tile; the columns of a stage */
  static constexpr int SUBTILES = BN / SN;
  static constexpr int STAGE_BYTES = BM * SN * 2; /* one of g, u */
  static constexpr int THREADS = Coop ? 256 : 128;  /* the threads that share a tile */
  static constexpr int MB = Coop ? 1 : 2;           /* m64 blocks a thread holds */
  static constexpr int VALS = BN / 2;               /* accumulators a thread holds per m64 block */
  static constexpr int UNROLL = Fp8 ? 2 : 4;        /* stages a round of the consumers' loop */
  static_assert(!Fp8 || (BN == 128 && MB == 1),
                "Fp8: a tile is one scale block of 128 columns, one m64 block a thread");
  static_assert(!Fp8 || Stages >= SUBTILES, "Fp8: the ring holds a whole tile's stages");

  using DispatchPolicy = cutlass::epilogue::PtrArrayNoSmemWarpSpecialized;
  using EpilogueSchedule = DispatchPolicy;
  using ThreadEpilogueOp = cutlass::epilogue::thread::LinearCombination<bfloat16_t, 8, float, float>;
  using ElementC = bfloat16_t;
  using ElementD = bfloat16_t;
  using InternalStrideC = cute::Stride<int64_t, cute::_1, cute::_0>;
  using InternalStrideD = InternalStrideC;
  using StrideC = InternalStrideC *;
  using StrideD = InternalStrideD *;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  static constexpr int NumEpilogueWarpGroups = Coop ? 2 : 1;

  using LoadPipeline = cutlass::PipelineTransactionAsync<Stages>;
  using LoadPipelineState = cutlass::PipelineState<Stages>;
  static constexpr bool RequiresTransactionBytes = true;
  using StorePipeline = cutlass::PipelineTmaStore<0>;
  using StorePipelineState = cutlass::PipelineState<0>;

  struct TensorStorage {
    alignas(1024) uint8_t g[Stages][STAGE_BYTES];
    alignas(1024) uint8_t u[Stages][STAGE_BYTES];
  };
  struct TensorMapStorage {};
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  /* what the mainloop's stage count leaves room for */
  struct SharedStorage {
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  struct Arguments {
    DgradOut out;
    CUtensorMap map_g, map_u; /* g, u [rows][N] as bytes: boxes of 64 bytes x 128 rows */
  };
  struct Params {
    DgradOut out;
    CUtensorMap map_g, map_u;
    uint32_t tma_transaction_bytes;
  };

  /* The TMA maps of the saved g and u [M][N] (bf16, as bytes): boxes of one
   * stage, SN columns x BM rows, 64-byte swizzle. Returns a mok_status. */
  static int map_saved(Arguments &a, const void *g, const void *u, int N, int M) {
    const int st = mok__sm90_map_bytes(&a.map_g, g, 2, 2LL * N, M, 1, 2LL * N, 2LL * N * M, 2 * SN,
                                       BM, 64);
    return st != MOK_OK ? st
                        : mok__sm90_map_bytes(&a.map_u, u, 2, 2LL * N, M, 1, 2LL * N,
                                              2LL * N * M, 2 * SN, BM, 64);
  }

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const &, Arguments const &a, void *) {
    return Params{a.out, a.map_g, a.map_u, 2u * STAGE_BYTES};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const &, Arguments const &, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const &, Arguments const &, void *,
                                              cudaStream_t, cutlass::CudaHostAdapter * = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape> static bool can_implement(ProblemShape const &, Arguments const &) {
    return true;
  }
  template <class CtaTileMNK> CUTLASS_HOST_DEVICE static constexpr int get_load_pipe_increment(CtaTileMNK) {
    return SUBTILES;
  }
  template <class CtaTileMNK> CUTLASS_HOST_DEVICE static constexpr int get_store_pipe_increment(CtaTileMNK) {
    return 1;
  }
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const &p) {
    tma_prefetch_map(&p.map_g);
    tma_prefetch_map(&p.map_u);
  }

  CUTLASS_DEVICE DgradEpilogue(Params const &p, TensorStorage &s) : params(p), smem(s) {}

  CUTLASS_DEVICE bool is_producer_load_needed() const { return true; }

  CUTLASS_DEVICE auto load_init(Params const &, TensorMapStorage &, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  CUTLASS_DEVICE auto store_init(Params const &, TensorMapStorage &, int32_t, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }
  template <bool IsLoad, class ProblemShapeMNKL, class Map>
  CUTLASS_DEVICE void tensormaps_perform_update(TensorMapStorage &, Params const &, Map, ProblemShapeMNKL,
                                                int32_t, int32_t) {}
  template <bool IsLoad, class Map>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(TensorMapStorage &, Map, int32_t) {}
  template <bool IsLoad, class Map> CUTLASS_DEVICE void tensormaps_fence_acquire(Map) {}

  /* The group's first row and the tile's first row in the routed buffer. */
  template <class Coord> CUTLASS_DEVICE int tile_row0(Coord const &c) const {
    return params.out.first[int(get<3>(c))] + int(get<0>(c)) * BM;
  }

  /* The epilogue load warp: the tile's g and u, SUBTILES stages in column order. */
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma, class Map>
  CUTLASS_DEVICE LoadPipelineState load(LoadPipeline pipeline, LoadPipelineState state, ProblemShapeMNKL,
                                        TileShapeMNK, TileCoordMNKL coord, TiledMma, int,
                                        TensorStorage &, Map const &, int = -1, bool = false) {
    const int row0 = tile_row0(coord);
    const int col0_bytes = int(get<1>(coord)) * BN * 2;
    const bool issue = cute::elect_one_sync();
#pragma unroll 1
    for (int s = 0; s < SUBTILES; s++) {
      pipeline.producer_acquire(state);
      if (issue) {
        const uint32_t bar = (uint32_t)__cvta_generic_to_shared(pipeline.producer_get_barrier(state));
        const int c0 = col0_bytes + s * SN * 2;
        tma_load_2d((uint32_t)__cvta_generic_to_shared(smem.g[state.index()]), &params.map_g, c0, row0, bar);
        tma_load_2d((uint32_t)__cvta_generic_to_shared(smem.u[state.index()]), &params.map_u, c0, row0, bar);
        pipeline.producer_expect_transaction(state);
      }
      pipeline.producer_commit(state);
      ++state;
    }
    return state;
  }

  CUTLASS_DEVICE LoadPipelineState load_tail(LoadPipeline pipeline, LoadPipelineState state) {
    if (cute::elect_one_sync()) pipeline.producer_tail(state);
    return state;
  }

  /* The consumers: the tile's SwiGLU backward, stage by stage. Four stages
   * at a time are unrolled (all eight would not fit the instruction
   * cache); the accumulators stay registers by moving the next four
   * stages' 64 values of each m64 block to the front of a local copy. */
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class Map>
  CUTLASS_DEVICE auto store(LoadPipeline pipeline, LoadPipelineState state, StorePipeline,
                            StorePipelineState store_state, ProblemShapeMNKL problem, TileShapeMNK,
                            TileCoordMNKL coord, cute::Tensor<AccEngine, AccLayout> acc, TiledMma,
                            int thread_idx, TensorStorage &, Map const &, int = -1) {
    const DgradOut &o = params.out;
    const int wg = Coop ? thread_idx / 128 : 0, warp = (thread_idx % 128) / 32, lane = thread_idx % 32;
    const int q = lane & 3;
    const int rows = int(get<0>(problem)); /* the group's rows */
    const int m0 = int(get<0>(coord)) * BM, n_tile = int(get<1>(coord)) * BN;
    const int row0 = tile_row0(coord);
    constexpr int R = 2 * MB; /* the thread's rows: (m64 block, hh) */
    int rl[R];
    bool used[R];
    float w[R], v[R];
    int slot[R];
#pragma unroll
    for (int i = 0; i < R; i++) {
      rl[i] = 64 * (wg + i / 2) + 16 * warp + (lane >> 2) + 8 * (i % 2);
      used[i] = m0 + rl[i] < rows;
      slot[i] = o.rw && used[i] ? o.row_slot[row0 + rl[i]] : -1;
    }
#pragma unroll
    for (int i = 0; i < R; i++) {
      w[i] = !o.rw ? 1.0f : (slot[i] >= 0 && slot[i] < o.n_slots) ? o.rw[slot[i]] : 0.0f;
      v[i] = 0.0f;
    }
    float a[MB * VALS];
#pragma unroll
    for (int i = 0; i < MB * VALS; i++) a[i] = acc(i);
    /* Fp8: the largest |dg| and |du| of each row's stored values so far */
    float amax_g[R], amax_u[R];
#pragma unroll
    for (int i = 0; i < R; i++) amax_g[i] = amax_u[i] = 0.0f;
    const uint32_t g_base = (uint32_t)__cvta_generic_to_shared(smem.g[0]);
    const uint32_t u_base = (uint32_t)__cvta_generic_to_shared(smem.u[0]);
    const LoadPipelineState first = state; /* Fp8: the tile's stages, released at its end */
    static_assert(SUBTILES % UNROLL == 0 && VALS % (16 * UNROLL) == 0, "whole rounds of stages");
#pragma unroll 1
    for (int s0 = 0; s0 < SUBTILES; s0 += UNROLL)
#pragma unroll
    for (int su_ = 0; su_ < UNROLL; su_++) {
      const int s = s0 + su_;
      pipeline.consumer_wait(state);
      const uint32_t sg = g_base + state.index() * STAGE_BYTES, su = u_base + state.index() * STAGE_BYTES;
#pragma unroll
      for (int i = 0; i < R; i++) {
        const int r = rl[i], mb = i / 2, hh = i % 2;
        const long long grow = (long long)row0 + r;
        uint32_t gw[4], uw[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
          /* 64-byte swizzle: the 16-byte chunk j of row r sits at chunk j ^ ((r >> 1) & 3) */
          const uint32_t at = r * 64 + ((j ^ ((r >> 1) & 3)) << 4) + 4 * q;
          gw[j] = lds32(sg + at);
          uw[j] = lds32(su + at);
        }
        float rowsum = Fp8 ? v[i] : 0.0f;
#pragma unroll
        for (int j = 0; j < 4; j++) {
          const int n = n_tile + 32 * s + 8 * j + 2 * q;
          if (!used[i] || n >= o.N) continue;
          const float2 gp = bf2_to_f2(gw[j]), up = bf2_to_f2(uw[j]);
          const float gin[2] = {gp.x, gp.y}, uin[2] = {up.x, up.y};
          float dg[2], du[2], hv[2];
#pragma unroll
          for (int c = 0; c < 2; c++) {
            const float x = a[VALS * mb + 16 * su_ + 4 * j + 2 * hh + c];
            const swiglu_grad g = swiglu_backward(gin[c], uin[c], x, w[i], o.has_limit, o.limit);
            hv[c] = g.h;
            rowsum = __fadd_rn(rowsum, __fmul_rn(x, hv[c]));
            dg[c] = g.dg;
            du[c] = g.du;
          }
          bf16 *dgu = o.dgu + grow * (2LL * o.N);
          if constexpr (Fp8) { /* the pairs stored, kept in the stage for the quantisation */
            const __nv_bfloat162 gb = __floats2bfloat162_rn(dg[0], dg[1]);
            const __nv_bfloat162 ub = __floats2bfloat162_rn(du[0], du[1]);
            *(__nv_bfloat162 *)(dgu + n) = gb;
            *(__nv_bfloat162 *)(dgu + o.N + n) = ub;
            const uint32_t at = r * 64 + ((j ^ ((r >> 1) & 3)) << 4) + 4 * q;
            uint32_t gbw, ubw;
            memcpy(&gbw, &gb, 4);
            memcpy(&ubw, &ub, 4);
            st_shared_u32(sg + at, gbw);
            st_shared_u32(su + at, ubw);
            const float2 gq = __bfloat1622float2(gb), uq = __bfloat1622float2(ub);
            amax_g[i] = fmaxf(amax_g[i], fmaxf(fabsf(gq.x), fabsf(gq.y)));
            amax_u[i] = fmaxf(amax_u[i], fmaxf(fabsf(uq.x), fabsf(uq.y)));
          } else {
            store_bf16x2(dgu + n, dg[0], dg[1]);
            store_bf16x2(dgu + o.N + n, du[0], du[1]);
          }
          store_bf16x2(o.h + grow * o.N + n, swiglu_h_weighted(hv[0], w[i]),
                       swiglu_h_weighted(hv[1], w[i]));
        }
        if constexpr (Fp8) { /* the quad's sum once the row's 128 columns are in */
          v[i] = rowsum;
          if (s == SUBTILES - 1) {
            rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 1));
            rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 2));
            const int pt = n_tile / 128;
            if (o.partial && q == 0 && used[i] && pt < o.n_partial)
              o.partial[grow * o.n_partial + pt] = rowsum;
            /* a cluster's tile past N (N / 128 odd) stores nothing: its bytes
             * would land in du's */
            if (n_tile < o.N) {
              const long long at = grow * (2LL * o.N) + n_tile, sat = grow * (2LL * o.N / 128) + pt;
              quantize_row(amax_g[i], used[i], g_base, first.index(), rl[i], o.q + at, o.qs + sat);
              quantize_row(amax_u[i], used[i], u_base, first.index(), rl[i], o.q + at + o.N,
                           o.qs + sat + o.N / 128);
            }
          }
        } else {
          /* every lane reaches the shuffles (skipped columns add nothing) */
          rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 1));
          rowsum = __fadd_rn(rowsum, __shfl_xor_sync(0xffffffffu, rowsum, 2));
          v[i] = (s & 3) == 0 ? rowsum : __fadd_rn(v[i], rowsum);
          const int pt = (n_tile + 128 * (s >> 2)) / 128;
          if ((s & 3) == 3 && o.partial && q == 0 && used[i] && pt < o.n_partial)
            o.partial[grow * o.n_partial + pt] = v[i];
        }
      }
      /* the stage's reads (and Fp8's writes) are done before the next TMA
       * write to it; Fp8 gives the tile's stages back once it is quantised */
      cutlass::arch::fence_view_async_shared();
      if constexpr (Fp8) {
        if (s == SUBTILES - 1) {
          LoadPipelineState r = first;
#pragma unroll 1
          for (int k = 0; k < SUBTILES; k++, ++r) pipeline.consumer_release(r);
        }
      } else {
        pipeline.consumer_release(state);
      }
      ++state;
      /* after a round: the next round's accumulators to the front of each m64 block */
      if (su_ == UNROLL - 1 && s0 + UNROLL < SUBTILES) {
#pragma unroll
        for (int mb = 0; mb < MB; mb++)
#pragma unroll
          for (int i = 0; i + 16 * UNROLL < VALS; i++) a[VALS * mb + i] = a[VALS * mb + i + 16 * UNROLL];
      }
    }
    return cute::make_tuple(state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(state, store_state);
  }

private:
  /* Fp8: one row's 128 values (this thread's 32: the pairs at columns
   * 32s + 8j + 2q of tile row r, which this thread wrote into the stages at
   * `base`, the tile's first stage at index s0) quantised with the row
   * block's scale, as mok_gemm_sm90_fp8.cu's f8_quantize_row; amax: this
   * thread's largest |value|. Every lane of the quad calls it; a row past
   * the group's count stores nothing (dgrad_zero_rows). */
  CUTLASS_DEVICE static void quantize_row(float amax, bool used, uint32_t base, int s0, int r,
                                          uint8_t *q, float *qs) {
    const int cq = 2 * (threadIdx.x & 3);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    if (!used) return;
    const int ex = mok_fp8_scale_exp(amax);
#pragma unroll 4
    for (int k = 0; k < 16; k++) {
      const int s = k / 4, j = k % 4, c = 32 * s + 8 * j + cq;
      const uint32_t at = ((s0 + s) % Stages) * STAGE_BYTES + r * 64 +
                          ((j ^ ((r >> 1) & 3)) << 4) + 2 * cq;
      const float2 f = bf2_to_f2(lds32(base + at));
      *(uint16_t *)(q + c) = mok_fp8_quantize2(f.x, f.y, ex);
    }
    if ((threadIdx.x & 3) == 0) *qs = mok_fp8_pow2(ex);
  }

  Params const &params;
  TensorStorage &smem;
};

} // namespace mok_cg

#endif /* MOK_CUTLASS_DGRAD_EPILOGUE_CUH */
