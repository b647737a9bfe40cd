"""Test-side handle on one container of the test host, for setting up and asserting.

Tests drive the container the way dflashctl does (ssh + pct); this handle looks at it
directly: its files on the host, its processes, a direct nsenter for checks.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from . import lxc, state
from .netns import Endpoint


def _ns_pid_link(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _status_field(pid: int, name: str) -> str | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(name + ":"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


class Container:
    """Container `vmid` of the node whose state lives in `state_dir`."""

    def __init__(self, state_dir: Path, vmid: int, *, network: Endpoint | None = None):
        self._ct = state.Container(Path(state_dir), vmid)
        self.vmid = vmid
        self.network = network  # its place on a test network (netns.Endpoint), if any
        self._own_monitors: list[int] = []  # sandbox monitors that are our children

    @property
    def root(self) -> Path:
        """The host folder that is /root inside the container."""
        return self._ct.rootfs_root

    @property
    def tmp(self) -> Path:
        """The host folder that is /tmp inside the container."""
        return self._ct.rootfs_tmp

    @property
    def address(self) -> str | None:
        """Its address on the test network (e.g. "10.231.0.1"), None without one."""
        return self.network.address if self.network else None

    @property
    def hostname(self) -> str:
        return self._ct.conf()["hostname"]

    def host_path(self, container_path: str) -> Path:
        """Host path of a file under the container's /root or /tmp."""
        for prefix, base in (("/root", self.root), ("/tmp", self.tmp)):
            if container_path == prefix or container_path.startswith(prefix + "/"):
                return base / container_path[len(prefix) :].lstrip("/")
        raise ValueError(f"{container_path}: only /root and /tmp are writable in the container")

    def init_pid(self) -> int | None:
        return self._ct.init_pid()

    def configure(self, **fields) -> None:
        """Change how the node treats this container (state.py lists the fields), e.g.
        configure(ha=1.0) or configure(start_warnings=["..."])."""
        self._ct.conf_path.write_text(json.dumps({**self._ct.conf(), **fields}))

    def is_running(self) -> bool:
        return self._ct.is_running()

    def start(self) -> None:
        # Started from this process, so the sandbox's monitor is our child and is reaped
        # in stop()/destroy() (rather than becoming an orphan nobody reaps), and the
        # container dies with this process if the test run is killed.
        with state.config_lock(self._ct):
            state.start_container(self._ct, die_with_parent=True)
        monitor = self._ct.monitor_pid()
        if monitor is not None:
            self._own_monitors.append(monitor)

    def stop(self) -> None:
        with state.config_lock(self._ct):
            state.stop_container(self._ct)
        self._reap_monitors()

    def destroy(self) -> None:
        """Kill everything in the container and remove its state."""
        state.destroy_container(self._ct)
        self._reap_monitors()

    def _reap_monitors(self) -> None:
        still_running = []
        for pid in self._own_monitors:
            try:
                done, _ = os.waitpid(pid, 0 if self._ct.init_pid() is None else os.WNOHANG)
            except ChildProcessError:
                continue
            if not done:
                still_running.append(pid)
        self._own_monitors = still_running

    def exec(
        self,
        argv: Sequence[str],
        input: bytes | str | None = None,
        *,
        timeout: float = 60,
        cwd: str = "/root",
    ) -> subprocess.CompletedProcess:
        """Run argv in the container directly (nsenter, as pct exec does), for checks.
        Output is text when `input` is text or None, bytes when `input` is bytes."""
        pid = self._ct.init_pid()
        if pid is None:
            raise RuntimeError(f"container {self.vmid} is not running")
        env = {"PATH": state.CONTAINER_PATH, "HOME": "/root", "container": "lxc"}
        if state.container_kind(self._ct.root_dir) == "lxc":
            # nsenter's --wd would leave the process outside LXC's pivoted root.
            in_cwd = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', cwd, *argv]
            command = lxc.attach_argv(self._ct.lxcpath, self._ct.lxc_name, in_cwd, keep_env=True)
        else:
            command = [
                "nsenter",
                "-t",
                str(pid),
                "-p",
                "-u",
                "-n",
                "-m",
                "-r",
                f"--wd={cwd}",
                "--",
                *argv,
            ]
        return subprocess.run(
            command,
            input=input,
            capture_output=True,
            text=not isinstance(input, bytes),
            timeout=timeout,
            env=env,
        )

    def pids(self) -> list[int]:
        """Host pids of every process in the container, its pid 1 included."""
        init = self._ct.init_pid()
        if init is None:
            return []
        namespace = _ns_pid_link(init)
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and _ns_pid_link(int(entry)) == namespace:
                found.append(int(entry))
        return sorted(found)

    def ps(self) -> list[tuple[int, str]]:
        """(pid inside the container, command line) of every process in it, by pid."""
        rows = []
        for pid in self.pids():
            nspid = _status_field(pid, "NSpid")
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if nspid:
                rows.append(
                    (
                        int(nspid.split()[-1]),
                        cmdline.replace(b"\0", b" ").decode(errors="replace").strip(),
                    )
                )
        return sorted(rows)
