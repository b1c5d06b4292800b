/* The control plane: the libuv loop, the Unix socket and the sessions. */
#ifndef MOK_SERVER_H
#define MOK_SERVER_H

#include <stdint.h>
#include <sys/types.h>

#include "engine_thread.h"

#define MOK_VERSION "0.1.0"

typedef struct mok_server_config {
  const char *socket_path;
  int listen_fd;          /* >= 0: an already-listening socket (socket activation) */
  mode_t socket_mode;     /* applied to a socket we create */
  const char *engine;     /* "cpu" or "cuda" */
  mok_engine_config engine_cfg;
  uint32_t max_sessions;
  uint32_t hello_timeout_ms;
  uint32_t max_pending_requests; /* per session, control requests awaiting the engine */
  uint32_t drain_ms;             /* at shutdown, how long queued jobs may still run */
  mok_session_limits limits;
} mok_server_config;

void mok_server_config_defaults(mok_server_config *cfg);

/* Serve until SIGTERM or SIGINT. Returns the process exit status. */
int mok_server_run(const mok_server_config *cfg);

#endif
