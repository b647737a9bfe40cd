"""OCI image archives on the stand-in node: what PVE 9.1's `pct create` does with one, a
registry that `oci-registry-pull` copies from, and the version gate.

Read from pve-container 94f5585 (src/PVE/LXC/Create.pm archive_is_oci_format,
restore_oci_archive; src/PVE/API2/LXC.pm create_vm) and pve-storage 0c56bad
(src/PVE/API2/Storage/Status.pm oci_registry_pull, src/PVE/Storage.pm
normalize_content_filename):

- an ostemplate is an OCI archive when its file ends in `.tar` and `tar -tf` lists
  `oci-layout`, `index.json` and `blobs/...`; create then prints `Detected OCI archive`
  and maps the image's config into the container's: Entrypoint + Cmd (unless
  `/sbin/init`) become `entrypoint`, with `cmode: console` and `host-managed=1` on each
  netN ("Auto-Enabling host-managed network for network device net0."); WorkingDir
  `lxc.init.cwd`; Env `lxc.environment.runtime` lines; StopSignal (default SIGTERM)
  `lxc.signal.halt`.
- before PVE 9.1 (pve-container 6.0.15) nothing checks for OCI: the archive is unpacked
  as a template and the OS detection fails: `unable to create CT <vmid> - unable to
  detect OS distribution`.
- oci-registry-pull stores `<normalized reference or filename>.tar` in the storage's
  vztmpl folder (`normalize_content_filename`: the part after the last `/`, every
  character outside `[A-Za-z0-9_.-]` made `_`) and refuses an existing file
  (`refusing to override existing file '<name>'`).

The fake registry is host.json `oci_registry`: {reference: path of an archive made by
make_archive}. A reference it lacks fails as skopeo does on an unknown tag.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import shlex
import tarfile
from pathlib import Path

OCI_RELEASE = (9, 1)  # PVE 9.1 = pve-container 6.0.15: creating from OCI images


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def is_oci_archive(path: Path) -> bool:
    if path.suffix != ".tar":
        return False
    try:
        with tarfile.open(path) as archive:
            names = {m.name.lstrip("./") for m in archive.getmembers()}
    except tarfile.TarError:
        return False
    return {"oci-layout", "index.json"} <= names and any(n.startswith("blobs/") for n in names)


def image_config(path: Path) -> dict:
    """The `config` of the image's first manifest (index.json -> manifest -> config)."""
    with tarfile.open(path) as archive:

        def blob(digest: str) -> dict:
            algorithm, _, hexdigest = digest.partition(":")
            return json.load(archive.extractfile(f"blobs/{algorithm}/{hexdigest}"))

        index = json.load(archive.extractfile("index.json"))
        manifest = blob(index["manifests"][0]["digest"])
        return blob(manifest["config"]["digest"]).get("config", {})


def apply_image_config(config: dict, options: dict[str, str], raw: list) -> list[str]:
    """restore_oci_archive's mapping onto a new container's options and raw lines; the
    lines it prints."""
    said = []
    init = [*(config.get("Entrypoint") or []), *(config.get("Cmd") or [])]
    if init and init[0] != "/sbin/init":
        options["entrypoint"] = shlex.join(init)
        options["cmode"] = "console"
        for key in sorted(k for k in options if re.fullmatch(r"net\d+", k)):
            if "host-managed=" not in options[key]:
                said.append(f"Auto-Enabling host-managed network for network device {key}.")
                options[key] += ",host-managed=1"
    if config.get("WorkingDir"):
        raw.append(("lxc.init.cwd", config["WorkingDir"]))
    raw += [("lxc.environment.runtime", env) for env in config.get("Env") or []]
    raw.append(("lxc.signal.halt", config.get("StopSignal") or "SIGTERM"))
    return said


def pulled_name(reference: str, filename: str | None) -> str:
    """normalize_content_filename(filename // reference) . '.tar'"""
    name = re.sub(r"^.*[/\\]", "", (filename or reference).strip())
    return re.sub(r"[^a-zA-Z0-9_.-]", "_", name) + ".tar"


def make_archive(path: Path, config: dict) -> Path:
    """An OCI image layout in a tar (as `skopeo copy ... oci-archive:`), one empty layer."""
    blobs: dict[str, bytes] = {}

    def add(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return {"digest": f"sha256:{digest}", "size": len(data)}

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w"):
        pass
    config_ref = add(
        json.dumps({"architecture": "amd64", "os": "linux", "config": config}).encode()
    )
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config_ref},
        "layers": [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", **add(layer.getvalue())}
        ],
    }
    manifest_ref = add(json.dumps(manifest).encode())
    index = {
        "schemaVersion": 2,
        "manifests": [{"mediaType": manifest["mediaType"], **manifest_ref}],
    }
    files = {
        "oci-layout": json.dumps({"imageLayoutVersion": "1.0.0"}).encode(),
        "index.json": json.dumps(index).encode(),
        **{f"blobs/sha256/{digest}": data for digest, data in blobs.items()},
    }
    with tarfile.open(path, "w") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path
