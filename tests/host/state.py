"""State of the stand-in Proxmox node: its containers, their sandboxes and its tasks.

Shared by the `pct` and `pvesh` stand-ins (run by sshd sessions, stdlib only) and by the
test fixtures. Everything lives under one state folder ($FAKEPVE_STATE):

    host.json                 node name, extra read-only binds for the sandboxes
    lxc/<vmid>/conf.json      vmid, hostname, memory, cores
    lxc/<vmid>/root/          the container's /root (writable, survives stop/start)
    lxc/<vmid>/tmp/           the container's /tmp
    lxc/<vmid>/init           "<host pid> <start time>" of the container's pid 1 while running
    lxc/<vmid>/monitor        the same for the bwrap process that waits on it
    lxc/<vmid>/console.log    bwrap's or lxc-start's own output (setup errors)
    lxc/<vmid>/conf.json      may also hold `start_warnings` (prestart-hook warnings),
                              `ha` (HA-managed), `start_delay_s` (a slow start),
                              `netns` ("<holder pid> <start time>": the network
                              namespace the container runs in, see netns.py)
    lxc-rootfs/, lxcpath/     with real LXC (host.json "containers": "lxc"): the shared
                              read-only root filesystem and each container's lxc config
    tasks/<n>.json            finished tasks (UPIDs) for /nodes/<node>/tasks/<upid>/status
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

try:  # imported by the tests as tests.host.<module>
    from . import lxc, pve_conf
except ImportError:  # run as bin/pct or bin/pvesh, with this folder on sys.path
    import lxc
    import pve_conf

STATE_ENV = "FAKEPVE_STATE"
DEFAULT_NODE = "pve"
# lxc-attach's default PATH when the environment is cleared (lxc: src/lxc/attach.c).
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class PveError(Exception):
    """An error the real tool would print on stderr, with its exit status."""

    def __init__(self, message: str, exit_code: int = 255):
        super().__init__(message)
        self.exit_code = exit_code


def state_dir() -> Path:
    value = os.environ.get(STATE_ENV)
    if not value:
        raise PveError(f"{STATE_ENV} is not set: this stand-in only runs inside the test host")
    return Path(value)


def host_settings(root: Path) -> dict:
    path = root / "host.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"node": DEFAULT_NODE, "ro_binds": []}


def node_name(root: Path) -> str:
    return host_settings(root).get("node", DEFAULT_NODE)


def container_kind(root: Path) -> str:
    """ "lxc" (real LXC containers) or "bwrap" (bubblewrap sandboxes, the fallback)."""
    return host_settings(root).get("containers", "bwrap")


def process_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process; None if gone or a zombie.

    Stored next to each pid so that a recycled pid is never mistaken for the container.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _read_pid_file(path: Path) -> int | None:
    try:
        pid_text, start_text = path.read_text().split()
    except (FileNotFoundError, ValueError):
        return None
    pid = int(pid_text)
    return pid if process_start_time(pid) == int(start_text) else None


def _write_pid_file(path: Path, pid: int) -> None:
    path.write_text(f"{pid} {process_start_time(pid)}\n")


@dataclass
class Container:
    root_dir: Path  # the state folder of the whole node
    vmid: int

    @property
    def dir(self) -> Path:
        return self.root_dir / "lxc" / str(self.vmid)

    @property
    def conf_path(self) -> Path:
        return self.dir / "conf.json"

    @property
    def rootfs_root(self) -> Path:
        return self.dir / "root"

    @property
    def rootfs_tmp(self) -> Path:
        return self.dir / "tmp"

    @property
    def lxc_name(self) -> str:
        return f"{host_settings(self.root_dir)['lxc_prefix']}{self.vmid}"

    @property
    def lxcpath(self) -> Path:
        return self.root_dir / "lxcpath"

    def exists(self) -> bool:
        return self.conf_path.exists()

    def conf(self) -> dict:
        return json.loads(self.conf_path.read_text())

    def pve_config(self) -> dict:
        """The container's configuration as `pct config` / GET .../lxc/<vmid>/config show it."""
        written = pve_conf.load(self.root_dir, self.vmid)
        if written is not None:  # made or changed by `pct create` / `pct set`
            digest = hashlib.sha1(written.text().encode()).hexdigest()
            return {**written.main.options, "digest": digest}
        conf = self.conf()
        return {
            "arch": "amd64",
            "cores": conf["cores"],
            "hostname": conf["hostname"],
            "memory": conf["memory"],
            "ostype": "debian",
            "rootfs": f"local-lvm:vm-{self.vmid}-disk-0,size=8G",
            "swap": 512,
            "digest": hashlib.sha1(self.conf_path.read_bytes()).hexdigest(),
        }

    def raw_lxc(self) -> list[tuple[str, str]]:
        """The raw `lxc.*` lines of its config file, in order (pct config prints them last)."""
        written = pve_conf.load(self.root_dir, self.vmid)
        return written.main.raw if written is not None else []

    def init_pid(self) -> int | None:
        """Host pid of the container's pid 1, or None when the container is stopped."""
        return _read_pid_file(self.dir / "init")

    def monitor_pid(self) -> int | None:
        return _read_pid_file(self.dir / "monitor")

    def is_running(self) -> bool:
        return self.init_pid() is not None

    def netns_path(self) -> str | None:
        """The network namespace the container joins (/proc/<holder>/ns/net), None for
        one of its own (LXC) or the host's (bubblewrap). A gone holder is an error: the
        container would start without its network."""
        entry = self.conf().get("netns")
        if not entry:
            return None
        pid, start = (int(x) for x in entry.split())
        if process_start_time(pid) != start:
            raise PveError(
                f"startup for container '{self.vmid}' failed\n"
                f"its network namespace (holder pid {pid}) is gone",
                255,
            )
        return f"/proc/{pid}/ns/net"

    def started_at(self) -> float | None:
        try:
            return float((self.dir / "started_at").read_text())
        except (FileNotFoundError, ValueError):
            return None


@contextlib.contextmanager
def config_lock(ct: Container, timeout: float = 10.0):
    """Serialise start/stop/push of one container, as pct's lock_config does."""
    ct.dir.mkdir(parents=True, exist_ok=True)
    with open(ct.dir / "lock", "w") as lock:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    # PVE::Tools::lock_file_full, on timeout
                    raise PveError(
                        f"can't lock file '/run/lock/lxc/pve-config-{ct.vmid}.lock' - got timeout"
                    ) from None
                time.sleep(0.01)
        yield


def create_container(
    root: Path,
    vmid: int,
    hostname: str | None = None,
    *,
    memory_mb: int = 2048,
    cores: int = 2,
    netns: str | None = None,
) -> Container:
    ct = Container(root, vmid)
    ct.rootfs_root.mkdir(parents=True, exist_ok=True)
    ct.rootfs_tmp.mkdir(parents=True, exist_ok=True)
    ct.rootfs_tmp.chmod(0o1777)
    conf = {"vmid": vmid, "hostname": hostname or f"ct{vmid}", "memory": memory_mb, "cores": cores}
    if netns:
        conf["netns"] = netns
    ct.conf_path.write_text(json.dumps(conf))
    return ct


def load_container(root: Path, vmid: int | str) -> Container:
    """The container, or the error the real tools give for a vmid without a config.

    PVE::LXC::Config->load_config dies with this text (pve-container,
    src/PVE/AbstractConfig.pm); perl's die exits with errno, ENOENT (2) here.
    """
    try:
        number = int(vmid)
    except ValueError:
        raise PveError(
            f"400 Parameter verification failed.\nvmid: type check ('integer') "
            f"failed - got '{vmid}'",
            255,
        ) from None
    ct = Container(root, number)
    if not ct.exists():
        node = node_name(root)
        raise PveError(f"Configuration file 'nodes/{node}/lxc/{number}.conf' does not exist", 2)
    return ct


def list_containers(root: Path) -> list[Container]:
    base = root / "lxc"
    if not base.exists():
        return []
    found = [Container(root, int(p.name)) for p in base.iterdir() if p.name.isdigit()]
    return sorted((ct for ct in found if ct.exists()), key=lambda ct: ct.vmid)


def _sandbox_argv(ct: Container, settings: dict, info_fd: int, die_with_parent: bool) -> list[str]:
    argv = [
        "bwrap",
        "--unshare-pid",
        "--unshare-uts",
        "--hostname",
        ct.conf()["hostname"],
        "--ro-bind",
        "/",
        "/",
        "--bind",
        str(ct.rootfs_root),
        "/root",
        "--bind",
        str(ct.rootfs_tmp),
        "/tmp",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]
    # The private /root hides whatever the host keeps there (the Python interpreter under
    # /root/.pyenv, a checkout under /root): bind those back, read-only.
    for path in settings.get("ro_binds", []):
        argv += ["--ro-bind", path, path]
    if settings.get("local_bin"):  # /usr/local/bin/python3, as in the LXC containers
        argv += ["--ro-bind", settings["local_bin"], "/usr/local/bin"]
    if ct.conf().get("netns") and os.path.isfile("/etc/resolv.conf"):
        # On a test network the host's name server lies out of reach: lookups would wait
        # for it to time out (seconds each). No DNS instead, as in the LXC containers
        # (no resolv.conf: the resolver asks 127.0.0.1, which refuses at once).
        resolv = ct.dir / "resolv.conf"
        resolv.write_text("nameserver 127.0.0.1\n")
        argv += ["--ro-bind", str(resolv), "/etc/resolv.conf"]
    argv += _gpu_sandbox_args(ct)
    if die_with_parent:
        argv.append("--die-with-parent")
    argv += ["--chdir", "/", "--info-fd", str(info_fd), "--"]
    # pid 1 is bwrap's own init (it reaps orphans); this shell is pid 2. It tells the
    # starter on stdout that the mounts are in place, then sleeps until the container is
    # stopped.
    init = "echo ready; exec >/dev/null; exec sleep infinity"
    return argv + ["/bin/sh", "-c", init]


FAKE_DRIVER_DIR = "/dev/.fake-nvidia-driver"  # where the fake nvidia-smi reads the host's


def gpu_passthrough(ct: Container) -> tuple[list[tuple[Path, str]], int | None, Path | None]:
    """What a start gives the container of the host root's GPU files: (device node, path
    inside) binds from its devN entries and raw mount entries, the size of a raw tmpfs
    /dev/shm entry, and the host's driver folder (proc/driver/nvidia, for the fake
    nvidia-smi) once /dev/nvidiactl is passed through. A devN whose node is missing on
    the host stops the start, as PVE's does (`Device /dev/x does not exist`)."""
    written = pve_conf.load(ct.root_dir, ct.vmid)
    if written is None:
        return [], None, None
    try:
        binds = pve_conf.passthrough(ct.root_dir, written)
    except LookupError as err:
        raise PveError(f"startup for container '{ct.vmid}' failed\n{err}", 255) from None
    driver = pve_conf.host_root(ct.root_dir) / "proc" / "driver" / "nvidia"
    has_ctl = any(inside == "/dev/nvidiactl" for _, inside in binds)
    return (
        binds,
        pve_conf.shm_size_bytes(written.main.raw),
        driver if has_ctl and driver.is_dir() else None,
    )


def _gpu_sandbox_args(ct: Container) -> list[str]:
    binds, shm, driver = gpu_passthrough(ct)
    args: list[str] = []
    for node, inside in binds:
        args += ["--dev-bind", str(node), inside]
    if shm is not None:
        args += ["--size", str(shm), "--tmpfs", "/dev/shm"]
    if driver is not None:
        args += ["--ro-bind", str(driver), FAKE_DRIVER_DIR]
    return args


def _gpu_lxc_lines(ct: Container) -> list[str]:
    binds, shm, driver = gpu_passthrough(ct)
    lines = [
        f"lxc.mount.entry = {node} {inside.lstrip('/')} none bind,create=file 0 0"
        for node, inside in binds
    ]
    if shm is not None:
        lines.append(
            f"lxc.mount.entry = tmpfs dev/shm tmpfs rw,nosuid,nodev,size={shm},create=dir 0 0"
        )
    if driver is not None:
        lines.append(
            f"lxc.mount.entry = {driver} {FAKE_DRIVER_DIR.lstrip('/')} none ro,bind,create=dir 0 0"
        )
    return lines


def start_container(ct: Container, timeout: float = 10.0, *, die_with_parent: bool = False) -> int:
    """Start the sandbox fully detached (own session, no stdio of ours) and wait until its
    mounts are ready. Returns the host pid of its pid 1.

    die_with_parent: the container dies with the calling thread's process (for containers
    a test process starts itself, so that a killed test run leaves none behind).
    """
    if ct.is_running():
        # pve-container, src/PVE/API2/LXC/Status.pm (vm_start)
        raise PveError(f"CT {ct.vmid} already running")
    settings = host_settings(ct.root_dir)
    netns = ct.netns_path()
    if settings.get("containers") == "lxc":
        return _start_lxc(ct, settings, netns)
    info_r, info_w = os.pipe()
    ready_r, ready_w = os.pipe()
    log = open(ct.dir / "console.log", "ab")
    try:
        argv = _sandbox_argv(ct, settings, info_w, die_with_parent)
        if netns:
            # bwrap joins the network namespace it starts in (no --unshare-net); nsenter
            # execs it, so --die-with-parent still names this process.
            argv = ["nsenter", f"--net={netns}", "--", *argv]
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=ready_w,
            stderr=log,
            pass_fds=(info_w,),
            start_new_session=True,
            close_fds=True,
        )
    finally:
        log.close()
        os.close(info_w)
        os.close(ready_w)
    try:
        info = _read_until_eof_or(info_r, b"}", timeout)
        ready = _read_until_eof_or(ready_r, b"ready", timeout)
    finally:
        os.close(ready_r)
        os.close(info_r)
    init_pid = json.loads(info)["child-pid"] if info else None
    if not ready:
        for pid in (init_pid, proc.pid):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()
        tail = (ct.dir / "console.log").read_text(errors="replace")[-2000:]
        raise PveError(f"startup for container '{ct.vmid}' failed\n{tail}", 255)
    _write_pid_file(ct.dir / "monitor", proc.pid)
    _write_pid_file(ct.dir / "init", init_pid)
    (ct.dir / "started_at").write_text(f"{time.time()}\n")
    # Deliberately not waited for: the sandbox outlives this process, like lxc-start's
    # monitor. Whoever inherits it (a subreaper) reaps it.
    proc.returncode = 0  # keeps Popen.__del__ from warning about a running child
    return init_pid


def _start_lxc(ct: Container, settings: dict, netns: str | None) -> int:
    lxc.write_config(
        ct.lxcpath / ct.lxc_name / "config",
        hostname=ct.conf()["hostname"],
        rootfs=Path(settings["lxc_rootfs"]),
        root=ct.rootfs_root,
        tmp=ct.rootfs_tmp,
        ro_binds=settings.get("ro_binds", []),
        netns=netns,
        extra=_gpu_lxc_lines(ct),
    )
    try:
        init_pid = lxc.start(ct.lxcpath, ct.lxc_name, ct.dir / "console.log")
    except lxc.LxcUnavailable as err:
        raise PveError(f"startup for container '{ct.vmid}' failed\n{err}", 255) from None
    _write_pid_file(ct.dir / "init", init_pid)
    (ct.dir / "started_at").write_text(f"{time.time()}\n")
    return init_pid


def _read_until_eof_or(fd: int, marker: bytes, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    data = b""
    while marker not in data:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return b""
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        data += chunk
    return data if marker in data else b""


def stop_container(ct: Container, timeout: float = 10.0) -> None:
    """Kill the container's pid 1; the kernel then kills everything in its pid namespace.

    Returns once pid 1 is gone (it exits only after every process in the namespace has).
    """
    pid = ct.init_pid()
    if pid is None:
        # pve-container, src/PVE/API2/LXC/Status.pm (vm_stop)
        raise PveError(f"CT {ct.vmid} not running")
    if container_kind(ct.root_dir) == "lxc":
        lxc.stop(ct.lxcpath, ct.lxc_name)
    else:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while ct.init_pid() is not None:
        if time.monotonic() > deadline:
            raise PveError(f"CT {ct.vmid}: init {pid} did not exit after SIGKILL")
        time.sleep(0.01)
    (ct.dir / "init").unlink(missing_ok=True)
    (ct.dir / "started_at").unlink(missing_ok=True)


def destroy_container(ct: Container) -> None:
    if ct.is_running():
        stop_container(ct)
    if container_kind(ct.root_dir) == "lxc":
        shutil.rmtree(ct.lxcpath / ct.lxc_name, ignore_errors=True)
    shutil.rmtree(ct.dir, ignore_errors=True)
    pve_conf.conf_path(ct.root_dir, ct.vmid).unlink(missing_ok=True)


def record_task(
    root: Path,
    kind: str,
    vmid: int,
    exitstatus: str = "OK",
    *,
    user: str = "root@pam",
    running: bool = False,
    pid: int | None = None,
) -> str:
    """A finished task (or, with `running`, one still running: finish_task ends it);
    returns its UPID in the real format
    UPID:<node>:<pid hex8>:<pstart hex8>:<starttime hex8>:<type>:<id>:<user>:"""
    node = node_name(root)
    pid = pid or os.getpid()
    started = int(time.time())
    upid = (
        f"UPID:{node}:{pid:08X}:{process_start_time(pid) or 0:08X}:{started:08X}:"
        f"{kind}:{vmid}:{user}:"
    )
    tasks = root / "tasks"
    tasks.mkdir(exist_ok=True)
    record = {
        "upid": upid,
        "node": node,
        "pid": pid,
        "pstart": process_start_time(pid) or 0,
        "starttime": started,
        "type": kind,
        "id": str(vmid),
        "user": user,
        "status": "running" if running else "stopped",
    }
    if not running:  # the real API has no exitstatus while a task runs
        record["exitstatus"] = exitstatus
    name = f"{pid}-{started}-{kind}-{vmid}-{time.monotonic_ns()}.json"
    (tasks / name).write_text(json.dumps(record))
    return upid


def finish_task(root: Path, upid: str, exitstatus: str) -> None:
    """A running task's end: `stopped` with its exit status (`OK`, `WARNINGS: N`, an error)."""
    for path in (root / "tasks").glob("*.json"):
        record = json.loads(path.read_text())
        if record["upid"] == upid:
            record.update(status="stopped", exitstatus=exitstatus, endtime=int(time.time()))
            temporary = path.with_suffix(".tmp")
            temporary.write_text(json.dumps(record))
            temporary.rename(path)  # a reader never sees half a record
            return


def find_task(root: Path, upid: str) -> dict | None:
    tasks = root / "tasks"
    if not tasks.exists():
        return None
    for path in tasks.glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:  # replaced by finish_task while we listed
            continue
        if record["upid"] == upid:
            return record
    return None
