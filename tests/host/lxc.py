"""Real LXC containers for the test host (Debian's `lxc` package), stdlib only.

Every container of a test session shares one read-only busybox root filesystem (made
once per machine with `lxc-create -t busybox`, copied once per session), with its own
writable /root and /tmp bound in from the node's state folder, and the test interpreter
(and its venv, the checkout) bound in read-only. `/usr/local/bin/python3` in that root
runs the test interpreter: a stock Debian container keeps pip-installed tools there,
which `pct exec`'s forced PATH does not reach.

Names carry the pid of the test session (`dfl<pid>-<vmid>`): LXC's cgroups are named
after the container, and several sessions run the suite at once on one machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

CACHE = Path("/var/cache/dflashctl-tests")
NAME_PREFIX = "dfl"
# What lxc-create's busybox template binds, so its busybox and the interpreter find
# their shared libraries (lxc: templates/lxc-busybox.in).
LIBRARY_BINDS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64")


class LxcUnavailable(RuntimeError):
    """LXC cannot run containers on this machine (the suite falls back to bubblewrap)."""


def tools_missing() -> list[str]:
    return [t for t in ("lxc-create", "lxc-start", "lxc-attach", "lxc-stop") if not shutil.which(t)]


def version() -> str:
    try:
        return subprocess.run(
            ["lxc-start", "--version"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
    except OSError:
        return "?"


def session_prefix(pid: int | None = None) -> str:
    return f"{NAME_PREFIX}{pid or os.getpid()}-"


def _busybox_rootfs() -> Path:
    """The busybox template's root filesystem, made once per machine (4 s)."""
    ready = CACHE / "busybox" / "rootfs"
    if ready.is_dir():
        return ready
    CACHE.mkdir(parents=True, exist_ok=True)
    scratch = CACHE / f"create-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    config = scratch / "create.conf"
    config.write_text("lxc.net.0.type = empty\nlxc.apparmor.profile = unconfined\n")
    made = subprocess.run(
        ["lxc-create", "-P", str(scratch), "-n", "busybox", "-t", "busybox", "-f", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if made.returncode != 0:
        shutil.rmtree(scratch, ignore_errors=True)
        raise LxcUnavailable(f"lxc-create -t busybox failed: {made.stderr.strip()[-500:]}")
    try:
        (scratch / "busybox").rename(CACHE / "busybox")  # atomic: another session may race
    except OSError:
        pass
    shutil.rmtree(scratch, ignore_errors=True)
    return ready


def prepare_rootfs(dest: Path, ro_binds: list[str]) -> Path:
    """A session's shared root filesystem: busybox, mount points for the read-only
    binds, `/usr/bin/env`, and `/usr/local/bin/python3` running this interpreter."""
    shutil.copytree(_busybox_rootfs(), dest, symlinks=True)
    (dest / "usr" / "bin").mkdir(parents=True, exist_ok=True)
    env = dest / "usr" / "bin" / "env"
    if not env.exists():
        env.symlink_to("/bin/busybox")
    for path in ro_binds:
        (dest / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    local_bin = dest / "usr" / "local" / "bin"
    local_bin.mkdir(parents=True, exist_ok=True)
    wrapper = local_bin / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    # Only what a container needs from init: reap orphans. No gettys on consoles that
    # do not exist (they would respawn forever), no syslogd, no DHCP.
    (dest / "etc" / "inittab").write_text("::sysinit:/bin/true\n")
    return dest


def write_config(
    path: Path,
    *,
    hostname: str,
    rootfs: Path,
    root: Path,
    tmp: Path,
    ro_binds: list[str],
    netns: str | None = None,
    extra: list[str] = (),
) -> None:
    """netns: a network namespace (/proc/<pid>/ns/net) to join instead of an empty one
    of its own (tests/host/netns.py makes those); extra: more config lines (the GPU
    device binds and /dev/shm of a container with devN entries, state.py)."""
    network = [f"lxc.namespace.share.net = {netns}"] if netns else ["lxc.net.0.type = empty"]
    lines = [
        f"lxc.uts.name = {hostname}",
        f"lxc.rootfs.path = dir:{rootfs}",
        "lxc.rootfs.options = ro",
        *network,
        "lxc.apparmor.profile = unconfined",
        "lxc.autodev = 1",
        "lxc.tty.max = 0",
        "lxc.pty.max = 1",
        "lxc.cap.drop = sys_module mac_admin mac_override sys_time",
        "lxc.mount.auto = cgroup:mixed proc:mixed sys:ro",
        *(
            f"lxc.mount.entry = {lib} {lib.lstrip('/')} none ro,bind 0 0"
            for lib in LIBRARY_BINDS
            if os.path.isdir(lib)
        ),
        f"lxc.mount.entry = {root} root none rw,bind 0 0",
        f"lxc.mount.entry = {tmp} tmp none rw,bind 0 0",
        *(f"lxc.mount.entry = {p} {p.lstrip('/')} none ro,bind,create=dir 0 0" for p in ro_binds),
        *extra,
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def start(lxcpath: Path, name: str, log: Path, timeout: float = 20.0) -> int:
    """lxc-start -d, then the host pid of the container's init."""
    started = subprocess.run(
        ["lxc-start", "-P", str(lxcpath), "-n", name, "-d", "-o", str(log), "-l", "WARN"],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if started.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise LxcUnavailable(f"lxc-start failed: {started.stderr.strip()}\n{tail}")
    pid = init_pid(lxcpath, name)
    if pid is None:
        raise LxcUnavailable(f"lxc-start gave container {name} no init pid")
    return pid


def init_pid(lxcpath: Path, name: str) -> int | None:
    info = subprocess.run(
        ["lxc-info", "-P", str(lxcpath), "-n", name, "-p", "-H"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    text = info.stdout.strip()
    return int(text) if info.returncode == 0 and text.isdigit() else None


def stop(lxcpath: Path, name: str) -> None:
    """lxc-stop -k: SIGKILL to init; the kernel kills the rest of the container."""
    subprocess.run(
        ["lxc-stop", "-P", str(lxcpath), "-n", name, "-k"],
        capture_output=True,
        timeout=30,
        stdin=subprocess.DEVNULL,
    )


def attach_argv(lxcpath: Path, name: str, command: list[str], *, keep_env: bool) -> list[str]:
    env_flag = "--keep-env" if keep_env else "--clear-env"
    return ["lxc-attach", "-P", str(lxcpath), "-n", name, env_flag, "--", *command]


def reap_stale_containers() -> None:
    """Kill containers left by test sessions that died (their pid is in the name)."""
    for hierarchy in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup")):
        if not hierarchy.is_dir():
            continue
        for group in hierarchy.glob(f"lxc.payload.{NAME_PREFIX}*"):
            owner = group.name[len(f"lxc.payload.{NAME_PREFIX}") :].partition("-")[0]
            if not owner.isdigit() or Path(f"/proc/{owner}").exists():
                continue
            try:
                pids = [int(p) for p in (group / "cgroup.procs").read_text().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def probe(workdir: Path, ro_binds: list[str]) -> None:
    """Start and attach to one throw-away container; raise LxcUnavailable if that fails."""
    missing = tools_missing()
    if missing:
        raise LxcUnavailable(f"{', '.join(missing)} not installed (apt-get install lxc)")
    rootfs = prepare_rootfs(workdir / "rootfs", ro_binds)
    name = f"{session_prefix()}probe"
    lxcpath = workdir / "lxcpath"
    root, tmp = workdir / "probe-root", workdir / "probe-tmp"
    root.mkdir(parents=True, exist_ok=True)
    tmp.mkdir(parents=True, exist_ok=True)
    write_config(
        lxcpath / name / "config",
        hostname="probe",
        rootfs=rootfs,
        root=root,
        tmp=tmp,
        ro_binds=ro_binds,
    )
    try:
        start(lxcpath, name, workdir / "probe.log")
        attached = subprocess.run(
            attach_argv(lxcpath, name, [sys.executable, "-c", "print(1)"], keep_env=False),
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
        if attached.stdout.strip() != "1":
            raise LxcUnavailable(f"lxc-attach failed: {attached.stderr.strip()[-500:]}")
    finally:
        stop(lxcpath, name)
        shutil.rmtree(lxcpath / name, ignore_errors=True)
