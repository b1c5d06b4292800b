#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Where the fp8 layer's products spend their time: ncu on one forward and backward of
# mok's fp8 layer (mok_bench, one shape, one T), and, when a CUTLASS example 68 binary is
# given, on CUTLASS's own blockwise-scaled FP8 grouped GEMM at the same four product shapes
# (the recipe's scales: 1x128 on A, 128x128 on B; cooperative 128x128x128 in 1x2
# clusters). Prints one table (tests/bench/ncu_table.py): per kernel its time, SM clock,
# TFLOP/s where the FLOPs are known, tensor pipe, issue slots and the stall ncu names first.
#
#   tests/bench/ncu_fp8_gemms.sh OUTDIR [SHAPE [T]]      (default kimi-k2.7 8192)
#
# Environment: MOK_BENCH (the mok_bench binary; default .benchbuild/mok_bench, built by
# tests/bench/run_bench.sh), EX68 (CUTLASS's examples/68_hopper_fp8_warp_specialized_
# grouped_gemm_with_blockwise_scaling built for sm_90a; its host check skipped through
# EX68_SKIP_VERIFY=1 at these sizes, after one checked small run), NCU (default ncu),
# PYTHON. Clocks stay as the GPU sets them (--clock-control none): the SM clock column says
# what each kernel ran at. OUTDIR gets ncu's CSV pages (ncu_mok_fp8.csv, ncu_ex68_<product>.csv),
# the logs and table.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUTDIR=${1:?usage: ncu_fp8_gemms.sh OUTDIR [SHAPE [T]]}
SHAPE=${2:-kimi-k2.7}
T=${3:-8192}
BIN=${MOK_BENCH:-.benchbuild/mok_bench}
NCU=${NCU:-ncu}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUTDIR"
[ -x "$BIN" ] || { echo "ncu_fp8_gemms.sh: no $BIN (tests/bench/run_bench.sh builds it)"; exit 2; }
SECTIONS=(--section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats
  --metrics sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__cycles_elapsed.avg.per_second)
status=0

# the model's expert shape at this T: experts a GPU, rows an expert (balanced), H, I
read -r E_GPU ROWS H I < <("$PYTHON" - "$SHAPE" "$T" <<'EOF'
import re, sys
name, T = sys.argv[1], int(sys.argv[2])
src = open("tests/harness/model_shapes.h").read()
ep = int(re.search(r"#define MOK_MODEL_EP (\d+)", src).group(1))
for m in re.finditer(r'X\("([^"]+)", (\d+), (\d+), (\d+), (\d+)\)', src):
    if m.group(1) == name:
        E, H, I, K = map(int, m.groups()[1:])
        e = E // ep
        print(e, (T * K // e) // 16 * 16, H, I)  # FP8 rows: a multiple of 16 a group
        break
else:
    sys.exit("unknown shape " + name)
EOF
) || exit 2
echo "== $SHAPE T=$T: $E_GPU experts a GPU, $ROWS rows an expert, H=$H, I=$I"

echo "== ncu: mok_bench fp8, one forward and backward"
"$NCU" --clock-control none --csv --page details "${SECTIONS[@]}" \
  "$BIN" --only "$SHAPE" --T "$T" --routing balanced --reps 1 --warmup 0 --variants fp8 \
  >"$OUTDIR/ncu_mok_fp8.csv" 2>"$OUTDIR/ncu_mok_fp8.log" || { echo "  FAILED (see ncu_mok_fp8.log)"; status=1; }
grep -E "fwd parts|bwd parts" "$OUTDIR/ncu_mok_fp8.csv" | sed 's/^/  (under ncu) /' 

if [ -n "${EX68:-}" ]; then
  echo "== CUTLASS example 68: a checked small run"
  "$EX68" --groups=4 --m=256 --n=512 --k=1024 --iterations=1 2>&1 | grep -E "Disposition|runtime" |
    tee "$OUTDIR/ex68_check.txt"
  grep -q "Passed" "$OUTDIR/ex68_check.txt" || { echo "  example 68 failed its own check"; status=1; }
  # the four products of the layer: M rows an expert, N, K; forward gate/up, forward
  # down, down dgrad (d_h = d_y W_d^T), gate/up dgrad (d_x = [dg du] [W_g; W_u])
  PRODUCTS=("gate_up $ROWS $((2 * I)) $H" "down $ROWS $H $I" "down_dgrad $ROWS $I $H"
    "gate_up_dgrad $ROWS $H $((2 * I))")
  echo "== CUTLASS example 68: timed (20 iterations each)"
  : >"$OUTDIR/ex68_timed.txt"
  for p in "${PRODUCTS[@]}"; do
    read -r name m n k <<<"$p"
    r=$(EX68_SKIP_VERIFY=1 "$EX68" --groups="$E_GPU" --m="$m" --n="$n" --k="$k" --iterations=20 2>&1 |
      sed -n 's/.*Avg runtime: \([0-9.]*\) ms.*/\1/p' | tail -1)
    echo "$name groups=$E_GPU m=$m n=$n k=$k ms=$r" | tee -a "$OUTDIR/ex68_timed.txt"
  done
  echo "== ncu: CUTLASS example 68, one launch a product"
  for p in "${PRODUCTS[@]}"; do
    read -r name m n k <<<"$p"
    EX68_SKIP_VERIFY=1 "$NCU" --clock-control none --csv --page details "${SECTIONS[@]}" \
      --kernel-name regex:device_kernel --launch-count 1 \
      "$EX68" --groups="$E_GPU" --m="$m" --n="$n" --k="$k" --iterations=1 \
      >"$OUTDIR/ncu_ex68_$name.csv" 2>>"$OUTDIR/ncu_mok_fp8.log" || status=1
  done
fi

"$PYTHON" tests/bench/ncu_table.py --rows "$((E_GPU * ROWS))" --H "$H" --I "$I" \
  "$OUTDIR"/ncu_*.csv | tee "$OUTDIR/table.txt"
exit $status
