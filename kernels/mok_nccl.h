/* SPDX-License-Identifier: Apache-2.0 */
/* mok kernels that read NCCL's device API (docs/ep_nccl.md), behind a C API.
 *
 * Plain C, no CUDA or NCCL headers needed by callers. The device API used
 * here (ncclGetLsaPointer of nccl_device/core.h) is header-inline: it reads
 * the window's device-side descriptor (struct ncclWindow_vidmem: the LSA
 * team's flat base and its 4 GiB stride) and links no symbol of libnccl, so
 * libmokkernels.a and mokd keep no link-time NCCL dependency (the host side,
 * daemon/cuda/nccl.c, loads libnccl.so.2 with dlopen).
 *
 * Built without NCCL's device headers, the launcher returns
 * MOK_EUNSUPPORTED and mok_k_nccl_device_api() returns 0.
 */
#ifndef MOK_NCCL_H
#define MOK_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "mok_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when this build has NCCL's device API (nccl_device.h), else 0. */
int mok_k_nccl_device_api(void);

/* The NCCL_VERSION_CODE of the device headers this was built with (0: none). */
int mok_k_nccl_header_version(void);

/* out[i] = (uint64_t)ncclGetLsaPointer(window, offset, i) for 0 <= i < n:
 * LSA peer i's bytes at offset as mapped on this GPU. window is an
 * ncclWindow_t (a device pointer, from ncclCommWindowRegister with
 * NCCL_WIN_COLL_SYMMETRIC); out is device memory of n uint64. Enqueue only.
 * Returns MOK_OK, MOK_EINVAL, MOK_EENGINE (launch failed,
 * mok_k_last_cuda_error()) or MOK_EUNSUPPORTED (no device headers). */
int mok_k_nccl_lsa_pointers(const void *window, uint64_t offset, int n, uint64_t *out,
                            mok_k_stream stream);

#ifdef __cplusplus
}
#endif

#endif /* MOK_NCCL_H */
