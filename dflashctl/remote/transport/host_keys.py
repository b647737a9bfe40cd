"""Host key verification against known_hosts, with messages that say how to fix things.

Policy: a key already in known_hosts must match; an unknown key is refused unless
host.accept_new_host_key is true (then it is appended to the file, like OpenSSH's
StrictHostKeyChecking=accept-new); a changed key is always refused. Never AutoAddPolicy.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import sys
from pathlib import Path

import paramiko

from dflashctl.remote.transport.base import ConnectFailed

DEFAULT_KNOWN_HOSTS = Path("~/.ssh/known_hosts").expanduser()


def fingerprint(key: paramiko.PKey) -> str:
    """The SHA256 fingerprint as `ssh` and `ssh-keygen -l` print it."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def key_type(key: paramiko.PKey) -> str:
    """OpenSSH's short name: ssh-ed25519 -> ED25519, ecdsa-sha2-nistp256 -> ECDSA."""
    name = key.get_name()
    if name.startswith("ecdsa-"):
        return "ECDSA"
    return name.removeprefix("ssh-").upper()


def load_known_hosts(path: Path) -> paramiko.HostKeys:
    """The keys in `path`; a missing file is an empty list (nothing is trusted yet).

    Read line by line rather than with paramiko's `HostKeys.load`, which raises on the
    first line it cannot parse: OpenSSH's `@cert-authority` and `@revoked` marker lines
    (certificates are not checked here, so such lines trust nothing) and a damaged line
    are skipped, as `ssh` skips what it cannot use, instead of ending in a traceback."""
    keys = paramiko.HostKeys()
    if not path.is_file():
        return keys
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConnectFailed(
            "host_key_unknown", f"cannot read the known_hosts file {path}: {exc.strerror}"
        ) from exc
    for lineno, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith(("#", "@")):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, lineno)
        except (paramiko.SSHException, paramiko.hostkeys.InvalidHostKey, ValueError):
            continue
        if entry is not None and entry.key is not None:
            for name in entry.hostnames:
                keys.add(name, entry.key.get_name(), entry.key)
    return keys


def _name_matches(pattern: str, name: str) -> bool:
    if pattern.startswith("|1|"):  # hashed entry (HashKnownHosts yes)
        return paramiko.HostKeys.hash_host(name, pattern) == pattern
    return pattern == name


def lines_for(path: Path, name: str) -> list[tuple[int, str]]:
    """(line number, key type) of every entry in `path` for `name`, hashed or not."""
    found = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return found
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if len(fields) < 3 or line.lstrip().startswith("#"):
            continue
        if fields[0].startswith("@"):  # @cert-authority / @revoked markers
            continue
        if any(_name_matches(p, name) for p in fields[0].split(",")):
            found.append((lineno, fields[1]))
    return found


def append_known_host(path: Path, name: str, key: paramiko.PKey) -> None:
    """Add one line to known_hosts, creating the file (0600) and folder (0700) if needed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    line = f"{name} {key.get_name()} {key.get_base64()}\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        if os.fstat(fd).st_size:
            with open(path, "rb") as existing:
                existing.seek(-1, os.SEEK_END)
                if existing.read(1) != b"\n":
                    line = "\n" + line
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def _file_option(path: Path) -> str:
    return "" if path == DEFAULT_KNOWN_HOSTS else f" -o UserKnownHostsFile={shlex.quote(str(path))}"


def unknown_key_error(path: Path, name: str, user: str, key: paramiko.PKey) -> ConnectFailed:
    hostname, port = _split_name(name)
    port_option = f" -p {port}" if port != 22 else ""
    return ConnectFailed(
        "host_key_unknown",
        f"the host key of {name} ({key.get_name()} {fingerprint(key)}) is not in {path}, "
        "so the host cannot be verified",
        hint=(
            f"check the fingerprint and accept it once with `ssh{port_option}{_file_option(path)} "
            f"{user}@{hostname} true`, or set host.accept_new_host_key: true to save it "
            "on the first connection"
        ),
    )


def changed_key_error(path: Path, name: str, server_key: paramiko.PKey) -> ConnectFailed:
    lines = lines_for(path, name)
    where = ", ".join(f"{path}:{lineno}" for lineno, _ in lines) or str(path)
    remove = f"ssh-keygen -f {shlex.quote(str(path))} -R {shlex.quote(name)}"
    return ConnectFailed(
        "host_key_changed",
        f"the host key of {name} has changed: the server offers {server_key.get_name()} "
        f"{fingerprint(server_key)}, which does not match {where}; refusing to connect "
        "(the host may have been reinstalled, or someone is intercepting the connection)",
        hint=f"if the change is expected, remove the old key with `{remove}` and connect again",
    )


def _split_name(name: str) -> tuple[str, int]:
    if name.startswith("[") and "]:" in name:
        host, port = name[1:].split("]:")
        return host, int(port)
    return name, 22


class VerifyingPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for a host with no key in known_hosts."""

    def __init__(self, path: Path, user: str, accept_new: bool) -> None:
        self.path = path
        self.user = user
        self.accept_new = accept_new
        self.saved: list[str] = []  # names whose key this connection added to known_hosts

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.accept_new:
            raise unknown_key_error(self.path, hostname, self.user, key)
        try:
            append_known_host(self.path, hostname, key)
        except OSError as exc:
            raise ConnectFailed(
                "host_key_unknown",
                f"cannot save the new host key of {hostname} to {self.path}: {exc.strerror}",
            ) from exc
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.saved.append(hostname)
        # Said as OpenSSH says it: a key trusted on first use is never added silently.
        print(
            f"Warning: Permanently added '{hostname}' ({key_type(key)}) to the list of "
            f"known hosts ({self.path}; {fingerprint(key)}).",
            file=sys.stderr,
            flush=True,
        )
