"""ops/pull.py without a test host: the agent's `pull_plan` (agent/pull.py) answers in
this process for each node's workdir (as agent_client would carry it), and the reader
stream runs on this machine through the local transport, as it would run in a
container. One node and two; a run folder made here the way the trainer leaves one.
The real thing in a container is tests/test_pull_container.py's."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dflashctl.agent import pull as agent_pull
from dflashctl.agent.checkpoint_folders import checkpoint_step, newest_complete
from dflashctl.errors import HostError, UsageError
from dflashctl.ops import pull
from dflashctl.remote import agent_client
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.nodes import Node, NodesFailed
from dflashctl.remote.transport.local import LocalTransport
from dflashctl.reporting import Reporter

RUN = "20261205-080000-0001"


def make_run(workdir: Path, run_id: str = RUN, steps=(2, 4)) -> Path:
    """A run folder as the bundled trainer leaves it: checkpoints (the newest with a
    drafter/ export), metrics, meta, a TensorBoard file and a W&B offline run."""
    run = workdir / "runs" / run_id
    for step in steps:
        folder = run / "outputs" / "checkpoints" / f"step-{step:06d}"
        (folder / "drafter").mkdir(parents=True)
        (folder / "state.pt").write_bytes(os.urandom(3000 + step))
        (folder / "drafter" / "config.json").write_text(f'{{"step": {step}}}\n')
    if steps:
        (run / "outputs" / "checkpoints" / "latest").write_text(f"step-{max(steps):06d}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n' * 50)
    (run / "meta.json").write_text('{"release": "r1"}\n')
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host").write_bytes(b"tb" * 100)
    (run / "wandb" / "offline-run-1").mkdir(parents=True)
    (run / "wandb" / "offline-run-1" / "run.wandb").write_bytes(b"w" * 10)
    os.chmod(run / "wandb" / "offline-run-1" / "run.wandb", 0o600)
    return run


def node(index: int, name: str, workdir: Path) -> Node:
    config = SimpleNamespace(container=SimpleNamespace(python=sys.executable, workdir=str(workdir)))
    return Node(index, name, config, Target(LocalTransport(), None))  # type: ignore[arg-type]


class Agents:
    """`pull_plan` answered by the agent's own code, in this process; a node named in
    `down` cannot be reached."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, dict]] = []
        self.down: set[str] = set()
        self.lists: list[str] = []

    def call_agent(self, target, python, op, params, timeout=None):
        assert op == "pull_plan"
        self.asked.append((params["workdir"], dict(params)))
        if any(params["workdir"].endswith(os.sep + name) for name in self.down):
            raise HostError("connection refused")
        answer = agent_pull.op_pull_plan(params)
        if "list" in answer:
            self.lists.append(answer["list"])
        return answer


@pytest.fixture
def agents(monkeypatch):
    fake = Agents()
    monkeypatch.setattr(agent_client, "call_agent", fake.call_agent)
    yield fake
    for path in fake.lists:
        Path(path).unlink(missing_ok=True)


class Said(Reporter):
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, message: str) -> None:
        self.warnings.append(message)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pulled(dest: Path) -> dict[str, str]:
    return {str(p.relative_to(dest)): sha(p) for p in sorted(dest.rglob("*")) if p.is_file()}


def test_a_checkpoint_folder_names_its_step_and_latest_names_the_newest(tmp_path):
    assert checkpoint_step("runs/x/outputs/checkpoints/step-000120/") == 120
    assert checkpoint_step("checkpoint_7") == 7
    assert checkpoint_step("final") is None
    run = make_run(tmp_path / "w", steps=(2, 4))
    base = run / "outputs" / "checkpoints"
    assert newest_complete(str(run)) == str(base / "step-000004")
    (base / "latest").write_text("step-000002\n")  # `latest` wins over the highest step
    assert newest_complete(str(run)) == str(base / "step-000002")
    (base / "latest").write_text("step-000009\n")  # names a folder that is gone
    assert newest_complete(str(run)) == str(base / "step-000004")


def test_one_node_pulls_the_latest_checkpoint_and_the_metrics_byte_for_byte(tmp_path, agents):
    workdir = tmp_path / "a"
    run = make_run(workdir)
    (run / "meta-link.json").symlink_to(run / "meta.json")
    (run / "tensorboard" / "elsewhere").symlink_to("/etc")
    nodes = [node(0, "a", workdir)]
    answers = pull.plans(nodes, RUN, None)
    files, checkpoint = pull.choose(nodes, answers, RUN, None)
    assert checkpoint["step"] == 4 and checkpoint["export"] is True
    dest = tmp_path / "pulled"
    counts = pull.pull_files(files, dest)
    ckpt = run / "outputs" / "checkpoints" / "step-000004"
    expected = {
        "checkpoints/step-000004/state.pt": sha(ckpt / "state.pt"),
        "checkpoints/step-000004/drafter/config.json": sha(ckpt / "drafter" / "config.json"),
        "metrics.jsonl": sha(run / "metrics.jsonl"),
        "meta.json": sha(run / "meta.json"),
        "tensorboard/events.out.tfevents.1.host": sha(
            run / "tensorboard" / "events.out.tfevents.1.host"
        ),
        "wandb/offline-run-1/run.wandb": sha(run / "wandb" / "offline-run-1" / "run.wandb"),
    }
    assert pulled(dest) == expected
    assert counts["fetched"] == len(expected) and counts["already"] == counts["resumed"] == 0
    assert counts["bytes"] == sum((dest / rel).stat().st_size for rel in expected)
    # Each file keeps its mode; no .partial is left; links are named, not followed.
    assert (dest / "wandb/offline-run-1/run.wandb").stat().st_mode & 0o777 == 0o600
    assert not list(dest.rglob("*.partial"))
    assert pull.links_left_out(answers) == ["tensorboard/elsewhere -> /etc"]
    # Again: every file is here at its size and only hashed there.
    again = pull.pull_files(pull.choose(nodes, pull.plans(nodes, RUN, None), RUN, None)[0], dest)
    assert again == {"fetched": 0, "resumed": 0, "already": len(expected), "bytes": 0}


def test_a_step_pulls_that_checkpoint_and_an_unknown_one_lists_the_steps(tmp_path, agents):
    workdir = tmp_path / "a"
    make_run(workdir, steps=(2, 4))
    nodes = [node(0, "a", workdir)]
    files, checkpoint = pull.choose(nodes, pull.plans(nodes, RUN, 2), RUN, 2)
    assert checkpoint["step"] == 2
    assert {f.rel for f in files if f.rel.startswith("checkpoints")} == {
        "checkpoints/step-000002/state.pt",
        "checkpoints/step-000002/drafter/config.json",
    }
    with pytest.raises(UsageError) as info:
        pull.choose(nodes, pull.plans(nodes, RUN, 3), RUN, 3)
    assert str(info.value) == f"run {RUN} has no checkpoint at step 3 (its checkpoints: 2, 4)"
    with pytest.raises(UsageError) as info:
        pull.choose(nodes, pull.plans(nodes, "20990101-000000-0001", None), "x", None)
    assert f"(latest runs: {RUN})" in str(info.value)
    assert "runs" in info.value.hint


def test_a_cut_pull_continues_each_file_from_its_partial_and_refetches_a_wrong_one(
    tmp_path, agents
):
    workdir = tmp_path / "a"
    run = make_run(workdir, steps=(4,))
    nodes = [node(0, "a", workdir)]
    files, _ = pull.choose(nodes, pull.plans(nodes, RUN, None), RUN, None)
    dest = tmp_path / "pulled"
    state = run / "outputs/checkpoints/step-000004/state.pt"
    metrics = run / "metrics.jsonl"
    (dest / "checkpoints/step-000004").mkdir(parents=True)
    # What a cut pull left: the first half of state.pt, and a metrics prefix that is
    # not the source's (the file was rewritten there meanwhile, say).
    (dest / "checkpoints/step-000004/state.pt.partial").write_bytes(state.read_bytes()[:1000])
    (dest / "metrics.jsonl.partial").write_bytes(b"not what is there")
    counts = pull.pull_files(files, dest)
    assert sha(dest / "checkpoints/step-000004/state.pt") == sha(state)
    assert sha(dest / "metrics.jsonl") == sha(metrics)
    assert counts["resumed"] == 1  # state.pt; metrics.jsonl came again whole
    assert counts["fetched"] == len(files) - 1
    assert not list(dest.rglob("*.partial"))


def test_a_file_here_of_the_same_size_but_other_bytes_is_fetched_again(tmp_path, agents):
    workdir = tmp_path / "a"
    run = make_run(workdir, steps=(4,))
    nodes = [node(0, "a", workdir)]
    files, _ = pull.choose(nodes, pull.plans(nodes, RUN, None), RUN, None)
    dest = tmp_path / "pulled"
    pull.pull_files(files, dest)
    (dest / "meta.json").write_text('{"release": "XX"}\n')  # same size, other content
    counts = pull.pull_files(files, dest)
    assert (dest / "meta.json").read_bytes() == (run / "meta.json").read_bytes()
    assert counts["already"] == len(files) - 1 and counts["fetched"] == 1


def test_a_file_that_shrank_there_is_refused_naming_it(tmp_path, agents):
    workdir = tmp_path / "a"
    run = make_run(workdir, steps=(4,))
    nodes = [node(0, "a", workdir)]
    files, _ = pull.choose(nodes, pull.plans(nodes, RUN, None), RUN, None)
    (run / "metrics.jsonl").write_text("short\n")  # after the plan listed its size
    with pytest.raises(HostError) as info:
        pull.pull_files(files, tmp_path / "pulled")
    assert str(info.value).startswith("metrics.jsonl arrived with a different sha256 than")
    assert "pull again" in info.value.hint


def test_a_run_listing_a_path_outside_the_folder_is_refused(tmp_path):
    n = node(0, "a", tmp_path)
    bad = pull.PullFile("../escape", "/etc/hostname", 5, n, 0, "/nonexistent")
    with pytest.raises(HostError, match="outside the pull folder"):
        pull.pull_files([bad], tmp_path / "pulled")
    assert not (tmp_path / "escape").exists()


def test_two_nodes_take_the_files_from_the_node_that_has_the_run(tmp_path, agents):
    """Node a (rank 0) has no such run (its disk was replaced, say): the checkpoint and
    the metrics come from node b, and both nodes were asked."""
    make_run(tmp_path / "b")
    (tmp_path / "a").mkdir()
    nodes = [node(0, "a", tmp_path / "a"), node(1, "b", tmp_path / "b")]
    answers = pull.plans(nodes, RUN, None)
    assert sorted(w for w, _ in agents.asked) == [str(tmp_path / "a"), str(tmp_path / "b")]
    files, checkpoint = pull.choose(nodes, answers, RUN, None)
    assert {f.node.name for f in files} == {"b"} and checkpoint["step"] == 4
    dest = tmp_path / "pulled"
    pull.pull_files(files, dest)
    assert (dest / "meta.json").read_bytes() == (
        tmp_path / "b/runs" / RUN / "meta.json"
    ).read_bytes()


def test_two_nodes_with_the_run_take_rank_0s(tmp_path, agents):
    make_run(tmp_path / "a", steps=(6,))
    make_run(tmp_path / "b", steps=(4,))  # a rank's own leftovers: not what rank 0 wrote
    nodes = [node(0, "a", tmp_path / "a"), node(1, "b", tmp_path / "b")]
    files, checkpoint = pull.choose(nodes, pull.plans(nodes, RUN, None), RUN, None)
    assert checkpoint["step"] == 6 and {f.node.name for f in files} == {"a"}


def test_an_unreachable_node_is_a_warning_unless_every_node_is(tmp_path, agents):
    make_run(tmp_path / "a")
    make_run(tmp_path / "b")
    nodes = [node(0, "a", tmp_path / "a"), node(1, "b", tmp_path / "b")]
    agents.down = {"b"}
    said = Said()
    answers = pull.plans(nodes, RUN, None, said)
    assert [a["found"] for a in answers] == [True, False]
    assert len(said.warnings) == 1 and said.warnings[0].startswith("node b (")
    assert "connection refused" in said.warnings[0]
    agents.down = {"a", "b"}
    with pytest.raises(
        NodesFailed, match=r"^node a \(.*connection refused \(also failed: b\)$"
    ) as info:
        pull.plans(nodes, RUN, None, said)
    assert info.value.exit_code == HostError.exit_code


def test_the_wanted_lists_join_runs_of_whole_files_and_split_when_too_long(monkeypatch):
    items = [(0, 0), (1, 0), (2, 0), (4, 0), (5, 120), (6, None), (7, 0), (8, 0)]
    assert pull.wanted_specs(items) == ["0-2,4,5@120,6#,7-8"]
    assert pull.wanted_specs([]) == []
    monkeypatch.setattr(pull, "SPEC_CHARS", 8)
    specs = pull.wanted_specs(items)
    assert specs == ["0-2,4", "5@120,6#", "7-8"]
    assert all(len(s) <= 8 for s in specs)
