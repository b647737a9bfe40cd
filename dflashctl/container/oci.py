"""container.template: a CT template volume, or an OCI image (PVE 9.1's technology preview).

One field takes both forms. `local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst` (any
`<storage>:vztmpl/...` volume, an OCI archive pulled before included) goes to `pct create`
as it is. Anything else is an OCI image reference, `docker.io/nvidia/cuda:12.4.1-base-
ubuntu22.04`: PVE 9.1 (pve-container 6.0.15) pulls it with the storage API's
`oci-registry-pull` (skopeo on the node; no registry logins) into `local`'s templates as
`<name>_<tag>.tar`, and `pct create` detects the OCI archive and unpacks it. Older PVE has
neither: refused before anything runs, naming the version needed.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from dflashctl.errors import ConfigError, HostError
from dflashctl.remote.deploy_target import Target

OCI_RELEASE = (9, 1)
PULL_STORAGE = "local"  # the storage every PVE install has for templates
_VOLUME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*:vztmpl/.+")
# pve-storage's pattern for the reference (API2/Storage/Status.pm oci_registry_pull): an
# optional registry host[:port]/, lowercase path components, and a tag (required).
_COMPONENT = r"[a-z\d]+(?:(?:[._]|__|[-]*)[a-z\d]+)*"
_HOST = r"(?:[a-zA-Z\d]|[a-zA-Z\d][a-zA-Z\d-]*[a-zA-Z\d])"
_REFERENCE = re.compile(
    rf"^(?:{_HOST}(?:\.{_HOST})*(?::\d+)?/)?{_COMPONENT}(?:/{_COMPONENT})*:\w[\w.-]{{0,127}}$"
)


def is_volume(template: str) -> bool:
    return bool(_VOLUME.match(template))


def reference_of(template: str) -> str:
    """The OCI reference a non-volume template names (a docker:// prefix dropped), or a
    ConfigError saying what the field takes."""
    reference = template.removeprefix("docker://")
    if not _REFERENCE.match(reference):
        raise ConfigError(
            f"container.template {template!r} is neither a CT template volume nor an OCI "
            "image reference with a tag",
            hint="e.g. local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst (pveam "
            "available), or docker.io/library/debian:12 (Proxmox VE 9.1 or later)",
        )
    return reference


def pulled_volume(reference: str) -> str:
    """Where oci-registry-pull stores it: pve-storage's normalize_content_filename of the
    reference (the part after the last /, other characters than [A-Za-z0-9_.-] made _)."""
    name = re.sub(r"[^a-zA-Z0-9_.-]", "_", reference.rpartition("/")[2])
    return f"{PULL_STORAGE}:vztmpl/{name}.tar"


def pve_version(target: Target) -> str:
    result = target.transport.run(
        ["pvesh", "get", "/version", "--output-format", "json"], check=False
    )
    if result.exit_status != 0:
        raise HostError(
            f"`pvesh get /version` failed on {target.transport.description}: "
            f"{result.last_error_line()}",
            hint="is it a Proxmox VE node? (pveversion there)",
        )
    return str(json.loads(result.stdout_text).get("version", "0"))


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def require_oci(target: Target, template: str) -> None:
    version = pve_version(target)
    if version_tuple(version) < OCI_RELEASE:
        raise ConfigError(
            f"container.template {template!r} is an OCI image: creating containers from "
            f"OCI images needs Proxmox VE 9.1 or later, and "
            f"{target.transport.description} runs {version}",
            hint="upgrade the node to PVE 9.1+, or name a CT template volume instead "
            "(pveam available; pveam download local <name>)",
        )


def templates(target: Target, node: str) -> set[str]:
    """The template volumes on `local`."""
    result = target.transport.run(
        ["pvesh", "get", f"/nodes/{node}/storage/{PULL_STORAGE}/content",
         "--content", "vztmpl", "--output-format", "json"],
        check=False,
    )  # fmt: skip
    if result.exit_status != 0:
        return set()
    return {item.get("volid", "") for item in json.loads(result.stdout_text or "[]")}


def pull_argv(node: str, reference: str) -> list[str]:
    return [
        "pvesh", "create", f"/nodes/{node}/storage/{PULL_STORAGE}/oci-registry-pull",
        "--reference", reference,
    ]  # fmt: skip


def pull(target: Target, argv: list[str]) -> None:
    result = target.transport.run(argv, timeout=1800.0, check=False)
    if result.exit_status != 0:
        raise HostError(
            f"`{shlex.join(argv)}` failed: {result.last_error_line()}",
            hint="the node pulls with skopeo and cannot log in to a registry: the image "
            "must be public (or pull it yourself into a storage and name its volume)",
        )


def ostemplate(config: Any, target: Target) -> tuple[str, list[str] | None]:
    """(the ostemplate for `pct create`, the pull command to run first or None)."""
    template = config.container.template
    if is_volume(template):
        return template, None
    reference = reference_of(template)
    require_oci(target, template)
    volume = pulled_volume(reference)
    node = config.proxmox.node
    if volume in templates(target, node):
        return volume, None
    return volume, pull_argv(node, reference)
