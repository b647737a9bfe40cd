"""Where the trainer runs: an LXC container on the host (through pct), or the host itself.

Everything above this module (deploy, runs, logs, doctor) talks to a Target and does not
care which of the two it is.
"""

from __future__ import annotations

import hashlib
import secrets
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from dflashctl import pct
from dflashctl.errors import HostError
from dflashctl.transport.base import (
    DEFAULT_TIMEOUT_S,
    CommandFailed,
    CommandResult,
    Stream,
    Transport,
    read_local,
)

# One exec for the whole push (deploy speed counts round trips). Small files travel on
# its stdin into a private temporary file on the host; large ones go ahead by SFTP,
# which is faster for bulk data ($1 names that copy). pct copies the file into the
# container, what arrived is checked there, and the temporary file is removed whatever
# happened.
_STAGE = (
    'umask 077; staged=$1; if [ -z "$staged" ]; then '
    'staged=$(mktemp /tmp/.dflashctl-push-XXXXXXXX) || exit 1; cat > "$staged" || exit 1; fi\n'
)
STDIN_PUSH_LIMIT = 1 << 20


class ContainerStream(Stream):
    """A `pct exec` stream that turns pct's own failure (stopped or missing container)
    into its HostError at EOF, instead of an unexplained end of output."""

    def __init__(self, inner: Stream, vmid: int, argv: list[str]) -> None:
        self._inner = inner
        self._vmid = vmid
        self._argv = argv

    def read(self, timeout: float) -> bytes | None:
        data = self._inner.read(timeout)
        if data == b"":
            status = self._inner.exit_status
            if status:
                result = CommandResult(self._argv, status, b"", self._inner.stderr)
                pct.raise_for_pct(result, self._vmid, "exec")
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
        if self.vmid is None:
            return (
                self.transport.description
                if self.transport.description != "local"
                else "this machine"
            )
        where = self.transport.description
        return f"CT {self.vmid} on {'this machine' if where == 'local' else where}"

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
            outer = self.transport.run(
                pct.exec_argv(self.vmid, argv, env), stdin=stdin, timeout=timeout, check=False
            )
            pct.raise_for_pct(outer, self.vmid, "exec")
            result = CommandResult(argv, outer.exit_status, outer.stdout, outer.stderr)
        if check and result.exit_status != 0:
            raise CommandFailed(result, self.describe())
        return result

    def stream(self, argv: Sequence[str]) -> Stream:
        argv = [str(a) for a in argv]
        if self.vmid is None:
            return self.transport.stream(argv)
        return ContainerStream(
            self.transport.stream(pct.exec_argv(self.vmid, argv)), self.vmid, argv
        )

    def push(self, data: bytes | Path, dest: str, *, mode: int = 0o644) -> None:
        """Write one file at `dest`: an atomic put on the host, or through `pct push`
        (one exec: the bytes travel on its stdin).

        pct push writes in place (not atomic) and creates no folders; callers that need
        atomicity in a container push to a temporary name and rename with run(["mv", ...]).
        """
        if self.vmid is None:
            self.transport.put_file(data, dest, mode=mode)
            return
        payload = read_local(data)
        staged, stdin = "", payload
        if len(payload) > STDIN_PUSH_LIMIT:
            staged, stdin = f"/tmp/.dflashctl-push-{secrets.token_hex(6)}", None
            self.transport.put_file(payload, staged, mode=0o600)
        digest = hashlib.sha256(payload).hexdigest()
        check = pct.checked_argv(dest, len(payload), digest, ["true"])
        script = (
            _STAGE
            + pct.push_script(self.vmid, '"$staged"', dest, mode)
            + f"exec {shlex.join(pct.raw_exec_argv(self.vmid, check))}\n"
        )
        result = self.transport.run(["sh", "-c", script, "sh", staged], stdin=stdin, check=False)
        pct.raise_for_push(result, self.vmid, dest, len(payload), mode)

    def read_file(self, path: str) -> bytes:
        """A file's bytes (`cat` in the container, SFTP on the host)."""
        if self.vmid is None:
            return self.transport.get_file(path)
        result = self.run(["cat", "--", path], check=False)
        if result.exit_status != 0:
            reason = result.last_error_line().rpartition(": ")[2] or "cannot read it"
            raise HostError(f"cannot read {path} in {self.describe()}: {reason}")
        return result.stdout
