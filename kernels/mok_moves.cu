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

/* One move in words of W; a take clears each source word after its copy
 * (the same thread, so the copy reads it first). */
template <typename W>
__device__ static void move_words(const mok_k_move &mv, size_t first, size_t step, W zero) {
  W *d = (W *)mv.dst;
  W *s = (W *)mv.src; /* written only by a take */
  const size_t n = mv.bytes / sizeof(W);
  for (size_t i = first; i < n; i += step) {
    d[i] = s ? s[i] : zero;
    if (mv.take) s[i] = zero;
  }
}

__global__ void moves_kernel(const __grid_constant__ moves_param p) {
  const mok_k_move mv = p.m[blockIdx.y];
  const size_t step = (size_t)gridDim.x * blockDim.x;
  const size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const uintptr_t align = (uintptr_t)mv.dst | (uintptr_t)mv.src | (uintptr_t)mv.bytes;
  if ((align & 15) == 0) { /* 16-byte words */
    move_words<uint4>(mv, first, step, make_uint4(0, 0, 0, 0));
  } else if ((align & 3) == 0) {
    move_words<uint32_t>(mv, first, step, 0u);
  } else {
    move_words<unsigned char>(mv, first, step, (unsigned char)0);
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
    if (moves[i].take && moves[i].bytes) { /* a take's source is read, then written */
      const uintptr_t d = (uintptr_t)moves[i].dst, s = (uintptr_t)moves[i].src;
      if (!s || (d < s + moves[i].bytes && s < d + moves[i].bytes)) return MOK_EINVAL;
    }
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
