"""The agent's trainer config check (agent/trainer_check.py): which command it runs, and
that it runs only an entry script that asks for it."""

from __future__ import annotations

import sys

import pytest

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
