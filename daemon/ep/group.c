/* SPDX-License-Identifier: Apache-2.0 */
/* Expert-parallel groups on one host: the shared segment, membership,
 * generations, job ordering and the two host barriers (docs/ep.md). */
#include "ep/group.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <linux/futex.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "layer.h"
#include "log.h"
#include "mok_slots.h"
#include "mok_status.h"

#define SEG_MAGIC 0x5045474bu /* "KGEP" */
#define SEG_VERSION 6u /* 3: capacity and ring in the sizing; 4: member incarnations;
                          * 5: whole failure messages in the posts; 6: the layer's
                          * dtype in the posts */
#define SEG_ALIGN 4096u
#define GEN_SHIFT 40u /* arrive word: generation << 40 | seq << 2 | phase */

typedef struct seg_rank {
  alignas(64) _Atomic uint64_t joined_gen; /* 0: not a member */
  _Atomic int32_t pid;                     /* the member's mokd */
  _Atomic uint64_t incarnation; /* ...and which process of that pid (our_incarnation) */
  alignas(64) _Atomic uint64_t arrive;
  _Atomic uint64_t dev_serial; /* names this member's device buffer (0: none yet) */
  /* by sequence parity: an engine without the host's second barrier (cuda)
   * may post job n+1 while a slower member still reads the posts of job n */
  alignas(64) mok_ep_group_post post[2];
  uint64_t fin_seq;
  int32_t fin_status;
  char fin_msg[MOK_JOB_MESSAGE_MAX];
} seg_rank;

typedef struct seg_header {
  uint32_t magic, version;
  uint32_t uid, reserved0;
  mok_ep_group_sizing sizing;
  char key[MOK_GROUP_KEY_MAX + 1];
  uint64_t total_bytes;
  uint64_t off_x, off_dout, off_ids, off_rw, off_land, off_drw;
  alignas(64) _Atomic uint64_t generation; /* from 1 */
  _Atomic uint64_t broken_gen;             /* == generation: broken */
  _Atomic uint64_t broken_claim;
  int32_t broken_by;
  char broken_msg[160];
  _Atomic uint32_t attached; /* daemons mapping it (changed under flock) */
  alignas(64) _Atomic uint32_t bell; /* futex word: bumped on every arrival */
  seg_rank ranks[MOK_GROUP_MAX_WORLD];
} seg_header;

struct mok_ep_group {
  uint32_t id;
  uid_t uid;
  char key[MOK_GROUP_KEY_MAX + 1];
  uint32_t rank;
  uint32_t timeout_ms;
  mok_ep_group_sizing sz;
  char path[256];
  int fd;
  seg_header *h;
  size_t bytes;
  mok_ep_group_buffers bufs;
  uint64_t gen, seq;
  uint32_t refs;
  uint64_t idle_since_ns; /* when refs dropped to 0 */
  mok_ep_group_table *table;
  uint64_t dev_serial;
  void *engine_state; /* the engine's per-group state (device buffers) */
  void (*engine_state_free)(void *);
  /* a group formed through NCCL: no segment (members may be on other
   * hosts); membership is the communicator, the job checks run on the
   * device, and this member's view of the group is local */
  bool nccl;
  uint8_t nccl_id[MOK_GROUP_NCCL_ID_BYTES];
  bool broken;
  char broken_msg[160];
  /* health, for the metrics: barriers that timed out on this member, and
   * per rank how often it was the one missing at a host barrier */
  uint64_t timeouts;
  uint64_t rank_missed[MOK_GROUP_MAX_WORLD];
  struct mok_ep_group *next;
};

struct mok_ep_group_table {
  mok_ep_group *groups;
  uint32_t next_id;
  uint32_t linger_ms;
  char dir[208]; /* "": $MOK_GROUP_DIR or /dev/shm (config: at most 200 bytes) */
  const _Atomic bool *abort;
};

__attribute__((format(printf, 4, 5))) static int fail(char *err, size_t errlen, int status,
                                                      const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
  return status;
}

static void group_break(mok_ep_group *g, const char *msg);

/* ---- futex bell ------------------------------------------------------------ */

static void bell_ring(seg_header *h) {
  atomic_fetch_add_explicit(&h->bell, 1u, memory_order_seq_cst);
  syscall(SYS_futex, (uint32_t *)&h->bell, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

static void bell_wait(seg_header *h, uint32_t seen, uint64_t ns) {
  struct timespec ts = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
  syscall(SYS_futex, (uint32_t *)&h->bell, FUTEX_WAIT, seen, &ts, NULL, 0);
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* ---- layout and checks ------------------------------------------------------- */

static uint64_t align_up(uint64_t v) { return (v + SEG_ALIGN - 1) & ~(uint64_t)(SEG_ALIGN - 1); }

typedef struct seg_layout {
  uint64_t off_x, off_dout, off_ids, off_rw, off_land, off_drw, total;
} seg_layout;

static seg_layout layout_of(const mok_ep_group_sizing *s) {
  uint64_t es = mok_dtype_size(s->dtype), n = (uint64_t)s->world * s->max_tokens;
  uint64_t rows = n * s->hidden * es, slots = n * s->topk;
  seg_layout l;
  l.off_x = align_up(sizeof(seg_header));
  l.off_dout = l.off_x + align_up(rows);
  l.off_ids = l.off_dout + align_up(rows);
  l.off_rw = l.off_ids + align_up(slots * 4u);
  l.off_land = l.off_rw + align_up(slots * 4u);
  l.off_drw = l.off_land + align_up(slots * s->hidden * es);
  l.total = l.off_drw + align_up(slots * 4u);
  return l;
}

static int check_sizing(const mok_ep_group_sizing *s, uint32_t rank, char *err, size_t errlen) {
  if (s->world < 1 || s->world > MOK_GROUP_MAX_WORLD)
    return fail(err, errlen, MOK_EINVAL, "world = %u is out of range [1, %u]", s->world,
                MOK_GROUP_MAX_WORLD);
  if (rank >= s->world)
    return fail(err, errlen, MOK_EINVAL, "rank = %u, a group of world %u has ranks 0..%u", rank,
                s->world, s->world - 1);
  if (s->max_tokens < 1 || s->max_tokens > MOK_LAYER_MAX_TOKENS)
    return fail(err, errlen, MOK_EINVAL, "max_tokens = %u is out of range [1, %u]",
                s->max_tokens, MOK_LAYER_MAX_TOKENS);
  if (s->hidden < 1 || s->hidden > MOK_LAYER_MAX_DIM)
    return fail(err, errlen, MOK_EINVAL, "hidden = %u is out of range [1, %u]", s->hidden,
                MOK_LAYER_MAX_DIM);
  if (s->experts < 1 || s->experts > MOK_LAYER_MAX_EXPERTS)
    return fail(err, errlen, MOK_EINVAL, "experts = %u is out of range [1, %u]", s->experts,
                MOK_LAYER_MAX_EXPERTS);
  if (s->topk < 1 || s->topk > MOK_LAYER_MAX_TOPK || s->topk > s->experts)
    return fail(err, errlen, MOK_EINVAL, "topk = %u is out of range [1, min(%u, experts)]",
                s->topk, MOK_LAYER_MAX_TOPK);
  if (s->experts % s->world)
    return fail(err, errlen, MOK_EINVAL,
                "experts = %u is not a multiple of world = %u (each rank holds experts / world)",
                s->experts, s->world);
  if (s->dtype != MOK_DTYPE_F32 && s->dtype != MOK_DTYPE_BF16)
    return fail(err, errlen, MOK_EINVAL,
                "dtype must be float32 or bfloat16: a group's dtype is its activations' (an "
                "fp8 layer's are bfloat16: it runs on a bfloat16 group)");
  if (s->capacity_ppm > 1000000u)
    return fail(err, errlen, MOK_EINVAL,
                "capacity = %u millionths is above 1 (all routes); use 0 or 1 for the worst case",
                s->capacity_ppm);
  if (s->ring_rows > MOK_GROUP_MAX_RING_ROWS)
    return fail(err, errlen, MOK_EINVAL, "ring_rows = %u is above %u", s->ring_rows,
                MOK_GROUP_MAX_RING_ROWS);
  seg_layout l = layout_of(s);
  if (l.total > MOK_GROUP_MAX_BYTES)
    return fail(err, errlen, MOK_ELIMIT,
                "the group's buffers would take %llu bytes (limit %llu): lower max_tokens",
                (unsigned long long)l.total, (unsigned long long)MOK_GROUP_MAX_BYTES);
  return MOK_OK;
}

int mok_ep_group_check_join(uid_t seg_uid, const mok_ep_group_sizing *seg, const char *seg_key,
                         const mok_ep_group_join_args *a, char *err, size_t errlen) {
  if (seg_uid != a->uid)
    return fail(err, errlen, MOK_EACCES,
                "group '%s' belongs to uid %u; a client of uid %u may not join it", a->key,
                (unsigned)seg_uid, (unsigned)a->uid);
  if (strcmp(seg_key, a->key) != 0)
    return fail(err, errlen, MOK_EACCES, "group segment holds key '%s', not '%s'", seg_key,
                a->key);
  const mok_ep_group_sizing *s = &a->sizing;
#define SAME(field)                                                                            \
  if (seg->field != s->field)                                                                  \
    return fail(err, errlen, MOK_EINVAL,                                                       \
                "group '%s' was formed with " #field " = %u; this join says %u: every rank "    \
                "must join with the same sizing",                                              \
                a->key, seg->field, s->field);
  SAME(world)
  SAME(max_tokens)
  SAME(hidden)
  SAME(topk)
  SAME(experts)
  SAME(dtype)
  SAME(capacity_ppm)
  SAME(ring_rows)
#undef SAME
  return MOK_OK;
}

static int check_key(const char *key, char *err, size_t errlen) {
  size_t n = strnlen(key, MOK_GROUP_KEY_MAX + 1);
  if (n == 0 || n > MOK_GROUP_KEY_MAX)
    return fail(err, errlen, MOK_EINVAL, "group key must be 1..%u bytes", MOK_GROUP_KEY_MAX);
  for (size_t i = 0; i < n; i++)
    if (key[i] < 0x20 || key[i] > 0x7e)
      return fail(err, errlen, MOK_EINVAL, "group key must be printable ASCII");
  return MOK_OK;
}

static uint64_t fnv1a(const char *s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (; *s; s++) h = (h ^ (uint8_t)*s) * 0x100000001b3ull;
  return h;
}

static bool pid_dead(int32_t pid) {
  return pid > 0 && kill((pid_t)pid, 0) < 0 && errno == ESRCH;
}

/* This process among all that had its pid (a restarted mokd in a container
 * often gets the same one): random, made once, never 0. */
static uint64_t our_incarnation(void) {
  static _Atomic uint64_t v;
  uint64_t x = atomic_load(&v);
  if (x) return x;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  x = ((uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec) ^
      ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)&v;
  x = x ? x : 1;
  uint64_t zero = 0;
  return atomic_compare_exchange_strong(&v, &zero, x) ? x : atomic_load(&v);
}

/* Is the mokd recorded in rank record r gone? */
static bool member_gone(const seg_rank *r) {
  int32_t pid = atomic_load(&r->pid);
  if (pid <= 0) return true;
  if (pid == (int32_t)getpid()) return atomic_load(&r->incarnation) != our_incarnation();
  return pid_dead(pid);
}

/* ---- the table --------------------------------------------------------------- */

mok_ep_group_table *mok_ep_group_table_create(const _Atomic bool *abort) {
  mok_ep_group_table *t = calloc(1, sizeof *t);
  if (!t) return NULL;
  t->abort = abort;
  t->linger_ms = MOK_GROUP_LINGER_MS; /* group-linger-ms: mok_ep_group_set_linger_ms */
  return t;
}

void mok_ep_group_set_linger_ms(mok_ep_group_table *t, uint32_t ms) { t->linger_ms = ms; }

void mok_ep_group_set_dir(mok_ep_group_table *t, const char *dir) {
  snprintf(t->dir, sizeof t->dir, "%s", dir ? dir : "");
}

const char *mok_ep_group_dir_of(const char *configured) {
  if (configured && *configured) return configured;
  const char *d = getenv("MOK_GROUP_DIR"); /* tests only (documented) */
  return d && *d ? d : MOK_GROUP_DIR_DEFAULT;
}

static const char *seg_dir(const mok_ep_group_table *t) { return mok_ep_group_dir_of(t->dir); }

/* ---- the segments' directory ------------------------------------------------
 *
 * Only the daemons' uid may write it: no tenant can squat a segment's path
 * (make every join of a key fail) or plant one. Checked at start and
 * before every segment is made; created 0700 when missing. */

/* A missing directory and, if need be, its missing parent (0755, as the
 * packaged tmpfiles.d makes /run/mok). */
static int make_dir(const char *dir, char *err, size_t errlen) {
  char parent[256];
  snprintf(parent, sizeof parent, "%s", dir);
  char *p = dirname(parent);
  struct stat st;
  if (stat(p, &st) < 0 && errno == ENOENT && mkdir(p, 0755) < 0 && errno != EEXIST)
    return fail(err, errlen, MOK_EACCES,
                "group-dir %s is missing and so is its parent %s, which mokd (uid %u) cannot "
                "create: %s; create %s owned by uid %u with mode 0700 (the packaged tmpfiles.d "
                "does), or set group-dir",
                dir, p, (unsigned)geteuid(), strerror(errno), dir, (unsigned)geteuid());
  if (mkdir(dir, 0700) < 0 && errno != EEXIST)
    return fail(err, errlen, MOK_EACCES,
                "group-dir %s is missing and mokd (uid %u) cannot create it: %s; create it "
                "owned by uid %u with mode 0700 (the packaged tmpfiles.d does), or set group-dir",
                dir, (unsigned)geteuid(), strerror(errno), (unsigned)geteuid());
  return MOK_OK;
}

int mok_ep_group_dir_check(const char *dir, bool create, char *err, size_t errlen) {
  const unsigned me = (unsigned)geteuid();
  if (dir[0] != '/' || strlen(dir) > 200)
    return fail(err, errlen, MOK_EINVAL, "group-dir %s must be an absolute path of at most 200 "
                "bytes", dir);
  struct stat st;
  if (lstat(dir, &st) < 0) {
    if (errno != ENOENT || !create)
      return fail(err, errlen, MOK_EIO, "group-dir %s: %s; create it owned by uid %u with mode "
                  "0700, or set group-dir", dir, strerror(errno), me);
    int r = make_dir(dir, err, errlen);
    if (r != MOK_OK) return r;
    if (lstat(dir, &st) < 0)
      return fail(err, errlen, MOK_EIO, "group-dir %s: %s", dir, strerror(errno));
  }
  if (S_ISLNK(st.st_mode))
    return fail(err, errlen, MOK_EACCES,
                "group-dir %s is a symbolic link; it must be a real directory that only mokd's "
                "uid %u can write (mode 0700): replace the link or set group-dir",
                dir, me);
  if (!S_ISDIR(st.st_mode))
    return fail(err, errlen, MOK_EACCES, "group-dir %s is not a directory; remove it or set "
                "group-dir", dir);
  if (st.st_uid != geteuid() && st.st_uid != 0)
    return fail(err, errlen, MOK_EACCES,
                "group-dir %s belongs to uid %u; it must belong to mokd's uid %u (or to root): "
                "chown %u %s, or set group-dir",
                dir, (unsigned)st.st_uid, me, me, dir);
  if (st.st_mode & (S_IWGRP | S_IWOTH))
    return fail(err, errlen, MOK_EACCES,
                "group-dir %s is writable by %s (mode %04o): another uid could squat or plant "
                "group segments there; chmod go-w %s (0700), or set group-dir to a directory "
                "only uid %u can write",
                dir, st.st_mode & S_IWOTH ? "everyone" : "its group",
                (unsigned)(st.st_mode & 07777), dir, me);
  if (faccessat(AT_FDCWD, dir, W_OK | X_OK, AT_EACCESS) < 0)
    return fail(err, errlen, MOK_EACCES,
                "mokd (uid %u) cannot write group-dir %s (owner uid %u, mode %04o): chown %u "
                "%s, or set group-dir",
                me, dir, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777), me, dir);
  /* a parent others can write (without the sticky bit) could swap the
   * directory for another under our feet */
  char parent[256];
  snprintf(parent, sizeof parent, "%s", dir);
  const char *p = dirname(parent);
  struct stat ps;
  if (stat(p, &ps) == 0 && (ps.st_mode & (S_IWGRP | S_IWOTH)) && !(ps.st_mode & S_ISVTX))
    return fail(err, errlen, MOK_EACCES,
                "the parent of group-dir %s, %s, is writable by others (mode %04o) without the "
                "sticky bit, so the directory could be replaced: chmod go-w %s, or set group-dir",
                dir, p, (unsigned)(ps.st_mode & 07777), p);
  return MOK_OK;
}

uint64_t mok_ep_group_segment_bytes(const mok_ep_group_sizing *s) {
  char err[8];
  if (check_sizing(s, 0, err, sizeof err) != MOK_OK) return 0;
  return layout_of(s).total;
}

int mok_ep_group_segment_path(const char *dir, uid_t uid, const char *key, char *buf,
                              size_t len) {
  int n = snprintf(buf, len, "%s/mok-ep-%u-%016llx", dir, (unsigned)uid,
                   (unsigned long long)fnv1a(key));
  return n > 0 && (size_t)n < len ? MOK_OK : MOK_EINVAL;
}

/* Why the file fd (st: its fstat), under its flock, is not a segment that
 * a live mokd uses: NULL when it is one (or may be), else the reason in
 * why. */
static const char *segment_dead(int fd, const struct stat *st, char *why, size_t n) {
  if (!S_ISREG(st->st_mode)) return snprintf(why, n, "not a regular file"), why;
  if (st->st_uid != geteuid())
    return snprintf(why, n, "owned by uid %u, not by mokd's uid %u", (unsigned)st->st_uid,
                    (unsigned)geteuid()), why;
  if ((st->st_mode & 07777) != 0600)
    return snprintf(why, n, "mode %04o, where mokd makes 0600", (unsigned)(st->st_mode & 07777)),
           why;
  if ((uint64_t)st->st_size < sizeof(seg_header) || (uint64_t)st->st_size > MOK_GROUP_MAX_BYTES)
    return snprintf(why, n, "%lld bytes, no segment's size", (long long)st->st_size), why;
  seg_header *h = malloc(sizeof *h);
  if (!h) return NULL; /* cannot tell: leave it */
  const char *res = NULL;
  char sizing_err[8];
  if (pread(fd, h, sizeof *h, 0) != (ssize_t)sizeof *h) {
    res = (snprintf(why, n, "unreadable header"), why);
  } else if (h->magic != SEG_MAGIC) {
    res = (snprintf(why, n, "not a mok group segment"), why);
  } else if (h->version != SEG_VERSION) {
    res = NULL; /* another mokd version's: its layout is not ours to judge (refused) */
  } else if (check_sizing(&h->sizing, 0, sizing_err, sizeof sizing_err) != MOK_OK ||
             h->total_bytes != (uint64_t)st->st_size ||
             layout_of(&h->sizing).total != h->total_bytes) {
    res = (snprintf(why, n, "its header does not match its size"), why);
  } else if (atomic_load(&h->attached) == 0) {
    res = (snprintf(why, n, "no mokd is attached to it"), why);
  } else {
    bool live = false;
    for (uint32_t p = 0; p < h->sizing.world && !live; p++) live = !member_gone(&h->ranks[p]);
    if (!live) res = (snprintf(why, n, "every member's mokd is gone"), why);
  }
  free(h);
  return res;
}

/* Remove what lies at path if it is still the file fd refers to (st). */
static void unlink_if_same(const char *path, const struct stat *st) {
  struct stat now;
  if (lstat(path, &now) == 0 && now.st_ino == st->st_ino && now.st_dev == st->st_dev) {
    if (S_ISDIR(now.st_mode)) rmdir(path);
    else unlink(path);
  }
}

/* path exists but cannot be a segment (a link, a directory, a device...):
 * remove it, so that a join of its key can make the segment. */
static int reclaim_non_file(const char *path, const struct stat *st, char *err, size_t errlen) {
  const char *what = S_ISLNK(st->st_mode) ? "a symbolic link" : S_ISDIR(st->st_mode) ? "a directory"
                                                                                       : "not a regular file";
  int r = S_ISDIR(st->st_mode) ? rmdir(path) : unlink(path);
  if (r < 0 && errno != ENOENT)
    return fail(err, errlen, MOK_EIO,
                "group segment %s is %s, and mokd cannot remove it: %s; remove it by hand",
                path, what, strerror(errno));
  log_warn("group segment %s was %s, not a segment mokd made; removed it", path, what);
  return MOK_OK;
}

int mok_ep_group_dir_sweep(const char *dir, unsigned *removed, char *err, size_t errlen) {
  *removed = 0;
  int r = mok_ep_group_dir_check(dir, true, err, errlen);
  if (r != MOK_OK) return r;
  DIR *d = opendir(dir);
  if (!d) return fail(err, errlen, MOK_EIO, "group-dir %s: %s", dir, strerror(errno));
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    if (strncmp(e->d_name, "mok-ep-", 7) != 0) continue;
    char path[512], why[96];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    struct stat st;
    if (lstat(path, &st) < 0) continue;
    if (!S_ISREG(st.st_mode)) {
      if (reclaim_non_file(path, &st, err, errlen) == MOK_OK) ++*removed;
      else log_warn("%s", err);
      continue;
    }
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    /* a segment being made or used holds its lock now and then: skip it */
    struct stat fst;
    if (flock(fd, LOCK_EX | LOCK_NB) == 0 && fstat(fd, &fst) == 0 && fst.st_nlink > 0 &&
        fst.st_ino == st.st_ino && segment_dead(fd, &fst, why, sizeof why)) {
      log_warn("group segment %s: %s; removed it", path, why);
      unlink_if_same(path, &fst);
      ++*removed;
    }
    close(fd);
  }
  closedir(d);
  return MOK_OK;
}

/* Leave the segment: our rank is free, and the last daemon out removes it. */
static void group_release(mok_ep_group *g) {
  /* the engine's buffers first: peers may still be mapping ours until we go */
  if (g->engine_state && g->engine_state_free) g->engine_state_free(g->engine_state);
  if (g->h) {
    flock(g->fd, LOCK_EX);
    seg_rank *me = &g->h->ranks[g->rank];
    if (atomic_load(&me->pid) == (int32_t)getpid()) {
      atomic_store(&me->joined_gen, 0);
      atomic_store(&me->pid, 0);
      atomic_store(&me->incarnation, 0);
    }
    bell_ring(g->h);
    uint32_t left = atomic_fetch_sub(&g->h->attached, 1u) - 1u;
    if (left == 0) unlink(g->path);
    flock(g->fd, LOCK_UN);
    munmap(g->h, g->bytes);
  }
  if (g->fd >= 0) close(g->fd);
  log_info("group '%s' rank %u released", g->key, g->rank);
  free(g);
}

static void table_remove(mok_ep_group_table *t, mok_ep_group *g) {
  for (mok_ep_group **p = &t->groups; *p; p = &(*p)->next) {
    if (*p != g) continue;
    *p = g->next;
    return;
  }
}

void mok_ep_group_table_destroy(mok_ep_group_table *t) {
  if (!t) return;
  while (t->groups) {
    mok_ep_group *g = t->groups;
    t->groups = g->next;
    group_release(g);
  }
  free(t);
}

mok_ep_group *mok_ep_group_find_key(mok_ep_group_table *t, uid_t uid, const char *key) {
  for (mok_ep_group *g = t->groups; g; g = g->next)
    if (g->uid == uid && strcmp(g->key, key) == 0) return g;
  return NULL;
}

mok_ep_group *mok_ep_group_find(mok_ep_group_table *t, uint32_t id) {
  for (mok_ep_group *g = t->groups; g; g = g->next)
    if (g->id == id) return g;
  return NULL;
}

void mok_ep_group_unref(mok_ep_group_table *t, mok_ep_group *g, bool leave) {
  if (g->refs > 0) g->refs--;
  if (g->refs > 0) return;
  if (leave || t->linger_ms == 0) {
    table_remove(t, g);
    group_release(g);
    return;
  }
  g->idle_since_ns = mok_clock_ns();
}

void mok_ep_group_tick(mok_ep_group_table *t) {
  uint64_t now = mok_clock_ns();
  for (mok_ep_group **p = &t->groups; *p;) {
    mok_ep_group *g = *p;
    if (g->refs == 0 && now - g->idle_since_ns >= (uint64_t)t->linger_ms * 1000000ull) {
      *p = g->next;
      group_release(g);
      continue;
    }
    p = &g->next;
  }
}

/* Has a job of this generation got past its first barrier? Then every rank
 * had joined it, and a daemon joining afresh replaces a member that is gone:
 * the group needs a new generation. (A member merely waiting at the first
 * barrier of job 1 is the normal start-up race, not a reason.) */
static bool generation_in_use(seg_header *h, uint64_t gen) {
  for (uint32_t p = 0; p < h->sizing.world; p++) {
    uint64_t a = atomic_load(&h->ranks[p].arrive);
    if ((a >> GEN_SHIFT) == gen && (a & ((1ull << GEN_SHIFT) - 1)) > (1ull << 2 | 1ull))
      return true;
  }
  return false;
}

/* Enter the segment's current generation as this rank (under flock).
 * fresh: this daemon did not hold the group before. */
static void enter_generation(mok_ep_group *g, bool fresh) {
  seg_header *h = g->h;
  uint64_t gen = atomic_load(&h->generation);
  bool broken = atomic_load(&h->broken_gen) == gen;
  if (broken || (fresh && generation_in_use(h, gen))) {
    gen++;
    atomic_store(&h->generation, gen);
    log_info("group '%s': rank %u starts generation %llu (%s)", g->key, g->rank,
             (unsigned long long)gen, broken ? "it was broken" : "a member came back");
  }
  seg_rank *me = &h->ranks[g->rank];
  atomic_store(&me->arrive, 0);
  atomic_store(&me->incarnation, our_incarnation());
  atomic_store(&me->pid, (int32_t)getpid());
  atomic_store(&me->dev_serial, g->dev_serial);
  atomic_store(&me->joined_gen, gen);
  g->gen = gen;
  g->seq = 0;
  bell_ring(h);
}

/* Make the segment at g->path, or open the one a peer made: created with
 * O_EXCL (never through a link, never someone else's file); an existing one
 * is verified after open and removed when it is stale (every member's mokd
 * gone) or not a segment mokd made, then made afresh. */
static int open_segment(mok_ep_group *g, const mok_ep_group_join_args *a, char *err, size_t errlen) {
  int r = mok_ep_group_dir_check(seg_dir(g->table), true, err, errlen);
  if (r != MOK_OK) return r;
  seg_layout l = layout_of(&a->sizing);
  int empty_waits = 0;
  for (int attempt = 0; attempt < 64; attempt++) {
    bool create = true;
    int fd = open(g->path, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST) {
      create = false;
      struct stat ls;
      if (lstat(g->path, &ls) < 0) continue; /* gone meanwhile */
      if (!S_ISREG(ls.st_mode)) {
        if ((r = reclaim_non_file(g->path, &ls, err, errlen)) != MOK_OK) return r;
        continue;
      }
      fd = open(g->path, O_RDWR | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
      if (fd < 0 && (errno == ENOENT || errno == ELOOP)) continue; /* replaced meanwhile */
    }
    if (fd < 0)
      return fail(err, errlen, errno == EACCES ? MOK_EACCES : MOK_EIO, "cannot open %s: %s",
                  g->path, strerror(errno));
    if (flock(fd, LOCK_EX) < 0) {
      close(fd);
      return fail(err, errlen, MOK_EIO, "flock %s: %s", g->path, strerror(errno));
    }
    struct stat st;
    if (fstat(fd, &st) < 0) {
      close(fd);
      return fail(err, errlen, MOK_EIO, "fstat %s: %s", g->path, strerror(errno));
    }
    if (st.st_nlink == 0) { /* removed meanwhile (its last member, a reclaim): start over */
      close(fd);
      continue;
    }
    if (!create) {
      /* empty: its maker is between its open and its lock (or died there) */
      if (st.st_size == 0 && S_ISREG(st.st_mode) && empty_waits++ < 20) {
        close(fd);
        usleep(1000);
        continue;
      }
      char why[96];
      if (segment_dead(fd, &st, why, sizeof why)) {
        log_warn("group segment %s: %s; removed it and making it afresh", g->path, why);
        unlink_if_same(g->path, &st);
        close(fd);
        continue;
      }
    }
    int fr;
    if (create && (fr = posix_fallocate(fd, 0, (off_t)l.total)) != 0) {
      unlink(g->path); /* ours, half made: the next joiner starts afresh */
      close(fd);
      return fail(err, errlen, MOK_ENOMEM,
                  "cannot size the group segment %s to %llu bytes: %s (group-dir's filesystem "
                  "is too small?)",
                  g->path, (unsigned long long)l.total, strerror(fr));
    }
    size_t bytes = create ? l.total : (size_t)st.st_size;
    seg_header *h = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (h == MAP_FAILED) {
      if (create) unlink(g->path);
      close(fd);
      return fail(err, errlen, MOK_ENOMEM, "mmap of the group segment: %s", strerror(errno));
    }
    if (create) {
      h->magic = SEG_MAGIC;
      h->version = SEG_VERSION;
      h->uid = (uint32_t)a->uid;
      h->sizing = a->sizing;
      snprintf(h->key, sizeof h->key, "%s", a->key);
      h->total_bytes = l.total;
      h->off_x = l.off_x, h->off_dout = l.off_dout, h->off_ids = l.off_ids;
      h->off_rw = l.off_rw, h->off_land = l.off_land, h->off_drw = l.off_drw;
      atomic_store(&h->generation, 1);
    } else {
      if (h->version != SEG_VERSION)
        r = fail(err, errlen, MOK_EIO,
                 "group segment %s was made by a mokd of another version (segment version %u, "
                 "this mokd makes %u): run one mokd version on every GPU of the group",
                 g->path, h->version, SEG_VERSION);
      else if ((r = mok_ep_group_check_join(h->uid, &h->sizing, h->key, a, err, errlen)) != MOK_OK)
        ;
      else if (h->total_bytes != l.total || bytes != l.total)
        r = fail(err, errlen, MOK_EIO, "group segment %s has the wrong size", g->path);
      if (r == MOK_OK) {
        seg_rank *me = &h->ranks[a->rank];
        int32_t pid = atomic_load(&me->pid);
        if (atomic_load(&me->joined_gen) != 0 && pid != 0 && pid != (int32_t)getpid() &&
            !pid_dead(pid))
          r = fail(err, errlen, MOK_EBUSY,
                   "rank %u of group '%s' is held by another mokd (pid %d): each rank joins "
                   "through its own GPU's mokd",
                   a->rank, a->key, (int)pid);
      }
      if (r != MOK_OK) {
        munmap(h, bytes);
        close(fd);
        return r;
      }
    }
    g->fd = fd;
    g->h = h;
    g->bytes = bytes;
    atomic_fetch_add(&h->attached, 1u);
    enter_generation(g, true);
    flock(fd, LOCK_UN);
    char *base = (char *)h;
    g->bufs = (mok_ep_group_buffers){base + h->off_x, base + h->off_dout,
                                  (int32_t *)(base + h->off_ids), (float *)(base + h->off_rw),
                                  base + h->off_land, (float *)(base + h->off_drw)};
    return MOK_OK;
  }
  return fail(err, errlen, MOK_EBUSY, "group segment %s keeps disappearing or stays empty "
              "(another mokd making it died?); join again", g->path);
}

/* A re-join of a group formed through NCCL: with the id it was formed
 * with and not broken, cheap (nothing changes); with another id (the
 * trainer made a new one) or broken, the member re-forms: the engine's
 * state (communicator, buffer) goes now, and group_attach forms the new
 * one with every rank. */
static void rejoin_nccl(mok_ep_group *g, const mok_ep_group_join_args *a, bool *rejoined) {
  if (!g->broken && memcmp(g->nccl_id, a->nccl_id, sizeof g->nccl_id) == 0) {
    *rejoined = true;
    return;
  }
  if (g->engine_state && g->engine_state_free) g->engine_state_free(g->engine_state);
  g->engine_state = NULL;
  g->engine_state_free = NULL;
  memcpy(g->nccl_id, a->nccl_id, sizeof g->nccl_id);
  g->broken = false;
  g->gen++;
  g->seq = 0;
  *rejoined = false;
  log_info("group '%s': rank %u re-forms it through NCCL (generation %llu)", g->key, g->rank,
           (unsigned long long)g->gen);
}

int mok_ep_group_join(mok_ep_group_table *t, const mok_ep_group_join_args *a, mok_ep_group **ret,
                   bool *rejoined, char *err, size_t errlen) {
  int r = check_key(a->key, err, errlen);
  if (r == MOK_OK) r = check_sizing(&a->sizing, a->rank, err, errlen);
  if (r != MOK_OK) return r;
  uint32_t timeout = a->timeout_ms ? a->timeout_ms : MOK_GROUP_DEFAULT_TIMEOUT_MS;
  if (timeout > MOK_GROUP_MAX_TIMEOUT_MS)
    return fail(err, errlen, MOK_EINVAL, "timeout_ms = %u exceeds %u", timeout,
                MOK_GROUP_MAX_TIMEOUT_MS);
  for (mok_ep_group *g = t->groups; g; g = g->next) {
    if (g->uid != a->uid || strcmp(g->key, a->key) != 0) continue;
    if (g->rank != a->rank)
      return fail(err, errlen, MOK_EINVAL,
                  "this mokd already serves rank %u of group '%s'; one mokd serves one rank of "
                  "a group (two ranks would wait for each other on one engine thread)",
                  g->rank, a->key);
    if ((r = mok_ep_group_check_join(g->uid, &g->sz, g->key, a, err, errlen)) != MOK_OK) return r;
    if (g->nccl != a->nccl)
      return fail(err, errlen, MOK_EINVAL,
                  "group '%s' was formed %s on this mokd; every join must say the same (leave "
                  "it first to change)",
                  a->key, g->nccl ? "through NCCL (with an nccl_id)" : "on this host (no nccl_id)");
    if (g->nccl) {
      rejoin_nccl(g, a, rejoined);
      g->refs++;
      g->timeout_ms = timeout;
      *ret = g;
      return MOK_OK;
    }
    /* a cheap re-join: unless the group broke or was re-formed meanwhile */
    seg_header *h = g->h;
    uint64_t gen = atomic_load(&h->generation);
    if (gen != g->gen || atomic_load(&h->broken_gen) == gen ||
        atomic_load(&h->ranks[g->rank].joined_gen) != g->gen) {
      flock(g->fd, LOCK_EX);
      enter_generation(g, false);
      flock(g->fd, LOCK_UN);
    }
    g->refs++;
    g->timeout_ms = timeout;
    *rejoined = true;
    *ret = g;
    return MOK_OK;
  }
  mok_ep_group *g = calloc(1, sizeof *g);
  if (!g) return fail(err, errlen, MOK_ENOMEM, "out of memory");
  g->fd = -1;
  g->uid = a->uid;
  snprintf(g->key, sizeof g->key, "%s", a->key);
  g->rank = a->rank;
  g->sz = a->sizing;
  g->timeout_ms = timeout;
  g->table = t;
  if (a->nccl) { /* no segment: the engine forms the communicator (group_attach) */
    g->nccl = true;
    memcpy(g->nccl_id, a->nccl_id, sizeof g->nccl_id);
    g->gen = 1;
  } else {
    if (mok_ep_group_segment_path(seg_dir(t), a->uid, a->key, g->path, sizeof g->path) !=
        MOK_OK) {
      free(g);
      return fail(err, errlen, MOK_EINVAL, "group-dir %s is too long for a segment's path",
                  seg_dir(t));
    }
    r = open_segment(g, a, err, errlen);
    if (r != MOK_OK) {
      free(g);
      return r;
    }
  }
  g->id = ++t->next_id;
  g->refs = 1;
  g->next = t->groups;
  t->groups = g;
  *rejoined = false;
  *ret = g;
  log_info("group '%s': joined as rank %u of %u (generation %llu)", g->key, g->rank,
           g->sz.world, (unsigned long long)g->gen);
  return MOK_OK;
}

mok_ep_group *mok_ep_group_next(mok_ep_group_table *t, mok_ep_group *prev) {
  return prev ? prev->next : t->groups;
}
const char *mok_ep_group_key(const mok_ep_group *g) { return g->key; }
uint32_t mok_ep_group_refs(const mok_ep_group *g) { return g->refs; }
bool mok_ep_group_is_broken(const mok_ep_group *g) {
  if (g->nccl) return g->broken;
  uint64_t gen = atomic_load(&g->h->generation);
  return gen != g->gen || atomic_load(&g->h->broken_gen) == g->gen;
}
uint32_t mok_ep_group_id(const mok_ep_group *g) { return g->id; }
uid_t mok_ep_group_uid(const mok_ep_group *g) { return g->uid; }
uint32_t mok_ep_group_rank(const mok_ep_group *g) { return g->rank; }
const mok_ep_group_sizing *mok_ep_group_get_sizing(const mok_ep_group *g) { return &g->sz; }
uint64_t mok_ep_group_generation(const mok_ep_group *g) { return g->gen; }
uint64_t mok_ep_group_sequence(const mok_ep_group *g) { return g->seq; }
const mok_ep_group_buffers *mok_ep_group_bufs(const mok_ep_group *g) { return &g->bufs; }

uint32_t mok_ep_group_timeout_ms(const mok_ep_group *g) { return g->timeout_ms; }

void *mok_ep_group_engine_state(const mok_ep_group *g) { return g->engine_state; }

void mok_ep_group_set_engine_state(mok_ep_group *g, void *state, void (*state_free)(void *),
                                   uint64_t dev_serial) {
  g->engine_state = state;
  g->engine_state_free = state_free;
  g->dev_serial = dev_serial;
  if (!g->h) return;
  atomic_store(&g->h->ranks[g->rank].dev_serial, dev_serial);
  bell_ring(g->h);
}

bool mok_ep_group_is_nccl(const mok_ep_group *g) { return g->nccl; }

bool mok_ep_group_needs_forming(const mok_ep_group *g) { return g->nccl && !g->engine_state; }

void mok_ep_group_attach_failed(mok_ep_group *g, const char *why) {
  /* a group re-formed through NCCL lost its old state: its other sessions'
   * jobs must fail clearly until a join succeeds */
  if (g->nccl) mok_ep_group_mark_broken(g, why);
}

mok_ep_group_form mok_ep_group_form_of(const mok_ep_group *g) {
  mok_ep_group_form f;
  memset(&f, 0, sizeof f);
  f.uid = g->uid;
  f.rank = g->rank;
  f.timeout_ms = g->timeout_ms;
  f.sizing = g->sz;
  memcpy(f.nccl_id, g->nccl_id, sizeof f.nccl_id);
  return f;
}
const uint8_t *mok_ep_group_nccl_id(const mok_ep_group *g) { return g->nccl ? g->nccl_id : NULL; }

mok_ep_group_peer mok_ep_group_peer_of(const mok_ep_group *g, uint32_t p) {
  mok_ep_group_peer r = {0};
  if (p >= g->sz.world || !g->h) return r;
  const seg_rank *o = &g->h->ranks[p];
  r.pid = atomic_load(&o->pid);
  r.dev_serial = atomic_load(&o->dev_serial);
  r.joined = atomic_load(&o->joined_gen) == g->gen;
  return r;
}

void mok_ep_group_mark_broken(mok_ep_group *g, const char *why) { group_break(g, why); }

void mok_ep_group_count_timeout(mok_ep_group *g) { g->timeouts++; }
uint64_t mok_ep_group_timeouts(const mok_ep_group *g) { return g->timeouts; }
uint64_t mok_ep_group_rank_missed(const mok_ep_group *g, uint32_t p) {
  return p < MOK_GROUP_MAX_WORLD ? g->rank_missed[p] : 0;
}

uint32_t mok_ep_group_peer_tokens(const mok_ep_group *g, uint32_t p) {
  if (!g->h) return g->sz.max_tokens;
  uint32_t t = g->h->ranks[p].post[g->seq & 1].tokens;
  return t <= g->sz.max_tokens ? t : g->sz.max_tokens;
}

/* ---- jobs ---------------------------------------------------------------------- */

/* Mark the group broken (first one wins the message) and wake everyone. */
static void group_break(mok_ep_group *g, const char *msg) {
  if (g->nccl) {
    if (!g->broken) snprintf(g->broken_msg, sizeof g->broken_msg, "%s", msg);
    g->broken = true;
    return;
  }
  seg_header *h = g->h;
  uint64_t prev = atomic_load(&h->broken_claim);
  if (prev < g->gen && atomic_compare_exchange_strong(&h->broken_claim, &prev, g->gen)) {
    h->broken_by = (int32_t)g->rank;
    snprintf(h->broken_msg, sizeof h->broken_msg, "%s", msg);
    atomic_store(&h->broken_gen, g->gen);
  }
  bell_ring(h);
}

/* Why this member may not run group jobs now (MOK_OK: it may). */
static int check_usable(mok_ep_group *g, char *err, size_t errlen) {
  if (g->nccl)
    return g->broken ? fail(err, errlen, MOK_ECLOSED,
                            "group '%s' is broken (%s): re-join it with a new NCCL id", g->key,
                            g->broken_msg)
                     : MOK_OK;
  seg_header *h = g->h;
  uint64_t gen = atomic_load(&h->generation);
  if (gen != g->gen)
    return fail(err, errlen, MOK_ECLOSED,
                "group '%s' was re-formed (generation %llu, this member has %llu): re-join it",
                g->key, (unsigned long long)gen, (unsigned long long)g->gen);
  if (atomic_load(&h->broken_gen) == g->gen)
    return fail(err, errlen, MOK_ECLOSED, "group '%s' is broken (rank %d: %s): re-join it",
                g->key, (int)h->broken_by, h->broken_msg);
  seg_rank *me = &h->ranks[g->rank];
  if (atomic_load(&me->joined_gen) != g->gen || atomic_load(&me->pid) != (int32_t)getpid())
    return fail(err, errlen, MOK_ECLOSED,
                "rank %u of group '%s' was taken over by another mokd: re-join it", g->rank,
                g->key);
  return MOK_OK;
}

int mok_ep_group_job_start(mok_ep_group *g, char *err, size_t errlen) {
  return check_usable(g, err, errlen);
}

/* Arrive at (seq, phase) and wait for every member, bounded by the timeout. */
static int barrier(mok_ep_group *g, uint32_t phase, char *err, size_t errlen) {
  seg_header *h = g->h;
  const uint32_t W = g->sz.world;
  const uint64_t epoch = g->gen << GEN_SHIFT | g->seq << 2 | phase;
  atomic_store_explicit(&h->ranks[g->rank].arrive, epoch, memory_order_release);
  bell_ring(h);
  uint64_t start = mok_clock_ns(), deadline = start + (uint64_t)g->timeout_ms * 1000000ull;
  for (uint64_t spins = 0;; spins++) {
    uint32_t bell = atomic_load_explicit(&h->bell, memory_order_acquire);
    int r = check_usable(g, err, errlen);
    if (r != MOK_OK) return r;
    uint32_t missing = 0;
    for (uint32_t p = 0; p < W; p++) {
      uint64_t a = atomic_load_explicit(&h->ranks[p].arrive, memory_order_acquire);
      if ((a >> GEN_SHIFT) != g->gen || a < epoch) missing++;
    }
    if (missing == 0) return MOK_OK;
    uint64_t now = mok_clock_ns();
    if (g->table->abort && atomic_load(g->table->abort)) {
      group_break(g, "a member's mokd is shutting down");
      return fail(err, errlen, MOK_ESHUTDOWN, "mokd is shutting down");
    }
    if (now >= deadline) {
      char who[160];
      size_t n = 0;
      who[0] = '\0';
      g->timeouts++;
      for (uint32_t p = 0; p < W; p++) {
        uint64_t a = atomic_load(&h->ranks[p].arrive);
        if ((a >> GEN_SHIFT) == g->gen && a >= epoch) continue;
        g->rank_missed[p]++;
        if (n >= sizeof who - 16) continue;
        bool joined = atomic_load(&h->ranks[p].joined_gen) == g->gen;
        n += (size_t)snprintf(who + n, sizeof who - n, "%s%u%s", n ? ", " : "", p,
                              joined ? "" : " (not joined)");
      }
      char msg[200];
      snprintf(msg, sizeof msg, "job %llu: rank(s) %s did not arrive within %u ms",
               (unsigned long long)g->seq, who, g->timeout_ms);
      group_break(g, msg);
      return fail(err, errlen, MOK_ETIMEOUT, "group '%s' %s; the group is broken until its "
                  "members re-join", g->key, msg);
    }
    if (spins < 2000) {
      cpu_relax();
      continue;
    }
    uint64_t left = deadline - now, slice = 50000000ull; /* re-check abort every 50 ms */
    bell_wait(h, bell, left < slice ? left : slice);
  }
}

mok_ep_group_post mok_ep_group_post_for(const mok_layer_config *l, uint32_t op, uint32_t flags,
                                  uint32_t tokens) {
  mok_ep_group_post p;
  memset(&p, 0, sizeof p);
  p.op = op;
  p.flags = flags;
  p.tokens = tokens;
  if (l) {
    p.tag = l->group_tag;
    p.dtype = l->dtype;
    p.intermediate = l->intermediate;
    p.shared_intermediate = l->shared_intermediate;
    p.has_limit = l->has_limit;
    p.swiglu_limit = l->has_limit ? l->swiglu_limit : 0.0f;
  }
  return p;
}

bool mok_ep_group_post_failure(mok_ep_group *g, const mok_layer_config *l, uint32_t op,
                               uint32_t flags, uint32_t tokens, int status, const char *msg) {
  if (g->nccl) return false; /* the engine takes the turn on the device */
  if (op != MOK_OP_FORWARD && op != MOK_OP_BACKWARD) return true;
  char err[MOK_JOB_MESSAGE_MAX];
  if (mok_ep_group_job_start(g, err, sizeof err) != MOK_OK) return true;
  mok_ep_group_post p = mok_ep_group_post_for(l, op, flags, tokens);
  p.status = status;
  snprintf(p.msg, sizeof p.msg, "%.*s", (int)sizeof p.msg - 1, msg); /* cut */
  (void)mok_ep_group_job_post(g, &p, err, sizeof err);
  return true;
}

/* "forward tag 3", plus the fields that differ from the other post (the
 * completion message is short). */
static void describe_post(const mok_ep_group_post *p, const mok_ep_group_post *o, char *buf,
                          size_t len) {
  int n = snprintf(buf, len, "%s%s tag %u", mok_op_name(p->op),
                   p->flags & MOK_JOB_RECOMPUTE ? "+recompute" : "", p->tag);
  if (n < 0 || (size_t)n >= len) return;
  if (p->dtype != o->dtype)
    n += snprintf(buf + n, len - (size_t)n, " %s layer", mok_dtype_name(p->dtype));
  if (n < 0 || (size_t)n >= len) return;
  if (p->intermediate != o->intermediate || p->shared_intermediate != o->shared_intermediate)
    n += snprintf(buf + n, len - (size_t)n, " I %u/%u", p->intermediate, p->shared_intermediate);
  if (n < 0 || (size_t)n >= len) return;
  if (p->has_limit != o->has_limit || memcmp(&p->swiglu_limit, &o->swiglu_limit, 4) != 0)
    snprintf(buf + n, len - (size_t)n, " limit %g", p->has_limit ? (double)p->swiglu_limit : 0.0);
}

int mok_ep_group_job_post(mok_ep_group *g, mok_ep_group_post *mine, char *err, size_t errlen) {
  int r = check_usable(g, err, errlen);
  if (r != MOK_OK) return r;
  g->seq++;
  mine->seq = g->seq;
  if (g->nccl) return MOK_OK; /* the engine compares the posts on the device */
  seg_rank *me = &g->h->ranks[g->rank];
  memcpy(&me->post[g->seq & 1], mine, sizeof *mine);
  r = barrier(g, 1, err, errlen);
  if (r != MOK_OK) return r;
  /* every member sees every post: all reach the same verdict */
  for (uint32_t p = 0; p < g->sz.world; p++) {
    const mok_ep_group_post *o = &g->h->ranks[p].post[g->seq & 1];
    if (o->status != MOK_OK)
      return fail(err, errlen, o->status, "group job %llu failed on rank %u: %.*s",
                  (unsigned long long)g->seq, p, (int)sizeof o->msg, o->msg);
  }
  for (uint32_t p = 0; p < g->sz.world; p++) {
    const mok_ep_group_post *o = &g->h->ranks[p].post[g->seq & 1];
    const mok_ep_group_post *first = &g->h->ranks[0].post[g->seq & 1];
    if (o->seq != g->seq)
      return fail(err, errlen, MOK_EINVAL, "group job %llu: rank %u is at job %llu",
                  (unsigned long long)g->seq, p, (unsigned long long)o->seq);
    if (o->op != first->op || o->flags != first->flags || o->tag != first->tag ||
        o->dtype != first->dtype || o->intermediate != first->intermediate ||
        o->shared_intermediate != first->shared_intermediate ||
        o->has_limit != first->has_limit ||
        memcmp(&o->swiglu_limit, &first->swiglu_limit, sizeof(float)) != 0) {
      char a[64], b[64];
      describe_post(first, o, a, sizeof a);
      describe_post(o, first, b, sizeof b);
      return fail(err, errlen, MOK_EINVAL,
                  "group job %llu mismatch: rank 0 runs %s, rank %u %s (ranks must run the same "
                  "layers in the same order)",
                  (unsigned long long)g->seq, a, p, b);
    }
  }
  return MOK_OK;
}

int mok_ep_group_job_finish(mok_ep_group *g, int status, const char *msg, char *err, size_t errlen) {
  if (g->nccl) { /* the engine's device barrier shares the statuses */
    if (status != MOK_OK) snprintf(err, errlen, "%s", msg ? msg : "");
    return status;
  }
  seg_rank *me = &g->h->ranks[g->rank];
  me->fin_seq = g->seq;
  me->fin_status = status;
  snprintf(me->fin_msg, sizeof me->fin_msg, "%s", msg ? msg : "");
  int r = barrier(g, 2, err, errlen);
  if (r != MOK_OK) return r;
  for (uint32_t p = 0; p < g->sz.world; p++) {
    const seg_rank *o = &g->h->ranks[p];
    if (o->fin_seq == g->seq && o->fin_status != MOK_OK)
      return fail(err, errlen, o->fin_status, "group job %llu failed on rank %u: %.*s",
                  (unsigned long long)g->seq, p, (int)sizeof o->fin_msg, o->fin_msg);
  }
  return MOK_OK;
}
