"""sync: gitignore-style excludes, the manifest, the diff, the archive, the syntax check."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from dflashctl.errors import UsageError
from dflashctl.sync import (
    MANIFEST_NAME,
    Excludes,
    build_manifest,
    check_syntax,
    diff_manifests,
    make_archive,
)


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


@pytest.mark.parametrize(
    ("patterns", "path", "is_dir", "excluded"),
    [
        (["*.pyc"], "a/b/c.pyc", False, True),
        (["*.pyc"], "a/b/c.py", False, False),
        (["__pycache__/"], "pkg/__pycache__", True, True),
        (["__pycache__/"], "pkg/__pycache__", False, False),  # trailing / : folders only
        (["/outputs"], "outputs", True, True),
        (["/outputs"], "sub/outputs", True, False),  # leading / anchors at the top
        (["docs/*.md"], "docs/a.md", False, True),
        (["docs/*.md"], "x/docs/a.md", False, False),  # a middle / anchors too
        (["docs/*.md"], "docs/sub/a.md", False, False),  # * stays in one segment
        (["**/logs"], "a/b/logs", True, True),
        (["**/logs"], "logs", True, True),
        (["a/**/z.txt"], "a/z.txt", False, True),
        (["a/**/z.txt"], "a/b/c/z.txt", False, True),
        (["data/**"], "data/x/y.bin", False, True),
        (["*.log", "!keep.log"], "keep.log", False, False),  # negation re-includes
        (["*.log", "!keep.log"], "other.log", False, True),
        (["file?.txt"], "file1.txt", False, True),
        (["file?.txt"], "file10.txt", False, False),
        (["[ab].py"], "a.py", False, True),
        (["[!ab].py"], "a.py", False, False),
        (["# comment", ""], "# comment", False, False),
        (["\\#hash"], "#hash", False, True),
    ],
)
def test_excludes_follow_gitignore_rules(patterns, path, is_dir, excluded):
    assert Excludes(patterns).excluded(path, is_dir) is excluded


def test_manifest_skips_excluded_files_and_folders(tmp_path):
    src = tree(
        tmp_path,
        {
            "train.py": "print(1)\n",
            "pkg/model.py": "x = 1\n",
            "pkg/__pycache__/model.cpython-311.pyc": "junk",
            "outputs/ckpt.bin": "big",
            "notes.pyc": "junk",
        },
    )
    manifest = build_manifest(src, ["__pycache__/", "*.pyc", "outputs/"])
    assert sorted(manifest) == ["pkg/model.py", "train.py"]
    data = (src / "train.py").read_bytes()
    assert manifest["train.py"] == [len(data), hashlib.sha256(data).hexdigest(), "644"]


def test_a_chmod_alone_changes_the_manifest_and_travels_as_the_new_mode(tmp_path):
    src = tree(tmp_path, {"run.sh": "echo\n", "train.py": "x = 1\n"})
    before = build_manifest(src, [])
    (src / "run.sh").chmod(0o755)
    after = build_manifest(src, [])
    assert after["run.sh"][2] == "755" and after["run.sh"][:2] == before["run.sh"][:2]
    assert diff_manifests(after, before).changed == ["run.sh"]
    with tarfile.open(fileobj=io.BytesIO(make_archive(src, after, ["run.sh"])), mode="r:gz") as tar:
        assert tar.getmember("run.sh").mode == 0o755


def test_manifest_of_a_missing_source_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="is not a folder"):
        build_manifest(tmp_path / "nope", [])


def test_diff_lists_changed_removed_and_unchanged():
    local = {"a.py": [1, "x"], "b.py": [2, "y"], "new.py": [3, "z"]}
    remote = {"a.py": [1, "x"], "b.py": [2, "OLD"], "gone.py": [4, "w"]}
    diff = diff_manifests(local, remote)
    assert diff.changed == ["b.py", "new.py"]
    assert diff.removed == ["gone.py"]
    assert diff.unchanged == ["a.py"]
    assert diff_manifests(local, None).changed == sorted(local)
    assert diff_manifests(local, dict(local)).empty


def test_archive_holds_the_manifest_and_only_the_changed_files(tmp_path):
    src = tree(tmp_path, {"train.py": "print(1)\n", "lib/a.py": "a = 1\n", "run.sh": "echo\n"})
    (src / "run.sh").chmod(0o755)
    manifest = build_manifest(src, [])
    data = make_archive(src, manifest, ["lib/a.py", "run.sh"])
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        names = tar.getnames()
        assert names == [MANIFEST_NAME, "lib/a.py", "run.sh"]
        assert json.loads(tar.extractfile(MANIFEST_NAME).read()) == manifest
        assert tar.extractfile("lib/a.py").read() == b"a = 1\n"
        assert tar.getmember("run.sh").mode == 0o755


def test_archive_refuses_a_file_that_changed_after_the_manifest(tmp_path):
    src = tree(tmp_path, {"train.py": "print(1)\n"})
    manifest = build_manifest(src, [])
    (src / "train.py").write_text("print(2)  # saved meanwhile\n")
    with pytest.raises(UsageError, match="changed while it was being packed"):
        make_archive(src, manifest, ["train.py"])


def test_syntax_error_names_file_line_and_caret(tmp_path):
    src = tree(tmp_path, {"ok.py": "x = 1\n", "pkg/bad.py": "x = 1\n    def f(:\n"})
    manifest = build_manifest(src, [])
    with pytest.raises(UsageError) as info:
        check_syntax(src, manifest)
    message = info.value.message
    assert f"{src / 'pkg/bad.py'}:2: " in message
    lines = message.splitlines()
    assert lines[1].strip() == "def f(:"
    assert lines[2].strip() == "^"


def test_syntax_check_counts_python_files(tmp_path):
    src = tree(tmp_path, {"a.py": "x = 1\n", "b/c.py": "y = 2\n", "d.txt": "not python ("})
    assert check_syntax(src, build_manifest(src, [])) == 2


def test_symlinks_are_deployed_as_what_they_point_at_and_loops_are_cut(tmp_path):
    src = tree(tmp_path / "src", {"train.py": "x = 1\n", "lib/a.py": "a = 1\n"})
    shared = tree(tmp_path / "shared", {"util.py": "u = 1\n", "outputs/big.bin": "x"})
    (src / "shared").symlink_to(shared)
    (src / "lib" / "loop").symlink_to(src)  # a link back up the tree
    (src / "dangling.py").symlink_to(tmp_path / "nowhere.py")
    manifest = build_manifest(src, ["/shared/outputs/"])
    assert sorted(manifest) == ["lib/a.py", "shared/util.py", "train.py"]
