/* SPDX-License-Identifier: Apache-2.0 */
/* libmok.so exports the interface of client/include/mok.h and nothing else:
 * its internals (the RPC, the framing, the protobuf-c code) stay hidden, so
 * a program cannot come to depend on them. The list of the library's
 * defined dynamic symbols (nm -D --defined-only) is held to the header's
 * MOK_EXTERN functions, each versioned MOK_1; mok_version() answers the
 * headers' MOK_VERSION. Run from the repository root (make test does). */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness/check.h"
#include "mok.h"

#define MAX_NAMES 256
#define NAME_MAX_ 64

typedef struct name_list {
  char names[MAX_NAMES][NAME_MAX_];
  int n;
} name_list;

static const char *lib_path(void) {
  static char path[256];
  const char *b = getenv("MOK_BUILD");
  snprintf(path, sizeof path, "%s/lib/libmok.so", b && *b ? b : "build");
  return path;
}

static int has(const name_list *l, const char *name) {
  for (int i = 0; i < l->n; i++)
    if (strcmp(l->names[i], name) == 0) return 1;
  return 0;
}

/* The functions mok.h declares MOK_EXTERN: "MOK_EXTERN <type> name(". */
static void header_names(name_list *l) {
  FILE *f = fopen("client/include/mok.h", "r");
  CHECK_MSG(f != NULL, "cannot open client/include/mok.h (run from the repository root)");
  if (!f) return;
  char line[512];
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, "MOK_EXTERN ", 11) != 0) continue;
    char *paren = strchr(line, '(');
    if (!paren) continue;
    char *end = paren;
    char *start = end;
    while (start > line && (start[-1] == '_' || (start[-1] >= 'a' && start[-1] <= 'z') ||
                            (start[-1] >= '0' && start[-1] <= '9')))
      start--;
    CHECK(l->n < MAX_NAMES && end - start < NAME_MAX_);
    snprintf(l->names[l->n++], NAME_MAX_, "%.*s", (int)(end - start), start);
  }
  fclose(f);
}

static void test_only_the_header_is_exported(void) {
  name_list *want = calloc(1, sizeof *want), *got = calloc(1, sizeof *got);
  header_names(want);
  CHECK_MSG(want->n >= 40, "only %d MOK_EXTERN functions found in mok.h", want->n);
  char cmd[320];
  snprintf(cmd, sizeof cmd, "nm -D --defined-only '%s'", lib_path());
  FILE *p = popen(cmd, "r");
  CHECK_MSG(p != NULL, "cannot run %s", cmd);
  char line[512];
  int foreign = 0, unversioned = 0;
  while (p && fgets(line, sizeof line, p)) {
    char addr[64], type[8], sym[400];
    if (sscanf(line, "%63s %7s %399s", addr, type, sym) != 3) continue;
    if (strcmp(type, "A") == 0) continue; /* the version node itself (MOK_1) */
    char *at = strchr(sym, '@');
    if (!at || strcmp(at, "@@MOK_1") != 0) {
      unversioned++;
      CHECK_MSG(0, "%s: not versioned MOK_1", sym);
    }
    if (at) *at = '\0';
    if (!has(want, sym)) {
      foreign++;
      CHECK_MSG(0, "libmok.so exports %s, which mok.h does not declare MOK_EXTERN", sym);
    }
    if (got->n < MAX_NAMES) snprintf(got->names[got->n++], NAME_MAX_, "%.*s", NAME_MAX_ - 1, sym);
  }
  int rc = p ? pclose(p) : -1;
  CHECK_MSG(rc == 0, "%s exited with status %d", cmd, rc);
  for (int i = 0; i < want->n; i++)
    CHECK_MSG(has(got, want->names[i]), "mok.h declares %s, libmok.so does not export it",
              want->names[i]);
  printf("# libmok.so exports %d symbols (mok.h declares %d; %d foreign, %d unversioned)\n",
         got->n, want->n, foreign, unversioned);
  free(want);
  free(got);
}

static void test_the_library_knows_its_version(void) {
  void *dl = dlopen(lib_path(), RTLD_NOW | RTLD_LOCAL);
  CHECK_MSG(dl != NULL, "dlopen %s: %s", lib_path(), dlerror());
  if (!dl) return;
  const char *(*version)(void) = (const char *(*)(void))dlsym(dl, "mok_version");
  CHECK_MSG(version != NULL, "libmok.so lacks mok_version");
  if (version)
    CHECK_MSG(strcmp(version(), MOK_VERSION) == 0, "mok_version() is %s, the headers %s",
              version(), MOK_VERSION);
  CHECK_MSG(dlsym(dl, "mok_rpc") == NULL, "libmok.so exports mok_rpc");
  dlclose(dl);
}

static const check_case cases[] = {
    CHECK_CASE(test_only_the_header_is_exported),
    CHECK_CASE(test_the_library_knows_its_version),
    {0},
};

int main(int argc, char **argv) { return check_main(argc, argv, cases); }
