/* SPDX-License-Identifier: Apache-2.0 */
#include "metrics_config.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void mok_metrics_config_defaults(mok_metrics_config *c) {
  memset(c, 0, sizeof *c);
  c->socket_mode = 0660;
  c->max_connections = 16;
  c->timeout_ms = 5000;
  c->max_label_sets = 32;
}

/* One copy per key, kept reachable (like config.c's strings). */
static char *owned_listen, *owned_socket, *owned_group;

static const char *keep(char **slot, const char *v) {
  char *copy = strdup(v);
  if (!copy) return NULL;
  free(*slot);
  *slot = copy;
  return copy;
}

static int parse_bool(const char *v, bool *ret) {
  if (!strcmp(v, "yes") || !strcmp(v, "true") || !strcmp(v, "on") || !strcmp(v, "1")) *ret = true;
  else if (!strcmp(v, "no") || !strcmp(v, "false") || !strcmp(v, "off") || !strcmp(v, "0"))
    *ret = false;
  else return -1;
  return 0;
}

static int parse_num(const char *v, uint64_t min, uint64_t max, int base, uint64_t *ret) {
  if (!*v || *v == '-' || *v == '+' || *v == ' ') return -1;
  errno = 0;
  char *end;
  unsigned long long x = strtoull(v, &end, base);
  if (errno || *end || x < min || x > max) return -1;
  *ret = x;
  return 0;
}

int mok_metrics_parse_listen(const char *v, struct sockaddr_storage *addr, bool *loopback,
                             char *err, size_t errlen) {
  char host[64];
  const char *port;
  memset(addr, 0, sizeof *addr);
  if (v[0] == '[') {
    const char *close = strchr(v, ']');
    if (!close || close[1] != ':' || (size_t)(close - v - 1) >= sizeof host) goto bad;
    memcpy(host, v + 1, (size_t)(close - v - 1));
    host[close - v - 1] = '\0';
    port = close + 2;
  } else {
    const char *colon = strrchr(v, ':');
    if (!colon || strchr(v, ':') != colon || (size_t)(colon - v) >= sizeof host) goto bad;
    memcpy(host, v, (size_t)(colon - v));
    host[colon - v] = '\0';
    port = colon + 1;
  }
  uint64_t p;
  if (parse_num(port, 1, 65535, 10, &p)) goto bad;
  struct sockaddr_in *a4 = (struct sockaddr_in *)addr;
  struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)addr;
  if (v[0] != '[' && inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
    a4->sin_family = AF_INET;
    a4->sin_port = htons((uint16_t)p);
    *loopback = (ntohl(a4->sin_addr.s_addr) >> 24) == 127;
    return 0;
  }
  if (v[0] == '[' && inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
    a6->sin6_family = AF_INET6;
    a6->sin6_port = htons((uint16_t)p);
    *loopback = IN6_IS_ADDR_LOOPBACK(&a6->sin6_addr);
    return 0;
  }
bad:
  snprintf(err, errlen,
           "metrics-listen \"%s\": expected a numeric ADDRESS:PORT (127.0.0.1:9464, [::1]:9464)",
           v);
  return -1;
}

int mok_metrics_config_check(const mok_metrics_config *c, char *err, size_t errlen) {
  if (!c->listen) return 0;
  struct sockaddr_storage a;
  bool loopback = false;
  if (mok_metrics_parse_listen(c->listen, &a, &loopback, err, errlen)) return -1;
  if (!loopback && !c->allow_nonlocal) {
    snprintf(err, errlen,
             "metrics-listen %s is not a loopback address: the endpoint cannot tell who "
             "connects (docs/metrics.md); set metrics-allow-nonlocal = yes to serve it there",
             c->listen);
    return -1;
  }
  return 0;
}

/* "metrics-foo" or "metrics_foo": the part after the prefix, with dashes. */
static const char *metrics_key(const char *key, char *buf, size_t len) {
  if (strncmp(key, "metrics-", 8) && strncmp(key, "metrics_", 8)) return NULL;
  snprintf(buf, len, "%s", key + 8);
  for (char *p = buf; *p; p++)
    if (*p == '_') *p = '-';
  return buf;
}

int mok_metrics_config_set(mok_metrics_config *c, const char *key, const char *value, char *err,
                           size_t errlen) {
  char kb[48];
  const char *k = metrics_key(key, kb, sizeof kb);
  if (!k) return 1;
  uint64_t n;
  if (!strcmp(k, "listen")) {
    struct sockaddr_storage a;
    bool lo;
    if (!*value) c->listen = NULL;
    else if (mok_metrics_parse_listen(value, &a, &lo, err, errlen)) return -1;
    else if (!(c->listen = keep(&owned_listen, value))) goto bad;
  } else if (!strcmp(k, "socket")) {
    if (!*value) c->socket_path = NULL;
    else if (value[0] != '/' || strlen(value) > 107 || !(c->socket_path = keep(&owned_socket, value)))
      goto bad;
  } else if (!strcmp(k, "socket-group")) {
    if (!*value) c->socket_group = NULL;
    else if (strlen(value) > 64 || !(c->socket_group = keep(&owned_group, value))) goto bad;
  } else if (!strcmp(k, "socket-mode")) {
    if (parse_num(value, 0, 0777, 8, &n)) goto bad;
    c->socket_mode = (mode_t)n;
  } else if (!strcmp(k, "allow-nonlocal")) {
    if (parse_bool(value, &c->allow_nonlocal)) goto bad;
  } else if (!strcmp(k, "per-uid")) {
    if (parse_bool(value, &c->per_uid)) goto bad;
  } else if (!strcmp(k, "max-connections")) {
    if (parse_num(value, 1, 1024, 10, &n)) goto bad;
    c->max_connections = (uint32_t)n;
  } else if (!strcmp(k, "timeout-ms")) {
    if (parse_num(value, 10, 600000, 10, &n)) goto bad;
    c->timeout_ms = (uint32_t)n;
  } else if (!strcmp(k, "max-label-sets")) {
    if (parse_num(value, 0, MOK_METRICS_LABEL_SETS_MAX, 10, &n)) goto bad;
    c->max_label_sets = (uint32_t)n;
  } else {
    snprintf(err, errlen, "unknown setting \"%s\"", key);
    return -1;
  }
  return 0;
bad:
  snprintf(err, errlen, "bad value \"%s\" for %s", value, key);
  return -1;
}
