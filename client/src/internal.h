/* SPDX-License-Identifier: Apache-2.0 */
/* libmok internals shared by its source files (and by white-box tests). */
#ifndef MOK_CLIENT_INTERNAL_H
#define MOK_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>

#include "mok.h"
#include "mok.pb-c.h"
#include "mok_wire.h"

typedef struct host_region {
  void *ptr;
  size_t bytes; /* mapped bytes */
  uint32_t id;  /* daemon region id */
} host_region;

typedef struct job_result {
  uint64_t ticket; /* 0: empty */
  bool done;
  bool detached; /* submitted without a ticket: reaped when it completes */
  int status;
  char message[MOK_JOB_MESSAGE_MAX]; /* a failed job's whole message */
} job_result;

struct mok_client {
  pthread_mutex_t lock;
  int sock;
  uint32_t next_request;
  uint64_t session_id;
  char engine[32];
  char device[128];
  mok_shm_header *shm;
  size_t shm_bytes;
  int doorbell_in, doorbell_out;
  uint32_t sq_tail, cq_head; /* private copies */
  uint64_t next_ticket;
  uint32_t outstanding; /* submitted, not yet returned by mok_wait */
  uint32_t parked;       /* threads asleep in park_locked (jobs.c) */
  bool closing;          /* mok_close has begun: sleepers return MOK_ECLOSED */
  pthread_cond_t unparked; /* the last sleeper left (mok_close waits for it) */
  job_result results[MOK_RING_ENTRIES];
  host_region *regions;
  size_t n_regions, cap_regions;
  mok_layer **layers;
  size_t n_layers, cap_layers;
  mok_group **groups; /* joined, not left: freed (not left) by mok_close */
  size_t n_groups, cap_groups;
  bool broken; /* the daemon went away */
  struct mok_cuda_state *cuda; /* device memory and streams (cuda.c); NULL until used */
  struct mok_standing_state *standing; /* standing jobs (standing.c); NULL until used */
  int async_status;            /* first failure of a detached job, not yet reported */
  char async_message[MOK_JOB_MESSAGE_MAX];
};

/* A registered CUDA allocation (cuda.c). */
typedef struct dev_region {
  unsigned long long base; /* CUdeviceptr */
  size_t size;
  unsigned long long buffer_id; /* CU_POINTER_ATTRIBUTE_BUFFER_ID when registered */
  uint32_t id;
} dev_region;
typedef struct mok_cuda_state mok_cuda_state;

struct mok_layer {
  mok_client *client;
  uint32_t id;
  mok_layer_config cfg;
};

struct mok_group {
  mok_client *client;
  uint32_t id, rank, world, local_experts, first_expert;
  uint64_t generation;
  bool rejoined;
  mok_group_sizing sizing;
  uint32_t capacity_ppm; /* sizing.capacity as joined (mok_group_rows_limit) */
};

/* Set the thread's last error; returns status for tail calls. */
int mok_set_error(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Place a descriptor in the ring (the client lock held); user_data is set. */
int mok_submit_desc_locked(mok_client *c, mok_job_desc *desc, uint64_t *ret_ticket);
/* jobs.c (the client lock held): mark the client closing, wake the threads
 * asleep in mok_wait or mok_sync and wait until they left (they return
 * MOK_ECLOSED); mok_close, before it releases what they poll. */
void mok_jobs_wake_sleepers_locked(mok_client *c);
/* For tests: submit a raw descriptor (nothing checked on this side). */
int mok_submit_desc(mok_client *c, mok_job_desc *desc, uint64_t *ret_ticket);

/* Fill a descriptor from tensors (the client lock held): host regions,
 * else CUDA memory registered on first use. */
int mok_build_desc_locked(mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                          const mok_tensor tensors[MOK_SLOT_COUNT_], mok_job_desc *desc);
void mok_forward_tensors(mok_layer *l, uint32_t tokens, const mok_forward_args *a, mok_tensor *t);
void mok_backward_tensors(mok_layer *l, uint32_t tokens, const mok_backward_args *a,
                          mok_tensor *t);

/* memory.c. Find the registered region holding [p, p+bytes); NULL if none. */
const host_region *mok_find_region(const mok_client *c, const void *p, uint64_t bytes);
/* memory.c: unmap every host region (mok_close, after Goodbye). */
void mok_memory_client_free(mok_client *c);
/* layer.c: destroy every layer the caller did not (mok_close). */
void mok_layers_client_free(mok_client *c);
/* group.c: free every group not left, without leaving (mok_close): the
 * daemon keeps such a group for a restarted client. */
void mok_groups_client_free(mok_client *c);

/* cuda.c (the client lock held). Find p in registered CUDA memory, or
 * register its allocation; MOK_ENOENT (no message) when p is not device
 * memory or no driver is there. */
int mok_cuda_resolve_locked(mok_client *c, const void *p, uint64_t bytes, uint32_t *ret_region,
                            uint64_t *ret_offset);
const char *mok_cuda_load_error(void);
/* The sync page for stream's context; *ret_signal: the next job's done value. */
int mok_cuda_fence_prepare_locked(mok_client *c, void *stream, uint64_t *ret_signal);
/* Enqueue the fence write of job `ticket` on stream, after the job is in
 * the ring (mokd enqueues its side while the driver call runs here); on
 * failure the fence is released from the host and the error returned. */
int mok_cuda_fence_release_locked(mok_client *c, void *stream, uint64_t ticket);
/* Enqueue the stream's wait for the done value (after the job is in the ring). */
int mok_cuda_fence_after_locked(mok_client *c, void *stream, uint64_t signal);
void mok_cuda_client_free(mok_client *c);
/* Enqueue a standing job's replay-invariant operations on stream: write 1
 * to its trigger word, wait for its flag == 1, write 0 to the flag. */
int mok_cuda_standing_ops_locked(mok_client *c, void *stream, uint32_t slot);
/* standing.c: stop the watcher, answer nothing more (mok_close). */
void mok_standing_client_free(mok_client *c);

#endif
