"""Serial compile warm-up: one process-wide capture lock and a gate for everything else.

CUDA graph capture is process-wide state: a ``synchronize``, an ``empty_cache`` or GPU
random numbers in another thread while one thread captures destroys the capture. So
drafters compile and warm up one at a time under ``capture_lock``, and the
prefetcher, the target loops and every drafter's steady state wait at the gate until
all drafters are warm.
"""

from __future__ import annotations

import threading
from collections import Counter

from dflash.pipeline import tls
from dflash.pipeline.config_errors import TrainConfigError
from dflash.pipeline.supervisor import POLL_S, Supervisor

CUDAGRAPH_MODES = ("reduce-overhead",)


class WarmupGate:
    def __init__(self, num_drafters: int, supervisor: Supervisor) -> None:
        self.capture_lock = threading.Lock()
        self._num_drafters = num_drafters
        self._warm = 0
        self._count_lock = threading.Lock()
        self._all_warm = threading.Event()
        self._supervisor = supervisor
        if num_drafters == 0:
            self._all_warm.set()

    @property
    def all_warm(self) -> bool:
        return self._all_warm.is_set()

    def acquire_capture(self) -> None:
        """Take the capture lock, giving up if the run stops meanwhile."""
        while not self.capture_lock.acquire(timeout=POLL_S):
            self._supervisor.check()

    def release_capture(self) -> None:
        self.capture_lock.release()

    def mark_warm(self) -> None:
        with self._count_lock:
            self._warm += 1
            if self._warm >= self._num_drafters:
                self._all_warm.set()

    def wait_all_warm(self) -> None:
        """The barrier: block until every drafter is warm (or the run stops)."""
        while not self._all_warm.wait(timeout=POLL_S):
            self._supervisor.check()
        self._supervisor.check()


def warm_target(gate: WarmupGate, say, warm) -> None:
    """A target loop's compile: no capture, but Dynamo is not thread-safe and its first
    runs may synchronize, so it runs under the capture lock like a drafter's warm-up."""
    import time

    gate.acquire_capture()
    try:
        say("compiling the target forward")
        started = time.perf_counter()
        warm()
        say(f"target ready (compile {time.perf_counter() - started:.1f} s)")
    finally:
        gate.release_capture()


def check_device_layout(drafter_devices: list[str], compile_mode: str) -> None:
    """Refuse two drafters on one GPU under CUDA Graph Trees where torch shares one graph
    between threads (<= 2.12): they would share one tree manager and corrupt each
    other's captures ("beginAllocateToPool: already recording")."""
    if compile_mode not in CUDAGRAPH_MODES or not tls.torch_shares_graphs_across_threads():
        return
    repeated = [
        dev for dev, n in Counter(drafter_devices).items() if n > 1 and dev.startswith("cuda")
    ]
    if repeated:
        import torch

        raise TrainConfigError(
            f"runtime.drafter_devices: {repeated[0]} holds more than one drafter with "
            f"compile: reduce-overhead; on torch {torch.__version__} (<= 2.12) drafters with the "
            "same shapes on one GPU share one CUDA Graph Trees manager and corrupt each other's "
            "graphs. Use one drafter per GPU, or compile: legacy-cudagraphs / default"
        )
