"""The CUDA Graph Trees thread-state helper: what it installs, what it stashes, idempotence."""

from __future__ import annotations

import threading
from collections import defaultdict

import torch
import torch._inductor.cudagraph_trees as cudagraph_trees
from dflash.pipeline import tls


def in_new_thread(fn):
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_new_thread_starts_without_state():
    def probe():
        return tls.thread_has_state(), tls.stashed_objects()

    has_state, stashed = in_new_thread(probe)
    assert has_state is False
    assert stashed == {}


def test_install_stashes_the_same_objects_the_thread_uses():
    def probe():
        report = tls.install_thread_state(force=True)
        local = cudagraph_trees.local
        stashed = tls.stashed_objects()
        return report, local.tree_manager_containers, local.tree_manager_locks, stashed

    report, containers, locks, stashed = in_new_thread(probe)
    assert report.installed
    assert containers == {}
    assert isinstance(locks, defaultdict)
    assert type(locks[0]) is type(threading.Lock())
    # The C++ stash (what autograd's backward threads inherit) is the very same objects.
    assert stashed[tls.CONTAINERS_KEY] is containers
    assert stashed[tls.LOCKS_KEY] is locks


def test_install_is_idempotent():
    def probe():
        first = tls.install_thread_state(force=True)
        containers = cudagraph_trees.local.tree_manager_containers
        containers["marker"] = "kept"
        second = tls.install_thread_state(force=True)
        return first, second, cudagraph_trees.local.tree_manager_containers, tls.stashed_objects()

    first, second, containers, stashed = in_new_thread(probe)
    assert first.installed and not second.installed
    assert containers == {"marker": "kept"}
    assert stashed[tls.CONTAINERS_KEY] is containers


def test_main_thread_state_is_left_alone():
    before = cudagraph_trees.local.tree_manager_containers
    report = tls.install_thread_state(force=True)
    assert not report.installed
    assert cudagraph_trees.local.tree_manager_containers is before


def test_threads_get_separate_state():
    def probe():
        tls.install_thread_state(force=True)
        return cudagraph_trees.local.tree_manager_containers

    assert in_new_thread(probe) is not in_new_thread(probe)


def test_backward_sees_the_stashed_state():
    class Probe(torch.autograd.Function):
        seen: dict = {}

        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            Probe.seen = tls.stashed_objects()
            return grad * 2

    def probe():
        tls.install_thread_state(force=True)
        x = torch.ones(3, requires_grad=True)
        Probe.apply(x).sum().backward()
        return cudagraph_trees.local.tree_manager_containers

    containers = in_new_thread(probe)
    assert Probe.seen[tls.CONTAINERS_KEY] is containers


def test_noop_where_torch_initialises_state_itself():
    def probe():
        return tls.install_thread_state(), tls.thread_has_state()

    report, has_state = in_new_thread(probe)
    if tls.torch_fixes_thread_state():
        assert not report.installed and "itself" in report.reason
        assert not has_state
    else:
        assert report.installed and has_state


def test_no_graphs_recorded_without_cuda():
    def probe():
        tls.install_thread_state(force=True)
        return tls.recorded_graph_count()

    assert in_new_thread(probe) == 0
