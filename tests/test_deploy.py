"""deploy on the local target (host.address: local, no container): the same code path
as on a Proxmox host, with the workdir in a temporary folder."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflashctl.commands.deploy import show_plan
from dflashctl.errors import ConfigError, HostError, UsageError
from dflashctl.ops import deploy as deploy_mod
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.ops.restart import restart
from dflashctl.remote import connect as connect_mod
from dflashctl.remote.connect import open_target
from dflashctl.remote.nodes import NodesFailed
from dflashctl.runs.records import list_runs, run_state
from tests.json_answers import flat, one_node
from tests.test_deploy_support import (  # noqa: F401
    pid_alive,
    project,
    release_manifest,
    snapshot,
    wait_for,
)

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def detached(config, **options):
    code, summary = deploy(config, DeployOptions(detach=True, **options))
    return code, one_node(summary)


def target(project):
    return open_target(project.config())


def test_first_deploy_lands_files_swaps_current_and_launches(project):
    code, summary = detached(project.config())
    assert code == 0
    release = summary["release"]
    assert summary["previous_release"] is None
    assert summary["files_sent"] == summary["files_total"] == 3  # no __pycache__
    assert summary["bytes_sent"] > 0
    assert os.readlink(project.workdir / "current") == f"releases/{release}"
    for rel in ("train.py", "helpers.py", "configs/tiny.yaml"):
        assert (project.current() / rel).read_bytes() == (project.source / rel).read_bytes()
    assert not (project.current() / "__pycache__").exists()
    manifest = release_manifest(project.current())
    assert sorted(manifest) == ["configs/tiny.yaml", "helpers.py", "train.py"]
    assert sorted(os.listdir(project.current())) == ["configs", "helpers.py", "train.py"]

    run_dir = project.run_dir(summary["run_id"])
    assert (project.workdir / "active_run").read_text().strip() == summary["run_id"]
    pid = int((run_dir / "pid").read_text())
    assert pid == summary["pid"] and pid_alive(pid)
    # The wrapper leads its own session and process group.
    assert os.getpgid(pid) == pid and os.getsid(pid) == pid
    wait_for(lambda: "hello from the trainer" in (run_dir / "train.log").read_text(), what="log")
    log = (run_dir / "train.log").read_text()
    assert summary["run_id"] in log and str(project.workdir / "releases" / release) in log

    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["release"] == release
    assert meta["pid"] == pid
    assert meta["config_digest"] == project.config().digest
    assert meta["command"] == [
        sys.executable,
        "train.py",
        "--sleep",
        "60",
        "--on-term",
        "checkpoint",
    ]
    assert meta["started"].endswith("Z")
    assert (
        run_state(
            target(project), str(project.workdir), summary["run_id"], python=sys.executable
        ).status
        == "running"
    )


def test_redeploy_sends_only_the_changed_file_and_replaces_the_run(project):
    _, first = detached(project.config())
    first_pid = first["pid"]
    log = project.run_dir(first["run_id"]) / "train.log"
    wait_for(lambda: "hello" in log.read_text(), what="the trainer to set its SIGTERM handler")
    (project.source / "helpers.py").write_text("def greeting():\n    return 'hello again'\n")
    _, second = detached(project.config())

    assert second["files_sent"] == 1 and second["previous_release"] == first["release"]
    assert second["release"] != first["release"]
    new, old = (
        project.workdir / "releases" / second["release"],
        project.workdir / "releases" / first["release"],
    )
    # The unchanged file was not sent: it is the previous release's file, linked.
    assert (new / "train.py").stat().st_ino == (old / "train.py").stat().st_ino
    assert (new / "helpers.py").read_text().endswith("'hello again'\n")
    assert (old / "helpers.py").read_text().endswith("'hello from the trainer'\n")

    # The first run got SIGTERM and its grace period (it wrote its checkpoint), and is gone.
    assert not pid_alive(first_pid)
    [stopped] = second["runs_stopped"]
    assert stopped["run_id"] == first["run_id"] and stopped["ended"] == "terminated"
    assert (project.run_dir(first["run_id"]) / "checkpointed").read_text() == "yes\n"
    assert (project.run_dir(first["run_id"]) / "exit_code").read_text().strip() == "0"
    assert pid_alive(second["pid"])


def test_no_change_redeploy_sends_no_file_content(project):
    _, first = detached(project.config())
    _, second = detached(project.config())
    assert second["files_sent"] == 0 and second["bytes_sent"] == 0 and second["archive_bytes"] == 0
    assert second["release"] == first["release"]
    assert second["run_id"] != first["run_id"]


def test_a_file_edited_in_place_in_the_release_is_sent_again(project):
    _, first = detached(project.config())
    (project.current() / "helpers.py").write_text("# edited by hand in the container\n")
    _, second = detached(project.config())
    assert second["files_sent"] == 1
    assert (project.current() / "helpers.py").read_bytes() == (
        project.source / "helpers.py"
    ).read_bytes()


def test_a_chmod_alone_is_deployed_without_touching_the_previous_release(project):
    _, first = detached(project.config())
    (project.source / "helpers.py").chmod(0o755)
    _, second = detached(project.config())
    assert second["files_sent"] == 1 and second["release"] != first["release"]
    new = project.workdir / "releases" / second["release"] / "helpers.py"
    old = project.workdir / "releases" / first["release"] / "helpers.py"
    assert os.access(new, os.X_OK) and not os.access(old, os.X_OK)
    assert new.stat().st_ino != old.stat().st_ino  # its own file, not a link to the old one
    (project.source / "helpers.py").chmod(0o644)
    _, third = detached(project.config())
    assert third["files_sent"] == 1 and not os.access(project.current() / "helpers.py", os.X_OK)


def test_a_chmod_by_hand_in_the_release_is_undone_by_the_next_deploy(project):
    detached(project.config())
    (project.current() / "helpers.py").chmod(0o755)
    _, second = detached(project.config())
    assert second["files_sent"] == 1
    assert not os.access(project.current() / "helpers.py", os.X_OK)


def test_a_removed_file_is_left_out_of_the_new_release(project):
    detached(project.config())
    (project.source / "configs" / "tiny.yaml").unlink()
    _, second = detached(project.config())
    assert second["files_removed"] == 1 and second["files_sent"] == 0
    assert not (project.current() / "configs" / "tiny.yaml").exists()


def test_old_releases_beyond_keep_releases_are_removed(project):
    seen = []
    for i in range(4):
        (project.source / "helpers.py").write_text(f"def greeting():\n    return 'v{i}'\n")
        _, summary = detached(project.config())
        seen.append(summary["release"])
    kept = {p.name for p in (project.workdir / "releases").iterdir()}
    # keep_releases: 2, the current one included; each with its record beside it.
    assert kept == set(seen[-2:]) | {f"{r}.manifest.json" for r in seen[-2:]}


def test_dry_run_prints_the_plan_and_changes_nothing(project, capsys):
    _, first = detached(project.config())
    (project.source / "helpers.py").write_text("def greeting():\n    return 'planned'\n")
    log = project.run_dir(first["run_id"]) / "train.log"
    wait_for(lambda: "hello" in log.read_text(), what="the run's first line")  # then it is quiet
    before = snapshot(project.workdir)
    capsys.readouterr()
    code, summary = deploy(project.config(), DeployOptions(dry_run=True))
    assert capsys.readouterr().out == ""  # the logic prints nothing: the command draws it
    show_plan(summary)
    plan = one_node(summary)
    out = capsys.readouterr().out
    assert code == 0 and plan["dry_run"] is True
    assert snapshot(project.workdir) == before
    assert pid_alive(first["pid"])
    assert [f["path"] for f in plan["files_to_send"]] == ["helpers.py"]
    assert "+ helpers.py" in out
    assert f"pid {first['pid']} (run {first['run_id']}" in out
    assert "train.py --sleep 60 --on-term checkpoint" in out


def _no_host(monkeypatch):
    def no_host(config):
        raise AssertionError("the host was contacted")

    from dflashctl.remote import nodes as nodes_mod

    monkeypatch.setattr(connect_mod, "open_target", no_host)
    monkeypatch.setattr(nodes_mod, "open_transport", no_host)


def test_syntax_error_refuses_without_contacting_the_host(project, monkeypatch):
    (project.source / "broken.py").write_text("def f(:\n    pass\n")
    _no_host(monkeypatch)

    with pytest.raises(UsageError, match=r"broken\.py:1: "):
        deploy(project.config(), DeployOptions(detach=True))
    assert not project.workdir.exists()


def test_a_bad_crash_rule_refuses_without_contacting_the_host(project, monkeypatch):
    config = project.config()
    config.crash_patterns = [{"name": "mine", "category": "mine", "regex": "(", "hint": "h"}]
    _no_host(monkeypatch)

    expected = rf"^{re.escape(str(config.path))}: crash_patterns\[0\]\.regex: invalid regular"
    with pytest.raises(ConfigError, match=expected):
        deploy(config, DeployOptions(detach=True))
    with pytest.raises(ConfigError, match=expected):
        restart(config, detach=True)
    assert not project.workdir.exists()


def test_interrupted_upload_leaves_previous_release_and_run(project, monkeypatch):
    _, first = detached(project.config())
    (project.source / "helpers.py").write_text("def greeting():\n    return 'never arrives'\n")

    def interrupted(config, target, plan, archive, launch, progress=None):
        # What an interrupted build leaves behind: a half-filled partial release.
        partial = project.workdir / "releases" / f"{plan.new_release}.partial"
        partial.mkdir()
        (partial / "helpers.py").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(deploy_mod, "upload_and_deploy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        detached(project.config())
    assert os.readlink(project.workdir / "current") == f"releases/{first['release']}"
    assert pid_alive(first["pid"])
    monkeypatch.undo()

    _, second = detached(project.config())
    assert not list((project.workdir / "releases").glob("*.partial"))
    assert (project.current() / "helpers.py").read_text().endswith("'never arrives'\n")
    assert not pid_alive(first["pid"])


def test_cli_deploy_json_with_extra_trainer_args(project):
    result = subprocess.run(
        [
            *DFLASHCTL,
            "deploy",
            "-c",
            str(project.config_path),
            "--detach",
            "--json",
            "--",
            "--steps",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    summary = flat(json.loads(result.stdout))
    assert summary["command"][-2:] == ["--steps", "2"]
    assert "launched run" in result.stderr
    [run] = list_runs(target(project), str(project.workdir), python=sys.executable)
    assert run.id == summary["run_id"] and run.command[-2:] == ["--steps", "2"]


def test_cli_syntax_error_exits_2(project):
    (project.source / "broken.py").write_text("x = (\n")
    result = subprocess.run(
        [*DFLASHCTL, "deploy", "-c", str(project.config_path), "--detach"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "broken.py:1:" in result.stderr
    assert not project.workdir.exists()


def test_meta_records_the_git_commit_and_dirty_flag(project):
    git = ["git", "-C", str(project.source), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "trainer"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    _, clean = detached(project.config())
    (project.source / "helpers.py").write_text("def greeting():\n    return 'uncommitted'\n")
    _, dirty = detached(project.config())
    metas = [
        json.loads((project.run_dir(s["run_id"]) / "meta.json").read_text()) for s in (clean, dirty)
    ]
    assert [m["git_commit"] for m in metas] == [head.strip()] * 2
    assert [m["git_dirty"] for m in metas] == [False, True]


def test_a_missing_interpreter_is_a_host_error_naming_it(project):
    config = project.config(container__python="/nonexistent/python3")
    with pytest.raises(NodesFailed, match="^/nonexistent/python3: cannot run it") as info:
        detached(config)
    # A fleet of one says its node's own error: its words, hint and exit code.
    assert isinstance(info.value.cause, HostError) and info.value.exit_code == HostError.exit_code
    assert "container.python" in info.value.hint


def counting_transports(monkeypatch) -> list[list]:
    """Every transport the deploy's node sessions open, with the commands run on each."""
    from dflashctl.remote import nodes as nodes_mod

    opened: list[list] = []
    real = nodes_mod.open_transport

    def connect(host):
        transport, calls = real(host), []
        original = transport.run

        def run(argv, **kwargs):
            calls.append(argv)
            return original(argv, **kwargs)

        transport.run = run
        opened.append(calls)
        return transport

    monkeypatch.setattr(nodes_mod, "open_transport", connect)
    return opened


def test_a_redeploy_from_the_same_machine_is_one_round_trip(project, monkeypatch):
    opened = counting_transports(monkeypatch)
    deploy(project.config(), DeployOptions(detach=True))
    assert len(opened[0]) == 2  # inspect, then send + build + launch
    (project.source / "helpers.py").write_text("def greeting():\n    return 'one trip'\n")
    _, changed = detached(project.config())
    _, unchanged = detached(project.config())
    assert [len(calls) for calls in opened[1:]] == [1, 1]
    assert changed["files_sent"] == 1 and unchanged["files_sent"] == 0


def test_a_deploy_from_elsewhere_in_between_is_noticed(project, monkeypatch, tmp_path):
    _, mine = detached(project.config())
    # A colleague deploys another version from their machine (their own cache)...
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "colleague-cache"))
    (project.source / "helpers.py").write_text("def greeting():\n    return 'colleague'\n")
    _, theirs = detached(project.config())
    # ...and we deploy our version again: the stale plan is noticed, nothing is lost.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (project.source / "helpers.py").write_text(
        "def greeting():\n    return 'hello from the trainer'\n"
    )
    _, again = detached(project.config())
    assert again["previous_release"] == theirs["release"]
    assert again["files_sent"] == 1
    assert (project.current() / "helpers.py").read_bytes() == (
        project.source / "helpers.py"
    ).read_bytes()
    assert not list((project.workdir / "releases").glob("*.partial"))
    assert mine["release"] != again["release"]


def test_readers_never_see_a_missing_or_half_written_current(project):
    """`current` is swapped by renaming a new symlink over it: a reader in a loop during
    several deploys always finds a complete tree."""
    detached(project.config())
    problems: list[str] = []
    done = threading.Event()

    def read_current() -> None:
        while not done.is_set():
            try:
                manifest = release_manifest((project.workdir / "current").resolve())
                for rel in manifest:
                    (project.workdir / "current" / rel).stat()
            except (OSError, ValueError) as exc:
                problems.append(repr(exc))

    reader = threading.Thread(target=read_current, name="current-reader")
    reader.start()
    try:
        for i in range(4):
            (project.source / "helpers.py").write_text(f"def greeting():\n    return '{i}'\n")
            detached(project.config())
    finally:
        done.set()
        reader.join()
    assert problems == []


def test_the_run_gets_trainer_env_and_its_run_variables(project):
    config = project.config(trainer__env={"TRAINER_FLAVOUR": "tiny", "OMP_NUM_THREADS": "2"})
    _, summary = detached(config)
    environ = Path(f"/proc/{summary['pid']}/environ").read_bytes().split(b"\0")
    run_dir = project.run_dir(summary["run_id"])
    for item in (
        "TRAINER_FLAVOUR=tiny",
        "OMP_NUM_THREADS=2",
        f"DFLASH_RUN_ID={summary['run_id']}",
        f"DFLASH_RUN_DIR={run_dir}",
        "PYTHONUNBUFFERED=1",
    ):
        assert item.encode() in environ
    # stdin is /dev/null, stdout and stderr go to train.log.
    assert os.readlink(f"/proc/{summary['pid']}/fd/0") == "/dev/null"
    assert os.readlink(f"/proc/{summary['pid']}/fd/1") == str(run_dir / "train.log")
    assert os.readlink(f"/proc/{summary['pid']}/fd/2") == str(run_dir / "train.log")


def test_run_on_exit_runs_once_the_run_has_ended(project):
    hook = 'echo "$DFLASH_RUN_ID $DFLASH_EXIT_CODE $DFLASH_RUN_DIR" > "$DFLASH_RUN_DIR/notified"; echo notified'
    config = project.config(trainer__args=["--exit", "3"], run__on_exit=hook)
    _, summary = detached(config)
    run_dir = project.run_dir(summary["run_id"])
    wait_for(lambda: (run_dir / "notified").exists(), what="the on_exit hook")
    assert (run_dir / "notified").read_text() == f"{summary['run_id']} 3 {run_dir}\n"
    assert (run_dir / "exit_code").read_text() == "3\n"
    wait_for(lambda: "notified" in (run_dir / "train.log").read_text(), what="the hook's output")
    assert (run_dir / "train.log").read_text().rstrip().endswith("notified")


def test_a_failing_on_exit_hook_leaves_the_runs_status_alone(project):
    config = project.config(trainer__args=[], run__on_exit="echo about to fail; exit 5")
    _, summary = detached(config)
    log = project.run_dir(summary["run_id"]) / "train.log"
    wait_for(lambda: "run.on_exit failed" in log.read_text(), what="the hook to fail")
    assert "dflashctl: run.on_exit failed with exit status 5" in log.read_text()
    assert (project.run_dir(summary["run_id"]) / "exit_code").read_text() == "0\n"
    state = run_state(target(project), str(project.workdir), summary["run_id"])
    assert state.finished and state.ok
