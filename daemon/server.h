/* SPDX-License-Identifier: Apache-2.0 */
/* The control plane: the libuv loop, the Unix socket and the sessions. */
#ifndef MOK_SERVER_H
#define MOK_SERVER_H

#include <stdint.h>
#include <sys/types.h>

#include "engine_thread.h"
#include "metrics_config.h"
#include "mok_version.h"

#define MOK_ALLOW_MAX 64 /* entries in allow-uids, allow-gids */

typedef struct mok_server_config {
  const char *socket_path;
  int listen_fd;          /* >= 0: an already-listening socket (socket activation) */
  mode_t socket_mode;     /* applied to a socket we create */
  const char *engine;     /* "cpu" or "cuda" */
  mok_engine_config engine_cfg;
  uint32_t max_sessions;
  uint32_t hello_timeout_ms;
  uint32_t max_pending_requests; /* per session, control requests awaiting the engine */
  uint32_t drain_ms;             /* at shutdown, how long queued jobs may still run */
  mok_session_limits limits;       /* per session, enforced by the engine thread */
  /* Access (checked against SO_PEERCRED at accept; empty lists allow everyone
   * who can open the socket). A peer is let in when its uid is in allow_uids
   * or its primary or a supplementary gid is in allow_gids. */
  const char *socket_group;        /* NULL: the daemon's own group */
  uint32_t n_allow_uids, n_allow_gids;
  uint32_t allow_uids[MOK_ALLOW_MAX];
  uint32_t allow_gids[MOK_ALLOW_MAX];
  /* Stats show a client only its own uid's sessions and groups, unless it
   * is root, the daemon's own uid, or listed here (like allow-uids/-gids). */
  uint32_t n_admin_uids, n_admin_gids;
  uint32_t admin_uids[MOK_ALLOW_MAX];
  uint32_t admin_gids[MOK_ALLOW_MAX];
  /* The client limits (deploy/mokd.conf's table): fair shares by default.
   * Per uid, across all of that uid's sessions (0: no limit beyond the
   * per-session ones). Counted by the loop, which sees every registration;
   * jobs in flight (limits.max_jobs_per_uid) are counted by the engine. */
  uint32_t max_sessions_per_uid;
  uint32_t max_regions_per_uid;
  uint64_t max_region_bytes_per_uid;
  uint32_t max_layers_per_uid;
  uint32_t max_groups_per_uid;       /* groups joined (held or lingering) */
  uint64_t max_group_bytes_per_uid;  /* their segments' bytes */
  /* Daemon-wide: when fewer than session_reserve session slots are free,
   * only a uid that holds no session yet may connect; at most
   * max_regions_total regions (mappings) across all sessions, well below
   * vm.max_map_count, so that a Hello never fails for want of one. */
  uint32_t session_reserve;
  uint32_t max_regions_total;
  mok_metrics_config metrics; /* the /metrics endpoint (off unless configured) */
} mok_server_config;

void mok_server_config_defaults(mok_server_config *cfg);

/* Serve until SIGTERM or SIGINT. Returns the process exit status. */
int mok_server_run(const mok_server_config *cfg);

#endif
