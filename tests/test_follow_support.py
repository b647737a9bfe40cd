"""Shared by the follow and logs tests (no tests here): a fake trainer, a launcher that
writes the runs/<id>/ layout the way the run's supervisor does, and small helpers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

# A stand-in trainer. argv: LINES DELAY MODE [GATE]
# GATE, a folder: step line i waits while GATE/hold-i exists (a test then decides when
# the run goes on, instead of racing it with the clock).
#   finish        LINES step lines, then "training complete", exit 0
#   thread-crash  LINES step lines, then a worker thread raises; exit 1
#   split         like finish, but every line is written in two halves DELAY apart
#   hang          LINES step lines, then sleeps until killed
#   crash-hang    like thread-crash, but the main thread then sleeps until killed
FAKE_TRAINER = r"""
import os, sys, threading, time
lines, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
gate = sys.argv[4] if len(sys.argv) > 4 else None
for i in range(1, lines + 1):
    while gate and os.path.exists(os.path.join(gate, f"hold-{i}")):
        time.sleep(0.01)
    text = f"step {i}/{lines} | loss {2.5 - i / lines:.4f} | acc 0.50 | 1830 tok/s"
    if mode == "split":
        half = len(text) // 2
        sys.stdout.write(text[:half]); sys.stdout.flush(); time.sleep(delay)
        sys.stdout.write(text[half:] + "\n"); sys.stdout.flush()
    else:
        print(text, flush=True)
        time.sleep(delay)
if mode in ("thread-crash", "crash-hang"):
    def warm():
        print("drafter-2 on cpu: warming compiled graphs", flush=True)
        raise AssertionError("tree manager container missing from this thread")
    worker = threading.Thread(target=warm, name="drafter-2")
    worker.start()
    worker.join()
    if mode == "crash-hang":
        time.sleep(3600)
    sys.exit(1)
if mode == "hang":
    time.sleep(3600)
print("training complete", flush=True)
"""

# Start argv fully detached in RUNDIR: pid (= session id), train.log, then exit_code
# (128+N after signal N, as a shell reports it), written atomically; the wrapper carries
# DFLASH_RUN_ID like a real launch, and workdir/active_run names the run.
LAUNCH = r"""
rundir=$1; shift
mkdir -p "$rundir"
cd "$rundir" || exit 1
basename "$rundir" > ../../active_run
DFLASH_RUN_ID=$(basename "$rundir") setsid sh -c 'echo $$ > pid; "$@" > train.log 2>&1; code=$?; echo $code > exit_code.tmp; mv exit_code.tmp exit_code' sh "$@" </dev/null >/dev/null 2>&1 &
"""


def trainer_argv(
    python: str, lines: int, delay: float, mode: str = "finish", gate: str | None = None
) -> list[str]:
    return [
        python,
        "-u",
        "-c",
        FAKE_TRAINER,
        str(lines),
        str(delay),
        mode,
        *([gate] if gate else []),
    ]


def launch_argv(rundir: str, argv: list[str]) -> list[str]:
    return ["sh", "-c", LAUNCH, "sh", rundir, *argv]


def expected_lines(lines: int, mode: str = "finish") -> list[str]:
    steps = [
        f"step {i}/{lines} | loss {2.5 - i / lines:.4f} | acc 0.50 | 1830 tok/s"
        for i in range(1, lines + 1)
    ]
    return steps + (["training complete"] if mode in ("finish", "split") else [])


def wait_for(predicate, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def kill_run(rundir: Path) -> None:
    """Kill a local fake run's whole session (tests must not leave processes behind)."""
    try:
        pid = int((rundir / "pid").read_text().split()[0])
        os.killpg(pid, signal.SIGKILL)
    except (FileNotFoundError, ValueError, ProcessLookupError, IndexError):
        pass


def file_lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def local_target():
    """Where the trainer runs for `host.address: local` with no container."""
    from dflashctl.remote.deploy_target import Target
    from dflashctl.remote.transport.local import LocalTransport

    return Target(LocalTransport(), None)
