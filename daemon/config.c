/* SPDX-License-Identifier: Apache-2.0 */
#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_limits.h"
#include "log.h"
#include "mok_enums.h"

/* The defaults, before any file or option (kept here, beside the parser,
 * so that the parser and its fuzzer need none of the server). */
void mok_server_config_defaults(mok_server_config *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->socket_path = MOK_DEFAULT_SOCKET;
  cfg->listen_fd = -1;
  cfg->socket_mode = 0660;
  cfg->engine = "cpu";
  cfg->hello_timeout_ms = 5000;
  cfg->max_pending_requests = 64;
  cfg->drain_ms = 10000;
  mok_limits_defaults(cfg); /* the client limits: one table (client_limits.c) */
  mok_metrics_config_defaults(&cfg->metrics);
}

/* Strings outlive the parse (the config is read once at start-up). Each key
 * owns one copy: setting it again frees the old one, and the copies stay
 * reachable from here, so nothing leaks however often a key is set. */
static struct {
  const char *key;
  char *value;
} owned[] = {{"socket", NULL}, {"engine", NULL}, {"socket-group", NULL}, {"group-dir", NULL}};

static const char *keep_string(const char *key, const char *v) {
  for (size_t i = 0; i < sizeof owned / sizeof owned[0]; i++) {
    if (strcmp(owned[i].key, key)) continue;
    char *copy = strdup(v);
    if (!copy) return NULL;
    free(owned[i].value);
    owned[i].value = copy;
    return copy;
  }
  return NULL;
}

/* "0,1000, 1001": at most MOK_ALLOW_MAX ids, each below 2^32-1 ((uid_t)-1
 * means "no id"); an empty value empties the list. */
static int parse_id_list(const char *v, uint32_t *ids, uint32_t *ret_n) {
  uint32_t n = 0;
  const char *p = v;
  while (*p == ' ' || *p == '\t') p++;
  if (!*p) {
    *ret_n = 0;
    return 0;
  }
  for (;;) {
    while (*p == ' ' || *p == '\t') p++;
    if (*p < '0' || *p > '9' || n == MOK_ALLOW_MAX) return -1;
    errno = 0;
    char *end;
    unsigned long long x = strtoull(p, &end, 10);
    if (errno || x >= UINT32_MAX) return -1;
    ids[n++] = (uint32_t)x;
    p = end;
    while (*p == ' ' || *p == '\t') p++;
    if (!*p) break;
    if (*p++ != ',') return -1;
  }
  *ret_n = n;
  return 0;
}

static int parse_u64(const char *v, uint64_t max, uint64_t *ret, int base) {
  char *end;
  if (!*v || *v == '-') return -1;
  errno = 0;
  unsigned long long x = strtoull(v, &end, base);
  if (errno || *end || x > max) return -1;
  *ret = x;
  return 0;
}

int mok_config_set(mok_server_config *cfg, const char *key, const char *value, char *err,
                   size_t errlen) {
  uint64_t n;
  int metrics = mok_metrics_config_set(&cfg->metrics, key, value, err, errlen);
  if (metrics <= 0) return metrics; /* a metrics-* key (metrics_config.c) */
  if (strcmp(key, "socket") == 0) {
    if (!*value || !(cfg->socket_path = keep_string("socket", value))) goto bad;
  } else if (strcmp(key, "engine") == 0) {
    if (!*value || !(cfg->engine = keep_string("engine", value))) goto bad;
  } else if (strcmp(key, "socket-group") == 0 || strcmp(key, "socket_group") == 0) {
    /* resolved when the socket is made, so a missing group fails start-up */
    if (!*value) cfg->socket_group = NULL;
    else if (strlen(value) > 64 || !(cfg->socket_group = keep_string("socket-group", value)))
      goto bad;
  } else if (strcmp(key, "allow-uids") == 0 || strcmp(key, "allow_uids") == 0) {
    uint32_t ids[MOK_ALLOW_MAX], count;
    if (parse_id_list(value, ids, &count)) goto bad;
    memcpy(cfg->allow_uids, ids, count * sizeof ids[0]);
    cfg->n_allow_uids = count;
  } else if (strcmp(key, "allow-gids") == 0 || strcmp(key, "allow_gids") == 0) {
    uint32_t ids[MOK_ALLOW_MAX], count;
    if (parse_id_list(value, ids, &count)) goto bad;
    memcpy(cfg->allow_gids, ids, count * sizeof ids[0]);
    cfg->n_allow_gids = count;
  } else if (strcmp(key, "admin-uids") == 0 || strcmp(key, "admin_uids") == 0) {
    uint32_t ids[MOK_ALLOW_MAX], count;
    if (parse_id_list(value, ids, &count)) goto bad;
    memcpy(cfg->admin_uids, ids, count * sizeof ids[0]);
    cfg->n_admin_uids = count;
  } else if (strcmp(key, "admin-gids") == 0 || strcmp(key, "admin_gids") == 0) {
    uint32_t ids[MOK_ALLOW_MAX], count;
    if (parse_id_list(value, ids, &count)) goto bad;
    memcpy(cfg->admin_gids, ids, count * sizeof ids[0]);
    cfg->n_admin_gids = count;
  } else if (strcmp(key, "log-level") == 0 || strcmp(key, "log_level") == 0) {
    int l = mok_log_parse_level(value);
    if (l < 0) goto bad;
    mok_log_set_level((mok_log_level)l);
  } else if (strcmp(key, "group-dir") == 0 || strcmp(key, "group_dir") == 0) {
    /* the segments of expert-parallel groups: members of a group must agree */
    if (value[0] != '/' || strlen(value) > 200 ||
        !(cfg->engine_cfg.group_dir = keep_string("group-dir", value)))
      goto bad;
  } else if (strcmp(key, "group-linger-ms") == 0 || strcmp(key, "group_linger_ms") == 0) {
    if (parse_u64(value, 86400000, &n, 10)) goto bad;
    cfg->engine_cfg.group_linger_ms = (uint32_t)n;
    cfg->engine_cfg.group_linger_set = true;
  } else if (strcmp(key, "socket-mode") == 0 || strcmp(key, "socket_mode") == 0) {
    if (parse_u64(value, 0777, &n, 8)) goto bad;
    cfg->socket_mode = (mode_t)n;
  } else {
    struct { const char *name; uint64_t max; void *field; int width; } nums[] = {
      {"device", 1024, &cfg->engine_cfg.device, 4},
      {"threads", 1024, &cfg->engine_cfg.threads, 4},
      {"max-sessions", 65536, &cfg->max_sessions, 4},
      {"hello-timeout-ms", 3600000, &cfg->hello_timeout_ms, 4},
      {"max-pending-requests", 65536, &cfg->max_pending_requests, 4},
      {"drain-ms", 3600000, &cfg->drain_ms, 4},
      {"max-regions", 1u << 20, &cfg->limits.max_regions, 4},
      {"max-region-bytes", UINT64_MAX, &cfg->limits.max_region_bytes, 8},
      {"max-layers", 65536, &cfg->limits.max_layers, 4},
      {"max-sessions-per-uid", 65536, &cfg->max_sessions_per_uid, 4},
      {"max-regions-per-uid", 1u << 24, &cfg->max_regions_per_uid, 4},
      {"max-region-bytes-per-uid", UINT64_MAX, &cfg->max_region_bytes_per_uid, 8},
      {"max-layers-per-uid", 1u << 24, &cfg->max_layers_per_uid, 4},
      {"max-jobs-per-uid", 1u << 24, &cfg->limits.max_jobs_per_uid, 4},
      {"fence-timeout-ms", 3600000, &cfg->engine_cfg.fence_timeout_ms, 4},
      {"job-timeout-ms", 86400000, &cfg->engine_cfg.job_timeout_ms, 4},
      {"idle-spin-us", 1000000, &cfg->engine_cfg.idle_spin_us, 4},
      {"workspace-idle-ms", 86400000, &cfg->engine_cfg.workspace_idle_ms, 4},
      {"session-reserve", 65536, &cfg->session_reserve, 4},
      {"max-regions-total", 1u << 24, &cfg->max_regions_total, 4},
      {"max-groups-per-uid", 65536, &cfg->max_groups_per_uid, 4},
      {"max-group-bytes-per-uid", UINT64_MAX, &cfg->max_group_bytes_per_uid, 8},
    };
    for (size_t i = 0; i < sizeof nums / sizeof nums[0]; i++) {
      char alt[64];
      snprintf(alt, sizeof alt, "%s", nums[i].name);
      for (char *p = alt; *p; p++) if (*p == '-') *p = '_';
      if (strcmp(key, nums[i].name) && strcmp(key, alt)) continue;
      if (parse_u64(value, nums[i].max, &n, 10)) goto bad;
      if (nums[i].width == 4) *(uint32_t *)nums[i].field = (uint32_t)n;
      else *(uint64_t *)nums[i].field = n;
      return 0;
    }
    snprintf(err, errlen, "unknown setting \"%s\"", key);
    return -1;
  }
  return 0;
bad:
  snprintf(err, errlen, "bad value \"%s\" for %s", value, key);
  return -1;
}

static char *trim(char *s) {
  while (isspace((unsigned char)*s)) s++;
  char *e = s + strlen(s);
  while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
  return s;
}

int mok_config_parse(mok_server_config *cfg, const char *text, char *err, size_t errlen) {
  char line[1024];
  int lineno = 0;
  const char *p = text;
  while (*p) {
    const char *nl = strchr(p, '\n');
    size_t len = nl ? (size_t)(nl - p) : strlen(p);
    lineno++;
    if (len >= sizeof line) {
      snprintf(err, errlen, "line %d: longer than %zu bytes", lineno, sizeof line - 1);
      return -1;
    }
    memcpy(line, p, len);
    line[len] = '\0';
    p = nl ? nl + 1 : p + len;
    char *hash = strchr(line, '#');
    if (hash) *hash = '\0';
    char *s = trim(line);
    if (!*s) continue;
    char *eq = strchr(s, '=');
    if (!eq) {
      snprintf(err, errlen, "line %d: expected key = value", lineno);
      return -1;
    }
    *eq = '\0';
    char sub[200];
    if (mok_config_set(cfg, trim(s), trim(eq + 1), sub, sizeof sub) < 0) {
      snprintf(err, errlen, "line %d: %s", lineno, sub);
      return -1;
    }
  }
  return 0;
}

int mok_config_load(mok_server_config *cfg, const char *path, char *err, size_t errlen) {
  FILE *f = fopen(path, "re");
  if (!f) {
    snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
    return -1;
  }
  char *text = malloc(1 << 16);
  size_t n = text ? fread(text, 1, (1 << 16) - 1, f) : 0;
  int toolong = text && n == (1 << 16) - 1 && fgetc(f) != EOF;
  fclose(f);
  if (!text || toolong) {
    free(text);
    snprintf(err, errlen, "%s: %s", path, text ? "larger than 64 KiB" : "out of memory");
    return -1;
  }
  text[n] = '\0';
  char sub[240];
  int r = mok_config_parse(cfg, text, sub, sizeof sub);
  free(text);
  if (r < 0) snprintf(err, errlen, "%s: %s", path, sub);
  return r;
}

/* The environment variables that override settings, in one table (docs/design.md's
 * "Environment" lists them with the ones read elsewhere, and why). Each is
 * read once, here, at start-up, into the configuration, which carries it
 * down to the modules. Precedence is per variable: most win over mokd.conf
 * (the tests set them under a shipped configuration); one with a `set` flag
 * only stands in for a key the configuration left unset. */
#define CFG_FIELD(member) offsetof(mok_server_config, member)
static const struct {
  const char *name;
  size_t field;    /* a uint32_t of mok_server_config */
  size_t set_flag; /* its bool "set by the configuration", or 0: the variable wins */
} env_overrides[] = {
    {"MOK_FENCE_TIMEOUT_MS", CFG_FIELD(engine_cfg.fence_timeout_ms), 0},
    {"MOK_JOB_TIMEOUT_MS", CFG_FIELD(engine_cfg.job_timeout_ms), 0},
    {"MOK_WORKSPACE_IDLE_MS", CFG_FIELD(engine_cfg.workspace_idle_ms), 0},
    {"MOK_GROUP_LINGER_MS", CFG_FIELD(engine_cfg.group_linger_ms),
     CFG_FIELD(engine_cfg.group_linger_set)},
};

void mok_config_apply_env(mok_server_config *cfg) {
  for (size_t i = 0; i < sizeof env_overrides / sizeof env_overrides[0]; i++) {
    const char *v = getenv(env_overrides[i].name);
    if (!v || !*v) continue;
    if (env_overrides[i].set_flag) {
      bool *set = (bool *)((char *)cfg + env_overrides[i].set_flag);
      if (*set) continue; /* the configuration's key wins */
      *set = true;
    }
    /* read as the modules read it before: strtoul, so a bad value is 0 (the default) */
    uint32_t ms = (uint32_t)strtoul(v, NULL, 10);
    memcpy((char *)cfg + env_overrides[i].field, &ms, sizeof ms);
  }
}
