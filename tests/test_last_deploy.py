"""ops/releases.py: what this machine remembers of its last deploy to each target (the
round trip a redeploy saves), and the names of a target's uploads; humanize.py's sizes
and durations, as the messages show them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflashctl.humanize import human_bytes, human_duration
from dflashctl.ops import releases


def target(vmid=200, workdir="/root/dflash", address="gpu-a"):
    return SimpleNamespace(
        host=SimpleNamespace(address=address, port=22, user="root"),
        container=SimpleNamespace(vmid=vmid, workdir=workdir),
    )


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_last_deploy_is_remembered_per_target():
    manifest = {"train.py": [9, "ab" * 32, "644"]}
    releases.save_last_deploy(target(), "r1", manifest)
    releases.save_last_deploy(target(vmid=201), "r2", {})
    assert releases.load_last_deploy(target()) == releases.LastDeploy("r1", manifest)
    assert releases.load_last_deploy(target(vmid=201)).release == "r2"
    assert releases.load_last_deploy(target(address="gpu-b")) is None
    assert releases.load_last_deploy(target(workdir="/root/other")) is None


def test_a_damaged_cache_means_asking_the_container_again(cache_home):
    releases.save_last_deploy(target(), "r1", {})
    (saved,) = (cache_home / "dflashctl" / "targets").glob("*.json")
    for damaged in ("{not json", '{"manifest": {}}', '["r1"]', ""):
        saved.write_text(damaged)
        assert releases.load_last_deploy(target()) is None


def test_a_cache_that_cannot_be_written_does_not_fail_the_deploy(cache_home):
    cache_home.mkdir()
    (cache_home / "dflashctl").write_text("a file where the folder would go")
    releases.save_last_deploy(target(), "r1", {})
    assert releases.load_last_deploy(target()) is None


def test_uploads_are_named_per_target_and_workdir():
    names = {
        releases.upload_prefix("/root/dflash", 200),
        releases.upload_prefix("/root/dflash", 201),
        releases.upload_prefix("/root/other", 200),
        releases.upload_prefix("/root/dflash", None),
    }
    assert len(names) == 4
    assert all(n.startswith(releases.UPLOAD_PREFIX) for n in names)
    assert releases.upload_prefix("/root/dflash", None).startswith("dflashctl-upload-host-")
    assert releases.upload_prefix("/w", 200) == releases.upload_prefix("/w", 200)


def test_sizes_and_durations_read_as_people_write_them():
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 * 2**20 + 2**19, 3 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "5.5 MiB",
        "3072.0 GiB",
    ]
    assert [human_duration(s) for s in (0, 12, 249, 7500, 3 * 86400 + 4 * 3600 + 59)] == [
        "0s",
        "12s",
        "4m 09s",
        "2h 05m",
        "3d 4h",
    ]
