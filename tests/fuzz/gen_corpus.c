/* SPDX-License-Identifier: Apache-2.0 */
/* Writes the fuzzers' seed corpora: golden messages as mokd and libmok
 * really exchange them (every Request body, valid job descriptors for every
 * op on a few layers, built schedules, a full configuration).
 *
 *   gen_corpus DIR   ->  DIR/request/, DIR/job_check/, DIR/schedule/, DIR/config/, DIR/http/
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz_job_check.h"
#include "job_check.h"
#include "layer.h"
#include "mok.pb-c.h"
#include "mok_slots.h"
#include "mok_status.h"
#include "schedule.h"

static const char *out_dir;
static int n_written;

static void put(const char *target, const char *name, const void *data, size_t n) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s", out_dir, target);
  if (mkdir(path, 0755) < 0 && errno != EEXIST) {
    perror(path);
    exit(1);
  }
  snprintf(path, sizeof path, "%s/%s/%s", out_dir, target, name);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(data, 1, n, f) != n) {
    perror(path);
    exit(1);
  }
  fclose(f);
  n_written++;
}

/* ---- request: [state byte][frame header][Request] ---- */
static void put_request(const char *name, const Mok__Request *req, int hello_done, int nfds) {
  uint8_t buf[4096];
  size_t len = mok__request__get_packed_size(req);
  mok_frame_header h = {.magic = MOK_FRAME_MAGIC, .version = MOK_PROTOCOL_VERSION,
                        .request_id = 7, .length = (uint32_t)len};
  buf[0] = (uint8_t)((hello_done ? 1 : 0) | (nfds << 1));
  memcpy(buf + 1, &h, sizeof h);
  mok__request__pack(req, buf + 1 + sizeof h);
  put("request", name, buf, 1 + sizeof h + len);
}

static void gen_requests(void) {
  Mok__Request req = MOK__REQUEST__INIT;
  Mok__Hello hello = MOK__HELLO__INIT;
  hello.protocol_version = MOK_PROTOCOL_VERSION;
  hello.client_name = "trainer-rank-0";
  req.body_case = MOK__REQUEST__BODY_HELLO, req.hello = &hello;
  put_request("hello", &req, 0, 0);
  Mok__RegisterBuffer rb = MOK__REGISTER_BUFFER__INIT;
  rb.kind = MOK__BUFFER_KIND__BUFFER_HOST_MEMFD, rb.bytes = 1 << 20, rb.offset = 4096;
  req.body_case = MOK__REQUEST__BODY_REGISTER_BUFFER, req.register_buffer = &rb;
  put_request("register_memfd", &req, 1, 1);
  uint8_t handle[64] = {1, 2, 3};
  rb.kind = MOK__BUFFER_KIND__BUFFER_CUDA_IPC, rb.cuda_ipc_handle.data = handle;
  rb.cuda_ipc_handle.len = sizeof handle;
  put_request("register_ipc", &req, 1, 0);
  Mok__UnregisterBuffer ub = MOK__UNREGISTER_BUFFER__INIT;
  ub.region_id = 3;
  req.body_case = MOK__REQUEST__BODY_UNREGISTER_BUFFER, req.unregister_buffer = &ub;
  put_request("unregister", &req, 1, 0);
  Mok__LayerConfig lc = MOK__LAYER_CONFIG__INIT;
  lc.hidden = 4096, lc.intermediate = 1536, lc.experts = 128, lc.topk = 8, lc.max_tokens = 8192;
  lc.dtype = MOK__DTYPE__DTYPE_BF16, lc.shared_intermediate = 2048;
  lc.has_swiglu_limit = 1, lc.swiglu_limit = 7.0f;
  Mok__CreateLayer cl = MOK__CREATE_LAYER__INIT;
  cl.config = &lc;
  req.body_case = MOK__REQUEST__BODY_CREATE_LAYER, req.create_layer = &cl;
  put_request("create_layer_bf16", &req, 1, 0);
  lc.dtype = MOK__DTYPE__DTYPE_F32, lc.shared_intermediate = 0, lc.has_swiglu_limit = 0;
  lc.hidden = 32, lc.intermediate = 16, lc.experts = 6, lc.topk = 2, lc.max_tokens = 64;
  put_request("create_layer_f32", &req, 1, 0);
  Mok__LayerCost lcost = MOK__LAYER_COST__INIT;
  lcost.config = &lc;
  req.body_case = MOK__REQUEST__BODY_LAYER_COST, req.layer_cost = &lcost;
  put_request("layer_cost", &req, 1, 0);
  lc.group_id = 2, lc.group_tag = 5;
  put_request("layer_cost_group", &req, 1, 0);
  lc.group_id = 0, lc.group_tag = 0;
  Mok__DestroyLayer dl = MOK__DESTROY_LAYER__INIT;
  dl.layer_id = 1;
  req.body_case = MOK__REQUEST__BODY_DESTROY_LAYER, req.destroy_layer = &dl;
  put_request("destroy_layer", &req, 1, 0);
  Mok__JoinGroup jg = MOK__JOIN_GROUP__INIT;
  jg.group_key = "ep-group-a", jg.rank = 1, jg.world = 8;
  req.body_case = MOK__REQUEST__BODY_JOIN_GROUP, req.join_group = &jg;
  put_request("join_group", &req, 1, 0);
  static uint8_t nccl_id[128] = {1, 2, 3};
  jg.nccl_id.data = nccl_id, jg.nccl_id.len = sizeof nccl_id;
  jg.capacity_ppm = 250000, jg.ring_rows = 4096;
  put_request("join_group_nccl", &req, 1, 0);
  Mok__GroupId gid = MOK__GROUP_ID__INIT;
  req.body_case = MOK__REQUEST__BODY_GROUP_ID, req.group_id = &gid;
  put_request("group_id", &req, 1, 0);
  Mok__Stats st = MOK__STATS__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS, req.stats = &st;
  put_request("stats", &req, 1, 0);
  Mok__Goodbye bye = MOK__GOODBYE__INIT;
  req.body_case = MOK__REQUEST__BODY_GOODBYE, req.goodbye = &bye;
  put_request("goodbye", &req, 1, 0);
}

/* The verdict mokd gives in (regions as fuzz_job_check.c builds them). */
static void expect_job(const fuzz_job_input *in, const mok_layer_config *l, int want, uint32_t op) {
  mok_region_table t;
  memset(&t, 0, sizeof t);
  for (uint32_t i = 0; i < FUZZ_REGIONS; i++) {
    mok_region r = {.kind = MOK_REGION_HOST_MEMFD, .bytes = in->region_bytes[i],
                    .base = (void *)(uintptr_t)((uint64_t)(i + 1) << 40)};
    uint32_t obj = in->region_object[i] % (FUZZ_OBJECTS + 1);
    if (obj)
      r.backing = (mok_region_backing){.object = obj, .object2 = 1,
                                       .offset = in->region_backing_offset[i] >> 1};
    mok_region_table_add(&t, &r);
  }
  mok_job_args args;
  char err[256] = "";
  int st = mok_job_check(&in->desc, &t, l, &args, err, sizeof err);
  mok_region_table_free(&t);
  if (st != want) {
    fprintf(stderr, "gen_corpus: %s seed: status %d, expected %d (%s)\n", mok_op_name(op), st,
            want, err);
    exit(1);
  }
}

/* ---- job_check: a valid descriptor for every op on a few layers ---- */
static void gen_jobs(void) {
  static const struct { uint32_t H, I, E, K, Is, T, dtype, lim, align; } layers[] = {
      {32, 16, 6, 2, 0, 64, MOK_DTYPE_F32, 0, 1},
      {64, 32, 8, 4, 48, 128, MOK_DTYPE_BF16, 1, 8},
      {256, 128, 2, 1, 128, 16, MOK_DTYPE_FP8_E4M3, 0, 1}, /* packed weights, quantize_weight */
  };
  static const char *const dtype_names[] = {[MOK_DTYPE_F32] = "f32", [MOK_DTYPE_BF16] = "bf16",
                                            [MOK_DTYPE_FP8_E4M3] = "fp8"};
  for (size_t li = 0; li < sizeof layers / sizeof layers[0]; li++) {
    for (uint32_t op = 0; op < MOK_OP_COUNT_; op++) {
      /* quantize_weight: an fp8 layer's op */
      const bool quantize = op == MOK_OP_QUANTIZE_WEIGHT;
      if (quantize && layers[li].dtype != MOK_DTYPE_FP8_E4M3) continue;
      for (uint32_t flags = 0; flags <= (op == MOK_OP_BACKWARD ? 1u : 0u); flags++) {
        fuzz_job_input in;
        memset(&in, 0, sizeof in);
        in.hidden = layers[li].H, in.intermediate = layers[li].I, in.experts = layers[li].E;
        in.topk = layers[li].K, in.shared_intermediate = layers[li].Is;
        in.max_tokens = layers[li].T, in.dtype = layers[li].dtype;
        in.has_limit = (uint8_t)layers[li].lim, in.row_align = (uint8_t)layers[li].align;
        in.layer_present = 1;
        mok_layer_config l = {.hidden = in.hidden, .intermediate = in.intermediate,
                              .experts = in.experts, .topk = in.topk,
                              .shared_intermediate = in.shared_intermediate,
                              .max_tokens = in.max_tokens, .dtype = in.dtype,
                              .has_limit = in.has_limit, .swiglu_limit = 7.0f};
        char err[256];
        if (mok_layer_validate(&l, err, sizeof err) != MOK_OK) {
          fprintf(stderr, "gen_corpus: %s\n", err);
          exit(1);
        }
        l.row_align = in.row_align;
        uint32_t T = in.max_tokens / 2 + 1;
        mok_job_desc *d = &in.desc;
        d->version = MOK_JOB_VERSION, d->op = (uint16_t)op, d->flags = (uint16_t)flags;
        d->layer = 1, d->tokens = op == MOK_OP_NOP || quantize ? 0 : T, d->user_data = 42;
        uint64_t off = 0;
        for (uint32_t s = 0; op != MOK_OP_NOP && s < MOK_SLOT_COUNT_; s++) {
          if (mok_job_slot_need(&l, op, flags, s) == MOK_NEED_NONE) continue;
          if (quantize && s != MOK_SLOT_W_DOWN && s != MOK_SLOT_PACKED_WEIGHT) continue;
          uint32_t dt, nd;
          uint64_t shape[MOK_MAX_DIMS];
          mok_job_slot_shape_op(&l, op, MOK_SLOT_W_DOWN, d->tokens, s, &dt, &nd, shape);
          mok_tensor_ref *r = &d->tensors[d->n_tensors++];
          r->region = 1 + (s % 2), r->slot = (uint16_t)s, r->dtype = (uint8_t)dt;
          r->ndim = (uint8_t)nd;
          uint64_t bytes = mok_dtype_size(dt);
          for (uint32_t k = 0; k < nd; k++) r->shape[k] = (uint32_t)shape[k], bytes *= shape[k];
          r->bytes = bytes;
          r->offset = off;
          off = mok_align256(off + bytes);
        }
        in.region_bytes[0] = in.region_bytes[1] = off;
        in.region_bytes[2] = 4096, in.region_bytes[3] = 1ull << 40;
        /* a seed is only golden if mokd accepts it */
        expect_job(&in, &l, MOK_OK, op);
        char name[64];
        snprintf(name, sizeof name, "%s_%s%s", dtype_names[layers[li].dtype], mok_op_name(op),
                 flags ? "_recompute" : "");
        put("job_check", name, &in, sizeof in);
        if (op == MOK_OP_NOP) continue;
        /* regions 1 and 2 as two registrations of one memfd, both from its
         * start: their tensors interleave, so nothing overlaps (accepted) */
        in.region_object[0] = in.region_object[1] = 1;
        expect_job(&in, &l, MOK_OK, op);
        snprintf(name, sizeof name, "%s_%s%s_aliased", dtype_names[layers[li].dtype],
                 mok_op_name(op), flags ? "_recompute" : "");
        put("job_check", name, &in, sizeof in);
        /* ... then shifted so that an output lies over a tensor of the
         * other registration (refused) */
        const mok_tensor_ref *o = NULL, *q = NULL;
        for (uint32_t i = 0; i < d->n_tensors && !o; i++)
          if (mok_job_slot_is_output(op, flags, d->tensors[i].slot)) o = &d->tensors[i];
        for (uint32_t i = 0; o && i < d->n_tensors && !q; i++)
          if (d->tensors[i].region != o->region) q = &d->tensors[i];
        if (!o || !q) continue;
        /* region r's backing offset is the fuzzer's value >> 1 */
        uint64_t shift = o->offset > q->offset ? o->offset - q->offset : q->offset - o->offset;
        in.region_backing_offset[(o->offset > q->offset ? q->region : o->region) - 1] = shift << 1;
        expect_job(&in, &l, MOK_EINVAL, op);
        snprintf(name, sizeof name, "%s_%s%s_overlap", dtype_names[layers[li].dtype],
                 mok_op_name(op), flags ? "_recompute" : "");
        put("job_check", name, &in, sizeof in);
      }
    }
  }
}

/* ---- schedule: [mode][T K E_loc align E+ first][int32...] ---- */
static void gen_schedules(void) {
  static const uint8_t shapes[][6] = {{16, 2, 6, 1, 0, 0}, {37, 3, 4, 8, 2, 1}, {1, 1, 1, 1, 0, 0},
                                      {0, 2, 3, 4, 0, 0}};
  for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++) {
    mok_sched_shape s;
    memset(&s, 0, sizeof s);
    s.dims.tokens = shapes[i][0] % 64, s.dims.topk = 1 + shapes[i][1] % 8;
    s.dims.local_experts = 1 + shapes[i][2] % 16, s.dims.row_align = 1 + shapes[i][3] % 16;
    s.first_expert = shapes[i][5] % 4;
    s.experts = (uint32_t)(s.first_expert + s.dims.local_experts + shapes[i][4] % 4);
    size_t n_ids = (size_t)(s.dims.tokens * s.dims.topk), n = (size_t)mok_schedule_ints(&s.dims);
    int32_t *ids = calloc(n_ids + 1, sizeof *ids), *sched = calloc(n, sizeof *sched);
    for (size_t k = 0; k < n_ids; k++) ids[k] = (int32_t)((k * 7 + i) % (s.experts + 1)) - 1;
    char msg[256];
    if (mok_schedule_build(&s, ids, sched, n, msg, sizeof msg) != MOK_OK) {
      fprintf(stderr, "gen_corpus: %s\n", msg);
      exit(1);
    }
    size_t bytes = 7 + 4 * (n > n_ids ? n : n_ids);
    uint8_t *buf = calloc(1, bytes);
    memcpy(buf + 1, shapes[i], 6);
    char name[64];
    buf[0] = 0; /* validate this built schedule */
    memcpy(buf + 7, sched, 4 * n);
    snprintf(name, sizeof name, "validate_%zu", i);
    put("schedule", name, buf, 7 + 4 * n);
    buf[0] = 1; /* build from these ids (the fuzzer maps x to x % (E+2) - 1) */
    for (size_t k = 0; k < n_ids; k++) {
      int32_t v = ids[k] + 1;
      memcpy(buf + 7 + 4 * k, &v, 4);
    }
    snprintf(name, sizeof name, "build_%zu", i);
    put("schedule", name, buf, 7 + 4 * n_ids);
    free(buf), free(ids), free(sched);
  }
}

static void gen_config(void) {
  const char *full =
      "# mokd configuration\nsocket = /run/mok/mokd-0.sock\nengine = cpu\ndevice = 0\n"
      "threads = 4\nlog-level = info\nsocket-mode = 0660\nsocket-group = mok\n"
      "max-sessions = 256\nhello-timeout-ms = 5000\nmax-pending-requests = 64\n"
      "drain-ms = 10000\nmax-regions = 4096\nmax-region-bytes = 68719476736\n"
      "max-layers = 256\nallow-uids = 0, 1000\nallow-gids = 27\nmax-sessions-per-uid = 16\n"
      "max-regions-per-uid = 1024\nmax-region-bytes-per-uid = 1099511627776\n"
      "max-layers-per-uid = 64\n";
  put("config", "full", full, strlen(full));
  const char *odd = "  max_layers=7 # underscores\n\n\t engine\t=\tcpu  \nallow-uids =\n";
  put("config", "odd_spacing", odd, strlen(odd));
}

/* ---- http: requests as scrapers send them (and a few the parser refuses) ---- */
static void gen_http(void) {
  const struct { const char *name, *text; } reqs[] = {
      {"prometheus", "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:9464\r\nUser-Agent: "
                     "Prometheus/2.53.0\r\nAccept: application/openmetrics-text;version=1.0.0;"
                     "q=0.5,text/plain;version=0.0.4;q=0.4,*/*;q=0.1\r\nAccept-Encoding: gzip\r\n"
                     "X-Prometheus-Scrape-Timeout-Seconds: 10\r\n\r\n"},
      {"curl_10", "GET /metrics HTTP/1.0\r\nUser-Agent: curl/7.88.1\r\nAccept: */*\r\n\r\n"},
      {"query", "GET /metrics?name[]=mokd_up HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"},
      {"post", "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"},
      {"folded", "GET /metrics HTTP/1.1\r\nHost: x\r\nX-A: a\r\n b\r\n\r\n"},
      {"chunked", "GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"},
      {"http2", "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"},
  };
  for (size_t i = 0; i < sizeof reqs / sizeof reqs[0]; i++)
    put("http", reqs[i].name, reqs[i].text, strlen(reqs[i].text));
  const char *metrics = "metrics-listen = 127.0.0.1:9464\nmetrics-socket = /run/mok/metrics.sock\n"
                        "metrics-socket-mode = 0660\nmetrics-socket-group = mok\n"
                        "metrics-per-uid = yes\nmetrics-allow-nonlocal = no\n"
                        "metrics-max-connections = 16\nmetrics-timeout-ms = 5000\n"
                        "metrics-max-label-sets = 32\nmetrics_listen = [::1]:9464\n";
  put("config", "metrics", metrics, strlen(metrics));
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: gen_corpus DIR\n");
    return 2;
  }
  out_dir = argv[1];
  if (mkdir(out_dir, 0755) < 0 && errno != EEXIST) {
    perror(out_dir);
    return 1;
  }
  gen_requests();
  gen_jobs();
  gen_schedules();
  gen_config();
  gen_http();
  printf("gen_corpus: %d seed files in %s\n", n_written, out_dir);
  return 0;
}
