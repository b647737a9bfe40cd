"""LocalTransport: the same behaviour as the SSH transport, on this machine."""

from __future__ import annotations

import os
import time

import pytest

from dflashctl.config.schema import HostConfig
from dflashctl.errors import EXIT_HOST, HostError
from dflashctl.remote.transport import (
    CommandFailed,
    CommandTimeout,
    LocalTransport,
    open_transport,
)


@pytest.fixture
def local():
    with LocalTransport() as transport:
        yield transport


def test_open_transport_gives_a_local_one_for_local():
    assert isinstance(open_transport(HostConfig(address="local")), LocalTransport)


def test_run_returns_both_streams_and_status(local):
    result = local.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (result.exit_status, result.stdout_text, result.stderr_text) == (3, "out\n", "err\n")
    assert result.argv == ["sh", "-c", "echo out; echo err >&2; exit 3"]


def test_nonzero_exit_raises_command_failed_with_the_result(local):
    with pytest.raises(CommandFailed) as caught:
        local.run(["sh", "-c", "echo boom >&2; exit 4"])
    assert caught.value.result.exit_status == 4
    assert caught.value.exit_code == EXIT_HOST
    assert "exit status 4: boom" in caught.value.message


def test_large_outputs_on_both_streams_do_not_deadlock(local):
    script = "head -c 3000000 /dev/zero; head -c 3000000 /dev/zero >&2"
    result = local.run(["sh", "-c", script], timeout=30)
    assert (len(result.stdout), len(result.stderr)) == (3_000_000, 3_000_000)


def test_stdin_and_env_reach_the_command(local):
    result = local.run(
        ["sh", "-c", 'cat; echo "$GREETING"'], stdin=b"x" * 100_000, env={"GREETING": "hello there"}
    )
    assert result.stdout == b"x" * 100_000 + b"hello there\n"


def test_missing_command_is_exit_127_like_a_shell(local):
    result = local.run(["no-such-command-here"], check=False)
    assert result.exit_status == 127
    assert "command not found" in result.stderr_text


def test_timeout_kills_the_command_and_its_children(local, tmp_path):
    pid_file = tmp_path / "pid"
    # Without the timeout the command would end by itself after 30 s, raising nothing.
    with pytest.raises(CommandTimeout) as caught:
        local.run(["sh", "-c", f"sleep 30 & echo $! > {pid_file}; wait"], timeout=0.5)
    assert "within 0.5 s" in caught.value.message
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60  # a net: the loop ends as soon as the child is gone
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def test_stream_reads_incrementally_then_eof_and_status(local):
    with local.stream(["sh", "-c", "echo a; sleep 0.3; echo b >&2; echo c; exit 5"]) as stream:
        chunks = []
        while (data := stream.read(5)) != b"":
            assert data is not None
            chunks.append(data)
        assert b"".join(chunks) == b"a\nc\n"
        assert stream.exit_status == 5
        assert stream.stderr == b"b\n"


def test_stream_read_times_out_with_none_and_close_stops_it(local):
    stream = local.stream(["sleep", "30"])
    assert stream.read(0.1) is None
    stream.close()
    assert stream.exit_status is not None


def test_put_file_is_atomic_and_sets_the_mode(local, tmp_path):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    local.put_file(b"new content", str(target), mode=0o600)
    assert target.read_bytes() == b"new content"
    assert target.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["out.bin"]  # no temporary file left behind
    source = tmp_path / "source.txt"
    source.write_text("from a path")
    local.put_file(source, str(target))
    assert local.get_file(str(target)) == b"from a path"


def test_put_file_into_a_missing_folder_is_a_host_error(local, tmp_path):
    with pytest.raises(HostError, match="No such file or directory"):
        local.put_file(b"x", str(tmp_path / "missing" / "file"))


def test_get_file_of_a_missing_path_is_a_host_error(local, tmp_path):
    with pytest.raises(HostError, match=f"cannot read {tmp_path}/nothing"):
        local.get_file(str(tmp_path / "nothing"))


def _pieces(total: int, piece: int = 256 * 1024, fail_after: int | None = None):
    sent = 0
    while sent < total:
        if fail_after is not None and sent >= fail_after:
            raise ValueError("the source changed")
        n = min(piece, total - sent)
        yield b"x" * n
        sent += n


def test_stdin_streams_from_pieces(local):
    result = local.run(["wc", "-c"], stdin=_pieces(16 << 20))
    assert int(result.stdout_text) == 16 << 20


def test_a_failing_stdin_ends_the_input_and_its_error_is_raised(local):
    with pytest.raises(ValueError, match="the source changed"):
        local.run(["wc", "-c"], stdin=_pieces(4 << 20, fail_after=1 << 20))
