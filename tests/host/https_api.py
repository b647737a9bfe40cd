"""HTTPS stand-in for the Proxmox VE REST API (pveproxy on port 8006), over the same state
folder as the pct and pvesh stand-ins (state.py): a container started here runs for pct.

What it follows of the real API (pve-http-server PVE/APIServer/AnyEvent.pm, pve-manager,
pve-container PVE/API2/LXC/Status.pm, pve-access-control):

- paths under /api2/json/, answers as `{"data": ...}`;
- `Authorization: PVEAPIToken=user@realm!tokenid=secret`; without it `401 No ticket`,
  with an unknown token or a wrong secret `401 authentication failure` (the HTTP reason
  phrase carries the message, the body is `{"data":null}`);
- a token without the privilege the path needs: `403 Permission check failed
  (/vms/<vmid>, VM.PowerMgmt)` (VM.Audit to read a container's status);
- POST .../status/start answers a UPID at once; the start runs in a worker, and
  /nodes/<node>/tasks/<upid>/status says `running`, then `stopped` with `exitstatus`
  `OK`, `WARNINGS: N`, or the error (`startup for container '200' failed`);
- an unknown container: `500 Configuration file 'nodes/<node>/lxc/<vmid>.conf' does not
  exist`;
- a self-signed certificate made when the server starts (as PVE makes its own), whose
  sha256 fingerprint reads as `pvenode cert info` prints it (`AB:CD:...`).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import itertools
import json
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from . import pvesh_cli, state

AUDIT, POWER = "VM.Audit", "VM.PowerMgmt"
ALL_PRIVILEGES = frozenset({AUDIT, POWER})
_TOKEN = re.compile(r"^PVEAPIToken=([^!=\s]+)!([^=\s]+)=(\S+)$")


@dataclass
class ApiToken:
    user: str  # user@realm
    name: str
    secret: str
    privileges: frozenset[str] = ALL_PRIVILEGES

    @property
    def token_id(self) -> str:
        return f"{self.user}!{self.name}"


def make_certificate(folder: Path, hostname: str = "127.0.0.1") -> tuple[Path, Path, str]:
    """A self-signed certificate for `hostname` (as PVE's pve-ssl.pem before a real one is
    set): returns (certificate, key, its sha256 fingerprint `AB:CD:...`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.timezone.utc)
    try:
        alt = x509.IPAddress(ipaddress.ip_address(hostname))
    except ValueError:
        alt = x509.DNSName(hostname)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / "pve-ssl.pem", folder / "pve-ssl.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    digest = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest().upper()
    return cert_path, key_path, ":".join(digest[i : i + 2] for i in range(0, len(digest), 2))


class ApiError(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass
class HttpsApi:
    """The server: `url`, `fingerprint`, `certificate` (a CA bundle that trusts it),
    `tokens` (add or change them in a test), `requests` (method, path, token id)."""

    state_dir: Path
    folder: Path
    tokens: dict[str, ApiToken] = field(default_factory=dict)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)

    def start(self) -> HttpsApi:
        self._worker_pids = itertools.count(100_000)
        self.certificate, key, self.fingerprint = make_certificate(self.folder)
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802 (http.server's naming)
                api.handle(self, "GET")

            def do_POST(self):  # noqa: N802
                api.handle(self, "POST")

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.certificate, key)
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="pve-https", daemon=True
        )
        self._thread.start()
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def add_token(self, user: str, name: str, secret: str, privileges=ALL_PRIVILEGES) -> ApiToken:
        token = ApiToken(user, name, secret, frozenset(privileges))
        self.tokens[token.token_id] = token
        return token

    # ------------------------------------------------------------------ requests

    def handle(self, request: BaseHTTPRequestHandler, method: str) -> None:
        length = int(request.headers.get("Content-Length") or 0)
        if length:
            request.rfile.read(length)
        path = request.path.split("?", 1)[0]
        token = None
        try:
            token = self._authenticate(request.headers.get("Authorization"))
            self.requests.append((method, path, token.token_id))
            data = self._route(method, path, token)
            self._answer(request, 200, "OK", {"data": data})
        except ApiError as exc:
            if token is None:
                self.requests.append((method, path, None))
            self._answer(request, exc.status, exc.reason, {"data": None})
        except state.PveError as exc:  # the node's own error, as pveproxy passes it on
            self._answer(request, 500, str(exc).splitlines()[0], {"data": None})

    def _answer(self, request, status: int, reason: str, body: dict) -> None:
        payload = json.dumps(body).encode()
        request.send_response(status, reason)
        request.send_header("Content-Type", "application/json;charset=UTF-8")
        request.send_header("Content-Length", str(len(payload)))
        request.end_headers()
        request.wfile.write(payload)

    def _authenticate(self, header: str | None) -> ApiToken:
        if not header:
            raise ApiError(401, "No ticket")
        found = _TOKEN.match(header)
        token = self.tokens.get(f"{found[1]}!{found[2]}") if found else None
        if token is None or found[3] != token.secret:
            raise ApiError(401, "authentication failure")
        return token

    def _route(self, method: str, path: str, token: ApiToken):
        prefix = "/api2/json/"
        if not path.startswith(prefix):
            raise ApiError(501, f"Unexpected content for method '{method}'")
        parts = [unquote(p) for p in path[len(prefix) :].strip("/").split("/") if p]
        node = state.node_name(self.state_dir)
        if parts == ["version"] and method == "GET":
            return pvesh_cli.VERSION
        if len(parts) < 2 or parts[0] != "nodes":
            raise ApiError(501, f"Method '{method} /{'/'.join(parts)}' not implemented")
        if parts[1] != node:  # as pvesh says it: the node's name does not resolve
            raise ApiError(
                500,
                f"hostname lookup '{parts[1]}' failed - failed to get address info for: "
                f"{parts[1]}: Name or service not known",
            )
        tail = parts[2:]
        if len(tail) == 4 and tail[0] == "lxc" and tail[2] == "status":
            vmid = tail[1]
            if tail[3] == "current" and method == "GET":
                self._require(token, vmid, AUDIT)
                return pvesh_cli.current_status(state.load_container(self.state_dir, vmid))
            if tail[3] == "start" and method == "POST":
                self._require(token, vmid, POWER)
                return self._start(state.load_container(self.state_dir, vmid), token)
        if len(tail) == 3 and tail[0] == "tasks" and tail[2] == "status" and method == "GET":
            task = state.find_task(self.state_dir, tail[1])
            if task is None:
                raise ApiError(500, f"no such task '{tail[1]}'")
            return task
        raise ApiError(501, f"Method '{method} /{'/'.join(parts)}' not implemented")

    def _require(self, token: ApiToken, vmid: str, privilege: str) -> None:
        if privilege not in token.privileges:
            raise ApiError(403, f"Permission check failed (/vms/{vmid}, {privilege})")

    def _start(self, ct: state.Container, token: ApiToken) -> str:
        """The worker runs after the answer, as pveproxy forks one: the task is `running`
        until the container is up (or its start failed)."""
        conf = ct.conf()
        if ct.is_running():
            raise ApiError(500, f"CT {ct.vmid} already running")
        upid = state.record_task(
            self.state_dir,
            "vzstart",
            ct.vmid,
            user=token.token_id,
            running=True,
            pid=next(self._worker_pids),  # each worker is its own process on PVE
        )

        def work() -> None:
            exitstatus = "OK"
            try:
                time.sleep(float(conf.get("start_delay_s", 0)))
                if conf.get("start_error"):
                    exitstatus = str(conf["start_error"])
                else:
                    with state.config_lock(ct):
                        state.start_container(ct)
                    warnings = conf.get("start_warnings", [])
                    if warnings:
                        exitstatus = f"WARNINGS: {len(warnings)}"
            except Exception as exc:  # the task log's last line
                exitstatus = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            state.finish_task(self.state_dir, upid, exitstatus)

        threading.Thread(target=work, name=f"vzstart-{ct.vmid}", daemon=True).start()
        return upid
