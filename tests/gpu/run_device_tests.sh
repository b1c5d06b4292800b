#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The cuda engine on a GPU machine, end to end, in one call:
#   1. the kernel library's own tests (tests/gpu/run_kernel_tests.sh)
#   2. mokd --engine cuda + tests/gpu/test_cuda_engine through libmok:
#      correctness vs ref64 and the cpu engine, single-step chain, determinism,
#      errors, stream fences, host-memfd and device (IPC) memory; fp8 layers
#      (the fp8 step) against the cpu engine's fp8 recipe and ref64
#   3. 4 concurrent client processes, without and with MPS: same bits
#   4. a client fence that never comes (MOK_FENCE_TIMEOUT_MS) -> ETIMEOUT
#   5. the Python binding with torch CUDA tensors (tests/gpu/test_torch.py; fp8
#      modules: tests/gpu/test_torch_fp8.py)
#      and compute-sanitizer memcheck on mokd (small shapes)
#   6. timings at T=2048 (the benchmark shapes of docs/design.md, balanced routing)
#   7. expert parallelism: the EP integration tests on the cuda engine, under
#      MPS, daemons spread over every GPU (tests/gpu/run_ep_tests.sh)
#   8. tenant isolation (tests/gpu/run_isolation_memory.sh): a client racing
#      its own buffers beside a victim client, without MPS (hostile), under
#      MPS (hostile_mps) and with mokd under memcheck (hostile_memcheck); the
#      job watchdog (watchdog); the session workspace (workspace)
# and prints a summary. Binaries: $MOK_DEVBUILD (default .devbuild, built on a
# development machine with tests/gpu/build_device.sh and copied here), else `make`.
#
#   tests/gpu/run_device_tests.sh [--out DIR] [STEP...]   STEP: kernels correct fp8 concurrent fence
#                                             python sanitize time ep hostile hostile_mps
#                                             hostile_memcheck watchdog workspace
#                                             (default: all of them)
# --out DIR: logs.tgz (every log) goes there. Environment: LOGS (default /tmp/mok-device-logs), KERNEL_STEPS (default
# "build correct"). Exit status 0 when every step passed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
B=${MOK_DEVBUILD:-.devbuild}
# logs in one folder, packed into DIR/logs.tgz at the end (one file to keep)
OUTDIR=
if [ "${1:-}" = --out ]; then OUTDIR=${2:?--out needs a folder}; shift 2; fi
LOGS=${LOGS:-/tmp/mok-device-logs}
rm -rf "$LOGS"
mkdir -p "$LOGS"
export LD_LIBRARY_PATH="$ROOT/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
SAN=${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
SOCK=/tmp/mok-devtest.sock
TEST=$B/tests/gpu/test_cuda_engine
STEP_LOGS=$LOGS
. tests/gpu/steps.sh # note, record, build_missing, start_mokd [PREFIX...], stop_mokd, start_mps, stop_mps

build_missing "$B/bin/mokd" "$TEST"
trap 'stop_mokd; echo quit | nvidia-cuda-mps-control >/dev/null 2>&1' EXIT
export MOK_SOCKET=$SOCK

step_kernels() {
  note "kernel library tests (${KERNEL_STEPS:-build correct})"
  BUILD_DIR=$B/kernel-tests tests/gpu/run_kernel_tests.sh --out "$LOGS/kernels" ${KERNEL_STEPS:-build correct} \
    >"$LOGS/kernel_tests.log" 2>&1
  local rc=$?
  tail -4 "$LOGS/kernel_tests.log"
  record kernels "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_correct() {
  note "mokd --engine cuda: correctness through libmok"
  start_mokd || { record correct "FAIL (mokd)"; return; }
  timeout 300 "$TEST" correct 2>&1 | tee "$LOGS/correct.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || { echo "mokd exit status non-zero"; rc=1; }
  record correct "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_fp8() {
  note "mokd --engine cuda: fp8 layers through libmok"
  start_mokd || { record fp8 "FAIL (mokd)"; return; }
  timeout 300 "$TEST" fp8 2>&1 | tee "$LOGS/fp8.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || { echo "mokd exit status non-zero"; rc=1; }
  record fp8 "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

concurrent_hashes() { # label -> prints "label: N distinct hashes" ; returns 0 when one
  local label=$1 pids=() i
  for i in 1 2 3 4; do
    timeout 120 "$TEST" hash 2 >"$LOGS/concurrent_${label}_$i.log" 2>&1 &
    pids+=($!)
  done
  local bad=0
  for p in "${pids[@]}"; do wait "$p" || bad=1; done
  grep -h '^hash' "$LOGS"/concurrent_"${label}"_*.log | sort | uniq -c | tee "$LOGS/hashes_$label.txt"
  [ $bad = 0 ] && [ "$(sort -u "$LOGS/hashes_$label.txt" | awk '{print $3}' | sort -u | wc -l)" = 1 ]
}

step_concurrent() {
  note "4 concurrent clients, no MPS"
  start_mokd || { record concurrent "FAIL (mokd)"; return; }
  "$TEST" hash 2 >"$LOGS/single.log" 2>&1
  local single ok=1
  single=$(grep '^hash' "$LOGS/single.log" | awk '{print $2}')
  echo "single process: $single"
  concurrent_hashes nomps || ok=0
  grep -q "$single" "$LOGS/hashes_nomps.txt" || ok=0
  stop_mokd || ok=0
  note "4 concurrent clients under MPS"
  local mps_ok=1
  if start_mps; then
    if start_mokd; then
      concurrent_hashes mps || mps_ok=0
      grep -q "$single" "$LOGS/hashes_mps.txt" || mps_ok=0
      stop_mokd || mps_ok=0
    else
      mps_ok=0
    fi
    stop_mps
  else
    stop_mps # no daemon to quit: forget its folders
    mps_ok=0
  fi
  record concurrent "$([ $ok = 1 ] && echo PASS || echo FAIL)"
  record concurrent_mps "$([ $mps_ok = 1 ] && echo PASS || echo FAIL)"
}

step_fence() {
  note "a client fence that never comes"
  MOKD_LOG_LEVEL=debug start_mokd env MOK_FENCE_TIMEOUT_MS=1500 || { record fence "FAIL (mokd)"; return; }
  timeout 120 "$TEST" fence 2>&1 | tee "$LOGS/fence.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || rc=1
  grep -i "fence\|warn\|error" "$LOGS/mokd.log" | tail -8
  record fence "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_sanitize() {
  note "compute-sanitizer memcheck on mokd (quick shapes)"
  start_mokd "$SAN" --tool memcheck --error-exitcode 3 --log-file "$LOGS/memcheck_mokd.log" ||
    { record sanitize "FAIL (mokd under the sanitizer)"; return; }
  timeout 400 "$TEST" quick >"$LOGS/sanitize_client.log" 2>&1
  local rc=$?
  tail -2 "$LOGS/sanitize_client.log"
  stop_mokd || rc=$?
  tail -6 "$LOGS/memcheck_mokd.log"
  grep -q "ERROR SUMMARY: 0 errors" "$LOGS/memcheck_mokd.log" || rc=1
  record sanitize "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_python() {
  note "Python binding: torch CUDA tensors (zero copy, current stream) vs numpy"
  start_mokd || { record python "FAIL (mokd)"; return; }
  local pp="$ROOT/client/python"
  [ -d "$B/python/mok" ] && pp="$ROOT/$B/python" # the binding as built with the carried libmok
  PYTHONPATH="$pp" MOK_LIBRARY="$ROOT/$B/lib/libmok.so" PYTHONUNBUFFERED=1 \
    timeout 180 python3 tests/gpu/test_torch.py 2>&1 | tee "$LOGS/python.log"
  local rc=${PIPESTATUS[0]}
  PYTHONPATH="$pp" MOK_LIBRARY="$ROOT/$B/lib/libmok.so" PYTHONUNBUFFERED=1 \
    timeout 180 python3 tests/gpu/test_torch_fp8.py 2>&1 | tee "$LOGS/python_fp8.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  stop_mokd || rc=1
  record python "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_time() {
  note "timings at T=2048 through the daemon (balanced routing)"
  start_mokd || { record time "FAIL (mokd)"; return; }
  timeout 300 "$TEST" time 2>&1 | tee "$LOGS/time.log"
  local rc=${PIPESTATUS[0]}
  stop_mokd || rc=1
  record time "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

step_ep() {
  local gpus
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  note "expert parallelism on the cuda engine ($gpus GPU(s), MPS)"
  MOK_DEVBUILD=$B tests/gpu/run_ep_tests.sh --out "$LOGS/ep" "${gpus:-1}" >"$LOGS/ep.txt" 2>&1
  local rc=$?
  tail -3 "$LOGS/ep.txt"
  record ep "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

# steps of tests/gpu/run_isolation_memory.sh, each with mokd of its own
step_isolation() { # STEP
  stop_mokd
  MOK_DEVBUILD=$B tests/gpu/run_isolation_memory.sh --out "$LOGS/isolation" "$1" >"$LOGS/$1.txt" 2>&1
  local rc=$?
  grep -A6 "^== hostile\|^== job watchdog\|^== session workspace" "$LOGS/$1.txt" | tail -8
  record "$1" "$([ $rc = 0 ] && echo PASS || echo "FAIL (rc $rc)")"
}

steps=("$@")
[ ${#steps[@]} = 0 ] && steps=(kernels correct fp8 concurrent fence python sanitize time ep hostile
  hostile_mps hostile_memcheck watchdog workspace)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1
for s in "${steps[@]}"; do
  case $s in
    kernels|correct|fp8|concurrent|fence|sanitize|python|time|ep) "step_$s" ;;
    hostile|hostile_mps|hostile_memcheck|watchdog|workspace) step_isolation "$s" ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
echo
note "summary"
for l in "${summary[@]}"; do echo "  $l"; done
[ $status = 0 ] && note "ALL PASSED" || note "SOME STEPS FAILED"
[ -n "$OUTDIR" ] && mkdir -p "$OUTDIR" && tar czf "$OUTDIR/logs.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
exit $status
