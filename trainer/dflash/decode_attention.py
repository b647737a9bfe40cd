"""Decoding runs with PyTorch's cuDNN attention kernel switched off.

Decoding calls attention at a new key length every step (speculative verification also
at new block shapes), and the cuDNN SDPA backend builds an execution plan the first time
it meets a shape. On one H100 (torch 2.11, bench/probe_decode_step.py --fresh-only) a
batch-32 decode of the docs zoo target paid +47.8 ms a step the first time its lengths
were seen with cuDNN on and +0.15 ms with it off, and took the same time warm either way
(0.76 against 0.74 s). An eval's lengths are almost all new, so building plans was most of
a 26.5 s eval; with it off, the zoo's 32 x 256 eval timed cold went from 35.4 to 9.4 s
(docs) and 35.5 to 6.7 s (code) (`probe_decode_step.py --eval`). Training repeats its
shapes, so training keeps whatever the process chose.

PyTorch holds the switch for the whole process, not per thread: a count of the decodes in
flight turns it off at the first and back to what it was at the last, so decodes that
overlap on several threads never leave it off (or on) by mistake.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

_lock = threading.Lock()
_in_flight = 0
_was_enabled = True


def _switch() -> tuple[Callable[[], bool], Callable[[bool], None]] | None:
    cuda = torch.backends.cuda
    if not hasattr(cuda, "enable_cudnn_sdp") or not hasattr(cuda, "cudnn_sdp_enabled"):
        return None  # a torch without the backend: nothing to switch
    return cuda.cudnn_sdp_enabled, cuda.enable_cudnn_sdp


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    """cuDNN attention off inside; as it was once the last overlapping decode leaves."""
    global _in_flight, _was_enabled
    switch = _switch()
    if switch is None:
        yield
        return
    enabled, enable = switch
    with _lock:
        if _in_flight == 0:
            _was_enabled = enabled()
            enable(False)
        _in_flight += 1
    try:
        yield
    finally:
        with _lock:
            _in_flight -= 1
            if _in_flight == 0:
                enable(_was_enabled)


def decoding(fn: F) -> F:
    """Run `fn` (a decode loop) without cuDNN attention."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with without_cudnn_attention():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
