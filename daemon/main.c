/* mokd: serves Mixture-of-Experts layers to training processes.
 *
 *   mokd --socket PATH --engine cpu|cuda [--device N] [--config FILE]
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "engine.h"
#include "log.h"
#include "server.h"

#include <systemd/sd-daemon.h>

static void usage(FILE *to) {
  fprintf(to,
          "usage: mokd [--socket PATH] [--engine cpu|cuda] [--device N] [--config FILE]\n"
          "            [--threads N] [--log-level error|warn|info|debug] [--version]\n"
          "            [--list-engines]\n"
          "  --socket PATH   control socket (default /run/mok/mokd-0.sock)\n"
          "  --engine NAME   cpu (reference, runs everywhere) or cuda (sm_90a)\n"
          "  --device N      GPU ordinal for the cuda engine\n"
          "  --config FILE   key = value settings (repeatable; -FILE: skip if missing);\n"
          "                  command-line options win\n"
          "  --threads N     cpu engine worker threads (0: one per core)\n");
}

/* Socket activation (mokd@.socket): systemd hands us the listening socket. */
static int take_activated_socket(mok_server_config *cfg) {
  int n = sd_listen_fds(1);
  if (n < 0) {
    fprintf(stderr, "mokd: socket activation (LISTEN_FDS): %s\n", strerror(-n));
    return -1;
  }
  if (n == 0) return 0;
  int fd = SD_LISTEN_FDS_START;
  if (n > 1 || sd_is_socket_unix(fd, SOCK_SEQPACKET, 1, NULL, 0) <= 0) {
    fprintf(stderr, "mokd: socket activation passed %d fds; expected one listening "
                    "SOCK_SEQPACKET Unix socket (ListenSequentialPacket=)\n", n);
    return -1;
  }
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0 || fcntl(fd, F_SETFD, FD_CLOEXEC) < 0) {
    fprintf(stderr, "mokd: activated socket: %s\n", strerror(errno));
    return -1;
  }
  cfg->listen_fd = fd;
  return 0;
}

int main(int argc, char **argv) {
  /* groups formed through NCCL never use NVLink multicast (docs/ep_nccl.md); set
   * here, before any thread runs, so nccl_group.c never has to */
  setenv("NCCL_NVLS_ENABLE", "0", 1);
  mok_server_config cfg;
  mok_server_config_defaults(&cfg);
  static const struct option opts[] = {
      {"socket", required_argument, 0, 's'}, {"engine", required_argument, 0, 'e'},
      {"device", required_argument, 0, 'd'}, {"config", required_argument, 0, 'c'},
      {"threads", required_argument, 0, 't'}, {"log-level", required_argument, 0, 'l'},
      {"help", no_argument, 0, 'h'},         {"version", no_argument, 0, 'V'},
      {"list-engines", no_argument, 0, 'L'},
      {0, 0, 0, 0}};
  char err[256];
  /* config files first (in order; a leading '-' marks one that may be
   * missing), so that command-line options override them */
  for (int i = 1; i < argc; i++) {
    const char *path = NULL;
    if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) path = argv[i + 1];
    else if (strncmp(argv[i], "--config=", 9) == 0) path = argv[i] + 9;
    if (!path) continue;
    int optional = path[0] == '-';
    if (optional) path++;
    if (optional && access(path, F_OK) != 0) continue;
    if (mok_config_load(&cfg, path, err, sizeof err) < 0) {
      fprintf(stderr, "mokd: %s\n", err);
      return 2;
    }
  }
  int c;
  while ((c = getopt_long(argc, argv, "hV", opts, NULL)) != -1) {
    const char *key = NULL;
    switch (c) {
    case 's': key = "socket"; break;
    case 'e': key = "engine"; break;
    case 'd': key = "device"; break;
    case 't': key = "threads"; break;
    case 'l': key = "log-level"; break;
    case 'c': continue;
    case 'h': usage(stdout); return 0;
    case 'V': printf("mokd %s\n", MOK_VERSION); return 0;
    case 'L': printf("cpu\n%s", mok_engine_find("cuda") ? "cuda\n" : ""); return 0;
    default: usage(stderr); return 2;
    }
    if (mok_config_set(&cfg, key, optarg, err, sizeof err) < 0) {
      fprintf(stderr, "mokd: %s\n", err);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "mokd: unexpected argument \"%s\"\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  if (take_activated_socket(&cfg) < 0) return 2;
  return mok_server_run(&cfg);
}
