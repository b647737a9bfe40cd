"""SSHTransport against the real sshd of the test host: commands, files, one connection."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from dflashctl.errors import HostError
from dflashctl.remote.transport import (
    CommandFailed,
    CommandTimeout,
    ConnectionLost,
    open_transport,
)
from dflashctl.remote.transport.ssh import SSHTransport
from tests.ssh_support import host_config


@pytest.fixture
def ssh(pve_host):
    transport = open_transport(host_config(pve_host))
    assert isinstance(transport.paramiko, SSHTransport)
    yield transport
    transport.close()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, seconds: float = 60) -> bool:
    # A net for a loaded machine: the loop ends as soon as the process is gone.
    deadline = time.monotonic() + seconds
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_description_names_user_host_and_port(ssh, pve_host):
    assert ssh.description == f"root@127.0.0.1:{pve_host.port}"


def test_argv_is_quoted_and_streams_and_status_come_back(ssh):
    result = ssh.run(
        ["sh", "-c", 'echo "$1"; echo err >&2; exit 3', "sh", "a b; $HOME 'q'"], check=False
    )
    assert result.exit_status == 3
    assert result.stdout_text == "a b; $HOME 'q'\n"
    assert result.stderr_text == "err\n"


def test_nonzero_exit_raises_with_the_result_and_the_host(ssh, pve_host):
    with pytest.raises(CommandFailed) as caught:
        ssh.run(["sh", "-c", "echo nope >&2; exit 9"])
    assert caught.value.result.exit_status == 9
    assert f"on root@127.0.0.1:{pve_host.port} with exit status 9: nope" in caught.value.message


def test_a_command_killed_by_a_signal_reports_128_plus_n(ssh):
    assert ssh.run(["sh", "-c", "kill -TERM $$"], check=False).exit_status == 128 + 15


def test_big_stdout_and_stderr_are_read_concurrently(ssh):
    script = "head -c 4000000 /dev/zero; head -c 4000000 /dev/zero >&2; echo done >&2"
    result = ssh.run(["sh", "-c", script], timeout=60)
    assert len(result.stdout) == 4_000_000
    assert result.stderr.endswith(b"done\n") and len(result.stderr) == 4_000_005


def test_stdin_and_env(ssh):
    data = bytes(range(256)) * 20_000
    assert ssh.run(["cat"], stdin=data).stdout == data
    result = ssh.run(["sh", "-c", 'printf %s "$WHO"'], env={"WHO": "it's me"})
    assert result.stdout_text == "it's me"


def test_timeout_kills_the_remote_command(ssh, tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(CommandTimeout, match="within 0.5 s"):
        ssh.run(["sh", "-c", f"echo $$ > {pid_file}; sleep 30"], timeout=0.5)
    assert _wait_gone(int(pid_file.read_text()))
    assert ssh.run(["echo", "still usable"]).stdout_text == "still usable\n"


def test_stream_reads_as_data_arrives_and_close_kills(ssh, tmp_path):
    with ssh.stream(["sh", "-c", "echo first; sleep 0.4; echo second; exit 6"]) as stream:
        first = stream.read(5)
        assert first == b"first\n"
        assert stream.read(0.05) is None  # nothing yet: the command is sleeping
        rest = b""
        while (data := stream.read(5)) != b"":
            rest += data or b""
        assert rest == b"second\n"
        assert stream.exit_status == 6
    pid_file = tmp_path / "pid"
    stream = ssh.stream(["sh", "-c", f"echo $$ > {pid_file}; echo go; exec sleep 30"])
    assert stream.read(5) == b"go\n"
    stream.close()
    assert _wait_gone(int(pid_file.read_text()))


def test_put_file_is_atomic_with_mode_and_get_file_reads_it(ssh, tmp_path):
    dest = tmp_path / "config.json"
    dest.write_text("old")
    ssh.put_file(b'{"new": true}', str(dest), mode=0o640)
    assert dest.read_bytes() == b'{"new": true}'
    assert dest.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    assert ssh.get_file(str(dest)) == b'{"new": true}'
    big = tmp_path / "big.bin"
    big.write_bytes(b"z" * 3_000_000)
    ssh.put_file(big, str(tmp_path / "copy.bin"))
    assert (tmp_path / "copy.bin").read_bytes() == big.read_bytes()


def test_file_errors_are_host_errors(ssh, tmp_path):
    with pytest.raises(HostError, match="its folder does not exist"):
        ssh.put_file(b"x", str(tmp_path / "missing" / "f"))
    with pytest.raises(HostError, match="No such file"):
        ssh.get_file(str(tmp_path / "absent"))


def _logins(pve_host) -> int:
    return pve_host.log_tail(10_000_000).count("Accepted publickey for root")


def test_one_connection_serves_exec_sftp_and_streams(pve_host, ssh, tmp_path):
    before = _logins(pve_host)
    ssh.run(["true"])
    ssh.put_file(b"1", str(tmp_path / "a"))
    ssh.get_file(str(tmp_path / "a"))
    with ssh.stream(["echo", "x"]) as stream:
        while stream.read(5):
            pass
    for _ in range(3):
        ssh.run(["true"])
    assert _logins(pve_host) == before + 1


def test_a_dropped_connection_is_connection_lost(pve_host, tmp_path):
    with open_transport(host_config(pve_host, keepalive_s=1)) as transport:
        transport.run(["true"])
        errors: list[BaseException] = []

        started = tmp_path / "started"

        def long_command() -> None:
            try:
                transport.run(["sh", "-c", f"touch {started}; exec sleep 30"], timeout=120)
            except BaseException as exc:  # collected for the assertion below
                errors.append(exc)

        worker = threading.Thread(target=long_command, name="long-command")
        worker.start()
        # The drop comes while the command runs (not before it started, however slow the
        # machine): the remote side marks its start.
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline and worker.is_alive(), errors
            time.sleep(0.02)
        assert pve_host.drop_connections() >= 1
        worker.join(60)
        assert not worker.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], ConnectionLost), errors
        assert "dropped while running `sh -c" in errors[0].message


def test_a_stream_cut_by_a_dropped_connection_raises_connection_lost(pve_host):
    with open_transport(host_config(pve_host, keepalive_s=1)) as transport:
        stream = transport.stream(["sh", "-c", "echo started; exec sleep 10"])
        assert stream.read(5) == b"started\n"
        assert pve_host.drop_connections() >= 1
        with pytest.raises(ConnectionLost, match="dropped while streaming `sh -c"):
            deadline = time.monotonic() + 60  # a net: the read raises once the loss is seen
            while time.monotonic() < deadline:
                stream.read(0.2)
        stream.close()


class _ScriptedStderr:
    """Just enough of a paramiko channel: recv_stderr hands out these chunks, then EOF."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def recv_stderr(self, size: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


def test_the_pid_line_is_found_after_shell_noise_and_removed():
    from dflashctl.remote.transport.ssh import _StderrReader

    reader = _StderrReader(
        _ScriptedStderr([b"bashrc says hi\ndflashctl-p", b"id=4321\n", b"real\n"])
    )
    reader.join(5)
    assert reader.pid == 4321
    assert bytes(reader.data) == b"bashrc says hi\nreal\n"
    quiet = _StderrReader(_ScriptedStderr([b"12\n"]))  # digits alone are not the pid line
    quiet.join(5)
    assert (quiet.pid, bytes(quiet.data)) == (None, b"12\n")


def _pieces(total: int, piece: int = 256 * 1024, fail_after: int | None = None):
    sent = 0
    while sent < total:
        if fail_after is not None and sent >= fail_after:
            raise ValueError("the source changed")
        n = min(piece, total - sent)
        yield bytes([sent // piece % 251]) * n
        sent += n


def test_stdin_streams_from_pieces_in_linear_time(ssh):
    # 64 MiB in pieces: one sendall of it all would slice the whole on every packet.
    total = 64 << 20
    # Quadratic slicing would take far past this timeout (CommandTimeout); how fast it
    # is belongs to bench/bench_transfer.py.
    result = ssh.run(["sh", "-c", "wc -c"], stdin=_pieces(total), timeout=300)
    assert int(result.stdout_text) == total


def test_a_failing_stdin_ends_the_input_early_and_its_error_is_raised(ssh):
    with pytest.raises(ValueError, match="the source changed"):
        ssh.run(["sh", "-c", "wc -c"], stdin=_pieces(4 << 20, fail_after=1 << 20), timeout=60)
    # The command saw the end of its input and exited: the connection still serves.
    result = ssh.run(["sh", "-c", "wc -c"], stdin=_pieces(1 << 20))
    assert int(result.stdout_text) == 1 << 20
