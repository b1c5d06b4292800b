#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The license line of every source file: "SPDX-License-Identifier: Apache-2.0"
# within its first 5 lines.
#
#   deploy/spdx.sh --check [FILE...]   list every file lacking it; exit 1 if any
#   deploy/spdx.sh --fix [FILE...]     add it where it lacks (idempotent)
#
# Without FILEs: every file git tracks in the repository this script lies in.
# Source files are C and CUDA (.c .h .cu .cuh), .proto, Python, shell,
# Makefiles, systemd units, .conf, .pc.in and .toml files, MANIFEST.in, and any other file whose
# first line is a "#!" shebang; everything else (documents, data) is left out.
# --fix writes the line in the file's comment syntax as its first line, or
# right after a shebang line (and after a Python coding line that follows
# it). A file that names another SPDX license is reported and never changed.
# Exit status: 0 all good, 1 files lack the line (--check) or could not be
# fixed (--fix), 2 wrong usage or no file list.
set -u

LICENSE_ID="Apache-2.0"
TAG="SPDX-License-Identifier:"

usage() {
  sed -n '4,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

mode=
case "${1:-}" in
  --check) mode=check ;;
  --fix) mode=fix ;;
  -h|--help) usage ;;
  *) echo "spdx.sh: first argument must be --check or --fix" >&2; usage ;;
esac
shift

# comment style of a path: c (/* */), slash (//), hash (#) or "" (not source)
style_of() {
  local f=$1 base
  base=${f##*/}
  case "$base" in
    *.c|*.h|*.cu|*.cuh) echo c; return ;;
    *.proto) echo slash; return ;;
    *.py|*.sh|Makefile|*.mk|*.service|*.socket|*.target|*.service.in|*.socket.in| \
    *.conf|*.conf.in|*.pc.in|*.toml|MANIFEST.in) echo hash; return ;;
  esac
  if [ -f "$f" ] && [ "$(head -c 2 -- "$f" 2>/dev/null)" = "#!" ]; then
    echo hash
  fi
}

header_of() {
  case "$1" in
    c) echo "/* $TAG $LICENSE_ID */" ;;
    slash) echo "// $TAG $LICENSE_ID" ;;
    hash) echo "# $TAG $LICENSE_ID" ;;
  esac
}

# "ok", "missing" or "other:<id>" for a file's first 5 lines
state_of() {
  local f=$1 id
  id=$(head -n 5 -- "$f" | sed -n "s/.*$TAG[[:space:]]*\([^[:space:]*]*\).*/\1/p" | head -n 1)
  if [ -z "$id" ]; then
    echo missing
  elif [ "$id" = "$LICENSE_ID" ]; then
    echo ok
  else
    echo "other:$id"
  fi
}

# writes the header into f after a shebang (and a coding line after it)
fix_file() {
  local f=$1 header=$2 tmp
  tmp=$(mktemp "${TMPDIR:-/tmp}/spdx.XXXXXX") || return 1
  awk -v header="$header" -v py="$([ "${f##*.}" = py ] && echo 1)" '
    function coding(line) { return py && line ~ /^[ \t\f]*#.*coding[:=][ \t]*[-_.a-zA-Z0-9]+/ }
    NR == 1 && /^#!/ { print; next_after = 1; next }
    NR == 1 && coding($0) { print; print header; done = 1; next }
    NR == 2 && next_after && !done && coding($0) { print; print header; done = 1; next }
    !done { print header; done = 1 }
    { print }
    END { if (!done) print header }
  ' "$f" > "$tmp" || { rm -f "$tmp"; return 1; }
  # over the old file in place: its mode, owner and links stay
  cat "$tmp" > "$f" || { rm -f "$tmp"; return 1; }
  rm -f "$tmp"
}

cd "$(dirname "$0")/.." || exit 2
files=()
if [ $# -gt 0 ]; then
  files=("$@")
else
  if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    echo "spdx.sh: $(pwd) is not a git work tree; name the files to check" >&2
    exit 2
  fi
  while IFS= read -r -d '' f; do files+=("$f"); done < <(git ls-files -z)
fi

lacking=()
other=()
fixed=0
failed=0
for f in "${files[@]+"${files[@]}"}"; do
  if [ ! -f "$f" ]; then
    # a tracked file deleted in the work tree has nothing to check
    [ $# -gt 0 ] && { echo "spdx.sh: $f: no such file" >&2; failed=$((failed + 1)); }
    continue
  fi
  style=$(style_of "$f")
  [ -n "$style" ] || continue
  state=$(state_of "$f")
  case "$state" in
    ok) continue ;;
    other:*) other+=("$f (${state#other:})"); continue ;;
  esac
  if [ "$mode" = check ]; then
    lacking+=("$f")
  elif fix_file "$f" "$(header_of "$style")"; then
    fixed=$((fixed + 1))
  else
    echo "spdx.sh: $f: could not write the header" >&2
    failed=$((failed + 1))
  fi
done

for o in "${other[@]+"${other[@]}"}"; do
  echo "spdx.sh: $o names another license than $LICENSE_ID; left as it is" >&2
done
if [ "$mode" = check ]; then
  if [ ${#lacking[@]} -gt 0 ]; then
    printf '%s\n' "${lacking[@]}"
    echo "spdx.sh: ${#lacking[@]} file(s) lack \"$TAG $LICENSE_ID\" in their first 5 lines" \
         "(deploy/spdx.sh --fix adds it)" >&2
  fi
  [ ${#lacking[@]} -eq 0 ] && [ ${#other[@]} -eq 0 ] && [ "$failed" -eq 0 ]
  exit $?
fi
echo "spdx.sh: added the header to $fixed file(s)"
[ "$failed" -eq 0 ] && [ ${#other[@]} -eq 0 ]
