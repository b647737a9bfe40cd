"""Per-thread state for CUDA Graph Trees in threads we start ourselves.

torch/_inductor/cudagraph_trees.py (2.5 to 2.12) keeps its tree managers in a
module-level ``threading.local`` and, at import, stashes the same objects in
PyTorch's C++ thread-local state so autograd's backward threads can find them.
A ``threading.Thread`` has neither, and its first cudagraph run fails with a bare
``AssertionError`` from ``get_obj`` (PyTorch issue 123177, fixed in 2.13 by PR
184357). ``install_thread_state`` gives the calling thread fresh containers and
stashes them again, so backward threads launched from it inherit them.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

CONTAINERS_KEY = "tree_manager_containers"
LOCKS_KEY = "tree_manager_locks"


def _cudagraph_trees() -> Any:
    import torch._inductor.cudagraph_trees as cudagraph_trees

    return cudagraph_trees


def torch_fixes_thread_state() -> bool:
    """True when this torch initialises missing thread state itself (2.13+)."""
    return hasattr(_cudagraph_trees(), "_initialize_tls")


def torch_shares_graphs_across_threads() -> bool:
    """True on torch <= 2.12: the cudagraph-wrapped callable is cached once for all
    threads, so two threads running the same graph on one device share a manager."""
    return not torch_fixes_thread_state()


@dataclass(frozen=True)
class ThreadStateReport:
    installed: bool  # False: the thread already had its own state
    reason: str


def thread_has_state() -> bool:
    local = _cudagraph_trees().local
    has_python = hasattr(local, CONTAINERS_KEY) and hasattr(local, LOCKS_KEY)
    has_stash = torch._C._is_key_in_tls(CONTAINERS_KEY) and torch._C._is_key_in_tls(LOCKS_KEY)
    return has_python and has_stash


def install_thread_state(*, force: bool = False) -> ThreadStateReport:
    """Give the calling thread its own CUDA Graph Trees containers and stash them.

    Idempotent: a thread that already has both the Python attributes and the stash
    keeps them (the main thread, or a second call). On torch 2.13+ this is a no-op
    unless ``force`` is set, because torch initialises missing state itself.
    """
    if torch_fixes_thread_state() and not force:
        return ThreadStateReport(False, "torch initialises cudagraph thread state itself")
    if thread_has_state():
        return ThreadStateReport(False, "thread already has cudagraph state")
    local = _cudagraph_trees().local
    # Python attributes for this thread's own calls ...
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    # ... and the C++ stash that autograd copies into the backward threads it runs
    # for this thread; without it the forward works and the backward asserts.
    torch._C._stash_obj_in_tls(CONTAINERS_KEY, local.tree_manager_containers)
    torch._C._stash_obj_in_tls(LOCKS_KEY, local.tree_manager_locks)
    return ThreadStateReport(True, "installed cudagraph thread state")


def stashed_objects() -> dict[str, Any]:
    """What the C++ thread-local state holds for this thread (for tests and logs)."""
    found = {}
    for key in (CONTAINERS_KEY, LOCKS_KEY):
        if torch._C._is_key_in_tls(key):
            found[key] = torch._C._get_obj_in_tls(key)
    return found


def recorded_graph_count() -> int:
    """Number of CUDA graphs recorded by this thread's tree managers (all devices).

    Walks the trees of every manager the thread owns; 0 means nothing was captured
    (eager fallback or cudagraphs skipped)."""
    local = _cudagraph_trees().local
    containers = getattr(local, CONTAINERS_KEY, None)
    if containers is None:
        containers = stashed_objects().get(CONTAINERS_KEY, {})
    total = 0
    for container in list(containers.values()):
        manager = getattr(container, "tree_manager", None)
        if manager is None or manager.roots is None:
            continue
        pending = [node for nodes in manager.roots.values() for node in nodes]
        while pending:
            node = pending.pop()
            total += 1
            pending.extend(child for nodes in node.children.values() for child in nodes)
    return total
