"""How the Proxmox API's HTTPS certificate is checked: `proxmox.verify_tls`.

- `true`: against the system's CA store (a node with a real certificate);
- `false`: not at all (said plainly by doctor; the traffic can then be read);
- a file path: a CA bundle (e.g. the cluster's /etc/pve/pve-root-ca.pem, copied);
- `sha256:AB:CD:...`: the certificate itself, pinned by its SHA-256 fingerprint as
  `pvenode cert info` prints it, for PVE's default self-signed certificate. A mismatch is
  refused as a changed SSH host key is, naming the fingerprint the server presented.
"""

from __future__ import annotations

import hashlib
import re
import ssl
from dataclasses import dataclass
from pathlib import Path

from dflashctl.remote.transport.base import ConnectFailed

_FINGERPRINT = re.compile(r"^sha256:((?:[0-9A-Fa-f]{2}:?){32})$")


@dataclass(frozen=True)
class TlsCheck:
    kind: str  # "ca" (system store), "off", "bundle", "pin"
    bundle: str | None = None
    fingerprint: str | None = None  # 64 hex digits, lowercase, no colons

    @property
    def requests_verify(self) -> bool | str:
        """What requests' `verify` takes: the pin is checked by urllib3 instead."""
        if self.kind == "bundle":
            return str(self.bundle)
        return self.kind == "ca"


def parse_verify_tls(value: bool | str) -> TlsCheck:
    """The setting as a check; ValueError with what to write for anything else."""
    if value is True:
        return TlsCheck("ca")
    if value is False:
        return TlsCheck("off")
    text = str(value).strip()
    pinned = _FINGERPRINT.match(text)
    if pinned:
        return TlsCheck("pin", fingerprint=pinned.group(1).replace(":", "").lower())
    if text.lower().startswith("sha256:"):
        raise ValueError(
            f"{text!r} is not a SHA-256 fingerprint: expected sha256: and 32 hex pairs, "
            "as `pvenode cert info` prints them (sha256:AB:CD:...)"
        )
    path = Path(text).expanduser()
    if not path.is_file():
        raise ValueError(
            f"{text!r} is neither true/false, a CA bundle file that exists, nor a pinned "
            "certificate fingerprint (sha256:AB:CD:..., from `pvenode cert info` on the node)"
        )
    return TlsCheck("bundle", bundle=str(path))


def colon_fingerprint(hex_digest: str) -> str:
    """`sha256:AB:CD:...`, the way `pvenode cert info` and browsers show it."""
    upper = hex_digest.upper()
    return "sha256:" + ":".join(upper[i : i + 2] for i in range(0, len(upper), 2))


def presented_fingerprint(host: str, port: int, timeout: float = 10.0) -> str | None:
    """The SHA-256 fingerprint of the certificate the server presents now (None when it
    cannot be read): for the mismatch message only, never to decide anything."""
    import socket

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            with context.wrap_socket(sock, server_hostname=host) as tls:
                der = tls.getpeercert(binary_form=True)
    except OSError:
        return None
    return hashlib.sha256(der).hexdigest() if der else None


def pin_session(session, check: TlsCheck, url: str, host: str, port: int) -> None:
    """Make a requests session accept exactly the pinned certificate: urllib3 compares
    the fingerprint during the handshake, before any request (the token included) is
    sent. Chain and host name checks are off, since the pin says more than they do."""
    from requests.adapters import HTTPAdapter

    class PinnedAdapter(HTTPAdapter):
        def init_poolmanager(self, *args, **kwargs):
            kwargs["assert_fingerprint"] = check.fingerprint
            kwargs["cert_reqs"] = ssl.CERT_NONE
            return super().init_poolmanager(*args, **kwargs)

        def cert_verify(self, conn, request_url, verify, cert):
            super().cert_verify(conn, request_url, False, cert)
            conn.assert_fingerprint = check.fingerprint

        def send(self, *args, **kwargs):
            try:
                return super().send(*args, **kwargs)
            except Exception as exc:
                if is_fingerprint_mismatch(exc):
                    raise fingerprint_mismatch(url, host, port, check) from None
                raise

    session.verify = False
    session.mount("https://", PinnedAdapter())


def fingerprint_mismatch(url: str, host: str, port: int, check: TlsCheck) -> ConnectFailed:
    seen = presented_fingerprint(host, port)
    shown = colon_fingerprint(seen) if seen else "(could not be read)"
    return ConnectFailed(
        "tls_fingerprint_changed",
        f"the TLS certificate of {url} has changed: the server presents {shown}, which does "
        f"not match proxmox.verify_tls ({colon_fingerprint(check.fingerprint or '')}); "
        "refusing to connect (the node's certificate may have been renewed, or someone is "
        "intercepting the connection)",
        hint="if the change is expected, check the new fingerprint on the node with "
        "`pvenode cert info` (or in the web UI: Node > System > Certificates) and put it "
        "in proxmox.verify_tls",
    )


def is_fingerprint_mismatch(exc: BaseException) -> bool:
    """urllib3's SSLError `Fingerprints did not match`, however requests wrapped it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if "Fingerprints did not match" in str(exc):
            return True
        nested = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
        exc = exc.__cause__ or exc.__context__ or nested
        # urllib3's MaxRetryError keeps the cause in .reason
        exc = exc or getattr(exc, "reason", None)
    return False
