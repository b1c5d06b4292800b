/* SPDX-License-Identifier: Apache-2.0 */
/* mokctl: ask a running mokd how it is doing.
 *
 *   mokctl [--socket PATH] status [--json]
 *   mokctl [--socket PATH] metrics          (Prometheus text format)
 *   mokctl [--socket PATH] version | help | --help | --version
 */
#include <stdio.h>
#include <string.h>

#include "internal.h"
#include "rpc.h"
#include "mok.h"

static Mok__StatsReply *fetch_stats(mok_client *c, Mok__Reply **ret_reply) {
  Mok__Stats st = MOK__STATS__INIT;
  Mok__Request req = MOK__REQUEST__INIT;
  req.body_case = MOK__REQUEST__BODY_STATS;
  req.stats = &st;
  pthread_mutex_lock(&c->lock);
  int r = mok_rpc(c, &req, NULL, 0, ret_reply, NULL, NULL);
  pthread_mutex_unlock(&c->lock);
  if (r != MOK_OK) return NULL;
  if ((*ret_reply)->body_case != MOK__REPLY__BODY_STATS) {
    mok_set_error(MOK_EPROTO, "stats reply without stats");
    return NULL;
  }
  return (*ret_reply)->stats;
}

/* JSON string: escape quotes, backslashes and control characters. */
static void json_str(const char *s) {
  putchar('"');
  for (; *s; s++) {
    unsigned char ch = (unsigned char)*s;
    if (ch == '"' || ch == '\\') printf("\\%c", ch);
    else if (ch < 0x20) printf("\\u%04x", ch);
    else putchar(ch);
  }
  putchar('"');
}

static void print_text(const Mok__StatsReply *s) {
  printf("mokd %s, %s engine on %s\n", s->daemon_version, s->engine, s->device);
  printf("uptime:       %.1f s\n", (double)s->uptime_ms / 1000.0);
  printf("jobs:         %llu done, %llu failed\n", (unsigned long long)s->jobs_done,
         (unsigned long long)s->jobs_failed);
  printf("job latency:  p50 %.1f us, p99 %.1f us (engine time, recent jobs)\n",
         (double)s->job_latency_p50_ns / 1e3, (double)s->job_latency_p99_ns / 1e3);
  if (s->own_uid_only)
    printf("shown:        uid %u's sessions and groups only (admins see every tenant)\n",
           s->viewer_uid);
  if (s->own_uid_only)
    printf("sessions:     %zu now (this one included)\n", s->n_sessions);
  else
    printf("sessions:     %zu now (this one included), %llu since start\n", s->n_sessions,
           (unsigned long long)s->sessions_total);
  printf("  %-8s %-20s %6s %8s %8s %12s %7s %10s %8s\n", "session", "client", "uid", "pid",
         "regions", "bytes", "layers", "jobs", "failed");
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Mok__SessionInfo *x = s->sessions[i];
    printf("  %-8llu %-20.20s %6u %8u %8u %12llu %7u %10llu %8llu\n",
           (unsigned long long)x->session_id, x->client_name, x->uid, x->pid, x->regions,
           (unsigned long long)x->region_bytes, x->layers, (unsigned long long)x->jobs_done,
           (unsigned long long)x->jobs_failed);
    printf("           memory: %llu device mapped, %llu workspace, %llu layers, %llu scratch "
           "(bytes)\n",
           (unsigned long long)x->mapped_device_bytes, (unsigned long long)x->workspace_bytes,
           (unsigned long long)x->layer_bytes, (unsigned long long)x->scratch_bytes);
    for (size_t k = 0; k < x->n_groups; k++) {
      const Mok__GroupInfo *g = x->groups[k];
      printf("           group %u: rank %u of %u, generation %llu, %llu jobs\n", g->group_id,
             g->rank, g->world, (unsigned long long)g->generation,
             (unsigned long long)g->sequence);
    }
  }
  printf("groups:       %zu\n", s->n_groups);
  for (size_t k = 0; k < s->n_groups; k++) {
    const Mok__GroupSummary *g = s->groups[k];
    printf("  group %u '%s' (uid %u): rank %u of %u, %s, generation %llu, %llu jobs, ", g->group_id,
           g->key, g->uid, g->rank, g->world, g->nccl ? "through NCCL" : "on this host",
           (unsigned long long)g->generation, (unsigned long long)g->sequence);
    if (g->forming) printf("forming\n");
    else if (g->sessions) printf("%u session(s)%s\n", g->sessions, g->broken ? ", broken" : "");
    else printf("lingering%s\n", g->broken ? ", broken" : "");
  }
}

static void print_json(const Mok__StatsReply *s) {
  printf("{\"version\": ");
  json_str(s->daemon_version);
  printf(", \"engine\": ");
  json_str(s->engine);
  printf(", \"device\": ");
  json_str(s->device);
  printf(", \"uptime_ms\": %llu, \"jobs_done\": %llu, \"jobs_failed\": %llu, "
         "\"latency_p50_ns\": %llu, \"latency_p99_ns\": %llu, \"sessions_total\": %llu, ",
         (unsigned long long)s->uptime_ms, (unsigned long long)s->jobs_done,
         (unsigned long long)s->jobs_failed, (unsigned long long)s->job_latency_p50_ns,
         (unsigned long long)s->job_latency_p99_ns, (unsigned long long)s->sessions_total);
  printf("\"own_uid_only\": %s, \"viewer_uid\": %u, \"sessions\": [",
         s->own_uid_only ? "true" : "false", s->viewer_uid);
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Mok__SessionInfo *x = s->sessions[i];
    printf("%s{\"id\": %llu, \"client\": ", i ? ", " : "", (unsigned long long)x->session_id);
    json_str(x->client_name);
    printf(", \"uid\": %u, \"pid\": %u, \"regions\": %u, \"region_bytes\": %llu, "
           "\"layers\": %u, \"jobs_done\": %llu, \"jobs_failed\": %llu, "
           "\"memory\": {\"mapped_device_bytes\": %llu, \"workspace_bytes\": %llu, "
           "\"layer_bytes\": %llu, \"scratch_bytes\": %llu}, \"groups\": [",
           x->uid, x->pid, x->regions, (unsigned long long)x->region_bytes, x->layers,
           (unsigned long long)x->jobs_done, (unsigned long long)x->jobs_failed,
           (unsigned long long)x->mapped_device_bytes, (unsigned long long)x->workspace_bytes,
           (unsigned long long)x->layer_bytes, (unsigned long long)x->scratch_bytes);
    for (size_t k = 0; k < x->n_groups; k++) {
      const Mok__GroupInfo *g = x->groups[k];
      printf("%s{\"id\": %u, \"rank\": %u, \"world\": %u, \"generation\": %llu, "
             "\"jobs\": %llu}",
             k ? ", " : "", g->group_id, g->rank, g->world, (unsigned long long)g->generation,
             (unsigned long long)g->sequence);
    }
    printf("]}");
  }
  printf("], \"groups\": [");
  for (size_t k = 0; k < s->n_groups; k++) {
    const Mok__GroupSummary *g = s->groups[k];
    printf("%s{\"id\": %u, \"key\": ", k ? ", " : "", g->group_id);
    json_str(g->key);
    printf(", \"uid\": %u, \"rank\": %u, \"world\": %u, \"generation\": %llu, \"jobs\": %llu, "
           "\"nccl\": %s, \"sessions\": %u, \"broken\": %s, \"forming\": %s}",
           g->uid, g->rank, g->world, (unsigned long long)g->generation,
           (unsigned long long)g->sequence, g->nccl ? "true" : "false", g->sessions,
           g->broken ? "true" : "false", g->forming ? "true" : "false");
  }
  printf("]}\n");
}

static void metric(const char *name, const char *type, const char *help) {
  printf("# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Prometheus label values: escape backslash, quote and newline. */
static void label_value(const char *s) {
  for (; *s; s++) {
    if (*s == '\\' || *s == '"') printf("\\%c", *s);
    else if (*s == '\n') printf("\\n");
    else putchar(*s);
  }
}

static void print_metrics(const Mok__StatsReply *s) {
  metric("mok_up", "gauge", "1 when mokd answered");
  printf("mok_up{engine=\"");
  label_value(s->engine);
  printf("\",version=\"");
  label_value(s->daemon_version);
  printf("\"} 1\n");
  metric("mok_stats_scope_own_uid", "gauge",
         "1: what follows covers only the asking uid's sessions (not an admin)");
  printf("mok_stats_scope_own_uid{uid=\"%u\"} %d\n", s->viewer_uid, s->own_uid_only ? 1 : 0);
  metric("mok_uptime_seconds", "gauge", "Seconds since mokd started");
  printf("mok_uptime_seconds %.3f\n", (double)s->uptime_ms / 1000.0);
  metric("mok_jobs_total", "counter", "Jobs completed, by result");
  printf("mok_jobs_total{result=\"ok\"} %llu\n", (unsigned long long)s->jobs_done);
  printf("mok_jobs_total{result=\"failed\"} %llu\n", (unsigned long long)s->jobs_failed);
  /* the median and 99th percentile of recent jobs as two gauges: a quantile
   * label belongs to a summary, which this snapshot is not (mokd's /metrics
   * endpoint has the histogram) */
  metric("mok_job_latency_p50_seconds", "gauge", "Median engine time of recent jobs");
  printf("mok_job_latency_p50_seconds %.9f\n", (double)s->job_latency_p50_ns / 1e9);
  metric("mok_job_latency_p99_seconds", "gauge", "99th percentile engine time of recent jobs");
  printf("mok_job_latency_p99_seconds %.9f\n", (double)s->job_latency_p99_ns / 1e9);
  metric("mok_sessions", "gauge", "Sessions connected now (mokctl's own included)");
  printf("mok_sessions %zu\n", s->n_sessions);
  metric("mok_sessions_total", "counter", "Sessions accepted since start");
  printf("mok_sessions_total %llu\n", (unsigned long long)s->sessions_total);
  metric("mok_session_region_bytes", "gauge", "Bytes registered, by session");
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Mok__SessionInfo *x = s->sessions[i];
    printf("mok_session_region_bytes{session=\"%llu\",client=\"", (unsigned long long)x->session_id);
    label_value(x->client_name);
    printf("\",uid=\"%u\"} %llu\n", x->uid, (unsigned long long)x->region_bytes);
  }
  metric("mok_session_memory_bytes", "gauge",
         "What a session holds in the engine, by session and kind (0: the engine does not say)");
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Mok__SessionInfo *x = s->sessions[i];
    const struct { const char *kind; uint64_t v; } m[] = {
        {"mapped_device", x->mapped_device_bytes}, {"workspace", x->workspace_bytes},
        {"layer", x->layer_bytes}, {"scratch", x->scratch_bytes}};
    for (size_t k = 0; k < sizeof m / sizeof m[0]; k++)
      printf("mok_session_memory_bytes{session=\"%llu\",kind=\"%s\"} %llu\n",
             (unsigned long long)x->session_id, m[k].kind, (unsigned long long)m[k].v);
  }
  metric("mok_group_jobs_total", "counter", "Group jobs run, by session, group and rank");
  for (size_t i = 0; i < s->n_sessions; i++)
    for (size_t k = 0; k < s->sessions[i]->n_groups; k++) {
      const Mok__GroupInfo *g = s->sessions[i]->groups[k];
      printf("mok_group_jobs_total{session=\"%llu\",group=\"%u\",rank=\"%u\",world=\"%u\"} %llu\n",
             (unsigned long long)s->sessions[i]->session_id, g->group_id, g->rank, g->world,
             (unsigned long long)g->sequence);
    }
  metric("mok_groups", "gauge", "Groups this mokd serves a rank of, by state");
  uint32_t held = 0, lingering = 0, broken = 0;
  for (size_t k = 0; k < s->n_groups; k++) {
    broken += s->groups[k]->broken;
    if (s->groups[k]->sessions) held++;
    else lingering++;
  }
  printf("mok_groups{state=\"held\"} %u\nmok_groups{state=\"lingering\"} %u\n"
         "mok_groups{state=\"broken\"} %u\n",
         held, lingering, broken);
  metric("mok_session_jobs_total", "counter", "Jobs completed, by session and result");
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Mok__SessionInfo *x = s->sessions[i];
    printf("mok_session_jobs_total{session=\"%llu\",result=\"ok\"} %llu\n",
           (unsigned long long)x->session_id, (unsigned long long)x->jobs_done);
    printf("mok_session_jobs_total{session=\"%llu\",result=\"failed\"} %llu\n",
           (unsigned long long)x->session_id, (unsigned long long)x->jobs_failed);
  }
}

/* Every command, one line each in the usage (and each one in mokctl(1):
 * tests/python/test_cli.py holds docs/man/mokctl.1 to this table). */
static const struct {
  const char *name, *args, *help;
} commands[] = {
    {"status", "[--json]", "engine, device, uptime, jobs, latencies, sessions and groups"},
    {"metrics", "", "the same in Prometheus text format"},
    {"version", "", "print mokctl's version (and mokd's, when it answers)"},
    {"help", "", "print this usage"},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static int usage(FILE *to, int code) {
  fprintf(to, "usage: mokctl [--socket PATH] [--json] [COMMAND]\n"
              "       mokctl -h | --help | --version\n"
              "commands (default: status):\n");
  for (size_t i = 0; i < N_COMMANDS; i++) {
    char head[32];
    snprintf(head, sizeof head, "%s %s", commands[i].name, commands[i].args);
    fprintf(to, "  %-16s %s\n", head, commands[i].help);
  }
  fprintf(to, "options:\n"
              "  --socket PATH    mokd's control socket (default: $MOK_SOCKET, else %s)\n"
              "  --json           status as one JSON object\n"
              "  -h, --help       print this usage\n"
              "  -V, --version    print mokctl's version\n"
              "See mokctl(1).\n",
          MOK_DEFAULT_SOCKET);
  return code;
}

/* A bad command line: what was wrong, then where the usage is. */
static int usage_error(const char *fmt, const char *arg) {
  fprintf(stderr, "mokctl: ");
  fprintf(stderr, fmt, arg);
  fprintf(stderr, "\nTry 'mokctl --help' for the commands and options.\n");
  return 2;
}

int main(int argc, char **argv) {
  const char *socket_path = NULL, *cmd = NULL;
  int json = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (strcmp(a, "--socket") == 0) {
      if (i + 1 == argc) return usage_error("%s needs a PATH", a);
      socket_path = argv[++i];
    } else if (strncmp(a, "--socket=", 9) == 0) {
      socket_path = a + 9;
    } else if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "-h") == 0 || strcmp(a, "--help") == 0) {
      return usage(stdout, 0);
    } else if (strcmp(a, "-V") == 0 || strcmp(a, "--version") == 0) {
      printf("mokctl %s\n", mok_version());
      return 0;
    } else if (a[0] == '-' && a[1] != '\0') {
      return usage_error("unknown option \"%s\"", a);
    } else if (!cmd) {
      cmd = a;
    } else {
      return usage_error("unexpected argument \"%s\"", a);
    }
  }
  if (!cmd) cmd = "status";
  size_t k = 0;
  while (k < N_COMMANDS && strcmp(cmd, commands[k].name) != 0) k++;
  if (k == N_COMMANDS) return usage_error("unknown command \"%s\"", cmd);
  if (strcmp(cmd, "help") == 0) return usage(stdout, 0);
  if (strcmp(cmd, "version") == 0) printf("mokctl %s\n", mok_version());
  if (socket_path && !*socket_path) return usage_error("%s: the socket path is empty", "--socket");
  mok_client *c;
  if (mok_connect(socket_path, "mokctl", &c) != MOK_OK) {
    if (strcmp(cmd, "version") == 0) { /* mokctl's own was the answer asked for */
      fprintf(stderr, "mokctl: mokd not reached: %s\n", mok_last_error());
      return 0;
    }
    fprintf(stderr, "mokctl: %s\n", mok_last_error());
    return 1;
  }
  Mok__Reply *reply = NULL;
  Mok__StatsReply *s = fetch_stats(c, &reply);
  int code = 0;
  if (!s) {
    fprintf(stderr, "mokctl: %s\n", mok_last_error());
    code = 1;
  } else if (strcmp(cmd, "version") == 0) {
    printf("mokd %s\n", s->daemon_version);
  } else if (strcmp(cmd, "metrics") == 0) {
    print_metrics(s);
  } else if (json) {
    print_json(s);
  } else {
    print_text(s);
  }
  if (reply) mok__reply__free_unpacked(reply, NULL);
  mok_close(c);
  return code;
}
