"""The root cause across nodes (the first failure in time, consequences apart), torchrun's
failure summary, and several threads printing through prefixed consoles."""

from __future__ import annotations

import io
import threading

from rich.console import Console

from dflashctl.crash import classify_text, load_rules
from dflashctl.follow.prefixed import node_consoles
from dflashctl.follow.root_cause import NodeFailure, TorchrunWatch, first_failure

RULES = load_rules()

THREAD_CRASH = [
    "drafter-2 on cpu: warming compiled graphs",
    "[rank1]: drafter-2 on cpu: warming compiled graphs",
    "[rank1]: drafter-2 failed:",
    "[rank1]: Traceback (most recent call last):",
    '[rank1]:   File "/root/dflash/current/dflash/pipeline/warmup.py", line 40, in warm',
    "[rank1]:     graphs.warm()",
    "[rank1]: AssertionError: tree manager container missing from this thread",
]
PEER_LOST = [
    "peers failed:",
    "Traceback (most recent call last):",
    '  File "/root/dflash/current/dflash/pipeline/distributed.py", line 200, in _watch',
    "    self._fail(text)",
    "dflash.pipeline.distributed.PeerFailure: rank 0/2 on host gpu-a (pid 7): rank 1 on host "
    "gpu-b stopped answering: no heartbeat for 15 s (killed, out of memory, or its host is gone)",
]
GLOO_CLOSED = [
    "drafter-0 failed:",
    "Traceback (most recent call last):",
    '  File "/root/dflash/current/dflash/pipeline/replicas.py", line 293, in _average',
    "    work.wait()",
    "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:434. This is typically caused by a remote worker crashing.",
]
# torchrun's own lines on the node whose rank was SIGKILLed (a real torch 2.13 run,
# paths shortened).
TORCHRUN_SIGKILL = [
    "step 2",
    "E1130 20:50:42.344000 27594 torch/distributed/elastic/multiprocessing/api.py:1002] "
    "failed (exitcode: -9) local_rank: 0 (pid: 27599) of binary: /venv/bin/python",
    "Traceback (most recent call last):",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in <module>',
    "    main()",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, '
    "in launch_agent",
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "======================================================",
    "w.py FAILED",
    "------------------------------------------------------",
    "Failures:",
    "  <NO_OTHER_FAILURES>",
    "------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-11-30_20:50:42",
    "  host      : gpu-b",
    "  rank      : 1 (local_rank: 0)",
    "  exitcode  : -9 (pid: 27599)  (SIGKILL)",
    "  error_file: <N/A>",
    "  traceback : Signal 9 (SIGKILL) received by PID 27599",
    "======================================================",
]


def crash(lines: list[str], exit_code: int | None = 1):
    return classify_text(lines, exit_code, RULES)[0]


def failure(node: str, index: int, lines: list[str] | None, **kwargs) -> NodeFailure:
    return NodeFailure(node, index, event=crash(lines) if lines else None, **kwargs)


def test_the_first_failure_in_time_is_the_cause_whatever_the_node_order():
    a = failure("gpu-a", 0, GLOO_CLOSED[:2] + ["ValueError: bad batch"], seen_at=1005.0)
    b = failure("gpu-b", 1, THREAD_CRASH, seen_at=1000.2)
    cause, consequences = first_failure([a, b])
    assert (cause.node, [f.node for f in consequences]) == ("gpu-b", ["gpu-a"])
    assert cause.describe() == (
        "node gpu-b, rank 1, thread drafter-2 on cpu: "
        "AssertionError: tree manager container missing from this thread"
    )


def test_a_peer_failure_is_never_the_cause_even_when_seen_first():
    """Node a's follower saw its PeerFailure before node b's own traceback arrived (b's
    connection was slower): b's failure is still the cause."""
    a = failure("gpu-a", 0, PEER_LOST, seen_at=1000.0)
    b = failure("gpu-b", 1, THREAD_CRASH, seen_at=1000.9)
    assert a.consequence and a.event.category == "peer_lost" and not b.consequence
    cause, consequences = first_failure([a, b])
    assert (cause.node, consequences[0].node) == ("gpu-b", "gpu-a")


def test_a_collective_the_dead_peer_closed_is_a_consequence():
    gloo = failure("gpu-a", 0, GLOO_CLOSED, seen_at=999.0)
    killed = NodeFailure("gpu-b", 1, event=crash(["step 3"], 137), seen_at=1000.0)
    assert gloo.consequence and killed.event.category == "killed"
    assert first_failure([gloo, killed])[0].node == "gpu-b"


def test_without_live_times_the_run_end_decides_then_the_node_order():
    a = failure("gpu-a", 0, THREAD_CRASH, ended_at=2000.0)
    b = failure("gpu-b", 1, THREAD_CRASH, ended_at=1990.0)
    assert first_failure([a, b])[0].node == "gpu-b"
    # Nothing known of when: the node order, and a known time beats an unknown one.
    c, d = failure("gpu-c", 2, THREAD_CRASH), failure("gpu-d", 3, THREAD_CRASH)
    assert first_failure([d, c])[0].node == "gpu-c"
    assert first_failure([c, d, b])[0].node == "gpu-b"


def test_only_consequences_seen_the_first_of_them_stands_for_the_cause():
    a = failure("gpu-a", 0, PEER_LOST, seen_at=1001.0)
    c = failure("gpu-c", 2, PEER_LOST, seen_at=1000.5)
    cause, consequences = first_failure([a, c])
    assert cause.node == "gpu-c" and cause.consequence and consequences == [a]
    assert first_failure([]) == (None, [])


def test_torchrun_summary_names_the_killed_rank():
    watch = TorchrunWatch()
    upto = TORCHRUN_SIGKILL.index("w.py FAILED")
    for line in TORCHRUN_SIGKILL[:upto]:
        watch.feed(line)
    # Before its summary, torchrun's first line says which local rank and how.
    early = NodeFailure("gpu-b", 1, event=crash(TORCHRUN_SIGKILL[:upto]), torchrun=watch.failure)
    assert early.describe() == "node gpu-b, local rank 0: killed by SIGKILL, pid 27599"
    for line in TORCHRUN_SIGKILL[upto:]:
        watch.feed(line)
    said = watch.failure
    assert (said.rank, said.local_rank, said.exitcode, said.pid) == (1, 0, -9, 27599)
    assert said.time == "2026-11-30_20:50:42"
    node = NodeFailure("gpu-b", 1, event=crash(TORCHRUN_SIGKILL), torchrun=said)
    # The detector reads the same summary: rank 1 killed is the log's root cause.
    assert (node.event.category, node.event.rank, node.event.message) == (
        "killed",
        1,
        "rank 1 killed (SIGKILL)",
    )
    assert node.describe() == "node gpu-b, rank 1: killed by SIGKILL, pid 27599"
    data = node.to_json()
    assert (data["node"], data["rank"], data["consequence"]) == ("gpu-b", 1, False)


def test_a_killed_rank_without_torchrun_says_how_it_ended():
    node = NodeFailure(
        "gpu-b", 1, event=crash(["step 3"], 137), state="crashed (killed by SIGKILL)"
    )
    assert node.rank is None and node.what() == node.event.summary
    assert NodeFailure("gpu-b", 1, state="lost").describe() == "node gpu-b: lost"


def test_threads_printing_through_prefixed_consoles_never_mix_within_a_line():
    out = io.StringIO()
    base = Console(file=out, width=120)
    names = ["gpu-a", "b"]
    prefixes = ["gpu-a | ", "b     | "]  # aligned on the longest name
    consoles = node_consoles(lambda: base, names)
    assert node_consoles(lambda: base, ["gpu-a"]) == [base]  # one node: no prefix

    def spam(index: int) -> None:
        for n in range(300):
            consoles[index].print(f"{names[index]} line {n} " + "x" * 50, soft_wrap=True)

    threads = [threading.Thread(target=spam, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    lines = out.getvalue().splitlines()
    assert len(lines) == 600
    for name, prefix in zip(names, prefixes, strict=True):
        mine = [line for line in lines if line.startswith(prefix)]
        assert mine == [f"{prefix}{name} line {n} " + "x" * 50 for n in range(300)]


def test_torchrun_stopping_its_ranks_is_a_failure_unless_it_was_told_to_stop():
    closing = (
        "W1130 21:10:00.000000 42 torch/distributed/elastic/multiprocessing/api.py:1031] "
        "Sending process 43 closing signal SIGTERM"
    )
    failed = TorchrunWatch()
    failed.feed("step 3/100")
    assert not failed.rank_failed
    failed.feed(closing)
    assert failed.rank_failed
    stopped = TorchrunWatch()
    stopped.feed(
        "W1130 20:57:38.461000 27593 torch/distributed/elastic/agent/server/api.py:753] "
        "Received 15 death signal, shutting down workers"
    )
    stopped.feed(closing)
    assert not stopped.rank_failed
