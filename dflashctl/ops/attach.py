"""`dflashctl exec` and `dflashctl shell`: a command in the container, attached to this
terminal, in the run's environment (the agent's exec verb, agent/exec_env.py).

Over SSH the command is `pct exec <vmid> -- ...` on a session channel that this
module pumps: stdin goes there, stdout and stderr come back apart, and the exit status
is the command's. With `tty`, the channel gets a pty (as `ssh -t`): `pct exec` then
sees a terminal and lxc-attach gives the command one inside the container; this
terminal is put in raw mode meanwhile, and its size follows SIGWINCH.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

from dflashctl.config.schema import Config
from dflashctl.errors import HostError
from dflashctl.ops import setup_env
from dflashctl.remote import agent_client, pct
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport.base import CommandResult, ConnectionLost

# An interactive shell: bash where there is one (with the user's ~/.bashrc), else sh.
SHELL = ["/bin/sh", "-c", "command -v bash >/dev/null 2>&1 && exec bash -i; exec sh -i"]


def remote_argv(config: Config, target: Target, ticket: str) -> list[str]:
    """What runs on the host: the agent's exec verb, through pct exec for a container.
    It names only the ticket that holds the parameters (trainer.env's secrets are not
    to be read in /proc/*/cmdline)."""
    inner = [
        config.container.python,
        "-S",
        "-c",
        agent_client.bootstrap("exec", {"ticket": ticket}, with_bundle=False),
        "DFLASH-EXEC",
    ]
    return pct.exec_argv(target.vmid, inner) if target.vmid is not None else inner


def leave_ticket(config: Config, target: Target, argv: list[str], *, describe: bool) -> str:
    """The exec's parameters kept in the container, sent on the agent's stdin (this
    call also makes the container keep the agent the exec verb runs)."""
    params = {
        "workdir": config.container.workdir,
        "argv": argv,
        "env": dict(config.trainer.env),
        "python": config.container.python,
        "setup": setup_env.setup_params(config),
        "describe": describe,
    }
    return agent_client.call_agent(target, config.container.python, "exec_ticket", params)["ticket"]


def run_attached(config: Config, target: Target, argv: list[str], *, tty: bool) -> int:
    """Run argv there, attached to this process's stdio; returns its exit status."""
    full = remote_argv(config, target, leave_ticket(config, target, argv, describe=tty))
    transport = target.transport
    if not hasattr(transport, "interactive_channel"):  # the local transport: our own stdio
        try:
            status = subprocess.call(full)
        except OSError as exc:
            raise HostError(f"cannot start `{full[0]}`: {exc.strerror}") from None
        tail = b""
    else:
        status, tail = _pump(transport, full, tty)
    if target.vmid is not None and status != 0:
        # pct's own failure (a stopped or missing container), not the command's.
        pct.raise_for_pct(CommandResult(full, status, b"", tail), target.vmid)
    return status


def _terminal_size() -> tuple[int, int]:
    size = shutil.get_terminal_size((80, 24))
    return size.columns, size.lines


@contextlib.contextmanager
def _raw_terminal(tty: bool) -> Iterator[None]:
    if not (tty and os.isatty(0)):
        yield
        return
    import termios
    import tty as ttymod

    saved = termios.tcgetattr(0)
    try:
        ttymod.setraw(0)
        yield
    finally:
        termios.tcsetattr(0, termios.TCSADRAIN, saved)


def _pump(transport: Any, full: list[str], tty: bool) -> tuple[int, bytes]:
    """Move bytes between this terminal and the channel until the command ends;
    (exit status, the last bytes of its stderr, or of its output with a pty)."""
    chan = transport.interactive_channel(full, pty_size=_terminal_size() if tty else None)
    tail = bytearray()
    stop = threading.Event()

    def feed() -> None:  # stdin -> the command; EOF here is EOF there
        try:
            while not stop.is_set():
                ready, _, _ = select.select([0], [], [], 0.2)
                if not ready:
                    continue
                data = os.read(0, 32768)
                if not data:
                    chan.shutdown_write()
                    return
                chan.sendall(data)
        except (OSError, EOFError, ValueError):
            pass

    previous = None
    if tty and threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGWINCH, lambda *_: chan.resize_pty(*_terminal_size()))
    feeder = threading.Thread(target=feed, name="exec-stdin", daemon=True)
    try:
        with _raw_terminal(tty):
            feeder.start()
            while True:
                moved = False
                if chan.recv_ready():
                    data = chan.recv(65536)
                    _write(1, data)
                    if tty:
                        tail[:] = (tail + data)[-4096:]
                    moved = True
                if chan.recv_stderr_ready():
                    data = chan.recv_stderr(65536)
                    _write(2, data)
                    tail[:] = (tail + data)[-4096:]
                    moved = True
                if moved:
                    continue
                if (
                    chan.exit_status_ready()
                    and not chan.recv_ready()
                    and not chan.recv_stderr_ready()
                ):
                    break
                if chan.closed or (chan.eof_received and chan.exit_status_ready()):
                    continue
                select.select([chan], [], [], 0.05)
    finally:
        stop.set()
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
    status = chan.recv_exit_status()
    chan.close()
    if status == -1:
        raise ConnectionLost(transport.description, "the command was running")
    return status, bytes(tail)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            select.select([], [fd], [], 1.0)
            continue
        view = view[written:]
    if fd == 1:
        sys.stdout.flush()


def pick_node(nodes: list[Any], wanted: str | None) -> Any:
    """--node: a node's name or its index (0 is the first, rank 0's); default the first."""
    from dflashctl.errors import UsageError

    if wanted is None:
        return nodes[0]
    for node in nodes:
        if wanted in (node.name, str(node.index)):
            return node
    names = ", ".join(f"{n.index} ({n.name})" for n in nodes)
    raise UsageError(f"no node {wanted!r} in the config", hint=f"--node takes one of: {names}")
