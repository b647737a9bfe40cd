"""Where a release's files land on disk: releases/ carries ext4's `T` attribute
(chattr +T), so that each release folder gets a block group of its own (see
dflashctl/agent/files.py spread_subfolders for why)."""

# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
from __future__ import annotations

import fcntl
import os
import struct
import subprocess
from pathlib import Path

import pytest

from dflashctl.agent.files import FS_IOC_GETFLAGS, FS_TOPDIR_FL, spread_subfolders
from dflashctl.ops.deploy import DeployOptions, deploy
from tests.test_deploy_support import project  # noqa: F401


def fs_type(path: Path) -> str:
    return subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=True
    ).stdout.strip()


def attribute_flags(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        raw = fcntl.ioctl(fd, FS_IOC_GETFLAGS, struct.pack("i", 0))
        return struct.unpack("i", raw[:4])[0]
    finally:
        os.close(fd)


needs_ext4 = pytest.mark.skipif(
    fs_type(Path(os.environ.get("TMPDIR", "/tmp"))) != "ext2/ext3",
    reason="the temporary folder is not on ext2/3/4",
)


@needs_ext4
def test_a_folder_is_marked_once_and_stays_marked(tmp_path):
    folder = tmp_path / "releases"
    folder.mkdir()
    assert not attribute_flags(folder) & FS_TOPDIR_FL
    assert spread_subfolders(str(folder)) is True
    assert attribute_flags(folder) & FS_TOPDIR_FL
    assert spread_subfolders(str(folder)) is True  # already marked: nothing to change
    assert attribute_flags(folder) & FS_TOPDIR_FL
    (folder / "r1").mkdir()
    assert not attribute_flags(folder / "r1") & FS_TOPDIR_FL  # not inherited


def test_elsewhere_it_is_a_polite_no(tmp_path):
    assert spread_subfolders(str(tmp_path / "missing")) is False
    (tmp_path / "file").write_text("x")
    assert spread_subfolders(str(tmp_path / "file")) is False
    if os.path.isdir("/dev/shm") and fs_type(Path("/dev/shm")) == "tmpfs":
        shm = Path("/dev/shm") / f"dflashctl-test-{os.getpid()}"
        shm.mkdir()
        try:
            assert spread_subfolders(str(shm)) is False  # tmpfs has no such attribute
        finally:
            shm.rmdir()


@needs_ext4
def test_a_deploy_marks_releases_and_the_release_is_complete(project):
    code, summary = deploy(project.config(), DeployOptions(detach=True))
    assert code == 0
    assert attribute_flags(project.workdir / "releases") & FS_TOPDIR_FL
    for rel in ("train.py", "helpers.py", "configs/tiny.yaml"):
        assert (project.current() / rel).read_bytes() == (project.source / rel).read_bytes()
