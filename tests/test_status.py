"""dflashctl status against the test host: container state, uptime and the active run."""

from __future__ import annotations

import json
import socket

from tests.json_answers import flat
from tests.test_doctor import dflashctl


def status_json(capsys, monkeypatch, config_path) -> tuple[int, dict]:
    code, out, err = dflashctl(capsys, monkeypatch, "status", "--json", "-c", str(config_path))
    assert code == 0, err
    return code, flat(json.loads(out))


def write_run(container, run_id: str, *, exit_code: int | None, pid: int | None = None) -> None:
    """A run as the launcher leaves it in workdir/runs/<id>/ (files seen from the host)."""
    run_dir = container.host_path(f"/root/dflash/runs/{run_id}")
    run_dir.mkdir(parents=True)
    if pid is not None:
        (run_dir / "pid").write_text(f"{pid}\n")
    if exit_code is not None:
        (run_dir / "exit_code").write_text(f"{exit_code}\n")
    meta = {
        "run_id": run_id,
        "release": "20261129-100000-beef",
        "pid": pid,
        "started": "2026-11-29T10:15:02Z",
        "command": ["python3", "train.py"],
    }
    (run_dir / "meta.json").write_text(json.dumps(meta))
    container.host_path("/root/dflash/active_run").write_text(run_id + "\n")


def test_running_container_without_runs(
    capsys, monkeypatch, write_config, tmp_path, container, pve_host
):
    path = write_config(tmp_path)
    _, report = status_json(capsys, monkeypatch, path)
    assert report["target"] == f"CT 200 on root@127.0.0.1:{pve_host.port}"
    assert report["container"]["status"] == "running"
    assert report["container"]["name"] == "ct200"
    assert report["container"]["uptime_s"] >= 0
    assert report["active_run"] is None
    code, out, _ = dflashctl(capsys, monkeypatch, "status", "-c", str(path))
    assert code == 0
    assert out.splitlines()[0].startswith("container  200 (ct200) on node pve: running, up ")
    assert out.splitlines()[1] == "run        none launched yet in /root/dflash"


def test_the_active_run_and_its_real_state(capsys, monkeypatch, write_config, tmp_path, container):
    path = write_config(tmp_path)
    write_run(container, "20261129-101502-a1b2", exit_code=137)
    _, report = status_json(capsys, monkeypatch, path)
    run = report["active_run"]
    assert (run["id"], run["status"], run["signal"]) == ("20261129-101502-a1b2", "killed", 9)
    assert run["release"] == "20261129-100000-beef"
    code, out, _ = dflashctl(capsys, monkeypatch, "status", "-c", str(path))
    assert (
        "run        20261129-101502-a1b2: crashed (killed by SIGKILL), started 2026-11-29T10:15:02Z"
        in out
    )

    # A live process that names the run: the state comes from the process table.
    run_id = "20261129-111111-c3d4"
    from dflashctl.config.schema import load_config
    from dflashctl.remote.deploy_target import Target
    from dflashctl.remote.transport import open_transport

    config = load_config(path)
    with open_transport(config.host) as transport:
        started = Target(transport, 200).run(
            [
                "sh",
                "-c",
                f"setsid sh -c 'sleep 60; : {run_id}' </dev/null >/dev/null 2>&1 & echo $!",
            ]
        )
    write_run(container, run_id, exit_code=None, pid=int(started.stdout_text))
    _, report = status_json(capsys, monkeypatch, path)
    assert report["active_run"]["status"] == "running"
    assert report["active_run"]["pid"] == int(started.stdout_text)


def test_stopped_container_is_reported_not_an_error(
    capsys, monkeypatch, write_config, tmp_path, make_container
):
    make_container(200, running=False)
    path = write_config(tmp_path)
    _, report = status_json(capsys, monkeypatch, path)
    assert report["container"] == {"vmid": 200, "status": "stopped", "uptime_s": 0, "name": "ct200"}
    assert report["active_run"] is None
    code, out, _ = dflashctl(capsys, monkeypatch, "status", "-c", str(path))
    assert code == 0
    assert "container  200 (ct200) on node pve: stopped" in out
    assert "run        unknown while the container is stopped" in out


def test_missing_vmid_is_exit_3_with_one_sentence(
    capsys, monkeypatch, write_config, tmp_path, pve_host
):
    code, out, err = dflashctl(
        capsys, monkeypatch, "status", "-c", str(write_config(tmp_path, vmid=4242))
    )
    assert code == 3
    assert out == ""
    assert "error: container 4242 does not exist on node pve" in err
    assert "pct list" in err


def test_unreachable_host_is_exit_3(capsys, monkeypatch, write_config, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = dflashctl(
        capsys, monkeypatch, "status", "-c", str(write_config(tmp_path, **{"host.port": port}))
    )
    assert code == 3
    assert f"error: 127.0.0.1 port {port} refused the connection" in err


def test_without_a_container_status_shows_the_host(
    capsys, monkeypatch, write_config, tmp_path, pve_host
):
    path = write_config(tmp_path, vmid=None, **{"container.workdir": str(tmp_path / "wd")})
    _, report = status_json(capsys, monkeypatch, path)
    assert report["container"] is None and report["proxmox_node"] is None
    assert report["active_run"] is None
    code, out, _ = dflashctl(capsys, monkeypatch, "status", "-c", str(path))
    assert out.splitlines()[0] == f"host       root@127.0.0.1:{pve_host.port} (no container)"


def test_a_broken_python_still_shows_the_container_then_exits_3(
    capsys, monkeypatch, write_config, tmp_path, container
):
    path = write_config(tmp_path, **{"container.python": "/opt/nowhere/python3"})
    code, out, err = dflashctl(capsys, monkeypatch, "status", "-c", str(path))
    assert code == 3
    assert out.startswith("container  200 (ct200) on node pve: running")
    assert "error: /opt/nowhere/python3: cannot run it on CT 200 on " in err
    code, out, _ = dflashctl(capsys, monkeypatch, "status", "--json", "-c", str(path))
    assert code == 3
    assert flat(json.loads(out))["active_run_error"]["message"].startswith("/opt/nowhere/python3")
