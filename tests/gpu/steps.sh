# SPDX-License-Identifier: Apache-2.0
# What the GPU step scripts share (sourced, not run): a step summary, mokd on
# the cuda engine at $SOCK, and the MPS control daemon. The script sets, before
# sourcing: B (the build folder), SOCK (mokd's socket), STEP_LOGS (where mokd's
# and MPS's logs go).
#   note TEXT            a heading line
#   record STEP RESULT   a summary line; a RESULT whose first word is not PASS
#                        fails the script
#   build_missing FILE.. `make all` into $B when one of the files is missing
#   start_mokd [PREFIX...]   mokd --engine cuda, run under PREFIX when given (env
#                        VAR=..., compute-sanitizer ...); settings: MOKD_LOG (its
#                        log; default $STEP_LOGS/mokd.log), MOKD_LOG_LEVEL (info),
#                        MOKD_ARGS (more options), MOKD_START_TRIES (tenths of a
#                        second to wait for the socket; 300)
#   mokd_self            the mokd process (under a PREFIX, the prefix's child)
#   stop_mokd            SIGTERM to mokd; returns its exit status
#   start_mps / stop_mps     nvidia-cuda-mps-control with the pipe folder every
#                        process of the script shares (MPS_PIPE_DIR, MPS_LOG_DIR;
#                        default /tmp/mok-mps-pipe, /tmp/mok-mps-log)
summary=()
status=0
MOKD_PID=
MPS_ON=0

note() { printf '== %s\n' "$*"; }
record() { summary+=("$1: $2"); [ "${2%% *}" = PASS ] || status=1; }

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
  local log=${MOKD_LOG:-$STEP_LOGS/mokd.log}
  rm -f "$SOCK"
  # shellcheck disable=SC2086 # MOKD_ARGS: extra options, word-split on purpose
  "$@" "$B/bin/mokd" --engine cuda --socket "$SOCK" --log-level "${MOKD_LOG_LEVEL:-info}" \
    ${MOKD_ARGS:-} >>"$log" 2>&1 &
  MOKD_PID=$!
  for _ in $(seq 1 "${MOKD_START_TRIES:-300}"); do
    [ -S "$SOCK" ] && return 0
    kill -0 "$MOKD_PID" 2>/dev/null || { echo "mokd exited at start:"; tail -5 "$log"; return 1; }
    sleep 0.1
  done
  echo "mokd did not come up"; return 1
}

mokd_self() {
  local p
  for p in $(pgrep -x mokd 2>/dev/null); do # the mokd on our socket (ours), by id
    tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | grep -q -- "--socket $SOCK" && { echo "$p"; return; }
  done
  echo "$MOKD_PID"
}

stop_mokd() {
  [ -n "$MOKD_PID" ] || return 0
  kill -TERM "$(mokd_self)" 2>/dev/null
  local rc=0
  wait "$MOKD_PID" || rc=$?
  MOKD_PID=
  return $rc
}

start_mps() {
  export CUDA_MPS_PIPE_DIRECTORY=${MPS_PIPE_DIR:-/tmp/mok-mps-pipe}
  export CUDA_MPS_LOG_DIRECTORY=${MPS_LOG_DIR:-/tmp/mok-mps-log}
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d >>"$STEP_LOGS/mps.log" 2>&1; then MPS_ON=1; sleep 1; return 0; fi
  echo "MPS would not start:"; cat "$STEP_LOGS/mps.log"; return 1
}

stop_mps() {
  # then a second for the control daemon to go (a next start_mps finds it gone)
  [ $MPS_ON = 1 ] && echo quit | nvidia-cuda-mps-control >>"$STEP_LOGS/mps.log" 2>&1 && sleep 1
  MPS_ON=0
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
