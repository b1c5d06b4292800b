/* SPDX-License-Identifier: Apache-2.0 */
/* The client limits' table (daemon/client_limits.c): every key is one the
 * configuration takes and sets the field the table names, the defaults come
 * from the table, and the one check refuses exactly past the limit. */
#include "harness/check.h"
#include "client_limits.h"
#include "config.h"

static uint64_t field_value(const mok_server_config *cfg, const mok_limit_info *l) {
  const char *p = (const char *)cfg + l->field;
  if (l->width == 4) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
  }
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

static void test_every_key_is_a_setting_of_its_field(void) {
  for (size_t i = 0; i < MOK_LIMIT_COUNT; i++) {
    const mok_limit_info *l = &mok_limit_table[i];
    CHECK_MSG(l->key && l->counts && (l->width == 4 || l->width == 8), "limit %zu", i);
    mok_server_config cfg;
    mok_server_config_defaults(&cfg);
    CHECK_MSG(field_value(&cfg, l) == l->default_value, "%s: default", l->key);
    char line[128], err[256] = "";
    snprintf(line, sizeof line, "%s = 7\n", l->key);
    CHECK_MSG(mok_config_parse(&cfg, line, err, sizeof err) == 0, "%s: %s", l->key, err);
    CHECK_MSG(field_value(&cfg, l) == 7, "%s does not set its field", l->key);
  }
}

static void test_the_check_refuses_past_the_limit(void) {
  uint64_t before = mok_limit_refusals(MOK_LIMIT_REGIONS);
  CHECK(!mok_limit_exceeded(MOK_LIMIT_REGIONS, 4, 3, 1));
  CHECK(mok_limit_exceeded(MOK_LIMIT_REGIONS, 4, 4, 1));
  CHECK(mok_limit_exceeded(MOK_LIMIT_REGIONS, 0, 0, 1)); /* a session's 0 refuses */
  CHECK_EQ_INT(mok_limit_refusals(MOK_LIMIT_REGIONS) - before, 2);
  CHECK(!mok_limit_exceeded(MOK_LIMIT_REGIONS_PER_UID, 0, 1u << 30, 1)); /* a uid's 0: none */
  CHECK(mok_limit_exceeded(MOK_LIMIT_REGION_BYTES_PER_UID, 100, 90, UINT64_MAX)); /* no wrap */
  CHECK(!mok_limit_exceeded(MOK_LIMIT_REGION_BYTES_PER_UID, 100, 90, 10));
}

static const check_case cases[] = {CHECK_CASE(test_every_key_is_a_setting_of_its_field),
                                   CHECK_CASE(test_the_check_refuses_past_the_limit), {0}};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
