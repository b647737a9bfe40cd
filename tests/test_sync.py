"""sync and archive: gitignore-style excludes, the manifest, the diff, the streamed archive,
the syntax check."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from dflashctl.errors import UsageError
from dflashctl.ops.archive import CHUNK, Archive
from dflashctl.ops.source_cache import SourceCache
from dflashctl.ops.sync import (
    METADATA_MEMBER,
    Excludes,
    build_manifest,
    check_syntax,
    diff_manifests,
    scan,
)


def make_archive(source, manifest, paths) -> bytes:
    """The streamed archive, whole (these trees are small), with the manifest as metadata."""
    return Archive.of_release(source, manifest, paths).read_all()


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


def test_links_that_leave_the_source_are_refused_naming_each(tmp_path):
    secret = tmp_path / "secret.key"
    secret.write_text("PRIVATE")
    (tmp_path / "keys").mkdir()
    src = tree(tmp_path / "src", {"train.py": "x = 1\n", "data/inside.txt": "ok\n"})
    (src / "creds").symlink_to(secret)
    (src / "data" / "keys").symlink_to(tmp_path / "keys")
    (src / "same.txt").symlink_to("data/inside.txt")  # stays inside: deployed
    with pytest.raises(UsageError) as caught:
        build_manifest(src, [])
    message = caught.value.message
    assert f"creds -> {secret}" in message and f"data/keys -> {tmp_path / 'keys'}" in message
    assert "same.txt" not in message and "trainer.exclude" in caught.value.hint
    manifest = build_manifest(src, ["creds", "data/keys"])  # left out: nothing leaves
    assert sorted(manifest) == ["data/inside.txt", "same.txt", "train.py"]


def test_a_chmod_alone_changes_the_manifest_and_travels_as_the_new_mode(tmp_path):
    src = tree(tmp_path, {"run.sh": "echo\n", "train.py": "x = 1\n"})
    before = build_manifest(src, [])
    (src / "run.sh").chmod(0o755)
    after = build_manifest(src, [])
    assert after["run.sh"][2] == "755" and after["run.sh"][:2] == before["run.sh"][:2]
    assert diff_manifests(after, before).changed == ["run.sh"]
    with tarfile.open(fileobj=io.BytesIO(make_archive(src, after, ["run.sh"])), mode="r:") as tar:
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
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        names = tar.getnames()
        assert names == [METADATA_MEMBER, "lib/a.py", "run.sh"]
        assert json.loads(tar.extractfile(METADATA_MEMBER).read()) == manifest
        assert tar.extractfile("lib/a.py").read() == b"a = 1\n"
        assert tar.getmember("run.sh").mode == 0o755


def test_archive_refuses_a_file_that_changed_after_the_manifest(tmp_path):
    src = tree(tmp_path, {"train.py": "print(1)\n"})
    manifest = build_manifest(src, [])
    (src / "train.py").write_text("print(2)  # saved meanwhile\n")
    with pytest.raises(UsageError, match="changed while it was being sent"):
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


def test_links_inside_are_kept_as_links_never_walked_through(tmp_path):
    src = tree(tmp_path / "src", {"train.py": "x = 1\n", "lib/a.py": "a = 1\n"})
    (src / "shared").symlink_to("lib")  # a folder: its files are deployed once, at lib/
    (src / "entry.py").symlink_to("train.py")
    (src / "lib" / "up.py").symlink_to("../train.py")
    (src / "lib" / "loop").symlink_to(src)  # absolute, back up the tree
    (src / "lib" / "roundabout").symlink_to("../../src/lib/a.py")  # out and back in by name
    (src / "later.log").symlink_to("logs/run.log")  # dangling, but inside: kept
    (src / "dangling.py").symlink_to(tmp_path / "nowhere.py")  # leads out, to nothing
    manifest = build_manifest(src, [])
    assert {rel: entry for rel, entry in manifest.items() if entry[0] == "link"} == {
        "shared": ["link", "lib"],
        "entry.py": ["link", "train.py"],
        "lib/up.py": ["link", "../train.py"],
        "lib/loop": ["link", ".."],
        "lib/roundabout": ["link", "a.py"],
        "later.log": ["link", "logs/run.log"],
    }
    assert sorted(rel for rel, entry in manifest.items() if entry[0] != "link") == [
        "lib/a.py",
        "train.py",
    ]
    # A link is its own kind of entry: a file in its place (or a new text) is a change,
    # and nothing of it travels but the manifest.
    (src / "entry.py").unlink()
    (src / "entry.py").write_text("x = 1\n")
    (src / "shared").unlink()
    (src / "shared").symlink_to("lib/a.py")
    after = build_manifest(src, [])
    assert after["entry.py"] == manifest["train.py"]
    assert diff_manifests(after, manifest).changed == ["entry.py", "shared"]
    assert diff_manifests(manifest, after).changed == ["entry.py", "shared"]
    data = make_archive(src, after, ["entry.py", "shared"])
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        assert tar.getnames() == [METADATA_MEMBER, "entry.py"]
    assert check_syntax(src, after) == 3  # entry.py, lib/a.py, train.py (not lib/up.py)


def test_an_excluded_link_is_neither_kept_nor_refused(tmp_path):
    src = tree(tmp_path / "src", {"train.py": "x = 1\n"})
    (src / "home").symlink_to(Path.home())
    (src / "alias").symlink_to("train.py")
    manifest, skipped = scan(src, ["home", "alias"])
    assert sorted(manifest) == ["train.py"] and skipped.names() == ["home/", "alias"]


def test_archive_size_is_known_before_reading_and_pieces_stay_small(tmp_path):
    src = tree(tmp_path, {f"pkg/m{i}.py": f"x = {i}\n" for i in range(300)})
    (src / "big.dat").write_bytes(os.urandom(3 * CHUNK + 123))
    manifest = build_manifest(src, [])
    archive = Archive(src, manifest, sorted(manifest), {})
    sent: list[int] = []
    digest = hashlib.sha256()
    pieces = list(archive.chunks(sent.append, digest))
    assert sum(map(len, pieces)) == archive.size == sum(sent)
    assert digest.hexdigest() == hashlib.sha256(b"".join(pieces)).hexdigest()
    assert archive.size % tarfile.RECORDSIZE == 0
    # Small files share a piece; no piece holds much more than one chunk.
    assert len(pieces) < 10 and max(map(len, pieces)) < 2 * CHUNK + tarfile.BLOCKSIZE * 4
    with tarfile.open(fileobj=io.BytesIO(b"".join(pieces)), mode="r:") as tar:
        assert sorted(tar.getnames()) == sorted(manifest)
        assert tar.extractfile("big.dat").read() == (src / "big.dat").read_bytes()


def test_archive_takes_any_file_name(tmp_path):
    names = [
        "MANIFEST.json",
        "with space.txt",
        "ünïcode.py",
        "x" * 120 + "/long.txt",
        "a\udcffb.txt",
    ]
    src = tmp_path / "src"
    for name in names:
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_bytes(name.encode("utf-8", "surrogateescape"))
    manifest = build_manifest(src, [])
    assert sorted(manifest) == sorted(names)
    data = Archive(src, manifest, sorted(manifest), {}).read_all()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:", encoding="utf-8") as tar:
        got = {m.name: tar.extractfile(m).read() for m in tar}
    assert got == {n: n.encode("utf-8", "surrogateescape") for n in names}


def test_archive_stops_before_its_end_when_a_file_shrank(tmp_path):
    src = tree(tmp_path, {"a.txt": "a" * 1000, "b.txt": "b" * 1000})
    manifest = build_manifest(src, [])
    archive = Archive(src, manifest, ["a.txt", "b.txt"], {})
    (src / "b.txt").write_text("short")
    produced = bytearray()
    with pytest.raises(UsageError, match="b.txt changed while it was being sent"):
        for piece in archive.chunks():
            produced += piece
    assert len(produced) < archive.size  # the receiver sees a short upload


def test_scan_names_what_the_excludes_left_out(tmp_path):
    src = tree(
        tmp_path,
        {
            "train.py": "x = 1\n",
            "model.safetensors": "w" * 5000,
            "tok.bin": "t" * 10,
            "data/train.jsonl": "{}\n",
            "pkg/__pycache__/a.pyc": "junk",
            "wandb/run-1/log": "l",
        },
    )
    manifest, skipped = scan(src, ["__pycache__/", "*.safetensors", "*.bin", "data/", "wandb/"])
    assert sorted(manifest) == ["train.py"]
    assert skipped.names() == ["data/", "wandb/", "model.safetensors", "tok.bin"]
    line = skipped.describe(lambda n: f"{n} B")
    assert line == (
        "left out by trainer.exclude: data/, wandb/, model.safetensors (5000 B), tok.bin (10 B)"
    )
    assert scan(src, [])[1].describe(str) is None


# Root reads any file: the CLI runs without the capabilities that let it.
NO_OVERRIDE = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--"]


@pytest.mark.parametrize("what", ["file", "folder"])
def test_unreadable_file_or_folder_is_exit_2_naming_it_before_any_host(tmp_path, what):
    src = tree(tmp_path / "src", {"train.py": "x = 1\n", "lib/secret.txt": "s"})
    bad = src / "lib" / "secret.txt" if what == "file" else src / "lib"
    config = tmp_path / "dflash.yaml"
    # Port 9 on loopback: nothing listens there; contacting it would be exit 3.
    config.write_text(
        "host: {address: 127.0.0.1, port: 9}\ncontainer: {vmid: 200}\n"
        "trainer: {source: src, entry: train.py}\n"
    )
    bad.chmod(0)
    try:
        argv = [sys.executable, "-m", "dflashctl", "deploy", "-c", str(config), "--detach"]
        if os.geteuid() == 0:
            argv = NO_OVERRIDE + argv
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        bad.chmod(0o755)
    assert result.returncode == 2, result.stderr
    assert f"cannot read {bad}: Permission denied" in result.stderr
    assert "Traceback" not in result.stderr and "127.0.0.1" not in result.stderr


def test_source_cache_skips_reading_files_whose_stat_is_unchanged(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tree(tmp_path / "src", {"big.dat": "a" * 4096, "new.py": "x = 1\n"})
    old = time.time_ns() - 60 * 10**9
    os.utime(src / "big.dat", ns=(old, old))  # older than the racy window
    first = SourceCache(src)
    manifest, _ = scan(src, [], first)
    assert check_syntax(src, manifest, first) == 1
    first.save(manifest)

    # Same size, same mtime, same inode: taken as unchanged without reading it (as git
    # does); a file changed just before the scan ("racy") is read every time.
    (src / "big.dat").write_text("b" * 4096)
    os.utime(src / "big.dat", ns=(old, old))
    (src / "new.py").write_text("x = 2\n")
    again, _ = scan(src, [], SourceCache(src))
    assert again["big.dat"] == manifest["big.dat"]
    assert again["new.py"][1] == hashlib.sha256(b"x = 2\n").hexdigest()

    os.utime(src / "big.dat", ns=(old, old + 1))  # any change of mtime: read again
    third, _ = scan(src, [], SourceCache(src))
    assert third["big.dat"][1] == hashlib.sha256(b"b" * 4096).hexdigest()


def test_source_cache_remembers_only_content_that_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    src = tree(tmp_path / "src", {"a.py": "x = 1\n"})
    cache = SourceCache(src)
    manifest, _ = scan(src, [], cache)
    check_syntax(src, manifest, cache)
    cache.save(manifest)
    (src / "a.py").write_text("x = (\n")
    cache = SourceCache(src)
    broken, _ = scan(src, [], cache)
    with pytest.raises(UsageError, match="a.py:1:"):
        check_syntax(src, broken, cache)


@pytest.mark.parametrize(
    ("name", "size", "mode"),
    [
        ("train.py", 0, 0o644),
        ("pkg/d00/m00000.py", 12, 0o755),
        ("x" * 100, 8**11 - 1, 0o644),  # the longest name and size a plain header holds
        ("x" * 101, 1, 0o644),  # longer: a pax record
        ("données/é.py", 3, 0o644),  # not ASCII: a pax record
        ("big.bin", 8**11, 0o644),  # 8 GiB: a pax record
    ],
)
def test_archive_headers_are_what_tarfile_writes(name, size, mode):
    """The plain headers built directly are byte for byte tarfile's (pax format)."""
    from dflashctl.ops.archive import _header

    info = tarfile.TarInfo(name)
    info.size, info.mode = size, mode
    assert _header(name, size, mode) == info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def test_syntax_check_compiles_what_the_scan_read_without_reading_it_again(tmp_path):
    src = tree(tmp_path, {"a.py": "x = 1\n", "b.py": "y = (\n", "c.txt": "z"})
    texts: dict[str, bytes] = {}
    manifest, _ = scan(src, [], texts=texts)
    assert texts == {"a.py": b"x = 1\n", "b.py": b"y = (\n"}  # .py only
    for rel in texts:
        (src / rel).unlink()  # were it read again, this would say "cannot read"
    with pytest.raises(UsageError, match=r"b\.py:1: "):
        check_syntax(src, manifest, texts=texts)


def test_a_big_python_file_is_hashed_whole_and_not_kept(tmp_path):
    from dflashctl.ops.sync import KEEP_TEXT_BYTES

    body = b"# " + b"x" * 98 + b"\n"
    big = body * (KEEP_TEXT_BYTES // len(body) + 2)  # a little over the limit
    src = tree(tmp_path, {"small.py": "x = 1\n"})
    (src / "big.py").write_bytes(big)
    (src / "empty.py").write_bytes(b"")
    texts: dict[str, bytes] = {}
    manifest, _ = scan(src, [], texts=texts)
    assert manifest["big.py"][:2] == [len(big), hashlib.sha256(big).hexdigest()]
    assert manifest["empty.py"][:2] == [0, hashlib.sha256(b"").hexdigest()]
    assert sorted(texts) == ["empty.py", "small.py"]
    assert check_syntax(src, manifest, texts=texts) == 3  # big.py read again to compile


def test_diff_of_thousands_of_files_stays_fast():
    local = {f"pkg/m{i:05d}.py": [10, f"{i:064x}", "644"] for i in range(20_000)}
    diff = diff_manifests(local, None)
    assert len(diff.changed) == 20_000 and diff.unchanged == []
    # How fast (linear, not quadratic): bench/bench_diff_manifests.py.
