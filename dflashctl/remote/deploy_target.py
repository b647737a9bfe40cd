"""Where the trainer runs: an LXC container on the host (through pct), or the host itself.

Everything above this module (deploy, runs, logs, doctor) talks to a Target and does not
care which of the two it is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dflashctl.remote import pct
from dflashctl.remote.transport.base import (
    DEFAULT_TIMEOUT_S,
    CommandFailed,
    CommandResult,
    Stream,
    Transport,
)


class ContainerStream(Stream):
    """A `pct exec` stream that turns pct's own failure (stopped or missing container)
    into its HostError at EOF, instead of an unexplained end of output."""

    def __init__(self, inner: Stream, vmid: int, argv: list[str], where: str) -> None:
        self._inner = inner
        self._vmid = vmid
        self._argv = argv
        self._where = where

    def read(self, timeout: float) -> bytes | None:
        data = self._inner.read(timeout)
        if data == b"":
            status = self._inner.exit_status
            if status:
                result = CommandResult(self._argv, status, b"", self._inner.stderr)
                pct.raise_for_pct(result, self._vmid, self._where)
        return data

    @property
    def exit_status(self) -> int | None:  # type: ignore[override]
        return self._inner.exit_status

    @property
    def stderr(self) -> bytes:
        return self._inner.stderr

    def close(self) -> None:
        self._inner.close()


class Target:
    def __init__(self, transport: Transport, vmid: int | None) -> None:
        self.transport = transport
        self.vmid = vmid

    def describe(self) -> str:
        """For messages: "CT 200 on root@127.0.0.1:2222", or the host alone."""
        where = self.transport.description
        where = "this machine" if where == "local" else where
        return where if self.vmid is None else f"CT {self.vmid} on {where}"

    def __str__(self) -> str:
        return self.describe()

    def close(self) -> None:
        self.transport.close()

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | None = None,
        timeout: float | None = DEFAULT_TIMEOUT_S,
        check: bool = True,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run argv in the container (`pct exec <vmid> -- argv`) or on the host.

        A stopped or missing container always raises its own HostError; a non-zero
        status of the command itself raises CommandFailed only with check=True.
        """
        argv = [str(a) for a in argv]
        if self.vmid is None:
            result = self.transport.run(argv, stdin=stdin, timeout=timeout, check=False, env=env)
        else:
            # A root login's environment there plus `env`, not the SSH session's.
            outer = self.transport.run(
                pct.exec_argv(self.vmid, argv, env), stdin=stdin, timeout=timeout, check=False
            )
            pct.raise_for_pct(outer, self.vmid, self.transport.description)
            result = CommandResult(argv, outer.exit_status, outer.stdout, outer.stderr)
        if check and result.exit_status != 0:
            raise CommandFailed(result, self.describe())
        return result

    def stream(self, argv: Sequence[str]) -> Stream:
        argv = [str(a) for a in argv]
        if self.vmid is None:
            return self.transport.stream(argv)
        return ContainerStream(
            self.transport.stream(pct.exec_argv(self.vmid, argv)),
            self.vmid,
            argv,
            self.transport.description,
        )
