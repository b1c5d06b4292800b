/* SPDX-License-Identifier: Apache-2.0 */
/* libFuzzer: mokd's configuration parser (daemon/config.c) on arbitrary
 * text, from the defaults, as mokd reads /etc/mok/mokd.conf. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "metrics_config.h"
#include "log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > 1 << 16) return 0; /* mok_config_load refuses larger files */
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  char err[256];
  err[0] = '\0';
  int r = mok_config_parse(&cfg, text, err, sizeof err);
  if (r < 0 && !err[0]) abort(); /* a refusal names the line */
  if (r == 0) {
    if (cfg.n_allow_uids > MOK_ALLOW_MAX || cfg.n_allow_gids > MOK_ALLOW_MAX) abort();
    if (!cfg.socket_path || !cfg.engine || (cfg.socket_mode & ~0777u)) abort();
    (void)strlen(cfg.socket_path), (void)strlen(cfg.engine); /* readable strings */
    if (cfg.socket_group) (void)strlen(cfg.socket_group);
    /* the metrics keys: an address given parses, limits within bounds */
    const mok_metrics_config *mc = &cfg.metrics;
    struct sockaddr_storage a;
    bool loopback;
    if (mc->listen && mok_metrics_parse_listen(mc->listen, &a, &loopback, err, sizeof err)) abort();
    if (mc->socket_path && mc->socket_path[0] != '/') abort();
    if (mc->max_label_sets > MOK_METRICS_LABEL_SETS_MAX || mc->max_connections == 0 ||
        mc->timeout_ms == 0 || (mc->socket_mode & ~0777u))
      abort();
    if (mc->listen && !loopback && !mc->allow_nonlocal &&
        mok_metrics_config_check(mc, err, sizeof err) == 0)
      abort(); /* a non-loopback address is refused without leave */
  }
  mok_log_set_level(MOK_LOG_ERROR); /* log-level lines must not make the fuzzer chatty */
  free(text);
  return 0;
}
