"""Agent verbs on a workdir made here, without a container: `metrics` (agent/metrics.py,
what `runs show` draws) and `exec` (agent/exec_env.py: a command in the run's
environment). Through a container they are tests/test_runs_show_container.py's and
tests/test_exec_container.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dflashctl.agent import exec_env, metrics

OLD, NEW = "20261205-080000-0001", "20261205-090000-0002"


def run_folder(workdir: Path, run_id: str, steps: range, resumed_from: str | None = None) -> Path:
    run = workdir / "runs" / run_id
    run.mkdir(parents=True)
    lines = [json.dumps({"kind": "config", "lr": 0.1})]
    lines += [json.dumps({"kind": "step", "step": s, "loss": 10.0 / s}) for s in steps]
    lines += ["[1, 2]", '{"kind": "step", "step": 99, "lo']  # not a record; a line cut short
    (run / "metrics.jsonl").write_text("\n".join(lines))
    (run / "meta.json").write_text(json.dumps({"resumed_from": resumed_from}))
    return run


def test_step_records_are_thinned_evenly_keeping_the_last_and_every_other_record(tmp_path):
    run = run_folder(tmp_path, OLD, range(1, 101))
    rows, total = metrics.read_metrics(str(run), 10)
    steps = [r["step"] for r in rows if r["kind"] == "step"]
    assert total == 100 and len(steps) == 10
    assert steps[0] == 1 and steps[-1] == 100 and steps == sorted(steps)
    assert [r for r in rows if r["kind"] != "step"] == [{"kind": "config", "lr": 0.1}]
    rows, total = metrics.read_metrics(str(run), None)
    assert total == 100 and len(rows) == 101  # no limit: every step, no cut line
    assert metrics.read_metrics(str(tmp_path / "nowhere"), 10) == (None, 0)


def test_a_runs_metrics_come_with_those_of_the_runs_it_resumed_from_oldest_first(tmp_path):
    run_folder(tmp_path, OLD, range(1, 6), resumed_from="20261201-000000-0009")  # pruned
    run_folder(tmp_path, NEW, range(6, 9), resumed_from=OLD)
    (tmp_path / "active_run").write_text(NEW + "\n")
    answer = metrics.op_metrics(
        {"workdir": str(tmp_path), "run_ids": ["@active", "../etc", "nope"], "max_points": 0}
    )
    assert answer["missing"] == ["../etc", "nope"] and answer["active_run"] == NEW
    (found,) = answer["runs"]
    lineage = found["lineage"]
    assert found["id"] == NEW
    assert [hop["id"] for hop in lineage] == ["20261201-000000-0009", OLD, NEW]
    assert lineage[0] == {"id": "20261201-000000-0009", "missing": True}
    assert [hop["step_records"] for hop in lineage[1:]] == [5, 3]
    assert [r["step"] for r in lineage[2]["metrics"] if r["kind"] == "step"] == [6, 7, 8]


def test_a_lineage_loop_in_meta_ends(tmp_path):
    run_folder(tmp_path, OLD, range(1, 3), resumed_from=NEW)
    run_folder(tmp_path, NEW, range(3, 5), resumed_from=OLD)
    answer = metrics.op_metrics({"workdir": str(tmp_path), "run_ids": [NEW]})
    assert [hop["id"] for hop in answer["runs"][0]["lineage"]] == [OLD, NEW]


def exec_in(workdir: Path, params: dict) -> subprocess.CompletedProcess:
    """The exec verb in a process of its own (it replaces the process), as the agent
    runs it, its parameters through a ticket."""
    ticket = exec_env.op_exec_ticket(params)["ticket"]
    assert os.stat(ticket).st_mode & 0o777 == 0o600  # trainer.env holds secrets
    code = (
        "import sys; from dflashctl.agent.exec_env import main_exec; "
        "sys.exit(main_exec(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps({"ticket": ticket})],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, DFLASH_RUN_ID="leaked-from-the-caller"),
    )
    assert not os.path.exists(ticket)  # read once, then gone
    return done


def test_exec_runs_in_the_workdir_with_the_active_run_and_trainer_env(tmp_path):
    run_folder(tmp_path, NEW, range(1, 2))
    (tmp_path / "active_run").write_text(NEW)
    done = exec_in(
        tmp_path,
        {
            "workdir": str(tmp_path),
            "env": {"WANDB_API_KEY": "secret"},
            "python": sys.executable,
            "argv": ["sh", "-c", 'echo "$PWD $DFLASH_RUN_ID $WANDB_API_KEY"; exit 7'],
        },
    )
    assert done.returncode == 7  # the command's own status
    assert done.stdout.split() == [str(tmp_path), NEW, "secret"]
    # No venv: the folder of container.python comes first on PATH.
    cwd, env = exec_env.run_environment({"workdir": str(tmp_path), "python": sys.executable})
    assert env["PATH"].split(os.pathsep)[0] == os.path.dirname(sys.executable)
    assert "VIRTUAL_ENV" not in env


def test_exec_of_a_missing_command_says_so_with_a_shells_status(tmp_path):
    done = exec_in(tmp_path, {"workdir": str(tmp_path), "argv": ["no-such-command-here"]})
    assert done.returncode == 127
    assert "no-such-command-here: command not found in the container" in done.stderr
    gone = exec_in(tmp_path, {"workdir": str(tmp_path / "gone"), "argv": ["true"]})
    assert gone.returncode == 2 and "cannot enter" in gone.stderr


def test_a_ticket_others_could_read_is_refused(tmp_path):
    ticket = exec_env.op_exec_ticket({"workdir": str(tmp_path), "argv": ["true"]})["ticket"]
    os.chmod(ticket, 0o644)
    try:
        assert exec_env.main_exec(json.dumps({"ticket": ticket})) == 2
        assert os.path.exists(ticket)  # not taken
    finally:
        os.unlink(ticket)
