"""dflashctl doctor against the test host: a line per check, a fix per failure, exit codes."""

from __future__ import annotations

import json
import shutil
import socket
import sys

import pytest

from dflashctl import cli
from tests.json_answers import flat


def dflashctl(capsys, monkeypatch, *args: str) -> tuple[int, str, str]:
    """Run the CLI in this process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["dflashctl", *args])
    code = 0
    try:
        cli.main()
    except SystemExit as exc:
        code = exc.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def doctor_json(capsys, monkeypatch, config_path) -> tuple[int, dict[str, dict]]:
    code, out, _ = dflashctl(capsys, monkeypatch, "doctor", "--json", "-c", str(config_path))
    answer = flat(json.loads(out))
    assert answer["exit_code"] == code
    return code, {check["name"]: check for check in answer["checks"]}


def statuses(checks: dict[str, dict]) -> dict[str, str]:
    return {name: check["status"] for name, check in checks.items()}


def test_a_healthy_container_passes_everything(
    capsys, monkeypatch, write_config, tmp_path, container, pve_host
):
    code, out, err = dflashctl(capsys, monkeypatch, "doctor", "-c", str(write_config(tmp_path)))
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("✓ config valid")
    assert f"✓ SSH reachable        127.0.0.1 port {pve_host.port} answers (OpenSSH_" in out
    assert "✓ host key known       ssh-ed25519 SHA256:" in out
    assert "✓ container runs       container 200 (ct200) is running, up " in out
    assert "✓ torch                torch " in out
    assert "! GPUs                 nvidia-smi is not installed there" in out
    assert (
        "✓ free disk" in out and "free for /root/dflash (on /" in out
    )  # busybox df names the rootfs
    assert "all checks passed" in err


def test_invalid_config_is_exit_2_and_everything_else_skipped(capsys, monkeypatch, tmp_path):
    bad = tmp_path / "dflash.yaml"
    bad.write_text("host:\n  address: pve.lan\n  prot: 22\n")
    code, checks = doctor_json(capsys, monkeypatch, bad)
    assert code == 2
    assert checks["config valid"]["status"] == "fail"
    assert "unknown key host.prot (did you mean host.port?)" in checks["config valid"]["detail"]
    assert set(statuses(checks).values()) == {"fail", "skip"}
    assert checks["SSH reachable"]["detail"] == "skipped: needs a valid config"


def test_unknown_host_key_fails_its_own_check_with_the_fix(
    capsys, monkeypatch, write_config, tmp_path, pve_host
):
    empty = pve_host.empty_known_hosts(tmp_path)
    path = write_config(tmp_path, **{"host.known_hosts": str(empty)})
    code, checks = doctor_json(capsys, monkeypatch, path)
    assert code == 3
    assert statuses(checks)["SSH reachable"] == "pass"
    key = checks["host key known"]
    assert key["status"] == "fail"
    assert key["detail"].startswith(f"the host key of [127.0.0.1]:{pve_host.port} (ssh-ed25519 ")
    assert "host.accept_new_host_key: true" in key["fix"]
    assert statuses(checks)["SSH login"] == "skip"
    assert statuses(checks)["free disk"] == "skip"


def test_refused_port_fails_ssh_reachable(capsys, monkeypatch, write_config, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, checks = doctor_json(capsys, monkeypatch, write_config(tmp_path, **{"host.port": port}))
    assert code == 3
    assert checks["SSH reachable"]["detail"] == f"127.0.0.1 port {port} refused the connection"
    assert checks["SSH reachable"]["fix"]
    assert statuses(checks)["host key known"] == "skip"


@pytest.mark.parametrize(
    "vmid, running, expected",
    [
        (200, False, "container 200 (ct200) is stopped"),
        (4242, None, "container 4242 does not exist on node pve"),
    ],
)
def test_container_problems_fail_and_skip_the_container_checks(
    capsys, monkeypatch, write_config, tmp_path, make_container, vmid, running, expected
):
    if running is not None:
        make_container(vmid, running=running)
    code, checks = doctor_json(capsys, monkeypatch, write_config(tmp_path, vmid=vmid))
    assert code == 3
    assert statuses(checks)["Proxmox API answers"] == "pass"
    assert checks["container runs"]["status"] == "fail"
    assert checks["container runs"]["detail"] == expected
    assert {statuses(checks)[n] for n in ("python", "torch", "GPUs", "free disk")} == {"skip"}


def test_missing_python_fails_but_gpu_and_disk_are_still_checked(
    capsys, monkeypatch, write_config, tmp_path, container
):
    path = write_config(tmp_path, **{"container.python": "/opt/nowhere/python3"})
    code, checks = doctor_json(capsys, monkeypatch, path)
    assert code == 3
    assert checks["python"]["status"] == "fail"
    assert checks["python"]["detail"].startswith("/opt/nowhere/python3 does not run in CT 200 on ")
    assert "container.python" in checks["python"]["fix"]
    assert statuses(checks)["torch"] == "skip"
    assert statuses(checks)["GPUs"] == "warn"
    assert statuses(checks)["free disk"] == "pass"


def test_without_a_container_there_is_no_proxmox_and_the_host_is_checked(
    capsys, monkeypatch, write_config, tmp_path, pve_host
):
    path = write_config(tmp_path, vmid=None, **{"container.workdir": str(tmp_path / "wd" / "x")})
    code, checks = doctor_json(capsys, monkeypatch, path)
    assert code == 0, checks
    assert checks["Proxmox API answers"]["status"] == "skip"
    assert checks["container runs"]["status"] == "skip"
    assert checks["python"]["status"] == "pass"
    assert f"free for {tmp_path}/wd/x" in checks["free disk"]["detail"]


def test_a_local_host_without_ssh(capsys, monkeypatch, tmp_path):
    from tests.test_deploy_support import write_trainer

    write_trainer(tmp_path / "trainer")  # deploy's local checks are doctor's too
    config = tmp_path / "dflash.yaml"
    config.write_text(
        f"host: {{address: local}}\n"
        f"container: {{vmid: null, workdir: {tmp_path}/work, python: {sys.executable}}}\n"
        "trainer: {entry: train.py}\n"
    )
    code, checks = doctor_json(capsys, monkeypatch, config)
    assert code == 0, checks
    assert checks["SSH reachable"]["detail"] == "host.address is local: no SSH needed"
    assert statuses(checks)["host key known"] == "skip"
    assert statuses(checks)["python"] == "pass"
    assert statuses(checks)["torch"] == "pass"


def test_a_nearly_full_disk_fails_and_points_at_pruning_old_runs(
    capsys, monkeypatch, write_config, tmp_path, pve_host
):
    from dflashctl.ops import doctor_checks as doctor

    monkeypatch.setattr(doctor, "MIN_FREE_BYTES", 1 << 60)  # no disk has an exbibyte free
    path = write_config(tmp_path, vmid=None, **{"container.workdir": str(tmp_path / "wd")})
    code, checks = doctor_json(capsys, monkeypatch, path)
    assert code == 3
    assert checks["free disk"]["status"] == "fail"
    assert checks["free disk"]["detail"].startswith("only ")
    assert f"`dflashctl runs --prune 5 -c {path}`" in checks["free disk"]["fix"]


def test_doctor_runs_deploys_local_checks_and_reports_every_syntax_error(tmp_path):
    """ "all checks passed" means a deploy will start: doctor fails (exit 2) on what
    deploy refuses before contacting anything, and names every broken file at once."""
    from dflashctl.commands.doctor import run_checks
    from tests.test_deploy_support import write_local_config, write_trainer

    project = tmp_path / "p"
    write_trainer(project / "src")
    (project / "src" / "broken_a.py").write_text("def f(:\n")
    (project / "src" / "broken_b.py").write_text("x = = 1\n")
    config = write_local_config(project)
    doctor = run_checks(str(config), lambda check: None)
    [source] = [c for c in doctor.checks if c.name == "trainer source"]
    assert source.status == "fail" and source.config_problem
    assert "2 files do not compile" in source.detail
    assert "broken_a.py:1" in source.detail and "broken_b.py:1" in source.detail
    assert doctor.exit_code == 2

    (project / "src" / "broken_a.py").unlink()
    (project / "src" / "broken_b.py").unlink()
    (project / "src" / "train.py").unlink()
    doctor = run_checks(str(config), lambda check: None)
    [source] = [c for c in doctor.checks if c.name == "trainer source"]
    assert source.status == "fail" and "trainer.entry train.py is not in" in source.detail

    shutil.rmtree(project / "src")
    doctor = run_checks(str(config), lambda check: None)
    [source] = [c for c in doctor.checks if c.name == "trainer source"]
    assert source.status == "fail" and doctor.exit_code == 2


def test_a_python_with_torch_but_not_the_trainers_packages_is_a_warning_with_the_fix(
    capsys, monkeypatch, tmp_path
):
    """torch imports, but transformers, safetensors, pyyaml and pydantic are missing: the
    bundled trainer would fail at start, so doctor says which and the pip command."""
    fake = tmp_path / "fake-site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "__version__ = '2.11.0'\nclass cuda:\n    is_available = staticmethod(lambda: False)\n"
    )
    python = tmp_path / "python-without-trainer-packages"
    # -S: no site-packages, so only the fake torch above can be imported.
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake.parent} exec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    config = tmp_path / "dflash.yaml"
    config.write_text(
        "host: {address: local}\n"
        f"container: {{vmid: null, workdir: {tmp_path / 'work'}, python: {python}}}\n"
    )
    _, checks = doctor_json(capsys, monkeypatch, config)
    torch = checks["torch"]
    assert torch["status"] == "warn", torch
    assert "torch 2.11.0, no CUDA (CPU only)" in torch["detail"]
    assert (
        "the bundled trainer also needs transformers, safetensors, yaml, pydantic"
        in (torch["detail"])
    )
    assert (
        f"`{python} -m pip install transformers safetensors pyyaml pydantic` there"
        in (torch["detail"])
    )
