/* SPDX-License-Identifier: Apache-2.0 */
/* Integration: a real mokd, driven through libmok and through raw sockets.
 *
 * Each test starts its own mokd (cpu engine) on a private socket, so a test
 * that breaks the daemon cannot hide behind another. Bad input of every
 * kind must get a clear error and cost nothing to anyone else.
 */
#include <fcntl.h>
#include <math.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>

#include "harness/check.h"
#include "frame.h"
#include "harness/daemon.h"
#include "internal.h"
#include "rpc.h"
#include "mok.h"
#include "mok.pb-c.h"
#include "ref64.h"

/* The daemon under test and raw sockets to it: tests/harness/daemon.h. */

/* ---- raw protocol helpers ---- */

static void send_request(int fd, const Mok__Request *req) {
  uint8_t buf[4096];
  size_t n = mok__request__pack(req, buf);
  CHECK_EQ_INT(mok_frame_send(fd, 1, buf, n, NULL, 0), 0);
}

static void send_hello(int fd, uint32_t version) {
  Mok__Hello h = MOK__HELLO__INIT;
  h.protocol_version = version;
  h.client_name = "raw-test";
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_HELLO;
  req.hello = &h;
  send_request(fd, &req);
}

/* After a protocol error the daemon closes the connection. */
static void expect_closed(int fd) {
  uint8_t buf[64];
  mok_frame f;
  CHECK_EQ_INT(mok_frame_recv(fd, buf, sizeof buf, 32, 0, &f), 1);
  close(fd);
}

/* ---- a small layer and its data ---- */

typedef struct problem {
  mok_layer_desc desc;
  uint32_t T;
  float *x, *rw, *wg, *wu, *wd, *out, *d_out, *d_x, *d_rw, *d_wg, *d_wu, *d_wd;
  int32_t *ids;
  void *ctx;
} problem;

static float frand(unsigned *s) {
  *s = *s * 1103515245u + 12345u;
  return ((float)((*s >> 8) & 0xffff) / 65536.0f - 0.5f);
}

static void *alloc_in(mok_client *c, size_t bytes) {
  void *p = mok_host_alloc(c, bytes);
  CHECK_MSG(p != NULL, "mok_host_alloc: %s", mok_last_error());
  return p;
}

static void problem_init(problem *p, mok_client *c, uint32_t T, unsigned seed) {
  memset(p, 0, sizeof *p);
  p->desc = (mok_layer_desc){.hidden = 32, .intermediate = 16, .experts = 6, .topk = 2,
                             .max_tokens = 64, .dtype = MOK_DTYPE_F32};
  p->T = T;
  uint32_t H = 32, I = 16, E = 6, K = 2;
  p->x = alloc_in(c, 4ull * T * H);
  p->ids = alloc_in(c, 4ull * T * K);
  p->rw = alloc_in(c, 4ull * T * K);
  p->wg = alloc_in(c, 4ull * E * I * H);
  p->wu = alloc_in(c, 4ull * E * I * H);
  p->wd = alloc_in(c, 4ull * E * H * I);
  p->out = alloc_in(c, 4ull * T * H);
  p->d_out = alloc_in(c, 4ull * T * H);
  p->d_x = alloc_in(c, 4ull * T * H);
  p->d_rw = alloc_in(c, 4ull * T * K);
  p->d_wg = alloc_in(c, 4ull * E * I * H);
  p->d_wu = alloc_in(c, 4ull * E * I * H);
  p->d_wd = alloc_in(c, 4ull * E * H * I);
  unsigned s = seed;
  for (uint32_t i = 0; i < T * H; i++) p->x[i] = frand(&s), p->d_out[i] = frand(&s);
  for (uint32_t i = 0; i < E * I * H; i++) p->wg[i] = frand(&s), p->wu[i] = frand(&s), p->wd[i] = frand(&s);
  for (uint32_t t = 0; t < T; t++) {
    p->ids[t * K] = (int32_t)((t + seed) % E);
    p->ids[t * K + 1] = (t % 5 == 0) ? -1 : (int32_t)((t * 7 + 3 + seed) % E);
    if (p->ids[t * K + 1] == p->ids[t * K]) p->ids[t * K + 1] = (p->ids[t * K] + 1) % (int32_t)E;
    p->rw[t * K] = 0.6f + frand(&s) * 0.2f;
    p->rw[t * K + 1] = 0.4f + frand(&s) * 0.2f;
  }
}

static double *to_f64(const float *v, size_t n) {
  double *d = malloc(n * sizeof *d);
  for (size_t i = 0; i < n; i++) d[i] = v[i];
  return d;
}

static double rel_err_f32(const double *ref, const float *got, size_t n) {
  double *g = to_f64(got, n);
  double e = ref64_rel_err(ref, g, n);
  free(g);
  return e;
}

/* Run forward and backward through the daemon; check against ref64. */
static void run_and_check(mok_client *c, problem *p) {
  mok_layer *l;
  CHECK_MSG(mok_layer_create(c, &p->desc, &l) == MOK_OK, "%s", mok_last_error());
  uint32_t T = p->T, H = 32, I = 16, E = 6, K = 2;
  p->ctx = alloc_in(c, mok_layer_ctx_bytes(l, T));
  for (uint32_t i = 0; i < T * H; i++) p->out[i] = NAN, p->d_x[i] = NAN;
  mok_forward_args fa = {.x = p->x, .w_gate = p->wg, .w_up = p->wu, .w_down = p->wd,
                         .topk_ids = p->ids, .router_weights = p->rw, .out = p->out,
                         .ctx = p->ctx};
  uint64_t t;
  CHECK_MSG(mok_forward(l, T, &fa, &t) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(mok_wait(c, t, 10000) == MOK_OK, "forward: %s", mok_last_error());
  mok_backward_args ba = {.x = p->x, .w_gate = p->wg, .w_up = p->wu, .w_down = p->wd,
                          .d_out = p->d_out, .router_weights = p->rw, .ctx = p->ctx,
                          .d_x = p->d_x, .d_w_gate = p->d_wg, .d_w_up = p->d_wu,
                          .d_w_down = p->d_wd, .d_router_weights = p->d_rw};
  CHECK_MSG(mok_backward(l, T, 0, &ba, &t) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(mok_wait(c, t, 10000) == MOK_OK, "backward: %s", mok_last_error());

  ref64_layer L = {.T = (int)T, .H = (int)H, .I = (int)I, .E = (int)E, .E_loc = (int)E,
                   .K = (int)K};
  double *x = to_f64(p->x, T * H), *rw = to_f64(p->rw, T * K), *wg = to_f64(p->wg, E * I * H),
         *wu = to_f64(p->wu, E * I * H), *wd = to_f64(p->wd, E * H * I),
         *dout = to_f64(p->d_out, T * H);
  ref64_inputs in = {.x = x, .rw = rw, .wg = wg, .wu = wu, .wd = wd, .ids = p->ids};
  double *out = malloc(8ull * T * H), *dx = malloc(8ull * T * H), *drw = malloc(8ull * T * K),
         *dwg = malloc(8ull * E * I * H), *dwu = malloc(8ull * E * I * H),
         *dwd = malloc(8ull * E * H * I);
  ref64_forward(&L, &in, out);
  ref64_backward(&L, &in, dout, dx, drw, dwg, dwu, dwd, NULL, NULL, NULL);
  CHECK_MSG(rel_err_f32(out, p->out, T * H) < 1e-5, "out error %g", rel_err_f32(out, p->out, T * H));
  CHECK_MSG(rel_err_f32(dx, p->d_x, T * H) < 1e-5, "d_x error");
  CHECK_MSG(rel_err_f32(drw, p->d_rw, T * K) < 1e-5, "d_rw error");
  CHECK_MSG(rel_err_f32(dwg, p->d_wg, E * I * H) < 1e-5, "d_w_gate error");
  CHECK_MSG(rel_err_f32(dwu, p->d_wu, E * I * H) < 1e-5, "d_w_up error");
  CHECK_MSG(rel_err_f32(dwd, p->d_wd, E * H * I) < 1e-5, "d_w_down error");
  free(x), free(rw), free(wg), free(wu), free(wd), free(dout);
  free(out), free(dx), free(drw), free(dwg), free(dwu), free(dwd);
  mok_layer_destroy(l);
}

/* ---- tests ---- */

static void test_forward_backward_match_the_reference(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK_MSG(mok_connect(d.sock, "test", &c) == MOK_OK, "%s", mok_last_error());
  CHECK(strcmp(mok_client_engine(c), "cpu") == 0);
  problem p;
  problem_init(&p, c, 37, 1); /* odd T */
  run_and_check(c, &p);
  mok_daemon_stats st;
  CHECK(mok_stats(c, &st) == MOK_OK);
  CHECK_EQ_INT(st.jobs_done, 2);
  CHECK_EQ_INT(st.jobs_failed, 0);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
  struct stat sb;
  CHECK_MSG(stat(d.sock, &sb) < 0, "the socket was left behind");
}

static void test_many_nops_round_trip(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "nops", &c) == MOK_OK);
  uint64_t tickets[MOK_RING_ENTRIES];
  for (int round = 0; round < 50; round++) {
    for (uint32_t i = 0; i < MOK_RING_ENTRIES; i++) CHECK(mok_submit_nop(c, &tickets[i]) == MOK_OK);
    uint64_t extra;
    CHECK_EQ_INT(mok_submit_nop(c, &extra), MOK_EBUSY); /* ring full of un-waited jobs */
    for (uint32_t i = 0; i < MOK_RING_ENTRIES; i++) CHECK(mok_wait(c, tickets[i], 5000) == MOK_OK);
  }
  CHECK_EQ_INT(mok_wait(c, tickets[0], 0), MOK_ENOENT); /* already collected */
  mok_daemon_stats st;
  CHECK(mok_stats(c, &st) == MOK_OK);
  CHECK_EQ_INT(st.jobs_done, 50 * MOK_RING_ENTRIES);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

typedef struct raw_case {
  const char *name;
  void (*send)(int fd);
  int status;
  const char *needle;
} raw_case;

static void send_garbage(int fd) { CHECK(send(fd, "\x01\x02\x03\x04garbage-bytes!!", 20, 0) == 20); }
static void send_oversized(int fd) {
  static uint8_t big[8192];
  CHECK_EQ_INT(mok_frame_send(fd, 1, big, sizeof big, NULL, 0), 0);
}
static void send_unknown_message(int fd) {
  /* field 99, varint 1: a message this daemon does not know */
  uint8_t pb[] = {0x98, 0x06, 0x01};
  CHECK_EQ_INT(mok_frame_send(fd, 1, pb, sizeof pb, NULL, 0), 0);
}
static void send_bad_protobuf(int fd) {
  uint8_t pb[] = {0x0a, 0x7f, 0x01}; /* field 1, length 127, 1 byte present */
  CHECK_EQ_INT(mok_frame_send(fd, 1, pb, sizeof pb, NULL, 0), 0);
}
static void send_stats_first(int fd) {
  Mok__Stats s = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &s;
  send_request(fd, &req);
}
static void send_old_hello(int fd) { send_hello(fd, MOK_PROTOCOL_VERSION + 7); }
static void send_other_frame_version(int fd) {
  mok_frame_header h = {.magic = MOK_FRAME_MAGIC, .version = 9, .length = 0};
  CHECK(send(fd, &h, sizeof h, 0) == sizeof h);
}
static void send_hello_with_fd(int fd) {
  Mok__Hello h = MOK__HELLO__INIT;
  h.protocol_version = MOK_PROTOCOL_VERSION;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_HELLO;
  req.hello = &h;
  uint8_t buf[256];
  size_t n = mok__request__pack(&req, buf);
  int devnull = open("/dev/null", O_RDONLY);
  CHECK_EQ_INT(mok_frame_send(fd, 1, buf, n, &devnull, 1), 0);
  close(devnull);
}

static void test_malformed_frames_close_only_their_session(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *bystander;
  CHECK(mok_connect(d.sock, "bystander", &bystander) == MOK_OK);
  problem p;
  problem_init(&p, bystander, 16, 2);
  const raw_case cases[] = {
      {"garbage", send_garbage, MOK_EPROTO, "malformed frame"},
      {"oversized", send_oversized, MOK_EPROTO, "larger than 4096 bytes"},
      {"unknown message", send_unknown_message, MOK_EPROTO, "unknown message"},
      {"bad protobuf", send_bad_protobuf, MOK_EPROTO, "protobuf decoding failed"},
      {"request before hello", send_stats_first, MOK_EPROTO, "first message must be Hello"},
      {"protocol version", send_old_hello, MOK_EVERSION, "client speaks protocol 8"},
      {"frame version", send_other_frame_version, MOK_EVERSION, "another protocol version"},
      {"fd with hello", send_hello_with_fd, MOK_EPROTO, "takes none"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int fd = harness_raw_connect(d.sock);
    cases[i].send(fd);
    char msg[512];
    int st = harness_read_reply(fd, msg, sizeof msg);
    CHECK_MSG(st == cases[i].status, "%s: status %d (%s)", cases[i].name, st, msg);
    CHECK_MSG(strstr(msg, cases[i].needle), "%s: message \"%s\"", cases[i].name, msg);
    expect_closed(fd);
  }
  CHECK(harness_alive(&d));
  run_and_check(bystander, &p); /* the earlier session lost nothing */
  mok_close(bystander);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_handshake_timeout_and_second_hello(void) {
  daemon_proc d = harness_start("hello-timeout-ms = 200\n");
  int fd = harness_raw_connect(d.sock);
  char msg[512];
  CHECK_EQ_INT(harness_read_reply(fd, msg, sizeof msg), MOK_ETIMEOUT);
  CHECK_STR_CONTAINS(msg, "no Hello");
  expect_closed(fd);
  fd = harness_raw_connect(d.sock);
  send_hello(fd, MOK_PROTOCOL_VERSION);
  CHECK_EQ_INT(harness_read_reply(fd, msg, sizeof msg), MOK_OK);
  send_hello(fd, MOK_PROTOCOL_VERSION);
  CHECK_EQ_INT(harness_read_reply(fd, msg, sizeof msg), MOK_EPROTO);
  CHECK_STR_CONTAINS(msg, "Hello sent twice");
  expect_closed(fd);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* A descriptor for forward naming p's tensors, for corrupting. */
static void forward_desc(mok_layer *l, problem *p, mok_job_desc *desc) {
  mok_client *c = l->client;
  mok_tensor t[MOK_SLOT_COUNT_];
  memset(t, 0, sizeof t);
  const void *ptrs[][2] = {{(void *)(uintptr_t)MOK_SLOT_X, p->x},
                           {(void *)(uintptr_t)MOK_SLOT_TOPK_IDS, p->ids},
                           {(void *)(uintptr_t)MOK_SLOT_ROUTER_W, p->rw},
                           {(void *)(uintptr_t)MOK_SLOT_W_GATE, p->wg},
                           {(void *)(uintptr_t)MOK_SLOT_W_UP, p->wu},
                           {(void *)(uintptr_t)MOK_SLOT_W_DOWN, p->wd},
                           {(void *)(uintptr_t)MOK_SLOT_OUT, p->out}};
  memset(desc, 0, sizeof *desc);
  desc->version = MOK_JOB_VERSION;
  desc->op = MOK_OP_FORWARD;
  desc->layer = l->id;
  desc->tokens = p->T;
  for (size_t i = 0; i < sizeof ptrs / sizeof ptrs[0]; i++) {
    uint32_t slot = (uint32_t)(uintptr_t)ptrs[i][0];
    mok_tensor mt = mok_tensor_for(l, p->T, slot, ptrs[i][1]);
    uint64_t bytes = mok_dtype_size(mt.dtype);
    for (uint32_t k = 0; k < mt.ndim; k++) bytes *= mt.shape[k];
    const host_region *hr = mok_find_region(c, ptrs[i][1], bytes);
    CHECK(hr != NULL);
    mok_tensor_ref *r = &desc->tensors[desc->n_tensors++];
    r->region = hr->id;
    r->slot = (uint16_t)slot;
    r->dtype = (uint8_t)mt.dtype;
    r->ndim = (uint8_t)mt.ndim;
    r->offset = (uint64_t)((const char *)ptrs[i][1] - (const char *)hr->ptr);
    r->bytes = bytes;
    for (uint32_t k = 0; k < mt.ndim; k++) r->shape[k] = (uint32_t)mt.shape[k];
  }
}

static int submit_and_wait(mok_client *c, mok_job_desc *desc) {
  uint64_t t;
  CHECK(mok_submit_desc(c, desc, &t) == MOK_OK);
  return mok_wait(c, t, 10000);
}

static void test_bad_descriptors_fail_only_their_job(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c, *other;
  CHECK(mok_connect(d.sock, "victim", &other) == MOK_OK);
  CHECK(mok_connect(d.sock, "attacker", &c) == MOK_OK);
  problem po, p;
  problem_init(&po, other, 24, 3);
  problem_init(&p, c, 24, 4);
  /* the other client's region ids, from its own id space */
  uint32_t foreign = mok_find_region(other, po.x, 4)->id + 100;
  mok_layer *l;
  CHECK(mok_layer_create(c, &p.desc, &l) == MOK_OK);
  mok_job_desc good, bad;
  forward_desc(l, &p, &good);
  CHECK_MSG(submit_and_wait(c, &good) == MOK_OK, "%s", mok_last_error());

  bad = good;
  bad.tensors[0].offset = 1ull << 40; /* out of bounds */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EBOUNDS);
  CHECK_STR_CONTAINS(mok_last_error(), "outside region");
  bad = good;
  bad.tensors[0].shape[1] = 31; /* wrong shape */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ESHAPE);
  CHECK_STR_CONTAINS(mok_last_error(), "x: dimension 1 is 31, expected 32");
  bad = good;
  bad.tensors[0].region = foreign; /* a region this session never registered */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ENOENT);
  CHECK_STR_CONTAINS(mok_last_error(), "not registered by this session");
  bad = good;
  bad.layer = 999;
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ENOENT);
  bad = good;
  bad.op = 250;
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EINVAL);
  p.ids[5] = 6; /* expert id == E */
  CHECK_EQ_INT(submit_and_wait(c, &good), MOK_EROUTE);
  CHECK_STR_CONTAINS(mok_last_error(), "6");
  p.ids[5] = -7; /* below -1 */
  CHECK_EQ_INT(submit_and_wait(c, &good), MOK_EROUTE);
  p.ids[5] = 1;
  CHECK_MSG(submit_and_wait(c, &good) == MOK_OK, "%s", mok_last_error()); /* still served */

  run_and_check(other, &po); /* the other tenant never noticed */
  mok_daemon_stats st;
  CHECK(mok_stats(other, &st) == MOK_OK);
  CHECK_EQ_INT(st.jobs_failed, 7);
  mok_close(c);
  mok_close(other);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* fp8 layers through mokd (docs/math.md, "FP8"): a quantize_weight job
 * writes only memory its own session registered, never over its input, and
 * every malformed one fails alone; the other tenant's packed weight stays
 * as its own job wrote it. */
static void test_fp8_quantize_weight_fails_alone_and_writes_only_its_own(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c, *other;
  CHECK(mok_connect(d.sock, "victim", &other) == MOK_OK);
  CHECK(mok_connect(d.sock, "attacker", &c) == MOK_OK);
  mok_layer_desc ld = {.hidden = 7000, .intermediate = 128, .experts = 2, .topk = 1,
                       .max_tokens = 8, .dtype = MOK_DTYPE_FP8_E4M3};
  mok_layer *l, *lo;
  CHECK_EQ_INT(mok_layer_create(c, &ld, &l), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "hidden = 7000 is not a multiple of 128");
  ld.hidden = 128;
  CHECK_MSG(mok_layer_create(c, &ld, &l) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(mok_layer_create(other, &ld, &lo) == MOK_OK, "%s", mok_last_error());
  const uint64_t n = 2ull * 128 * 128, pb = mok_layer_packed_weight_bytes(l, MOK_SLOT_W_GATE);
  CHECK_EQ_INT(pb, 2 * n + 4 * 2); /* e4m3 bytes, their transpose, scales */
  CHECK_EQ_INT(mok_layer_packed_weight_bytes(l, MOK_SLOT_S_GATE), 0); /* no shared expert */

  /* the victim's weight and its packed form */
  uint16_t *wv = alloc_in(other, 2 * n);
  uint8_t *pv = alloc_in(other, pb);
  unsigned seed = 5;
  for (uint64_t i = 0; i < n; i++) wv[i] = (uint16_t)(0x3c00u + (frand(&seed) > 0 ? 0x8000u : 0) +
                                                    (uint16_t)(seed >> 20 & 0x1ffu));
  uint64_t t;
  CHECK_MSG(mok_quantize_weight(lo, MOK_SLOT_W_GATE, wv, pv, &t) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(mok_wait(other, t, 10000) == MOK_OK, "%s", mok_last_error());
  uint8_t *saved = malloc(pb);
  memcpy(saved, pv, pb);

  /* the attacker's: master at 0, packed right after it, in one region */
  char *mem = alloc_in(c, 2 * n + pb + 4096);
  memcpy(mem, wv, 2 * n);
  CHECK_MSG(mok_quantize_weight(l, MOK_SLOT_W_GATE, mem, mem + 2 * n, &t) == MOK_OK, "%s",
            mok_last_error());
  CHECK_MSG(mok_wait(c, t, 10000) == MOK_OK, "%s", mok_last_error());
  CHECK(memcmp(mem + 2 * n, saved, pb) == 0); /* the same bytes for the same weight */
  CHECK_EQ_INT(mok_quantize_weight(l, MOK_SLOT_X, mem, mem + 2 * n, &t), MOK_EINVAL);

  mok_job_desc good = {.version = MOK_JOB_VERSION, .op = MOK_OP_QUANTIZE_WEIGHT, .layer = l->id,
                       .n_tensors = 2};
  uint32_t region = mok_find_region(c, mem, 4)->id;
  good.tensors[0] = (mok_tensor_ref){.region = region, .slot = MOK_SLOT_W_GATE,
                                     .dtype = MOK_DTYPE_BF16, .ndim = 3, .offset = 0,
                                     .bytes = 2 * n, .shape = {2, 128, 128}};
  good.tensors[1] = (mok_tensor_ref){.region = region, .slot = MOK_SLOT_PACKED_WEIGHT,
                                     .dtype = MOK_DTYPE_U8, .ndim = 1, .offset = 2 * n,
                                     .bytes = pb, .shape = {(uint32_t)pb}};
  CHECK_MSG(submit_and_wait(c, &good) == MOK_OK, "%s", mok_last_error());
  mok_job_desc bad = good;
  bad.tensors[1].region = mok_find_region(other, pv, 4)->id + 100; /* not this session's */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ENOENT);
  CHECK_STR_CONTAINS(mok_last_error(), "packed_weight: region");
  bad = good;
  bad.tensors[1].offset = 1ull << 40; /* past its region's end */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EBOUNDS);
  bad = good;
  bad.tensors[1].offset = 2 * n - 2; /* over the source's last element */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "output packed_weight overlaps w_gate");
  bad = good;
  bad.tensors[1].bytes--, bad.tensors[1].shape[0]--; /* one byte short */
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ESHAPE);
  bad = good;
  bad.tensors[0].dtype = MOK_DTYPE_U8, bad.tensors[0].ndim = 1; /* a packed source */
  bad.tensors[0].shape[0] = (uint32_t)(2 * n), bad.tensors[0].shape[1] = 0;
  bad.tensors[0].shape[2] = 0;
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_ESHAPE);
  bad = good;
  bad.tokens = 8;
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EINVAL);
  bad = good;
  bad.tensors[0].slot = MOK_SLOT_S_GATE;
  CHECK_EQ_INT(submit_and_wait(c, &bad), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "the layer has no shared expert");
  CHECK_MSG(submit_and_wait(c, &good) == MOK_OK, "%s", mok_last_error()); /* still served */

  CHECK(memcmp(pv, saved, pb) == 0); /* the victim's packed weight is untouched */
  CHECK_MSG(mok_quantize_weight(lo, MOK_SLOT_W_GATE, wv, pv, &t) == MOK_OK, "%s",
            mok_last_error());
  CHECK_MSG(mok_wait(other, t, 10000) == MOK_OK, "%s", mok_last_error());
  free(saved);
  mok_close(c);
  mok_close(other);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* A failed job's message longer than a completion's 96 bytes reaches the
 * client whole (the message area beside the ring), at every ring index,
 * and a client scribbling over that area changes nothing in the daemon. */
static void test_a_failed_jobs_whole_message_reaches_the_client(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "long-messages", &c) == MOK_OK);
  problem p;
  problem_init(&p, c, 24, 4);
  mok_layer *l;
  CHECK(mok_layer_create(c, &p.desc, &l) == MOK_OK);
  mok_job_desc good, bad;
  forward_desc(l, &p, &good);
  const mok_tensor_ref *wd = &good.tensors[5];
  CHECK_EQ_INT(wd->slot, MOK_SLOT_W_DOWN);
  CHECK_EQ_INT(wd->ndim, 3);
  char *area = (char *)c->shm + MOK_SHM_MSG_OFFSET;
  /* past the ring's 64 entries, so every index of the area is used, each
   * with its own text; the area is scribbled over between rounds */
  for (int round = 0; round < 3; round++) {
    memset(area, 0xa5, MOK_RING_ENTRIES * MOK_JOB_MESSAGE_MAX); /* no NUL anywhere */
    uint64_t tickets[40];
    for (uint32_t i = 0; i < 40; i++) {
      bad = good;
      bad.tensors[5].shape[1] = 4000000000u - (uint32_t)round * 100u - i;
      CHECK(mok_submit_desc(c, &bad, &tickets[i]) == MOK_OK);
    }
    for (uint32_t i = 0; i < 40; i++) {
      CHECK_EQ_INT(mok_wait(c, tickets[i], 10000), MOK_ESHAPE);
      char want[MOK_JOB_MESSAGE_MAX];
      snprintf(want, sizeof want,
               "w_down: dimension 1 is %u, expected %u (shape [%u, %u, %u]; a forward job of "
               "%u tokens on this layer needs [%u, %u, %u])",
               4000000000u - (uint32_t)round * 100u - i, wd->shape[1], wd->shape[0],
               4000000000u - (uint32_t)round * 100u - i, wd->shape[2], good.tokens,
               wd->shape[0], wd->shape[1], wd->shape[2]);
      CHECK_MSG(strlen(want) > MOK_COMPLETION_MSG, "the test's message is short: %s", want);
      CHECK_MSG(strcmp(mok_last_error(), want) == 0, "round %d job %u: \"%s\", wanted \"%s\"",
                round, i, mok_last_error(), want);
    }
  }
  CHECK_MSG(submit_and_wait(c, &good) == MOK_OK, "%s", mok_last_error()); /* still served */
  CHECK(harness_alive(&d));
  mok_daemon_stats st;
  CHECK(mok_stats(c, &st) == MOK_OK);
  CHECK_EQ_INT(st.jobs_failed, 120);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_unsealed_memfd_and_quota_are_refused(void) {
  daemon_proc d = harness_start("max-region-bytes = 1048576\nmax-regions = 3\n");
  mok_client *c;
  CHECK(mok_connect(d.sock, "quota", &c) == MOK_OK);
  /* an unsealed memfd could be truncated under the daemon */
  int fd = memfd_create("unsealed", MFD_CLOEXEC);
  CHECK(ftruncate(fd, 4096) == 0);
  Mok__RegisterBuffer rb = MOK__REGISTER_BUFFER__INIT;
  rb.kind = MOK__BUFFER_KIND__BUFFER_HOST_MEMFD;
  rb.bytes = 4096;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_REGISTER_BUFFER;
  req.register_buffer = &rb;
  Mok__Reply *rep = NULL;
  CHECK_EQ_INT(mok_rpc(c, &req, &fd, 1, &rep, NULL, NULL), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "F_SEAL_SHRINK");
  rb.bytes = 8192; /* larger than the memfd */
  CHECK_EQ_INT(mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "takes 1 fd");
  close(fd);
  CHECK(mok_host_alloc(c, 2u << 20) == NULL); /* over the byte quota */
  CHECK_STR_CONTAINS(mok_last_error(), "quota");
  void *a = mok_host_alloc(c, 4096), *b = mok_host_alloc(c, 4096), *e = mok_host_alloc(c, 4096);
  CHECK(a && b && e);
  CHECK(mok_host_alloc(c, 4096) == NULL); /* over the region count */
  CHECK_STR_CONTAINS(mok_last_error(), "limit 3");
  CHECK(mok_host_free(c, b) == MOK_OK);
  CHECK(mok_host_alloc(c, 4096) != NULL); /* freed room is reusable */
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

/* JoinGroup's nccl_id is empty or an NCCL unique id (128 bytes), nothing else. */
static void test_join_group_with_a_malformed_nccl_id(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "nccl-id", &c) == MOK_OK);
  uint8_t id[200] = {1, 2, 3};
  Mok__JoinGroup jg = MOK__JOIN_GROUP__INIT;
  jg.group_key = "bad-id";
  jg.world = 2;
  jg.max_tokens = 8, jg.hidden = 8, jg.topk = 1, jg.experts = 2;
  jg.dtype = MOK__DTYPE__DTYPE_BF16;
  jg.nccl_id.data = id;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_JOIN_GROUP;
  req.join_group = &jg;
  const size_t lens[] = {1, 127, 129, 200};
  for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
    jg.nccl_id.len = lens[i];
    Mok__Reply *rep = NULL;
    CHECK_EQ_INT(mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL), MOK_EINVAL);
    CHECK_STR_CONTAINS(mok_last_error(), "nccl_id must be empty or 128 bytes");
  }
  /* the session is still usable */
  problem p;
  problem_init(&p, c, 16, 3);
  mok_layer *l;
  CHECK(mok_layer_create(c, &p.desc, &l) == MOK_OK);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_a_killed_client_loses_only_its_session(void) {
  daemon_proc d = harness_start(NULL);
  for (int round = 0; round < 3; round++) {
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
      mok_client *c;
      if (mok_connect(d.sock, "doomed", &c) != MOK_OK) _exit(2);
      problem p;
      problem_init(&p, c, 64, 9);
      mok_layer *l;
      if (mok_layer_create(c, &p.desc, &l) != MOK_OK) _exit(3);
      mok_forward_args fa = {.x = p.x, .w_gate = p.wg, .w_up = p.wu, .w_down = p.wd,
                             .topk_ids = p.ids, .router_weights = p.rw, .out = p.out};
      uint64_t t;
      for (int i = 0; i < 32; i++) mok_forward(l, 64, &fa, &t); /* queue, never wait */
      kill(getpid(), SIGKILL);
    }
    int st;
    waitpid(child, &st, 0);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
  }
  CHECK(harness_alive(&d));
  mok_client *c;
  CHECK(mok_connect(d.sock, "survivor", &c) == MOK_OK);
  problem p;
  problem_init(&p, c, 33, 5);
  run_and_check(c, &p);
  mok_daemon_stats st;
  for (int i = 0; i < 100; i++) { /* the dead sessions go once the engine releases them */
    CHECK(mok_stats(c, &st) == MOK_OK);
    if (st.sessions_now == 1) break;
    usleep(20000);
  }
  CHECK_EQ_INT(st.sessions_now, 1);
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_concurrent_clients_each_get_their_results(void) {
  daemon_proc d = harness_start(NULL);
  enum { CLIENTS = 4 };
  pid_t kids[CLIENTS];
  for (int k = 0; k < CLIENTS; k++) {
    kids[k] = fork();
    CHECK(kids[k] >= 0);
    if (kids[k] == 0) {
      mok_client *c;
      CHECK(mok_connect(d.sock, "concurrent", &c) == MOK_OK);
      for (int j = 0; j < 5; j++) {
        problem p;
        problem_init(&p, c, 16 + (uint32_t)k * 7 + (uint32_t)j, 100 + (unsigned)(k * 10 + j));
        run_and_check(c, &p);
      }
      mok_close(c);
      _exit(0);
    }
  }
  for (int k = 0; k < CLIENTS; k++) {
    int st;
    waitpid(kids[k], &st, 0);
    CHECK_MSG(WIFEXITED(st) && WEXITSTATUS(st) == 0, "client %d failed", k);
  }
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static void test_shutdown_drains_and_refuses_a_second_daemon(void) {
  daemon_proc d = harness_start(NULL);
  /* a second daemon on the same live socket must refuse, not steal it */
  char bin[256];
  snprintf(bin, sizeof bin, "%s/bin/mokd", harness_build_dir());
  pid_t pid = fork();
  if (pid == 0) {
    int nul = open("/dev/null", O_WRONLY);
    dup2(nul, 2);
    execl(bin, "mokd", "--socket", d.sock, "--engine", "cpu", (char *)NULL);
    _exit(127);
  }
  int st;
  waitpid(pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) != 0);
  CHECK(harness_can_connect(d.sock));
  mok_client *c;
  CHECK(mok_connect(d.sock, "drain", &c) == MOK_OK);
  problem p;
  problem_init(&p, c, 64, 6);
  mok_layer *l;
  CHECK(mok_layer_create(c, &p.desc, &l) == MOK_OK);
  mok_forward_args fa = {.x = p.x, .w_gate = p.wg, .w_up = p.wu, .w_down = p.wd,
                         .topk_ids = p.ids, .router_weights = p.rw, .out = p.out};
  uint64_t t[16];
  for (int i = 0; i < 16; i++) CHECK(mok_forward(l, 64, &fa, &t[i]) == MOK_OK);
  kill(d.pid, SIGTERM); /* queued jobs still run */
  for (int i = 0; i < 16; i++) CHECK_MSG(mok_wait(c, t[i], 10000) == MOK_OK, "job %d: %s", i, mok_last_error());
  waitpid(d.pid, &st, 0);
  CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
  CHECK(!harness_can_connect(d.sock));
  uint64_t t2;
  int r = mok_submit_nop(c, &t2);
  if (r == MOK_OK) r = mok_wait(c, t2, 2000);
  CHECK_EQ_INT(r, MOK_ECLOSED); /* the client learns the daemon is gone */
  mok_close(c);
}

/* CPU seconds the process has used (utime + stime from /proc). */
static double cpu_seconds(pid_t pid) {
  char path[64], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  CHECK(f != NULL);
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the name may hold spaces */
  unsigned long long ut = 0, st = 0;
  CHECK(p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2);
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

static void test_a_client_that_never_drains_costs_no_cpu(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "hoarder", &c) == MOK_OK);
  uint64_t t;
  for (uint32_t i = 0; i < MOK_RING_ENTRIES; i++) CHECK(mok_submit_nop(c, &t) == MOK_OK);
  usleep(200000); /* the completion ring is now full and never drained */
  /* go past libmok's own limit, as a hostile client would: more submissions wait */
  c->outstanding = 0;
  for (int i = 0; i < 8; i++) CHECK(mok_submit_nop(c, &t) == MOK_OK);
  usleep(300000);
  double before = cpu_seconds(d.pid);
  usleep(1000000);
  double used = cpu_seconds(d.pid) - before;
  CHECK_MSG(used < 0.3, "mokd burned %.2f s of CPU in 1 s on a full completion ring", used);
  CHECK(harness_alive(&d));
  mok_client *other; /* and everyone else is still served */
  CHECK(mok_connect(d.sock, "other", &other) == MOK_OK);
  CHECK(mok_submit_nop(other, &t) == MOK_OK);
  CHECK_EQ_INT(mok_wait(other, t, 5000), MOK_OK);
  mok_close(other);
  kill(d.pid, SIGKILL); /* c's books are cooked: no orderly close */
  waitpid(d.pid, NULL, 0);
}

/* LayerCost: CreateLayer's description and checks, nothing created, no
 * quota; the numbers are the wire formulas (ctx at max_tokens) and the
 * engine's (the cpu engine keeps no per-layer state: 0). */
static void test_layer_cost_before_creating(void) {
  char dir[] = "/tmp/mok-test-cost-XXXXXX", conf[256];
  CHECK(mkdtemp(dir) != NULL);
  snprintf(conf, sizeof conf, "max-layers = 1\nmax-layers-per-uid = 1\ngroup-dir = %s\n", dir);
  daemon_proc d = harness_start(conf);
  mok_client *c;
  CHECK(mok_connect(d.sock, "cost", &c) == MOK_OK);
  mok_layer_desc ld = {.hidden = 64, .intermediate = 32, .experts = 8, .topk = 2,
                       .shared_intermediate = 16, .max_tokens = 40, .dtype = MOK_DTYPE_BF16};
  mok_layer_cost_info a, b;
  CHECK_MSG(mok_layer_cost(c, &ld, &a) == MOK_OK, "%s", mok_last_error());
  CHECK_MSG(mok_layer_cost(c, &ld, &b) == MOK_OK, "%s", mok_last_error()); /* no quota used */
  CHECK(a.ctx_bytes == b.ctx_bytes && a.layer_bytes == b.layer_bytes &&
        a.workspace_bytes == b.workspace_bytes && a.row_align == b.row_align);
  mok_layer *l, *l2;
  CHECK_MSG(mok_layer_create(c, &ld, &l) == MOK_OK, "%s", mok_last_error());
  CHECK_EQ_INT(a.ctx_bytes, mok_layer_ctx_bytes(l, ld.max_tokens));
  CHECK_EQ_INT(a.row_align, mok_layer_row_align(l));
  CHECK_EQ_INT(a.local_experts, 8);
  CHECK_EQ_INT(a.first_expert, 0);
  /* the cpu engine keeps no per-layer state and reports no workspace */
  if (strcmp(mok_client_engine(c), "cpu") == 0) {
    CHECK_EQ_INT(a.layer_bytes, 0);
    CHECK_EQ_INT(a.workspace_bytes, 0);
  }
  /* still asked with a layer (the quota full): a cost is no layer */
  CHECK_MSG(mok_layer_cost(c, &ld, &b) == MOK_OK, "%s", mok_last_error());
  CHECK_EQ_INT(mok_layer_create(c, &ld, &l2), MOK_ELIMIT);
  /* a larger layer never costs less; ctx follows max_tokens */
  mok_layer_desc big = ld;
  big.max_tokens = 4 * ld.max_tokens;
  CHECK_MSG(mok_layer_cost(c, &big, &b) == MOK_OK, "%s", mok_last_error());
  CHECK(b.ctx_bytes > a.ctx_bytes && b.layer_bytes >= a.layer_bytes &&
        b.workspace_bytes >= a.workspace_bytes);
  /* refused exactly as CreateLayer would be */
  mok_layer_desc bad = ld;
  bad.topk = 9;
  CHECK_EQ_INT(mok_layer_cost(c, &bad, &b), MOK_EINVAL);
  char why[256];
  snprintf(why, sizeof why, "%s", mok_last_error());
  mok_layer_destroy(l);
  CHECK_EQ_INT(mok_layer_create(c, &bad, &l2), MOK_EINVAL);
  CHECK(strcmp(why, mok_last_error()) == 0);
  bad = ld;
  bad.dtype = 77;
  CHECK_EQ_INT(mok_layer_cost(c, &bad, &b), MOK_EINVAL);
  bad = ld;
  bad.max_tokens = 0;
  CHECK_EQ_INT(mok_layer_cost(c, &bad, &b), MOK_EINVAL);
  CHECK_EQ_INT(mok_layer_cost(c, NULL, &b), MOK_EINVAL);
  /* a raw LayerCost without a config */
  Mok__LayerCost lc = MOK__LAYER_COST__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_LAYER_COST;
  req.layer_cost = &lc;
  Mok__Reply *rep = NULL;
  CHECK_EQ_INT(mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL), MOK_EINVAL);
  CHECK_STR_CONTAINS(mok_last_error(), "LayerCost without a config");
  /* on a group: this rank's experts, the group's ctx */
  mok_group_sizing sz = {.max_tokens = 40, .hidden = 64, .topk = 2, .experts = 8,
                         .dtype = MOK_DTYPE_BF16, .timeout_ms = 1000};
  mok_group *g;
  CHECK_MSG(mok_group_join(c, "cost-group", 0, 2, &sz, &g) == MOK_OK, "%s", mok_last_error());
  mok_layer_desc gd = ld;
  gd.group = g;
  CHECK_MSG(mok_layer_cost(c, &gd, &b) == MOK_OK, "%s", mok_last_error());
  CHECK_EQ_INT(b.local_experts, 4);
  CHECK_EQ_INT(b.first_expert, 0);
  CHECK_MSG(mok_layer_create(c, &gd, &l2) == MOK_OK, "%s", mok_last_error());
  CHECK_EQ_INT(b.ctx_bytes, mok_layer_ctx_bytes(l2, gd.max_tokens));
  CHECK(b.ctx_bytes != a.ctx_bytes); /* the group's routed rows, not the local ones */
  mok_layer_destroy(l2);
  CHECK(mok_group_leave(g) == MOK_OK);
  gd.group = NULL;
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
  rmdir(dir);
}

/* Stats carries each session's memory split (mokctl prints it). */
static void test_stats_report_session_memory(void) {
  daemon_proc d = harness_start(NULL);
  mok_client *c;
  CHECK(mok_connect(d.sock, "memory", &c) == MOK_OK);
  problem p;
  problem_init(&p, c, 16, 5);
  run_and_check(c, &p);
  Mok__Stats st = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &st;
  Mok__Reply *rep = NULL;
  CHECK(mok_rpc(c, &req, NULL, 0, &rep, NULL, NULL) == MOK_OK);
  CHECK(rep->body_case == MOK__REPLY__BODY_STATS && rep->stats->n_sessions == 1);
  const Mok__SessionInfo *x = rep->stats->sessions[0];
  CHECK(!rep->stats->own_uid_only); /* root: an admin */
  CHECK_EQ_INT(x->mapped_device_bytes, 0); /* host memory only */
  if (strcmp(mok_client_engine(c), "cpu") == 0) CHECK_EQ_INT(x->layer_bytes, 0);
  /* whatever the engine holds for it is bounded by what it would say a job needs */
  CHECK(x->workspace_bytes + x->scratch_bytes < (1ull << 32));
  mok__reply__free_unpacked(rep, NULL);
  /* mokctl shows it, in text, JSON and metrics */
  const char *modes[][2] = {{"status", "memory: "}, {"status --json", "\"memory\": {\"mapped_device_bytes\""},
                            {"metrics", "mok_session_memory_bytes{session="}};
  for (int m = 0; m < 3; m++) {
    char cmd[512], out[8192];
    snprintf(cmd, sizeof cmd, "%s/bin/mokctl --socket %s %s", harness_build_dir(), d.sock,
             modes[m][0]);
    FILE *f = popen(cmd, "r");
    CHECK(f != NULL);
    size_t n = fread(out, 1, sizeof out - 1, f);
    out[n] = '\0';
    CHECK_EQ_INT(pclose(f), 0);
    CHECK_STR_CONTAINS(out, modes[m][1]);
  }
  mok_close(c);
  CHECK_EQ_INT(harness_stop(&d), 0);
}

static const check_case cases[] = {
    CHECK_CASE(test_forward_backward_match_the_reference),
    CHECK_CASE(test_many_nops_round_trip),
    CHECK_CASE(test_malformed_frames_close_only_their_session),
    CHECK_CASE(test_handshake_timeout_and_second_hello),
    CHECK_CASE(test_bad_descriptors_fail_only_their_job),
    CHECK_CASE(test_a_failed_jobs_whole_message_reaches_the_client),
    CHECK_CASE(test_unsealed_memfd_and_quota_are_refused),
    CHECK_CASE(test_join_group_with_a_malformed_nccl_id),
    CHECK_CASE(test_layer_cost_before_creating),
    CHECK_CASE(test_stats_report_session_memory),
    CHECK_CASE(test_a_killed_client_loses_only_its_session),
    CHECK_CASE(test_fp8_quantize_weight_fails_alone_and_writes_only_its_own),
    CHECK_CASE(test_concurrent_clients_each_get_their_results),
    CHECK_CASE(test_shutdown_drains_and_refuses_a_second_daemon),
    CHECK_CASE(test_a_client_that_never_drains_costs_no_cpu),
    {0}};

int main(int argc, char **argv) {
  signal(SIGPIPE, SIG_IGN);
  return check_main(argc, argv, cases);
}
