/* SPDX-License-Identifier: Apache-2.0 */
/* The metrics registry and page (daemon/metrics.c): counts as the engine
 * and the loop report them, the histogram's consistency, bounded label
 * sets (folded into "other" without losing a count), refusal reasons from
 * the real messages, privacy (no uid or client labels unless per-uid). */
#include <math.h>

#include "harness/check.h"
#include "metrics.h"
#include "mok_slots.h"
#include "mok_status.h"
#include "quota.h"

/* The page as a NUL-terminated string (static storage). */
static const char *render(mok_metrics *m, const mok_engine_stats *st) {
  static char *last;
  free(last);
  mok_metrics_page_info info = {.version = "0.1.0", .engine = "cpu", .device = "dev \"x\"",
                                .uptime_ms = 1500, .connections = 3, .http_connections = 1};
  size_t len;
  char *p = mok_metrics_render(m, &info, st, &len);
  CHECK(p != NULL);
  last = realloc(p, len + 1);
  CHECK(last != NULL);
  last[len] = '\0';
  return last;
}

/* The value of one sample ("name{labels}"), or NAN when absent. */
static double sample(const char *page, const char *series) {
  size_t n = strlen(series);
  for (const char *l = page; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
    if (strncmp(l, series, n) == 0 && l[n] == ' ') return strtod(l + n + 1, NULL);
  return NAN;
}

static bool has_line_starting(const char *page, const char *prefix) {
  size_t n = strlen(prefix);
  for (const char *l = page; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
    if (strncmp(l, prefix, n) == 0) return true;
  return false;
}

static const mok_engine_stats no_stats = {0};

static void test_jobs_count_by_op_status_and_latency(void) {
  mok_metrics *m = mok_metrics_create(8, false);
  CHECK(m != NULL);
  mok_job_sink *a = mok_metrics_session_open(m, 1000, "trainer");
  mok_job_sink_record(a, MOK_OP_FORWARD, MOK_OK, 40000);       /* <= 50 us */
  mok_job_sink_record(a, MOK_OP_FORWARD, MOK_OK, 50000);       /* le is inclusive */
  mok_job_sink_record(a, MOK_OP_FORWARD, MOK_OK, 3000000);     /* 3 ms: le=0.005 */
  mok_job_sink_record(a, MOK_OP_FORWARD, MOK_EBOUNDS, 1000);   /* failures count in the histogram */
  mok_job_sink_record(a, MOK_OP_BACKWARD, MOK_ELIMIT, 100000000000ull); /* 100 s: +Inf only */
  mok_job_sink_record(a, 99, MOK_EINVAL, 1000);                /* an op we do not know */
  mok_job_sink_record(a, MOK_OP_NOP, 1234, 1000);               /* a status we do not know */
  mok_job_sink_record(NULL, MOK_OP_FORWARD, MOK_OK, 1);         /* metrics off: nothing */
  const char *p = render(m, &no_stats);
  CHECK_EQ_INT(sample(p, "mokd_jobs_completed_total{op=\"forward\"}"), 3);
  CHECK_EQ_INT(sample(p, "mokd_jobs_completed_total{op=\"backward\"}"), 0);
  CHECK_EQ_INT(sample(p, "mokd_jobs_failed_total{op=\"forward\",status=\"EBOUNDS\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_jobs_failed_total{op=\"backward\",status=\"ELIMIT\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_jobs_failed_total{op=\"unknown\",status=\"EINVAL\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_jobs_failed_total{op=\"nop\",status=\"unknown\"}"), 1);
  CHECK(isnan(sample(p, "mokd_jobs_failed_total{op=\"forward\",status=\"ELIMIT\"}")));
  /* the histogram: cumulative, +Inf == count, sum in seconds */
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"forward\",le=\"5e-05\"}"), 3);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"forward\",le=\"0.0025\"}"), 3);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"forward\",le=\"0.005\"}"), 4);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"forward\",le=\"+Inf\"}"), 4);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_count{op=\"forward\"}"), 4);
  CHECK(fabs(sample(p, "mokd_job_duration_seconds_sum{op=\"forward\"}") - 0.003091) < 1e-9);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"backward\",le=\"60\"}"), 0);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_bucket{op=\"backward\",le=\"+Inf\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_job_duration_seconds_count{op=\"backward\"}"), 1);
  /* ops that never ran have no histogram series */
  CHECK(isnan(sample(p, "mokd_job_duration_seconds_count{op=\"combine\"}")));
  /* every bucket of every op is no less than the one before */
  for (int op = 0; op < MOK_OP_COUNT_; op++) {
    double prev = 0;
    for (int b = 0; b < MOK_LATENCY_BUCKETS; b++) {
      char s[128];
      snprintf(s, sizeof s, "mokd_job_duration_seconds_bucket{op=\"%s\",le=\"%g\"}",
               mok_op_name((uint32_t)op), mok_latency_bounds_ns[b] / 1e9);
      double v = sample(p, s);
      if (isnan(v)) continue;
      CHECK_MSG(v >= prev, "%s: %g after %g", s, v, prev);
      prev = v;
    }
  }
  /* without per-uid, no series has a uid or client label */
  CHECK(strstr(p, "uid=") == NULL && strstr(p, "client=") == NULL && strstr(p, "trainer") == NULL);
  CHECK(!has_line_starting(p, "mokd_tenant_"));
  CHECK_EQ_INT(sample(p, "mokd_metrics_per_uid"), 0);
  CHECK_EQ_INT(sample(p, "mokd_sessions"), 1);
  mok_metrics_session_close(m, a);
  p = render(m, &no_stats);
  CHECK_EQ_INT(sample(p, "mokd_sessions"), 0);
  CHECK_EQ_INT(sample(p, "mokd_sessions_opened_total"), 1);
  mok_metrics_free(m);
}

static void test_every_family_has_help_and_type_once_before_its_samples(void) {
  mok_metrics *m = mok_metrics_create(4, true);
  mok_job_sink *a = mok_metrics_session_open(m, 7, "x");
  mok_job_sink_record(a, MOK_OP_FORWARD, MOK_OK, 1000);
  const char *p = render(m, &no_stats);
  char seen[128][96];
  int n_seen = 0;
  for (const char *l = p; *l; l = strchr(l, '\n') + 1) {
    CHECK_MSG(strchr(l, '\n') != NULL, "the page ends with a newline");
    char name[96];
    if (strncmp(l, "# HELP ", 7) == 0) {
      sscanf(l + 7, "%95s", name);
      for (int i = 0; i < n_seen; i++) CHECK_MSG(strcmp(seen[i], name), "%s twice", name);
      CHECK(n_seen < 128);
      snprintf(seen[n_seen++], sizeof seen[0], "%s", name);
      const char *t = strchr(l, '\n') + 1;
      char tname[96], type[32];
      CHECK(sscanf(t, "# TYPE %95s %31s", tname, type) == 2);
      CHECK(strcmp(tname, name) == 0);
      CHECK(!strcmp(type, "counter") || !strcmp(type, "gauge") || !strcmp(type, "histogram"));
      if (!strcmp(type, "counter")) CHECK_MSG(strstr(name, "_total") != NULL, "%s", name);
      continue;
    }
    if (l[0] == '#') continue;
    /* a sample belongs to the last family named */
    CHECK(n_seen > 0);
    const char *fam = seen[n_seen - 1];
    CHECK_MSG(strncmp(l, fam, strlen(fam)) == 0, "sample after %s: %.60s", fam, l);
  }
  mok_metrics_free(m);
}

static void test_label_sets_are_bounded_and_fold_into_other(void) {
  mok_metrics *m = mok_metrics_create(2, true);
  mok_job_sink *a = mok_metrics_session_open(m, 1000, "a");
  mok_job_sink *a2 = mok_metrics_session_open(m, 1000, "a"); /* the same set */
  mok_job_sink *b = mok_metrics_session_open(m, 1001, "b");
  mok_job_sink *c = mok_metrics_session_open(m, 1002, "c\"q\\"); /* both taken: other */
  CHECK(a == a2 && a != b && c != a && c != b);
  for (int i = 0; i < 5; i++) mok_job_sink_record(a, MOK_OP_FORWARD, MOK_OK, 1000);
  for (int i = 0; i < 2; i++) mok_job_sink_record(b, MOK_OP_FORWARD, MOK_EINVAL, 1000);
  mok_job_sink_record(c, MOK_OP_FORWARD, MOK_OK, 1000);
  const char *p = render(m, &no_stats);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_completed_total{uid=\"1000\",client=\"a\"}"), 5);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_failed_total{uid=\"1001\",client=\"b\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_completed_total{uid=\"other\",client=\"other\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_tenant_sessions{uid=\"1000\",client=\"a\"}"), 2);
  CHECK(strstr(p, "1002") == NULL);
  CHECK_EQ_INT(sample(p, "mokd_tenant_label_sets{bound=\"used\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_tenant_label_sets{bound=\"max\"}"), 2);
  /* a set with a live session is never given away */
  mok_metrics_session_close(m, a);
  mok_job_sink *d = mok_metrics_session_open(m, 1003, "d");
  CHECK(d == c); /* "other" */
  mok_metrics_session_close(m, d);
  /* once "a" has no session, a new (uid, client) may take its set; its
   * counts go on under "other" (sums over sets never go down) */
  mok_metrics_session_close(m, a2);
  mok_job_sink *e = mok_metrics_session_open(m, 1004, "e");
  CHECK(e == a);
  p = render(m, &no_stats);
  CHECK(isnan(sample(p, "mokd_tenant_jobs_completed_total{uid=\"1000\",client=\"a\"}")));
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_completed_total{uid=\"1004\",client=\"e\"}"), 0);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_completed_total{uid=\"other\",client=\"other\"}"), 6);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_failed_total{uid=\"1001\",client=\"b\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_jobs_completed_total{op=\"forward\"}"), 6);
  CHECK_EQ_INT(sample(p, "mokd_sessions"), 3); /* b, c, e */
  /* a client name is escaped in its label */
  mok_metrics_session_close(m, b);
  mok_metrics_session_open(m, 1002, "c\"q\\");
  p = render(m, &no_stats);
  CHECK_STR_CONTAINS(p, "mokd_tenant_sessions{uid=\"1002\",client=\"c\\\"q\\\\\"} 1\n");
  CHECK_STR_CONTAINS(p, "device=\"dev \\\"x\\\"\"");
  /* however many tenants come, the page names at most max sets plus other */
  for (uint32_t u = 2000; u < 2100; u++) mok_metrics_session_close(m, mok_metrics_session_open(m, u, "t"));
  p = render(m, &no_stats);
  int sets = 0;
  for (const char *l = p; (l = strstr(l, "mokd_tenant_sessions{")) != NULL; l++) sets++;
  CHECK_EQ_INT(sets, 3);
  mok_metrics_free(m);
}

/* A free set is given away only when no set was ever used; the least
 * recently used free one goes first. */
static void test_free_label_sets_are_reused_least_recent_first(void) {
  mok_metrics *m = mok_metrics_create(3, true);
  mok_job_sink *a = mok_metrics_session_open(m, 1, "a");
  mok_metrics_session_close(m, a);
  mok_job_sink *b = mok_metrics_session_open(m, 2, "b"); /* a's set is free: still a new one */
  CHECK(b != a);
  mok_metrics_session_close(m, b);
  mok_job_sink *c = mok_metrics_session_open(m, 3, "c");
  CHECK(c != a && c != b);
  mok_job_sink *d = mok_metrics_session_open(m, 4, "d"); /* all used: a is the oldest free */
  CHECK(d == a);
  mok_job_sink *e = mok_metrics_session_open(m, 5, "e"); /* then b */
  CHECK(e == b);
  mok_job_sink *f = mok_metrics_session_open(m, 6, "f"); /* none free: other */
  CHECK(f != a && f != b && f != c);
  mok_job_sink *a2 = mok_metrics_session_open(m, 1, "a"); /* a's counts were folded: other */
  CHECK(a2 == f);
  const char *p = render(m, &no_stats);
  CHECK_EQ_INT(sample(p, "mokd_tenant_label_sets{bound=\"used\"}"), 3);
  CHECK_EQ_INT(sample(p, "mokd_tenant_sessions{uid=\"other\",client=\"other\"}"), 2);
  mok_metrics_free(m);
}

static void test_gauges_come_from_the_engine_stats(void) {
  mok_metrics *m = mok_metrics_create(4, true);
  mok_job_sink *a = mok_metrics_session_open(m, 1000, "a");
  mok_session_stats ss[3] = {
      {.session_id = 1, .regions = 2, .region_bytes = 4096, .layers = 1, .jobs_in_flight = 3,
       .sink = a, .memory = {.workspace_bytes = 100, .layer_bytes = 10}},
      {.session_id = 2, .regions = 1, .region_bytes = 1000, .layers = 2, .jobs_in_flight = 1,
       .sink = a, .memory = {.workspace_bytes = 50, .mapped_device_bytes = 7}},
      /* detaching: counted in the totals, nobody's any more */
      {.session_id = 3, .regions = 5, .region_bytes = 5, .sink = NULL,
       .memory = {.scratch_bytes = 9}}};
  mok_engine_stats st = {.sessions = ss, .n_sessions = 3};
  const char *p = render(m, &st);
  CHECK_EQ_INT(sample(p, "mokd_regions"), 8);
  CHECK_EQ_INT(sample(p, "mokd_region_bytes"), 5101);
  CHECK_EQ_INT(sample(p, "mokd_layers"), 3);
  CHECK_EQ_INT(sample(p, "mokd_jobs_in_flight"), 4);
  CHECK_EQ_INT(sample(p, "mokd_memory_bytes{kind=\"workspace\"}"), 150);
  CHECK_EQ_INT(sample(p, "mokd_memory_bytes{kind=\"mapped_device\"}"), 7);
  CHECK_EQ_INT(sample(p, "mokd_memory_bytes{kind=\"layers\"}"), 10);
  CHECK_EQ_INT(sample(p, "mokd_memory_bytes{kind=\"scratch\"}"), 9);
  CHECK_EQ_INT(sample(p, "mokd_tenant_region_bytes{uid=\"1000\",client=\"a\"}"), 5096);
  CHECK_EQ_INT(sample(p, "mokd_tenant_jobs_in_flight{uid=\"1000\",client=\"a\"}"), 4);
  CHECK_EQ_INT(sample(p, "mokd_tenant_memory_bytes{uid=\"1000\",client=\"a\",kind=\"workspace\"}"),
               150);
  CHECK_EQ_INT(sample(p, "mokd_connections"), 3);
  CHECK_EQ_INT(sample(p, "mokd_uptime_seconds") * 1000, 1500);
  mok_metrics_free(m);
}

static void test_group_health_is_bounded_by_group(void) {
  mok_metrics *m = mok_metrics_create(0, false);
  mok_daemon_group_stats g[20];
  memset(g, 0, sizeof g);
  for (int i = 0; i < 20; i++) {
    g[i].group_id = (uint32_t)(40 - i); /* listed by id: 21..36 */
    g[i].world = 4;
    g[i].rank = 1;
    g[i].sessions = i % 2;
    snprintf(g[i].key, sizeof g[i].key, "secret-key-%d", i);
  }
  g[0].timeouts = 3; /* group 40: not listed */
  g[19].timeouts = 2, g[19].rank_missed[0] = 1, g[19].rank_missed[3] = 2, g[19].broken = true;
  g[19].nccl = true, g[19].sequence = 77;
  mok_engine_stats st = {.groups = g, .n_groups = 20};
  const char *p = render(m, &st);
  CHECK_EQ_INT(sample(p, "mokd_groups{state=\"held\"}"), 10);
  CHECK_EQ_INT(sample(p, "mokd_groups{state=\"lingering\"}"), 10);
  CHECK_EQ_INT(sample(p, "mokd_groups{state=\"broken\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_groups_unlisted"), 4);
  CHECK_EQ_INT(sample(p, "mokd_group_timeouts_total{group=\"21\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_group_rank_missed_total{group=\"21\",rank=\"0\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_group_rank_missed_total{group=\"21\",rank=\"3\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_group_rank_missed_total{group=\"21\",rank=\"2\"}"), 0);
  CHECK(isnan(sample(p, "mokd_group_rank_missed_total{group=\"21\",rank=\"1\"}"))); /* itself */
  CHECK_EQ_INT(sample(p, "mokd_group_broken{group=\"21\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_group_broken{group=\"22\"}"), 0);
  CHECK_EQ_INT(sample(p, "mokd_group_jobs_total{group=\"21\"}"), 77);
  CHECK_EQ_INT(sample(p, "mokd_group_info{group=\"21\",rank=\"1\",world=\"4\",transport=\"nccl\"}"),
               1);
  CHECK_EQ_INT(sample(p, "mokd_group_timeouts_total{group=\"36\"}"), 0);
  CHECK(isnan(sample(p, "mokd_group_timeouts_total{group=\"37\"}")));
  CHECK(isnan(sample(p, "mokd_group_timeouts_total{group=\"40\"}")));
  CHECK(strstr(p, "secret-key") == NULL); /* keys are tenants' metadata */
  mok_metrics_free(m);
}

/* The reasons of the real refusal messages (quota.c), the server's and the
 * engine's formats, and names given as they are. */
static void test_refusals_count_under_the_setting_they_name(void) {
  mok_quota q = {.lim = {.max_regions_total = 1, .max_regions_per_uid = 1,
                         .max_region_bytes_per_uid = 10, .max_layers_per_uid = 1,
                         .max_groups_per_uid = 1, .max_group_bytes_per_uid = 100}};
  mok_uid_usage *u = mok_quota_user(&q, 1000, true);
  char msg[320];
  CHECK_EQ_INT(mok_quota_check(&q, u, 1, 0, 0, msg, sizeof msg), MOK_OK);
  mok_quota_region(&q, u, +1, 5);
  CHECK_EQ_INT(mok_quota_check(&q, u, 1, 0, 0, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-regions-total") == 0);
  q.lim.max_regions_total = 0;
  CHECK_EQ_INT(mok_quota_check(&q, u, 1, 0, 0, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-regions-per-uid") == 0);
  CHECK_EQ_INT(mok_quota_check(&q, u, 0, 6, 0, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-region-bytes-per-uid") == 0);
  mok_quota_layer(u, +1);
  CHECK_EQ_INT(mok_quota_check(&q, u, 0, 0, 1, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-layers-per-uid") == 0);
  mok_quota_group *g;
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "k", 200, 0, &g, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-group-bytes-per-uid") == 0);
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "k", 50, 0, &g, msg, sizeof msg), MOK_OK);
  mok_quota_group_settle(g, true);
  CHECK_EQ_INT(mok_quota_group_reserve(&q, u, "k2", 10, 0, &g, msg, sizeof msg), MOK_ELIMIT);
  CHECK(strcmp(mok_metrics_refusal_reason(msg), "max-groups-per-uid") == 0);
  mok_quota_free(&q);
  const struct { const char *msg, *reason; } cases[] = {
      /* server.c's connection refusals */
      {"uid 5 (gid 5) may not use this mokd: not in allow-uids/allow-gids", "allow-list"},
      {"mokd has 4 sessions already (max-sessions)", "max-sessions"},
      {"uid 5 has 2 sessions already (max-sessions-per-uid 2)", "max-sessions-per-uid"},
      {"mokd has 5 of 8 sessions in use; the last 4 are kept for uids that have none "
       "(session-reserve), and uid 5 has 1", "session-reserve"},
      {"mokd is out of memory", "out-of-memory"},
      /* the engine thread's per-session limits */
      {"session already has 4 regions (limit 4)", "max-regions"},
      {"registering 9 bytes would exceed the session's quota of 8 bytes (0 in use)",
       "max-region-bytes"},
      {"session already has 2 layers (limit 2)", "max-layers"},
      {"max-pending-requests", "max-pending-requests"},
      {"protocol", "protocol"},
      {"hello-timeout-ms", "hello-timeout-ms"},
      {"something else entirely", "other"},
      {"", "other"},
      {NULL, "other"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    CHECK_MSG(strcmp(mok_metrics_refusal_reason(cases[i].msg), cases[i].reason) == 0,
              "\"%s\" -> %s, not %s", cases[i].msg ? cases[i].msg : "(null)",
              mok_metrics_refusal_reason(cases[i].msg), cases[i].reason);
  mok_metrics *m = mok_metrics_create(0, false);
  mok_metrics_refused(m, "mokd has 4 sessions already (max-sessions)");
  mok_metrics_refused(m, "mokd has 4 sessions already (max-sessions)");
  mok_metrics_refused(m, "???");
  mok_cmd c = {.kind = MOK_CMD_REGISTER, .status = MOK_ELIMIT};
  snprintf(c.message, sizeof c.message, "session already has 4 regions (limit 4)");
  mok_metrics_command_done(m, &c);
  c.status = MOK_OK;
  c.in.reg.bytes = 4096;
  mok_metrics_command_done(m, &c);
  mok_metrics_command_done(m, &c);
  c.kind = MOK_CMD_CREATE_LAYER;
  mok_metrics_command_done(m, &c);
  mok_metrics_http_answered(m, 404);
  mok_metrics_http_answered(m, 999); /* not a code of ours: not counted */
  mok_metrics_http_over_cap(m);
  mok_metrics_http_timed_out(m);
  const char *p = render(m, &no_stats);
  CHECK_EQ_INT(sample(p, "mokd_refusals_total{reason=\"max-sessions\"}"), 2);
  CHECK_EQ_INT(sample(p, "mokd_refusals_total{reason=\"other\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_refusals_total{reason=\"max-regions\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_refusals_total{reason=\"allow-list\"}"), 0); /* every reason shown */
  CHECK_EQ_INT(sample(p, "mokd_regions_registered_total"), 2);
  CHECK_EQ_INT(sample(p, "mokd_region_bytes_registered_total"), 8192);
  CHECK_EQ_INT(sample(p, "mokd_layers_created_total"), 1);
  CHECK_EQ_INT(sample(p, "mokd_http_responses_total{code=\"404\"}"), 1);
  CHECK_EQ_INT(sample(p, "mokd_http_responses_total{code=\"200\"}"), 0);
  CHECK(strstr(p, "999") == NULL);
  CHECK_EQ_INT(sample(p, "mokd_http_refused_connections_total"), 1);
  CHECK_EQ_INT(sample(p, "mokd_http_timeouts_total"), 1);
  CHECK_EQ_INT(sample(p, "mokd_http_connections"), 1);
  mok_metrics_free(m);
  /* metrics off: every call is a no-op */
  mok_metrics_refused(NULL, "x");
  mok_metrics_command_done(NULL, &c);
  CHECK(mok_metrics_session_open(NULL, 1, "x") == NULL);
  mok_metrics_session_close(NULL, NULL);
}

static const check_case cases[] = {
    CHECK_CASE(test_jobs_count_by_op_status_and_latency),
    CHECK_CASE(test_every_family_has_help_and_type_once_before_its_samples),
    CHECK_CASE(test_label_sets_are_bounded_and_fold_into_other),
    CHECK_CASE(test_free_label_sets_are_reused_least_recent_first),
    CHECK_CASE(test_gauges_come_from_the_engine_stats),
    CHECK_CASE(test_group_health_is_bounded_by_group),
    CHECK_CASE(test_refusals_count_under_the_setting_they_name),
    {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
