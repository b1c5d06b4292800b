/* SPDX-License-Identifier: Apache-2.0 */
/* The routed rows of an fp8 layer's quantised tokens (docs/math.md, "FP8"):
 * a token's x (or d_out) is quantised once per 128 of H, and each routed
 * row is a copy of its token's bytes and scales, the same bytes the cpu
 * engine gets by quantising the routed rows. */
#include "mok_kernels_internal.cuh"

#define F8_ROWS_PER_BLOCK 8 /* one warp per row */

/* Row r of q [R][H] and s [R][H/128]: its slot's token's row, zeros for
 * padding rows (and scale 0, as the cpu engine leaves them). */
__global__ void fp8_gather_kernel(const uint4 *__restrict__ tok_q, const float *__restrict__ tok_s,
                                  const int32_t *__restrict__ row_slot, int capacity, int K,
                                  int n_slots, int qvecs, int blocks, uint4 *__restrict__ q,
                                  float *__restrict__ s, const int32_t *status) {
  if (job_failed(status)) return;
  const int r = blockIdx.x * F8_ROWS_PER_BLOCK + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (r >= capacity) return;
  const int slot = row_slot[r];
  const int t = slot >= 0 && slot < n_slots ? slot / K : -1;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int c = lane; c < qvecs; c += 32)
    q[(size_t)r * qvecs + c] = t >= 0 ? tok_q[(size_t)t * qvecs + c] : zero;
  for (int c = lane; c < blocks; c += 32)
    s[(size_t)r * blocks + c] = t >= 0 ? tok_s[(size_t)t * blocks + c] : 0.0f;
}

extern "C" int mok_k_fp8_gather_rows(const mok_k_dims *d, const int32_t *schedule,
                                     const uint8_t *tok_q, const float *tok_s, uint8_t *q,
                                     float *s, int32_t *status, mok_k_stream stream) {
  if (mok_k_check_dims(d, NULL, 0) != MOK_OK || d->H % 128 || !schedule || !status || !q || !s ||
      (d->T > 0 && (!tok_q || !tok_s)) || !mok_k_aligned16(tok_q) || !mok_k_aligned16(q))
    return MOK_EINVAL;
  const sched_ptrs sv = sched_view(d, schedule);
  if (sv.capacity == 0) return MOK_OK;
  fp8_gather_kernel<<<(sv.capacity + F8_ROWS_PER_BLOCK - 1) / F8_ROWS_PER_BLOCK,
                      32 * F8_ROWS_PER_BLOCK, 0, stream>>>(
      (const uint4 *)tok_q, tok_s, sv.row_slot, sv.capacity, d->K, sv.n_slots, d->H / 16,
      d->H / 128, (uint4 *)q, s, status);
  return mok_k_launch_status();
}
