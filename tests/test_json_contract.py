"""The --json contract: every command answers one JSON object on one line, with
schema_version 1 and the same shape for one node and for several, valid against the
schema kept in dflashctl/schemas/ (which must match the models it is made from)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.ui import json_schemas
from dflashctl.ui.json_output import COMMANDS, command_in, document
from tests.test_deploy_support import kill_runs, write_local_config, write_trainer

jsonschema = pytest.importorskip("jsonschema")


def cli(config: Path, *args: str) -> tuple[int, dict]:
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", *args, "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (args, done.stdout, done.stderr[-2000:])
    assert done.stdout.endswith("\n") and "\n" not in done.stdout.rstrip("\n")
    answer = json.loads(lines[0])
    return done.returncode, answer


def check(answer: dict, command: str, *, nodes: int) -> dict:
    schema = json.loads(json_schemas.schema_file(command).read_text())
    jsonschema.validate(answer, schema)
    assert answer["schema_version"] == 1 and answer["command"] == command
    assert len(answer["nodes"]) == nodes, answer
    assert list(answer)[:3] == ["schema_version", "command", "nodes"]
    return answer


def test_the_kept_schemas_match_the_models():
    for command in COMMANDS:
        path = json_schemas.schema_file(command)
        assert path.is_file(), f"{path} missing: run `make schemas`"
        assert path.read_text() == json_schemas.rendered(command), (
            f"{path} is out of date with dflashctl/ui/json_schemas.py: run `make schemas`"
        )


def test_one_shape_for_one_node_and_for_several():
    one = document("stop", {"target": "local", "stopped": []}, "pve")
    several = document(
        "stop", {"nodes": [{"node": "a", "target": "x", "stopped": [], "error": None}]}
    )
    assert one == {
        "schema_version": 1,
        "command": "stop",
        "nodes": [{"node": "pve", "target": "local", "stopped": [], "error": None}],
    }
    assert set(one) == set(several) and set(one["nodes"][0]) == set(several["nodes"][0])


def test_the_command_of_an_argument_list():
    assert command_in(["--config", "x.yaml", "runs", "show", "r1"]) == "runs show"
    assert command_in(["stop", "--json"]) == "stop"
    assert command_in(["deploy", "--", "status"]) == "deploy"
    assert command_in(["--version"]) is None


@pytest.fixture
def local_project(tmp_path):
    write_trainer(tmp_path / "src")
    config = write_local_config(tmp_path, args=["--sleep", "60", "--on-term", "checkpoint"])
    yield config
    kill_runs(tmp_path / "workdir")


def test_every_command_on_the_local_target(local_project):
    config = local_project
    code, answer = cli(config, "deploy", "--detach")
    assert code == 0, answer
    run_id = check(answer, "deploy", nodes=1)["run_id"]
    assert answer["nodes"][0]["pid"] > 0 and answer["nodes"][0]["target"]
    code, answer = cli(config, "deploy", "--dry-run")
    check(answer, "deploy", nodes=1)
    assert answer["dry_run"] is True
    code, answer = cli(config, "status")
    assert check(answer, "status", nodes=1)["nodes"][0]["active_run"]["id"] == run_id
    code, answer = cli(config, "runs")
    assert [r["id"] for r in check(answer, "runs", nodes=1)["nodes"][0]["runs"]] == [run_id]
    code, answer = cli(config, "runs", "--prune", "5", "--dry-run")
    assert check(answer, "runs", nodes=1)["nodes"][0]["dry_run"] is True
    code, answer = cli(config, "runs", "show", run_id)
    check(answer, "runs show", nodes=1)
    code, answer = cli(config, "logs", run_id)
    assert check(answer, "logs", nodes=1)["run"] == run_id
    code, answer = cli(config, "doctor")
    check(answer, "doctor", nodes=1)
    assert answer["ok"] is (code == 0) and answer["nodes"][0]["checks"]
    code, answer = cli(config, "restart", "--detach")
    assert code == 0, answer
    check(answer, "restart", nodes=1)
    code, answer = cli(config, "stop")
    assert code == 0
    stopped = check(answer, "stop", nodes=1)["nodes"][0]["stopped"]
    assert len(stopped) == 1


def test_an_error_before_any_answer_has_the_same_envelope(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    code, answer = cli(missing, "status")
    assert code == 2
    check(answer, "status", nodes=0)
    assert answer["error"] and answer["exit_code"] == 2


def test_several_nodes_have_the_shape_of_one(tmp_path):
    write_trainer(tmp_path / "src")
    names = ("gpu-a", "gpu-b")
    config = tmp_path / "dflash.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": {"address": "local"},
                "container": {"vmid": None, "python": sys.executable},
                "nodes": [
                    {"name": n, "container": {"workdir": str(tmp_path / f"work-{n}")}}
                    for n in names
                ],
                "trainer": {"source": "src", "entry": "train.py", "args": ["--sleep", "60"]},
                "run": {"stop_grace_s": 3},
            }
        )
    )
    for command in (("status",), ("runs",), ("stop",), ("doctor",)):
        code, answer = cli(config, *command)
        check(answer, " ".join(command), nodes=2)
        assert [n["node"] for n in answer["nodes"]] == list(names)


def test_every_command_on_the_test_host(container, write_config, tmp_path):
    source = write_trainer(tmp_path / "src")
    config = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "trainer.entry": "train.py",
            # Longer than the commands below take on a loaded machine (doctor's torch
            # import alone can take 20 s there): `stop` must find it still running.
            "trainer.args": ["--sleep", "600", "--on-term", "checkpoint"],
        },
    )
    code, answer = cli(config, "deploy", "--detach")
    assert code == 0, answer
    run_id = check(answer, "deploy", nodes=1)["run_id"]
    code, answer = cli(config, "status")
    status = check(answer, "status", nodes=1)["nodes"][0]
    assert status["container"]["status"] == "running" and status["proxmox_node"] == "pve"
    code, answer = cli(config, "runs")
    check(answer, "runs", nodes=1)
    code, answer = cli(config, "logs", run_id)
    check(answer, "logs", nodes=1)
    code, answer = cli(config, "doctor")
    check(answer, "doctor", nodes=1)
    code, answer = cli(config, "stop")
    assert code == 0 and len(check(answer, "stop", nodes=1)["nodes"][0]["stopped"]) == 1


def keys(value, at: str = "") -> set[str]:
    """Every key path of a JSON value; the items of `nodes` and `checks` under `[]`
    (the entries every answer has); another list's items depend on what there was."""
    if isinstance(value, dict):
        found = set()
        for key, item in value.items():
            # A run's `meta` is what its launch recorded (torchrun's place on several).
            below = keys(item, f"{at}.{key}") if key != "meta" else set()
            found |= {f"{at}.{key}"} | below
        return found
    if isinstance(value, list) and at.rsplit(".", 1)[-1] in ("nodes", "checks"):
        return set().union(set(), *(keys(item, f"{at}[]") for item in value))
    return set()


# Every command with --json whose answer a project of local nodes can give, and what
# it runs after a deploy (--detach); logs' answer is made in follow/.
ANSWERS = [
    ("deploy", ("deploy", "--detach")),
    ("restart", ("restart", "--detach")),
    ("status", ("status",)),
    ("runs", ("runs",)),
    ("runs", ("runs", "--prune", "0", "--dry-run")),
    ("runs show", ("runs", "show")),
    ("stacks", ("stacks", "--wait", "2")),
    ("doctor", ("doctor",)),
    ("stop", ("stop",)),
]


def test_every_answer_has_the_same_keys_for_one_node_and_for_two(tmp_path, monkeypatch):
    """The real commands' answers on one node and on two: the same key paths in the
    document and in each entry of `nodes` (and in doctor's checks, deploy's result...)."""
    from tests.test_commands_on_nodes import NAMES, dflashctl, make_project

    answers: dict[int, list[dict]] = {}
    for count in (1, 2):
        for project in make_project(tmp_path / str(count), monkeypatch, NAMES[:count]):
            answers[count] = []
            for command, args in ANSWERS:
                done = dflashctl(project, *args, "--json")
                answer = json.loads(done.stdout)
                assert answer["command"] == command, (args, done.stderr[-2000:])
                answers[count].append(answer)
    for (_, args), one, two in zip(ANSWERS, answers[1], answers[2], strict=True):
        assert keys(one) == keys(two), (args, keys(one) ^ keys(two))
        entries = [keys(entry) for entry in (*one["nodes"], *two["nodes"])]
        assert all(e == entries[0] for e in entries), (args, entries)
