"""An SSH host as dflashctl uses it: commands over paramiko (ssh.py), a deploy's
archive through the system's OpenSSH (openssh.py) when it can.

The paramiko connection, and paramiko itself (a tenth of a second to import), come
only when a command needs them: a redeploy whose only remote call is the archive's
(the machine remembers what it deployed last) runs over the OpenSSH master that the
last deploy left, with no handshake and no paramiko at all.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflashctl.config.schema import HostConfig
from dflashctl.remote.transport.base import (
    DEFAULT_TIMEOUT_S,
    CommandResult,
    Stdin,
    Stream,
    Transport,
)
from dflashctl.remote.transport.ssh_config import resolve_host

if TYPE_CHECKING:
    from dflashctl.remote.transport.openssh import OpenSSH
    from dflashctl.remote.transport.ssh import SSHTransport


class RemoteTransport(Transport):
    def __init__(self, host: HostConfig) -> None:
        self.host = host
        self.destination = resolve_host(host)
        self.description = str(self.destination)
        self._paramiko: SSHTransport | None = None
        self._openssh: OpenSSH | bool | None = None  # False: tried, not usable here
        self._lock = threading.Lock()
        self._openssh_lock = threading.Lock()  # (a master starting holds up no command)
        self._preparing: threading.Thread | None = None

    @property
    def paramiko(self) -> SSHTransport:
        """The paramiko transport (connecting lazily, on its first command)."""
        with self._lock:
            if self._paramiko is None:
                from dflashctl.remote.transport.ssh import SSHTransport

                self._paramiko = SSHTransport(self.host)
            return self._paramiko

    def openssh(self) -> OpenSSH | None:
        """The OpenSSH runner with its master up, or None (then paramiko does it all)."""
        with self._openssh_lock:
            if self._openssh is None:
                from dflashctl.remote.transport import openssh

                self._openssh = openssh.connect(self.host, self.destination) or False
            return self._openssh or None

    def prepare_bulk(self, argv: Sequence[str] | None = None) -> None:
        """Start the OpenSSH master in the background (a handshake, a few tenths of a
        second) while the deploy inspects the container and plans, and `argv` over it
        (its stdin left open for the run_bulk that follows: the session, `pct exec`
        and the agent's interpreter start meanwhile)."""
        if self._preparing is not None:
            return

        def prepare() -> None:
            runner = self.openssh()
            if runner is not None and argv is not None:
                runner.prestart(argv)

        self._preparing = threading.Thread(target=prepare, name="openssh-master", daemon=True)
        self._preparing.start()

    @property
    def saved_host_keys(self) -> list[str]:
        return self._paramiko.saved_host_keys if self._paramiko is not None else []

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        return self.paramiko.run(argv, stdin=stdin, timeout=timeout, check=check, env=env)

    def run_bulk(
        self, argv: Sequence[str], *, stdin: Stdin, timeout: float | None
    ) -> CommandResult:
        """Through the OpenSSH master when there is one to be had (ssh encrypts in C,
        paramiko in Python: see bench/README.md), else over paramiko."""
        if self._preparing is not None:
            self._preparing.join()
        runner = self.openssh()
        if runner is None:
            return self.paramiko.run(argv, stdin=stdin, timeout=timeout, check=False)
        return runner.run(argv, stdin=stdin, timeout=timeout)

    def bulk_command_line(self, argv: Sequence[str]) -> list[str] | None:
        """The local command run_bulk(argv) runs now, through the OpenSSH master (None:
        over paramiko, no command line to give)."""
        if self._preparing is not None:
            self._preparing.join()
        return self._openssh.command_line(argv) if self._openssh else None  # type: ignore[union-attr]

    def stream(self, argv: Sequence[str]) -> Stream:
        return self.paramiko.stream(argv)

    def put_file(self, local: Path | bytes, remote_path: str, *, mode: int = 0o644) -> None:
        self.paramiko.put_file(local, remote_path, mode=mode)

    def get_file(self, remote_path: str) -> bytes:
        return self.paramiko.get_file(remote_path)

    def close(self) -> None:
        # The OpenSSH master stays (ControlPersist): the next command reuses it. A
        # command started ahead that was not used gets its stdin closed: it ends.
        if self._preparing is not None:
            self._preparing.join()
        if self._openssh:
            self._openssh.discard_prestarted()  # type: ignore[union-attr]
        with self._lock:
            if self._paramiko is not None:
                self._paramiko.close()

    def __getattr__(self, name: str) -> Any:
        # Anything else the paramiko transport offers (its private state excepted).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.paramiko, name)
