/* SPDX-License-Identifier: Apache-2.0 */
/* mokd: serves Mixture-of-Experts layers to training processes.
 *
 *   mokd --socket PATH --engine cpu|cuda [--device N] [--config FILE]
 *
 * Every option is in mokd(8) (docs/man/mokd.8), every config key in
 * mokd.conf(5); tests/python/test_cli.py holds them to this table.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "cuda/nccl.h"
#include "engine.h"
#include "log.h"
#include "mok_enums.h"
#include "server.h"

#include <systemd/sd-daemon.h>

static void usage(FILE *to) {
  fprintf(to,
          "usage: mokd [--socket PATH] [--engine cpu|cuda] [--device N] [--config FILE]\n"
          "            [--threads N] [--log-level error|warn|info|debug] [--list-engines]\n"
          "            [--version] [--help]\n"
          "  --socket PATH     control socket (default " MOK_DEFAULT_SOCKET ")\n"
          "  --engine NAME     cpu (reference, runs everywhere) or cuda (sm_90a)\n"
          "  --device N        GPU ordinal for the cuda engine\n"
          "  --config FILE     key = value settings, mokd.conf(5) (repeatable; -FILE: skip\n"
          "                    if missing); command-line options win\n"
          "  --threads N       cpu engine worker threads (0: one per core)\n"
          "  --log-level L     error, warn, info (default) or debug\n"
          "  --list-engines    print the engines this build has, one a line, and exit\n"
          "  -V, --version     print the version and exit\n"
          "  -h, --help        print this and exit\n"
          "See mokd(8).\n");
}

/* The error for a bad command line: what was wrong (getopt said it, or
 * what), then where the usage is. */
static int usage_error(const char *what, const char *arg) {
  if (what) fprintf(stderr, "mokd: %s \"%s\"\n", what, arg);
  fprintf(stderr, "Try 'mokd --help' for the options.\n");
  return 2;
}

/* The socket mokd makes lives in a directory it does not create (under
 * systemd, tmpfiles.d and the socket unit make /run/mok): say which one is
 * missing and how to make it, instead of bind()'s bare ENOENT. */
static int check_socket_dir(const char *socket_path) {
  char dir[4096];
  const char *slash = strrchr(socket_path, '/');
  if (!slash) return 0; /* the working directory */
  size_t n = slash == socket_path ? 1 : (size_t)(slash - socket_path);
  if (n >= sizeof dir) return 0; /* too long for a socket anyway: bind says so */
  memcpy(dir, socket_path, n);
  dir[n] = '\0';
  struct stat st;
  if (stat(dir, &st) == 0) {
    if (S_ISDIR(st.st_mode)) return 0;
    fprintf(stderr, "mokd: socket directory %s is not a directory; pass --socket PATH in an "
                    "existing directory\n", dir);
    return -1;
  }
  if (errno == ENOENT)
    fprintf(stderr, "mokd: socket directory %s does not exist; create it (install -d -m 0755 "
                    "%s) or pass --socket PATH\n", dir, dir);
  else if (errno == ENOTDIR)
    fprintf(stderr, "mokd: socket directory %s: a part of its path is not a directory; pass "
                    "--socket PATH in an existing directory\n", dir);
  else
    fprintf(stderr, "mokd: socket directory %s: %s\n", dir, strerror(errno));
  return -1;
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
  /* groups formed through NCCL never use NVLink multicast (docs/ep_nccl.md):
   * before any thread runs, so that the loader's own call changes nothing */
  mok_nccl_no_multicast();
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
  static char prog[] = "mokd";
  argv[0] = prog; /* getopt's messages name mokd, not the path it was run by */
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
    default: return usage_error(NULL, NULL); /* getopt named the option */
    }
    if (mok_config_set(&cfg, key, optarg, err, sizeof err) < 0) {
      fprintf(stderr, "mokd: %s\n", err);
      return 2;
    }
  }
  if (optind < argc) return usage_error("unexpected argument", argv[optind]);
  mok_config_apply_env(&cfg);
  if (take_activated_socket(&cfg) < 0) return 2;
  if (cfg.listen_fd < 0 && check_socket_dir(cfg.socket_path) < 0) return 1;
  return mok_server_run(&cfg);
}
