"""Opening one verified SSH connection: the socket (direct, through a ProxyCommand or a
jump host's tunnel), the handshake against the known host keys, and authentication;
every way it can fail becomes one ConnectFailed with a plain sentence. ssh.py's
SSHTransport holds the connection these make."""

from __future__ import annotations

import os
import select
import shlex
import signal
import socket
import time
from pathlib import Path

import paramiko
from paramiko.common import MSG_CHANNEL_REQUEST

from dflashctl.config.schema import HostConfig
from dflashctl.remote.transport import host_keys
from dflashctl.remote.transport.base import ConnectFailed
from dflashctl.remote.transport.ssh_config import SSHDestination

# --------------------------------------------------------------------------- exit signals


def handle_channel_request(chan: paramiko.Channel, m: paramiko.Message) -> None:
    """paramiko ignores "exit-signal" (RFC 4254 6.10), leaving a killed command without
    a status. Record it as 128+N, like a shell does, then defer to paramiko."""
    start = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply: always false for exit-signal
        name = m.get_text()
        number = getattr(signal, f"SIG{name}", None)
        chan.exit_status = 128 + int(number) if number is not None else 255
        chan.status_event.set()
        return
    m.packet.seek(start)
    paramiko.Channel._handle_request(chan, m)


def open_socket(dest: SSHDestination, timeout: float) -> socket.socket:
    try:
        addresses = socket.getaddrinfo(dest.hostname, dest.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConnectFailed(
            "resolve",
            f"cannot resolve the host name {dest.hostname}",
            hint="check host.address (and HostName in ~/.ssh/config), or the DNS of this machine",
        ) from exc
    failure: OSError | None = None
    for family, kind, proto, _, address in addresses:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout)
        try:
            sock.connect(address)
            return sock
        except OSError as exc:
            sock.close()
            failure = exc
    where = f"{dest.hostname} port {dest.port}"
    if isinstance(failure, ConnectionRefusedError):
        raise ConnectFailed(
            "refused",
            f"{where} refused the connection",
            hint="check that sshd runs on the host and that host.port is right",
        ) from failure
    if isinstance(failure, socket.timeout):
        raise ConnectFailed(
            "timeout",
            f"connecting to {where} timed out after {timeout:g} s",
            hint="check that the host is up and that no firewall drops the port",
        ) from failure
    reason = failure.strerror if failure and failure.strerror else str(failure)
    raise ConnectFailed(
        "unreachable",
        f"cannot connect to {where}: {reason}",
        hint="check the address and the network route to the host",
    ) from failure


class ShellProxy(paramiko.ProxyCommand):
    """paramiko's ProxyCommand, run through /bin/sh as ssh does (pipes, redirections
    and `~` work), reading like a socket: whatever is there, b"" at end of stream.
    (paramiko's own recv spins until its timeout once the command has exited, and its
    close fails on a command already reaped.)"""

    def recv(self, size: int) -> bytes:
        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout)
        if not ready:
            raise TimeoutError()
        return os.read(self.process.stdout.fileno(), size)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.terminate()
            except ProcessLookupError:
                pass


def proxy_command(dest: SSHDestination, timeout: float) -> paramiko.ProxyCommand:
    """The ProxyCommand from ssh_config, its stdin/stdout as the connection."""
    assert dest.proxy_command is not None
    try:
        proxy = ShellProxy(shlex.join(["/bin/sh", "-c", "exec " + dest.proxy_command]))
    except OSError as exc:
        raise ConnectFailed(
            "proxy", f"cannot start the ProxyCommand for {dest.alias}: {exc}"
        ) from exc
    proxy.settimeout(timeout)
    return proxy


def proxy_failure(dest: SSHDestination, proxy: paramiko.ProxyCommand) -> ConnectFailed | None:
    """What to say when the handshake failed because the ProxyCommand itself ended."""
    try:
        code = proxy.process.wait(timeout=0.5)
    except Exception:  # still running: the failure was the SSH server's, not the proxy's
        return None
    if code == -signal.SIGTERM:  # ended by our close after an SSH-level failure
        return None
    err = (
        proxy.process.stderr.read().decode(errors="replace").strip() if proxy.process.stderr else ""
    )
    said = f": {err.splitlines()[-1]}" if err else ""
    return ConnectFailed(
        "proxy",
        f"the ProxyCommand for {dest.alias} exited with status {code} before SSH could start{said}",
        hint=f"run it by hand to see why: {dest.proxy_command}",
    )


def auth_error(dest: SSHDestination, key_files: list[str], exc: Exception) -> ConnectFailed:
    if isinstance(exc, paramiko.PasswordRequiredException):
        return ConnectFailed(
            "auth",
            f"SSH authentication to {dest} needs the passphrase of a private key ({exc})",
            hint="load the key into ssh-agent with `ssh-add <key file>` and run again",
        )
    tried = "ssh-agent and " + (", ".join(key_files) if key_files else "the default keys in ~/.ssh")
    return ConnectFailed(
        "auth",
        f"SSH authentication failed for {dest}: the server accepted none of the keys tried ({tried})",
        hint=f"add your public key to ~{dest.user}/.ssh/authorized_keys on the host, "
        "or set host.identity_file to the right key",
    )


def connect_one(
    dest: SSHDestination,
    host: HostConfig,
    policy: host_keys.VerifyingPolicy,
    sock: socket.socket | paramiko.Channel,
) -> paramiko.SSHClient:
    """Handshake, verify the host key and authenticate on an already open socket."""
    known_hosts = Path(host.known_hosts)
    client = paramiko.SSHClient()
    client.get_host_keys().update(host_keys.load_known_hosts(known_hosts))
    policy.user = dest.user
    client.set_missing_host_key_policy(policy)
    key_files = [f for f in dest.identity_files if Path(f).is_file()]
    timeout = host.connect_timeout_s
    started = time.monotonic()
    try:
        client.connect(
            dest.hostname,
            port=dest.port,
            username=dest.user,
            sock=sock,
            key_filename=key_files or None,
            allow_agent=True,
            look_for_keys=True,
            timeout=timeout,
            banner_timeout=timeout,
            auth_timeout=timeout,
        )
    except ConnectFailed:
        client.close()
        raise
    except paramiko.BadHostKeyException as exc:
        client.close()
        raise host_keys.changed_key_error(known_hosts, dest.known_hosts_name, exc.key) from exc
    except paramiko.AuthenticationException as exc:
        client.close()
        if "transport shut down or saw EOF" in str(exc):
            # paramiko words a connection that dropped mid-authentication as an auth
            # failure; it is a network event, not a key problem.
            raise ConnectFailed(
                "ssh",
                f"the connection to {dest.hostname} port {dest.port} closed during authentication",
                hint="try again; if it keeps happening, check sshd's MaxStartups and logs",
            ) from exc
        raise auth_error(dest, key_files, exc) from exc
    except (TimeoutError, paramiko.SSHException, EOFError, OSError) as exc:
        handshake = client.get_transport()
        greeted = bool(handshake and handshake.remote_version)
        client.close()
        where = f"{dest.hostname} port {dest.port}"
        if not greeted:
            # paramiko reports a missing banner in several ways depending on timing
            # ("Error reading SSH protocol banner", "No existing session"): no greeting
            # within the timeout is what happened.
            if time.monotonic() - started >= timeout * 0.9:
                raise ConnectFailed(
                    "timeout",
                    f"{where} accepted the connection but sent no SSH greeting within {timeout:g} s",
                    hint="check that host.port is the SSH port and that sshd is not overloaded",
                ) from exc
            raise ConnectFailed(
                "ssh",
                f"{where} closed the connection without an SSH greeting",
                hint="check that host.port is the SSH port",
            ) from exc
        raise ConnectFailed(
            "ssh",
            f"the SSH handshake with {where} failed: {exc or type(exc).__name__}",
            hint="try `ssh -v` by hand to see where it stops",
        ) from exc
    transport = client.get_transport()
    assert transport is not None
    transport._channel_handler_table = {
        **transport._channel_handler_table,
        MSG_CHANNEL_REQUEST: handle_channel_request,
    }
    if host.keepalive_s:
        transport.set_keepalive(host.keepalive_s)
    return client


def tunnel(
    via: paramiko.SSHClient, via_dest: SSHDestination, dest: SSHDestination, timeout: float
) -> paramiko.Channel:
    transport = via.get_transport()
    assert transport is not None
    try:
        return transport.open_channel(
            "direct-tcpip", (dest.hostname, dest.port), ("127.0.0.1", 0), timeout=timeout
        )
    except (paramiko.ChannelException, paramiko.SSHException, OSError, EOFError) as exc:
        reason = getattr(exc, "text", None) or str(exc) or type(exc).__name__
        raise ConnectFailed(
            "jump",
            f"the jump host {via_dest} could not connect to {dest.hostname} port {dest.port}: {reason}",
            hint="check host.address and host.port as the jump host sees them, "
            "and that the jump host allows TCP forwarding",
        ) from exc
