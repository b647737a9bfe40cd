"""The agent's trainer config check (agent/trainer_check.py): which command it runs, that
it runs only an entry script that asks for it, and its interpreter started ahead (while
the client plans the deploy): told the new release and the final arguments once they
are there, used only with the run's environment, ended untold when not needed."""

from __future__ import annotations

import json
import os
import sys

import pytest

from dflashctl.agent import trainer_check
from dflashctl.agent.trainer_check import TrainerConfigRefused, check_argv, check_trainer_config


def test_the_trainers_own_command_line_is_taken_out_of_the_launch():
    plain = ["/v/bin/python", "train.py", "--config", "c.yaml", "--resume-from={resume_from}"]
    assert check_argv(plain, "train.py") == [
        "/v/bin/python",
        "train.py",
        "--config",
        "c.yaml",
        "--resume-from=",
    ]
    torchrun = ["/v/bin/python", "-m", "torch.distributed.run", "--nnodes=2", "train.py", "-x"]
    assert check_argv(torchrun, "train.py") == ["/v/bin/python", "train.py", "-x"]
    assert check_argv(["/v/bin/python", "other.py"], "train.py") is None


def params(tmp_path, entry_text: str) -> dict:
    release = tmp_path / "release"
    release.mkdir(parents=True)
    (release / "train.py").write_text(entry_text)
    return {
        "workdir": str(tmp_path / "w"),
        "entry": "train.py",
        "command": [sys.executable, "train.py", "--set", "a=1"],
        "env": {"MINE": "yes"},
    }


def test_an_entry_script_that_does_not_ask_for_the_check_is_not_run(tmp_path):
    p = params(tmp_path, "open('ran', 'w').write('started training')\n")
    assert check_trainer_config(str(tmp_path / "release"), p) is None
    assert not (tmp_path / "release" / "ran").exists()


def test_a_refusal_is_said_in_the_trainers_words(tmp_path):
    p = params(
        tmp_path,
        "import os, sys\n"
        "assert os.environ['DFLASH_CHECK_CONFIG'] == '1' and os.environ['MINE'] == 'yes'\n"
        "print('reading', sys.argv[1:])\n"
        "sys.exit('config error: --set a=1: unknown key a')\n",
    )
    with pytest.raises(TrainerConfigRefused) as caught:
        check_trainer_config(str(tmp_path / "release"), p)
    assert caught.value.reason == "config error: --set a=1: unknown key a"
    assert "nothing was stopped" in caught.value.message
    fine = params(tmp_path / "b", "import os\nassert os.environ['DFLASH_CHECK_CONFIG'] == '1'\n")
    assert check_trainer_config(str(tmp_path / "b" / "release"), fine) is None


# ------------------------------------------------- the check's interpreter, started ahead

ENTRY_REPORTING = """\
import json, os, sys
ahead = "slow_import" in sys.modules
import slow_import
with open(os.environ["REPORT"], "w") as out:
    json.dump({"ahead": ahead, "argv": sys.argv[1:], "cwd": os.getcwd(), "name": __name__,
               "path0": sys.path[0], "check": os.environ["DFLASH_CHECK_CONFIG"]}, out)
if "--set" in sys.argv and "a=typo" in sys.argv:
    sys.exit("config error: --set a=typo: unknown key a")
"""


def ahead_params(tmp_path, release: str, *args: str) -> dict:
    """A workdir with `release` built; a trainer that imports slow_import (a second to
    import, from PYTHONPATH) and reports what it saw."""
    workdir = tmp_path / "w"
    folder = workdir / "releases" / release
    folder.mkdir(parents=True)
    (folder / "train.py").write_text(ENTRY_REPORTING)
    modules = tmp_path / "modules"
    modules.mkdir(exist_ok=True)
    (modules / "slow_import.py").write_text("import time\ntime.sleep(1)\n")
    return {
        "workdir": str(workdir),
        "entry": "train.py",
        "command": [sys.executable, "train.py", *args],
        "env": {"PYTHONPATH": str(modules), "REPORT": str(tmp_path / "report.json")},
    }


def report(tmp_path) -> dict:
    return json.loads((tmp_path / "report.json").read_text())


def test_a_check_started_ahead_runs_the_new_release_with_the_final_arguments(tmp_path):
    first = ahead_params(tmp_path, "r1", "--config", "c.yaml")
    assert check_trainer_config(str(tmp_path / "w/releases/r1"), first) is None
    assert report(tmp_path)["ahead"] is False  # nothing was started ahead the first time
    spec = tmp_path / "w" / trainer_check.SPEC_FILE
    assert spec.stat().st_mode & 0o777 == 0o600  # trainer.env may hold secrets
    # The next upload's agent starts it before the release exists; the release and the
    # arguments (a `-- --set` of this deploy) come while it is still importing.
    trainer_check.prestart(first["workdir"])
    later = ahead_params(tmp_path, "r2", "--config", "c.yaml", "--set", "a=1")
    release = tmp_path / "w/releases/r2"
    assert check_trainer_config(str(release), later) is None
    seen = report(tmp_path)
    assert seen["ahead"] is True  # imported before it was told what to run
    assert seen["argv"] == ["--config", "c.yaml", "--set", "a=1"]
    assert seen["cwd"] == str(release) and seen["path0"] == os.path.realpath(release)
    assert seen["name"] == "__main__" and seen["check"] == "1"
    # What it imported from a release is never imported ahead (a new release may change it).
    recorded = json.loads((tmp_path / "w" / trainer_check.MODULES_FILE).read_text())
    assert "slow_import" in recorded and "train" not in recorded


def test_a_refusal_from_a_check_started_ahead_is_said_in_the_trainers_words(tmp_path):
    first = ahead_params(tmp_path, "r1")
    check_trainer_config(str(tmp_path / "w/releases/r1"), first)
    trainer_check.prestart(first["workdir"])
    typo = ahead_params(tmp_path, "r2", "--set", "a=typo")
    with pytest.raises(TrainerConfigRefused) as caught:
        check_trainer_config(str(tmp_path / "w/releases/r2"), typo)
    assert caught.value.reason == "config error: --set a=typo: unknown key a"
    assert "nothing was stopped" in caught.value.message


def test_a_check_started_ahead_with_another_environment_is_not_used(tmp_path):
    first = ahead_params(tmp_path, "r1")
    check_trainer_config(str(tmp_path / "w/releases/r1"), first)
    trainer_check.prestart(first["workdir"])
    changed = ahead_params(tmp_path, "r2")
    changed["env"]["TRAINER_FLAG"] = "new"  # trainer.env changed since the last check
    assert check_trainer_config(str(tmp_path / "w/releases/r2"), changed) is None
    assert report(tmp_path)["ahead"] is False  # a fresh interpreter with the run's env


def test_a_check_started_ahead_that_is_not_asked_runs_nothing(tmp_path):
    first = ahead_params(tmp_path, "r1")
    check_trainer_config(str(tmp_path / "w/releases/r1"), first)
    (tmp_path / "report.json").unlink()
    trainer_check.prestart(first["workdir"])
    runner = trainer_check._warm[2]
    # An entry script that does not ask for the check: the runner is ended untold.
    other = ahead_params(tmp_path, "r2")
    (tmp_path / "w/releases/r2/train.py").write_text("open('ran', 'w')\n")
    assert check_trainer_config(str(tmp_path / "w/releases/r2"), other) is None
    assert runner.wait(timeout=60) != 0
    assert not (tmp_path / "report.json").exists()
    assert not (tmp_path / "w/releases/r2/ran").exists()
