/* SPDX-License-Identifier: Apache-2.0 */
/* Job descriptor validation: every reference checked before any engine work. */
#include <stdint.h>

#include "harness/check.h"
#include "job_check.h"
#include "layer.h"

#define REGION_BYTES (1u << 20)

typedef struct fixture {
  mok_region_table regions;
  mok_layer_config layer;
  mok_job_desc desc;
  uint64_t next_offset;
  char *mem;
} fixture;

static void fixture_init(fixture *f, uint32_t shared) {
  memset(f, 0, sizeof *f);
  f->mem = calloc(1, REGION_BYTES);
  mok_region r = {.kind = MOK_REGION_HOST_MEMFD, .base = f->mem, .bytes = REGION_BYTES};
  CHECK(mok_region_table_add(&f->regions, &r) == MOK_OK);
  f->layer = (mok_layer_config){.hidden = 16, .intermediate = 8, .experts = 4,
                                .local_experts = 4, .topk = 2, .shared_intermediate = shared,
                                .max_tokens = 32, .dtype = MOK_DTYPE_F32, .row_align = 1};
  f->desc.version = MOK_JOB_VERSION;
  f->desc.op = MOK_OP_FORWARD;
  f->desc.layer = 1;
  f->desc.tokens = 8;
}

/* Append the tensor the layer expects in slot, at the next free offset
 * (a quantize_weight job's as its source: the first weight slot added). */
static mok_tensor_ref *add(fixture *f, uint32_t slot) {
  uint32_t dt, nd, source = MOK_SLOT_COUNT_;
  uint64_t shape[MOK_MAX_DIMS], present = 0;
  for (uint32_t i = 0; i < f->desc.n_tensors; i++) present |= 1ull << f->desc.tensors[i].slot;
  if (f->desc.op == MOK_OP_QUANTIZE_WEIGHT)
    source = mok_quantize_source(present | (slot == MOK_SLOT_PACKED_WEIGHT ? 0 : 1ull << slot));
  mok_job_slot_shape_op(&f->layer, f->desc.op, source, f->desc.tokens, slot, &dt, &nd, shape);
  mok_tensor_ref *t = &f->desc.tensors[f->desc.n_tensors++];
  memset(t, 0, sizeof *t);
  t->region = 1;
  t->slot = (uint16_t)slot;
  t->dtype = (uint8_t)dt;
  t->ndim = (uint8_t)nd;
  uint64_t n = mok_dtype_size(dt);
  for (uint32_t i = 0; i < nd; i++) t->shape[i] = (uint32_t)shape[i], n *= shape[i];
  t->bytes = n;
  t->offset = f->next_offset;
  f->next_offset += (n + 255) & ~255ull;
  return t;
}

static void add_forward(fixture *f) {
  uint32_t slots[] = {MOK_SLOT_X, MOK_SLOT_TOPK_IDS, MOK_SLOT_ROUTER_W, MOK_SLOT_W_GATE,
                      MOK_SLOT_W_UP, MOK_SLOT_W_DOWN, MOK_SLOT_OUT};
  for (size_t i = 0; i < sizeof slots / sizeof *slots; i++) add(f, slots[i]);
}

static mok_tensor_ref *find(fixture *f, uint32_t slot) {
  for (uint32_t i = 0; i < f->desc.n_tensors; i++)
    if (f->desc.tensors[i].slot == slot) return &f->desc.tensors[i];
  return NULL;
}

static int check_job(fixture *f, char *err) {
  mok_job_args args;
  return mok_job_check(&f->desc, &f->regions, &f->layer, &args, err, 256);
}

#define EXPECT_REJECTED(f, status, needle)                                     \
  do {                                                                         \
    char err_[256] = "";                                                       \
    CHECK_EQ_INT(check_job(f, err_), status);                                  \
    CHECK_STR_CONTAINS(err_, needle);                                          \
  } while (0)

static void test_a_good_forward_resolves_every_tensor(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  mok_job_args args;
  char err[256] = "";
  CHECK_MSG(mok_job_check(&f.desc, &f.regions, &f.layer, &args, err, sizeof err) == MOK_OK,
            "%s", err);
  CHECK(args.t[MOK_SLOT_X].ptr == f.mem + find(&f, MOK_SLOT_X)->offset);
  CHECK(args.t[MOK_SLOT_OUT].ptr != NULL);
  CHECK(args.t[MOK_SLOT_CTX].ptr == NULL); /* optional and absent */
  CHECK_EQ_INT(args.tokens, 8);
}

static void test_references_outside_the_session_fail(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  find(&f, MOK_SLOT_X)->region = 2; /* another session's id space: not ours */
  EXPECT_REJECTED(&f, MOK_ENOENT, "x: region 2 is not registered");
  find(&f, MOK_SLOT_X)->region = 0;
  EXPECT_REJECTED(&f, MOK_ENOENT, "region 0");
}

static void test_bounds_are_overflow_safe(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  mok_tensor_ref *x = find(&f, MOK_SLOT_X);
  x->offset = REGION_BYTES - 4; /* starts inside, ends outside */
  EXPECT_REJECTED(&f, MOK_EBOUNDS, "outside region 1");
  x->offset = UINT64_MAX - 8; /* offset + bytes wraps */
  EXPECT_REJECTED(&f, MOK_EBOUNDS, "outside region 1");
  x->offset = 0;
  x->bytes = UINT64_MAX;
  EXPECT_REJECTED(&f, MOK_EBOUNDS, "outside region 1");
}

static void test_dtype_shape_and_size_must_match_the_layer(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  mok_tensor_ref *x = find(&f, MOK_SLOT_X), saved = *x;
  x->dtype = MOK_DTYPE_BF16;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "x: dtype");
  *x = saved;
  x->ndim = 3;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "dimensions");
  *x = saved;
  x->shape[1] = 15;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "dimension 1 is 15, expected 16");
  *x = saved;
  x->shape[3] = 1;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "unused dimension");
  *x = saved;
  x->bytes -= 4;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "bytes declared");
  *x = saved;
  x->offset += 2;
  EXPECT_REJECTED(&f, MOK_EINVAL, "not aligned");
  *x = saved;
  mok_tensor_ref *w = find(&f, MOK_SLOT_W_DOWN);
  w->shape[1] = 8, w->shape[2] = 16; /* w_down transposed */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_down: dimension 1");
}

static void test_slots_required_forbidden_and_unique(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  f.desc.n_tensors--; /* drop out */
  EXPECT_REJECTED(&f, MOK_EINVAL, "forward needs out");
  add(&f, MOK_SLOT_OUT);
  add(&f, MOK_SLOT_D_X);
  EXPECT_REJECTED(&f, MOK_EINVAL, "d_x is not an argument of forward");
  f.desc.n_tensors--;
  add(&f, MOK_SLOT_S_GATE);
  EXPECT_REJECTED(&f, MOK_EINVAL, "no shared expert");
  f.desc.n_tensors--;
  f.desc.tensors[f.desc.n_tensors] = *find(&f, MOK_SLOT_X);
  f.desc.n_tensors++;
  EXPECT_REJECTED(&f, MOK_EINVAL, "x given twice");
  f.desc.n_tensors--;
  f.desc.tensors[0].slot = 200;
  EXPECT_REJECTED(&f, MOK_EINVAL, "unknown slot 200");
}

static void test_shared_expert_weights_are_required_when_configured(void) {
  fixture f;
  fixture_init(&f, 4);
  add_forward(&f);
  EXPECT_REJECTED(&f, MOK_EINVAL, "forward needs s_gate");
  add(&f, MOK_SLOT_S_GATE);
  add(&f, MOK_SLOT_S_UP);
  add(&f, MOK_SLOT_S_DOWN);
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
}

static void test_outputs_may_not_overlap_other_tensors(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  find(&f, MOK_SLOT_OUT)->offset = find(&f, MOK_SLOT_X)->offset + 64;
  EXPECT_REJECTED(&f, MOK_EINVAL, "output out overlaps x");
  /* inputs may share bytes: w_gate and w_up read from one buffer is fine */
  fixture g;
  fixture_init(&g, 0);
  add_forward(&g);
  find(&g, MOK_SLOT_W_UP)->offset = find(&g, MOK_SLOT_W_GATE)->offset;
  char err[256] = "";
  CHECK_MSG(check_job(&g, err) == MOK_OK, "%s", err);
}

/* Give region 1 a backing and add region 2 of REGION_BYTES on (object,
 * object2) at backing offset off: a second registration of one memfd
 * when the object matches region 1's. */
static void add_aliasing_region(fixture *f, uint64_t object, uint64_t object2, uint64_t off) {
  f->regions.items[0].backing = (mok_region_backing){.object = 7, .object2 = 99, .offset = 0};
  mok_region r = {.kind = MOK_REGION_HOST_MEMFD, .base = f->mem, .bytes = REGION_BYTES,
                  .backing = {.object = object, .object2 = object2, .offset = off}};
  CHECK(mok_region_table_add(&f->regions, &r) == MOK_OK);
  CHECK_EQ_INT(r.id, 2);
}

static void test_one_memfd_registered_twice_is_seen_through(void) {
  /* region 2 is the same memfd from offset B; region 1's tensors lie below
   * 8 KiB, so only x (moved up to B) can meet out (moved to region 2) */
  enum { B = 65536 };
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  add_aliasing_region(&f, 7, 99, B);
  mok_tensor_ref *x = find(&f, MOK_SLOT_X), *out = find(&f, MOK_SLOT_OUT);
  CHECK(f.next_offset < 8192 && x->bytes == out->bytes);
  out->region = 2;
  out->offset = 0; /* memfd bytes B .. B + 512 */
  x->offset = B;
  EXPECT_REJECTED(&f, MOK_EINVAL, "output out overlaps x: regions 2 and 1 are the same memory");
  /* right after out in the memfd: fine */
  x->offset = B + out->bytes;
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  /* one element over the end of out */
  x->offset = B + out->bytes - 4;
  EXPECT_REJECTED(&f, MOK_EINVAL, "same memory");
  /* x ending where out starts, then one element into it */
  x->offset = B - x->bytes;
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  x->offset = B - x->bytes + 4;
  EXPECT_REJECTED(&f, MOK_EINVAL, "same memory");
  /* deep inside the second registration */
  out->offset = 8192;
  x->offset = B + 8192;
  EXPECT_REJECTED(&f, MOK_EINVAL, "same memory");
  /* an input read through both registrations is fine */
  out->offset = 16384;
  mok_tensor_ref *wg = find(&f, MOK_SLOT_W_GATE), *wu = find(&f, MOK_SLOT_W_UP);
  wu->offset = B + 4096;
  wg->region = 2;
  wg->offset = 4096; /* the same memfd bytes as w_up */
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  /* but an output over an input read through the other registration is not */
  wg->region = 1;
  wg->offset = 1024;
  out->offset = 4096;
  EXPECT_REJECTED(&f, MOK_EINVAL, "output out overlaps w_up: regions 2 and 1 are the same");
}

static void test_backings_differ_by_either_half_of_their_identity(void) {
  uint64_t objects[][2] = {{7, 98}, {8, 99}};
  for (int k = 0; k < 2; k++) {
    fixture f;
    fixture_init(&f, 0);
    add_forward(&f);
    add_aliasing_region(&f, objects[k][0], objects[k][1], 0);
    mok_tensor_ref *out = find(&f, MOK_SLOT_OUT);
    out->region = 2;
    out->offset = find(&f, MOK_SLOT_X)->offset; /* same offsets, other memory */
    char err[256] = "";
    CHECK_MSG(check_job(&f, err) == MOK_OK, "case %d: %s", k, err);
  }
}

static void test_unknown_backings_only_alias_themselves(void) {
  /* object 0: only the region itself (by id) can overlap it */
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  mok_region r = {.kind = MOK_REGION_HOST_MEMFD, .base = f.mem, .bytes = REGION_BYTES};
  CHECK(mok_region_table_add(&f.regions, &r) == MOK_OK);
  mok_tensor_ref *out = find(&f, MOK_SLOT_OUT);
  out->region = 2;
  out->offset = find(&f, MOK_SLOT_X)->offset;
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  out->region = 1; /* and within one region the offsets decide, as before */
  EXPECT_REJECTED(&f, MOK_EINVAL, "output out overlaps x");
  /* a known backing never equals an unknown one, even with equal numbers */
  f.regions.items[0].backing = (mok_region_backing){.object = 2, .object2 = 0, .offset = 0};
  out->region = 2;
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
}

static void test_huge_backing_offsets_do_not_wrap(void) {
  /* backing offsets near 2^64: start + bytes must not wrap into "no overlap" */
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  uint64_t top = UINT64_MAX - REGION_BYTES / 2;
  add_aliasing_region(&f, 7, 99, top);
  f.regions.items[0].backing.offset = top;
  mok_tensor_ref *x = find(&f, MOK_SLOT_X), *out = find(&f, MOK_SLOT_OUT);
  out->region = 2;
  out->offset = REGION_BYTES / 2 - 64; /* straddles 2^64 in backing terms */
  x->offset = REGION_BYTES / 2 - 32;
  EXPECT_REJECTED(&f, MOK_EINVAL, "same memory");
}

static void test_header_fields_are_checked(void) {
  fixture f;
  fixture_init(&f, 0);
  add_forward(&f);
  f.desc.version = 99;
  EXPECT_REJECTED(&f, MOK_EVERSION, "version 99");
  f.desc.version = MOK_JOB_VERSION;
  f.desc.op = 77;
  EXPECT_REJECTED(&f, MOK_EINVAL, "unknown op 77");
  f.desc.op = MOK_OP_FORWARD;
  f.desc.flags = MOK_JOB_RECOMPUTE;
  EXPECT_REJECTED(&f, MOK_EINVAL, "only valid on backward");
  f.desc.flags = 0x80;
  EXPECT_REJECTED(&f, MOK_EINVAL, "unknown job flags");
  f.desc.flags = 0;
  f.desc.tokens = 0;
  EXPECT_REJECTED(&f, MOK_EINVAL, "tokens = 0");
  f.desc.tokens = 33;
  EXPECT_REJECTED(&f, MOK_EINVAL, "max_tokens");
  f.desc.tokens = 8;
  f.desc.n_tensors = MOK_MAX_TENSORS + 1;
  EXPECT_REJECTED(&f, MOK_EINVAL, "at most");
  mok_job_args args;
  char err[256] = "";
  f.desc.n_tensors = 7;
  CHECK_EQ_INT(mok_job_check(&f.desc, &f.regions, NULL, &args, err, sizeof err), MOK_ENOENT);
  CHECK_STR_CONTAINS(err, "layer 1 does not exist");
}

static void test_nop_takes_nothing(void) {
  fixture f;
  fixture_init(&f, 0);
  f.desc.op = MOK_OP_NOP;
  mok_job_args args;
  char err[256] = "";
  CHECK_EQ_INT(mok_job_check(&f.desc, &f.regions, NULL, &args, err, sizeof err), MOK_OK);
  add(&f, MOK_SLOT_X);
  CHECK_EQ_INT(mok_job_check(&f.desc, &f.regions, NULL, &args, err, sizeof err), MOK_EINVAL);
}

static void test_recompute_needs_routing_ids(void) {
  fixture f;
  fixture_init(&f, 0);
  f.desc.op = MOK_OP_BACKWARD;
  uint32_t slots[] = {MOK_SLOT_CTX, MOK_SLOT_D_OUT, MOK_SLOT_ROUTER_W, MOK_SLOT_X,
                      MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN, MOK_SLOT_D_X,
                      MOK_SLOT_D_RW, MOK_SLOT_D_W_GATE, MOK_SLOT_D_W_UP, MOK_SLOT_D_W_DOWN};
  for (size_t i = 0; i < sizeof slots / sizeof *slots; i++) add(&f, slots[i]);
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  f.desc.flags = MOK_JOB_RECOMPUTE;
  EXPECT_REJECTED(&f, MOK_EINVAL, "backward needs topk_ids");
  add(&f, MOK_SLOT_TOPK_IDS);
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
}

static void test_every_op_accepts_exactly_its_required_slots(void) {
  /* build each op's minimal job from the table itself and check it passes
   * (quantize_weight, an fp8 layer's op: test_quantize_weight_*) */
  for (uint32_t shared = 0; shared <= 4; shared += 4) {
    for (uint32_t op = 1; op < MOK_OP_COUNT_; op++) {
      if (op == MOK_OP_QUANTIZE_WEIGHT) continue;
      fixture f;
      fixture_init(&f, shared);
      f.desc.op = (uint16_t)op;
      for (uint32_t s = 0; s < MOK_SLOT_COUNT_; s++)
        if (mok_job_slot_need(&f.layer, op, 0, s) == MOK_NEED_REQUIRED) add(&f, s);
      char err[256] = "";
      CHECK_MSG(f.next_offset <= REGION_BYTES, "fixture region too small");
      CHECK_MSG(check_job(&f, err) == MOK_OK, "%s (shared %u): %s", mok_op_name(op), shared, err);
    }
  }
}

/* ---- fp8 layers: packed weights (mok_wire.h) and quantize_weight ---------- */

static void fixture_init_fp8(fixture *f, uint32_t shared) {
  fixture_init(f, 0);
  f->layer.hidden = 256;
  f->layer.intermediate = 128;
  f->layer.experts = f->layer.local_experts = 2;
  f->layer.shared_intermediate = shared;
  f->layer.dtype = MOK_DTYPE_FP8_E4M3;
}

static void test_fp8_layers_need_whole_blocks(void) {
  mok_layer_config c = {.hidden = 7000, .intermediate = 256, .experts = 4, .topk = 2,
                        .max_tokens = 8, .dtype = MOK_DTYPE_FP8_E4M3};
  char err[256] = "";
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "hidden = 7000 is not a multiple of 128");
  c.hidden = 256, c.intermediate = 100;
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "intermediate = 100 is not a multiple of 128");
  c.intermediate = 384, c.shared_intermediate = 64;
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "shared_intermediate = 64");
  c.shared_intermediate = 128;
  CHECK_MSG(mok_layer_validate(&c, err, sizeof err) == MOK_OK, "%s", err);
  c.shared_intermediate = 0;
  CHECK_MSG(mok_layer_validate(&c, err, sizeof err) == MOK_OK, "%s", err);
  c.experts = 4096, c.hidden = c.intermediate = 1024; /* packed w_gate: 2 x 4 GiB + scales */
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_ELIMIT);
  CHECK_STR_CONTAINS(err, "more than the 4 GiB one tensor dimension holds");
  /* both orientations count: 2 x 2 GiB + scales is refused, 2 x 1 GiB + scales is not */
  c.experts = 2048;
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_ELIMIT);
  CHECK_STR_CONTAINS(err, "an fp8 layer's packed w_gate would be 4295491584 bytes");
  c.experts = 1024;
  CHECK_MSG(mok_layer_validate(&c, err, sizeof err) == MOK_OK, "%s", err);
  /* the shared expert's weights too: s_gate [32768, 65536] twice is 4 GiB + scales */
  c.experts = 4, c.intermediate = 128, c.hidden = 65536, c.shared_intermediate = 32768;
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_ELIMIT);
  CHECK_STR_CONTAINS(err, "packed s_gate would be");
  CHECK_STR_CONTAINS(err, "use a smaller H or shared_intermediate");
  c.shared_intermediate = 16384;
  CHECK_MSG(mok_layer_validate(&c, err, sizeof err) == MOK_OK, "%s", err);
  c.shared_intermediate = 0;
  c.experts = 4, c.hidden = 256, c.intermediate = 384;
  c.dtype = MOK_DTYPE_U8; /* not a layer dtype */
  CHECK_EQ_INT(mok_layer_validate(&c, err, sizeof err), MOK_EINVAL);
  /* bf16 layers keep any size */
  c.dtype = MOK_DTYPE_BF16, c.hidden = 7000;
  CHECK_MSG(mok_layer_validate(&c, err, sizeof err) == MOK_OK, "%s", err);
}

static void test_fp8_jobs_take_packed_weights(void) {
  fixture f;
  fixture_init_fp8(&f, 128);
  add_forward(&f);
  add(&f, MOK_SLOT_S_GATE), add(&f, MOK_SLOT_S_UP), add(&f, MOK_SLOT_S_DOWN);
  mok_tensor_ref *wg = find(&f, MOK_SLOT_W_GATE), saved = *wg;
  CHECK(wg->dtype == MOK_DTYPE_U8 && wg->ndim == 1 &&
        wg->bytes == mok_fp8_weight_bytes(2, 128, 256) &&
        wg->bytes == 2 * 65536 + 4 * 2 * 1 * 2); /* both orientations, then the scales */
  CHECK_EQ_INT(find(&f, MOK_SLOT_X)->dtype, MOK_DTYPE_BF16);
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  wg->shape[0]--, wg->bytes--; /* one byte short: the last scale cut */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_gate: dimension 0 is 131087, expected 131088");
  *wg = saved;
  wg->bytes--; /* the shape right, the size not */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_gate: 131087 bytes declared");
  *wg = saved;
  wg->shape[0] = 65536 + 16, wg->bytes = 65536 + 16; /* one orientation only, as before */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_gate: dimension 0 is 65552, expected 131088");
  /* the bf16 master where the packed form belongs */
  *wg = saved;
  wg->dtype = MOK_DTYPE_BF16, wg->ndim = 3;
  wg->shape[0] = 2, wg->shape[1] = 128, wg->shape[2] = 256, wg->bytes = 2ull * 128 * 256 * 2;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_gate: dtype 2, the layer needs dtype 4");
  *wg = saved;
  find(&f, MOK_SLOT_S_DOWN)->dtype = MOK_DTYPE_BF16;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "s_down: dtype 2, the layer needs dtype 4");
  find(&f, MOK_SLOT_S_DOWN)->dtype = MOK_DTYPE_U8;
  find(&f, MOK_SLOT_X)->dtype = MOK_DTYPE_FP8_E4M3; /* activations stay bf16 */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "x: dtype 5, the layer needs dtype 2");
  find(&f, MOK_SLOT_X)->dtype = MOK_DTYPE_BF16;
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  /* the packed output slot belongs to quantize_weight alone */
  add(&f, MOK_SLOT_CTX)->slot = MOK_SLOT_PACKED_WEIGHT;
  EXPECT_REJECTED(&f, MOK_EINVAL, "packed_weight is not an argument of forward");
}

static void test_fp8_backward_gradients_stay_bf16(void) {
  fixture f;
  fixture_init_fp8(&f, 0);
  f.desc.op = MOK_OP_BACKWARD;
  for (uint32_t s = 0; s < MOK_SLOT_COUNT_; s++)
    if (mok_job_slot_need(&f.layer, MOK_OP_BACKWARD, 0, s) == MOK_NEED_REQUIRED) add(&f, s);
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  mok_tensor_ref *dwd = find(&f, MOK_SLOT_D_W_DOWN);
  CHECK(dwd->dtype == MOK_DTYPE_BF16 && dwd->ndim == 3 && dwd->shape[1] == 256);
  CHECK_EQ_INT(find(&f, MOK_SLOT_W_DOWN)->dtype, MOK_DTYPE_U8);
  dwd->dtype = MOK_DTYPE_U8;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "d_w_down: dtype 4, the layer needs dtype 2");
}

static void quantize_job(fixture *f, uint32_t shared, uint32_t source) {
  fixture_init_fp8(f, shared);
  f->desc.op = MOK_OP_QUANTIZE_WEIGHT;
  f->desc.tokens = 0;
  add(f, source);
  add(f, MOK_SLOT_PACKED_WEIGHT);
}

static void test_quantize_weight_takes_one_bf16_source_and_its_packed_size(void) {
  const uint32_t sources[] = {MOK_SLOT_W_GATE, MOK_SLOT_W_UP, MOK_SLOT_W_DOWN, MOK_SLOT_S_GATE,
                              MOK_SLOT_S_UP, MOK_SLOT_S_DOWN};
  char err[256] = "";
  for (size_t i = 0; i < sizeof sources / sizeof *sources; i++) {
    fixture f;
    quantize_job(&f, 256, sources[i]);
    CHECK_MSG(check_job(&f, err) == MOK_OK, "%s: %s", mok_slot_name(sources[i]), err);
    mok_tensor_ref *src = find(&f, sources[i]), *out = find(&f, MOK_SLOT_PACKED_WEIGHT);
    CHECK_EQ_INT(src->dtype, MOK_DTYPE_BF16);
    CHECK_EQ_INT(out->bytes, mok_slot_packed_bytes(&f.layer, sources[i]));
  }
  fixture f;
  quantize_job(&f, 0, MOK_SLOT_W_DOWN);
  CHECK(find(&f, MOK_SLOT_W_DOWN)->shape[1] == 256 && find(&f, MOK_SLOT_W_DOWN)->shape[2] == 128);
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  mok_tensor_ref *out = find(&f, MOK_SLOT_PACKED_WEIGHT), saved = *out;
  out->shape[0]--, out->bytes--;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "packed_weight: dimension 0");
  *out = saved;
  out->dtype = MOK_DTYPE_FP8_E4M3;
  EXPECT_REJECTED(&f, MOK_ESHAPE, "packed_weight: dtype 5, the layer needs dtype 4");
  *out = saved;
  mok_tensor_ref *src = find(&f, MOK_SLOT_W_DOWN), src_saved = *src;
  src->dtype = MOK_DTYPE_U8, src->ndim = 1, src->shape[0] = (uint32_t)saved.bytes;
  src->shape[1] = src->shape[2] = 0, src->bytes = saved.bytes; /* a packed source */
  EXPECT_REJECTED(&f, MOK_ESHAPE, "w_down: dtype 4, the layer needs dtype 2");
  *src = src_saved;
  f.desc.tokens = 3;
  EXPECT_REJECTED(&f, MOK_EINVAL, "quantize_weight works on a weight, it takes 0 tokens");
  f.desc.tokens = 0;
  add(&f, MOK_SLOT_W_UP); /* two sources */
  EXPECT_REJECTED(&f, MOK_EINVAL, "exactly one source weight");
  f.desc.n_tensors--;
  add(&f, MOK_SLOT_S_GATE); /* no shared expert */
  EXPECT_REJECTED(&f, MOK_EINVAL, "s_gate is not an argument of quantize_weight (the layer has no");
  f.desc.n_tensors--;
  add(&f, MOK_SLOT_X);
  EXPECT_REJECTED(&f, MOK_EINVAL, "x is not an argument of quantize_weight");
  f.desc.n_tensors--;
  /* no source at all; no output */
  f.desc.tensors[0] = f.desc.tensors[1];
  f.desc.n_tensors = 1;
  EXPECT_REJECTED(&f, MOK_EINVAL, "exactly one source weight");
  quantize_job(&f, 0, MOK_SLOT_W_GATE);
  f.desc.n_tensors = 1;
  EXPECT_REJECTED(&f, MOK_EINVAL, "quantize_weight needs packed_weight");
  /* on a bf16 layer there is nothing to quantise */
  quantize_job(&f, 0, MOK_SLOT_W_GATE);
  f.layer.dtype = MOK_DTYPE_BF16;
  EXPECT_REJECTED(&f, MOK_EINVAL, "quantize_weight runs on fp8 layers only");
}

/* Its output is checked as every op's: inside this session's regions, and
 * sharing no byte with its input, through any registration. */
static void test_quantize_weight_output_is_isolated(void) {
  fixture f;
  quantize_job(&f, 0, MOK_SLOT_W_UP);
  mok_tensor_ref *src = find(&f, MOK_SLOT_W_UP), *out = find(&f, MOK_SLOT_PACKED_WEIGHT);
  uint64_t src_end = src->offset + src->bytes;
  out->offset = src_end - 1; /* its first byte is the source's last */
  EXPECT_REJECTED(&f, MOK_EINVAL, "output packed_weight overlaps w_up");
  out->offset = src->offset + 4096; /* inside it */
  EXPECT_REJECTED(&f, MOK_EINVAL, "output packed_weight overlaps w_up");
  out->offset = src_end;
  char err[256] = "";
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
  out->region = 2; /* another session's id space: not this session's memory */
  EXPECT_REJECTED(&f, MOK_ENOENT, "packed_weight: region 2 is not registered");
  out->region = 1;
  out->offset = REGION_BYTES - out->bytes + 1; /* past the end of its region */
  EXPECT_REJECTED(&f, MOK_EBOUNDS, "packed_weight: offset");
  /* the same memfd registered again: the overlap is seen through */
  enum { B = 262144 };
  add_aliasing_region(&f, 7, 99, B);
  out->region = 2;
  out->offset = 0;
  src->offset = B + 256;
  EXPECT_REJECTED(&f, MOK_EINVAL, "output packed_weight overlaps w_up: regions 2 and 1");
  src->offset = B + out->bytes;
  CHECK_MSG(check_job(&f, err) == MOK_OK, "%s", err);
}

/* The quantising forward's flag: a forward of an fp8 layer without a group
 * only (a group layer's forward reads packed weights, never masters). */
static void test_quantize_weights_flag_rules(void) {
  fixture f;
  fixture_init_fp8(&f, 0);
  char err[256] = "";
  const uint32_t fl = MOK_JOB_QUANTIZE_WEIGHTS;
  CHECK_MSG(mok_job_check_flags_op(&f.layer, MOK_OP_FORWARD, fl, err, sizeof err) == MOK_OK,
            "%s", err);
  CHECK_EQ_INT(mok_job_check_flags_op(&f.layer, MOK_OP_BACKWARD, fl, err, sizeof err),
               MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "only valid on forward");
  f.layer.group_id = 3;
  CHECK_EQ_INT(mok_job_check_flags_op(&f.layer, MOK_OP_FORWARD, fl, err, sizeof err),
               MOK_EUNSUPPORTED);
  CHECK_STR_CONTAINS(err, "layers without a group");
  CHECK_MSG(mok_job_check_flags_op(&f.layer, MOK_OP_FORWARD, 0, err, sizeof err) == MOK_OK,
            "%s", err);
  f.layer.group_id = 0;
  f.layer.dtype = MOK_DTYPE_BF16;
  CHECK_EQ_INT(mok_job_check_flags_op(&f.layer, MOK_OP_FORWARD, fl, err, sizeof err),
               MOK_EINVAL);
  CHECK_STR_CONTAINS(err, "needs an fp8 layer");
}

static const check_case cases[] = {
    CHECK_CASE(test_a_good_forward_resolves_every_tensor),
    CHECK_CASE(test_references_outside_the_session_fail),
    CHECK_CASE(test_bounds_are_overflow_safe),
    CHECK_CASE(test_dtype_shape_and_size_must_match_the_layer),
    CHECK_CASE(test_slots_required_forbidden_and_unique),
    CHECK_CASE(test_shared_expert_weights_are_required_when_configured),
    CHECK_CASE(test_outputs_may_not_overlap_other_tensors),
    CHECK_CASE(test_one_memfd_registered_twice_is_seen_through),
    CHECK_CASE(test_backings_differ_by_either_half_of_their_identity),
    CHECK_CASE(test_unknown_backings_only_alias_themselves),
    CHECK_CASE(test_huge_backing_offsets_do_not_wrap),
    CHECK_CASE(test_header_fields_are_checked),
    CHECK_CASE(test_nop_takes_nothing),
    CHECK_CASE(test_recompute_needs_routing_ids),
    CHECK_CASE(test_every_op_accepts_exactly_its_required_slots),
    CHECK_CASE(test_fp8_layers_need_whole_blocks),
    CHECK_CASE(test_fp8_jobs_take_packed_weights),
    CHECK_CASE(test_fp8_backward_gradients_stay_bf16),
    CHECK_CASE(test_quantize_weight_takes_one_bf16_source_and_its_packed_size),
    CHECK_CASE(test_quantize_weight_output_is_isolated),
    CHECK_CASE(test_quantize_weights_flag_rules),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
