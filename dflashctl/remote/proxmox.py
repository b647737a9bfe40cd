"""Container state through the Proxmox API (proxmoxer): status, start, list.

With `proxmox.api: ssh`, pvesh runs over dflashctl's own verified SSH connection: the
session below offers proxmoxer's command-backend interface (`_exec`, `upload_file_obj`)
on top of our Transport, so there is no second connection and no AutoAddPolicy. With
`api: https`, the API token secret is read from the environment variable named in the
config and is never printed or logged.

Imported lazily (by remote/connect.py and the commands): proxmoxer is not needed for --help.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

from proxmoxer.backends.command_base import CommandBaseSession, JsonSimpleSerializer
from proxmoxer.core import ProxmoxResource, ResourceException

from dflashctl.config.schema import ProxmoxConfig
from dflashctl.errors import ConfigError, DflashError, HostError
from dflashctl.remote.pct import ContainerNotFound, not_a_proxmox_node
from dflashctl.remote.transport.base import CommandTimeout, Transport

PVESH_TIMEOUT_S = 60.0
DEFAULT_START_TIMEOUT_S = 300.0
_WARNINGS = re.compile(r"^WARNINGS: \d+$")
_UPID = re.compile(
    r"UPID:[\w.-]+:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{8}:[0-9A-Fa-f]{8}:\w+:[\w.-]*:[\w.@-]+:"
)
_MISSING_CONFIG = re.compile(r"Configuration file 'nodes/[^/']+/lxc/\d+\.conf' does not exist")
_UNKNOWN_NODE = re.compile(r"hostname lookup '([^']+)' failed")


class TransportSession(CommandBaseSession):
    """proxmoxer's command-backend session, running pvesh through our Transport."""

    def __init__(self, transport: Transport, timeout: float = PVESH_TIMEOUT_S) -> None:
        super().__init__(service="PVE", timeout=timeout)
        self.transport = transport

    def _exec(self, cmd: list[str]) -> tuple[str, str, int]:
        result = self.transport.run(cmd, check=False, timeout=self.timeout)
        if result.exit_status == 127:
            raise not_a_proxmox_node(cmd[0], self.transport.description)
        return result.stdout_text, result.stderr_text, result.exit_status

    def request(self, method, url, data=None, params=None, headers=None):
        response = super().request(method, url, data=data, params=params, headers=headers)
        # proxmoxer guesses failure from any stderr output; pvesh's exit status is the
        # better witness (it also prints harmless notices, e.g. lock waits, on stderr).
        if response.exit_code == 0 and response.status_code >= 400:
            response.status_code = 200
        return response

    def upload_file_obj(self, file_obj: Any, remote_path: str) -> None:
        self.transport.put_file(file_obj.read(), remote_path, mode=0o600)


def ssh_api(transport: Transport) -> ProxmoxResource:
    """The API root (`api.nodes(node).lxc.get()` ...) over pvesh on `transport`."""
    return ProxmoxResource(
        base_url="", session=TransportSession(transport), serializer=JsonSimpleSerializer()
    )


def https_api(config: ProxmoxConfig) -> ProxmoxResource:
    """The REST API with an API token; the secret comes from the environment only."""
    secret = os.environ.get(config.token_secret_env)
    if not secret:
        raise ConfigError(
            f"the environment variable {config.token_secret_env} (proxmox.token_secret_env) "
            "is not set: it must hold the API token secret",
            hint=f"export {config.token_secret_env}=<secret of {config.token_id}>",
        )
    try:
        import requests  # noqa: F401  (proxmoxer's https backend needs it)
    except ImportError:
        raise ConfigError(
            "proxmox.api: https needs the Python package requests, which is not installed",
            hint="pip install requests, or use proxmox.api: ssh",
        ) from None
    from proxmoxer import ProxmoxAPI

    from dflashctl.remote.proxmox_tls import parse_verify_tls, pin_session

    try:
        check = parse_verify_tls(config.verify_tls)
    except ValueError as exc:  # a CA bundle removed since the config was loaded
        raise ConfigError(f"proxmox.verify_tls: {exc}") from None
    if check.kind == "off":
        import warnings

        from dflashctl.errors import Notice

        warnings.warn(
            Notice(
                f"proxmox.verify_tls is false: the API token {config.token_id} goes to "
                f"{config.url} without checking who answers (pin the certificate with "
                "proxmox.verify_tls: sha256:..., as `pvenode cert info` prints it)"
            ),
            stacklevel=2,
        )
    if check.kind in ("off", "pin"):  # no warning per request: off was asked for, a pin
        import urllib3  # is checked in the handshake instead

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)

    url = urlsplit(config.url or "")
    host, port = url.hostname or "", url.port or 8006
    user, _, token_name = (config.token_id or "").partition("!")
    api = ProxmoxAPI(
        host,
        port=port,
        backend="https",
        user=user,
        token_name=token_name,
        token_value=secret,
        verify_ssl=check.requests_verify,
        timeout=PVESH_TIMEOUT_S,
    )
    if check.kind == "pin":
        pin_session(api._store["session"], check, config.url or "", host, port)
    return api


# --------------------------------------------------------------------------- calls


@dataclass
class ContainerStatus:
    vmid: int
    status: str  # "running" | "stopped" (what Proxmox says)
    uptime_s: int
    name: str
    warnings: str | None = None  # a start that succeeded with warnings: what they were

    @property
    def running(self) -> bool:
        return self.status == "running"

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "warnings"}


def _api_error(exc: Exception, node: str, vmid: int | None, doing: str) -> HostError:
    """One plain sentence for whatever the API (or the way to it) answered."""
    text = str(getattr(exc, "content", "") or exc)
    if vmid is not None and _MISSING_CONFIG.search(text):
        return ContainerNotFound(
            f"container {vmid} does not exist on node {node}",
            hint="check container.vmid in dflash.yaml; `pct list` on the host lists the "
            "containers (or set container.vmid: null to run on the host itself)",
        )
    if isinstance(exc, ResourceException) and exc.status_code == 404 and vmid is not None:
        return ContainerNotFound(f"container {vmid} does not exist on node {node}")
    if isinstance(exc, ResourceException) and exc.status_code == 401:
        return HostError(
            f"the Proxmox API refused the API token (401 {exc.content or 'Unauthorized'})",
            hint="check proxmox.token_id and the secret in the variable named by "
            "proxmox.token_secret_env, and the token's privileges",
        )
    if isinstance(exc, ResourceException) and exc.status_code == 403:
        return HostError(
            f"the Proxmox API token lacks a privilege: {exc.content}",
            hint="grant the token (or, with privilege separation off, its user) a role "
            "with that privilege on that path, e.g. `pveum acl modify /vms/<vmid> --tokens "
            "'user@realm!token' --roles PVEVMUser` on the node",
        )
    if type(exc).__module__.startswith("requests"):  # the https API could not be reached
        return HostError(
            f"cannot reach the Proxmox API: {_network_reason(text)}",
            hint="check proxmox.url and the network; for PVE's self-signed certificate "
            "pin it: proxmox.verify_tls: sha256:AB:CD:... as `pvenode cert info` prints it "
            "on the node (or a CA bundle path)",
        )
    unknown = _UNKNOWN_NODE.search(text)
    if unknown:
        return HostError(
            f"the Proxmox node {unknown.group(1)} is not known to this host",
            hint="set proxmox.node to the node name that `pvesh get /nodes` shows",
        )
    detail = text.strip().splitlines()[-1] if text.strip() else type(exc).__name__
    return HostError(f"the Proxmox API failed while {doing}: {detail}")


def _network_reason(text: str) -> str:
    """requests' long chained message, cut down to what went wrong."""
    for needle, reason in (
        ("Failed to resolve", "the host name does not resolve"),
        ("Name or service not known", "the host name does not resolve"),
        ("Connection refused", "the connection was refused"),
        ("timed out", "the connection timed out"),
        ("CERTIFICATE_VERIFY_FAILED", "its TLS certificate is not trusted"),
    ):
        if needle in text:
            return reason
    return text.splitlines()[-1] if text else "unknown network error"


def _call(fn, node: str, vmid: int | None, doing: str) -> Any:
    try:
        return fn()
    except DflashError:
        raise
    except Exception as exc:  # proxmoxer and requests raise many kinds; all mean "API failed"
        raise _api_error(exc, node, vmid, doing) from exc


def _status_from(entry: dict[str, Any], vmid: int | None = None) -> ContainerStatus:
    return ContainerStatus(
        vmid=int(entry.get("vmid", vmid or 0)),
        status=str(entry.get("status", "unknown")),
        uptime_s=int(entry.get("uptime") or 0),
        name=str(entry.get("name") or ""),
    )


def api_version(api: ProxmoxResource) -> str:
    """`8.2.4`: proves the API answers (pvesh runs, or the token works)."""
    answer = _call(lambda: api.version.get(), "?", None, "reading the version")
    return str(answer.get("version", "?")) if isinstance(answer, dict) else "?"


def container_status(api: ProxmoxResource, node: str, vmid: int) -> ContainerStatus:
    answer = _call(
        lambda: api.nodes(node).lxc(vmid).status.current.get(),
        node,
        vmid,
        f"reading the state of container {vmid}",
    )
    if not isinstance(answer, dict) or "status" not in answer:
        raise HostError(f"the Proxmox API gave no state for container {vmid}: {answer!r}")
    return _status_from(answer, vmid)


def start_container(
    api: ProxmoxResource, node: str, vmid: int, timeout: float = DEFAULT_START_TIMEOUT_S
) -> ContainerStatus:
    """POST status/start, wait for its task, then until the container runs; returns its
    state, with `warnings` set when the task ended `WARNINGS: N` (a success).

    pvesh runs the start task before it answers, so the call itself may take as long as
    the start (its own 60 s would cut a slow one short). An HA-managed container's
    `hastart` task only asks ha-manager and ends before the container runs, hence the
    wait for `running` afterwards.
    """
    started = time.monotonic()

    def left() -> float:
        return max(timeout - (time.monotonic() - started), 1.0)

    def too_slow() -> HostError:
        return HostError(
            f"container {vmid} did not start within {timeout:g} s",
            hint="raise proxmox.start_timeout_s in dflash.yaml if it needs longer; the "
            f"start task's log is on the host (`pvenode task list --vmid {vmid}`)",
        )

    try:
        with _session_timeout(api, timeout):
            upid = _call(
                lambda: api.nodes(node).lxc(vmid).status.start.post(),
                node,
                vmid,
                f"starting container {vmid}",
            )
    except CommandTimeout:
        raise too_slow() from None
    upid = _upid_in(upid)
    if upid is None:
        raise HostError(f"starting container {vmid} gave no task id")
    task = _call(
        lambda: wait_for_task(api, upid, left()),
        node,
        vmid,
        f"waiting for container {vmid} to start",
    )
    if task is None:
        raise too_slow()
    exitstatus = str(task.get("exitstatus"))
    if not task_succeeded(exitstatus):
        raise HostError(
            f"starting container {vmid} failed: {exitstatus}",
            hint=f"see `pct start {vmid}` on the host for details",
        )
    while True:
        status = container_status(api, node, vmid)
        if status.running:
            break
        if time.monotonic() - started >= timeout:
            waited = time.monotonic() - started
            raise HostError(
                f"container {vmid} is {status.status} {waited:.0f} s after starting it",
                hint=f"see why with `pct start {vmid} --debug` on the host (an HA-managed "
                "container: `ha-manager status`); raise proxmox.start_timeout_s if it is "
                "only slow",
            )
        time.sleep(0.25)
    if exitstatus != "OK":
        status.warnings = f"{exitstatus} (task log: `pvenode task log {upid}` on the host)"
    return status


def task_succeeded(exitstatus: str) -> bool:
    """`OK`, or `WARNINGS: N`: both are a success (pve-common Tools/UPID.pm)."""
    return exitstatus == "OK" or _WARNINGS.match(exitstatus) is not None


def _upid_in(answer: Any) -> str | None:
    """The task id pvesh printed: a JSON string, possibly after the task's own log
    text (proxmoxer's serializer drops the text only when the JSON is a line of its own)."""
    if isinstance(answer, str) and answer.startswith("UPID:"):
        return answer
    found = _UPID.search(str(answer.get("errors", "") if isinstance(answer, dict) else answer))
    return found.group(0) if found else None


@contextlib.contextmanager
def _session_timeout(api: ProxmoxResource, seconds: float):
    """Another timeout for one call on the API's session (pvesh command or https)."""
    session = getattr(api, "_store", {}).get("session")
    before = getattr(session, "timeout", None)
    if before is None:
        yield
        return
    session.timeout = seconds
    try:
        yield
    finally:
        session.timeout = before


def wait_for_task(
    api: ProxmoxResource, upid: str, timeout: float, poll_s: float = 0.2
) -> dict[str, Any] | None:
    """The finished task's status, or None after `timeout`.

    What proxmoxer.tools.Tasks.blocking_status does, without its unconditional 1 s sleep;
    and importing proxmoxer.tools exits the process when `requests` is not installed.
    """
    node = upid.split(":")[1]
    deadline = time.monotonic() + timeout
    while True:
        task = api.nodes(node).tasks(upid).status.get()
        if isinstance(task, dict) and task.get("status") == "stopped":
            return task
        if time.monotonic() >= deadline:
            return None
        time.sleep(poll_s)
