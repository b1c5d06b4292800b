#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
#
# The Python package as a user gets it: a fresh venv, `pip install` of the
# repository with its bf16 extra (ml_dtypes), then the numpy example
# (client/python/examples/moe_step.py) in float32 and bfloat16 and the
# bfloat16-results tests against a cpu-engine mokd this script starts.
# Needs the package index (numpy, ml_dtypes, setuptools, pytest) and what
# libmok's build needs (make, gcc, protoc-c, libprotobuf-c-dev).
#
#   tests/python/ci_pip_install.sh OUTDIR [--mokd PATH] [--python PYTHON]
#
# OUTDIR (made if missing; must be empty or absent) receives the venv, a copy
# of the repository's files that pip builds from (so the repository itself
# stays untouched and a file git does not know is caught missing), the
# daemon's socket and every log. --mokd: the daemon to run (default:
# build/bin/mokd, built into OUTDIR when missing); --python: the interpreter
# the venv is made from (default python3). Exit status 0 when everything
# passed; on a failure the step and its log are named.
set -eu
cd "$(dirname "$0")/../.."
REPO=$(pwd)

usage() { sed -n '11,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 1 ] || usage
case "$1" in -h|--help|-*) usage ;; esac
OUTDIR=$1; shift
MOKD=
PY=python3
while [ $# -gt 0 ]; do
  case "$1" in
    --mokd) MOKD=${2:?--mokd needs a path}; shift 2 ;;
    --python) PY=${2:?--python needs an interpreter}; shift 2 ;;
    *) echo "ci_pip_install: unknown option $1" >&2; usage ;;
  esac
done
if [ -e "$OUTDIR" ] && [ -n "$(ls -A "$OUTDIR" 2>/dev/null)" ]; then
  echo "ci_pip_install: $OUTDIR is not empty (give a fresh folder)" >&2; exit 2
fi
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)

step() { echo "== $*"; }
fail() { echo "ci_pip_install: FAILED: $*" >&2; exit 1; }
run_logged() { # name, command...: output to OUT/name.log, shown on failure
  local name=$1; shift
  if ! "$@" > "$OUTDIR/$name.log" 2>&1; then
    tail -n 40 "$OUTDIR/$name.log" >&2
    fail "$name (log: $OUTDIR/$name.log)"
  fi
}

step "copy the repository's files to $OUTDIR/src"
mkdir "$OUTDIR/src"
git ls-files -z --cached --others --exclude-standard | \
  (cd "$REPO" && xargs -0 cp --parents -t "$OUTDIR/src" 2>/dev/null) || true
[ -f "$OUTDIR/src/pyproject.toml" ] && [ -f "$OUTDIR/src/client/src/client.c" ] || \
  fail "copying the repository to $OUTDIR/src"

step "fresh venv ($PY)"
run_logged venv "$PY" -m venv "$OUTDIR/venv"
V="$OUTDIR/venv/bin/python"
run_logged pip-upgrade "$V" -m pip install --upgrade pip

step "pip install $OUTDIR/src[bf16]"
run_logged pip-install env -u MOK_LIBRARY -u PYTHONPATH "$V" -m pip install "$OUTDIR/src[bf16]"
run_logged pip-pytest "$V" -m pip install pytest

if [ -z "$MOKD" ]; then
  MOKD="$REPO/build/bin/mokd"
  if [ ! -x "$MOKD" ]; then
    step "build mokd into $OUTDIR/mokd-build"
    run_logged mokd-build make -C "$REPO" --no-print-directory NVCC= BUILD="$OUTDIR/mokd-build" \
      "$OUTDIR/mokd-build/bin/mokd"
    MOKD="$OUTDIR/mokd-build/bin/mokd"
  fi
fi
[ -x "$MOKD" ] || fail "no mokd at $MOKD"

SOCK="$OUTDIR/mokd.sock"
step "start $MOKD --engine cpu on $SOCK"
"$MOKD" --socket "$SOCK" --engine cpu --log-level warn > "$OUTDIR/mokd.log" 2>&1 &
MOKD_PID=$!
stop_mokd() {
  if [ -n "${MOKD_PID:-}" ] && kill -0 "$MOKD_PID" 2>/dev/null; then
    kill -TERM "$MOKD_PID" 2>/dev/null || true
    wait "$MOKD_PID" 2>/dev/null || true
  fi
}
trap stop_mokd EXIT
for _ in $(seq 200); do
  [ -S "$SOCK" ] && break
  kill -0 "$MOKD_PID" 2>/dev/null || { cat "$OUTDIR/mokd.log" >&2; fail "mokd exited at start"; }
  sleep 0.05
done
[ -S "$SOCK" ] || fail "mokd did not make $SOCK (log: $OUTDIR/mokd.log)"

# everything below runs outside the repository, with nothing pointing at it
clean_env=(env -u MOK_LIBRARY -u PYTHONPATH -u MOK_BF16 MOK_SOCKET="$SOCK")
cd "$OUTDIR"

step "the installed package: bundled libmok, py.typed, ml_dtypes results"
run_logged installed "${clean_env[@]}" "$V" -I -c '
import os, sys, numpy as np, ml_dtypes, mok
venv = sys.prefix
for what, path in (("mok", mok.__file__), ("libmok", mok.library_path())):
    assert os.path.realpath(path).startswith(os.path.realpath(venv)), (what, path, venv)
    print(what, path)
pkg = os.path.dirname(mok.__file__)
assert os.path.isfile(os.path.join(pkg, "py.typed")), "py.typed is missing"
assert mok.bf16_dtype() == np.dtype(ml_dtypes.bfloat16), mok.bf16_dtype()
print("mok", mok.__version__, "bf16 results as", mok.bf16_dtype())
'
cat "$OUTDIR/installed.log"

EXAMPLE="$REPO/client/python/examples/moe_step.py"
for dtype in float32 bfloat16; do
  step "$EXAMPLE --dtype $dtype"
  run_logged "moe_step-$dtype" "${clean_env[@]}" "$V" -I "$EXAMPLE" --dtype "$dtype" --steps 2
  cat "$OUTDIR/moe_step-$dtype.log"
  grep -q "^moe_step: OK$" "$OUTDIR/moe_step-$dtype.log" || fail "moe_step $dtype did not say OK"
  grep -q "libmok $OUTDIR/venv/" "$OUTDIR/moe_step-$dtype.log" || \
    fail "moe_step $dtype did not use the bundled libmok"
done

step "tests/python/test_bf16_results.py with ml_dtypes (against the repository's build)"
if [ -f "$REPO/build/lib/libmok.so" ] && [ -x "$REPO/build/bin/mokd" ]; then
  run_logged bf16-tests env -u MOK_BF16 MOK_BUILD=build "$V" -m pytest -q -p no:cacheprovider \
    -rs "$REPO/tests/python/test_bf16_results.py"
  tail -n 3 "$OUTDIR/bf16-tests.log"
  if grep -q "SKIPPED" "$OUTDIR/bf16-tests.log"; then fail "bf16 tests skipped with ml_dtypes"; fi
else
  echo "(skipped: the repository's build/ has no libmok.so and mokd; run make first)"
fi

stop_mokd
MOKD_PID=
echo "ci_pip_install: OK"
