"""The commit barrier's decision (dflashctl/agent/commit_barrier.py), with real
TCPStores on 127.0.0.1, each node's barrier in a process of its own as the agent
starts it: all arrive => commit everywhere; an abort marker on one node => abort
everywhere; a node that never arrives => abort at the deadline, naming it; a node
arriving after the abort => abort, not a commit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    not __import__("importlib").util.find_spec("torch"), reason="the barrier needs torch"
)

PROGRAM = resources.files("dflashctl.agent").joinpath("commit_barrier.py").read_text("utf-8")
NAMES = ["a", "b", "c"]
SECRET = "0f1e2d3c4b5a69788796a5b4c3d2e1f0"  # what the deploy gives every node
RUN_ID = "20261202-000000-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Barrier:
    """One run's barrier across `world` nodes; each node's marker in tmp_path."""

    def __init__(self, tmp_path: Path, world: int, deadline_s: float = 60.0) -> None:
        self.tmp_path = tmp_path
        self.world = world
        self.port = free_port()
        self.deadline_s = deadline_s
        self.procs: dict[int, subprocess.Popen] = {}

    def marker(self, rank: int) -> Path:
        return self.tmp_path / f"abort-{rank}"

    def params(self, rank: int, **more) -> dict:
        return {
            "world": self.world,
            "rank": rank,
            "names": NAMES[: self.world],
            "address": "127.0.0.1",
            "port": self.port,
            "run_id": RUN_ID,
            "deadline_s": self.deadline_s,
            "marker": str(self.marker(rank)),
            "ack_wait_s": 5,
            **more,
        }

    def start(self, rank: int, **more) -> None:
        self.procs[rank] = subprocess.Popen(
            [sys.executable, "-c", PROGRAM, json.dumps(self.params(rank, **more))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, DFLASH_COMMIT_SECRET=SECRET),
        )

    def answer(self, rank: int, timeout: float = 120) -> dict:
        out, err = self.procs[rank].communicate(timeout=timeout)
        assert self.procs[rank].returncode == 0, err
        return json.loads(out.strip().splitlines()[-1])

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def barrier(tmp_path):
    made = []

    def make(world: int, deadline_s: float = 60.0) -> Barrier:
        made.append(Barrier(tmp_path, world, deadline_s))
        return made[-1]

    yield make
    for b in made:
        b.close()


def test_every_node_arriving_commits_everywhere(barrier):
    b = barrier(3)
    for rank in (2, 1, 0):  # node 0 hosts the store: the others wait for it
        b.start(rank)
    answers = [b.answer(rank) for rank in range(3)]
    assert [a["decision"] for a in answers] == ["commit"] * 3
    assert not any(a["in_doubt"] for a in answers)


def test_an_abort_marker_on_one_node_aborts_every_node(barrier):
    b = barrier(3)
    # Node b decides (it sees its marker) before node a reads the decision, and c never
    # comes: node a need not keep the store up for anyone.
    b.start(0, ack_wait_s=0)
    b.start(1)
    b.marker(1).write_text("node c failed: no space left on device\n")
    answers = [b.answer(rank) for rank in (0, 1)]
    assert [a["decision"] for a in answers] == ["abort", "abort"]
    assert all(a["reason"] == "node c failed: no space left on device" for a in answers)


def test_a_node_that_never_arrives_aborts_everyone_at_the_deadline_naming_it(barrier):
    b = barrier(3, deadline_s=6)
    b.start(0)
    b.start(2)
    answers = [b.answer(rank) for rank in (0, 2)]
    assert [a["decision"] for a in answers] == ["abort", "abort"]
    # Node c may be named too when its start-up (importing torch) took longer.
    reason = answers[0]["reason"]
    assert reason.startswith("node b") and reason.endswith("did not arrive within 6 s")
    assert "a" not in reason.split(" did not")[0].replace("node", "")
    assert answers[1]["reason"] == reason


def decided(b: Barrier, timeout: float = 120) -> str:
    """The decision in node 0's store, read as the nodes read it (waits for it)."""
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore(
        "127.0.0.1",
        b.port,
        None,
        False,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )
    view = dist.PrefixStore(f"dflash-commit/{RUN_ID}/{SECRET}/", store)
    view.wait(["decision"], datetime.timedelta(seconds=timeout))
    return view.get("decision").decode()


def test_a_client_without_the_secret_cannot_move_the_barrier(barrier):
    """The store listens on the network with no authentication: a peer that knows the
    run id (and tries the keys a deploy without a secret used) cannot arrive for the
    missing node nor decide commit."""
    import datetime

    import torch.distributed as dist

    b = barrier(2, deadline_s=8)
    b.start(0, ack_wait_s=0)  # node b never comes to read the decision
    deadline = time.monotonic() + 60
    store = None
    while store is None:
        try:
            store = dist.TCPStore(
                "127.0.0.1", b.port, None, False, datetime.timedelta(seconds=5),
                wait_for_workers=False,
            )  # fmt: skip
        except Exception:  # noqa: BLE001 - node 0 is still importing torch
            assert time.monotonic() < deadline
            time.sleep(0.2)
    for guess in (f"dflash-commit/{RUN_ID}/", f"dflash-commit/{RUN_ID}/{'0' * 32}/"):
        view = dist.PrefixStore(guess, store)
        view.set("node/1", "1")
        view.add("arrived", 1)
        view.compare_set("decision", "", "commit")
    answer = b.answer(0)
    assert answer["decision"] == "abort", answer
    assert answer["reason"] == "node b did not arrive within 8 s"


def test_a_barrier_given_no_secret_never_arrives(barrier, tmp_path):
    b = barrier(1)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, json.dumps(b.params(0))],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "DFLASH_COMMIT_SECRET"},
    )
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["decision"] == "abort" and "no commit secret" in answer["reason"]


def test_a_node_arriving_after_the_abort_aborts_too(barrier):
    b = barrier(2)
    b.marker(0).write_text("node b failed: the build failed\n")
    b.start(0, ack_wait_s=120)  # keeps the store up for node b to read
    assert decided(b) == "abort:node b failed: the build failed"
    # Node b arrives only now: its arrival makes 2 of 2, yet the abort stands.
    b.start(1)
    late, first = b.answer(1), b.answer(0)
    assert late == {
        "decision": "abort",
        "reason": "node b failed: the build failed",
        "in_doubt": False,
    }
    assert first["decision"] == "abort"


def test_a_node_without_node_0_aborts_when_its_marker_appears(barrier):
    b = barrier(2)
    b.start(1)  # node 0 never hosts the store (its build failed, say)
    time.sleep(1)
    b.marker(1).write_text("node a failed: the build failed\n")
    answer = b.answer(1)
    assert answer == {
        "decision": "abort",
        "reason": "node a failed: the build failed",
        "in_doubt": False,
    }


def test_a_failed_node_telling_the_barrier_aborts_the_others_at_once(barrier):
    b = barrier(2)
    b.start(1)
    # Node 0 failed before it arrived: its agent tells the barrier in the background.
    b.start(0, mode="abort", reason="node a failed: disk full", deadline_s=120)
    assert b.answer(1) == {
        "decision": "abort",
        "reason": "node a failed: disk full",
        "in_doubt": False,
    }
    assert b.answer(0)["decision"] == "abort"


# -- the agent's side (agent/commit.py): started ahead, the commit, the stop gate ---------
def agent_params(b: Barrier, rank: int, workdir: Path) -> dict:
    keys = ("world", "rank", "names", "address", "port", "run_id", "deadline_s", "ack_wait_s")
    commit = {k: v for k, v in b.params(rank).items() if k in keys}
    return {
        "workdir": str(workdir),
        "command": [sys.executable, "train.py"],
        "grace_s": 0,
        "commit": dict(commit, program=PROGRAM, secret=SECRET),
    }


def in_thread(work) -> dict:
    """work() on its own thread; the dict gets its "result" or its "error"."""
    import threading

    out: dict = {}

    def run() -> None:
        try:
            out["result"] = work()
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = exc

    out["thread"] = threading.Thread(target=run, daemon=True)
    out["thread"].start()
    return out


def joined(*calls: dict) -> list:
    for call in calls:
        call["thread"].join(120)
        assert "error" not in call, call.get("error")
    return [call["result"] for call in calls]


def commit_all(params: list[dict], warm: list) -> list:
    """Every node joins (with its barrier started ahead, or None); their open barriers."""
    from dflashctl.agent import commit

    calls = [
        in_thread(lambda p=p, w=w: commit.join(p, sys.executable, "r1", w))
        for p, w in zip(params, warm, strict=True)
    ]
    return joined(*calls)


def test_barriers_started_ahead_commit_once_given_the_release(barrier, tmp_path):
    from dflashctl.agent import commit

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    warm = [commit.prestart(p) for p in params]
    assert all(w is not None and w.proc.poll() is None for w in warm)  # importing, waiting
    opened = commit_all(params, warm)
    assert opened == warm  # the ones started ahead arrived, none was started again
    gates = [in_thread(lambda o=o: commit.pass_gate(o, True, 0)) for o in opened]
    assert joined(*gates) == [{"gate": "open"}] * 2
    assert launch_all(opened) == [{"launch": "all"}] * 2


def launch_all(opened: list, launched: tuple[bool, ...] = (True, True)) -> list:
    """The launch round, every node saying whether its new run started."""
    from dflashctl.agent import commit

    calls = [
        in_thread(lambda o=o, ok=ok: commit.report_launch(o, ok, None if ok else "no space"))
        for o, ok in zip(opened, launched, strict=True)
    ]
    return joined(*calls)


def test_no_node_passes_the_stop_gate_before_every_node_stopped(barrier, tmp_path):
    from dflashctl.agent import commit

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    opened = commit_all(params, [None, None])
    node_b = in_thread(lambda: commit.pass_gate(opened[1], True, 0))
    node_b["thread"].join(3)
    assert node_b["thread"].is_alive()  # node a has not stopped its old run yet
    node_a = in_thread(lambda: commit.pass_gate(opened[0], True, 0))
    assert joined(node_a, node_b) == [{"gate": "open"}] * 2
    launch_all(opened)


def test_a_node_whose_stop_failed_does_not_hold_the_others_for_ever(barrier, tmp_path, monkeypatch):
    from dflashctl.agent import commit

    monkeypatch.setattr(commit, "GATE_SLACK_S", 3.0)
    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    opened = commit_all(params, [None, None])
    node_a = in_thread(lambda: commit.pass_gate(opened[0], False, 0))  # its old run is stuck
    node_b = in_thread(lambda: commit.pass_gate(opened[1], True, 0))
    a, b_ = joined(node_a, node_b)
    assert a["gate"] == "closed" and "a" in a["missing"]  # it says so and goes on at once
    assert b_ == {"gate": "timeout", "missing": ["a"]}
    # Node a did not launch (its stop failed): node b learns it, and takes its run down
    # without waiting for a, which has none.
    launched = commit.report_launch(opened[1], True)
    assert launched["launch"] == "failed" and launched["failed"][0]["node"] == "a"
    assert commit.pass_rollback(opened[1], 0) == {"rollback": "open"}


def test_a_cancelled_barrier_never_arrives_so_the_other_node_aborts(barrier, tmp_path):
    from dflashctl.agent import commit

    b = barrier(2, deadline_s=6)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    warm = [commit.prestart(p) for p in params]
    commit.cancel(warm[1])  # node b's build failed: it will not send a release
    assert warm[1].proc.wait(120) == 0 and warm[1].proc.stdout.read() == b""
    node_a = in_thread(lambda: commit.join(params[0], sys.executable, "r1", warm[0]))
    node_a["thread"].join(120)
    assert "node b did not arrive within 6 s" in node_a["error"].message


def test_a_barrier_started_ahead_that_died_is_started_again_at_the_join(barrier, tmp_path):
    from dflashctl.agent import commit

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    dead = commit.prestart(params[1])
    dead.proc.kill()
    dead.proc.wait()
    opened = commit_all(params, [commit.prestart(params[0]), dead])
    assert opened[1] is not dead
    gates = [in_thread(lambda o=o: commit.pass_gate(o, True, 0)) for o in opened]
    assert joined(*gates) == [{"gate": "open"}] * 2
    launch_all(opened)


def test_a_forked_launch_uses_the_barrier_its_parent_started_ahead(barrier, tmp_path):
    """As on a node: the agent starts the barrier ahead, the launch runs in a forked,
    detached child (agent/transaction.py), which must send the release to that one
    rather than start another (it cannot wait for a process it is not the parent of)."""
    from dflashctl.agent import commit
    from dflashctl.agent.transaction import detached

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    warm = [commit.prestart(p) for p in params]

    def launch(p, w) -> dict:
        def work() -> dict:
            arrived = commit.join(p, sys.executable, "r1", w)
            gate = commit.pass_gate(arrived, True, 0)
            return {"warm": arrived is w, "gate": gate, **commit.report_launch(arrived, True)}

        return detached(work)

    calls = [in_thread(lambda p=p, w=w: launch(p, w)) for p, w in zip(params, warm, strict=True)]
    assert joined(*calls) == [{"warm": True, "gate": {"gate": "open"}, "launch": "all"}] * 2


def test_a_node_that_could_not_launch_makes_every_node_roll_back(barrier, tmp_path):
    """The launch round: node b's launch failed after the stop. Node a, which launched,
    learns it and takes its run down; neither launches the previous release before
    both runs are down (node b waits for node a)."""
    from dflashctl.agent import commit

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    opened = commit_all(params, [None, None])
    gates = [in_thread(lambda o=o: commit.pass_gate(o, True, 0)) for o in opened]
    joined(*gates)
    outcomes = launch_all(opened, (True, False))
    failed = {"launch": "failed", "failed": [{"node": "b", "why": "no space"}]}
    assert outcomes == [failed, failed]
    assert commit.failed_nodes(failed) == "node b (no space)"
    node_b = in_thread(lambda: commit.pass_rollback(opened[1], 0))
    node_b["thread"].join(3)
    assert node_b["thread"].is_alive()  # node a's new run is not down yet
    node_a = in_thread(lambda: commit.pass_rollback(opened[0], 0))
    assert joined(node_a, node_b) == [{"rollback": "open"}] * 2


def test_the_launch_round_waits_for_every_node(barrier, tmp_path):
    from dflashctl.agent import commit

    b = barrier(2)
    params = [agent_params(b, rank, tmp_path / f"w{rank}") for rank in (0, 1)]
    opened = commit_all(params, [None, None])
    joined(*[in_thread(lambda o=o: commit.pass_gate(o, True, 0)) for o in opened])
    node_a = in_thread(lambda: commit.report_launch(opened[0], True))
    node_a["thread"].join(3)
    assert node_a["thread"].is_alive()  # node b has not said yet
    node_b = in_thread(lambda: commit.report_launch(opened[1], True))
    assert joined(node_a, node_b) == [{"launch": "all"}] * 2


def test_a_store_that_connects_slowly_is_tried_again_with_longer_waits(monkeypatch, tmp_path):
    """Where the DNS server does not answer, torch's TCPStore takes about 10 s to look
    up its peer's name after connecting: every try shorter than that fails, node 0's
    own included. The barrier tries again, each time waiting longer."""
    import datetime

    import torch.distributed as dist

    from dflashctl.agent import commit_barrier

    lookup_s = 5.0
    tries = []

    class SlowLookupStore:
        def __init__(self, host, port, world, master, timeout, wait_for_workers):
            tries.append(timeout.total_seconds())
            if timeout < datetime.timedelta(seconds=lookup_s):
                raise RuntimeError(
                    "The client socket has timed out after 2000ms while trying to connect"
                )

        def set_timeout(self, timeout):
            pass

    monkeypatch.setattr(dist, "TCPStore", SlowLookupStore)
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: (prefix, store))
    monkeypatch.setattr(commit_barrier, "POLL_S", 0.0)
    for rank in (0, 1):
        tries.clear()
        p = dict(Barrier(tmp_path, 2).params(rank), secret=SECRET)
        view, why = commit_barrier.connect(p, time.monotonic() + 60)
        assert why is None and view[0] == f"dflash-commit/{RUN_ID}/{SECRET}/"
        assert tries == [2.0, 4.0, 8.0]


def test_node_0_gives_up_at_once_when_its_port_is_taken(barrier):
    b = barrier(1)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", b.port))
        taken.listen()
        b.start(0)
        answer = b.answer(0)
    assert answer["decision"] == "abort"
    assert answer["reason"].startswith(f"node a could not host the commit store on port {b.port}")
