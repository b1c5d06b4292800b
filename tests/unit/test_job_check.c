/* Job descriptor validation: every reference checked before any engine work. */
#include <stdint.h>

#include "check.h"
#include "job_check.h"

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

/* Append the tensor the layer expects in slot, at the next free offset. */
static mok_tensor_ref *add(fixture *f, uint32_t slot) {
  uint32_t dt, nd;
  uint64_t shape[MOK_MAX_DIMS];
  mok_job_slot_shape(&f->layer, f->desc.tokens, slot, &dt, &nd, shape);
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
  /* build each op's minimal job from the table itself and check it passes */
  for (uint32_t shared = 0; shared <= 4; shared += 4) {
    for (uint32_t op = 1; op < MOK_OP_COUNT_; op++) {
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

static const check_case cases[] = {
    CHECK_CASE(test_a_good_forward_resolves_every_tensor),
    CHECK_CASE(test_references_outside_the_session_fail),
    CHECK_CASE(test_bounds_are_overflow_safe),
    CHECK_CASE(test_dtype_shape_and_size_must_match_the_layer),
    CHECK_CASE(test_slots_required_forbidden_and_unique),
    CHECK_CASE(test_shared_expert_weights_are_required_when_configured),
    CHECK_CASE(test_outputs_may_not_overlap_other_tensors),
    CHECK_CASE(test_header_fields_are_checked),
    CHECK_CASE(test_nop_takes_nothing),
    CHECK_CASE(test_recompute_needs_routing_ids),
    CHECK_CASE(test_every_op_accepts_exactly_its_required_slots),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
