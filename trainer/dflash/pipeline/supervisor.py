"""Named threads, one stop signal, failure propagation and bounded stop-aware queues.

Every blocking wait in the pipeline (queue put/get, barriers, the warm-up gate) wakes
up at least every ``POLL_S`` to look at the stop signal, so one failing thread ends
the whole run promptly instead of leaving the others blocked forever.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from dflash.pipeline.logging import RunLog

POLL_S = 0.05


class Stopped(Exception):
    """Raised inside a thread when the run is stopping; ends the thread quietly."""


class Supervisor:
    def __init__(self, log: RunLog) -> None:
        self.log = log
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.failures: list[tuple[str, BaseException]] = []
        self.threads: list[threading.Thread] = []
        self.devices: dict[str, str] = {}  # thread name -> the device it works on
        self._on_stop: list[Callable[[], None]] = []
        self._on_failure: list[Callable[[str, BaseException], None]] = []

    # -- stopping

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the stop is broadcast (abort barriers, close queues)."""
        self._on_stop.append(callback)

    def on_failure(self, callback: Callable[[str, BaseException], None]) -> None:
        """Run ``callback(thread, exc)`` on the first failure (torchrun: tell the other ranks)."""
        self._on_failure.append(callback)

    def request_stop(self) -> None:
        with self._lock:
            if self.stop.is_set():
                return
            self.stop.set()
            callbacks = list(self._on_stop)
        for callback in callbacks:
            try:
                callback()
            except Exception as exc:  # a broken callback must not block the others
                self.log.line(f"stop callback failed: {exc!r}")

    def check(self) -> None:
        if self.stop.is_set():
            raise Stopped()

    @property
    def failed(self) -> bool:
        return bool(self.failures)

    def record_failure(self, name: str, exc: BaseException) -> None:
        with self._lock:
            first = not self.failures
            self.failures.append((name, exc))
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.log.block(
            f"{name} failed:\n{text}"
            if first
            else f"{name} failed (after an earlier failure):\n{text}"
        )
        if first:
            for callback in self._on_failure:
                try:
                    callback(name, exc)
                except Exception as err:  # noqa: BLE001 - the stop below must still happen
                    self.log.line(f"failure callback failed: {err!r}")
        self.request_stop()

    # -- threads

    def spawn(
        self, name: str, body: Callable[[], Any], device: str | None = None
    ) -> threading.Thread:
        def run() -> None:
            try:
                body()
            except Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - every failure must end the run
                self.record_failure(name, exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        self.threads.append(thread)
        if device is not None:
            self.devices[name] = device
        thread.start()
        return thread

    def join_all(self, timeout: float) -> list[str]:
        """Join every thread within ``timeout`` seconds in total; names of those still alive."""
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        return [t.name for t in self.threads if t.is_alive()]


class StopQueue:
    """A bounded FIFO whose put/get give up when the run stops (back-pressure, no hang)."""

    def __init__(self, maxsize: int, supervisor: Supervisor) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.maxsize = maxsize
        self._supervisor = supervisor
        supervisor.on_stop(self.drain)

    def put(self, item: Any) -> None:
        while True:
            self._supervisor.check()
            try:
                self._queue.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue

    def get(self) -> Any:
        while True:
            self._supervisor.check()
            try:
                return self._queue.get(timeout=POLL_S)
            except queue.Empty:
                continue

    def qsize(self) -> int:
        return self._queue.qsize()

    def drain(self) -> None:
        """Drop what is buffered so device memory held by queued tensors is released."""
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
