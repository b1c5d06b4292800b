/* SPDX-License-Identifier: Apache-2.0 */
/* The metrics endpoint's settings (the metrics-* keys of mokd.conf;
 * docs/metrics.md). Parsed beside the rest of the configuration
 * (daemon/config.c hands every metrics-* key to mok_metrics_config_set). */
#ifndef MOK_METRICS_CONFIG_H
#define MOK_METRICS_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>

#define MOK_METRICS_LABEL_SETS_MAX 256 /* metrics-max-label-sets at most */

typedef struct mok_metrics_config {
  const char *listen;       /* "127.0.0.1:9464" or "[::1]:9464"; NULL: no TCP endpoint */
  const char *socket_path;  /* a Unix socket; NULL: none */
  const char *socket_group; /* its group; NULL: mokd's own */
  mode_t socket_mode;       /* 0660 */
  bool allow_nonlocal;      /* metrics-listen may name an address that is not loopback */
  bool per_uid;             /* series labelled by uid and client name */
  uint32_t max_connections; /* at once, both endpoints together */
  uint32_t timeout_ms;      /* a connection's whole life: request, engine, response */
  uint32_t max_label_sets;  /* distinct (uid, client) label sets; the rest are "other" */
} mok_metrics_config;

void mok_metrics_config_defaults(mok_metrics_config *c);

/* Apply one key. Returns 1 when key is not a metrics-* key (nothing done),
 * 0 when applied, -1 with err filled when the value is bad. */
int mok_metrics_config_set(mok_metrics_config *c, const char *key, const char *value, char *err,
                           size_t errlen);

/* "A.B.C.D:PORT" or "[IPv6]:PORT" (numeric only, port 1..65535). Fills
 * addr and *loopback (127.0.0.0/8 or ::1). Returns 0, or -1 with err. */
int mok_metrics_parse_listen(const char *v, struct sockaddr_storage *addr, bool *loopback,
                             char *err, size_t errlen);

/* The settings as a whole (what one key alone cannot say: a non-loopback
 * address needs metrics-allow-nonlocal). Returns 0, or -1 with err. */
int mok_metrics_config_check(const mok_metrics_config *c, char *err, size_t errlen);

#endif
