"""The agent as it travels: it parses for the oldest Python it promises (3.6), imports
only the standard library, runs from its cached copy, and a poll sends little."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from dflashctl.agent import trainer_check
from dflashctl.remote import agent_client

OLDEST = (3, 6)


def _programs() -> dict[str, str]:
    programs = {f"dflashctl/agent/{n}.py": s for n, s in agent_client.agent_modules().items()}
    programs["the bundle"] = agent_client.bundle_source()
    programs["the bootstrap"] = agent_client.bootstrap("runs", {"workdir": "/w"}, with_bundle=True)
    programs["the loader, preloading"] = agent_client.agent_argv("python3", "deploy", preload=True)[
        3
    ]
    # Run in the trainer's interpreter, which may be as old.
    programs["the config check's runner"] = trainer_check.RUNNER
    return programs


def test_the_package_has_every_module_the_verbs_need():
    names = set(agent_client.agent_modules())
    assert {"__init__", "main", "verbs", "files", "manifest", "releases", "runs"} <= names
    assert {"processes", "stopping", "logreader", "errors"} <= names


@pytest.mark.parametrize("name", sorted(_programs()))
def test_parses_for_the_oldest_python_it_promises(name):
    source = _programs()[name]
    tree = ast.parse(source, filename=name, feature_version=OLDEST)
    # feature_version does not reject everything newer: these would fail on 3.6.
    for node in ast.walk(tree):
        assert not isinstance(node, ast.NamedExpr), f"{name}: walrus at line {node.lineno}"
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            assert all(a.name != "annotations" for a in node.names), name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            assert not args.posonlyargs, f"{name}: positional-only parameters in {node.name}"
            annotated = [a for a in args.args + args.kwonlyargs if a.annotation is not None]
            assert not annotated and node.returns is None, f"{name}: annotations in {node.name}"
        if isinstance(node, ast.AnnAssign):
            pytest.fail(f"{name}: a variable annotation at line {node.lineno}")


@pytest.mark.parametrize("name", sorted(_programs()))
def test_imports_only_the_standard_library(name):
    tree = ast.parse(_programs()[name])
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            imported.add(node.module.split(".")[0])
    # Modules added to the standard library after 3.6 would not be there either.
    assert imported <= set(sys.stdlib_module_names), imported - set(sys.stdlib_module_names)
    assert not imported & {"dataclasses", "contextvars", "graphlib", "zoneinfo", "tomllib"}


def test_the_bundle_is_the_same_program_every_time():
    text = agent_client.bundle_source()
    agent_client.bundle_source.cache_clear()
    agent_client.bundle_hash.cache_clear()
    assert agent_client.bundle_source() == text
    assert agent_client.bootstrap("runs", {}, with_bundle=False) == agent_client.bootstrap(
        "runs", {}, with_bundle=False
    )


def _call(op, params, *, with_bundle, env):
    done = subprocess.run(
        agent_client.agent_argv(sys.executable, op),
        input=agent_client.agent_input(op, params, with_bundle=with_bundle),
        capture_output=True,
        env=env,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout.decode().strip().splitlines()[-1])


def test_runs_from_the_copy_it_keeps_and_only_a_copy_with_its_hash(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    workdir = str(tmp_path / "work")
    params = {"workdir": workdir}

    status, answer = _call("runs", params, with_bundle=False, env=env)
    assert status == 3 and answer["agent_missing"] is True and not answer["ok"]
    assert not os.path.exists(workdir)  # it did nothing

    status, answer = _call("runs", params, with_bundle=True, env=env)
    assert (status, answer["ok"], answer["runs"]) == (0, True, [])
    cached = (
        tmp_path / "tmp" / f"dflashctl-agent-{os.getuid()}" / f"{agent_client.bundle_hash()}.py"
    )
    assert cached.read_text(encoding="utf-8") == agent_client.bundle_source()

    status, answer = _call("runs", params, with_bundle=False, env=env)
    assert (status, answer["ok"]) == (0, True)

    # A copy whose content does not have its hash is never run.
    cached.write_text("raise SystemExit(42)\n", encoding="utf-8")
    status, answer = _call("runs", params, with_bundle=False, env=env)
    assert status == 3 and answer["agent_missing"] is True
    status, answer = _call("runs", params, with_bundle=True, env=env)
    assert (status, answer["ok"]) == (0, True)
    assert cached.read_text(encoding="utf-8") == agent_client.bundle_source()


def test_a_poll_sends_a_small_bootstrap_not_the_agent():
    params = {"workdir": "/srv/dflash", "run_id": "20261130-180000-abcd"}
    poll = agent_client.agent_input("runs", params, with_bundle=False)
    full = agent_client.agent_input("runs", params)
    assert len(poll) < 1500 < 10 * len(poll) < len(full)
    argv = agent_client.log_reader_argv("python3", "/srv/dflash", "r1", 0, -1, once=False)
    assert sum(len(a) for a in argv) < 1500


def _started_ahead(stdin: bytes, env, workdir: str) -> subprocess.CompletedProcess:
    argv = agent_client.agent_argv(sys.executable, "runs", preload=True)
    return subprocess.run(argv, input=stdin, capture_output=True, env=env, timeout=60)


def test_an_agent_started_ahead_that_gets_no_program_does_nothing(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    workdir = str(tmp_path / "work")
    _call("runs", {"workdir": workdir}, with_bundle=True, env=env)  # keeps the bundle
    shutil.rmtree(workdir, ignore_errors=True)
    # Its stdin closed before any program came (the deploy planned nothing to send, or
    # was stopped): no answer, no error, nothing made.
    done = _started_ahead(b"", env, workdir)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert not os.path.exists(workdir)
    # A program cut short is not run either.
    program = agent_client.agent_input("runs", {"workdir": workdir})
    done = _started_ahead(program[:-10], env, workdir)
    assert (done.returncode, done.stdout) == (0, b"")
    assert not os.path.exists(workdir)


def test_an_agent_started_ahead_runs_its_program_with_the_kept_modules(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    params = {"workdir": str(tmp_path / "work")}
    for kept in (False, True):  # no copy kept yet: the program brings the bundle
        program = agent_client.agent_input("runs", params, with_bundle=not kept)
        done = _started_ahead(program, env, params["workdir"])
        answer = json.loads(done.stdout.decode().strip().splitlines()[-1])
        assert (done.returncode, answer["ok"], answer["runs"]) == (0, True, []), done.stderr
    folder = tmp_path / "tmp" / f"dflashctl-agent-{os.getuid()}"
    # The compiled modules are kept beside the bundle, for the interpreter that made them.
    assert (folder / f"{agent_client.bundle_hash()}.{sys.implementation.cache_tag}.code").is_file()


def test_a_damaged_code_cache_is_compiled_afresh(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    params = {"workdir": str(tmp_path / "work")}
    _call("runs", params, with_bundle=True, env=env)
    folder = tmp_path / "tmp" / f"dflashctl-agent-{os.getuid()}"
    code = folder / f"{agent_client.bundle_hash()}.{sys.implementation.cache_tag}.code"
    assert code.is_file()
    code.write_bytes(b"not marshal data")
    status, answer = _call("runs", params, with_bundle=False, env=env)
    assert (status, answer["ok"]) == (0, True)
    assert code.read_bytes() != b"not marshal data"  # written again


def test_a_deploys_agent_started_ahead_starts_the_trainer_config_check_too(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    workdir = tmp_path / "work"
    workdir.mkdir()
    _call("runs", {"workdir": str(workdir)}, with_bundle=True, env=env)  # keeps the bundle
    # The last check of this workdir: its interpreter, its environment, what it imported.
    modules = tmp_path / "modules"
    modules.mkdir()
    marker = tmp_path / "imported"
    (modules / "marks_import.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    spec = {"python": sys.executable, "env": {"PYTHONPATH": str(modules)}}
    (workdir / trainer_check.SPEC_FILE).write_text(json.dumps(spec))
    (workdir / trainer_check.MODULES_FILE).write_text(json.dumps(["marks_import"]))
    argv = agent_client.agent_argv(sys.executable, "deploy", preload=True, check_in=str(workdir))
    # No program comes (the deploy stopped before its upload): the agent does nothing,
    # and the check's interpreter it started, with that environment, imported ahead
    # and then ends untold.
    done = subprocess.run(argv, input=b"", capture_output=True, env=env, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    deadline = time.monotonic() + 60
    while not marker.exists():
        assert time.monotonic() < deadline, "the check's interpreter did not start"
        time.sleep(0.1)
