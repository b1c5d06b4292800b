/* The configuration file parser. */
#include "check.h"
#include "config.h"

static void test_parses_settings_comments_and_blank_lines(void) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  const char *text = "# mokd\n\nsocket = /tmp/a.sock  # trailing comment\nengine=cpu\n"
                     "threads = 3\nmax-region-bytes = 1048576\nmax_layers = 7\n"
                     "socket-mode = 0600\n";
  CHECK_MSG(mok_config_parse(&cfg, text, err, sizeof err) == 0, "%s", err);
  CHECK(strcmp(cfg.socket_path, "/tmp/a.sock") == 0);
  CHECK(strcmp(cfg.engine, "cpu") == 0);
  CHECK_EQ_INT(cfg.engine_cfg.threads, 3);
  CHECK_EQ_INT(cfg.limits.max_region_bytes, 1048576);
  CHECK_EQ_INT(cfg.limits.max_layers, 7);
  CHECK_EQ_INT(cfg.socket_mode, 0600);
}

static void expect_error(const char *text, const char *needle) {
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256] = "";
  CHECK_EQ_INT(mok_config_parse(&cfg, text, err, sizeof err), -1);
  CHECK_STR_CONTAINS(err, needle);
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

static const check_case cases[] = {CHECK_CASE(test_parses_settings_comments_and_blank_lines),
                                   CHECK_CASE(test_rejects_bad_lines_with_their_number), {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
