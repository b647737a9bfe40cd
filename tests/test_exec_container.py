# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""exec and shell against the test host: a command in a real container with the run's
environment, its output, stdin and exit status; a shell on a pty (Python's pty module
stands in for the user's terminal)."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.host.fixtures import CONTAINER_KIND
from tests.setup_support import IMPORTING_TRAINER, build_wheel

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def cli(path: Path, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args[:1], "-c", str(path), *args[1:]],
        capture_output=True,
        text=True,
        timeout=300,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )


@pytest.fixture
def deployed(tmp_path, container, write_config, monkeypatch):
    """(config path, run id, venv, container): a run from a venv with hello-pkg."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(IMPORTING_TRAINER)
    build_wheel(source / "wheels", "hello-pkg", "1.0", "VALUE = 'one'\n")
    (source / "requirements.txt").write_text("hello-pkg==1.0\n")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "trainer.entry": "train.py",
            "trainer.args": [],
            "trainer.env": {"MY_SETTING": "forty two"},
            "run.stop_grace_s": 3,
            "setup.pip_args": ["--no-index", "--find-links", "wheels"],
        },
    )
    done = cli(path, "deploy", "--detach")
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = (done.stdout + done.stderr).split("launched run ", 1)[1].split()[0]
    log = container.host_path(f"{WORKDIR}/runs/{run_id}/train.log")
    deadline = time.monotonic() + 60
    while "prefix " not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    venv = log.read_text().split("prefix ", 1)[1].split()[0]
    return path, run_id, venv, container


def test_exec_runs_in_the_run_environment_with_its_status(deployed):
    path, run_id, venv, _ = deployed
    script = (
        'echo "venv=$VIRTUAL_ENV"; echo "cwd=$(pwd)"; echo "run=$DFLASH_RUN_ID"; '
        'echo "setting=$MY_SETTING"; echo "python=$(command -v python)"; '
        "python -c 'import hello_pkg; print(\"pkg\", hello_pkg.VALUE)'; "
        "echo oops >&2; exit 7"
    )
    done = cli(path, "exec", "--", "sh", "-c", script)
    assert done.returncode == 7, done.stderr
    out = done.stdout
    assert f"venv={venv}\n" in out and f"cwd={WORKDIR}\n" in out
    assert f"run={run_id}\n" in out and "setting=forty two\n" in out
    assert f"python={venv}/bin/python\n" in out and "pkg one\n" in out
    assert "oops" in done.stderr and "oops" not in out  # stderr stays stderr


def test_exec_passes_stdin_and_options_of_the_command(deployed):
    path, *_ = deployed
    done = cli(path, "exec", "--", "cat", input="line one\nline two\n")
    assert done.returncode == 0 and done.stdout == "line one\nline two\n"
    # the command's own options are not dflashctl's
    done = cli(path, "exec", "ls", "-la", "--color=never")
    assert done.returncode == 0 and "current" in done.stdout


def test_exec_errors(deployed):
    path, _, _, container = deployed
    missing = cli(path, "exec", "--", "no-such-command-here")
    assert missing.returncode == 127
    assert "no-such-command-here: command not found" in missing.stderr
    no_node = cli(path, "exec", "--node", "elsewhere", "--", "true")
    assert no_node.returncode == 2 and "no node 'elsewhere'" in no_node.stderr
    no_command = cli(path, "exec")
    assert no_command.returncode == 2
    assert "Traceback" not in no_node.stderr + no_command.stderr
    container.stop()
    stopped = cli(path, "exec", "--", "true")
    assert stopped.returncode == 3 and "container 200 is not running" in stopped.stderr


def test_shell_on_a_pty(deployed):
    path, run_id, venv, _ = deployed
    pid, fd = pty.fork()
    if pid == 0:  # the child: dflashctl shell on the pty's slave end
        os.execv(sys.executable, [*DFLASHCTL, "shell", "-c", str(path)])
    output = b""
    sent = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the pty
                break
            if not data:
                break
            output += data
        if not sent and b"dflashctl: in" in output:
            time.sleep(0.5)  # the shell's prompt
            os.write(fd, b'echo hi-$((40+2)) "$VIRTUAL_ENV"; tty; exit 3\n')
            sent = True
    _, status = os.waitpid(pid, 0)
    text = output.decode("utf-8", "replace")
    assert os.WEXITSTATUS(status) == 3, text
    assert f"hi-42 {venv}" in text
    if CONTAINER_KIND.get("kind") == "lxc":  # lxc-attach gives it a terminal inside
        assert "/dev/pts/" in text
    else:  # the bubblewrap stand-in has no pty of its own: the SSH session's is the terminal
        assert "not a tty" in text
    assert f"run {run_id}" in text


def test_trainer_env_is_on_no_command_line_while_exec_runs(deployed):
    """Any user of the host reads /proc/*/cmdline: pct exec, lxc-attach and the agent
    stay there while the command runs, so trainer.env must not ride on them."""
    path, *_ = deployed
    proc = subprocess.Popen(
        [
            *DFLASHCTL,
            "exec",
            "-c",
            str(path),
            "--",
            "sh",
            "-c",
            'echo "ready $MY_SETTING"; sleep 5',
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready forty two\n"
        seen = []
        for pid in os.listdir("/proc"):
            try:
                cmdline = Path("/proc", pid, "cmdline").read_bytes()
            except OSError:
                continue
            if b"forty two" in cmdline:
                seen.append(cmdline.replace(b"\0", b" ")[:300])
        assert seen == []
    finally:
        proc.kill()
        proc.wait()
