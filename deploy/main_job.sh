#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The main job, from nothing: install what is missing, build, start mokd
# (the cuda engine when a GPU is usable, else the cpu engine), run a real
# client doing MoE forward and backward steps checked against a float64
# reference, stop mokd. Exit status 0 means every result matched.
#
#   deploy/main_job.sh [--engine cpu|cuda] [extra moe_step.py options]
set -eu
cd "$(dirname "$0")/.."
engine=
if [ "${1:-}" = "--engine" ]; then engine=$2; shift 2; fi

deploy/setup.sh
make -j"$(nproc)" build/bin/mokd build/bin/mokctl build/lib/libmok.so >/dev/null
python=$(for p in python3 /usr/bin/python3; do $p -c 'import numpy' 2>/dev/null && { command -v $p; break; }; done)
[ -n "$python" ] || { echo "main_job: no python3 with numpy (run deploy/setup.sh as root)" >&2; exit 1; }

if [ -z "$engine" ]; then
  engine=cpu
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 &&
     build/bin/mokd --list-engines | grep -qx cuda; then
    engine=cuda
  fi
fi

run=$(mktemp -d /tmp/mok-main-XXXXXX)
sock=$run/mokd.sock
build/bin/mokd --socket "$sock" --engine "$engine" --log-level warn 2>"$run/mokd.log" &
mokd_pid=$!
trap 'kill $mokd_pid 2>/dev/null; wait $mokd_pid 2>/dev/null; rm -rf "$run"' EXIT
for _ in $(seq 100); do [ -S "$sock" ] && break; kill -0 $mokd_pid 2>/dev/null || break; sleep 0.1; done
if ! [ -S "$sock" ]; then
  echo "main_job: mokd did not start:" >&2
  cat "$run/mokd.log" >&2
  exit 1
fi
echo "main_job: mokd (pid $mokd_pid, $engine engine) on $sock"
status=0
MOK_SOCKET=$sock "$python" client/python/examples/moe_step.py "$@" || status=$?
build/bin/mokctl --socket "$sock" status || status=1
kill $mokd_pid
wait $mokd_pid || { echo "main_job: mokd exited with an error" >&2; status=1; }
trap 'rm -rf "$run"' EXIT
[ "$status" -eq 0 ] && echo "main_job: OK" || echo "main_job: FAILED (status $status)"
exit $status
