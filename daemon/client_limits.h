/* SPDX-License-Identifier: Apache-2.0 */
/* The client limits in one table: every per-session, per-uid and
 * daemon-wide limit, its configuration key, its default, what it counts,
 * and how often it refused something (deploy/mokd.conf documents the keys).
 * (Not "limits.h": with -Idaemon it would shadow <limits.h>.)
 *
 * One check (mok_limit_exceeded) for all of them. Who counts what:
 * - the loop thread (server.c, quota.c): sessions, and per uid regions,
 *   region bytes, layers, groups and group bytes (reserved when a request
 *   goes to the engine thread, settled when it answers);
 * - the engine thread (engine_thread.c): per session regions, region bytes
 *   and layers (it owns the session's region table and layers), and per
 *   uid the jobs in flight.
 * The refusal counters are atomic: both threads count into them.
 */
#ifndef MOK_CLIENT_LIMITS_H
#define MOK_CLIENT_LIMITS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct mok_server_config;

typedef enum mok_limit_id {
  MOK_LIMIT_SESSIONS,          /* daemon-wide */
  MOK_LIMIT_SESSION_RESERVE,   /* daemon-wide, for uids that hold a session */
  MOK_LIMIT_REGIONS_TOTAL,     /* daemon-wide */
  MOK_LIMIT_REGIONS,           /* per session */
  MOK_LIMIT_REGION_BYTES,      /* per session */
  MOK_LIMIT_LAYERS,            /* per session */
  MOK_LIMIT_SESSIONS_PER_UID,
  MOK_LIMIT_REGIONS_PER_UID,
  MOK_LIMIT_REGION_BYTES_PER_UID,
  MOK_LIMIT_LAYERS_PER_UID,
  MOK_LIMIT_JOBS_PER_UID,
  MOK_LIMIT_GROUPS_PER_UID,
  MOK_LIMIT_GROUP_BYTES_PER_UID,
  MOK_LIMIT_COUNT
} mok_limit_id;

typedef enum mok_limit_scope {
  MOK_LIMIT_SCOPE_DAEMON,
  MOK_LIMIT_SCOPE_SESSION,
  MOK_LIMIT_SCOPE_UID
} mok_limit_scope;

typedef struct mok_limit_info {
  const char *key;         /* the configuration key (config.c parses it) */
  mok_limit_scope scope;
  uint64_t default_value;
  bool zero_is_unlimited;  /* else 0 refuses everything */
  size_t field;            /* offsetof the value in mok_server_config */
  int width;               /* of that field: 4 or 8 bytes */
  const char *counts;      /* what it counts */
} mok_limit_info;

/* Indexed by mok_limit_id. */
extern const mok_limit_info mok_limit_table[MOK_LIMIT_COUNT];

/* Every limit's default into cfg (mok_server_config_defaults). */
void mok_limits_defaults(struct mok_server_config *cfg);

/* Whether holding `held` and adding `adding` more would pass max (overflow
 * safe); a refusal is counted. A limit whose 0 means "no limit" never
 * refuses at 0. The caller says why (its message names the key). */
bool mok_limit_exceeded(mok_limit_id id, uint64_t max, uint64_t held, uint64_t adding);

/* How often a limit refused since start. */
uint64_t mok_limit_refusals(mok_limit_id id);

#endif
