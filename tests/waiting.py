"""Waiting in tests without asserting on the clock: a call that must return (rather
than wait for something that takes an hour) runs in a thread, given far more time than
any busy machine needs; only never returning fails."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# A safety net, never a goal: what the call would otherwise wait for is much longer.
PATIENCE_S = 300.0


def returns(call: Callable[[], T], patience: float = PATIENCE_S, what: str = "the call") -> T:
    """call()'s value (or its exception), once it returned."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(patience)
    if thread.is_alive():
        raise AssertionError(f"{what} never returned: it waits for what it should not")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
