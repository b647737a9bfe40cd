"""The agent's build from an archive streaming in on stdin (dflashctl/agent/incoming.py):
the same release as from a file, any member name, and nothing at all when the stream
ends early or arrives damaged."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path

import pytest

from dflashctl.agent.errors import AgentError
from dflashctl.agent.incoming import IncomingArchive
from dflashctl.agent.releases import fill_release
from dflashctl.ops.archive import Archive
from dflashctl.ops.sync import build_manifest


def tree(root: Path) -> Path:
    names = ["train.py", "a" * 40 + "/" + "b" * 90 + ".bin", "données/café ☕.txt", "empty"]
    for i, name in enumerate(names):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(1000 * i))
    (root / "big.bin").write_bytes(os.urandom(3 << 20))  # more than one piece of the wire
    (root / "train.py").chmod(0o755)
    return root


def streamed(source: Path) -> tuple[bytes, Archive, dict]:
    manifest = build_manifest(source, [])
    archive = Archive.of_release(source, manifest, sorted(manifest))
    return archive.read_all(), archive, manifest


def build(tmp_path: Path, data: bytes, size: int, manifest_sha: str | None = None):
    partial = tmp_path / "out.partial"
    partial.mkdir(parents=True)
    return partial, fill_release(
        str(partial), IncomingArchive(size, io.BufferedReader(io.BytesIO(data))), None, manifest_sha
    )


def test_a_streamed_archive_builds_every_file_with_its_mode_and_long_or_unicode_name(tmp_path):
    source = tree(tmp_path / "src")
    data, archive, manifest = streamed(source)
    partial, (counts, built, _) = build(
        tmp_path, data, archive.size, hashlib.sha256(archive.metadata).hexdigest()
    )
    assert built == manifest and counts["unpacked"] == len(manifest)
    for rel in manifest:
        assert (partial / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert os.stat(partial / "train.py").st_mode & 0o777 == 0o755


def test_a_stream_that_ends_early_is_an_incomplete_archive_wherever_it_stops(tmp_path):
    source = tree(tmp_path / "src")
    data, archive, _ = streamed(source)
    for cut in (100, 600, len(data) // 2, len(data) - 1):
        with pytest.raises(AgentError, match=r"arrived incomplete \(\d+ of \d+ bytes\)"):
            build(tmp_path / str(cut), data[:cut], archive.size)


def test_damaged_bytes_or_manifest_fail_the_build(tmp_path):
    source = tree(tmp_path / "src")
    data, archive, _ = streamed(source)
    at = data.index(b"big.bin") + 4096  # inside big.bin's content
    damaged = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    with pytest.raises(AgentError, match="big.bin arrived damaged"):
        build(tmp_path / "a", damaged, archive.size)
    with pytest.raises(AgentError, match="manifest arrived damaged"):
        build(tmp_path / "b", data, archive.size, "0" * 64)
    with pytest.raises(AgentError, match="damaged"):
        build(tmp_path / "c", data[:148] + b"X" + data[149:], archive.size)  # a header's checksum
