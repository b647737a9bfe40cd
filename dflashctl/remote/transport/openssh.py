"""Bulk transfers through the system's OpenSSH: a deploy's archive at wire speed.

paramiko encrypts and frames every packet in Python; `ssh` does it in C (AES-GCM or
ChaCha20 with the CPU's instructions). So the one command that carries a large stdin
(the deploy's archive, transport.run_bulk) goes through `ssh`, as Ansible's default
connection does, over one multiplexed connection per target: a master started once
(ControlMaster, kept ControlPersist seconds after the last use), so the next deploy
within that time skips the handshake altogether.

The same trust as the paramiko connection: StrictHostKeyChecking=yes against
host.known_hosts only (no global file), BatchMode (never a prompt), the identity
files the paramiko path would use, ~/.ssh/config (or DFLASHCTL_SSH_CONFIG) applied by
ssh itself. The control socket lives in a folder only this user can enter, named by
a hash of all of that: a changed known_hosts path, identity or jump host gets a
connection of its own. When there is no `ssh`, or it cannot connect on those terms
(an unknown or changed host key included), connect() says None and the caller uses
paramiko, which refuses a bad key with its own precise message.
DFLASHCTL_SSH_CLIENT=paramiko turns this off.
"""

from __future__ import annotations

import fcntl
import hashlib
import math
import os
import re
import shlex
import shutil
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from dflashctl.config.schema import HostConfig
from dflashctl.ops import early_upload
from dflashctl.remote.transport.base import (
    CommandResult,
    CommandTimeout,
    ConnectionLost,
    Stdin,
    StdinFeeder,
)
from dflashctl.remote.transport.ssh_config import SSH_CONFIG_ENV, SSHDestination, ssh_config_path

CLIENT_ENV = "DFLASHCTL_SSH_CLIENT"  # "paramiko": never use the system's ssh
# How long the master outlives its last use: the edit-and-redeploy loop of a working
# session (minutes apart) keeps reusing it, where 60 s made most redeploys pay a
# handshake again. An idle master holds only a connection the key already allowed.
PERSIST_S = 900
PIPE_CHUNK = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)

# What ssh itself says when the connection, not the remote command, failed (exit 255).
_SSH_FAILURE = re.compile(
    r"(?m)^(ssh: |mux_client|client_loop|Connection to \S+ closed|Connection closed|"
    r"Control ?[Ss]ocket|Timeout, server|packet_write_wait|Read from remote host)"
    r"|Broken pipe|Connection reset"
)


def control_folder() -> Path | None:
    """A folder for control sockets that only this user can enter (else None)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) if runtime and os.path.isdir(runtime) else Path(tempfile.gettempdir())
    folder = base / f"dflashctl-ssh-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        return None  # someone else's, or open to others: no sockets there
    return folder


def _option_path(path: str) -> str:
    """A path as the value of `-o Key=value`: ssh splits a bare value at whitespace
    (a list of files) and expands `%` tokens, so such a path goes in double quotes
    with its `%` doubled."""
    path = path.replace("%", "%%")
    return f'"{path}"' if any(c.isspace() for c in path) else path


class OpenSSH:
    """`ssh` to one destination over a control master (see the module's docstring)."""

    def __init__(self, host: HostConfig, dest: SSHDestination, ssh: str, folder: Path) -> None:
        self.host = host
        self.dest = dest
        self.description = str(dest)
        options = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes"]
        options += ["-o", f"UserKnownHostsFile={_option_path(str(host.known_hosts))}"]
        options += ["-o", "GlobalKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
        # What a ~/.ssh/config may add that has no place in a command's connection.
        options += ["-o", "RemoteCommand=none", "-o", "ClearAllForwardings=yes"]
        options += ["-o", f"ConnectTimeout={max(1, math.ceil(host.connect_timeout_s))}"]
        if host.keepalive_s:
            options += ["-o", f"ServerAliveInterval={max(1, math.ceil(host.keepalive_s))}"]
        if os.environ.get(SSH_CONFIG_ENV):
            config = ssh_config_path()
            options += ["-F", str(config) if config.is_file() else "/dev/null"]
        for key in dest.identity_files:
            if Path(key).is_file():
                options += ["-i", key]
        if host.proxy_jump:
            options += ["-J", host.proxy_jump]
        options += ["-p", str(dest.port), "-l", dest.user]
        identity = "\0".join([ssh, host.address, str(dest), *options])
        name = hashlib.sha256(identity.encode()).hexdigest()[:20]
        self.control_path = str(folder / name)
        self._base = [ssh, *options, "-o", f"ControlPath={_option_path(self.control_path)}"]
        self._prestarted: dict[tuple[str, ...], subprocess.Popen] = {}

    def _argv(self, *extra: str) -> list[str]:
        return [*self._base, *extra, self.host.address]

    def master_running(self) -> bool:
        check = subprocess.run(
            self._argv("-O", "check"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=self.host.connect_timeout_s + 5,
        )
        return check.returncode == 0

    def start_master(self) -> str | None:
        """Make sure a master runs; None when it does, else why not (ssh's words)."""
        with open(self.control_path + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one master per target, however many deploys
            if os.path.exists(self.control_path):
                if self.master_running():
                    return None
                os.unlink(self.control_path)  # a dead master's: ssh would not listen there
            # -f: back to us once authenticated. Its stderr goes to a file: the master
            # lives on and would hold a pipe open.
            with tempfile.TemporaryFile() as said:
                try:
                    started = subprocess.run(
                        self._argv(
                            "-o",
                            "ControlMaster=yes",
                            "-o",
                            f"ControlPersist={PERSIST_S}",
                            "-N",
                            "-f",
                        ),
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=said,
                        timeout=self.host.connect_timeout_s * 3 + 10,
                    )
                except subprocess.TimeoutExpired:
                    return "ssh did not connect in time"
                said.seek(0)
                text = said.read(4096).decode(errors="replace").strip()
            if started.returncode != 0:
                return text or f"ssh exited with status {started.returncode}"
            return None

    def command_line(self, argv: Sequence[str]) -> list[str]:
        """The local command that runs `argv` on the host over the master."""
        return self._argv("-o", "ControlMaster=no", "-T") + ["--", shlex.join(map(str, argv))]

    def _popen(self, argv: list[str]) -> subprocess.Popen:
        process = subprocess.Popen(
            self.command_line(argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            bufsize=0,
        )
        try:  # a 1 MiB pipe to ssh, not 64 KiB: fewer wake-ups on both sides
            fcntl.fcntl(process.stdin.fileno(), F_SETPIPE_SZ, PIPE_CHUNK)  # type: ignore[union-attr]
        except OSError:
            pass
        return process

    def prestart(self, argv: Sequence[str]) -> None:
        """Start `argv` now, for the run() of the same argv that follows: its stdin
        stays open (the command waits on it) until run() writes it."""
        key = tuple(str(a) for a in argv)
        if key not in self._prestarted:
            # Started already by this process's first steps (dflashctl/ops/early_upload.py)?
            early = early_upload.take(self.command_line(key))
            self._prestarted[key] = early or self._popen(list(key))

    def discard_prestarted(self) -> None:
        """Close the stdin of every command started ahead and not run: each one sees
        its stdin end before it got a program, and ends having done nothing."""
        while self._prestarted:
            _, process = self._prestarted.popitem()
            for pipe in (process.stdin, process.stdout, process.stderr):
                try:
                    pipe.close()  # type: ignore[union-attr]
                except OSError:
                    pass
            try:
                process.wait(timeout=1)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def run(self, argv: Sequence[str], *, stdin: Stdin, timeout: float | None) -> CommandResult:
        """`argv` on the host with `stdin` streamed to it; check=False semantics."""
        argv = [str(a) for a in argv]
        process = self._prestarted.pop(tuple(argv), None)
        if process is not None and process.poll() is not None:
            # It ended before its stdin came (the container was not running yet when
            # it started, the connection dropped): this call is made afresh.
            self._prestarted[tuple(argv)] = process
            self.discard_prestarted()
            process = None
        process = process or self._popen(argv)
        outputs = [bytearray(), bytearray()]
        to_ssh = process.stdin
        assert to_ssh is not None
        feeder = StdinFeeder("openssh-stdin", stdin, to_ssh.write, to_ssh.close)
        readers = [
            threading.Thread(target=_drain, args=(pipe, into), daemon=True)
            for pipe, into in zip((process.stdout, process.stderr), outputs, strict=True)
        ]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for thread in [feeder, *readers]:
                thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
                if thread.is_alive():
                    raise CommandTimeout(argv, self.description, timeout or 0)
            status = process.wait(None if deadline is None else max(deadline - time.monotonic(), 1))
        except BaseException:
            process.kill()  # the channel closes: the agent sees its stdin end, builds nothing
            process.wait()
            raise
        stdout, stderr = bytes(outputs[0]), bytes(outputs[1])
        if feeder.error is not None:  # the input's own failure comes first
            raise feeder.error
        if status < 0 or (status == 255 and self._connection_failed(stderr)):
            # (< 0: ssh itself was killed, by a signal: the same for the command.)
            raise ConnectionLost(self.description, f"running `{shlex.join(argv)[:80]}`")
        return CommandResult(argv, status, stdout, stderr)

    def _connection_failed(self, stderr: bytes) -> bool:
        """Was exit status 255 ssh's own (the connection failed), not the command's?
        A mux client whose master lost its connection says nothing: the master is
        then gone."""
        if _SSH_FAILURE.search(stderr.decode(errors="replace")):
            return True
        try:
            return not self.master_running()
        except (OSError, subprocess.SubprocessError):
            return True


def _drain(pipe, into: bytearray) -> None:
    while chunk := pipe.read(PIPE_CHUNK):
        into += chunk


def connect(host: HostConfig, dest: SSHDestination) -> OpenSSH | None:
    """An OpenSSH runner with its master up, or None: use paramiko."""
    if os.environ.get(CLIENT_ENV, "").lower() == "paramiko" or dest.proxy_command:
        # (A ProxyCommand runs through paramiko's own handling, tested as such.)
        return None
    ssh = shutil.which("ssh")
    folder = control_folder()
    if ssh is None or folder is None:
        return None
    runner = OpenSSH(host, dest, ssh, folder)
    try:
        problem = runner.start_master()
    except (OSError, subprocess.SubprocessError):
        return None
    return None if problem else runner
