"""Links in a release (dflashctl/agent/releases.py): the manifest's links are made as
links with their own text, a release never gets a link that leads out of it, and no
file of a build is ever written through a link."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflashctl.agent.errors import AgentError, StaleBase
from dflashctl.agent.manifest import read_metadata, real_manifest
from dflashctl.agent.releases import build_release, current_release, swap_current
from dflashctl.ops.archive import Archive
from dflashctl.ops.sync import build_manifest, diff_manifests
from tests.test_agent_build import crafted, entry, upload


def linked_source(root: Path) -> Path:
    (root / "lib").mkdir(parents=True)
    (root / "lib" / "a.py").write_text("a = 1\n")
    (root / "train.py").write_text("import lib.a\n")
    (root / "shared").symlink_to("lib")
    (root / "entry.py").symlink_to("train.py")
    (root / "lib" / "up.py").symlink_to("../train.py")
    return root


def upload_changed(tmp_path: Path, source: Path, before: dict) -> tuple[Path, dict]:
    """The archive a redeploy sends: the manifest, and the files that changed."""
    manifest = build_manifest(source, [])
    archive = tmp_path / "changed.tar"
    changed = diff_manifests(manifest, before).changed
    with open(archive, "wb") as f:
        for piece in Archive.of_release(source, manifest, changed).chunks():
            f.write(piece)
    return archive, manifest


def build(tmp_path: Path, archive: Path, release: str, base: str | None = None) -> dict:
    params = {"workdir": str(tmp_path / "work"), "release": release, "archive": str(archive)}
    if base:
        params["base"] = base
    return build_release(params)


def test_links_arrive_as_links_with_their_text_and_the_record_knows_them(tmp_path):
    source = linked_source(tmp_path / "src")
    archive, manifest = upload(tmp_path, source)
    built = build(tmp_path, archive, "r1")
    assert (built["files"], built["unpacked"], built["links"]) == (5, 2, 3)
    release = tmp_path / "work" / "releases" / "r1"
    assert os.readlink(release / "shared") == "lib"
    assert os.readlink(release / "entry.py") == "train.py"
    assert os.readlink(release / "lib" / "up.py") == "../train.py"
    assert (release / "shared" / "a.py").read_text() == "a = 1\n"
    assert sorted(os.listdir(release)) == ["entry.py", "lib", "shared", "train.py"]
    assert read_metadata(str(release))[0] == manifest == real_manifest(str(release))


def test_a_changed_link_is_updated_and_a_link_turned_file_is_seen(tmp_path):
    source = linked_source(tmp_path / "src")
    first, before = upload(tmp_path, source, "first.tar")
    build(tmp_path, first, "r1")
    (source / "shared").unlink()
    (source / "shared").symlink_to("lib/a.py")
    (source / "entry.py").unlink()
    (source / "entry.py").write_text("import train\n")
    second, manifest = upload_changed(tmp_path, source, before)
    built = build(tmp_path, second, "r2", base="r1")
    releases = tmp_path / "work" / "releases"
    assert os.readlink(releases / "r2" / "shared") == "lib/a.py"
    assert not (releases / "r2" / "entry.py").is_symlink()
    assert (releases / "r2" / "entry.py").read_text() == "import train\n"
    assert os.readlink(releases / "r1" / "shared") == "lib"  # the previous one as it was
    assert built["linked"] == 2  # lib/a.py and train.py, from r1
    assert real_manifest(str(releases / "r2")) == manifest
    # A link put in a file's place by hand (or a file in a link's) is a change.
    (releases / "r2" / "train.py").unlink()
    (releases / "r2" / "train.py").symlink_to("lib/a.py")
    (releases / "r2" / "shared").unlink()
    (releases / "r2" / "shared").write_text("a = 1\n")
    seen = real_manifest(str(releases / "r2"))
    assert seen["train.py"] == ["link", "lib/a.py"] and seen["shared"][0] != "link"


@pytest.mark.parametrize(
    ("links", "files", "said"),
    [
        ({"etc": "/etc"}, [], "etc -> /etc leads out of the release"),
        ({"up": "../../.."}, [], "up -> ../../.. leads out"),
        ({"sub/up": "../../x"}, [], "sub/up -> ../../x leads out"),
        # Each reads as inside, but "here" is the release itself, so here/.. is not.
        ({"here": ".", "away": "here/../victim"}, [], "away -> here/../victim leads out"),
        # A file under a link would be written wherever the link leads.
        ({"lib": "sub"}, [("lib/x.py", b"x = 1\n")], "lib/x.py lies under the link lib"),
        # A member must be a file of the manifest, never a link's place.
        ({"lib": "sub"}, [("sub/x.py", b"x = 1\n"), ("lib", b"x = 1\n")], "'lib' is not a file"),
    ],
)
def test_a_manifest_whose_links_lead_out_is_refused_and_nothing_is_written(
    tmp_path, links, files, said
):
    workdir = tmp_path / "work"
    source = linked_source(tmp_path / "src")
    first, _ = upload(tmp_path, source, "first.tar")
    build(tmp_path, first, "r1")
    swap_current(str(workdir), "r1")
    before = sorted(os.listdir(workdir / "releases"))
    manifest = {rel: ["link", text] for rel, text in links.items()}
    manifest.update({name: entry(data) for name, data in files if name not in links})
    archive = crafted(tmp_path, manifest, files)
    with pytest.raises(AgentError, match=said):
        build(tmp_path, archive, "r2")
    assert sorted(os.listdir(workdir / "releases")) == before
    assert current_release(str(workdir)) == "r1"
    assert not (workdir / "victim").exists() and not list(tmp_path.glob("**/x.py"))


def test_reuse_never_takes_a_file_through_a_link_put_in_the_previous_release(tmp_path):
    """The previous release's lib/ swapped for a link after it was inspected: the
    files the new one would link from there are refused, not taken from elsewhere."""
    source = linked_source(tmp_path / "src")
    first, before = upload(tmp_path, source, "first.tar")
    build(tmp_path, first, "r1")
    r1 = tmp_path / "work" / "releases" / "r1"
    elsewhere = tmp_path / "elsewhere"
    (r1 / "lib").rename(elsewhere)
    (r1 / "lib").symlink_to(elsewhere)
    (source / "train.py").write_text("import lib.a  # changed\n")
    second, _ = upload_changed(tmp_path, source, before)
    with pytest.raises(StaleBase, match="lib/a.py: a folder on its way"):
        build(tmp_path, second, "r2", base="r1")
    assert not (tmp_path / "work" / "releases" / "r2").exists()
