"""The test host itself: a real sshd whose pct/pvesh stand-ins drive bubblewrap containers.

Checked from the outside, with the system ssh client and with paramiko, both strict about
the host key, the way dflashctl will use it.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from pathlib import Path

import paramiko
import pytest
from proxmoxer.backends.command_base import CommandBaseSession, JsonSimpleSerializer
from proxmoxer.core import ProxmoxResource, ResourceException

from tests.host import fixtures, lxc, state
from tests.host.fixtures import apply_overrides, require_test_host
from tests.host.sshd import SshServer
from tests.waiting import returns


def ssh(
    pve_host,
    *argv: str,
    input: str | None = None,
    known_hosts: Path | None = None,
    timeout: float = 30,
) -> subprocess.CompletedProcess:
    """Run argv on the test host with the system ssh client (strict host key checking)."""
    return subprocess.run(
        pve_host.ssh_argv(*argv, known_hosts=known_hosts),
        input=input,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def paramiko_client(pve_host, known_hosts: Path | None = None) -> paramiko.SSHClient:
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts or pve_host.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect(
        pve_host.address,
        port=pve_host.port,
        username=pve_host.user,
        key_filename=str(pve_host.identity_file),
        look_for_keys=False,
        allow_agent=False,
        timeout=60,
    )
    return client


def wait_for(predicate, timeout: float = 60) -> None:
    """Poll until predicate() is true (a detached process may take a moment to exec)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def running_commands(container) -> set[str]:
    return {args for _, args in container.ps()}


@pytest.fixture
def client(pve_host):
    client = paramiko_client(pve_host)
    yield client
    client.close()


def remote(client: paramiko.SSHClient, argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    """Run argv over paramiko; stdout and stderr are read together (merged reads would
    deadlock only past the channel window, far above what these commands print)."""
    channel = client.get_transport().open_session()
    channel.exec_command(shlex.join(argv))
    if stdin:
        channel.sendall(stdin)
    channel.shutdown_write()
    out = channel.makefile("rb").read().decode()
    err = channel.makefile_stderr("rb").read().decode()
    return channel.recv_exit_status(), out, err


# -- sshd and host keys --------------------------------------------------------------------


def test_system_ssh_finds_the_standins_with_a_strict_host_key(pve_host, container):
    result = ssh(pve_host, "sh", "-c", "command -v pct; command -v pvesh; pct status 200")
    assert result.returncode == 0, result.stderr
    pct_path, pvesh_path, status = result.stdout.splitlines()
    assert Path(pct_path) == Path(__file__).parent / "host" / "bin" / "pct"
    assert Path(pvesh_path).name == "pvesh"
    assert status == "status: running"
    assert pve_host.known_hosts.read_text().startswith(f"[127.0.0.1]:{pve_host.port} ssh-ed25519 ")


def test_paramiko_connects_with_reject_policy(client, container):
    status, out, _ = remote(client, ["pct", "exec", "200", "--", "hostname"])
    assert (status, out) == (0, "ct200\n")


def test_changed_host_key_is_refused(pve_host, tmp_path):
    wrong = pve_host.known_hosts_with_wrong_key(tmp_path)
    result = ssh(pve_host, "true", known_hosts=wrong)
    assert result.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in result.stderr
    with pytest.raises(paramiko.BadHostKeyException):
        paramiko_client(pve_host, known_hosts=wrong)


def test_unknown_host_key_is_refused(pve_host, tmp_path):
    empty = pve_host.empty_known_hosts(tmp_path)
    result = ssh(pve_host, "true", known_hosts=empty)
    assert result.returncode == 255
    assert "Host key verification failed" in result.stderr
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        paramiko_client(pve_host, known_hosts=empty)


# -- pct exec ------------------------------------------------------------------------------


def test_exec_sees_only_the_container(client, container):
    host_file = Path("/tmp") / f"host-only-{os.getpid()}"
    host_file.write_text("host")
    try:
        status, out, err = remote(
            client,
            [
                "pct",
                "exec",
                "200",
                "--",
                "sh",
                "-c",
                f"hostname; ps -eo pid=,args=; ls /tmp; "
                f"test -e {host_file} && echo leaked; env | sort",
            ],
        )
    finally:
        host_file.unlink()
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0] == "ct200"
    processes = [line.split(None, 1) for line in lines if line.strip()[:1].isdigit()]
    pids = {int(pid) for pid, _ in processes}
    assert 1 in pids and max(pids) < 50, out  # a fresh pid namespace
    assert not any("sshd" in args for _, args in processes)
    assert "leaked" not in lines
    # pct exec is lxc-attach --keep-env under the PATH PVE's CLI handler forces: the SSH
    # session's variables come along, /usr/local/bin does not.
    assert "PATH=/sbin:/bin:/usr/sbin:/usr/bin" in lines
    assert any(line.startswith("SSH_CONNECTION=") for line in lines)


def test_root_is_private_and_the_host_read_only(client, container):
    status, out, _ = remote(
        client,
        [
            "pct",
            "exec",
            "200",
            "--",
            "sh",
            "-c",
            "echo mine > /root/note && cat /root/note; touch /usr/x 2>&1; touch /etc/x 2>&1; true",
        ],
    )
    assert status == 0
    assert out.splitlines()[0] == "mine"
    assert "Read-only file system" in out
    assert (container.root / "note").read_text() == "mine\n"
    assert not Path("/root/note").exists() or Path("/root/note").read_text() != "mine\n"


def test_exec_passes_stdin_and_exit_status(client, container):
    assert remote(client, ["pct", "exec", "200", "--", "cat"], stdin=b"through\n")[:2] == (
        0,
        "through\n",
    )
    assert remote(client, ["pct", "exec", "200", "--", "sh", "-c", "exit 7"])[0] == 7
    # Killed by SIGKILL: 128+9, as lxc-attach reports it.
    assert remote(client, ["pct", "exec", "200", "--", "sh", "-c", "kill -9 $$"])[0] == 137


def test_python_works_inside(client, container, write_config, tmp_path):
    import yaml

    python = yaml.safe_load(write_config(tmp_path).read_text())["container"]["python"]
    status, out, err = remote(
        client,
        [
            "pct",
            "exec",
            "200",
            "--",
            python,
            "-c",
            "import yaml, socket; print(socket.gethostname())",
        ],
    )
    assert (status, out) == (0, "ct200\n"), err


def test_detached_child_outlives_exec(client, container):
    # An exec that waited for its detached child would wait the child's hour.
    status, _, err = returns(
        lambda: remote(
            client,
            [
                "pct",
                "exec",
                "200",
                "--",
                "sh",
                "-c",
                "setsid sleep 3600 </dev/null >/dev/null 2>&1 &",
            ],
        )
    )
    assert status == 0, err
    wait_for(lambda: "sleep 3600" in running_commands(container))


def test_exec_on_stopped_or_missing_container(client, make_container):
    make_container(201, running=False)
    status, _, err = remote(client, ["pct", "exec", "201", "--", "true"])
    assert (status, err) == (255, "container '201' not running!\n")
    status, _, err = remote(client, ["pct", "status", "999"])
    assert status != 0
    assert err.strip() == "Configuration file 'nodes/pve/lxc/999.conf' does not exist"


# -- pct start / stop ----------------------------------------------------------------------


def test_stop_kills_everything_and_start_keeps_files(client, container):
    remote(
        client,
        [
            "pct",
            "exec",
            "200",
            "--",
            "sh",
            "-c",
            "echo kept > /root/file; setsid sleep 300 </dev/null >/dev/null 2>&1 &",
        ],
    )
    wait_for(lambda: "sleep 300" in running_commands(container))
    inside = container.pids()
    assert len(inside) >= 2  # the container's init (and bwrap's own sleep), our sleep
    assert remote(client, ["pct", "stop", "200"])[0] == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in inside)
    assert remote(client, ["pct", "status", "200"])[1] == "status: stopped\n"
    assert remote(client, ["pct", "start", "200"])[0] == 0
    assert remote(client, ["pct", "exec", "200", "--", "cat", "/root/file"])[1] == "kept\n"
    status, _, err = remote(client, ["pct", "start", "200"])
    assert status != 0 and err.strip() == "CT 200 already running"


# -- pct push / pull -----------------------------------------------------------------------


def test_push_writes_in_place(client, container, tmp_path):
    source = tmp_path / "payload"
    source.write_text("first")
    assert remote(client, ["pct", "push", "200", str(source), "/root/payload"])[0] == 0
    inode = (container.root / "payload").stat().st_ino
    source.write_text("second, longer")
    assert (
        remote(client, ["pct", "push", "200", str(source), "/root/payload", "--perms", "0750"])[0]
        == 0
    )
    pushed = container.root / "payload"
    assert pushed.read_text() == "second, longer"
    assert pushed.stat().st_ino == inode  # truncated and rewritten, not replaced
    assert pushed.stat().st_mode & 0o777 == 0o750
    back = tmp_path / "back"
    assert remote(client, ["pct", "pull", "200", "/root/payload", str(back)])[0] == 0
    assert back.read_text() == "second, longer"


def test_push_failures_reach_only_stderr_and_exit_0(client, make_container, tmp_path):
    # The copy runs in a task worker: its error is printed, the command exits 0.
    container = make_container(200)
    source = tmp_path / "payload"
    source.write_text("x")
    status, _, err = remote(client, ["pct", "push", "200", str(source), "/root/missing/f"])
    assert status == 0
    assert err.strip() == "failed to create file: /root/missing/f: No such file or directory"
    status, _, err = remote(client, ["pct", "push", "200", str(source), "/etc/dflash"])
    assert status == 0
    assert err.strip() == "failed to create file: /etc/dflash: Read-only file system"
    # A short write (a full disk) is not even printed: File::Copy's result is ignored.
    container.stop()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(container.tmp)], check=True
    )
    try:
        container.start()
        source.write_bytes(os.urandom(64 * 1024))
        status, _, err = remote(client, ["pct", "push", "200", str(source), "/tmp/big"])
        assert (status, err) == (0, "")
        assert (container.tmp / "big").stat().st_size < 64 * 1024
    finally:
        container.stop()
        subprocess.run(["umount", "-l", str(container.tmp)], check=True)
    # Not running (or not there at all): the same refusal, before any worker.
    for vmid in ("200", "999"):
        status, _, err = remote(client, ["pct", "push", vmid, str(source), "/tmp/x"])
        assert (status, err) == (255, "can only push files to a running CT\n")


# -- pvesh ---------------------------------------------------------------------------------


class ParamikoPveshSession(CommandBaseSession):
    """proxmoxer's command backend logic over an already verified paramiko connection."""

    def __init__(self, client: paramiko.SSHClient):
        super().__init__()
        self.client = client

    def _exec(self, cmd):
        status, out, err = remote(self.client, cmd)
        return out, err, status


def test_pvesh_answers_proxmoxer(client, make_container):
    make_container(200)
    make_container(201, running=False)
    api = ProxmoxResource(
        base_url="", session=ParamikoPveshSession(client), serializer=JsonSimpleSerializer()
    )
    assert "version" in api.version.get()
    listed = {entry["vmid"]: entry for entry in api.nodes("pve").lxc.get()}
    assert (listed[200]["status"], listed[201]["status"]) == ("running", "stopped")
    assert listed[200]["name"] == "ct200" and listed[200]["maxmem"] > 0
    assert api.nodes("pve").lxc(201).config.get()["hostname"] == "ct201"
    current = api.nodes("pve").lxc(201).status.current.get()
    assert current["status"] == "stopped" and current["vmid"] == 201
    upid = api.nodes("pve").lxc(201).status.start.post()
    # The shape proxmoxer.tools.Tasks.decode_upid accepts (proxmoxer.tools itself needs
    # requests to import), and what Tasks.blocking_status polls for.
    assert upid.startswith("UPID:pve:") and len(upid.split(":")) == 9
    assert upid.split(":")[5:8] == ["vzstart", "201", "root@pam"]
    task = api.nodes("pve").tasks(upid).status.get()
    assert (task["status"], task["exitstatus"]) == ("stopped", "OK")
    assert api.nodes("pve").lxc(201).status.current.get()["status"] == "running"
    with pytest.raises(ResourceException) as missing:
        api.nodes("pve").lxc(999).status.current.get()
    assert missing.value.status_code == 500
    assert "Configuration file 'nodes/pve/lxc/999.conf' does not exist" in str(missing.value)
    with pytest.raises(ResourceException) as bad:
        api.nodes("pve").tasks("not-a-upid").status.get()
    assert bad.value.status_code == 400


# -- dropped connections and teardown ------------------------------------------------------


def test_drop_connections_cuts_an_inflight_command(pve_host, container):
    client = paramiko_client(pve_host)
    system_ssh = subprocess.Popen(
        pve_host.ssh_argv("pct", "exec", "200", "--", "sleep", "60"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        channel = client.get_transport().open_session()
        channel.exec_command("pct exec 200 -- sleep 61")
        wait_for(lambda: {"sleep 60", "sleep 61"} <= running_commands(container))
        assert pve_host.drop_connections() >= 2
        assert system_ssh.wait(timeout=60) == 255
        assert channel.recv_exit_status() == -1  # paramiko: closed without an exit status
        assert not client.get_transport().is_active()
    finally:
        system_ssh.kill()
        system_ssh.wait()
        client.close()
    # As on a real network drop, the commands themselves go on running.
    assert {"sleep 60", "sleep 61"} <= running_commands(container)


def test_stopping_the_server_leaves_no_processes(tmp_path):
    require_test_host()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    state.create_container(state_dir, 300)
    server = SshServer(workdir=tmp_path / "ssh", state_dir=state_dir)
    server.start()
    try:
        started = ssh(
            server,
            "sh",
            "-c",
            "pct start 300 && pct exec 300 -- sh -c "
            "'setsid sleep 300 </dev/null >/dev/null 2>&1 &'; "
            "setsid sleep 301 </dev/null >/dev/null 2>&1 &",
        )
        assert started.returncode == 0, started.stderr
    finally:
        server.stop()
    leftovers = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline or cmdline.startswith(b"sleep\x00301"):
            leftovers.append(cmdline.replace(b"\0", b" ").decode())
    assert leftovers == []


def test_server_moves_on_when_its_port_is_taken(tmp_path, monkeypatch):
    require_test_host()
    import socket

    from tests.host import sshd as sshd_module

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1], sshd_module._free_port()]
        monkeypatch.setattr(sshd_module, "_free_port", lambda: ports.pop(0))
        server = SshServer(workdir=tmp_path / "ssh", state_dir=tmp_path)
        server.start()
        try:
            assert server.port != taken.getsockname()[1]
            assert server.run("true").returncode == 0
        finally:
            server.stop()


# -- fixtures ------------------------------------------------------------------------------


def test_missing_host_skips_locally_and_fails_under_ci(monkeypatch):
    monkeypatch.setattr(fixtures, "host_problem", lambda: "no bwrap here")
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no bwrap here"):
        fixtures.require_test_host()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="under CI: no bwrap here"):
        fixtures.require_test_host()


def test_pct_options_in_both_spellings():
    from tests.host.pct_cli import _split_options

    assert _split_options(["200", "a", "/root/b", "--perms=0750"], {"perms"}) == (
        ["200", "a", "/root/b"],
        {"perms": "0750"},
    )
    assert _split_options(["-perms", "644", "200"], {"perms"}) == (["200"], {"perms": "644"})


def test_folders_hidden_by_a_containers_private_root_and_tmp_are_bound_back(tmp_path):
    # tmp_path lies under /tmp, like a clean clone with its venv in /tmp would.
    checkout = tmp_path / "checkout"
    (checkout / ".venv" / "bin").mkdir(parents=True)
    candidates = [
        checkout,
        checkout / ".venv",
        checkout / ".venv" / "bin",
        Path("/usr/bin"),  # visible in the container already
        Path("/tmp"),  # the private folder itself is never bound over
        tmp_path / "missing",
    ]
    assert fixtures.hidden_in_containers(candidates) == [str(checkout.resolve())]


def test_write_config_overrides():
    config = {"host": {"port": 22, "user": "root"}, "run": {"stop_grace_s": 20}}
    merged = apply_overrides(config, {"run.stop_grace_s": 1, "host": {"port": 2222}})
    assert merged == {"host": {"port": 2222, "user": "root"}, "run": {"stop_grace_s": 1}}
    assert config["run"]["stop_grace_s"] == 20


def test_write_config_loads_with_dflashctl(pve_host, write_config, tmp_path):
    from dflashctl.config.schema import load_config

    path = write_config(tmp_path, vmid=201, **{"run.stop_grace_s": 2})
    config = load_config(path)
    assert (config.host.address, config.host.port) == ("127.0.0.1", pve_host.port)
    assert config.container.vmid == 201
    assert config.run.stop_grace_s == 2


def test_container_handle(container):
    result = container.exec(["sh", "-c", "echo $HOME; cat"], input="in")
    assert result.stdout == "/root\nin"
    assert [ns_pid for ns_pid, _ in container.ps()][0] == 1
    assert container.host_path("/root/x") == container.root / "x"
    container.stop()
    assert not container.is_running() and container.pids() == []
    container.start()
    assert container.exec(["hostname"]).stdout == "ct200\n"


# -- which containers ------------------------------------------------------------------------


def test_containers_are_real_lxc_where_lxc_runs(pve_host, container):
    settings = json.loads((pve_host.state_dir / "host.json").read_text())
    if settings["containers"] != "lxc":
        pytest.skip(f"this session runs {fixtures.CONTAINER_KIND.get('detail')}")
    name = f"{lxc.session_prefix()}200"
    assert name.startswith(f"dfl{os.getpid()}-")  # unique per test session
    info = subprocess.run(
        ["lxc-info", "-P", str(pve_host.state_dir / "lxcpath"), "-n", name, "-s", "-p"],
        capture_output=True,
        text=True,
    )
    assert info.stdout.split() == ["State:", "RUNNING", "PID:", str(container.init_pid())]


def test_bubblewrap_is_the_fallback_and_the_summary_says_so(monkeypatch, tmp_path):
    if fixtures._missing_tool("bwrap"):
        pytest.skip("no bwrap here")
    monkeypatch.setenv("DFLASHCTL_TEST_CONTAINERS", "bwrap")
    monkeypatch.setattr(fixtures, "CONTAINER_KIND", {})
    settings = fixtures._host_settings(tmp_path)
    assert settings["containers"] == "bwrap"
    assert fixtures.CONTAINER_KIND == {
        "kind": "bwrap",
        "detail": "LXC not used: DFLASHCTL_TEST_CONTAINERS=bwrap",
    }
    python3 = Path(settings["local_bin"]) / "python3"  # /usr/local/bin/python3 in there
    assert os.access(python3, os.X_OK)
