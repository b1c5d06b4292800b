/* mokctl: ask a running mokd how it is doing.
 *
 *   mokctl [--socket PATH] status
 */
#include <stdio.h>
#include <string.h>

#include "mok.h"

static int status(const char *socket_path) {
  mok_client *c;
  if (mok_connect(socket_path, "mokctl", &c) != MOK_OK) {
    fprintf(stderr, "mokctl: %s\n", mok_last_error());
    return 1;
  }
  mok_daemon_stats st;
  int r = mok_stats(c, &st);
  if (r != MOK_OK) {
    fprintf(stderr, "mokctl: %s\n", mok_last_error());
    mok_close(c);
    return 1;
  }
  printf("engine:        %s\n", mok_client_engine(c));
  printf("device:        %s\n", mok_client_device(c));
  printf("uptime:        %.1f s\n", (double)st.uptime_ms / 1000.0);
  printf("sessions:      %llu now (this one included), %llu since start\n",
         (unsigned long long)st.sessions_now, (unsigned long long)st.sessions_total);
  printf("jobs:          %llu done, %llu failed\n", (unsigned long long)st.jobs_done,
         (unsigned long long)st.jobs_failed);
  printf("job latency:   p50 %.1f us, p99 %.1f us (engine time, recent jobs)\n",
         (double)st.latency_p50_ns / 1000.0, (double)st.latency_p99_ns / 1000.0);
  mok_close(c);
  return 0;
}

int main(int argc, char **argv) {
  const char *socket_path = NULL;
  int i = 1;
  for (; i < argc; i++) {
    if (strcmp(argv[i], "--socket") == 0 && i + 1 < argc) socket_path = argv[++i];
    else if (strncmp(argv[i], "--socket=", 9) == 0) socket_path = argv[i] + 9;
    else break;
  }
  const char *cmd = i < argc ? argv[i] : "status";
  if (strcmp(cmd, "status") == 0) return status(socket_path);
  if (strcmp(cmd, "--help") == 0 || strcmp(cmd, "help") == 0) {
    printf("usage: mokctl [--socket PATH] status\n");
    return 0;
  }
  fprintf(stderr, "mokctl: unknown command \"%s\" (try: status)\n", cmd);
  return 2;
}
