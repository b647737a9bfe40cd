"""Data-parallel drafter replicas stay identical and match one replica on the combined batch."""

from __future__ import annotations

import threading
import time

import torch
from dflash.pipeline.logging import RunLog
from dflash.pipeline.replicas import GradientAverager, StopAwareBarrier
from dflash.pipeline.supervisor import Stopped, Supervisor

from tests.pipeline_standin import run_standin


def params(replica):
    return {n: p.detach().clone() for n, p in replica.model.named_parameters()}


def test_replicas_equal_and_match_single_replica_on_combined_batch(tmp_path):
    two, _ = run_standin(
        tmp_path / "two",
        runtime={"drafter_devices": ["cpu", "cpu"]},
        data={"batch_size": 2},
        train={"steps": 15, "log_every": 5},
    )
    one, _ = run_standin(
        tmp_path / "one", data={"batch_size": 4}, train={"steps": 15, "log_every": 5}
    )
    assert two.exit_code == one.exit_code == 0
    a, b = params(two.replicas[0]), params(two.replicas[1])
    single = params(one.replicas[0])
    moved = 0.0
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bitwise: same arithmetic in the same order
        torch.testing.assert_close(a[name], single[name], rtol=1e-4, atol=1e-5)
    initial = run_standin(tmp_path / "zero", train={"steps": 1, "log_every": 1}, optim={"lr": 0.0})[
        0
    ]
    for name, value in params(initial.replicas[0]).items():
        moved = max(moved, (value - single[name]).abs().max().item())
    assert moved > 1e-2  # the comparison is about trained weights, not the initial ones
    for (s1, l1), (s2, l2) in zip(two.history, one.history, strict=False):
        assert s1 == s2 and abs(l1 - l2) < 1e-4


def test_averager_gives_every_rank_the_bitwise_same_mean():
    supervisor = Supervisor(RunLog())
    averager = GradientAverager(3, supervisor, lambda: False)
    inputs = [torch.randn(1000, dtype=torch.float32) for _ in range(3)]
    outputs = [None] * 3

    def rank(i):
        outputs[i] = averager.all_reduce_mean(i, inputs[i].clone())

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    expected = (inputs[0] + inputs[1] + inputs[2]) / 3
    for out in outputs:
        assert torch.equal(out, outputs[0])
        torch.testing.assert_close(out, expected)


def test_averager_samples_the_stop_request_once_per_step():
    flag = {"stop": False}
    supervisor = Supervisor(RunLog())
    averager = GradientAverager(2, supervisor, lambda: flag["stop"])
    seen = []

    def rank(i):
        averager.all_reduce_mean(i, torch.zeros(2))
        seen.append(averager.stop_after_step)

    flag["stop"] = True
    threads = [threading.Thread(target=rank, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert seen == [True, True]


def test_a_stop_releases_a_rank_waiting_for_the_others():
    supervisor = Supervisor(RunLog())
    averager = GradientAverager(2, supervisor, lambda: False)
    errors = []

    def lonely():
        try:
            averager.all_reduce_mean(0, torch.zeros(2))
        except Stopped as exc:
            errors.append(exc)

    thread = threading.Thread(target=lonely)
    thread.start()
    supervisor.request_stop()
    thread.join(timeout=60)
    assert not thread.is_alive() and len(errors) == 1


def test_a_released_rank_keeps_its_step_when_a_peer_stops_right_after():
    """A stop requested the moment the meeting completes (here: by the barrier's action,
    before the waiting party even wakes up) must not take the step from that party."""
    supervisor = Supervisor(RunLog())
    barrier = StopAwareBarrier(2, supervisor, supervisor.request_stop)
    outcome = []

    def waiter():
        try:
            barrier.wait()
            outcome.append("returned")
        except Stopped:
            outcome.append("stopped")

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)  # the waiter is inside wait()
    barrier.wait()
    thread.join(timeout=60)
    assert supervisor.stop.is_set()
    assert outcome == ["returned"]
