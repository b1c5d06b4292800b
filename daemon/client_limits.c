/* SPDX-License-Identifier: Apache-2.0 */
#include "client_limits.h"

#include <stdatomic.h>
#include <string.h>

#include "server.h"

#define FIELD(member) offsetof(mok_server_config, member), sizeof(((mok_server_config *)0)->member)

/* The defaults are fair shares: a uid's share is a fraction of the daemon,
 * so that one tenant can never exhaust it for the others. */
const mok_limit_info mok_limit_table[MOK_LIMIT_COUNT] = {
    [MOK_LIMIT_SESSIONS] = {"max-sessions", MOK_LIMIT_SCOPE_DAEMON, 256, false,
                            FIELD(max_sessions), "sessions (connections that said Hello)"},
    [MOK_LIMIT_SESSION_RESERVE] = {"session-reserve", MOK_LIMIT_SCOPE_DAEMON, 16, false,
                                   FIELD(session_reserve),
                                   "session slots kept for uids that hold none"},
    [MOK_LIMIT_REGIONS_TOTAL] = {"max-regions-total", MOK_LIMIT_SCOPE_DAEMON, 32000, true,
                                 FIELD(max_regions_total),
                                 "regions (mappings) of all sessions; vm.max_map_count is "
                                 "65530 by default"},
    [MOK_LIMIT_REGIONS] = {"max-regions", MOK_LIMIT_SCOPE_SESSION, 4096, false,
                           FIELD(limits.max_regions), "registered buffers"},
    [MOK_LIMIT_REGION_BYTES] = {"max-region-bytes", MOK_LIMIT_SCOPE_SESSION, 256ull << 30, false,
                                FIELD(limits.max_region_bytes),
                                "bytes of registered buffers (a 61-layer model registers "
                                "~75 GiB)"},
    [MOK_LIMIT_LAYERS] = {"max-layers", MOK_LIMIT_SCOPE_SESSION, 256, false,
                          FIELD(limits.max_layers), "layers"},
    [MOK_LIMIT_SESSIONS_PER_UID] = {"max-sessions-per-uid", MOK_LIMIT_SCOPE_UID, 64, true,
                                    FIELD(max_sessions_per_uid), "sessions"},
    [MOK_LIMIT_REGIONS_PER_UID] = {"max-regions-per-uid", MOK_LIMIT_SCOPE_UID, 8192, true,
                                   FIELD(max_regions_per_uid),
                                   "registered buffers (a quarter of max-regions-total)"},
    [MOK_LIMIT_REGION_BYTES_PER_UID] = {"max-region-bytes-per-uid", MOK_LIMIT_SCOPE_UID,
                                        256ull << 30, true, FIELD(max_region_bytes_per_uid),
                                        "bytes of registered buffers"},
    [MOK_LIMIT_LAYERS_PER_UID] = {"max-layers-per-uid", MOK_LIMIT_SCOPE_UID, 1024, true,
                                  FIELD(max_layers_per_uid), "layers"},
    [MOK_LIMIT_JOBS_PER_UID] = {"max-jobs-per-uid", MOK_LIMIT_SCOPE_UID, 1024, true,
                                FIELD(limits.max_jobs_per_uid),
                                "jobs in flight (queued in the rings or running)"},
    [MOK_LIMIT_GROUPS_PER_UID] = {"max-groups-per-uid", MOK_LIMIT_SCOPE_UID, 16, true,
                                  FIELD(max_groups_per_uid),
                                  "expert-parallel groups joined (held or lingering)"},
    [MOK_LIMIT_GROUP_BYTES_PER_UID] = {"max-group-bytes-per-uid", MOK_LIMIT_SCOPE_UID,
                                       32ull << 30, true, FIELD(max_group_bytes_per_uid),
                                       "bytes of those groups' segments"},
};

static _Atomic uint64_t refusals[MOK_LIMIT_COUNT];

void mok_limits_defaults(mok_server_config *cfg) {
  for (size_t i = 0; i < MOK_LIMIT_COUNT; i++) {
    const mok_limit_info *l = &mok_limit_table[i];
    char *field = (char *)cfg + l->field;
    if (l->width == 4) {
      uint32_t v = (uint32_t)l->default_value;
      memcpy(field, &v, sizeof v);
    } else {
      memcpy(field, &l->default_value, sizeof l->default_value);
    }
  }
}

bool mok_limit_exceeded(mok_limit_id id, uint64_t max, uint64_t held, uint64_t adding) {
  if (max == 0 && mok_limit_table[id].zero_is_unlimited) return false;
  if (held <= max && adding <= max - held) return false;
  atomic_fetch_add_explicit(&refusals[id], 1, memory_order_relaxed);
  return true;
}

uint64_t mok_limit_refusals(mok_limit_id id) {
  return atomic_load_explicit(&refusals[id], memory_order_relaxed);
}
