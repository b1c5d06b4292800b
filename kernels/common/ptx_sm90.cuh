/* SPDX-License-Identifier: Apache-2.0 */
/* Hopper (sm_90a) PTX wrappers for the wgmma/TMA GEMMs: mbarriers, TMA tile
 * loads (also multicast to a cluster), thread-block clusters, wgmma with
 * shared-memory descriptors, register reallocation. Inline PTX only (no
 * CUTLASS/CuTe); each wrapper is one instruction or a tight loop around one. */
#ifndef MOK_COMMON_PTX_SM90_CUH
#define MOK_COMMON_PTX_SM90_CUH

#include <cuda.h> /* CUtensorMap (type only; no driver library is linked) */
#include <stdint.h>

#include "ptx.cuh"

/* ---- mbarriers ------------------------------------------------------------------- */

__device__ static inline void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

/* Makes barrier initialisation visible to the async proxy (TMA). */
__device__ static inline void mbar_fence_init(void) {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* Producer: one arrival, and the bytes the phase's TMA loads will deliver. */
__device__ static inline void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}

/* Arrives when pred holds; the predicate stays inside the PTX, so the
 * compiler sees no divergent branch near in-flight wgmmas (it would
 * serialise them otherwise, ptxas C7518). */
__device__ static inline void mbar_arrive_if(uint32_t bar, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n"
      "@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(bar),
      "r"((int)pred)
      : "memory");
}

/* Returns once the phase of parity `parity` has completed (a fresh barrier
 * is in phase 0, so parity 1 passes at once). The retry loop is inside the
 * PTX for the same reason as above. */
__device__ static inline void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred p;\n"
      "MOK_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra MOK_WAIT;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

/* ---- TMA tile loads (completion counted on an mbarrier) ----------------------- */

__device__ static inline void tma_load_2d(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                          uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}

__device__ static inline void tma_load_3d(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                          int c2, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

/* The same loads with an L2 eviction-priority policy (createpolicy). */
__device__ static inline void tma_load_2d_hint(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                               uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar), "l"(policy)
      : "memory");
}

__device__ static inline void tma_load_3d_hint(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                               int c2, uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3, %4}], [%5], %6;\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}

/* ---- thread-block clusters (2 CTAs sharing operand tiles) ---------------------- */

/* This CTA's rank in its cluster. */
__device__ static inline uint32_t cluster_ctarank(void) {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

/* Every thread of every CTA of the cluster arrives, then waits for all:
 * orders shared-memory writes (barrier inits, DSMEM stores) before the
 * other CTAs' later accesses. Not .aligned: callers need not be converged. */
__device__ static inline void cluster_sync(void) {
  asm volatile("barrier.cluster.arrive.release;\n" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire;\n" ::: "memory");
}

/* The address of the same shared-memory location in CTA `rank` of the
 * cluster (a shared::cluster address). */
__device__ static inline uint32_t cluster_map(uint32_t saddr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(saddr), "r"(rank));
  return r;
}

__device__ static inline void st_cluster_u32(uint32_t caddr, uint32_t v) {
  asm volatile("st.shared::cluster.u32 [%0], %1;\n" ::"r"(caddr), "r"(v) : "memory");
}

__device__ static inline uint32_t ld_cluster_u32(uint32_t caddr) {
  uint32_t v;
  asm volatile("ld.shared::cluster.u32 %0, [%1];\n" : "=r"(v) : "r"(caddr) : "memory");
  return v;
}

/* Arrives on the mbarrier at this CTA-relative address in CTA `rank` of the
 * cluster (this CTA's own rank included) when pred holds; the predicate
 * stays inside the PTX (see mbar_arrive_if). */
__device__ static inline void mbar_arrive_cluster_if(uint32_t bar, uint32_t rank, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 ra;\nsetp.ne.b32 p, %2, 0;\n"
      "@p mapa.shared::cluster.u32 ra, %0, %1;\n"
      "@p mbarrier.arrive.shared::cluster.b64 _, [ra];\n}\n" ::"r"(bar),
      "r"(rank), "r"((int)pred)
      : "memory");
}

/* TMA tile loads delivered to the same CTA-relative address (and counted
 * on the mbarrier at the same address) in every CTA of cta_mask. */
__device__ static inline void tma_load_2d_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                             uint32_t bar, uint16_t cta_mask, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar), "h"(cta_mask), "l"(policy)
      : "memory");
}

__device__ static inline void tma_load_3d_mc(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                             int c2, uint32_t bar, uint16_t cta_mask,
                                             uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%2, %3, %4}], [%5], %6, %7;\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "h"(cta_mask), "l"(policy)
      : "memory");
}

/* ---- TMA tile stores from shared memory (bulk groups) ------------------------- */

/* Out-of-bounds parts of the box are not written. */
__device__ static inline void tma_store_3d(const CUtensorMap *map, uint32_t src, int c0, int c1,
                                           int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n" ::"l"(
                   (uint64_t)map),
               "r"(c0), "r"(c1), "r"(c2), "r"(src)
               : "memory");
}

__device__ static inline void bulk_commit(void) {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

/* The committed stores have finished reading shared memory. */
__device__ static inline void bulk_wait_read0(void) {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

/* The committed stores are complete. */
__device__ static inline void bulk_wait0(void) {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

__device__ static inline void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

/* L2 policies: 0 evict_normal, 1 evict_last (keep), 2 evict_first (stream). */
__device__ static inline uint64_t l2_policy(int kind) {
  uint64_t p;
  if (kind == 1)
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(p));
  else if (kind == 2)
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
  else
    asm volatile("createpolicy.fractional.L2::evict_normal.b64 %0, 1.0;\n" : "=l"(p));
  return p;
}

__device__ static inline void tma_prefetch_map(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"((uint64_t)map) : "memory");
}

/* ---- register reallocation between warpgroups ------------------------------------ */

template <int N> __device__ static inline void regs_dec(void) {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N> __device__ static inline void regs_inc(void) {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}

/* ---- wgmma ------------------------------------------------------------------------ */

/* Shared-memory matrix descriptor of a K-major tile written by TMA with the
 * 128-byte swizzle: rows of 128 B (64 bf16 of K), 8-row groups 1024 B apart
 * (SBO); LBO is unused for this layout (set to 1 as is customary). The
 * tile base must be 1024-byte aligned (the swizzle uses address bits). */
__device__ static inline uint64_t wgmma_desc_k128(uint32_t saddr) {
  uint64_t d = (uint64_t)((saddr & 0x3FFFF) >> 4);
  d |= (uint64_t)1 << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

/* The same for an MN-major tile (M or N contiguous: the operand's stored
 * layout when it is not K-major), as TMA writes boxes of 64 MN elements x
 * 64 K rows with the 128-byte swizzle: 128-byte rows of 64 MN elements,
 * one row per k. LBO: distance between 64-element MN slabs (one 8 KB box);
 * SBO: distance between 8-row groups along K (1 KB). Used with the wgmma
 * transpose bit; a k16 step is +16 rows = +2048 B. */
__device__ static inline uint64_t wgmma_desc_mn128(uint32_t saddr) {
  uint64_t d = (uint64_t)((saddr & 0x3FFFF) >> 4);
  d |= (uint64_t)(8192 >> 4) << 16;
  d |= (uint64_t)(1024 >> 4) << 32;
  d |= (uint64_t)1 << 62;
  return d;
}

/* Orders this thread's generic-proxy shared-memory writes before later
 * async-proxy (wgmma, TMA) accesses. */
__device__ static inline void fence_proxy_async_smem(void) {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

/* 16 bytes global -> shared, bypassing L1; src_bytes 0 writes zeros (no
 * byte is read, but src must still be a mapped address). */
__device__ static inline void cp_async16_zfill(uint32_t dst, const void *src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}

/* cp_async16_zfill without the source size: a whole 16-byte copy (one
 * instruction fewer where the caller knows the row is real) */
__device__ static inline void cp_async16(uint32_t dst, const void *src) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

/* One arrival on bar once every cp.async this thread issued before has
 * landed; noinc: the arrival is one of the barrier's expected count. */
__device__ static inline void cp_async_mbar_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

__device__ static inline void st_shared_zero16(uint32_t addr) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(addr), "r"(0) : "memory");
}

__device__ static inline void wgmma_fence(void) {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ static inline void wgmma_commit(void) {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N> __device__ static inline void wgmma_wait(void) {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

/* Keeps the compiler from moving accumulator reads or writes across the
 * asynchronous wgmma window. */
template <int N> __device__ static inline void acc_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}

/* D[64x256] (+)= A[64x16] B[16x256], both from shared memory (128-byte
 * swizzle); TA, TB: the wgmma transpose bits (0: K-major tile, 1: MN-major);
 * scale_d = 0 starts a fresh accumulation. */
template <int TA, int TB>
__device__ static inline void wgmma_m64n256k16(float (&d)[128], uint64_t da, uint64_t db,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* The 64 accumulator registers of an m64n128 wgmma (one thread's share of
 * a 64x128 f32 tile): their operand numbers in the instruction text, and
 * the operands themselves, shared by every m64n128 wrapper. */
#define MOK_WGMMA_D64_REGS                                                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                        \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "              \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "              \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MOK_WGMMA_D64_OUTS(d)                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
  "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
  "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
  "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

/* D[64x128] (+)= A[64x16] B[16x128]: as wgmma_m64n256k16, half the columns
 * (accumulator register i: row 16*warp + lane/4 + 8*((i>>1)&1), column
 * 8*(i>>2) + 2*(lane%4) + (i&1)). */
template <int TA, int TB>
__device__ static inline void wgmma_m64n128k16(float (&d)[64], uint64_t da, uint64_t db,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MOK_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
      : MOK_WGMMA_D64_OUTS(d)
      : "l"(da), "l"(db), "r"(scale_d), "n"(TA), "n"(TB));
}

/* D[64x128] (+)= A[64x32] B[32x128] in e4m3, into f32 registers at the
 * tensor cores' e4m3 accumulation precision (narrower than f32: callers
 * promote the partial sums), both operands K-major in shared memory (e4m3
 * has no transposed form); a k32 step is 32 bytes of each row. The
 * registers are as wgmma_m64n128k16's. */
__device__ static inline void wgmma_m64n128k32_e4m3(float (&d)[64], uint64_t da, uint64_t db,
                                                    int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MOK_WGMMA_D64_REGS
      "}, %64, %65, p, 1, 1;\n}\n"
      : MOK_WGMMA_D64_OUTS(d)
      : "l"(da), "l"(db), "r"(scale_d));
}

#endif /* MOK_COMMON_PTX_SM90_CUH */
