/* SPDX-License-Identifier: Apache-2.0 */
#include "quota.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_limits.h"
#include "mok_status.h"

/* The engine releases a lingering group on its next housekeeping turn
 * (every 100 ms) after the linger: count it a little longer, never less. */
#define LINGER_MARGIN_MS 1000u

mok_uid_usage *mok_quota_user(mok_quota *q, uid_t uid, bool create) {
  for (mok_uid_usage *u = q->users; u; u = u->next)
    if (u->uid == uid) return u;
  if (!create) return NULL;
  mok_uid_usage *u = calloc(1, sizeof *u);
  if (!u) return NULL;
  u->uid = uid;
  u->next = q->users;
  q->users = u;
  return u;
}

static bool group_counted(const mok_quota_group *g, uint64_t now_ms) {
  return g->holders > 0 || g->pending > 0 || now_ms < g->linger_until_ms;
}

static void prune_groups(mok_uid_usage *u, uint64_t now_ms) {
  for (mok_quota_group **p = &u->groups; *p;) {
    mok_quota_group *g = *p;
    if (group_counted(g, now_ms)) {
      p = &g->next;
      continue;
    }
    *p = g->next;
    free(g);
  }
}

void mok_quota_prune(mok_quota *q, uint64_t now_ms) {
  for (mok_uid_usage **p = &q->users; *p;) {
    mok_uid_usage *u = *p;
    prune_groups(u, now_ms);
    if (u->sessions || u->regions || u->layers || u->groups) {
      p = &u->next;
      continue;
    }
    *p = u->next;
    free(u);
  }
}

void mok_quota_free(mok_quota *q) {
  while (q->users) {
    mok_uid_usage *u = q->users;
    q->users = u->next;
    while (u->groups) {
      mok_quota_group *g = u->groups;
      u->groups = g->next;
      free(g);
    }
    free(u);
  }
  q->regions_total = 0;
}

int mok_quota_check(const mok_quota *q, const mok_uid_usage *u, uint32_t regions, uint64_t bytes,
                    uint32_t layers, char *msg, size_t len) {
  const mok_quota_limits *l = &q->lim;
  if (regions && mok_limit_exceeded(MOK_LIMIT_REGIONS_TOTAL, l->max_regions_total, q->regions_total,
                                    regions)) {
    snprintf(msg, len,
             "mokd holds %u regions across all sessions (max-regions-total %u): unregister "
             "buffers, or ask the operator to raise the limit",
             q->regions_total, l->max_regions_total);
    return MOK_ELIMIT;
  }
  if (regions &&
      mok_limit_exceeded(MOK_LIMIT_REGIONS_PER_UID, l->max_regions_per_uid, u->regions, regions)) {
    snprintf(msg, len, "uid %u already has %u regions across its sessions (max-regions-per-uid %u)",
             (unsigned)u->uid, u->regions, l->max_regions_per_uid);
    return MOK_ELIMIT;
  }
  if (bytes && mok_limit_exceeded(MOK_LIMIT_REGION_BYTES_PER_UID, l->max_region_bytes_per_uid,
                                  u->region_bytes, bytes)) {
    snprintf(msg, len,
             "registering %llu bytes would exceed the quota of uid %u: %llu bytes in use "
             "across its sessions (max-region-bytes-per-uid %llu)",
             (unsigned long long)bytes, (unsigned)u->uid, (unsigned long long)u->region_bytes,
             (unsigned long long)l->max_region_bytes_per_uid);
    return MOK_ELIMIT;
  }
  if (layers &&
      mok_limit_exceeded(MOK_LIMIT_LAYERS_PER_UID, l->max_layers_per_uid, u->layers, layers)) {
    snprintf(msg, len, "uid %u already has %u layers across its sessions (max-layers-per-uid %u)",
             (unsigned)u->uid, u->layers, l->max_layers_per_uid);
    return MOK_ELIMIT;
  }
  return MOK_OK;
}

void mok_quota_region(mok_quota *q, mok_uid_usage *u, int sign, uint64_t bytes) {
  if (sign > 0) {
    u->regions++, q->regions_total++;
    u->region_bytes += bytes;
  } else {
    u->regions--, q->regions_total--;
    u->region_bytes -= bytes;
  }
}

void mok_quota_layer(mok_uid_usage *u, int sign) {
  if (sign > 0) u->layers++;
  else u->layers--;
}

uint32_t mok_quota_groups(mok_uid_usage *u, uint64_t now_ms, uint64_t *ret_bytes) {
  uint32_t n = 0;
  uint64_t bytes = 0;
  for (const mok_quota_group *g = u->groups; g; g = g->next) {
    if (!group_counted(g, now_ms)) continue;
    n++;
    bytes += g->bytes;
  }
  if (ret_bytes) *ret_bytes = bytes;
  return n;
}

int mok_quota_group_reserve(mok_quota *q, mok_uid_usage *u, const char *key, uint64_t bytes,
                            uint64_t now_ms, mok_quota_group **ret, char *msg, size_t len) {
  prune_groups(u, now_ms);
  const mok_quota_limits *l = &q->lim;
  uint64_t held_bytes;
  uint32_t held = mok_quota_groups(u, now_ms, &held_bytes);
  for (mok_quota_group *g = u->groups; g; g = g->next) {
    if (strcmp(g->key, key) != 0) continue;
    /* a re-join, or a second session of the job: no new group. A larger
     * sizing (the old one lingered and went) counts its extra bytes. */
    if (bytes > g->bytes) {
      uint64_t extra = bytes - g->bytes;
      if (mok_limit_exceeded(MOK_LIMIT_GROUP_BYTES_PER_UID, l->max_group_bytes_per_uid, held_bytes,
                             extra)) {
        snprintf(msg, len,
                 "group '%s' needs %llu bytes of buffers; uid %u holds %llu in its groups "
                 "(max-group-bytes-per-uid %llu): leave a group, or lower max_tokens",
                 key, (unsigned long long)bytes, (unsigned)u->uid,
                 (unsigned long long)held_bytes, (unsigned long long)l->max_group_bytes_per_uid);
        return MOK_ELIMIT;
      }
      g->bytes = bytes;
    }
    g->pending++;
    *ret = g;
    return MOK_OK;
  }
  if (mok_limit_exceeded(MOK_LIMIT_GROUPS_PER_UID, l->max_groups_per_uid, held, 1)) {
    snprintf(msg, len,
             "uid %u already holds %u expert-parallel groups, counting those kept for a re-join "
             "(max-groups-per-uid %u): leave one (mok_group_leave) first",
             (unsigned)u->uid, held, l->max_groups_per_uid);
    return MOK_ELIMIT;
  }
  if (mok_limit_exceeded(MOK_LIMIT_GROUP_BYTES_PER_UID, l->max_group_bytes_per_uid, held_bytes,
                         bytes)) {
    snprintf(msg, len,
             "group '%s' needs %llu bytes of buffers; uid %u holds %llu in its other groups "
             "(max-group-bytes-per-uid %llu): leave a group, or lower max_tokens",
             key, (unsigned long long)bytes, (unsigned)u->uid, (unsigned long long)held_bytes,
             (unsigned long long)l->max_group_bytes_per_uid);
    return MOK_ELIMIT;
  }
  mok_quota_group *g = calloc(1, sizeof *g);
  if (!g) {
    snprintf(msg, len, "out of memory");
    return MOK_ENOMEM;
  }
  snprintf(g->key, sizeof g->key, "%s", key);
  g->bytes = bytes;
  g->pending = 1;
  g->next = u->groups;
  u->groups = g;
  *ret = g;
  return MOK_OK;
}

void mok_quota_group_settle(mok_quota_group *g, bool joined) {
  g->pending--;
  if (!joined) return;
  g->holders++;
  g->linger_until_ms = 0;
}

void mok_quota_group_drop(const mok_quota *q, mok_quota_group *g, bool left, uint64_t now_ms) {
  g->holders--;
  if (g->holders > 0) return;
  /* the last holder: LeaveGroup releases it now; an ended session leaves it
   * lingering (unless group-linger-ms is 0, which the margin covers) */
  g->linger_until_ms = left ? 0 : now_ms + q->lim.group_linger_ms + LINGER_MARGIN_MS;
}
