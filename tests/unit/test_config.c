/* SPDX-License-Identifier: Apache-2.0 */
/* The configuration file parser. */
#include "harness/check.h"
#include "config.h"

static void test_parses_settings_comments_and_blank_lines(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  const char *text = "# mokd\n\nsocket = /tmp/a.sock  # trailing comment\nengine=cpu\n"
                     "threads = 3\nmax-region-bytes = 1048576\nmax_layers = 7\n"
                     "socket-mode = 0600\nfence-timeout-ms = 1500\njob-timeout-ms = 9000\n";
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
  CHECK(strcmp(cfg.socket_path, "/tmp/a.sock") == 0);
  CHECK(strcmp(cfg.engine, "cpu") == 0);
  CHECK_EQ_INT(cfg.engine_cfg.threads, 3);
  CHECK_EQ_INT(cfg.limits.max_region_bytes, 1048576);
  CHECK_EQ_INT(cfg.limits.max_layers, 7);
  CHECK_EQ_INT(cfg.socket_mode, 0600);
  CHECK_EQ_INT(cfg.engine_cfg.fence_timeout_ms, 1500);
  CHECK_EQ_INT(cfg.engine_cfg.job_timeout_ms, 9000);
}

static void expect_error(const char *text, const char *needle) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  CHECK_EQ_INT(mok_config_parse(&cfg, text, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, needle);
}

static void test_group_settings(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  CHECK(!cfg.engine_cfg.group_linger_set && cfg.engine_cfg.group_dir == NULL);
  char err[256] = "";
  CHECK_MSG(mok_config_parse(&cfg, "group-dir = /var/lib/mok/groups\ngroup_linger_ms = 0\n", err,
                             sizeof err) == 0,
            "%s", err);
  CHECK(strcmp(cfg.engine_cfg.group_dir, "/var/lib/mok/groups") == 0);
  CHECK(cfg.engine_cfg.group_linger_set && cfg.engine_cfg.group_linger_ms == 0);
  expect_error("group-dir = relative/dir\n", "bad value");
  expect_error("group-linger-ms = 86400001\n", "bad value");
  expect_error("group-linger-ms = soon\n", "bad value");
}

static void test_rejects_bad_lines_with_their_number(void) {
  expect_error("engine = cpu\nno equals sign\n", "line 2");
  expect_error("bogus = 1\n", "unknown setting \"bogus\"");
  expect_error("threads = -1\n", "bad value");
  expect_error("threads = 12abc\n", "bad value");
  expect_error("threads = 99999999999999999999999\n", "bad value");
  expect_error("max-sessions = 70000\n", "bad value"); /* over its bound */
  expect_error("socket-mode = 999\n", "bad value");     /* not octal */
  expect_error("log-level = loud\n", "bad value");
  char longline[2000];
  memset(longline, 'a', sizeof longline - 1);
  longline[sizeof longline - 1] = '\0';
  expect_error(longline, "longer than");
}

static void test_access_settings(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  CHECK(cfg.socket_group == NULL);
  CHECK_EQ_INT(cfg.n_allow_uids, 0);
  CHECK(cfg.max_sessions_per_uid > 0); /* a cap by default */
  char err[256] = "";
  const char *text = "socket-group = mok\nallow-uids = 0, 1000,1001\nallow_gids=27\n"
                     "max-sessions-per-uid = 4\nmax-regions-per-uid = 10\n"
                     "max-region-bytes-per-uid = 4096\nmax-layers-per-uid = 3\n"
                     "socket-group = mok-clients\n"; /* set twice: the last wins */
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
  CHECK(strcmp(cfg.socket_group, "mok-clients") == 0);
  CHECK_EQ_INT(cfg.n_allow_uids, 3);
  CHECK_EQ_INT(cfg.allow_uids[0], 0);
  CHECK_EQ_INT(cfg.allow_uids[2], 1001);
  CHECK_EQ_INT(cfg.n_allow_gids, 1);
  CHECK_EQ_INT(cfg.allow_gids[0], 27);
  CHECK_EQ_INT(cfg.max_sessions_per_uid, 4);
  CHECK_EQ_INT(cfg.max_regions_per_uid, 10);
  CHECK_EQ_INT(cfg.max_region_bytes_per_uid, 4096);
  CHECK_EQ_INT(cfg.max_layers_per_uid, 3);
  CHECK(mok_config_parse(&cfg, "allow-uids =\nsocket-group =\n", err, sizeof err) == 0);
  CHECK_EQ_INT(cfg.n_allow_uids, 0); /* an empty list lets everyone in again */
  CHECK(cfg.socket_group == NULL);
  expect_error("allow-uids = 1,,2\n", "bad value");
  expect_error("allow-uids = 1,\n", "bad value");
  expect_error("allow-uids = -1\n", "bad value");
  expect_error("allow-uids = 4294967295\n", "bad value"); /* (uid_t)-1 is no uid */
  expect_error("allow-gids = 12 34\n", "bad value");
  expect_error("socket =\n", "bad value");
  char many[1024] = "allow-uids = 0";
  for (int i = 1; i <= MOK_ALLOW_MAX; i++) snprintf(many + strlen(many), 16, ",%d", i);
  expect_error(many, "bad value"); /* more than MOK_ALLOW_MAX */
}

/* The client limits are fair shares by default: nothing unlimited, one
 * uid's share a fraction of the daemon's, the region cap well below
 * vm.max_map_count's default (65530). */
static void test_client_limits_default_to_fair_shares(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  CHECK(cfg.max_sessions_per_uid > 0 && cfg.max_sessions_per_uid < cfg.max_sessions);
  CHECK(cfg.session_reserve > 0 &&
        cfg.max_sessions_per_uid <= cfg.max_sessions - cfg.session_reserve);
  CHECK(cfg.max_regions_total > 0 && cfg.max_regions_total <= 65530 / 2);
  CHECK(cfg.max_regions_per_uid > 0 && cfg.max_regions_per_uid <= cfg.max_regions_total / 2);
  CHECK(cfg.max_region_bytes_per_uid > 0 && cfg.max_layers_per_uid > 0);
  CHECK(cfg.limits.max_jobs_per_uid > 0);
  CHECK(cfg.max_groups_per_uid > 0 && cfg.max_group_bytes_per_uid > 0);
  CHECK(cfg.limits.max_regions <= cfg.max_regions_per_uid);
  CHECK_EQ_INT(cfg.n_admin_uids + cfg.n_admin_gids, 0);
  CHECK_EQ_INT(cfg.engine_cfg.workspace_idle_ms, 0); /* 0: the engine's default */
  char err[256] = "";
  const char *text = "session-reserve = 8\nmax-regions-total = 1000\nmax-groups-per-uid = 4\n"
                     "max_group_bytes_per_uid = 1073741824\nmax-jobs-per-uid = 0\n"
                     "admin-uids = 0, 1500\nadmin_gids = 27\nworkspace-idle-ms = 86400000\n";
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
  CHECK_EQ_INT(cfg.session_reserve, 8);
  CHECK_EQ_INT(cfg.max_regions_total, 1000);
  CHECK_EQ_INT(cfg.max_groups_per_uid, 4);
  CHECK_EQ_INT(cfg.max_group_bytes_per_uid, 1ull << 30);
  CHECK_EQ_INT(cfg.limits.max_jobs_per_uid, 0); /* an explicit 0: no limit */
  CHECK(cfg.n_admin_uids == 2 && cfg.admin_uids[1] == 1500);
  CHECK(cfg.n_admin_gids == 1 && cfg.admin_gids[0] == 27);
  CHECK_EQ_INT(cfg.engine_cfg.workspace_idle_ms, 86400000);
  CHECK(mok_config_parse(&cfg, "workspace-idle-ms = 0\n", err, sizeof err) == 0);
  CHECK_EQ_INT(cfg.engine_cfg.workspace_idle_ms, 0);
  expect_error("workspace-idle-ms = 86400001\n", "bad value");
  expect_error("workspace-idle-ms = -5\n", "bad value");
  expect_error("workspace-idle-ms = 10s\n", "bad value");
  expect_error("session-reserve = 65537\n", "bad value");
  expect_error("max-regions-total = 16777217\n", "bad value");
  expect_error("max-groups-per-uid = lots\n", "bad value");
  expect_error("max-group-bytes-per-uid = 18446744073709551616\n", "bad value");
  expect_error("admin-uids = 1,,2\n", "bad value");
  expect_error("admin-gids = 4294967295\n", "bad value");
  expect_error("admin-uids = root\n", "bad value");
  CHECK(mok_config_parse(&cfg, "admin-uids =\n", err, sizeof err) == 0);
  CHECK_EQ_INT(cfg.n_admin_uids, 0);
}

/* The metrics endpoint: off by default; every key; loopback unless told. */
static void test_metrics_settings(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  CHECK(cfg.metrics.listen == NULL && cfg.metrics.socket_path == NULL && !cfg.metrics.per_uid);
  CHECK(!cfg.metrics.allow_nonlocal);
  CHECK_EQ_INT(cfg.metrics.max_label_sets, 32);
  char err[256] = "";
  CHECK_MSG(mok_config_parse(&cfg,
                             "metrics-listen = 127.0.0.1:9464\nmetrics_socket = /run/m.sock\n"
                             "metrics-socket-mode = 0600\nmetrics-socket-group = mok\n"
                             "metrics-per-uid = yes\nmetrics-max-label-sets = 0\n"
                             "metrics-max-connections = 2\nmetrics-timeout-ms = 100\n",
                             err, sizeof err) == 0,
            "%s", err);
  CHECK(strcmp(cfg.metrics.listen, "127.0.0.1:9464") == 0);
  CHECK(strcmp(cfg.metrics.socket_path, "/run/m.sock") == 0);
  CHECK(strcmp(cfg.metrics.socket_group, "mok") == 0);
  CHECK_EQ_INT(cfg.metrics.socket_mode, 0600);
  CHECK(cfg.metrics.per_uid);
  CHECK_EQ_INT(cfg.metrics.max_label_sets, 0);
  CHECK_EQ_INT(cfg.metrics.max_connections, 2);
  CHECK_EQ_INT(cfg.metrics.timeout_ms, 100);
  CHECK_EQ_INT(mok_metrics_config_check(&cfg.metrics, err, sizeof err), 0);
  /* empty values turn an endpoint off again */
  CHECK(mok_config_parse(&cfg, "metrics-listen =\nmetrics-socket =\n", err, sizeof err) == 0);
  CHECK(cfg.metrics.listen == NULL && cfg.metrics.socket_path == NULL);
  expect_error("metrics-listen = localhost:9464\n", "line 1: metrics-listen \"localhost:9464\"");
  expect_error("metrics-listen = 127.0.0.1\n", "numeric ADDRESS:PORT");
  expect_error("metrics-listen = 127.0.0.1:0\n", "numeric ADDRESS:PORT");
  expect_error("metrics-listen = 127.0.0.1:65536\n", "numeric ADDRESS:PORT");
  expect_error("metrics-listen = ::1:9464\n", "numeric ADDRESS:PORT");
  expect_error("metrics-socket = relative.sock\n", "bad value");
  expect_error("metrics-per-uid = maybe\n", "bad value");
  expect_error("metrics-max-label-sets = 257\n", "bad value");
  expect_error("metrics-max-connections = 0\n", "bad value");
  expect_error("metrics-socket-mode = 0888\n", "bad value");
  expect_error("metrics-colour = red\n", "unknown setting \"metrics-colour\"");
  /* a non-loopback address needs leave, whatever the order of the keys */
  mok_server_config_defaults(&cfg);
  const char *nonlocal[] = {"0.0.0.0:9464", "10.1.2.3:9464", "[::]:9464", "[fe80::1]:9464"};
  for (size_t i = 0; i < 4; i++) {
    char text[128];
    snprintf(text, sizeof text, "metrics-listen = %s\n", nonlocal[i]);
    CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
    CHECK_EQ_INT(mok_metrics_config_check(&cfg.metrics, err, sizeof err), -1);
    CHECK_STR_CONTAINS(err, "metrics-allow-nonlocal");
  }
  CHECK(mok_config_parse(&cfg, "metrics-allow-nonlocal = yes\n", err, sizeof err) == 0);
  CHECK_EQ_INT(mok_metrics_config_check(&cfg.metrics, err, sizeof err), 0);
  const char *local[] = {"127.0.0.1:1", "127.8.9.10:65535", "[::1]:9464"};
  cfg.metrics.allow_nonlocal = false;
  for (size_t i = 0; i < 3; i++) {
    char text[128];
    snprintf(text, sizeof text, "metrics-listen = %s\n", local[i]);
    CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
    CHECK_MSG(mok_metrics_config_check(&cfg.metrics, err, sizeof err) == 0, "%s: %s", local[i], err);
  }
}

/* deploy/mokd.conf parses, and documents every key the parser knows. */
static void test_the_shipped_config_documents_every_key(void) {
  FILE *f = fopen("deploy/mokd.conf", "r");
  if (!f) {
    printf("# skipped: run from the repository root to read deploy/mokd.conf\n");
    return;
  }
  static char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, f);
  fclose(f);
  text[n] = '\0';
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "deploy/mokd.conf: %s", err);
  const char *keys[] = {"max-sessions", "session-reserve", "hello-timeout-ms",
                        "max-pending-requests", "drain-ms", "max-regions", "max-region-bytes",
                        "max-layers", "max-regions-total", "max-sessions-per-uid",
                        "max-regions-per-uid", "max-region-bytes-per-uid", "max-layers-per-uid",
                        "max-jobs-per-uid", "max-groups-per-uid", "max-group-bytes-per-uid",
                        "socket-mode", "socket-group", "allow-uids", "allow-gids", "admin-uids",
                        "admin-gids", "group-dir", "group-linger-ms", "workspace-idle-ms",
                        "fence-timeout-ms", "threads", "device", "engine", "log-level",
                        "metrics-listen", "metrics-allow-nonlocal", "metrics-socket",
                        "metrics-socket-mode", "metrics-socket-group", "metrics-per-uid",
                        "metrics-max-label-sets", "metrics-max-connections",
                        "metrics-timeout-ms"};
  for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
    char want[64];
    snprintf(want, sizeof want, "%s =", keys[i]);
    CHECK_MSG(strstr(text, want) != NULL, "deploy/mokd.conf does not document %s", keys[i]);
  }
}

static const check_case cases[] = {CHECK_CASE(test_parses_settings_comments_and_blank_lines),
                                   CHECK_CASE(test_client_limits_default_to_fair_shares),
                                   CHECK_CASE(test_the_shipped_config_documents_every_key),
                                   CHECK_CASE(test_metrics_settings),
                                   CHECK_CASE(test_rejects_bad_lines_with_their_number),
                                   CHECK_CASE(test_group_settings),
                                   CHECK_CASE(test_access_settings), {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
