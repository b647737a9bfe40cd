# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
"""A deploy interrupted before its launch leaves no run: `runs` lists no row for the
folder it made (supervise.py and an empty train.log, no pid, no meta.json), and the
next deploy removes that folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.json_answers import flat
from tests.test_deploy_support import project  # noqa: F401

LEFT = "20261201-101010-dead"


def dflashctl(project, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH")}
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args, "-c", str(project.config_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(env, NO_COLOR="1", COLUMNS="200"),
    )


def test_a_run_folder_never_launched_is_no_run_and_the_next_deploy_removes_it(project):
    first = dflashctl(project, "deploy", "--detach")
    assert first.returncode == 0, first.stdout + first.stderr
    # What a deploy interrupted between making the run's folder and launching it left.
    left = project.run_dir(LEFT)
    left.mkdir()
    (left / "supervise.py").write_text("# the run's wrapper\n")
    (left / "train.log").write_text("")

    listed = dflashctl(project, "runs")
    assert listed.returncode == 0, listed.stderr
    assert LEFT not in listed.stdout and "lost" not in listed.stdout, listed.stdout
    answer = flat(json.loads(dflashctl(project, "runs", "--json").stdout))
    assert LEFT not in [run["id"] for run in answer["runs"]]
    assert len(answer["runs"]) == 1

    again = dflashctl(project, "deploy", "--detach")
    assert again.returncode == 0, again.stdout + again.stderr
    assert not left.exists()
    assert len(list((project.workdir / "runs").iterdir())) == 2
