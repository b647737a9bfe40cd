"""The interface every transport offers: run a command, stream one, copy files.

A command is an argv list, never a shell string: the SSH transport quotes it with
shlex.join, the local one hands it to the OS as is. stdout and stderr are always read
concurrently and the exit status is always collected. A command's stdin is bytes, or an
iterable of bytes pieces that is consumed as the command reads (a large archive is
streamed from disk this way, never whole in memory).
"""

from __future__ import annotations

import posixpath
import secrets
import shlex
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dflashctl.errors import HostError

DEFAULT_TIMEOUT_S = 120.0

# bytes, or pieces produced while they are sent (see stdin_pieces).
Stdin = bytes | Iterable[bytes]


def stdin_pieces(stdin: Stdin) -> Iterator[bytes]:
    """A command's input as pieces. An exception raised by an iterable (say, a file
    that changed while it was being sent) ends the input early: the transports close
    the command's stdin and raise it once the command has ended."""
    if isinstance(stdin, (bytes, bytearray, memoryview)):
        yield bytes(stdin)
    else:
        yield from stdin


# A pipe's own: the command exited without reading all of its stdin.
PIPE_GONE = (BrokenPipeError, ConnectionResetError)


class StdinFeeder(threading.Thread):
    """Sends a command's stdin piece by piece through `send` (how many bytes it took;
    0: the far end has gone), then `end` (EOF). Each piece goes as a memoryview, so that
    resending a partly sent piece copies nothing. `gone`: the exceptions that mean the
    command exited without reading everything; any other is the input's own failure,
    kept in `error` for the caller to raise once the command has ended."""

    def __init__(
        self,
        name: str,
        stdin: Stdin,
        send: Callable[[memoryview], int],
        end: Callable[[], object],
        gone: tuple[type[BaseException], ...] = PIPE_GONE,
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.stdin, self.send, self.end, self.gone = stdin, send, end, gone
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            for piece in stdin_pieces(self.stdin):
                view = memoryview(piece)
                while view:
                    sent = self.send(view)
                    if not sent:
                        return  # the command has gone
                    view = view[sent:]
        except self.gone:
            pass
        except Exception as exc:  # the input failed: end it here, say why afterwards
            self.error = exc
        try:
            self.end()
        except self.gone:
            pass


@dataclass
class CommandResult:
    argv: list[str]
    exit_status: int
    stdout: bytes
    stderr: bytes

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")

    @property
    def stderr_text(self) -> str:
        return self.stderr.decode("utf-8", errors="replace")

    @property
    def ok(self) -> bool:
        return self.exit_status == 0

    def last_error_line(self) -> str:
        """The last non-empty line of stderr (else stdout): usually the actual complaint."""
        for text in (self.stderr_text, self.stdout_text):
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            if lines:
                return lines[-1]
        return ""


def command_text(argv: Sequence[str], limit: int = 120) -> str:
    """argv as a user would type it, shortened for messages."""
    text = shlex.join(argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CommandFailed(HostError):
    """A command exited non-zero and the caller asked for check=True."""

    def __init__(self, result: CommandResult, where: str, *, hint: str | None = None) -> None:
        complaint = result.last_error_line()
        message = (
            f"`{command_text(result.argv)}` failed on {where} with exit status {result.exit_status}"
        )
        if complaint:
            message += f": {complaint}"
        super().__init__(message, hint=hint)
        self.result = result
        self.where = where


class CommandTimeout(HostError):
    """A command ran past its timeout and was killed."""

    def __init__(self, argv: Sequence[str], where: str, timeout: float) -> None:
        super().__init__(
            f"`{command_text(argv)}` did not finish on {where} within {timeout:g} s and was stopped",
            hint="the host may be overloaded, or the command is waiting for input",
        )
        self.argv = list(argv)
        self.timeout = timeout


class ConnectionLost(HostError):
    """The SSH connection dropped while a command was running or a file was moving."""

    def __init__(self, where: str, doing: str) -> None:
        super().__init__(
            f"the SSH connection to {where} dropped while {doing}",
            hint="check the network and the host, then run the command again",
        )
        self.where = where

    @property
    def short(self) -> str:
        """For a line that goes on (a follower reconnecting): without the command."""
        return f"the SSH connection to {self.where} dropped"


class ConnectFailed(HostError):
    """Connecting failed before any command ran; `reason` says which step failed.

    reason is one of: resolve, refused, timeout, unreachable, banner, auth,
    host_key_unknown, host_key_changed, jump, proxy, ssh.
    """

    def __init__(self, reason: str, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.reason = reason


class Stream:
    """A long-running command's stdout, read incrementally.

    stderr is collected on the side (`stderr`) so that it never blocks the command.
    """

    exit_status: int | None = None

    def read(self, timeout: float) -> bytes | None:
        """Data as it arrives; b"" at EOF; None when nothing came within timeout."""
        raise NotImplementedError

    @property
    def stderr(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        """Stop the command (if still running) and release its resources."""
        raise NotImplementedError

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# `dflashctl -v`: called with (host, argv) before each command a transport runs.
command_trace: Callable[[str, Sequence[str]], None] | None = None


def trace(description: str, argv: Sequence[str]) -> None:
    if command_trace is not None:
        command_trace(description, argv)


class Transport:
    """Runs commands and moves files on one host, over one connection."""

    description: str = ""

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        raise NotImplementedError

    def prepare_bulk(self, argv: Sequence[str] | None = None) -> None:
        """A large stdin will follow soon (a deploy), for run_bulk(argv): get its way
        ready meanwhile and, where the transport can, start `argv` already."""

    def run_bulk(
        self, argv: Sequence[str], *, stdin: Stdin, timeout: float | None
    ) -> CommandResult:
        """run() (check=False) for a command whose stdin is large (a deploy's archive):
        the SSH transport sends it through the system's OpenSSH when it can."""
        return self.run(argv, stdin=stdin, timeout=timeout, check=False)

    def bulk_command_line(self, argv: Sequence[str]) -> list[str] | None:
        """The local command line that run_bulk(argv) runs, where it is one process
        that another could start ahead (dflashctl/ops/early_upload.py); else None."""
        return None

    def stream(self, argv: Sequence[str]) -> Stream:
        raise NotImplementedError

    def put_file(self, local: Path | bytes, remote_path: str, *, mode: int = 0o644) -> None:
        """Write a file atomically: a temporary name in the same folder, then rename."""
        raise NotImplementedError

    def get_file(self, remote_path: str) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # Shared by the implementations.
    def _finish(self, result: CommandResult, check: bool) -> CommandResult:
        if check and result.exit_status != 0:
            raise CommandFailed(result, self.description)
        return result


def read_local(local: Path | bytes) -> bytes:
    if isinstance(local, bytes):
        return local
    try:
        return Path(local).read_bytes()
    except OSError as exc:
        raise HostError(f"cannot read {local}: {exc.strerror}") from exc


def temp_name_for(path: str) -> str:
    """`<dir>/.<name>.tmp-<random>`: hidden, in the same folder so that rename is atomic."""
    folder, name = posixpath.split(path)
    return posixpath.join(folder, f".{name}.tmp-{secrets.token_hex(4)}")
