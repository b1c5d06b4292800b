/* SPDX-License-Identifier: Apache-2.0 */
#include "metrics.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "metrics_config.h"
#include "mok_slots.h"

/* ---- the job sinks (engine thread) ------------------------------------------ */

/* 50 us .. 60 s: an empty job through the rings is ~10 us, the layer at
 * T=8192 tens of ms on an H200, a big cpu-engine job seconds. */
const uint64_t mok_latency_bounds_ns[MOK_LATENCY_BUCKETS] = {
    50000ull,     100000ull,     250000ull,     500000ull,     1000000ull,
    2500000ull,   5000000ull,    10000000ull,   25000000ull,   50000000ull,
    100000000ull, 250000000ull,  500000000ull,  1000000000ull, 2500000000ull,
    5000000000ull, 10000000000ull, 30000000000ull, 60000000000ull};
/* the same bounds as Prometheus le values (seconds) */
static const char *const latency_le[MOK_LATENCY_BUCKETS] = {
    "5e-05", "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05",
    "0.1",   "0.25",   "0.5",     "1",      "2.5",   "5",      "10",    "30",   "60"};

void mok_job_sink_record(mok_job_sink *sink, uint32_t op, int status, uint64_t ns) {
  if (!sink) return;
  mok_job_totals *all = sink->all;
  uint32_t o = op < MOK_OP_COUNT_ ? op : MOK_OP_COUNT_;
  if (status == MOK_OK) {
    atomic_fetch_add_explicit(&sink->done, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&all->done[o], 1, memory_order_relaxed);
  } else {
    uint32_t s = status > 0 && status < MOK_STATUS_COUNT_ ? (uint32_t)status : MOK_STATUS_COUNT_;
    atomic_fetch_add_explicit(&sink->failed, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&all->failed[o][s], 1, memory_order_relaxed);
  }
  uint32_t b = 0;
  while (b < MOK_LATENCY_BUCKETS && ns > mok_latency_bounds_ns[b]) b++;
  atomic_fetch_add_explicit(&all->bucket[o][b], 1, memory_order_relaxed);
  atomic_fetch_add_explicit(&all->sum_ns[o], ns, memory_order_relaxed);
}

/* ---- the registry (loop thread) --------------------------------------------- */

/* Refusal reasons: a fixed list, every one reported (0 included). */
static const char *const reasons[] = {
    "allow-list",        "max-sessions",          "max-sessions-per-uid",
    "session-reserve",   "max-pending-requests",  "max-regions",
    "max-region-bytes",  "max-regions-total",     "max-regions-per-uid",
    "max-region-bytes-per-uid", "max-layers",     "max-layers-per-uid",
    "max-groups-per-uid", "max-group-bytes-per-uid", "hello-timeout-ms",
    "protocol",          "out-of-memory",         "other"};
#define N_REASONS (sizeof reasons / sizeof reasons[0])

/* The HTTP statuses the endpoint answers with: a fixed list. */
static const int http_codes[] = {200, 400, 403, 404, 405, 408, 413, 414, 431, 500, 503, 505};
#define N_HTTP_CODES (sizeof http_codes / sizeof http_codes[0])

typedef struct label_set {
  mok_job_sink sink; /* first: a sink's address is its set's */
  bool used;
  uint32_t uid;
  char client[64];
  uint32_t refs;     /* live sessions counting here */
  uint64_t last_use; /* for giving the least recently used free set away */
} label_set;

struct mok_metrics {
  bool per_uid;
  uint32_t n_sets;  /* sets[0] is "other"; sets[1..n_sets] the named ones */
  label_set *sets;
  mok_job_totals totals;
  uint64_t use_clock;
  uint32_t sessions;
  uint64_t sessions_opened;
  uint64_t refusals[N_REASONS];
  uint64_t regions_registered, region_bytes_registered, layers_created;
  uint64_t http_answered[N_HTTP_CODES];
  uint64_t http_over_cap, http_timed_out;
};

mok_metrics *mok_metrics_create(uint32_t max_label_sets, bool per_uid) {
  if (max_label_sets > MOK_METRICS_LABEL_SETS_MAX) max_label_sets = MOK_METRICS_LABEL_SETS_MAX;
  mok_metrics *m = calloc(1, sizeof *m);
  if (!m) return NULL;
  m->per_uid = per_uid;
  /* without per-uid series nothing needs telling apart: everything is "other" */
  m->n_sets = per_uid ? max_label_sets : 0;
  m->sets = calloc(m->n_sets + 1u, sizeof *m->sets);
  if (!m->sets) {
    free(m);
    return NULL;
  }
  for (uint32_t i = 0; i <= m->n_sets; i++) m->sets[i].sink.all = &m->totals;
  m->sets[0].used = true;
  snprintf(m->sets[0].client, sizeof m->sets[0].client, "other");
  return m;
}

void mok_metrics_free(mok_metrics *m) {
  if (!m) return;
  free(m->sets);
  free(m);
}

static uint64_t load(_Atomic uint64_t *v) { return atomic_load_explicit(v, memory_order_relaxed); }

mok_job_sink *mok_metrics_session_open(mok_metrics *m, uint32_t uid, const char *client) {
  if (!m) return NULL;
  m->sessions++;
  m->sessions_opened++;
  label_set *pick = NULL, *lru = NULL;
  for (uint32_t i = 1; i <= m->n_sets; i++) {
    label_set *s = &m->sets[i];
    if (s->used && s->uid == uid && strcmp(s->client, client) == 0) {
      pick = s;
      break;
    }
    if (!s->used) {
      if (!lru || lru->used) lru = s; /* a never used set first */
    } else if (s->refs == 0 && (!lru || (lru->used && s->last_use < lru->last_use))) {
      lru = s; /* else the least recently used free one */
    }
  }
  if (!pick && lru) {
    if (lru->used) { /* given away: what it counted goes on under "other" */
      label_set *o = &m->sets[0];
      atomic_store(&o->sink.done, load(&o->sink.done) + load(&lru->sink.done));
      atomic_store(&o->sink.failed, load(&o->sink.failed) + load(&lru->sink.failed));
    }
    atomic_store(&lru->sink.done, 0);
    atomic_store(&lru->sink.failed, 0);
    lru->used = true;
    lru->uid = uid;
    snprintf(lru->client, sizeof lru->client, "%s", client);
    pick = lru;
  }
  if (!pick) pick = &m->sets[0];
  pick->refs++;
  pick->last_use = ++m->use_clock;
  return &pick->sink;
}

static label_set *set_of(mok_metrics *m, const mok_job_sink *sink) {
  for (uint32_t i = 0; i <= m->n_sets; i++)
    if (&m->sets[i].sink == sink) return &m->sets[i];
  return NULL;
}

void mok_metrics_session_close(mok_metrics *m, mok_job_sink *sink) {
  if (!m || !sink) return;
  label_set *s = set_of(m, sink);
  if (!s || s->refs == 0) return;
  s->refs--;
  s->last_use = ++m->use_clock;
  m->sessions--;
}

const char *mok_metrics_refusal_reason(const char *why) {
  if (!why) return "other";
  for (size_t i = 0; i < N_REASONS; i++)
    if (strcmp(why, reasons[i]) == 0) return reasons[i];
  /* the setting a refusal names, in parentheses (quota.c, server.c) */
  static const struct { const char *needle, *reason; } named[] = {
      {"(max-sessions-per-uid", "max-sessions-per-uid"},
      {"(max-sessions)", "max-sessions"},
      {"(session-reserve)", "session-reserve"},
      {"allow-uids/allow-gids", "allow-list"},
      {"(max-regions-total", "max-regions-total"},
      {"(max-regions-per-uid", "max-regions-per-uid"},
      {"(max-region-bytes-per-uid", "max-region-bytes-per-uid"},
      {"(max-layers-per-uid", "max-layers-per-uid"},
      {"(max-groups-per-uid", "max-groups-per-uid"},
      {"(max-group-bytes-per-uid", "max-group-bytes-per-uid"},
      /* the engine's per-session limits (engine_thread.c) */
      {"the session's quota of", "max-region-bytes"},
      {"regions (limit", "max-regions"},
      {"layers (limit", "max-layers"},
      {"out of memory", "out-of-memory"},
  };
  for (size_t i = 0; i < sizeof named / sizeof named[0]; i++)
    if (strstr(why, named[i].needle)) return named[i].reason;
  return "other";
}

void mok_metrics_refused(mok_metrics *m, const char *why) {
  if (!m) return;
  const char *r = mok_metrics_refusal_reason(why);
  for (size_t i = 0; i < N_REASONS; i++)
    if (reasons[i] == r) m->refusals[i]++;
}

void mok_metrics_command_done(mok_metrics *m, const mok_cmd *c) {
  if (!m) return;
  if (c->status == MOK_ELIMIT) mok_metrics_refused(m, c->message);
  if (c->status != MOK_OK) return;
  if (c->kind == MOK_CMD_REGISTER) {
    m->regions_registered++;
    m->region_bytes_registered += c->in.reg.bytes;
  } else if (c->kind == MOK_CMD_CREATE_LAYER) {
    m->layers_created++;
  }
}

void mok_metrics_http_answered(mok_metrics *m, int status) {
  if (!m) return;
  for (size_t i = 0; i < N_HTTP_CODES; i++)
    if (http_codes[i] == status) m->http_answered[i]++;
}

void mok_metrics_http_over_cap(mok_metrics *m) {
  if (m) m->http_over_cap++;
}

void mok_metrics_http_timed_out(mok_metrics *m) {
  if (m) m->http_timed_out++;
}

/* ---- the page ----------------------------------------------------------------- */

typedef struct page {
  char *p;
  size_t len, cap;
  bool failed;
} page;

static void put(page *pg, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(page *pg, const char *fmt, ...) {
  if (pg->failed) return;
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(pg->p + pg->len, pg->cap - pg->len, fmt, ap);
    va_end(ap);
    if (n < 0) {
      pg->failed = true;
      return;
    }
    if ((size_t)n < pg->cap - pg->len) {
      pg->len += (size_t)n;
      return;
    }
    size_t want = pg->cap * 2;
    while (want < pg->len + (size_t)n + 1) want *= 2;
    char *grown = want <= MOK_METRICS_PAGE_MAX ? realloc(pg->p, want) : NULL;
    if (!grown) {
      pg->failed = true;
      return;
    }
    pg->p = grown;
    pg->cap = want;
  }
}

static void family(page *pg, const char *name, const char *type, const char *help) {
  put(pg, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* A label value, escaped (backslash, quote, newline), into a small buffer. */
static const char *esc(const char *s, char *buf, size_t len) {
  size_t n = 0;
  for (; s && *s && n + 3 < len; s++) {
    if (*s == '\\' || *s == '"') buf[n++] = '\\', buf[n++] = *s;
    else if (*s == '\n') buf[n++] = '\\', buf[n++] = 'n';
    else buf[n++] = *s;
  }
  buf[n] = '\0';
  return buf;
}

static const char *op_label(uint32_t o) { return o < MOK_OP_COUNT_ ? mok_op_name(o) : "unknown"; }

static const char *status_label(uint32_t s) {
  static const char *const names[MOK_STATUS_COUNT_] = {
#define MOK_STATUS_NAME_(name, value, desc) [value] = #name,
      MOK_STATUS_MAP(MOK_STATUS_NAME_)
#undef MOK_STATUS_NAME_
  };
  return s < MOK_STATUS_COUNT_ ? names[s] : "unknown";
}

/* The (uid, client) labels of a set. */
static void set_labels(const label_set *s, bool other, char *buf, size_t len) {
  char c[160];
  if (other) snprintf(buf, len, "uid=\"other\",client=\"other\"");
  else snprintf(buf, len, "uid=\"%u\",client=\"%s\"", s->uid, esc(s->client, c, sizeof c));
}

typedef struct set_gauges {
  uint32_t in_flight;
  uint64_t regions, region_bytes;
  uint64_t mem[4];
} set_gauges;

static const char *const mem_kinds[4] = {"mapped_device", "workspace", "layers", "scratch"};

static void mem_of(const mok_session_memory *mm, uint64_t out[4]) {
  out[0] += mm->mapped_device_bytes;
  out[1] += mm->workspace_bytes;
  out[2] += mm->layer_bytes;
  out[3] += mm->scratch_bytes;
}

static void render_jobs(mok_metrics *m, page *pg) {
  mok_job_totals *t = &m->totals;
  family(pg, "mokd_jobs_completed_total", "counter", "Jobs that completed successfully, by op");
  for (uint32_t o = 0; o < MOK_METRICS_OPS; o++) {
    uint64_t v = load(&t->done[o]);
    if (o < MOK_OP_COUNT_ || v) put(pg, "mokd_jobs_completed_total{op=\"%s\"} %llu\n", op_label(o),
                                    (unsigned long long)v);
  }
  family(pg, "mokd_jobs_failed_total", "counter",
         "Jobs that failed, by op and status (only pairs that happened)");
  for (uint32_t o = 0; o < MOK_METRICS_OPS; o++)
    for (uint32_t s = 0; s < MOK_METRICS_STATUSES; s++) {
      uint64_t v = load(&t->failed[o][s]);
      if (v) put(pg, "mokd_jobs_failed_total{op=\"%s\",status=\"%s\"} %llu\n", op_label(o),
                 status_label(s), (unsigned long long)v);
    }
  family(pg, "mokd_job_duration_seconds", "histogram",
         "Engine time of finished jobs (taken from the ring to completion), by op");
  for (uint32_t o = 0; o < MOK_METRICS_OPS; o++) {
    uint64_t b[MOK_LATENCY_BUCKETS + 1], count = 0;
    for (uint32_t i = 0; i <= MOK_LATENCY_BUCKETS; i++) count += b[i] = load(&t->bucket[o][i]);
    if (count == 0) continue;
    uint64_t cum = 0;
    for (uint32_t i = 0; i < MOK_LATENCY_BUCKETS; i++) {
      cum += b[i];
      put(pg, "mokd_job_duration_seconds_bucket{op=\"%s\",le=\"%s\"} %llu\n", op_label(o),
          latency_le[i], (unsigned long long)cum);
    }
    put(pg, "mokd_job_duration_seconds_bucket{op=\"%s\",le=\"+Inf\"} %llu\n", op_label(o),
        (unsigned long long)count);
    put(pg, "mokd_job_duration_seconds_sum{op=\"%s\"} %.9f\n", op_label(o),
        (double)load(&t->sum_ns[o]) / 1e9);
    put(pg, "mokd_job_duration_seconds_count{op=\"%s\"} %llu\n", op_label(o),
        (unsigned long long)count);
  }
}

static void render_groups(page *pg, const mok_engine_stats *st) {
  uint32_t held = 0, lingering = 0, broken = 0, forming = 0;
  for (size_t k = 0; k < st->n_groups; k++) {
    const mok_daemon_group_stats *g = &st->groups[k];
    broken += g->broken;
    forming += g->forming;
    if (g->sessions) held++;
    else lingering++;
  }
  family(pg, "mokd_groups", "gauge",
         "Expert-parallel groups this mokd serves a rank of: held by a session or lingering "
         "for a re-join; broken and forming ones among them");
  put(pg, "mokd_groups{state=\"held\"} %u\nmokd_groups{state=\"lingering\"} %u\n"
          "mokd_groups{state=\"broken\"} %u\nmokd_groups{state=\"forming\"} %u\n",
      held, lingering, broken, forming);
  /* the groups of the lowest ids get series of their own */
  size_t order[MOK_STATS_DAEMON_GROUPS_MAX], n = 0;
  for (size_t k = 0; k < st->n_groups && n < MOK_STATS_DAEMON_GROUPS_MAX; k++) {
    size_t at = n++;
    while (at > 0 && st->groups[order[at - 1]].group_id > st->groups[k].group_id) {
      order[at] = order[at - 1];
      at--;
    }
    order[at] = k;
  }
  size_t listed = n < MOK_METRICS_GROUPS_LISTED ? n : MOK_METRICS_GROUPS_LISTED;
  family(pg, "mokd_groups_unlisted", "gauge",
         "Groups beyond the listed ones (the lowest group ids get series of their own)");
  put(pg, "mokd_groups_unlisted %zu\n", st->n_groups - listed);
  family(pg, "mokd_group_info", "gauge",
         "1 for each listed group: this mokd's rank in it, its world size and transport");
  for (size_t i = 0; i < listed; i++) {
    const mok_daemon_group_stats *g = &st->groups[order[i]];
    put(pg, "mokd_group_info{group=\"%u\",rank=\"%u\",world=\"%u\",transport=\"%s\"} 1\n",
        g->group_id, g->rank, g->world, g->nccl ? "nccl" : "host");
  }
  family(pg, "mokd_group_broken", "gauge",
         "1 while a group is broken (a member missed a barrier; its clients must re-join)");
  for (size_t i = 0; i < listed; i++) {
    const mok_daemon_group_stats *g = &st->groups[order[i]];
    put(pg, "mokd_group_broken{group=\"%u\"} %d\n", g->group_id, g->broken ? 1 : 0);
  }
  family(pg, "mokd_group_jobs_total", "counter", "Group jobs this member took part in");
  for (size_t i = 0; i < listed; i++) {
    const mok_daemon_group_stats *g = &st->groups[order[i]];
    put(pg, "mokd_group_jobs_total{group=\"%u\"} %llu\n", g->group_id,
        (unsigned long long)g->sequence);
  }
  family(pg, "mokd_group_timeouts_total", "counter",
         "Barriers of a group that timed out on this member (host or device barriers)");
  for (size_t i = 0; i < listed; i++) {
    const mok_daemon_group_stats *g = &st->groups[order[i]];
    put(pg, "mokd_group_timeouts_total{group=\"%u\"} %llu\n", g->group_id,
        (unsigned long long)g->timeouts);
  }
  family(pg, "mokd_group_rank_missed_total", "counter",
         "Times a rank had not arrived when a host barrier of the group timed out, by rank");
  for (size_t i = 0; i < listed; i++) {
    const mok_daemon_group_stats *g = &st->groups[order[i]];
    for (uint32_t p = 0; p < g->world && p < MOK_GROUP_MAX_WORLD; p++)
      if (p != g->rank)
        put(pg, "mokd_group_rank_missed_total{group=\"%u\",rank=\"%u\"} %llu\n", g->group_id, p,
            (unsigned long long)g->rank_missed[p]);
  }
}

static void render_tenants(mok_metrics *m, page *pg, const mok_engine_stats *st) {
  set_gauges *g = calloc(m->n_sets + 1u, sizeof *g);
  if (!g) {
    pg->failed = true;
    return;
  }
  for (size_t i = 0; i < st->n_sessions; i++) {
    const mok_session_stats *ss = &st->sessions[i];
    label_set *s = ss->sink ? set_of(m, ss->sink) : NULL;
    if (!s) continue; /* detaching: no longer any tenant's */
    set_gauges *x = &g[s - m->sets];
    x->in_flight += ss->jobs_in_flight;
    x->regions += ss->regions;
    x->region_bytes += ss->region_bytes;
    mem_of(&ss->memory, x->mem);
  }
  char lb[256];
  family(pg, "mokd_tenant_label_sets", "gauge",
         "Distinct (uid, client) label sets in use, and the most there may be (metrics-max-label-sets); "
         "the rest count as uid=\"other\"");
  uint32_t used = 0;
  for (uint32_t i = 1; i <= m->n_sets; i++) used += m->sets[i].used;
  put(pg, "mokd_tenant_label_sets{bound=\"used\"} %u\nmokd_tenant_label_sets{bound=\"max\"} %u\n",
      used, m->n_sets);
  struct {
    const char *name, *type, *help;
  } fams[] = {
      {"mokd_tenant_sessions", "gauge", "Sessions now, by uid and client name"},
      {"mokd_tenant_jobs_completed_total", "counter", "Jobs completed, by uid and client name"},
      {"mokd_tenant_jobs_failed_total", "counter", "Jobs failed, by uid and client name"},
      {"mokd_tenant_jobs_in_flight", "gauge",
       "Jobs submitted and not yet completed, by uid and client name"},
      {"mokd_tenant_regions", "gauge", "Registered buffers, by uid and client name"},
      {"mokd_tenant_region_bytes", "gauge", "Registered bytes, by uid and client name"},
      {"mokd_tenant_memory_bytes", "gauge",
       "What the sessions hold in the engine, by uid, client name and kind"},
  };
  for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
    family(pg, fams[f].name, fams[f].type, fams[f].help);
    for (uint32_t i = 0; i <= m->n_sets; i++) {
      label_set *s = &m->sets[i];
      if (!s->used) continue;
      set_labels(s, i == 0, lb, sizeof lb);
      const set_gauges *x = &g[i];
      unsigned long long v = 0;
      switch (f) {
      case 0: v = s->refs; break;
      case 1: v = load(&s->sink.done); break;
      case 2: v = load(&s->sink.failed); break;
      case 3: v = x->in_flight; break;
      case 4: v = x->regions; break;
      case 5: v = x->region_bytes; break;
      default:
        for (int k = 0; k < 4; k++)
          put(pg, "%s{%s,kind=\"%s\"} %llu\n", fams[f].name, lb, mem_kinds[k],
              (unsigned long long)x->mem[k]);
        continue;
      }
      put(pg, "%s{%s} %llu\n", fams[f].name, lb, v);
    }
  }
  free(g);
}

char *mok_metrics_render(mok_metrics *m, const mok_metrics_page_info *info,
                         const mok_engine_stats *st, size_t *len) {
  if (!m) return NULL;
  page pg = {.cap = 16384};
  pg.p = malloc(pg.cap);
  if (!pg.p) return NULL;
  char a[160], b[160], c[320];
  family(&pg, "mokd_build_info", "gauge", "1, labelled with mokd's version, engine and device");
  put(&pg, "mokd_build_info{version=\"%s\",engine=\"%s\",device=\"%s\"} 1\n",
      esc(info->version, a, sizeof a), esc(info->engine, b, sizeof b),
      esc(info->device, c, sizeof c));
  family(&pg, "mokd_uptime_seconds", "gauge", "Seconds since mokd started");
  put(&pg, "mokd_uptime_seconds %.3f\n", (double)info->uptime_ms / 1000.0);
  family(&pg, "mokd_metrics_per_uid", "gauge",
         "1 when series by uid and client name are served (metrics-per-uid)");
  put(&pg, "mokd_metrics_per_uid %d\n", m->per_uid ? 1 : 0);

  family(&pg, "mokd_connections", "gauge", "Control-socket connections now (before Hello too)");
  put(&pg, "mokd_connections %u\n", info->connections);
  family(&pg, "mokd_sessions", "gauge", "Sessions now (connections that said Hello)");
  put(&pg, "mokd_sessions %u\n", m->sessions);
  family(&pg, "mokd_sessions_opened_total", "counter", "Sessions that said Hello since start");
  put(&pg, "mokd_sessions_opened_total %llu\n", (unsigned long long)m->sessions_opened);

  render_jobs(m, &pg);

  uint64_t in_flight = 0, regions = 0, region_bytes = 0, layers = 0, mem[4] = {0};
  for (size_t i = 0; i < st->n_sessions; i++) {
    const mok_session_stats *ss = &st->sessions[i];
    in_flight += ss->jobs_in_flight;
    regions += ss->regions;
    region_bytes += ss->region_bytes;
    layers += ss->layers;
    mem_of(&ss->memory, mem);
  }
  family(&pg, "mokd_jobs_in_flight", "gauge",
         "Jobs submitted to the rings and not yet completed (queued or running)");
  put(&pg, "mokd_jobs_in_flight %llu\n", (unsigned long long)in_flight);
  family(&pg, "mokd_regions", "gauge", "Registered buffers now");
  put(&pg, "mokd_regions %llu\n", (unsigned long long)regions);
  family(&pg, "mokd_region_bytes", "gauge", "Bytes of the registered buffers now");
  put(&pg, "mokd_region_bytes %llu\n", (unsigned long long)region_bytes);
  family(&pg, "mokd_layers", "gauge", "Layers now");
  put(&pg, "mokd_layers %llu\n", (unsigned long long)layers);
  family(&pg, "mokd_memory_bytes", "gauge",
         "What the sessions hold in the engine now, by kind: client device memory mapped, "
         "workspaces, layer state, other scratch (0: the engine does not say)");
  for (int k = 0; k < 4; k++)
    put(&pg, "mokd_memory_bytes{kind=\"%s\"} %llu\n", mem_kinds[k], (unsigned long long)mem[k]);
  family(&pg, "mokd_regions_registered_total", "counter", "Buffers registered since start");
  put(&pg, "mokd_regions_registered_total %llu\n", (unsigned long long)m->regions_registered);
  family(&pg, "mokd_region_bytes_registered_total", "counter",
         "Bytes of the buffers registered since start");
  put(&pg, "mokd_region_bytes_registered_total %llu\n",
      (unsigned long long)m->region_bytes_registered);
  family(&pg, "mokd_layers_created_total", "counter", "Layers created since start");
  put(&pg, "mokd_layers_created_total %llu\n", (unsigned long long)m->layers_created);

  family(&pg, "mokd_refusals_total", "counter",
         "Requests and connections refused, by the limit or rule that refused them");
  for (size_t i = 0; i < N_REASONS; i++)
    put(&pg, "mokd_refusals_total{reason=\"%s\"} %llu\n", reasons[i],
        (unsigned long long)m->refusals[i]);

  render_groups(&pg, st);
  if (m->per_uid) render_tenants(m, &pg, st);

  family(&pg, "mokd_http_connections", "gauge", "Connections to the metrics endpoint now");
  put(&pg, "mokd_http_connections %u\n", info->http_connections);
  family(&pg, "mokd_http_responses_total", "counter",
         "Responses of the metrics endpoint, by HTTP status (this one not yet counted)");
  for (size_t i = 0; i < N_HTTP_CODES; i++)
    put(&pg, "mokd_http_responses_total{code=\"%d\"} %llu\n", http_codes[i],
        (unsigned long long)m->http_answered[i]);
  family(&pg, "mokd_http_refused_connections_total", "counter",
         "Metrics connections closed at once: metrics-max-connections were open");
  put(&pg, "mokd_http_refused_connections_total %llu\n", (unsigned long long)m->http_over_cap);
  family(&pg, "mokd_http_timeouts_total", "counter",
         "Metrics connections closed by metrics-timeout-ms (a request or its reader too slow)");
  put(&pg, "mokd_http_timeouts_total %llu\n", (unsigned long long)m->http_timed_out);

  if (pg.failed) {
    free(pg.p);
    return NULL;
  }
  *len = pg.len;
  return pg.p;
}
