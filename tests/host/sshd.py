"""A real OpenSSH sshd on 127.0.0.1 whose sessions find the `pct` and `pvesh` stand-ins.

The server gets its own ed25519 host key and accepts one client key; clients are expected
to check the host key strictly against `known_hosts` (written in the `[127.0.0.1]:PORT`
form OpenSSH and paramiko use for non-default ports).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HOST_DIR = Path(__file__).resolve().parent
STANDIN_BIN = HOST_DIR / "bin"
SESSION_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SSHD = "/usr/sbin/sshd"
# Newer OpenSSH (9.8+) penalises a source address after failed or dropped connections and
# would then refuse the tests' next connections from 127.0.0.1. Older sshd does not know
# these options: they are kept only where `sshd -t` accepts them.
OPTIONAL_SETTINGS = ["PerSourcePenalties no", "PerSourceMaxStartups none"]


class SshdFailed(RuntimeError):
    pass


def generate_key(path: Path, comment: str) -> Path:
    """A new passphrase-less ed25519 key pair (path and path.pub)."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )
    return path


def write_known_hosts(path: Path, *servers: SshServer) -> Path:
    """One known_hosts file that trusts every one of `servers` (each by its own key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{server.host_key_line}\n" for server in servers))
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@dataclass
class SshServer:
    """One sshd under a reaper (tests/host/reaper.py), with its keys and files in `workdir`."""

    workdir: Path
    state_dir: Path
    address: str = "127.0.0.1"
    user: str = "root"
    node: str = "pve"  # the Proxmox node name pvesh answers for
    port: int = 0
    host_key_line: str = ""
    # A client key this server accepts instead of one of its own (one key for all hosts).
    client_key: Path | None = None
    _process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def identity_file(self) -> Path:
        return self.client_key or self.workdir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.workdir / "known_hosts"

    @property
    def sshd_log(self) -> Path:
        return self.workdir / "sshd.log"

    @property
    def host_key(self) -> Path:
        return self.workdir / "ssh_host_ed25519_key"

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, timeout: float = 15.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        generate_key(self.host_key, "test-host")
        if self.client_key is None:
            generate_key(self.identity_file, "test-client")
        (self.workdir / "authorized_keys").write_text(Path(f"{self.identity_file}.pub").read_text())
        # sshd refuses to start without its privilege separation directory.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        last_error = None
        for _attempt in range(3):  # another process may take the free port before sshd
            self.port = _free_port()
            self._write_config()
            try:
                self._launch(timeout)
                break
            except SshdFailed as err:
                last_error = err
                self.stop()
        else:
            raise last_error
        key_type, key_b64 = self.host_key.with_suffix(".pub").read_text().split()[:2]
        self.host_key_line = f"[{self.address}]:{self.port} {key_type} {key_b64}"
        self.known_hosts.write_text(self.host_key_line + "\n")

    def _write_config(self) -> None:
        config = f"""\
ListenAddress {self.address}
Port {self.port}
HostKey "{self.host_key}"
PidFile "{self.workdir / "sshd.pid"}"
AuthorizedKeysFile "{self.workdir / "authorized_keys"}"
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
AllowTcpForwarding yes
MaxStartups 100
MaxSessions 100
LogLevel VERBOSE
Subsystem sftp internal-sftp
# SHLVL=1: bash then takes itself for a nested shell and skips ~/.bashrc, which it
# would otherwise source for ssh commands (Debian builds bash with SSH_SOURCE_BASHRC):
# sessions stay fast and see only this PATH.
# DFLASHCTL_HOST_ROOT: where dflashctl reads the node's GPU files and /etc/pve
# (tests/host/pve_conf.py); a real node leaves it unset.
SetEnv "PATH={STANDIN_BIN}:{SESSION_PATH}" "FAKEPVE_STATE={self.state_dir}" SHLVL=1 "DFLASHCTL_HOST_ROOT={self.state_dir}/host-root"
"""
        path = self.workdir / "sshd_config"
        optional = list(OPTIONAL_SETTINGS)
        while True:
            path.write_text(config + "".join(f"{line}\n" for line in optional))
            check = subprocess.run([SSHD, "-t", "-f", str(path)], capture_output=True, text=True)
            if check.returncode == 0:
                return
            rejected = [line for line in optional if line.split()[0] in check.stderr]
            if not rejected:
                raise SshdFailed(f"sshd rejects its configuration:\n{check.stderr}")
            optional = [line for line in optional if line not in rejected]

    def _launch(self, timeout: float) -> None:
        with open(self.sshd_log, "ab") as log:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    str(HOST_DIR / "reaper.py"),
                    "--",
                    SSHD,
                    "-D",
                    "-e",
                    "-f",
                    str(self.workdir / "sshd_config"),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise SshdFailed(f"sshd exited ({self._process.returncode}):\n{self.log_tail()}")
            # Ours once it has written its PidFile (after binding the port) and answers;
            # a banner alone could come from another server that took the port first.
            if self.listener_pid is not None and self._banner_ok():
                return
            time.sleep(0.02)
        raise SshdFailed(
            f"sshd did not answer on port {self.port} within {timeout} s:\n{self.log_tail()}"
        )

    def _banner_ok(self) -> bool:
        try:
            with socket.create_connection((self.address, self.port), timeout=1) as sock:
                return sock.recv(64).startswith(b"SSH-2.0-")
        except OSError:
            return False

    def stop(self) -> None:
        """Stop sshd; the reaper then kills every process the sessions left behind."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None

    def crash(self) -> None:
        """sshd dies at once, as on a host that went down: SIGKILL to the listener and to
        every connection's sshd. Clients see their connections drop mid-command; the
        reaper then exits. `restart()` brings it back on the same port and keys."""
        pids = [pid for pid in [self.listener_pid, *self.connection_pids()] if pid]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._process is not None:
            try:
                self._process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._process = None

    def restart(self, timeout: float = 15.0) -> None:
        """sshd again after stop() or crash(): the same port, host key and clients, so a
        config (and known_hosts) made for it still holds."""
        if self._process is not None and self._process.poll() is None:
            return
        self._process = None
        deadline = time.monotonic() + timeout
        while True:  # the port may linger a moment after the old listener died
            try:
                self._launch(timeout)
                return
            except SshdFailed:
                self.stop()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    @property
    def is_up(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.sshd_log.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    # -- what tests use ----------------------------------------------------------------

    @property
    def listener_pid(self) -> int | None:
        """The sshd that accepts connections (it writes its PidFile once listening)."""
        if self._process is None:
            return None
        try:
            pid = int((self.workdir / "sshd.pid").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid in _children(self._process.pid) else None

    def connection_pids(self) -> list[int]:
        """The sshd processes that serve open connections (not the listener)."""
        listener = self.listener_pid
        if listener is None:
            return []
        found: list[int] = []
        todo = _children(listener)
        while todo:
            pid = todo.pop()
            if _comm(pid) == "sshd":  # not the session's shell or commands
                found.append(pid)
                todo.extend(_children(pid))
        return found

    def drop_connections(self) -> int:
        """Kill the sshd processes of every open connection, as if the network dropped:
        clients see their connection close mid-command, the commands they started keep
        running (they are not in a terminal session, so nothing hangs them up).
        Returns how many processes were killed."""
        pids = self.connection_pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def run(
        self, *argv: str, input: str | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run argv here with the system ssh client (strict host key); text output."""
        return subprocess.run(
            self.ssh_argv(*argv),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def known_hosts_with_wrong_key(self, directory: Path) -> Path:
        """A known_hosts that names this host and port with some other ed25519 key."""
        directory.mkdir(parents=True, exist_ok=True)
        other = directory / "other_host_key"
        if not other.exists():
            generate_key(other, "other-host")
        key_type, key_b64 = Path(f"{other}.pub").read_text().split()[:2]
        path = directory / "known_hosts_wrong_key"
        path.write_text(f"[{self.address}]:{self.port} {key_type} {key_b64}\n")
        return path

    def empty_known_hosts(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "known_hosts_empty"
        path.write_text("")
        return path

    def ssh_argv(self, *command: str, known_hosts: Path | None = None) -> list[str]:
        """The system ssh client, strict about the host key, running `command` (an argv,
        quoted for the remote shell) on this host."""
        return [
            "ssh",
            "-F",
            "/dev/null",
            "-p",
            str(self.port),
            "-i",
            str(self.identity_file),
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f'UserKnownHostsFile="{known_hosts or self.known_hosts}"',  # may contain spaces
            "-o",
            "GlobalKnownHostsFile=/dev/null",
            "-o",
            "ConnectTimeout=10",
            f"{self.user}@{self.address}",
            shlex.join(command),
        ]
