/* SPDX-License-Identifier: Apache-2.0 */
/* NCCL device API helpers (mok_nccl.h). */
#include "mok_nccl.h"
#include "mok_kernels_internal.cuh"

#if defined(__has_include)
#if __has_include(<nccl_device.h>)
#define MOK_HAVE_NCCL_DEVICE 1
#endif
#endif

#ifdef MOK_HAVE_NCCL_DEVICE
#include <nccl.h>
#include <nccl_device.h>

__global__ void nccl_lsa_pointers_kernel(ncclWindow_t win, uint64_t offset, int n,
                                         uint64_t *out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (uint64_t)(uintptr_t)ncclGetLsaPointer(win, (size_t)offset, i);
}

extern "C" int mok_k_nccl_device_api(void) { return 1; }

extern "C" int mok_k_nccl_header_version(void) { return NCCL_VERSION_CODE; }

extern "C" int mok_k_nccl_lsa_pointers(const void *window, uint64_t offset, int n,
                                       uint64_t *out, mok_k_stream stream) {
  if (!window || !out || n < 1) return MOK_EINVAL;
  nccl_lsa_pointers_kernel<<<(n + 127) / 128, 128, 0, stream>>>((ncclWindow_t)window, offset,
                                                                 n, out);
  return mok_k_launch_status();
}

#else /* built without NCCL's device headers */

extern "C" int mok_k_nccl_device_api(void) { return 0; }

extern "C" int mok_k_nccl_header_version(void) { return 0; }

extern "C" int mok_k_nccl_lsa_pointers(const void *window, uint64_t offset, int n,
                                       uint64_t *out, mok_k_stream stream) {
  (void)window;
  (void)offset;
  (void)n;
  (void)out;
  (void)stream;
  return MOK_EUNSUPPORTED;
}

#endif
