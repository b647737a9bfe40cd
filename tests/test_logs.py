"""`dflashctl logs` as a user runs it, on this machine (host.address local, no
container): exit codes, --follow, -n, --json, Ctrl-C, and --file for copied logs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.json_answers import flat
from tests.test_follow_support import (
    expected_lines,
    kill_run,
    launch_argv,
    trainer_argv,
    wait_for,
)

CRASH_LOG = """\
step 1/100 | loss 2.31 | acc 0.52
drafter-2 on cuda:7: warming compiled graphs
step 2/100 | loss 2.29 | acc 0.52
drafter-2 failed:
Traceback (most recent call last):
  File "/root/dflash/current/dflash/pipeline/workers.py", line 88, in _run
    self._warm_up(device)
  File "/usr/lib/python3/site-packages/torch/_inductor/cudagraph_trees.py", line 322, in get_obj
    assert torch._C._is_key_in_tls(attr_name)
AssertionError
step 3/100 | loss 2.27 | acc 0.53
"""
CLEAN_LOG = "step 1/2 | loss 2.0\nstep 2/2 | loss 1.9\ntraining complete\n"


def dflashctl(*args, cwd: Path, stdin: str | None = None, timeout: float = 60):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("DFLASHCTL_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step ", "training complete"))]


class Project:
    """A dflash.yaml for this machine and runs launched in its workdir."""

    def __init__(self, root: Path):
        self.root = root
        self.workdir = root / "workdir"
        config = {
            "host": {"address": "local"},
            "container": {"vmid": None, "workdir": str(self.workdir), "python": sys.executable},
        }
        (root / "dflash.yaml").write_text(yaml.safe_dump(config))
        self.rundirs: list[Path] = []

    def launch(self, run_id: str, lines: int, delay: float, mode: str = "finish") -> Path:
        rundir = self.workdir / "runs" / run_id
        self.rundirs.append(rundir)
        argv = trainer_argv(sys.executable, lines, delay, mode)
        subprocess.run(launch_argv(str(rundir), argv), check=True)
        wait_for(lambda: (rundir / "pid").exists(), what="the pid file")
        return rundir


@pytest.fixture
def project(tmp_path):
    made = Project(tmp_path)
    yield made
    for rundir in made.rundirs:
        kill_run(rundir)


# --------------------------------------------------------------------------- --file


def test_file_names_the_crash_and_exits_1(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(CRASH_LOG)
    done = dflashctl("logs", "--file", str(log), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert "cudagraph_tls" in done.stdout and "drafter-2" in done.stdout
    assert "step 3/100" in done.stdout  # the log's lines come first
    assert "crashed" in done.stderr


def test_file_json_from_stdin(tmp_path):
    done = dflashctl("logs", "--file", "-", "--json", cwd=tmp_path, stdin=CRASH_LOG)
    assert done.returncode == 1, done.stderr
    answer = flat(json.loads(done.stdout))
    assert answer["status"] == "crashed" and answer["exit_code"] is None
    root = answer["crashes"][0]
    assert (root["category"], root["thread"], root["device"]) == (
        "cudagraph_tls",
        "drafter-2",
        "cuda:7",
    )
    assert root["exception"] == "AssertionError" and root["line"] == 4
    for key in ("rule", "stage", "message", "hint", "excerpt"):
        assert key in root


def test_a_bad_user_crash_rule_is_exit_2_naming_the_config_file(project):
    config_path = project.root / "dflash.yaml"
    config = yaml.safe_load(config_path.read_text())
    config["crash_patterns"] = [{"name": "mine", "category": "mine", "regex": "(", "hint": "h"}]
    config_path.write_text(yaml.safe_dump(config))
    for args in (["logs"], ["logs", "--file", "-"]):
        done = dflashctl(*args, cwd=project.root, stdin="")
        assert done.returncode == 2, done.stderr
        # Checked with the rest of the config, so named with its line like any mistake.
        assert (
            f"{config_path}, line 6, column 3: crash_patterns[0].regex: invalid regular expression"
            in done.stderr
        )


def test_file_weighs_the_exit_code(tmp_path):
    log = tmp_path / "clean.log"
    log.write_text(CLEAN_LOG)
    assert dflashctl("logs", "--file", str(log), cwd=tmp_path).returncode == 0
    done = dflashctl("logs", "--file", str(log), "--exit-code", "137", "--json", cwd=tmp_path)
    assert done.returncode == 1
    answer = flat(json.loads(done.stdout))
    assert answer["exit_code"] == 137 and answer["crashes"][0]["category"] == "killed"


def test_file_with_only_the_last_lines(tmp_path):
    done = dflashctl("logs", "--file", "-", "-n", "1", cwd=tmp_path, stdin=CLEAN_LOG)
    assert done.returncode == 0
    assert step_lines(done.stdout) == ["training complete"]


def test_usage_errors_exit_2(tmp_path):
    missing = dflashctl("logs", "--file", str(tmp_path / "nope.log"), cwd=tmp_path)
    assert missing.returncode == 2 and "nope.log" in missing.stderr
    stray = dflashctl("logs", "--exit-code", "1", cwd=tmp_path)
    assert stray.returncode == 2 and "--file" in stray.stderr


# --------------------------------------------------------------------------- runs


def test_no_runs_yet(project):
    done = dflashctl("logs", cwd=project.root)
    assert done.returncode == 2
    assert "no runs" in done.stderr and "dflashctl deploy" in done.stderr


def test_plain_logs_of_a_running_run_show_the_last_lines_and_exit_0(project):
    rundir = project.launch("20261129-100000-aaaa", lines=5, delay=0.01, mode="hang")
    wait_for(lambda: "step 5/5" in (rundir / "train.log").read_text(), what="the log")
    done = dflashctl("logs", "-n", "2", cwd=project.root)  # the active run
    assert done.returncode == 0, done.stderr
    assert step_lines(done.stdout) == expected_lines(5, "hang")[-2:]
    assert "still running" in done.stderr


def test_follow_to_a_clean_finish_exits_0(project):
    project.launch("20261129-100001-bbbb", lines=15, delay=0.03)
    done = dflashctl("logs", "-f", "20261129-100001-bbbb", cwd=project.root)
    assert done.returncode == 0, done.stderr
    assert step_lines(done.stdout) == expected_lines(15)
    assert "finished" in done.stderr


def test_follow_a_crash_exits_1_with_json(project):
    project.launch("20261129-100002-cccc", lines=4, delay=0.03, mode="thread-crash")
    done = dflashctl("logs", "-f", "--json", cwd=project.root)
    assert done.returncode == 1, done.stderr
    answer = flat(json.loads(done.stdout))  # stdout holds the JSON object only
    assert answer["run"] == "20261129-100002-cccc"
    assert (answer["status"], answer["exit_code"]) == ("crashed", 1)
    assert answer["crashes"][0]["thread"] == "drafter-2"
    assert step_lines(done.stderr) == expected_lines(4, "thread-crash")


def test_ctrl_c_stops_following_and_leaves_the_run_running(project):
    # The run logs its lines, then stays alive until killed: however slowly the
    # follower starts on a busy machine, the run is still running when Ctrl-C comes.
    rundir = project.launch("20261129-100003-dddd", lines=400, delay=0.005, mode="hang")
    env = {**os.environ, "NO_COLOR": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", "logs", "-f"],
        cwd=project.root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    # One reader per pipe, and no communicate(): a second reader of stdout would take
    # lines from this one, and the test would see a gap the follower never left.
    printed: list[str] = []
    errors: list[str] = []
    readers = [
        threading.Thread(target=lambda: printed.extend(proc.stdout), daemon=True),
        threading.Thread(target=lambda: errors.extend(proc.stderr), daemon=True),
    ]
    try:
        for reader in readers:
            reader.start()
        # Ctrl-C once the follower has printed lines (it is following, not starting up).
        wait_for(lambda: len(step_lines("".join(printed))) > 5, timeout=120, what="lines")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        for reader in readers:
            reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    out, err = "".join(printed), "".join(errors)
    assert proc.returncode == 130, err
    assert "dflashctl logs -f 20261129-100003-dddd" in err
    shown, everything = step_lines(out), expected_lines(400, "hang")
    first = everything.index(shown[0])
    assert len(shown) > 5 and shown == everything[first : first + len(shown)]
    assert not (rundir / "exit_code").exists()
    pid = int((rundir / "pid").read_text())
    os.kill(pid, 0)  # the run is still alive


def test_a_run_killed_by_a_signal_is_a_crash_named_by_its_signal(project):
    rundir = project.launch("20261129-100004-eeee", lines=2, delay=0.01, mode="hang")
    wait_for(lambda: "step 2/2" in (rundir / "train.log").read_text(), what="the log")
    wrapper = int((rundir / "pid").read_text())
    subprocess.run(["pkill", "-TERM", "-P", str(wrapper)], check=True)  # the trainer only
    wait_for(lambda: (rundir / "exit_code").exists(), what="the exit code")
    done = dflashctl("logs", "--json", cwd=project.root)
    assert done.returncode == 1
    answer = flat(json.loads(done.stdout))
    assert (answer["status"], answer["exit_code"]) == ("crashed", 143)
    done = dflashctl("logs", cwd=project.root)
    assert done.returncode == 1 and "killed by SIGTERM" in done.stderr


def test_a_run_id_that_leaves_runs_is_refused(project):
    # A train.log outside runs/ must not be read through `..`.
    outside = project.workdir / "elsewhere"
    outside.mkdir(parents=True)
    (outside / "train.log").write_text("SECRET LINE\n")
    (project.workdir / "runs").mkdir(parents=True)
    done = dflashctl("logs", "../elsewhere", cwd=project.root)
    assert done.returncode == 2, done.stderr
    assert "not a run id" in done.stderr and "SECRET" not in done.stdout + done.stderr


def test_the_log_reader_refuses_a_run_id_that_leaves_runs(tmp_path):
    from dflashctl.agent.logreader import _stream

    (tmp_path / "runs").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "train.log").write_text("SECRET LINE\n")
    import io

    out = io.BytesIO()
    _stream(out, str(tmp_path), "../elsewhere", 0, -1, True)
    assert b"SECRET" not in out.getvalue() and out.getvalue().endswith(b"N\n")
