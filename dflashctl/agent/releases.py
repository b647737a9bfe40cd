"""Releases: `releases/<id>` folders, the `current` link, building one from an upload,
and garbage collection."""

import errno
import hashlib
import json
import os
import shutil
import stat
import tarfile
import time

from .errors import AgentError, StaleBase
from .files import BYTECODE_DIR, oldest_first, remove_file, sha256_file, spread_subfolders
from .incoming import IncomingArchive, members
from .manifest import (
    METADATA_SUFFIX,
    file_mode,
    is_link,
    link_stays_inside,
    metadata_path,
    read_metadata,
    stat_identity,
    write_metadata,
)

ABANDONED_UPLOAD_S = 60


def releases_dir(workdir):
    return os.path.join(workdir, "releases")


def current_release(workdir):
    """The release id `current` points at, or None (nothing deployed, or dangling)."""
    try:
        target = os.readlink(os.path.join(workdir, "current"))
    except OSError:
        return None
    release = os.path.basename(target.rstrip("/"))
    if not os.path.isdir(os.path.join(releases_dir(workdir), release)):
        return None
    return release


def swap_current(workdir, release):
    """Point `current` at releases/<release>: a new symlink renamed over the old one."""
    link = os.path.join(workdir, "current")
    tmp = f"{link}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", release), tmp)
    os.replace(tmp, link)


def safe_member_path(name):
    norm = os.path.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise AgentError(f"archive member {name!r} escapes the release folder")
    return norm


def remove_leftovers(workdir, keep_archive, upload_prefix):
    """Partial releases and uploaded archives left by an interrupted deploy."""
    removed = []
    base = releases_dir(workdir)
    if os.path.isdir(base):
        for name in os.listdir(base):
            path = os.path.join(base, name)
            if name.endswith(".partial"):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(os.path.join("releases", name))
            elif name.endswith(METADATA_SUFFIX) and not os.path.isdir(
                path[: -len(METADATA_SUFFIX)]
            ):
                os.unlink(path)  # the record of a release that never got into place
                removed.append(os.path.join("releases", name))
    if not upload_prefix:
        return removed
    # (Streamed archives leave no file; uploads of earlier versions went to /tmp.)
    tmpdir = os.path.dirname(keep_archive) if keep_archive else "/tmp"
    try:
        names = os.listdir(tmpdir)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(tmpdir, name)
        if path == keep_archive or not name.lstrip(".").startswith(upload_prefix):
            continue
        try:
            # An upload still being written keeps changing; one untouched for a while
            # was abandoned (several test hosts or users may share one /tmp).
            if time.time() - os.stat(path).st_mtime < ABANDONED_UPLOAD_S:
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def gc_releases(workdir, keep, protect):
    """Keep the newest `keep` releases (ids sort by time) plus those in `protect`."""
    base = releases_dir(workdir)
    if not os.path.isdir(base):
        return []
    names = [n for n in os.listdir(base) if not n.endswith(".partial")]
    names = oldest_first(
        base, [n for n in names if os.path.isdir(os.path.join(base, n))], metadata_path
    )
    kept = set(names[-keep:]) if keep > 0 else set()
    kept.update(p for p in protect if p)
    removed = []
    for name in names:
        if name not in kept:
            remove_release(workdir, name)
            removed.append(name)
    return removed


def remove_release(workdir, name):
    """A release folder, the manifest beside it, and the bytecode its runs wrote into
    the workdir's shared cache (kept at the release's real path: see runs.bytecode_env)."""
    path = os.path.join(releases_dir(workdir), name)
    real = os.path.realpath(path)
    shutil.rmtree(os.path.join(workdir, BYTECODE_DIR) + real, ignore_errors=True)
    shutil.rmtree(path, ignore_errors=True)
    remove_file(metadata_path(path))


def build_release(p):
    """Unpack the archive into releases/<id>.partial, link the unchanged files from
    the base release, validate, rename to releases/<id>. The caller holds the workdir
    lock. The archive is the rest of stdin when p["archive_size"] is given (see
    incoming.py), else the uploaded file p["archive"], removed whatever happens."""
    workdir, release = p["workdir"], p["release"]
    streamed = p.get("archive_size") is not None
    archive = None if streamed else p["archive"]
    base = p.get("base")
    try:
        leftovers = remove_leftovers(workdir, archive, p.get("upload_prefix"))
        os.makedirs(releases_dir(workdir), exist_ok=True)
        spread_subfolders(releases_dir(workdir))  # each release a tree of its own (ext4)
        final = os.path.join(releases_dir(workdir), release)
        if os.path.exists(final):
            raise AgentError(f"release {release} already exists in {workdir}")
        if "expect" in p and current_release(workdir) != base:
            raise StaleBase(f"the current release is {current_release(workdir)}, not {base}")
        partial = final + ".partial"
        os.mkdir(partial)
        try:
            base_dir = base and os.path.join(releases_dir(workdir), base)
            source = IncomingArchive(p["archive_size"]) if streamed else archive
            counts, manifest, stats = fill_release(
                partial, source, base_dir, p.get("manifest_sha256")
            )
            write_metadata(final, manifest, stats)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.rename(partial, final)
    finally:
        if archive is not None:
            remove_file(archive)
    counts.update({"release": release, "leftovers_removed": leftovers})
    return counts


def current_umask():
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def write_member(src, size, dest, mode, umask):
    """Write the member's `size` bytes (file object `src`) to a new file `dest` with
    `mode`; returns (sha256 of what was written, the file's stat). Four system calls
    for a small file (open, write, fstat, close): Python's open() adds three more, and
    a chmod only when the umask took bits off `mode`. Reads ask for no more than is
    left (a read of a megabyte allocates a megabyte, whatever it returns)."""
    digest = hashlib.sha256()
    # O_NOFOLLOW: never write through a link (none is made before the files are in).
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(dest, flags, mode)
    try:
        left = size
        while left > 0:
            chunk = src.read(min(left, 1 << 20))
            if not chunk:
                break
            left -= len(chunk)
            digest.update(chunk)
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
        if mode & umask:
            os.fchmod(fd, mode)
        return digest.hexdigest(), os.fstat(fd)
    finally:
        os.close(fd)


class _TarMember:
    """A member of an archive file, as incoming.Member is one of a stream."""

    def __init__(self, tar, info):
        self.name, self.size, self.mode = info.name, info.size, info.mode
        self.read = tar.extractfile(info).read


def archive_members(source):
    """The regular files of the archive, in order: `source` is an uploaded file's
    path (tarfile), or an IncomingArchive (read as it arrives, every byte of it)."""
    if isinstance(source, IncomingArchive):
        yield from members(source)
        source.drain()
        return
    with tarfile.open(source, "r:") as tar:
        for info in tar:
            if not info.isfile():
                raise AgentError(f"archive member {info.name!r} is not a regular file")
            yield _TarMember(tar, info)


def checked_manifest(raw, manifest_sha256=None):
    """The release's manifest (the archive's first member), refused when damaged or
    when it would make the release lead out of itself: a path outside it, a link
    whose text leaves it, or an entry under a link (writing it would go wherever the
    link leads)."""
    if manifest_sha256 and hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise AgentError(
            "the archive's manifest arrived damaged (its sha256 differs)",
            "deploy again; if it repeats, check the connection",
        )
    manifest = {safe_member_path(rel): entry for rel, entry in json.loads(raw.decode()).items()}
    links = {rel for rel, entry in manifest.items() if is_link(entry)}
    for rel in links:
        if not link_stays_inside(rel, manifest[rel][1]):
            raise AgentError(f"the link {rel} -> {manifest[rel][1]} leads out of the release")
    if links:
        for rel in manifest:
            parent = os.path.dirname(rel)
            while parent:
                if parent in links:
                    raise AgentError(f"{rel} lies under the link {parent} in the manifest")
                parent = os.path.dirname(parent)
    return manifest


def fill_release(partial, source, base_dir, manifest_sha256=None):
    """Unpack the archive (a path, or an IncomingArchive) into `partial`, link the
    rest from `base_dir`, check every file (and the manifest against
    `manifest_sha256`, when given), make the links last; returns (counts, manifest,
    stats). No write ever passes through a link: `partial` is new, every member
    written is a file of the manifest, no entry lies under a link, and the links are
    made only once every file is in place."""
    unpacked = {}
    stats = {}
    manifest = None
    folders = {partial}  # made already: thousands of small files share a few folders
    umask = current_umask()
    for member in archive_members(source):
        if manifest is None:  # the first member is dflashctl's, whatever its name
            manifest = checked_manifest(member.read(member.size), manifest_sha256)
            continue
        name = safe_member_path(member.name)
        if name not in manifest or is_link(manifest[name]):
            raise AgentError(f"archive member {member.name!r} is not a file of the manifest")
        dest = os.path.join(partial, name)
        make_folder(os.path.dirname(dest), folders)
        digest, st = write_member(member, member.size, dest, member.mode & 0o7777, umask)
        stats[name] = stat_identity(st)
        unpacked[name] = [member.size, digest]
    if manifest is None:
        raise AgentError("the uploaded archive is empty")
    base_manifest, base_stats = read_metadata(base_dir) if base_dir else ({}, {})
    base_folders = {}  # folder -> whether it is the base's own (no link on the way)
    linked = copied = 0
    links = []
    for rel, entry in sorted(manifest.items()):
        if is_link(entry):
            links.append((rel, entry[1]))
            continue
        size, sha, mode = entry
        dest = os.path.join(partial, rel)
        if rel in unpacked:
            if unpacked[rel] != [size, sha]:
                raise AgentError(
                    f"{rel} arrived damaged (size or sha256 differs)",
                    "deploy again; if it repeats, check the connection",
                )
            continue
        if not base_dir:
            raise StaleBase(
                f"{rel} was not sent and there is no previous release to take it from",
                "deploy again",
            )
        src = os.path.join(base_dir, rel)
        if not _own_folder(base_dir, os.path.dirname(rel), base_folders):
            raise StaleBase(
                f"{rel}: a folder on its way in the previous release is now a link",
                "deploy again; the release was changed meanwhile",
            )
        make_folder(os.path.dirname(dest), folders)
        try:
            os.link(src, dest, follow_symlinks=False)
            linked += 1
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise StaleBase(
                    f"{rel} is missing from the previous release",
                    "deploy again; the release was changed meanwhile",
                ) from None
            shutil.copy2(src, dest, follow_symlinks=False)
            copied += 1
        # Validate what we reuse: the previous release may have been edited in place.
        # A link whose stat is as recorded for the previous release is that content.
        st = os.lstat(dest)
        recorded = base_stats.get(rel) == stat_identity(st) and (
            list(base_manifest.get(rel) or [])[:2] == [size, sha]
        )
        if (
            not stat.S_ISREG(st.st_mode)
            or st.st_size != size
            or not (recorded or sha256_file(dest) == sha)
        ):
            raise StaleBase(
                f"{rel} in the previous release changed since it was inspected", "deploy again"
            )
        if file_mode(st.st_mode) != mode:
            # Only a chmod in place since the inspection gets here (a mode change
            # locally is sent); a link shares the mode, so fix this release's own copy.
            os.unlink(dest)
            shutil.copyfile(src, dest)
            os.chmod(dest, int(mode, 8))
            st = os.stat(dest)
        stats[rel] = stat_identity(st)
    make_links(partial, links, folders)
    counts = {
        "files": len(manifest),
        "unpacked": len(unpacked),
        "linked": linked,
        "copied": copied,
        "links": len(links),
    }
    return counts, manifest, stats


def make_folder(folder, folders):
    """Make `folder` unless it is in `folders` (those made already), and add it."""
    if folder not in folders:
        os.makedirs(folder, exist_ok=True)
        folders.add(folder)


def _own_folder(base_dir, folder, known):
    """Is `folder` (relative) of the previous release a folder of its own, reached
    through no link? (A folder swapped for a link since the inspection would make
    the reuse take a file from wherever it leads.) One check per folder."""
    if folder not in known:
        real_base = os.path.realpath(base_dir)
        path = os.path.join(base_dir, folder) if folder else base_dir
        known[folder] = os.path.realpath(path) == os.path.normpath(os.path.join(real_base, folder))
    return known[folder]


def make_links(partial, links, folders):
    """The manifest's links, with their texts; each must lead inside the release as
    the kernel resolves it (a ".." after another link goes where that link leads)."""
    for rel, target in links:
        dest = os.path.join(partial, rel)
        make_folder(os.path.dirname(dest), folders)
        os.symlink(target, dest)
    top = os.path.realpath(partial)
    for rel, target in links:
        real = os.path.realpath(os.path.join(partial, rel))
        if real != top and not real.startswith(top + os.sep):
            raise AgentError(f"the link {rel} -> {target} leads out of the release")
