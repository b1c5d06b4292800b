/* SPDX-License-Identifier: Apache-2.0 */
/* What the /metrics endpoint reports (docs/metrics.md lists every series):
 * the counters the loop and the engine thread keep as things happen, and
 * the page in the Prometheus text format (0.0.4), rendered from them and
 * one snapshot of the engine's stats.
 *
 * Loop thread only, except the job sinks (job_sink.h), which the engine
 * thread adds to. Every function takes m == NULL (metrics off) and does
 * nothing, so the server calls them unconditionally.
 *
 * Labels are of bounded cardinality: ops, statuses, reasons and HTTP codes
 * are fixed lists; (uid, client name) label sets are at most
 * max_label_sets, the rest counted as uid="other", client="other"; groups
 * at most MOK_METRICS_GROUPS_LISTED. No series names a session.
 */
#ifndef MOK_METRICS_H
#define MOK_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine_thread.h"
#include "job_sink.h"

#define MOK_METRICS_GROUPS_LISTED 16   /* groups with series of their own */
#define MOK_METRICS_PAGE_MAX (16u << 20) /* a page never grows past this */

typedef struct mok_metrics mok_metrics;

/* What the loop knows at render time. */
typedef struct mok_metrics_page_info {
  const char *version, *engine, *device;
  uint64_t uptime_ms;
  uint32_t connections;      /* control connections now (before Hello too) */
  uint32_t http_connections; /* metrics connections now */
} mok_metrics_page_info;

/* max_label_sets: distinct (uid, client) sets (0..MOK_METRICS_LABEL_SETS_MAX);
 * per_uid: render them (else only daemon-wide series). NULL: out of memory. */
mok_metrics *mok_metrics_create(uint32_t max_label_sets, bool per_uid);
void mok_metrics_free(mok_metrics *m);

/* A session said Hello: the sink its jobs count into (its label set's, or
 * "other" when every set is taken by live sessions). A set no live session
 * holds may be given to a new (uid, client); its counts go to "other"
 * then, so sums over all sets stay monotonic. */
mok_job_sink *mok_metrics_session_open(mok_metrics *m, uint32_t uid, const char *client);
/* The session is gone and the engine has detached it (no job of it will
 * count any more). */
void mok_metrics_session_close(mok_metrics *m, mok_job_sink *sink);

/* A refusal: why is the message given to the client (classified by the
 * setting it names) or a reason's own name ("protocol", "hello-timeout-ms",
 * "max-pending-requests"). */
void mok_metrics_refused(mok_metrics *m, const char *why);
/* The reason label a refusal message counts under (pure; "other" if none). */
const char *mok_metrics_refusal_reason(const char *why);
/* A command came back from the engine (registrations, layers, refusals). */
void mok_metrics_command_done(mok_metrics *m, const mok_cmd *c);

/* The endpoint's own counters. */
void mok_metrics_http_answered(mok_metrics *m, int status);
void mok_metrics_http_over_cap(mok_metrics *m);
void mok_metrics_http_timed_out(mok_metrics *m);

/* The page (malloc'd, *len bytes, not NUL-terminated), or NULL when out of
 * memory or larger than MOK_METRICS_PAGE_MAX. st: the engine's stats. */
char *mok_metrics_render(mok_metrics *m, const mok_metrics_page_info *info,
                         const mok_engine_stats *st, size_t *len);

#endif
