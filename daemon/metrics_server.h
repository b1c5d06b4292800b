/* SPDX-License-Identifier: Apache-2.0 */
/* The /metrics endpoint on mokd's libuv loop: a TCP address
 * (metrics-listen) and/or a Unix socket (metrics-socket), one GET per
 * connection (daemon/http.h parses it), the page from daemon/metrics.h.
 *
 * Bounded against slow or hostile scrapers: at most metrics-max-connections
 * at once (more are closed at once), a fixed 4 KiB request buffer each,
 * metrics-timeout-ms for a connection's whole life, reading stopped once a
 * request is in, one engine stats request in flight whatever the number of
 * scrapers (the waiting ones share its answer and one rendered page).
 *
 * On the Unix socket the peer's credentials are checked: only those who
 * see every tenant in Stats (root, mokd's uid, admin-uids/-gids) are
 * served; others get 403. TCP peers cannot be told apart (docs/metrics.md).
 */
#ifndef MOK_METRICS_SERVER_H
#define MOK_METRICS_SERVER_H

#include <stdbool.h>
#include <sys/socket.h>
#include <uv.h>

#include "metrics.h"
#include "metrics_config.h"

typedef struct mok_metrics_server mok_metrics_server;

typedef struct mok_metrics_hooks {
  void *arg;
  /* Ask the engine thread for its stats; the answer is handed to
   * mok_metrics_server_engine_stats. false: it cannot be asked now. */
  bool (*request_stats)(void *arg);
  /* May this Unix-socket peer see every tenant? */
  bool (*is_admin)(void *arg, int fd, const struct ucred *cr);
  void (*page_info)(void *arg, mok_metrics_page_info *info);
} mok_metrics_hooks;

/* Start the endpoints cfg names (*ret NULL when it names none). Returns 0,
 * or -1 after logging why (the daemon should not start then). */
int mok_metrics_server_start(uv_loop_t *loop, const mok_metrics_config *cfg, mok_metrics *m,
                             const mok_metrics_hooks *hooks, mok_metrics_server **ret);

/* The engine's answer to request_stats (status: a mok_status). */
void mok_metrics_server_engine_stats(mok_metrics_server *s, int status,
                                     const mok_engine_stats *st);

/* Close every endpoint and connection (and remove the Unix socket); the
 * server frees itself once libuv has closed its handles. s may be NULL. */
void mok_metrics_server_stop(mok_metrics_server *s);

#endif
