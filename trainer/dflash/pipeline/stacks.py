"""Every thread's Python stack, on request and from a watchdog of the trainer's own.

A run that stops making progress says nothing by itself. This module, one per process
(every rank under torchrun), writes the stacks of all its threads, with their names:

- on request: `dflashctl stacks` writes a new id into ``<run>/stacks/request``; a
  thread of ours polls it and answers with ``<run>/stacks/rank<R>.<id>.json``. A polling
  thread (not a Python signal handler) answers even when the main thread is blocked in C
  code (a collective, a join): signal handlers run only in the main thread.
- from a watchdog: no finished step for the hang threshold (the one `dflashctl status`
  uses: DFLASH_HANG_FACTOR times the recent step interval, at least DFLASH_HANG_MIN_S)
  writes ``<run>/stacks/rank<R>.watchdog.json`` once, and a line in the log.
- on SIGUSR1: faulthandler appends every thread's stack to
  ``<run>/stacks/rank<R>.faulthandler.txt`` from C, even while a thread holds the GIL
  (thread ids there, not names).

``<run>`` is $DFLASH_RUN_DIR when dflashctl launched the trainer, else the output dir.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from dflash.pipeline.logging import RunLog

POLL_S = 0.2
DEFAULT_FACTOR = 4.0
DEFAULT_MIN_S = 60.0
RECENT_STEPS = 16
THREAD_NAME = "stack-watch"
# Before the first step (loading, compiling, the rendezvous) the watchdog waits this many
# times the floor, and at least STARTUP_MIN_S (DFLASH_HANG_STARTUP_S replaces both): a
# start-up that deadlocks is named too, a slow compile is not.
STARTUP_FACTOR = 10.0
STARTUP_MIN_S = 90.0
# The threads whose stack the watchdog's line names: the ones that make the steps.
STEP_THREADS = ("drafter-",)

_installed: StackWatch | None = None


def stacks_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "stacks"


def thread_stacks(skip: set[int] | None = None) -> list[dict]:
    """Every live thread's stack, outermost frame first, with its name."""
    names = {t.ident: t for t in threading.enumerate()}
    threads = []
    for ident, frame in sys._current_frames().items():
        if skip and ident in skip:
            continue
        thread = names.get(ident)
        frames = [
            {"file": f.filename, "line": f.lineno, "function": f.name, "code": f.line or ""}
            for f in traceback.extract_stack(frame)
        ]
        threads.append(
            {
                "name": thread.name if thread is not None else f"thread {ident}",
                "ident": ident,
                "daemon": bool(thread.daemon) if thread is not None else None,
                "frames": frames,
            }
        )
    threads.sort(key=lambda t: (t["name"] != "MainThread", t["name"]))
    return threads


def _where_waiting(threads: list[dict]) -> str:
    """`drafter-0 at entry.py:14 in push`: where each step-making thread stands."""
    parts = []
    for thread in threads:
        if thread["name"].startswith(STEP_THREADS) and thread["frames"]:
            frame = thread["frames"][-1]
            parts.append(
                f"{thread['name']} at {Path(frame['file']).name}:{frame['line']} in {frame['function']}"
            )
    return ", ".join(parts)


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


class StackWatch:
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        log: RunLog,
        *,
        factor: float | None = None,
        min_s: float | None = None,
        startup_s: float | None = None,
        clock=time.monotonic,
    ) -> None:
        self.folder = stacks_dir(run_dir)
        self.rank = rank
        self.log = log
        self.factor = (
            factor if factor is not None else _env_float("DFLASH_HANG_FACTOR", DEFAULT_FACTOR)
        )
        self.min_s = min_s if min_s is not None else _env_float("DFLASH_HANG_MIN_S", DEFAULT_MIN_S)
        self.startup_s = (
            startup_s
            if startup_s is not None
            else _env_float(
                "DFLASH_HANG_STARTUP_S", max(STARTUP_FACTOR * self.min_s, STARTUP_MIN_S)
            )
        )
        self.clock = clock
        self._steps: deque[float] = deque(maxlen=RECENT_STEPS + 1)
        self._last_step: tuple[int, int] | None = None
        self._dumped_silence = False  # the watchdog dumps once per silence
        self._started_at: float | None = None  # start(): the start-up's clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen_request: str | None = None
        self._fault_file = None

    # -- set-up ---------------------------------------------------------------------

    def start(self) -> None:
        self._started_at = self.clock()
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write(
            f"rank{self.rank}.pid",
            json.dumps({"rank": self.rank, "pid": os.getpid(), "host": socket.gethostname()}),
        )
        self._seen_request = self._request_id()  # an older request is not ours to answer
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGUSR1"):
            self._fault_file = open(self.folder / f"rank{self.rank}.faulthandler.txt", "a")
            faulthandler.register(signal.SIGUSR1, file=self._fault_file, all_threads=True)
        self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # Joined: a clean finish exits through the interpreter's own teardown only
        # when no other thread is left (train_dflash_pipeline.main).
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * POLL_S)
        if self._fault_file is not None:
            try:
                faulthandler.unregister(signal.SIGUSR1)
            except (ValueError, RuntimeError):
                pass
            self._fault_file.close()
            self._fault_file = None

    # -- progress -------------------------------------------------------------------

    def step_done(self, step: int, total: int) -> None:
        self._steps.append(self.clock())
        self._last_step = (step, total)
        self._dumped_silence = False

    def threshold_s(self) -> float | None:
        """None before the first finished step: compilation and warm-up never count."""
        if not self._steps:
            return None
        gaps = [b - a for a, b in zip(self._steps, list(self._steps)[1:], strict=False)]
        if not gaps:
            return 2 * self.min_s
        return max(self.min_s, self.factor * statistics.median(gaps))

    def silent_for(self) -> float | None:
        return None if not self._steps else self.clock() - self._steps[-1]

    def check_watchdog(self) -> Path | None:
        """Dump once when the steps stopped for the threshold (or the first step has not
        come STARTUP_FACTOR times the floor after the start); the path, when it did."""
        if self._dumped_silence:
            return None
        threshold, silent = self.threshold_s(), self.silent_for()
        if threshold is None and self._started_at is not None:
            threshold, silent = self.startup_s, self.clock() - self._started_at
            when = f"after the start (threshold {threshold:.0f} s), before the first step"
        elif threshold is None:
            return None  # not started (a test's watch): nothing to judge before a step
        else:
            when = (
                f"(threshold {threshold:.0f} s) after step "
                f"{self._last_step[0] if self._last_step else '?'}"
            )
        if threshold is None or silent is None or silent <= threshold:
            return None
        if self._last_step is not None and self._last_step[0] >= self._last_step[1]:
            return None  # past the last step: evaluation and the final checkpoint
        self._dumped_silence = True
        path = self.dump("watchdog", "watchdog")
        waiting = _where_waiting(json.loads(path.read_text())["threads"])
        self.log.line(
            f"watchdog: no step finished for {silent:.0f} s {when}; "
            f"{f'waiting: {waiting}; ' if waiting else ''}every thread's stack written to {path}"
        )
        return path

    # -- dumps ----------------------------------------------------------------------

    def dump(self, reason: str, name: str) -> Path:
        skip = {self._thread.ident} if self._thread is not None else set()
        record = {
            "rank": self.rank,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "time": round(time.time(), 3),
            "reason": reason,
            "last_step": self._last_step[0] if self._last_step else None,
            "total_steps": self._last_step[1] if self._last_step else None,
            "silent_s": None if self.silent_for() is None else round(self.silent_for(), 1),
            "threads": thread_stacks(skip),
        }
        return self._write(f"rank{self.rank}.{name}.json", json.dumps(record, indent=1))

    def _write(self, name: str, text: str) -> Path:
        path = self.folder / name
        partial = path.with_name(path.name + f".{os.getpid()}.partial")
        partial.write_text(text)
        os.replace(partial, path)
        return path

    def _request_id(self) -> str | None:
        try:
            text = (self.folder / "request").read_text().strip()
        except OSError:
            return None
        return text or None

    def _loop(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                wanted = self._request_id()
                if wanted and wanted != self._seen_request and wanted.isalnum():
                    self._seen_request = wanted
                    self.dump("request", wanted)
                self.check_watchdog()
            except OSError as exc:  # a full disk or a removed folder: keep training
                self.log.line(f"stack-watch: could not write stacks: {exc}")
                self._stop.wait(10)


def install(run_dir: Path, rank: int, log: RunLog) -> StackWatch | None:
    """Start this process's watcher (once); None where its folder cannot be made."""
    global _installed
    if _installed is not None:
        return _installed
    if os.environ.get("DFLASH_STACK_WATCH") == "0":  # bench/bench_trainer.py: its cost
        return None
    watch = StackWatch(run_dir, rank, log)
    try:
        watch.start()
    except OSError as exc:
        log.line(f"stack-watch: not started ({exc}); `dflashctl stacks` cannot ask this run")
        return None
    _installed = watch
    return watch


def step_done(step: int, total: int) -> None:
    """A step finished in this process (its lead drafter): the watchdog's clock."""
    if _installed is not None:
        _installed.step_done(step, total)


def uninstall() -> None:
    global _installed
    if _installed is not None:
        _installed.stop()
        _installed = None
