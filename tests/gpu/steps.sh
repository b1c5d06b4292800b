# SPDX-License-Identifier: Apache-2.0
# What the GPU step scripts share (sourced, not run): a step summary, mokd on
# the cuda engine at $SOCK, and the MPS control daemon. The script sets, before
# sourcing: B (the build folder), SOCK (mokd's socket), STEP_LOGS (where mokd's
# and MPS's logs go).
#   note TEXT            a heading line
#   record STEP RESULT   a summary line; anything but PASS fails the script
#   build_missing FILE.. `make all` into $B when one of the files is missing
#   start_mokd / stop_mokd   mokd --engine cuda (stop: its exit status)
#   start_mps / stop_mps     nvidia-cuda-mps-control with the pipe folder every
#                            process of the script shares
summary=()
status=0
MOKD_PID=
MPS_ON=0

note() { printf '== %s\n' "$*"; }
record() { summary+=("$1: $2"); [ "$2" = PASS ] || status=1; }

build_missing() {
  local f
  for f in "$@"; do
    [ -e "$f" ] && continue
    note "building into $B"
    make -j"$(nproc)" BUILD="$B" all >"$STEP_LOGS/build.log" 2>&1 ||
      { tail -30 "$STEP_LOGS/build.log"; exit 1; }
    return
  done
}

start_mokd() {
  rm -f "$SOCK"
  "$B/bin/mokd" --engine cuda --socket "$SOCK" --log-level info >>"$STEP_LOGS/mokd.log" 2>&1 &
  MOKD_PID=$!
  for _ in $(seq 1 300); do
    [ -S "$SOCK" ] && return 0
    kill -0 "$MOKD_PID" 2>/dev/null || { echo "mokd exited at start:"; tail -5 "$STEP_LOGS/mokd.log"; return 1; }
    sleep 0.1
  done
  echo "mokd did not come up"; return 1
}

stop_mokd() {
  [ -n "$MOKD_PID" ] || return 0
  kill -TERM "$MOKD_PID" 2>/dev/null
  local rc=0
  wait "$MOKD_PID" || rc=$?
  MOKD_PID=
  return $rc
}

start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mok-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mok-mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$STEP_LOGS/mps.log" 2>&1; then MPS_ON=1; sleep 1; return 0; fi
  echo "MPS would not start:"; cat "$STEP_LOGS/mps.log"; return 1
}

stop_mps() {
  [ $MPS_ON = 1 ] && echo quit | nvidia-cuda-mps-control >>"$STEP_LOGS/mps.log" 2>&1
  MPS_ON=0
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
