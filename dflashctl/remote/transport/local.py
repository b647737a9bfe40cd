"""The transport for `host.address: local`: the same interface, on this machine."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflashctl.errors import HostError
from dflashctl.remote.transport.base import (
    DEFAULT_TIMEOUT_S,
    CommandResult,
    CommandTimeout,
    Stdin,
    StdinFeeder,
    Stream,
    Transport,
    read_local,
    temp_name_for,
    trace,
)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the command and everything it started (it leads its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _not_found(argv: Sequence[str], exc: OSError) -> CommandResult:
    # What a shell would answer, so callers handle "no such command" alike on both
    # transports (an SSH command runs through the remote user's shell).
    status = 127 if isinstance(exc, FileNotFoundError) else 126
    reason = "command not found" if status == 127 else exc.strerror
    return CommandResult(list(argv), status, b"", f"{argv[0]}: {reason}\n".encode())


class LocalStream(Stream):
    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc
        self._stderr = bytearray()
        self._eof = False
        self._stderr_reader = threading.Thread(
            target=self._drain_stderr, name="local-stream-stderr", daemon=True
        )
        self._stderr_reader.start()

    def _drain_stderr(self) -> None:
        assert self._proc.stderr is not None
        while chunk := self._proc.stderr.read1(65536):
            self._stderr += chunk

    def read(self, timeout: float) -> bytes | None:
        if self._eof:
            return b""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], max(timeout, 0))
        if not ready:
            return None
        data = os.read(fd, 65536)
        if not data:
            self._eof = True
            self._proc.wait()
            self._stderr_reader.join(timeout=5)
        return data

    @property
    def exit_status(self) -> int | None:  # type: ignore[override]
        return self._proc.poll()

    @property
    def stderr(self) -> bytes:
        return bytes(self._stderr)

    def close(self) -> None:
        if self._proc.poll() is None:
            _kill_group(self._proc)
        for pipe in (self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                pipe.close()
        self._stderr_reader.join(timeout=5)


class LocalTransport(Transport):
    description = "local"

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        argv = [str(a) for a in argv]
        trace(self.description, argv)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**os.environ, **env} if env else None,
                start_new_session=True,
            )
        except OSError as exc:
            return self._finish(_not_found(argv, exc), check)
        feeder = None
        if stdin is not None and not isinstance(stdin, bytes):
            # Pieces produced while they are sent: a writer thread of our own, and
            # communicate() only reads (and must not close the pipe under it).
            pipe, proc.stdin = proc.stdin, None
            assert pipe is not None
            feeder = StdinFeeder("local-stdin", stdin, pipe.write, pipe.close)
            stdin = None
        try:
            # communicate() feeds stdin and reads both pipes concurrently.
            stdout, stderr = proc.communicate(stdin, timeout=timeout)
            if feeder is not None:
                feeder.join()
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            raise CommandTimeout(argv, self.description, timeout or 0) from None
        except BaseException:
            _kill_group(proc)
            raise
        if feeder is not None and feeder.error is not None:
            raise feeder.error
        return self._finish(CommandResult(argv, proc.returncode, stdout, stderr), check)

    def stream(self, argv: Sequence[str]) -> Stream:
        argv = [str(a) for a in argv]
        trace(self.description, argv)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as exc:
            raise HostError(f"cannot start `{argv[0]}` locally: {exc.strerror}") from exc
        return LocalStream(proc)

    def put_file(self, local: Path | bytes, remote_path: str, *, mode: int = 0o644) -> None:
        data = read_local(local)
        tmp = temp_name_for(remote_path)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fchmod(fd, mode)  # the umask must not change the mode asked for
            finally:
                os.close(fd)
            os.replace(tmp, remote_path)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise HostError(f"cannot write {remote_path}: {exc.strerror}") from exc

    def get_file(self, remote_path: str) -> bytes:
        try:
            return Path(remote_path).read_bytes()
        except OSError as exc:
            raise HostError(f"cannot read {remote_path}: {exc.strerror}") from exc

    def close(self) -> None:
        pass
