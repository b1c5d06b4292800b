/* SPDX-License-Identifier: Apache-2.0 */
/* Layers: creation, destruction and the sizes of the buffers jobs use. */
#include <stdlib.h>

#include "internal.h"
#include "rpc.h"
#include "mok_slots.h"

/* The wire form of a layer description (CreateLayer, LayerCost). */
static Mok__LayerConfig layer_config_of(const mok_layer_desc *d) {
  Mok__LayerConfig lc = MOK__LAYER_CONFIG__INIT;
  lc.hidden = d->hidden;
  lc.intermediate = d->intermediate;
  lc.experts = d->experts;
  lc.topk = d->topk;
  lc.shared_intermediate = d->shared_intermediate;
  lc.max_tokens = d->max_tokens;
  lc.dtype = d->dtype == MOK_DTYPE_F32        ? MOK__DTYPE__DTYPE_F32
             : d->dtype == MOK_DTYPE_BF16       ? MOK__DTYPE__DTYPE_BF16
             : d->dtype == MOK_DTYPE_FP8_E4M3   ? MOK__DTYPE__DTYPE_FP8_E4M3
                                                : MOK__DTYPE__DTYPE_UNSPECIFIED;
  lc.has_swiglu_limit = d->has_swiglu_limit != 0;
  lc.swiglu_limit = d->swiglu_limit;
  lc.group_id = d->group ? d->group->id : 0;
  lc.group_tag = d->group_tag;
  return lc;
}

int mok_layer_cost(mok_client *c, const mok_layer_desc *d, mok_layer_cost_info *ret) {
  if (!c || !d || !ret) return mok_set_error(MOK_EINVAL, "mok_layer_cost: NULL argument");
  if (d->group && d->group->client != c)
    return mok_set_error(MOK_EINVAL, "the layer's group was joined through another client");
  Mok__LayerConfig lc = layer_config_of(d);
  Mok__LayerCost cost = MOK__LAYER_COST__INIT;
  cost.config = &lc;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_LAYER_COST;
  req.layer_cost = &cost;
  Mok__Reply *reply = NULL;
  pthread_mutex_lock(&c->lock);
  int r = mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) return r;
  if (reply->body_case != MOK__REPLY__BODY_LAYER_COST) {
    mok__reply__free_unpacked(reply, NULL);
    return mok_set_error(MOK_EPROTO, "layer-cost reply without a cost (an older mokd?)");
  }
  const Mok__LayerCostReply *lr = reply->layer_cost;
  *ret = (mok_layer_cost_info){.layer_bytes = lr->layer_bytes,
                               .workspace_bytes = lr->workspace_bytes,
                               .ctx_bytes = lr->ctx_bytes,
                               .row_align = lr->row_align,
                               .local_experts = lr->local_experts,
                               .first_expert = lr->first_expert};
  mok__reply__free_unpacked(reply, NULL);
  return MOK_OK;
}

int mok_layer_create(mok_client *c, const mok_layer_desc *d, mok_layer **ret) {
  Mok__LayerConfig lc = layer_config_of(d);
  Mok__CreateLayer cl = MOK__CREATE_LAYER__INIT;
  cl.config = &lc;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_CREATE_LAYER;
  req.create_layer = &cl;
  mok_layer *l = calloc(1, sizeof *l);
  mok_layer **grown = NULL;
  if (!l) return mok_set_error(MOK_ENOMEM, "out of memory");
  pthread_mutex_lock(&c->lock);
  if (c->n_layers == c->cap_layers) {
    size_t cap = c->cap_layers ? 2 * c->cap_layers : 8;
    grown = realloc(c->layers, cap * sizeof *grown);
    if (grown) c->layers = grown, c->cap_layers = cap;
  } else {
    grown = c->layers;
  }
  Mok__Reply *reply = NULL;
  int r = grown ? mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL)
                : mok_set_error(MOK_ENOMEM, "out of memory");
  if (r == MOK_OK && reply->body_case != MOK__REPLY__BODY_CREATE_LAYER)
    r = mok_set_error(MOK_EPROTO, "create-layer reply without a layer");
  if (r == MOK_OK) {
    const Mok__CreateLayerReply *cr = reply->create_layer;
    l->client = c;
    l->id = cr->layer_id;
    l->cfg = (mok_layer_config){
        .hidden = d->hidden, .intermediate = d->intermediate, .experts = d->experts,
        .local_experts = cr->local_experts, .first_expert = cr->first_expert, .topk = d->topk,
        .shared_intermediate = d->shared_intermediate, .max_tokens = d->max_tokens,
        .dtype = d->dtype, .row_align = cr->row_align, .has_limit = d->has_swiglu_limit != 0,
        .swiglu_limit = d->swiglu_limit};
    if (d->group) {
      l->cfg.group_id = d->group->id;
      l->cfg.group_world = d->group->world;
      l->cfg.group_rank = d->group->rank;
      l->cfg.group_tokens = d->group->sizing.max_tokens;
      l->cfg.group_tag = d->group_tag;
      l->cfg.group_ring = d->group->sizing.ring_rows;
      l->cfg.group_rows = mok_group_rows_limit(d->group->capacity_ppm, d->group->world,
                                               d->group->sizing.max_tokens, d->topk,
                                               cr->local_experts, cr->row_align);
    }
    c->layers[c->n_layers++] = l;
  }
  if (reply) mok__reply__free_unpacked(reply, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) {
    free(l);
    return r;
  }
  *ret = l;
  return MOK_OK;
}

void mok_layer_destroy(mok_layer *l) {
  if (!l) return;
  mok_client *c = l->client;
  pthread_mutex_lock(&c->lock);
  for (size_t i = 0; i < c->n_layers; i++) {
    if (c->layers[i] != l) continue;
    c->layers[i] = c->layers[--c->n_layers];
    break;
  }
  Mok__DestroyLayer dl = MOK__DESTROY_LAYER__INIT;
  dl.layer_id = l->id;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_DESTROY_LAYER;
  req.destroy_layer = &dl;
  Mok__Reply *reply = NULL;
  if (!c->broken && mok_rpc(c, &req, NULL, 0, &reply, NULL, NULL) == MOK_OK)
    mok__reply__free_unpacked(reply, NULL);
  pthread_mutex_unlock(&c->lock);
  free(l);
}

uint32_t mok_layer_row_align(const mok_layer *l) { return l->cfg.row_align; }
uint32_t mok_layer_local_experts(const mok_layer *l) { return l->cfg.local_experts; }

uint64_t mok_layer_ctx_bytes(const mok_layer *l, uint32_t tokens) {
  if (l->cfg.group_id) return mok_group_ctx_bytes(&l->cfg, tokens);
  mok_layout_dims d = mok_layer_dims(&l->cfg, tokens);
  return mok_ctx_bytes(&d);
}
uint64_t mok_layer_acts_bytes(const mok_layer *l, uint32_t tokens) {
  mok_layout_dims d = mok_layer_dims(&l->cfg, tokens);
  return mok_acts_bytes(&d);
}
uint64_t mok_layer_schedule_ints(const mok_layer *l, uint32_t tokens) {
  mok_layout_dims d = mok_layer_dims(&l->cfg, tokens);
  return mok_schedule_ints(&d);
}
uint64_t mok_layer_rows_capacity(const mok_layer *l, uint32_t tokens) {
  mok_layout_dims d = mok_layer_dims(&l->cfg, tokens);
  return mok_rows_capacity(&d);
}

mok_tensor mok_tensor_for(const mok_layer *l, uint32_t tokens, uint32_t slot, const void *data) {
  mok_tensor t = {.data = data};
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape(&l->cfg, tokens, slot, &t.dtype, &t.ndim, shape);
  for (int i = 0; i < 4; i++) t.shape[i] = shape[i];
  return t;
}

mok_tensor mok_tensor_for_job(const mok_layer *l, uint32_t op, uint32_t flags, uint32_t tokens,
                              uint32_t slot, const void *data) {
  mok_tensor t = {.data = data};
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape_job(&l->cfg, op, flags, MOK_SLOT_COUNT_, tokens, slot, &t.dtype, &t.ndim,
                         shape);
  for (int i = 0; i < 4; i++) t.shape[i] = shape[i];
  return t;
}

uint64_t mok_layer_packed_weights_bytes(const mok_layer *l) {
  return l ? mok_packed_weights_bytes(&l->cfg) : 0;
}

uint64_t mok_layer_packed_weights_offset(const mok_layer *l, uint32_t weight_slot) {
  return l ? mok_packed_weights_offset(&l->cfg, weight_slot) : UINT64_MAX;
}

uint64_t mok_layer_packed_weight_bytes(const mok_layer *l, uint32_t weight_slot) {
  return l ? mok_slot_packed_bytes(&l->cfg, weight_slot) : 0;
}

int mok_quantize_weight(mok_layer *l, uint32_t weight_slot, const void *weight, void *packed,
                        uint64_t *ret_ticket) {
  if (!l || !weight || !packed) return mok_set_error(MOK_EINVAL, "mok_quantize_weight: NULL argument");
  if (mok_slot_packed_bytes(&l->cfg, weight_slot) == 0)
    return mok_set_error(MOK_EINVAL,
                         "mok_quantize_weight: slot %u is not a weight of an fp8 layer (w_gate, "
                         "w_up, w_down, or s_* with a shared expert)", weight_slot);
  mok_tensor t[MOK_SLOT_COUNT_] = {0};
  const uint32_t slots[2] = {weight_slot, MOK_SLOT_PACKED_WEIGHT};
  const void *data[2] = {weight, packed};
  for (int i = 0; i < 2; i++) {
    uint64_t shape[MOK_MAX_DIMS];
    mok_tensor *x = &t[slots[i]];
    mok_job_slot_shape_op(&l->cfg, MOK_OP_QUANTIZE_WEIGHT, weight_slot, 0, slots[i], &x->dtype,
                          &x->ndim, shape);
    x->data = data[i];
    for (int d = 0; d < 4; d++) x->shape[d] = shape[d];
  }
  return mok_submit(l, MOK_OP_QUANTIZE_WEIGHT, 0, 0, t, ret_ticket);
}

void mok_layers_client_free(mok_client *c) {
  while (c->n_layers) mok_layer_destroy(c->layers[c->n_layers - 1]);
  free(c->layers);
  c->layers = NULL;
  c->cap_layers = 0;
}
