/* SPDX-License-Identifier: Apache-2.0 */
/* The client limits: what each uid holds across all its sessions, and what
 * the whole daemon holds, against the configured shares (deploy/mokd.conf's
 * table). Loop thread only; pure bookkeeping (no I/O), so that the rules
 * are unit-tested (tests/unit/test_quota.c).
 *
 * Resources are reserved when their request goes to the engine thread and
 * settled when it answers (given back on failure), so that requests in
 * flight can never overshoot a limit. A dead session's share goes once the
 * engine has detached it (its memory really unmapped).
 *
 * Expert-parallel groups count per (uid, key): a join reserves, a
 * successful join holds, leaving releases at once when no other session of
 * the uid holds it; a session that ends without leaving keeps the group
 * counted while the engine keeps it warm for a re-join (group-linger-ms).
 */
#ifndef MOK_QUOTA_H
#define MOK_QUOTA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "ep/group.h"

typedef struct mok_quota_limits {
  /* 0: no limit */
  uint32_t max_regions_total; /* daemon-wide */
  uint32_t max_regions_per_uid;
  uint64_t max_region_bytes_per_uid;
  uint32_t max_layers_per_uid;
  uint32_t max_groups_per_uid;
  uint64_t max_group_bytes_per_uid;
  /* how long the engine keeps a group that no session holds */
  uint32_t group_linger_ms;
} mok_quota_limits;

/* One group of a uid, as the quota sees it. */
typedef struct mok_quota_group {
  char key[MOK_GROUP_KEY_MAX + 1];
  uint64_t bytes;           /* its segment's (mok_ep_group_segment_bytes) */
  uint32_t holders;         /* successful joins of live sessions */
  uint32_t pending;         /* joins sent to the engine, not answered yet */
  uint64_t linger_until_ms; /* no holder: counted until then */
  struct mok_quota_group *next;
} mok_quota_group;

typedef struct mok_uid_usage {
  uid_t uid;
  uint32_t sessions;
  uint32_t regions;
  uint64_t region_bytes;
  uint32_t layers;
  mok_quota_group *groups;
  struct mok_uid_usage *next;
} mok_uid_usage;

typedef struct mok_quota {
  mok_quota_limits lim;
  mok_uid_usage *users;
  uint32_t regions_total;
} mok_quota;

/* The usage of uid (create: a zeroed one when it has none; NULL when out
 * of memory). Without create, NULL when the uid holds nothing. */
mok_uid_usage *mok_quota_user(mok_quota *q, uid_t uid, bool create);
/* Forget users that hold nothing any more (groups whose linger ended go
 * first). now_ms: CLOCK_MONOTONIC. */
void mok_quota_prune(mok_quota *q, uint64_t now_ms);
/* Free everything (daemon exit). */
void mok_quota_free(mok_quota *q);

/* MOK_OK, or MOK_ELIMIT with msg naming the setting, when adding regions
 * (with bytes) and layers to u would exceed a limit. */
int mok_quota_check(const mok_quota *q, const mok_uid_usage *u, uint32_t regions, uint64_t bytes,
                    uint32_t layers, char *msg, size_t len);
/* Count (sign +1) or un-count (-1) one region of bytes, or one layer. */
void mok_quota_region(mok_quota *q, mok_uid_usage *u, int sign, uint64_t bytes);
void mok_quota_layer(mok_uid_usage *u, int sign);

/* Groups of u still counted at now_ms (held, being joined or lingering),
 * and their bytes. */
uint32_t mok_quota_groups(mok_uid_usage *u, uint64_t now_ms, uint64_t *ret_bytes);
/* A join of key (its segment: bytes) is sent: reserve. MOK_OK with *ret
 * the group's record, MOK_ELIMIT (msg names the setting) or MOK_ENOMEM.
 * Joining a group the uid holds already (or that lingers) costs nothing. */
int mok_quota_group_reserve(mok_quota *q, mok_uid_usage *u, const char *key, uint64_t bytes,
                            uint64_t now_ms, mok_quota_group **ret, char *msg, size_t len);
/* The engine answered the join reserved on g: joined or not. */
void mok_quota_group_settle(mok_quota_group *g, bool joined);
/* One holder of g goes: left (LeaveGroup: the engine releases a group
 * nobody holds at once) or its session ended (the engine keeps it
 * lingering). */
void mok_quota_group_drop(const mok_quota *q, mok_quota_group *g, bool left, uint64_t now_ms);

#endif
