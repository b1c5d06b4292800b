#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Runs each libFuzzer target for a fixed time from its seed corpora and
# prints, per target, executions, corpus size and whether it crashed.
#   tests/fuzz/run.sh BUILD SECONDS TARGET...
# Corpora: BUILD/fuzz/corpus/T (grows, kept between runs), BUILD/fuzz/seeds/T
# (generated golden messages), tests/fuzz/corpus/T (committed: regressions).
# A crash leaves its input in BUILD/fuzz/crash-T-* and fails the run.
set -u
cd "$(dirname "$0")/../.."
build=$1 seconds=$2
shift 2
status=0
for t in "$@"; do
  bin=$build/fuzz/fuzz_$t
  work=$build/fuzz/corpus/$t
  mkdir -p "$work"
  dirs=("$work" "$build/fuzz/seeds/$t")
  [ -d "tests/fuzz/corpus/$t" ] && dirs+=("tests/fuzz/corpus/$t")
  log=$build/fuzz/$t.log
  # -rss_limit_mb: protobuf-c allocations are bounded by the frame limit
  "$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
    -artifact_prefix="$build/fuzz/crash-$t-" "${dirs[@]}" >"$log" 2>&1
  rc=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
  files=$(find "$work" -type f | wc -l)
  if [ $rc -eq 0 ]; then
    echo "fuzz_$t: ${execs:-?} executions in ${seconds}s, corpus $files files, no crash"
  else
    echo "fuzz_$t: FAILED (status $rc) after ${execs:-?} executions; see $log"
    grep -E "ERROR|runtime error|SUMMARY|Test unit written" "$log" | head -5
    status=1
  fi
done
exit $status
