/* SPDX-License-Identifier: Apache-2.0 */
/* Where the engine thread counts finished jobs for the metrics endpoint
 * (daemon/metrics.h owns these; docs/metrics.md lists the series).
 *
 * A sink belongs to one label set (uid, client name) and points at the
 * daemon-wide totals. The engine thread adds to them with relaxed atomics
 * as each job finishes; the loop thread reads them when it renders a page.
 * Buckets are stored per bucket, not cumulated, so that a page summed from
 * one read of each is always consistent (+Inf equals the count).
 */
#ifndef MOK_JOB_SINK_H
#define MOK_JOB_SINK_H

#include <stdatomic.h>
#include <stdint.h>

#include "mok_enums.h"
#include "mok_status.h"

#define MOK_METRICS_OPS (MOK_OP_COUNT_ + 1)           /* the last: an unknown op */
#define MOK_METRICS_STATUSES (MOK_STATUS_COUNT_ + 1)  /* the last: an unknown status */
#define MOK_LATENCY_BUCKETS 19                         /* finite bounds; one more for +Inf */

typedef struct mok_job_totals {
  _Atomic uint64_t done[MOK_METRICS_OPS];
  _Atomic uint64_t failed[MOK_METRICS_OPS][MOK_METRICS_STATUSES];
  _Atomic uint64_t bucket[MOK_METRICS_OPS][MOK_LATENCY_BUCKETS + 1];
  _Atomic uint64_t sum_ns[MOK_METRICS_OPS];
} mok_job_totals;

typedef struct mok_job_sink {
  _Atomic uint64_t done, failed; /* this label set's jobs */
  mok_job_totals *all;
} mok_job_sink;

/* The bucket bounds in nanoseconds (ascending; +Inf is implied). */
extern const uint64_t mok_latency_bounds_ns[MOK_LATENCY_BUCKETS];

/* One job finished (engine thread). sink may be NULL (metrics off). */
void mok_job_sink_record(mok_job_sink *sink, uint32_t op, int status, uint64_t ns);

#endif
