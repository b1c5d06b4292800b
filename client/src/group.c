/* SPDX-License-Identifier: Apache-2.0 */
/* Expert-parallel groups: JoinGroup / LeaveGroup (docs/ep.md). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "rpc.h"

int mok_group_join(mok_client *c, const char *key, uint32_t rank, uint32_t world,
                   const mok_group_sizing *sz, mok_group **ret) {
  if (!c || !key || !sz || !ret) return mok_set_error(MOK_EINVAL, "mok_group_join: NULL argument");
  if (sz->dtype != MOK_DTYPE_F32 && sz->dtype != MOK_DTYPE_BF16)
    return mok_set_error(MOK_EINVAL, "mok_group_join: dtype must be MOK_DTYPE_F32 or BF16: a group's "
                                     "dtype is its activations' (an fp8 layer runs on a "
                                     "bfloat16 group)");
  if (!(sz->capacity >= 0.0f && sz->capacity <= 1.0f))
    return mok_set_error(MOK_EINVAL,
                         "mok_group_join: capacity must be in (0, 1], or 0 for all routes");
  uint32_t capacity_ppm = (uint32_t)lround((double)sz->capacity * 1e6);
  Mok__JoinGroup jg = MOK__JOIN_GROUP__INIT;
  jg.group_key = (char *)key;
  jg.rank = rank;
  jg.world = world;
  jg.max_tokens = sz->max_tokens;
  jg.hidden = sz->hidden;
  jg.topk = sz->topk;
  jg.experts = sz->experts;
  jg.dtype = sz->dtype == MOK_DTYPE_F32 ? MOK__DTYPE__DTYPE_F32 : MOK__DTYPE__DTYPE_BF16;
  jg.timeout_ms = sz->timeout_ms;
  jg.capacity_ppm = capacity_ppm;
  jg.ring_rows = sz->ring_rows;
  if (sz->nccl_id) {
    jg.nccl_id.data = (uint8_t *)sz->nccl_id;
    jg.nccl_id.len = MOK_NCCL_ID_BYTES;
  }
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_JOIN_GROUP;
  req.join_group = &jg;
  mok_group *g = calloc(1, sizeof *g);
  if (!g) return mok_set_error(MOK_ENOMEM, "out of memory");
  Mok__Reply *reply = NULL;
  pthread_mutex_lock(&c->lock);
  int r = MOK_OK;
  if (c->n_groups == c->cap_groups) {
    size_t cap = c->cap_groups ? 2 * c->cap_groups : 4;
    mok_group **n = realloc(c->groups, cap * sizeof *n);
    if (n) c->groups = n, c->cap_groups = cap;
    else r = mok_set_error(MOK_ENOMEM, "out of memory");
  }
  if (r == MOK_OK) r = mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  if (r == MOK_OK && reply->body_case == MOK__REPLY__BODY_JOIN_GROUP)
    c->groups[c->n_groups++] = g;
  pthread_mutex_unlock(&c->lock);
  if (r == MOK_OK && reply->body_case != MOK__REPLY__BODY_JOIN_GROUP)
    r = mok_set_error(MOK_EPROTO, "join-group reply without a group");
  if (r != MOK_OK) {
    if (reply) mok__reply__free_unpacked(reply, NULL);
    free(g);
    return r;
  }
  const Mok__JoinGroupReply *jr = reply->join_group;
  g->client = c;
  g->id = jr->group_id;
  g->rank = rank;
  g->world = world;
  g->local_experts = jr->local_experts;
  g->first_expert = jr->first_expert;
  g->generation = jr->generation;
  g->rejoined = jr->rejoined;
  g->sizing = *sz;
  g->sizing.nccl_id = NULL; /* the caller's memory */
  g->capacity_ppm = capacity_ppm;
  mok__reply__free_unpacked(reply, NULL);
  *ret = g;
  return MOK_OK;
}

int mok_group_leave(mok_group *g) {
  if (!g) return MOK_OK;
  mok_client *c = g->client;
  Mok__LeaveGroup lg = MOK__LEAVE_GROUP__INIT;
  lg.group_id = g->id;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_LEAVE_GROUP;
  req.leave_group = &lg;
  Mok__Reply *reply = NULL;
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->n_groups; i++) {
    if (c->groups[i] != g) continue;
    c->groups[i] = c->groups[--c->n_groups];
    break;
  }
  int r = c->broken ? MOK_OK : mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (reply) mok__reply__free_unpacked(reply, NULL);
  free(g);
  return r;
}

uint32_t mok_group_rank(const mok_group *g) { return g->rank; }
uint32_t mok_group_world(const mok_group *g) { return g->world; }
uint32_t mok_group_local_experts(const mok_group *g) { return g->local_experts; }
uint32_t mok_group_first_expert(const mok_group *g) { return g->first_expert; }
uint64_t mok_group_generation(const mok_group *g) { return g->generation; }
int mok_group_rejoined(const mok_group *g) { return g->rejoined; }

int mok_group_nccl_id(mok_client *c, uint8_t id[MOK_NCCL_ID_BYTES]) {
  if (!c || !id) return mok_set_error(MOK_EINVAL, "mok_group_nccl_id: NULL argument");
  Mok__GroupId gi = MOK__GROUP_ID__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_GROUP_ID;
  req.group_id = &gi;
  Mok__Reply *reply = NULL;
  pthread_mutex_lock(&c->lock);
  int r = mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r == MOK_OK && (reply->body_case != MOK__REPLY__BODY_GROUP_ID ||
                      reply->group_id->nccl_id.len != MOK_NCCL_ID_BYTES))
    r = mok_set_error(MOK_EPROTO, "group-id reply without a %d-byte id", MOK_NCCL_ID_BYTES);
  if (r == MOK_OK) memcpy(id, reply->group_id->nccl_id.data, MOK_NCCL_ID_BYTES);
  if (reply) mok__reply__free_unpacked(reply, NULL);
  return r;
}

void mok_groups_client_free(mok_client *c) {
  for (size_t i = 0; i < c->n_groups; i++) free(c->groups[i]);
  free(c->groups);
  c->groups = NULL;
  c->n_groups = c->cap_groups = 0;
}
