#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The v3 kernel step in one GPU call (one H200, about 6 minutes): every
# kernel path's bitwise and correctness tests, the tile variants swept on
# the benchmark shapes (docs/design.md), ncu on one configuration per GEMM, a summary table.
#
#   tests/gpu/run_kernels_v3.sh [OUTDIR]     OUTDIR: $1, else BUILD/results
#
# The binaries come from tests/gpu/build_kernels_v3.sh, run beforehand on a
# machine with nvcc (no GPU needed); copy its folder here: BUILD = $MOK_V3BUILD,
# default build-v3. Nothing is compiled here.
# Steps, in this order, each under a time limit within the whole budget
# (V3_BUDGET seconds, default 360):
#   test_gemm_sm90 correct    forward: every variant bitwise = default path = mma.sync
#   test_gemm_sm90 bwd        backward: the same, each mode alone and all together
#                             (both again with the cutlass variant's DOWN on ping-pong)
#   test_kernels correct      the whole layer against the float64 reference
#   test_kernels quick        the same on the cluster, pingpong, quad and cutlass variants (MOK_GEMM_VARIANT)
#   test_ring                 macrobatches = one pass, on every backend and variant
#   mok_bench                 the layer at the four shapes, T=2048 and 8192, balanced
#                             routing, per variant (rows, expert, cluster): ms, TFLOP/s,
#                             hashes equal across variants
#   ncu                       `test_gemm_sm90 profile` at kimi-k2.7 T=8192: one launch
#                             of each GEMM in the rows and cluster variants
#   summary                   tests/gpu/v3_summary.py: the table (also summary.txt)
# A variant whose test step timed out (a hang) is left out of the bench and ncu.
# Environment: NCU (default: ncu on PATH or under /usr/local/cuda or
# /opt/nvidia; NCU=none: no profile), PYTHON (python3), V3_SHAPE / V3_T (the
# ncu configuration), V3_SKIP (step names to leave out, e.g. "kernels_correct"),
# V3_VARIANTS / V3_NCU_VARIANTS (the variants benched / profiled; default
# rows,expert,cluster,pingpong,quad,cutlass / rows,cluster,pingpong,quad,cutlass).
# Exit status: 0 when every step passed.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
B=${MOK_V3BUILD:-build-v3}
OUTDIR=${1:-$B/results}
BUDGET=${V3_BUDGET:-360}
PYTHON=${PYTHON:-python3}
SHAPE=${V3_SHAPE:-kimi-k2.7}
PT=${V3_T:-8192}
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)}
mkdir -p "$OUTDIR"
STEPS=$OUTDIR/steps.tsv
: >"$STEPS"
status=0
note() { printf '== %s\n' "$*"; }

for b in test_gemm_sm90 test_kernels test_ring mok_bench; do
  [ -x "$B/$b" ] || { echo "missing $B/$b: run tests/gpu/build_kernels_v3.sh first (and carry $B)"; exit 2; }
done
cp "$B/resources.txt" "$B/sass.txt" "$B/commit" "$OUTDIR/" 2>/dev/null

# step NAME LIMIT CMD...: runs CMD under min(LIMIT, what the budget has
# left less 15 s for the summary), its output in OUTDIR/NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  case " ${V3_SKIP:-} " in *" $name "*)
    note "$name: skipped (V3_SKIP)"
    printf '%s\tskip\t0\tV3_SKIP\n' "$name" >>"$STEPS"
    return 0 ;;
  esac
  local left=$((BUDGET - SECONDS - 15))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    note "$name: skipped (budget spent)"
    printf '%s\tskip\t0\tbudget spent\n' "$name" >>"$STEPS"
    status=1
    return 0
  fi
  note "$name (limit ${limit} s)"
  local t0=$SECONDS rc
  timeout -k 5 "$limit" "$@" >"$OUTDIR/$name.log" 2>&1
  rc=$?
  tail -n 3 "$OUTDIR/$name.log"
  local why=""
  [ $rc = 124 ] || [ $rc = 137 ] && why="timed out; "
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" "$why" >>"$STEPS"
  [ $rc = 0 ] || status=1
  return $rc
}

step info 10 bash -c 'nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,memory.used --format=csv; nvidia-smi -q -d CLOCK | head -30'

cluster_ok=1
step gemm_correct 80 "$B/test_gemm_sm90" correct
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step gemm_bwd 90 "$B/test_gemm_sm90" bwd
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step gemm_correct_pp 80 "$B/test_gemm_sm90" correct every-pp
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step gemm_bwd_pp 90 "$B/test_gemm_sm90" bwd every-pp
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step kernels_correct 100 "$B/test_kernels" correct
step kernels_cluster 30 env MOK_GEMM_VARIANT=cluster "$B/test_kernels" quick
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step kernels_pingpong 30 env MOK_GEMM_VARIANT=pingpong "$B/test_kernels" quick
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step kernels_quad 30 env MOK_GEMM_VARIANT=quad "$B/test_kernels" quick
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step kernels_cutlass 30 env MOK_GEMM_VARIANT=cutlass MOK_GEMM_CUTLASS=every "$B/test_kernels" quick
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0
step ring 40 "$B/test_ring"
rc=$?; [ $rc = 124 ] || [ $rc = 137 ] && cluster_ok=0

VARIANTS=${V3_VARIANTS:-rows,expert,cluster,pingpong,quad,cutlass}
NCU_VARIANTS=${V3_NCU_VARIANTS:-rows,cluster,pingpong,quad,cutlass}
if [ $cluster_ok = 0 ]; then
  note "a test step timed out: the cluster variant is left out of the bench and ncu"
  VARIANTS=rows,expert
  NCU_VARIANTS=rows,expert
fi
have_ncu=0
[ -n "$NCU" ] && [ -x "$NCU" ] && have_ncu=1
left=$((BUDGET - SECONDS - 15 - 75 * have_ncu)) # keep 75 s for ncu
[ $left -gt 130 ] && left=130
step bench "$left" "$B/mok_bench" --out "$OUTDIR/mok.json" --T 2048,8192 --routing balanced \
  --reps 5 --warmup 2 --deadline $((left - 25 > 10 ? left - 25 : 10)) --variants "$VARIANTS"

if [ $have_ncu = 1 ]; then
  echo "$NCU_VARIANTS" >"$OUTDIR/ncu_variants.txt"
  rm -f "$OUTDIR/v3.ncu-rep"
  step ncu 75 "$NCU" --profile-from-start off --clock-control none --kernel-name 'regex:s9_gemm|device_kernel' \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section ComputeWorkloadAnalysis \
    --metrics dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct,gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second \
    --export "$OUTDIR/v3" "$B/test_gemm_sm90" profile "$SHAPE" "$PT" "$NCU_VARIANTS"
  [ -f "$OUTDIR/v3.ncu-rep" ] &&
    "$NCU" --import "$OUTDIR/v3.ncu-rep" --csv --page raw >"$OUTDIR/ncu.csv" 2>"$OUTDIR/ncu_import.log"
else
  note "ncu: not found (NCU=...): no profile"
  printf 'ncu\tskip\t0\tncu not found\n' >>"$STEPS"
fi

note "summary"
"$PYTHON" tests/gpu/v3_summary.py "$OUTDIR" --shape "$SHAPE" --T "$PT" || status=1
note "logs and JSON in $OUTDIR (${SECONDS} s)"
exit $status
