#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The daemon boundary in one command: the layer in one process (mok_bench)
# and through mokd (mok_bench_daemon), under MPS and without, in one call,
# then the table of what the boundary costs (boundary_table.py).
#   tests/bench/run_boundary.sh OUTDIR [T_LIST] [REPS]
#   AB=1 tests/bench/run_boundary.sh OUTDIR 2048,8192 20     (interleaved, below)
# Environment:
#   INPROC_MEMORY  mok_bench --memory kinds (default "own"; also pool, ipc,
#                  ipc-touched, vmm, vmm-ipc: where the operands live, to
#                  separate the memory's cost from mokd's)
#   DAEMON_MEMORY  mok_bench_daemon --memory kinds (default "cudamalloc vmm";
#                  also cudamalloc-unrounded)
#   MODES          "mps nomps" (default)
#   PIPED=1        through mokd also 8 jobs back to back with one wait (the
#                  client ahead of the GPU, as a trainer is)
#   NCU_SHAPE=NAME each kernel's duration, DRAM bytes and L2 hit rate, in one
#                  process and through mokd (without MPS), for that shape
#   AB=1           interleaved instead: one mok_bench_daemon --inproc-ab 1 per
#                  mode and client memory, the layer in-process and through
#                  mokd taking turns rep by rep in one process, on one stream,
#                  on the same inputs (separate runs drift by more than the
#                  cost: the clocks under the power cap); no mok_bench run.
#                  MODES defaults to "mps" and DAEMON_MEMORY to "cudamalloc"
#                  there; table: boundary_table.py OUTDIR --ab
#   PHASES=1       with AB=1: each step's time on both sides (mokd with
#                  MOK_CUDA_PROFILE=1 logs its jobs' steps, the in-process
#                  chain records events between its steps); table:
#                  phase_table.py OUTDIR (OUTDIR/phases_MODE_KIND.txt)
#   RUNS=N         with AB=1: N interleaved runs, into OUTDIR/run1..runN, then
#                  per configuration the median of the runs' costs
#                  (boundary_table.py --ab-runs; OUTDIR/table_ab_runs.txt):
#                  one run's row scatters by about +/-1.5 % on an H200
#   ONLY=NAMES     mok_bench_daemon --only (with AB=1)
#   MOKD_ARGS      more mokd options (e.g. "--idle-spin-us 5000")
#   CLIENT_WAIT=host  with AB=1: the mokd jobs submitted and waited for on
#                  the host instead of on the stream (no fence pending on
#                  either stream while mokd's kernels run)
# Binaries: $KBUILD/mok_bench (tests/gpu/build_kernels_v3.sh, default build-v3),
# $MOK_DEVBUILD/{bin/mokd,bench/mok_bench_daemon} (tests/gpu/build_device.sh).
# Files: OUTDIR/inproc_MODE_KIND.{json,log}, OUTDIR/daemon_MODE_KIND.{json,log},
# OUTDIR/table.txt, OUTDIR/ncu_*.csv; with AB=1 OUTDIR/ab_MODE_KIND.{json,log},
# OUTDIR/mokd_ab_MODE_KIND.log, OUTDIR/table_ab.txt.
set -uo pipefail
SELF="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")" # RUNS runs it again
cd "$(dirname "$0")/../.."
OUTDIR=${1:?outdir}; TS=${2:-2048,8192}; REPS=${3:-10}
AB=${AB:-0}
case $AB in 0|1) ;; *) echo "run_boundary.sh: AB must be 0 or 1, not '$AB'"; exit 2 ;; esac
RUNS=${RUNS:-1}
case $RUNS in ''|*[!0-9]*|0) echo "run_boundary.sh: RUNS must be a count, not '$RUNS'"; exit 2 ;; esac
if [ "$RUNS" -gt 1 ]; then
  [ "$AB" = 1 ] || { echo "run_boundary.sh: RUNS goes with AB=1"; exit 2; }
  rc=0
  for i in $(seq 1 "$RUNS"); do
    echo "== run $i of $RUNS"
    RUNS=1 "$SELF" "$OUTDIR/run$i" "$TS" "$REPS" || rc=1
  done
  dirs=()
  for i in $(seq 1 "$RUNS"); do dirs+=("$OUTDIR/run$i"); done
  python3 tests/bench/boundary_table.py --ab-runs "${dirs[@]}" |
    tee "$OUTDIR/table_ab_runs.txt" || rc=1
  exit $rc
fi
if [ "$AB" = 1 ]; then
  DAEMON=${DAEMON_MEMORY:-cudamalloc}; MODES=${MODES:-mps}
else
  DAEMON=${DAEMON_MEMORY:-cudamalloc vmm}; MODES=${MODES:-mps nomps}
fi
INPROC=${INPROC_MEMORY:-own}
KB=${KBUILD:-build-v3}; B=${MOK_DEVBUILD:-.devbuild}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH="$PWD/$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export NCCL_NVLS_ENABLE=0
rc=0
STEP_LOGS=$OUTDIR
# shellcheck source=tests/gpu/steps.sh
. tests/gpu/steps.sh # start_mps, stop_mps
PHASES=${PHASES:-0}; CLIENT_WAIT=${CLIENT_WAIT:-stream}
case $PHASES in 0|1) ;; *) echo "run_boundary.sh: PHASES must be 0 or 1"; exit 2 ;; esac
case $CLIENT_WAIT in stream|host) ;; *) echo "run_boundary.sh: CLIENT_WAIT: stream or host"; exit 2 ;; esac
MOKD_LOG_LEVEL=warn
[ "$PHASES" = 1 ] && { export MOK_CUDA_PROFILE=1; MOKD_LOG_LEVEL=info; }
mokd_up() { # SOCK LOG [wrapper...]
  local sock=$1 log=$2; shift 2
  # shellcheck disable=SC2086 # MOKD_ARGS: words
  "$@" "$B/bin/mokd" --engine cuda --socket "$sock" --log-level "$MOKD_LOG_LEVEL" ${MOKD_ARGS:-} \
    >"$log" 2>&1 &
  MOKD_PID=$!
  for _ in $(seq 1 600); do
    [ -S "$sock" ] && return 0
    kill -0 "$MOKD_PID" 2>/dev/null || break # it exited (its log says why)
    sleep 0.1
  done
  echo "mokd did not come up ($log)"; return 1
}
mokd_down() {
  kill -TERM "$MOKD_PID" 2>/dev/null; wait "$MOKD_PID" 2>/dev/null; rm -f "$1"
}
for v in $MODES; do
  case $v in mps|nomps) ;; *) echo "run_boundary.sh: MODES: mps or nomps, not '$v'"; exit 2 ;; esac
done
if [ "$AB" = 1 ]; then
  for v in $MODES; do
    [ "$v" = mps ] && { start_mps || { rc=1; continue; }; }
    for m in $DAEMON; do
      SOCK=/tmp/mok-boundary-ab-$$.sock
      mokd_up "$SOCK" "$OUTDIR/mokd_ab_${v}_$m.log" || { rc=1; continue; }
      echo "== interleaved: in-process and through mokd in one process, $v, client memory $m"
      MOK_SOCKET=$SOCK timeout 500 "$B/bench/mok_bench_daemon" --inproc-ab 1 --T "$TS" \
        --reps "$REPS" --memory "$m" --piped "${PIPED:-0}" --phases "$PHASES" \
        --client-wait "$CLIENT_WAIT" ${ONLY:+--only "$ONLY"} --out "$OUTDIR/ab_${v}_$m.json" \
        >"$OUTDIR/ab_${v}_$m.log" 2>&1 || rc=1
      grep -E "in-process side|through mokd|fail|rror|differ" "$OUTDIR/ab_${v}_$m.log" | sed 's/^/  /'
      mokd_down "$SOCK"
      if [ "$PHASES" = 1 ]; then
        python3 tests/bench/phase_table.py "$OUTDIR/ab_${v}_$m.json" "$OUTDIR/mokd_ab_${v}_$m.log" \
          | tee "$OUTDIR/phases_${v}_$m.txt" || rc=1
      fi
    done
    [ "$v" = mps ] && { stop_mps; sleep 1; }
  done
  python3 tests/bench/boundary_table.py "$OUTDIR" --ab | tee "$OUTDIR/table_ab.txt" || rc=1
  exit $rc
fi
for v in $MODES; do
  [ "$v" = mps ] && { start_mps || { rc=1; continue; }; }
  for k in $INPROC; do
    echo "== in-process, $v, --memory $k"
    timeout 300 "$KB/mok_bench" --variants cluster --T "$TS" --reps "$REPS" --memory "$k" \
      --out "$OUTDIR/inproc_${v}_$k.json" >"$OUTDIR/inproc_${v}_$k.log" 2>&1 || rc=1
    grep -E "^[a-z0-9.-]+ +T=" "$OUTDIR/inproc_${v}_$k.log" | sed -E 's/ +max\/mean [^ ]+//; s/ +status.*//; s/^/  /'
  done
  for m in $DAEMON; do
    SOCK=/tmp/mok-boundary-$$.sock
    mokd_up "$SOCK" "$OUTDIR/mokd_${v}_$m.log" || { rc=1; continue; }
    echo "== through mokd, $v, client memory $m"
    MOK_SOCKET=$SOCK timeout 300 "$B/bench/mok_bench_daemon" --T "$TS" --reps "$REPS" \
      --memory "$m" --piped "${PIPED:-0}" --out "$OUTDIR/daemon_${v}_$m.json" >"$OUTDIR/daemon_${v}_$m.log" 2>&1 || rc=1
    grep -E "through mokd|fail|rror" "$OUTDIR/daemon_${v}_$m.log" | sed 's/^/  /'
    mokd_down "$SOCK"
  done
  [ "$v" = mps ] && { stop_mps; sleep 1; }
done
if [ -n "${NCU_SHAPE:-}" ] && command -v ncu >/dev/null; then
  NC=(ncu --metrics gpu__time_duration.sum,dram__bytes_read.sum,lts__t_sector_hit_rate.pct --csv --page raw)
  T1=${TS%%,*}
  timeout 150 "${NC[@]}" "$KB/mok_bench" --variants cluster --routing balanced --T "$T1" --reps 1 \
    --warmup 0 --only "$NCU_SHAPE" >"$OUTDIR/ncu_inproc.csv" 2>"$OUTDIR/ncu_inproc.err" || rc=1
  for m in $DAEMON; do
    SOCK=/tmp/mok-boundary-ncu-$$.sock
    mokd_up "$SOCK" "$OUTDIR/ncu_mokd_$m.csv" timeout 200 "${NC[@]}" --target-processes all || { rc=1; continue; }
    MOK_SOCKET=$SOCK timeout 150 "$B/bench/mok_bench_daemon" --T "$T1" --reps 1 --warmup 0 \
      --only "$NCU_SHAPE" --memory "$m" >"$OUTDIR/ncu_client_$m.log" 2>&1 || rc=1
    pkill -TERM -x mokd; wait "$MOKD_PID" 2>/dev/null; rm -f "$SOCK"
  done
  echo "== ncu: $OUTDIR/ncu_inproc.csv, $OUTDIR/ncu_mokd_*.csv"
fi
for k in $INPROC; do
  python3 tests/bench/boundary_table.py "$OUTDIR" --inproc "$k" | tee -a "$OUTDIR/table.txt"
done
exit $rc
