"""The archive of changed files, streamed from disk: never whole in memory.

An uncompressed POSIX (pax) tar whose exact size is known before the first byte is
read: the agent reads exactly that many bytes off its stdin (see
agent/incoming.py) and knows a stream cut short. Members are the metadata (`METADATA_MEMBERS`, bytes
built here) and then the changed files, each read once, in chunks, and checked
against the manifest as it goes: a file edited while it is being sent ends the
stream early (the agent then sees a short archive and deploys nothing) instead of
deploying it half-old, half-new.

No compression: weights and data do not shrink, code is small, and on a LAN the link
outruns a single-threaded gzip.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflashctl.agent.manifest import is_link
from dflashctl.errors import UsageError
from dflashctl.ops.source_cache import SourceCache
from dflashctl.ops.sync import METADATA_MEMBER, Manifest, unreadable

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 20 blocks: tar pads the whole archive to a record
CHUNK = 1 << 20  # what one write to the wire carries (a pipe to ssh, or paramiko)


def _padding(size: int, unit: int = BLOCK) -> int:
    return -size % unit


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


# A ustar header's fields after the checksum, for a regular file with no owner names
# or device numbers: type "0", no link name, magic and version, uname, gname,
# devmajor, devminor, prefix, padding (as tarfile writes them).
_USTAR_TAIL = b"0" + bytes(100) + b"ustar\x0000" + bytes(32 + 32 + 8 + 8 + 155 + 12)
_ZERO_ID = _octal(0, 8)
_TAIL_SUM = sum(_USTAR_TAIL) + 8 * ord(" ")  # the checksum field counts as spaces


def _ustar_header(name: str, size: int, mode: int) -> bytes | None:
    """The header tarfile writes for this member when it needs no pax record (an ASCII
    name of at most 100 bytes, a size below 8 GiB), built directly: tarfile's way
    costs 15 us a member, most of a 5,000-file archive's making. None otherwise."""
    if not name.isascii() or len(name) > 100 or "\0" in name or size >= 8**11:
        return None
    head = (
        name.encode("ascii").ljust(100, b"\0")
        + _octal(mode, 8)
        + _ZERO_ID  # uid
        + _ZERO_ID  # gid
        + _octal(size, 12)
        + _octal(0, 12)  # mtime
    )
    checksum = sum(head) + _TAIL_SUM
    return head + b"%06o\0 " % checksum + _USTAR_TAIL


def _header(name: str, size: int, mode: int) -> bytes:
    fast = _ustar_header(name, size, mode)
    if fast is not None:
        return fast
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    # pax headers carry any name: long, non-ASCII, even bytes that are not UTF-8.
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


@dataclass(frozen=True)
class _Member:
    name: str
    header: bytes
    size: int
    data: bytes | None  # in memory (metadata), or None: read from the source
    sha256: str | None


class Archive:
    """`size` bytes of tar; `chunks()` produces them, reading files as it goes."""

    def __init__(
        self,
        source: Path,
        manifest: Manifest,
        paths: Iterable[str],
        extra: dict[str, bytes],
        known: SourceCache | None = None,
    ) -> None:
        self.source = Path(source)
        self.known = known
        members = [
            _Member(name, _header(name, len(data), 0o644), len(data), data, None)
            for name, data in extra.items()
        ]
        for rel in paths:
            if is_link(manifest[rel]):
                continue  # a link travels in the manifest (the first member), as its text
            size, sha, mode = manifest[rel]
            members.append(_Member(rel, _header(rel, size, int(mode, 8)), size, None, sha))
        self._members = members
        # The first member's bytes (a deploy's manifest): the agent checks its sha256.
        self.metadata = members[0].data or b"" if members else b""
        self._members_bytes = sum(len(m.header) + m.size + _padding(m.size) for m in members)
        # Two zero blocks end a tar; the whole is padded to a record, as tarfile does.
        end = self._members_bytes + 2 * BLOCK
        self.size = end + _padding(end, RECORD)

    @classmethod
    def of_release(
        cls,
        source: Path,
        manifest: Manifest,
        paths: Iterable[str],
        known: SourceCache | None = None,
    ) -> Archive:
        """What a deploy sends: the manifest of the whole new release first (the agent
        takes the first member as such, whatever its name), then the files in `paths`.
        `known`: the source cache the scan saved (files it knows are not hashed again)."""
        metadata = json.dumps(manifest, sort_keys=True).encode()
        return cls(source, manifest, paths, {METADATA_MEMBER: metadata}, known)

    def chunks(
        self, progress: Callable[[int], None] | None = None, digest: Any = None
    ) -> Iterator[bytes]:
        """The archive in pieces: small members share pieces of about CHUNK bytes, a
        big file's pieces go out as read (not copied into a buffer first);
        `progress(n)` once the consumer has taken (sent) a piece of n bytes. `digest`
        (a hashlib object), if given, sees every piece."""
        buffer = bytearray()

        def out(data: bytes) -> Iterator[bytes]:
            if digest is not None:
                digest.update(data)
            yield data
            if progress is not None:
                progress(len(data))

        def flush() -> Iterator[bytes]:
            data = bytes(buffer)
            buffer.clear()
            yield from out(data)

        for member in self._members:
            buffer += member.header
            if member.data is not None:
                buffer += member.data
            elif member.size >= CHUNK:
                yield from flush()
                for piece in self._file_pieces(member):
                    yield from out(piece)
            else:
                for piece in self._file_pieces(member):
                    buffer += piece
            buffer += bytes(_padding(member.size))
            if len(buffer) >= CHUNK:
                yield from flush()
        buffer += bytes(self.size - self._members_bytes)
        yield from flush()

    def _file_pieces(self, member: _Member) -> Iterator[bytes]:
        """The file's bytes, checked against the manifest as they go: hashed again,
        unless the source cache knows its content by its stat (the scan has just
        hashed it, or an earlier one did; it is not "racy") and the stat is the same
        after the read. (The agent checks every file's sha256 in the container too:
        this check is here to say clearly what happened.)"""
        path = self.source / member.name
        digest = hashlib.sha256()
        left = member.size
        try:
            with open(path, "rb") as f:
                before = os.fstat(f.fileno())
                known = self.known is not None and (
                    self.known.sha256(member.name, before) == member.sha256
                )
                while left:
                    piece = f.read(min(CHUNK, left))
                    if not piece:
                        break
                    if not known:
                        digest.update(piece)
                    left -= len(piece)
                    yield piece
                grew = bool(f.read(1))
                after = os.fstat(f.fileno())
        except OSError as exc:
            raise unreadable(path, exc) from None
        if known:
            same = SourceCache.same_file(before, after)
        else:
            same = digest.hexdigest() == member.sha256
        if left or grew or not same:
            raise UsageError(
                f"{path} changed while it was being sent",
                hint="run the deploy again once your editor has saved",
            )

    def read_all(self) -> bytes:
        """The whole archive in memory: for tests and small archives only."""
        return b"".join(self.chunks())
