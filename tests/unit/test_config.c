/* The configuration file parser. */
#include "check.h"
#include "config.h"

static void test_parses_settings_comments_and_blank_lines(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  const char *text = "# mokd\n\nsocket = /tmp/a.sock  # trailing comment\nengine=cpu\n"
                     "threads = 3\nmax-region-bytes = 1048576\nmax_layers = 7\n"
                     "socket-mode = 0600\nfence-timeout-ms = 1500\n";
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
  CHECK(strcmp(cfg.socket_path, "/tmp/a.sock") == 0);
  CHECK(strcmp(cfg.engine, "cpu") == 0);
  CHECK_EQ_INT(cfg.engine_cfg.threads, 3);
  CHECK_EQ_INT(cfg.limits.max_region_bytes, 1048576);
  CHECK_EQ_INT(cfg.limits.max_layers, 7);
  CHECK_EQ_INT(cfg.socket_mode, 0600);
  CHECK_EQ_INT(cfg.engine_cfg.fence_timeout_ms, 1500);
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

static const check_case cases[] = {CHECK_CASE(test_parses_settings_comments_and_blank_lines),
                                   CHECK_CASE(test_rejects_bad_lines_with_their_number),
                                   CHECK_CASE(test_group_settings),
                                   CHECK_CASE(test_access_settings), {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
