/* SPDX-License-Identifier: Apache-2.0 */
/* Small copies and zero fills inside a job, several in one kernel.
 *
 * Why kernels, not cudaMemcpyAsync / cudaMemsetAsync: between two kernels a
 * copy-engine operation costs its own launch and a switch of engines, 4-8 us
 * on an H200 for a few hundred bytes (the daemon's step timeline, docs/cuda.md
 * "The daemon boundary"), more than the move itself; a job's status word,
 * the zeros of its ctx and its schedule copies are that small. One launch
 * carries up to MOK_K_MOVES_MAX of them, a block row (blockIdx.y) each. */
#include <string.h>

#include "mok_kernels_internal.cuh"

typedef struct moves_param {
  mok_k_move m[MOK_K_MOVES_MAX];
} moves_param;

__global__ void moves_kernel(const __grid_constant__ moves_param p) {
  const mok_k_move mv = p.m[blockIdx.y];
  const size_t step = (size_t)gridDim.x * blockDim.x;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t align = (uintptr_t)mv.dst | (uintptr_t)mv.src | (uintptr_t)mv.bytes;
  if ((align & 15) == 0) { /* 16-byte words */
    uint4 *d = (uint4 *)mv.dst;
    const uint4 *s = (const uint4 *)mv.src;
    for (size_t i = first; i < mv.bytes / 16; i += step) d[i] = s ? s[i] : make_uint4(0, 0, 0, 0);
  } else if ((align & 3) == 0) {
    uint32_t *d = (uint32_t *)mv.dst;
    const uint32_t *s = (const uint32_t *)mv.src;
    for (size_t i = first; i < mv.bytes / 4; i += step) d[i] = s ? s[i] : 0u;
  } else {
    unsigned char *d = (unsigned char *)mv.dst;
    const unsigned char *s = (const unsigned char *)mv.src;
    for (size_t i = first; i < mv.bytes; i += step) d[i] = s ? s[i] : 0;
  }
}

extern "C" int mok_k_moves(const mok_k_move *moves, int n, mok_k_stream stream) {
  if (n < 0 || n > MOK_K_MOVES_MAX || (n > 0 && !moves)) return MOK_EINVAL;
  moves_param p;
  memset(&p, 0, sizeof p);
  size_t most = 0;
  for (int i = 0; i < n; i++) {
    if (moves[i].bytes > MOK_K_MOVE_BYTES_MAX || (moves[i].bytes && !moves[i].dst))
      return MOK_EINVAL;
    p.m[i] = moves[i];
    if (moves[i].bytes > most) most = moves[i].bytes;
  }
  if (most == 0) return MOK_OK;
  /* 16-byte words, 256 threads a block, at most 64 blocks a move: a move
   * of MOK_K_MOVE_BYTES_MAX takes a few us */
  const size_t words = (most + 15) / 16;
  const unsigned blocks = (unsigned)(words / 256 + 1 < 64 ? words / 256 + 1 : 64);
  moves_kernel<<<dim3(blocks, (unsigned)n), 256, 0, stream>>>(p);
  return mok_k_launch_status();
}
