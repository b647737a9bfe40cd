"""One lock per mutating verb: what a verb checked is still true when it acts."""

from __future__ import annotations

import os

import pytest

from dflashctl.agent import files, verbs
from dflashctl.agent.errors import AgentError, StaleBase
from dflashctl.ops import sync
from dflashctl.ops.archive import Archive


def _locked_out(workdir) -> bool:
    """Is the workdir lock held (by a verb running in this process)?"""
    try:
        fd = files.lock_workdir(str(workdir))
    except AgentError:
        return True
    os.close(fd)
    return False


def test_launch_checks_its_expectation_under_the_lock(tmp_path):
    workdir = tmp_path / "work"
    params = {
        "workdir": str(workdir),
        "run_id": "r1",
        "entry": "train.py",
        "grace_s": 1,
        "expect": {"release": "20261130-000000-aaaa", "manifest": {}},
    }
    with pytest.raises(StaleBase):  # nothing deployed: the expectation is out of date
        verbs.op_launch(params)
    held = files.lock_workdir(str(workdir))
    try:
        # Another deploy, restart or stop holds the lock: the check waits its turn
        # instead of judging a workdir that is being changed.
        with pytest.raises(AgentError, match="another dflashctl deploy, restart or stop") as caught:
            verbs.op_launch(params)
        assert not isinstance(caught.value, StaleBase)
    finally:
        os.close(held)


def test_deploy_holds_one_lock_from_build_to_launch(tmp_path, monkeypatch):
    source, workdir = tmp_path / "src", tmp_path / "work"
    source.mkdir()
    (source / "train.py").write_text("print('hi')\n")
    manifest = sync.build_manifest(source, [])
    archive = tmp_path / "upload.tar"
    archive.write_bytes(Archive.of_release(source, manifest, list(manifest)).read_all())
    seen = {}

    def launch(p, warm=None):  # warm: the commit barrier started ahead (several nodes)
        # Between build and launch nobody else could take the workdir.
        seen["locked"] = _locked_out(workdir)
        seen["built"] = (workdir / "releases" / p["release"] / "train.py").is_file()
        return {"release": p["release"]}

    monkeypatch.setattr(verbs, "launch", launch)
    answer = verbs.op_deploy(
        {"workdir": str(workdir), "release": "20261130-000000-bbbb", "archive": str(archive)}
    )
    assert seen == {"locked": True, "built": True}
    assert answer["build"]["files"] == 1 and answer["release"] == "20261130-000000-bbbb"
    assert not archive.exists()  # the upload is removed once built
    assert not _locked_out(workdir)  # and the lock released after
