# ruff: noqa: F811  (fixtures are imported, and then asked for by name)
"""setup: the trainer's requirements installed into a venv in a real test container
(no PyPI there: a wheel folder built here, --no-index), once per content, streamed,
a failure naming the package and stopping nothing, and doctor checking it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.json_answers import flat
from tests.setup_support import IMPORTING_TRAINER, build_wheel

pytestmark = pytest.mark.slow

WORKDIR = "/root/dflash"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]
PIP_ARGS = ["--no-index", "--find-links", "wheels"]


def cli(path: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args, "-c", str(path)], capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def project(tmp_path, container, write_config, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text(IMPORTING_TRAINER)
    build_wheel(source / "wheels", "hello-pkg", "1.0", "VALUE = 'one'\n")
    (source / "requirements.txt").write_text("# the trainer's needs\nhello-pkg==1.0\n")
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "trainer.entry": "train.py",
            "trainer.args": [],
            "run.stop_grace_s": 3,
            "run.keep_releases": 2,
            "setup.pip_args": PIP_ARGS,
        },
    )
    return path, source, container


def deploy(path: Path, *extra: str) -> subprocess.CompletedProcess:
    return cli(path, "deploy", "--detach", *extra)


def run_log(container, run_id: str, want: str) -> str:
    log = container.host_path(f"{WORKDIR}/runs/{run_id}/train.log")
    deadline = time.monotonic() + 60
    while want not in log.read_text():
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    return log.read_text()


def runs_json(path: Path) -> dict:
    done = cli(path, "runs", "--json")
    assert done.returncode == 0, done.stderr
    return flat(json.loads(done.stdout))


def deployed(path: Path, done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return (done.stdout + done.stderr).split("launched run ", 1)[1].split()[0]


def test_setup_installs_into_a_venv_once_and_the_trainer_runs_from_it(project):
    path, source, container = project
    first = deploy(path)
    run_id = deployed(path, first)
    # pip's own output, streamed before the launch
    assert "setup |" in first.stdout and "Successfully installed hello-pkg-1.0" in first.stdout
    log = run_log(container, run_id, "hello one")
    prefix = log.split("prefix ", 1)[1].split()[0]
    assert prefix.startswith(f"{WORKDIR}/venvs/")
    assert f"path {prefix}/bin:" in log
    meta = json.loads(container.host_path(f"{WORKDIR}/runs/{run_id}/meta.json").read_text())
    assert meta["command"][0] == f"{prefix}/bin/python" and meta["venv"] == prefix

    # The trainer changed, its requirements did not: no pip at all, the same venv.
    (source / "train.py").write_text(IMPORTING_TRAINER + "\n# v2\n")
    second = deploy(path)
    run2 = deployed(path, second)
    assert "setup |" not in second.stdout
    assert f"prefix {prefix}" in run_log(container, run2, "hello one")

    # Forgotten here (another machine): the check streams, and finds it up to date.
    shutil.rmtree(Path(path).parent / "cache" / "dflashctl" / "setups")
    (source / "train.py").write_text(IMPORTING_TRAINER + "\n# v3\n")
    third = deploy(path)
    run3 = deployed(path, third)
    assert "up to date" in third.stderr + third.stdout
    assert "Successfully installed" not in third.stdout
    assert f"prefix {prefix}" in run_log(container, run3, "hello one")

    # New requirements: a new venv (a new hash), the trainer sees the new version.
    build_wheel(source / "wheels", "hello-pkg", "2.0", "VALUE = 'two'\n")
    (source / "requirements.txt").write_text("hello-pkg==2.0\n")
    fourth = deploy(path)
    run4 = deployed(path, fourth)
    log4 = run_log(container, run4, "hello two")
    assert log4.split("prefix ", 1)[1].split()[0] != prefix

    # doctor checks the venv of the current release: it imports hello_pkg.
    doctor = cli(path, "doctor", "--json")
    checks = {c["name"]: c for c in flat(json.loads(doctor.stdout))["checks"]}
    assert checks["setup venv"]["status"] == "pass", checks["setup venv"]
    assert "hello-pkg" in checks["setup venv"]["detail"]


def test_a_failing_setup_names_the_package_and_stops_nothing(project):
    path, source, container = project
    run_id = deployed(path, deploy(path))
    run_log(container, run_id, "hello one")
    releases_before = sorted(p.name for p in container.host_path(f"{WORKDIR}/releases").iterdir())
    current = container.host_path(f"{WORKDIR}/current").readlink()

    (source / "requirements.txt").write_text("hello-pkg==1.0\nno-such-package-xyz==3.1\n")
    failed = deploy(path)
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "no-such-package-xyz" in failed.stderr
    assert "nothing was stopped" in failed.stderr
    assert "No matching distribution found for no-such-package-xyz" in failed.stdout  # streamed
    # the old run runs on, from the old release; the unused new release is gone
    assert container.host_path(f"{WORKDIR}/active_run").read_text().strip() == run_id
    state = runs_json(path)
    assert next(r for r in state["runs"] if r["id"] == run_id)["status"] == "running"
    assert container.host_path(f"{WORKDIR}/current").readlink() == current
    after = sorted(p.name for p in container.host_path(f"{WORKDIR}/releases").iterdir())
    assert after == releases_before
    # no half-made venv left behind
    venvs = container.host_path(f"{WORKDIR}/venvs")
    made = [p for p in venvs.iterdir() if p.is_dir()]
    assert all((p / ".dflash-setup.json").is_file() for p in made)

    with_json = cli(path, "deploy", "--detach", "--json")
    assert with_json.returncode == 3
    assert (
        "no-such-package-xyz"
        in flat(json.loads(with_json.stdout.strip().splitlines()[-1]))["error"]
    )


def test_doctor_fails_when_the_venv_lost_a_package(project):
    path, _, container = project
    run_id = deployed(path, deploy(path))
    run_log(container, run_id, "hello one")
    venv = json.loads(container.host_path(f"{WORKDIR}/runs/{run_id}/meta.json").read_text())["venv"]
    found = container.exec(["sh", "-c", f"rm -rf {venv}/lib/python*/site-packages/hello_pkg"])
    assert found.returncode == 0
    doctor = cli(path, "doctor", "--json")
    assert doctor.returncode == 3
    checks = {c["name"]: c for c in flat(json.loads(doctor.stdout))["checks"]}
    assert checks["setup venv"]["status"] == "fail"
    assert "hello-pkg" in checks["setup venv"]["detail"]


def test_setup_commands_run_in_the_venv_and_old_venvs_are_pruned(project):
    path, source, container = project
    (source / "requirements.txt").unlink()
    keys = []
    for n in range(4):
        # each deploy a different setup: a different venv, older ones pruned with releases
        data = yaml.safe_load(path.read_text())
        data["setup"]["commands"] = [f'echo made {n} > "$VIRTUAL_ENV/made.txt"']
        path.write_text(yaml.safe_dump(data))
        (source / "train.py").write_text(
            "import os, sys, time\nprint('venv', os.environ.get('VIRTUAL_ENV'), flush=True)\n"
            "time.sleep(60)\n"
        )
        done = deploy(path)
        run_id = deployed(path, done)
        log = run_log(container, run_id, "venv ")
        venv = log.split("venv ", 1)[1].split()[0]
        assert container.host_path(f"{venv}/made.txt").read_text() == f"made {n}\n"
        keys.append(venv)
    assert len(set(keys)) == 4
    left = sorted(p.name for p in container.host_path(f"{WORKDIR}/venvs").iterdir() if p.is_dir())
    assert len(left) <= 2 and Path(keys[-1]).name in left


def test_a_requirements_file_left_out_of_the_release_is_an_error(project):
    path, _, container = project
    plan = cli(path, "deploy", "--dry-run")
    assert plan.returncode == 0 and "setup (in a venv, once per content)" in plan.stdout
    data = yaml.safe_load(path.read_text())
    data["trainer"]["exclude"] = ["requirements.txt"]
    path.write_text(yaml.safe_dump(data))
    done = deploy(path)
    assert done.returncode == 3
    assert "setup.requirements requirements.txt is not in the deployed release" in done.stderr
    assert not container.host_path(f"{WORKDIR}/active_run").exists()


# Says which interpreter's packages it sees: where_from lives only in the second venv.
WHICH_PYTHON_TRAINER = """\
import signal, sys, time
import hello_pkg
try:
    import where_from
    origin = where_from.VALUE
except ImportError:
    origin = "none"
print("hello", hello_pkg.VALUE, "from", origin, "prefix", sys.prefix, flush=True)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
time.sleep(60)
"""


def test_pointing_container_python_at_another_venv_makes_its_own_setup_venv(project):
    path, source, container = project
    (source / "train.py").write_text(WHICH_PYTHON_TRAINER)
    run1 = deployed(path, deploy(path))
    log1 = run_log(container, run1, "hello one")
    assert "from none" in log1
    prefix1 = log1.split("prefix ", 1)[1].split()[0]

    # A second venv of the same base Python, with a package of its own.
    made = container.exec(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", "/root/venv2"]
    )
    assert made.returncode == 0, made.stderr
    site = container.exec(
        ["/root/venv2/bin/python", "-c", "import site; print(site.getsitepackages()[0])"]
    )
    assert site.returncode == 0, site.stderr
    container.host_path(f"{site.stdout.strip()}/where_from.py").write_text("VALUE = 'venv2'\n")
    data = yaml.safe_load(path.read_text())
    data["container"]["python"] = "/root/venv2/bin/python"
    path.write_text(yaml.safe_dump(data))

    second = deploy(path)
    run2 = deployed(path, second)
    log2 = run_log(container, run2, "hello one")
    assert "from venv2" in log2  # the run sees the new interpreter's packages
    prefix2 = log2.split("prefix ", 1)[1].split()[0]
    assert prefix2 != prefix1 and prefix2.startswith(f"{WORKDIR}/venvs/")
    # The launch line and meta.json name the interpreter that runs, and what it came from.
    assert f"{prefix2}/bin/python train.py" in second.stdout + second.stderr
    meta = json.loads(container.host_path(f"{WORKDIR}/runs/{run2}/meta.json").read_text())
    assert meta["command"][0] == f"{prefix2}/bin/python"
    assert meta["venv_made_from"] == "/root/venv2/bin/python"


def test_setup_without_dns_says_the_index_was_not_reached(
    tmp_path, make_container, container_network, write_config, monkeypatch
):
    """A container on a network of its own, with no DNS server: pip cannot resolve the
    index's name. The error says so, instead of blaming the package's name."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    container = make_container(200, network=container_network[0])
    source = tmp_path / "src"
    source.mkdir()
    (source / "train.py").write_text("import time\ntime.sleep(60)\n")
    (source / "requirements.txt").write_text("tabulate>=0.9\n")
    pip_args = ["--isolated", "--index-url", "https://pypi.dflash-test.example/simple"]
    path = write_config(
        tmp_path,
        trainer_source=source,
        **{
            "trainer.entry": "train.py",
            "trainer.args": [],
            "setup.pip_args": [*pip_args, "--retries", "1", "--timeout", "5"],
        },
    )
    failed = deploy(path)
    assert failed.returncode == 3, failed.stdout + failed.stderr
    assert "pip could not reach the package index" in failed.stderr, failed.stdout
    assert "name resolution failed for pypi.dflash-test.example" in failed.stderr
    assert "while looking for tabulate>=0.9" in failed.stderr
    assert "found no distribution" not in failed.stderr
    assert not container.host_path(f"{WORKDIR}/active_run").exists()
