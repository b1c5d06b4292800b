/* SPDX-License-Identifier: Apache-2.0 */
/* Symmetric memory for an expert-parallel group through NCCL (docs/ep_nccl.md).
 *
 * The members of a group (one mokd per GPU, on one host or on several hosts
 * of one NVLink domain) form an NCCL communicator and register one equal
 * buffer each as an NCCL window (NCCL_WIN_COLL_SYMMETRIC). Every member
 * then reads, through NCCL's device API (ncclGetLsaPointer,
 * kernels/mok_nccl.h), where each peer's buffer is mapped on its own GPU:
 * those addresses are mok_k_ep.base[], and the EP kernels of
 * kernels/mok_ep_kernels.h (barrier, all-gather, pull, push) run on them
 * unchanged, with plain loads and stores over NVLink.
 *
 * NCCL is loaded at run time (dlopen("libnccl.so.2"), or the file named by
 * MOK_NCCL_LIB): mokd links no NCCL and starts without it or without a GPU;
 * every call here then fails with MOK_EUNSUPPORTED and a message. NCCL 2.28
 * or later is required (windows, the device API). NVLink multicast is never
 * used: NCCL_NVLS_ENABLE is 0 before NCCL starts (mok_nccl_no_multicast).
 *
 * Only peers reachable by load/store (NCCL's LSA team: one NVLink domain)
 * are supported; a group with a peer outside it fails at creation. No
 * network transport is built here.
 *
 * Calls that talk to peers (creation) are bounded by a timeout: a missing
 * or stalled peer makes creation fail with MOK_ETIMEOUT (the communicator
 * is aborted); it never hangs the caller. Not thread-safe per group (one
 * thread uses a group at a time); different groups may be used from
 * different threads.
 */
#ifndef MOK_NCCL_GROUP_H
#define MOK_NCCL_GROUP_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mok_enums.h" /* MOK_NCCL_ID_BYTES */

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_NCCL_MIN_VERSION 22800  /* NCCL 2.28.0: windows and the device API */

/* The design never uses NVLink multicast (docs/ep_nccl.md): NCCL_NVLS_ENABLE
 * is 0 before NCCL's first call, whatever the environment said. The one
 * place it is set (inline: mokd's main calls it in builds without
 * cuda/nccl.c too), before any thread runs (setenv is not thread-safe);
 * the loader again for in-process users, changing nothing once it is 0. */
static inline void mok_nccl_no_multicast(void) {
  const char *nvls = getenv("NCCL_NVLS_ENABLE");
  if (!nvls || strcmp(nvls, "0") != 0) setenv("NCCL_NVLS_ENABLE", "0", 1);
}

/* MOK_OK when NCCL loads and is recent enough (and this build has CUDA and
 * NCCL's device API); else MOK_EUNSUPPORTED with the reason in err. The
 * first call loads the library; later calls return the same answer. */
int mok_nccl_available(char *err, size_t errlen);

/* The loaded library's NCCL_VERSION_CODE (e.g. 22803), 0 when none loaded. */
int mok_nccl_version(void);

/* ncclGetUniqueId: the id every member passes to mok_nccl_group_create.
 * NCCL's bootstrap root runs in THIS process until every member joined, so
 * the process that makes the id must stay up while the group forms (in
 * mokd: rank 0's daemon). Returns a mok_status. */
int mok_nccl_unique_id(uint8_t out[MOK_NCCL_ID_BYTES], char *err, size_t errlen);

typedef struct mok_nccl_group mok_nccl_group;

/* Forms the group, rank `rank` of `world` (<= MOK_K_EP_MAX_WORLD) on CUDA
 * device `device`, with a symmetric buffer of at least `bytes` bytes per
 * member, zeroed on every member before any member's creation returns.
 * Collective: every member calls it with the same id, world and bytes.
 * Fails (*out NULL) with MOK_ETIMEOUT when the group has not formed within
 * timeout_ms, MOK_EUNSUPPORTED (no NCCL, too old, no symmetric memory, a
 * peer outside this GPU's NVLink domain), MOK_ENOMEM, MOK_EINVAL or
 * MOK_EENGINE (an NCCL or CUDA call failed: named in err). The calling
 * thread's current CUDA device is restored. */
int mok_nccl_group_create(const uint8_t id[MOK_NCCL_ID_BYTES], int rank, int world, int device,
                          uint64_t bytes, uint32_t timeout_ms, mok_nccl_group **out, char *err,
                          size_t errlen);

/* base[p] = member p's buffer as mapped on this GPU (world entries): what
 * mok_k_ep.base takes. base[rank] is this member's own buffer through the
 * window (the same memory as mok_nccl_group_local). */
const uint64_t *mok_nccl_group_bases(const mok_nccl_group *g);

/* This member's buffer as allocated (ncclMemAlloc). */
void *mok_nccl_group_local(const mok_nccl_group *g);

/* Usable bytes per member (>= the bytes asked for). */
uint64_t mok_nccl_group_bytes(const mok_nccl_group *g);

int mok_nccl_group_world(const mok_nccl_group *g);
int mok_nccl_group_rank(const mok_nccl_group *g);
int mok_nccl_group_device(const mok_nccl_group *g);

/* NCCL's LSA team as seen by this member: its size (every member of a
 * group that formed: = world) and this member's index in it. */
int mok_nccl_group_lsa_size(const mok_nccl_group *g);

/* Milliseconds the creation spent forming the communicator and
 * registering the window (for logs and benches). */
void mok_nccl_group_timings(const mok_nccl_group *g, double *init_ms, double *register_ms);

/* The communicator's asynchronous error (ncclCommGetAsyncError): MOK_OK,
 * or MOK_EENGINE with the message. What a watchdog polls. */
int mok_nccl_group_check(mok_nccl_group *g, char *err, size_t errlen);

/* Aborts the communicator now (a peer stopped, the watchdog fired): no
 * call of this member waits for the peers afterwards. The buffer and the
 * mappings stay until mok_nccl_group_destroy. */
void mok_nccl_group_abort(mok_nccl_group *g);

/* Waits for this GPU's work (kernels may still use the mappings), then
 * deregisters the window, frees the buffer and destroys the communicator
 * (ncclCommFinalize bounded by the creation timeout, ncclCommAbort if it
 * does not complete or the group was aborted). NULL is a no-op. */
void mok_nccl_group_destroy(mok_nccl_group *g);

#ifdef __cplusplus
}
#endif

#endif /* MOK_NCCL_GROUP_H */
