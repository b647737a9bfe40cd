#!/bin/sh
# Wrapper of one training run, started by dflashctl in a new session (its pid is the
# run's process group and session id), stdin from /dev/null, output to train.log:
#
#     sh launch.sh <run-dir> <python> <entry> [args...]
#
# The trainer runs as a child, not exec'd, so that this shell outlives it and writes
# its exit status to <run-dir>/exit_code (128+N when signal N killed it), via a
# temporary name and rename so a reader never sees a partial number.
#
# `dflashctl stop` sends SIGTERM to the whole process group: the trainer gets it
# directly and has its grace period to checkpoint. This shell traps the signal with a
# no-op (not an ignore, which the trainer would inherit), so it keeps waiting for
# the trainer instead of dying first.
run_dir=$1
shift
trap ':' TERM INT HUP
"$@" </dev/null
status=$?
printf '%s\n' "$status" >"$run_dir/exit_code.tmp" && mv -f "$run_dir/exit_code.tmp" "$run_dir/exit_code"
# run.on_exit: after exit_code, so the run already reads as ended; its output follows
# the trainer's in train.log, and its own failure never changes the run's status.
if [ -n "${DFLASH_ON_EXIT:-}" ]; then
  DFLASH_EXIT_CODE=$status sh -c "$DFLASH_ON_EXIT" </dev/null ||
    echo "dflashctl: run.on_exit failed with exit status $?"
fi
exit "$status"
