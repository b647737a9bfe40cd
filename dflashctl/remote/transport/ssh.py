"""The SSH transport: one verified paramiko connection per command, reused for every
exec, SFTP transfer and pvesh call.

The connection is opened lazily on first use. Every way connecting can fail becomes one
ConnectFailed with a plain sentence (exit code 3).
"""

from __future__ import annotations

import errno
import os
import re
import shlex
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import paramiko

from dflashctl.config.schema import HostConfig
from dflashctl.errors import ConfigError, HostError
from dflashctl.remote.transport import host_keys
from dflashctl.remote.transport.base import (
    DEFAULT_TIMEOUT_S,
    CommandResult,
    CommandTimeout,
    ConnectFailed,
    ConnectionLost,
    Stdin,
    StdinFeeder,
    Stream,
    Transport,
    command_text,
    read_local,
    temp_name_for,
    trace,
)
from dflashctl.remote.transport.identity import check_identity_file
from dflashctl.remote.transport.ssh_config import SSHDestination, resolve_host, resolve_jumps
from dflashctl.remote.transport.ssh_connect import (
    connect_one,
    open_socket,
    proxy_command,
    proxy_failure,
    tunnel,
)

CHUNK = 65536


# The remote shell reports its pid on stderr's first line, then execs the command. sshd
# makes every session its own process group (setsid), so `kill -- -PID` stops the command
# and whatever it started. (The SSH "signal" request would be simpler, but OpenSSH
# refuses it for root logins, which is how Proxmox hosts are used.)
PID_PREFIX = "echo dflashctl-pid=$$ >&2; exec "
_PID_LINE = re.compile(rb"(?m)^dflashctl-pid=(\d+)\n")
_PID_SEARCH_LIMIT = 65536  # shell start-up noise (a chatty .bashrc) may come first


# The channel's own: the command exited without reading all of its stdin.
_GONE = (OSError, EOFError, paramiko.SSHException)


class _StderrReader(threading.Thread):
    """Reads a channel's stderr while the caller reads stdout, so neither fills up; the
    remote pid line (see PID_PREFIX) is taken out of it."""

    def __init__(self, chan: paramiko.Channel) -> None:
        super().__init__(name="ssh-stderr", daemon=True)
        self.chan = chan
        self.data = bytearray()
        self.pid: int | None = None
        self.pid_known = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            while True:
                try:
                    chunk = self.chan.recv_stderr(CHUNK)
                except TimeoutError:  # the channel timeout is shared with stdout's reads
                    continue
                except (OSError, EOFError):
                    return
                if not chunk:
                    return
                self.data += chunk
                if not self.pid_known.is_set():
                    self._take_pid()
        finally:
            self.pid_known.set()

    def _take_pid(self) -> None:
        found = _PID_LINE.search(self.data)
        if found:
            self.pid = int(found.group(1))
            del self.data[found.start() : found.end()]
            self.pid_known.set()
        elif len(self.data) > _PID_SEARCH_LIMIT:
            self.pid_known.set()  # not coming: the command cannot be killed by pid


class SSHStream(Stream):
    def __init__(self, owner: SSHTransport, chan: paramiko.Channel, argv: list[str]) -> None:
        self._owner = owner
        self._chan = chan
        self._argv = argv
        self._stderr = _StderrReader(chan)
        self._eof = False

    def read(self, timeout: float) -> bytes | None:
        if self._eof:
            return b""
        self._chan.settimeout(max(timeout, 0.0))
        try:
            data = self._chan.recv(CHUNK)
        except TimeoutError:
            return None
        except (OSError, EOFError):
            data = b""
        if not data:
            self._eof = True
            self._chan.status_event.wait(5)
            transport = self._chan.get_transport()
            if self._chan.exit_status == -1 and not (transport and transport.is_active()):
                # The end of the output only because the connection died: say so.
                raise ConnectionLost(
                    self._owner.description, f"streaming `{command_text(self._argv)}`"
                )
        return data

    @property
    def exit_status(self) -> int | None:  # type: ignore[override]
        if self._chan.status_event.is_set() and self._chan.exit_status != -1:
            return self._chan.exit_status
        return None

    @property
    def stderr(self) -> bytes:
        return bytes(self._stderr.data)

    def close(self) -> None:
        self._owner._kill(self._chan, self._stderr)
        self._stderr.join(timeout=5)


# --------------------------------------------------------------------------- connecting


class SSHTransport(Transport):
    def __init__(self, host: HostConfig) -> None:
        self.host = host
        self.destination = resolve_host(host)
        self.description = str(self.destination)
        self.saved_host_keys: list[str] = []  # filled when accept_new_host_key saved one
        self._client: paramiko.SSHClient | None = None
        self._jump_clients: list[paramiko.SSHClient] = []
        self._sftp: paramiko.SFTPClient | None = None
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- connection

    def connect(self) -> None:
        """Open and verify the connection now (it otherwise opens on first use)."""
        self._transport()

    def server_summary(self) -> tuple[str, str]:
        """(the server's SSH version, its verified host key as `type SHA256:...`)."""
        transport = self._transport()
        key = transport.get_remote_server_key()
        version = transport.remote_version.removeprefix("SSH-2.0-")
        return version, f"{key.get_name()} {host_keys.fingerprint(key)}"

    def _transport(self) -> paramiko.Transport:
        with self._lock:
            if self._client is None:
                self._client = self._open()
            transport = self._client.get_transport()
            if transport is None or not transport.is_active():
                raise ConnectionLost(self.description, "talking to it")
            return transport

    def _open(self) -> paramiko.SSHClient:
        host = self.host
        if host.identity_file and not Path(host.identity_file).is_file():
            raise ConfigError(
                f"host.identity_file: {host.identity_file} does not exist",
                hint="point it at your private key, or remove it to use ssh-agent and ~/.ssh",
            )
        if host.identity_file:
            check_identity_file(host.identity_file)
        policy = host_keys.VerifyingPolicy(
            Path(host.known_hosts), self.destination.user, host.accept_new_host_key
        )
        hops = resolve_jumps(self.destination.proxy_jump) if self.destination.proxy_jump else []
        timeout = host.connect_timeout_s
        previous: tuple[paramiko.SSHClient, SSHDestination] | None = None
        try:
            for dest in [*hops, self.destination]:
                if previous is not None:
                    client = connect_one(dest, host, policy, tunnel(*previous, dest, timeout))
                elif dest.proxy_command:
                    client = self._connect_by_command(dest, policy)
                else:
                    client = connect_one(dest, host, policy, open_socket(dest, timeout))
                if dest is not self.destination:
                    self._jump_clients.append(client)
                previous = (client, dest)
        except BaseException:
            self._close_jumps()
            raise
        self.saved_host_keys = policy.saved
        assert previous is not None
        return previous[0]

    def _connect_by_command(
        self, dest: SSHDestination, policy: host_keys.VerifyingPolicy
    ) -> paramiko.SSHClient:
        proxy = proxy_command(dest, self.host.connect_timeout_s)
        try:
            return connect_one(dest, self.host, policy, proxy)
        except ConnectFailed as exc:
            failure = proxy_failure(dest, proxy)
            proxy.close()
            if failure is not None and exc.reason in ("ssh", "timeout", "banner"):
                raise failure from exc
            raise

    def _close_jumps(self) -> None:
        for client in reversed(self._jump_clients):
            client.close()
        self._jump_clients.clear()

    def close(self) -> None:
        with self._lock:
            if self._sftp is not None:
                try:
                    self._sftp.close()
                except (OSError, EOFError, paramiko.SSHException):
                    pass
                self._sftp = None
            if self._client is not None:
                self._client.close()
                self._client = None
            self._close_jumps()

    def _channel(
        self, argv: Sequence[str], command: str, pty_size: tuple[int, int] | None = None
    ) -> paramiko.Channel:
        transport = self._transport()
        try:
            chan = transport.open_session(timeout=self.host.connect_timeout_s)
            if pty_size is not None:
                term = os.environ.get("TERM") or "xterm"
                chan.get_pty(term=term, width=pty_size[0], height=pty_size[1])
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise ConnectionLost(self.description, f"starting `{command_text(argv)}`") from exc
        return chan

    def interactive_channel(
        self, argv: Sequence[str], *, pty_size: tuple[int, int] | None = None
    ) -> paramiko.Channel:
        """A session running argv that the caller pumps itself (dflashctl/ops/attach.py):
        with a pty of pty_size (columns, rows) when given, as `ssh -t` does."""
        argv = [str(a) for a in argv]
        return self._channel(argv, shlex.join(argv), pty_size)

    # ---------------------------------------------------------------- commands

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
        # sshd usually refuses "env" requests (AcceptEnv), so set variables with env(1).
        prefix = ["env", *(f"{k}={v}" for k, v in env.items())] if env else []
        chan = self._channel(argv, PID_PREFIX + shlex.join(prefix + argv))
        stderr_reader = _StderrReader(chan)
        try:
            stdout, stderr, status = self._collect(chan, stderr_reader, argv, stdin, timeout)
        except BaseException:
            self._kill(chan, stderr_reader)
            raise
        chan.close()
        return self._finish(CommandResult(argv, status, stdout, stderr), check)

    def _kill(self, chan: paramiko.Channel, stderr_reader: _StderrReader) -> None:
        """Stop a remote command that is still running, then close its channel."""
        if not chan.closed and not chan.status_event.is_set():
            stderr_reader.pid_known.wait(2)
            if stderr_reader.pid:
                try:
                    self.run(
                        ["kill", "-KILL", "--", f"-{stderr_reader.pid}"], check=False, timeout=10
                    )
                except HostError:
                    pass  # the connection is gone: sshd then ends the session itself
        chan.close()

    def _collect(
        self,
        chan: paramiko.Channel,
        stderr_reader: _StderrReader,
        argv: list[str],
        stdin: Stdin | None,
        timeout: float | None,
    ) -> tuple[bytes, bytes, int]:
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            if deadline is None:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CommandTimeout(argv, self.description, timeout or 0)
            return remaining

        feeder = None
        if stdin:
            # A writer thread: the command may print before it has read all its input.
            # Channel.send of a memoryview, not sendall: sendall copies the rest of its
            # bytes on every packet (quadratic in the size of one call).
            feeder = StdinFeeder("ssh-stdin", stdin, chan.send, chan.shutdown_write, _GONE)
        else:
            chan.shutdown_write()  # like </dev/null: a command reading stdin sees EOF

        stdout = bytearray()
        while True:
            chan.settimeout(left())
            try:
                chunk = chan.recv(CHUNK)
            except TimeoutError:
                left()  # raises when the deadline has passed
                continue
            except (OSError, EOFError):
                chunk = b""
            if not chunk:
                break
            stdout += chunk
        while not chan.status_event.wait(min(left() or 1.0, 1.0)):
            pass
        stderr_reader.join(left())
        if feeder is not None:
            feeder.join(left())
            if feeder.error is not None:  # the input's own failure comes first
                raise feeder.error
        if chan.exit_status == -1:  # closed without a status: the connection went away
            raise ConnectionLost(self.description, f"running `{command_text(argv)}`")
        return bytes(stdout), bytes(stderr_reader.data), chan.exit_status

    def stream(self, argv: Sequence[str]) -> Stream:
        argv = [str(a) for a in argv]
        trace(self.description, argv)
        chan = self._channel(argv, PID_PREFIX + shlex.join(argv))
        chan.shutdown_write()
        return SSHStream(self, chan, argv)

    # ---------------------------------------------------------------- files

    def _sftp_client(self) -> paramiko.SFTPClient:
        with self._lock:
            if self._sftp is None:
                transport = self._transport()
                try:
                    self._sftp = paramiko.SFTPClient.from_transport(transport)
                except (paramiko.SSHException, OSError, EOFError) as exc:
                    raise HostError(
                        f"cannot start SFTP on {self.description}: {exc}",
                        hint="enable the sftp subsystem in the host's sshd_config",
                    ) from exc
                assert self._sftp is not None
            return self._sftp

    def put_file(self, local: Path | bytes, remote_path: str, *, mode: int = 0o644) -> None:
        data = read_local(local)
        tmp = temp_name_for(remote_path)
        with self._lock:
            sftp = self._sftp_client()
            try:
                with sftp.open(tmp, "wb") as handle:
                    handle.set_pipelined(True)
                    handle.write(data)
                    handle.chmod(mode)
                sftp.posix_rename(tmp, remote_path)
            except OSError as exc:
                try:
                    sftp.remove(tmp)
                except (OSError, EOFError, paramiko.SSHException):
                    pass
                raise self._file_error("write", remote_path, exc) from exc
            except (EOFError, paramiko.SSHException) as exc:
                raise ConnectionLost(self.description, f"writing {remote_path}") from exc

    def get_file(self, remote_path: str) -> bytes:
        with self._lock:
            sftp = self._sftp_client()
            try:
                with sftp.open(remote_path, "rb") as handle:
                    handle.prefetch()
                    return handle.read()
            except OSError as exc:
                raise self._file_error("read", remote_path, exc) from exc
            except (EOFError, paramiko.SSHException) as exc:
                raise ConnectionLost(self.description, f"reading {remote_path}") from exc

    def _file_error(self, verb: str, path: str, exc: OSError) -> HostError:
        if exc.errno == errno.ENOENT and verb == "write":
            reason = "its folder does not exist"
        else:
            reason = exc.strerror or str(exc)
        return HostError(f"cannot {verb} {path} on {self.description}: {reason}")
