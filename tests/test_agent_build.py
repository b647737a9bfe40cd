"""The agent's build of a release from an uploaded archive (dflashctl/agent/releases.py):
every file as the manifest says, or no release at all; the previous one stays current."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from dflashctl.agent.errors import AgentError
from dflashctl.agent.manifest import read_metadata, real_manifest, stat_identity
from dflashctl.agent.releases import build_release, current_release, swap_current
from dflashctl.ops.archive import Archive
from dflashctl.ops.sync import METADATA_MEMBER, build_manifest


def write_tree(root: Path, count: int) -> Path:
    for i in range(count):
        path = root / "pkg" / f"d{i // 50:02d}" / f"m{i:04d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE = {i}\n")
    (root / "run.sh").write_text("#!/bin/sh\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty.txt").write_text("")
    return root


def upload(tmp_path: Path, source: Path, name: str = "upload.tar") -> tuple[Path, dict]:
    manifest = build_manifest(source, [])
    archive = tmp_path / name
    with open(archive, "wb") as f:
        for piece in Archive.of_release(source, manifest, sorted(manifest)).chunks():
            f.write(piece)
    return archive, manifest


def crafted(tmp_path: Path, manifest: dict, members: list[tuple[str, bytes]]) -> Path:
    """An archive as dflashctl writes one (manifest first), with the members given."""
    archive = tmp_path / "crafted.tar"
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [(METADATA_MEMBER, json.dumps(manifest).encode()), *members]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return archive


def entry(data: bytes) -> list:
    return [len(data), hashlib.sha256(data).hexdigest(), "644"]


def test_a_release_of_hundreds_of_files_is_complete_and_recorded(tmp_path):
    source = write_tree(tmp_path / "src", 300)
    archive, manifest = upload(tmp_path, source)
    workdir = tmp_path / "work"
    built = build_release({"workdir": str(workdir), "release": "r1", "archive": str(archive)})
    assert built["files"] == built["unpacked"] == 302 and built["linked"] == 0
    release = workdir / "releases" / "r1"
    for rel, (size, sha, mode) in manifest.items():
        data = (release / rel).read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (size, sha)
        assert oct((release / rel).stat().st_mode & 0o777)[2:] == mode
    recorded, stats = read_metadata(str(release))
    assert recorded == manifest
    # The stats recorded are the files' own: the next deploy trusts them unread.
    assert all(stats[rel] == stat_identity(os.stat(release / rel)) for rel in manifest)
    assert real_manifest(str(release)) == manifest
    assert not archive.exists() and not (workdir / "releases" / "r1.partial").exists()


def test_modes_are_the_archives_whatever_the_umask(tmp_path):
    source = write_tree(tmp_path / "src", 3)
    archive, _ = upload(tmp_path, source)
    old = os.umask(0o077)
    try:
        build_release({"workdir": str(tmp_path / "w"), "release": "r1", "archive": str(archive)})
    finally:
        os.umask(old)
    release = tmp_path / "w" / "releases" / "r1"
    assert (release / "run.sh").stat().st_mode & 0o777 == 0o755
    assert (release / "empty.txt").stat().st_mode & 0o777 == 0o644


def test_a_private_file_stays_private_in_the_release(tmp_path):
    source = write_tree(tmp_path / "src", 1)
    (source / "secrets.env").write_text("TOKEN=1\n")
    (source / "secrets.env").chmod(0o600)
    (source / "tool.sh").write_text("#!/bin/sh\n")
    (source / "tool.sh").chmod(0o750)
    archive, manifest = upload(tmp_path, source)
    assert (manifest["secrets.env"][2], manifest["tool.sh"][2]) == ("600", "750")
    build_release({"workdir": str(tmp_path / "w"), "release": "r1", "archive": str(archive)})
    release = tmp_path / "w" / "releases" / "r1"
    assert (release / "secrets.env").stat().st_mode & 0o777 == 0o600
    assert (release / "tool.sh").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize(
    "files",
    [
        # "lib" arrives as a file, then "lib/a.py" needs it as a folder;
        [("lib", b"x = 1\n"), ("lib/a.py", b"a = 1\n")],
        # "lib" is a folder when the file "lib" is to be written there.
        [("lib/a.py", b"a = 1\n"), ("lib", b"x = 1\n")],
    ],
)
def test_a_file_that_cannot_be_written_fails_the_build_naming_it_and_leaves_nothing(
    tmp_path, files
):
    workdir = tmp_path / "work"
    source = write_tree(tmp_path / "src", 5)
    first, _ = upload(tmp_path, source, "first.tar")
    build_release({"workdir": str(workdir), "release": "r1", "archive": str(first)})
    swap_current(str(workdir), "r1")
    before = sorted(os.listdir(workdir / "releases"))

    archive = crafted(tmp_path, {name: entry(data) for name, data in files}, files)
    with pytest.raises(OSError) as info:
        build_release({"workdir": str(workdir), "release": "r2", "archive": str(archive)})
    assert "r2.partial/lib" in str(info.value.filename)
    assert sorted(os.listdir(workdir / "releases")) == before  # no r2, no r2.partial
    assert current_release(str(workdir)) == "r1"
    assert not archive.exists()


def test_a_damaged_file_fails_the_build_naming_it_and_leaves_nothing(tmp_path):
    workdir = tmp_path / "work"
    files = [("a.py", b"a = 1\n"), ("b.py", b"b = 2\n")]
    manifest = {name: entry(data) for name, data in files}
    manifest["b.py"] = entry(b"b = 3\n")  # what was meant to arrive
    archive = crafted(tmp_path, manifest, files)
    with pytest.raises(AgentError, match=r"b\.py arrived damaged"):
        build_release({"workdir": str(workdir), "release": "r1", "archive": str(archive)})
    assert os.listdir(workdir / "releases") == []
    assert not archive.exists()
