"""The archive of a deploy as it arrives on the agent's stdin, right behind the
agent's own program: exactly `size` bytes, no fewer.

The deploy's command reads its program off stdin first (a known number of bytes, see
agent_client.LOADER), so what stdin holds next is the archive, read here
as it comes and unpacked straight into the release: no copy of it on the host or in
the container, and every byte read once. A stream that ends early (the connection
dropped, the client was stopped) fails the build, which then leaves nothing behind.
"""

import sys
import tarfile

from .errors import AgentError


class IncomingArchive:
    """A file-like reader of the next `size` bytes of stdin (for tarfile's "r|")."""

    def __init__(self, size, source=None):
        self.size = int(size)
        self.left = self.size
        if source is None:
            source = sys.stdin.buffer
            _widen_pipe(0)
        self._source = source

    def read(self, n=-1):
        want = self.left if n is None or n < 0 else min(n, self.left)
        if want <= 0:
            return b""
        data = self._source.read(want)  # a BufferedReader blocks for all `want` bytes
        self.left -= len(data)
        if len(data) < want:
            raise self.cut()
        return data

    def drain(self):
        """Read what tarfile left of the archive (its end blocks and padding): the build
        counts as complete only once every byte announced has arrived."""
        while self.left:
            self.read(min(self.left, 1 << 20))

    def cut(self):
        got = self.size - self.left
        return AgentError(
            f"the archive arrived incomplete ({got} of {self.size} bytes): "
            "the connection dropped or the deploy was stopped",
            "nothing was changed; deploy again",
        )


BLOCK = 512
F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ (Linux), not named by Python before 3.10


def _widen_pipe(fd):
    """A pipe of 1 MiB instead of 64 KiB: a sixteenth of the reads and wake-ups.
    Best effort (not a pipe, or a lower limit in /proc/sys/fs/pipe-max-size)."""
    try:
        import fcntl

        fcntl.fcntl(fd, F_SETPIPE_SZ, 1 << 20)
    except (OSError, ImportError):
        pass


def _pax_records(data):
    """The `<length> <key>=<value>\n` records of a pax extended header."""
    records = {}
    at = 0
    while at < len(data) and data[at : at + 1] != b"\0":
        space = data.index(b" ", at)
        length = int(data[at:space])
        key, _, value = data[space + 1 : at + length - 1].partition(b"=")
        records[key.decode("ascii", "replace")] = value.decode("utf-8", "surrogateescape")
        at += length
    return records


class Member:
    """One regular file of the stream: its name, size and mode; `read(n)` its bytes."""

    def __init__(self, archive, name, size, mode):
        self.name, self.size, self.mode = name, size, mode
        self._archive = archive
        self._left = size

    def read(self, n):
        n = min(n, self._left)
        if n <= 0:
            return b""
        data = self._archive.read(n)
        self._left -= len(data)
        return data

    def skip(self):
        """The rest of its bytes and its padding to the next block."""
        while self._left:
            self.read(1 << 20)
        self._archive.read(-self.size % BLOCK)


def members(archive):
    """The members of the ustar/pax stream `archive` (an IncomingArchive), in order,
    each a Member whose bytes go straight from the pipe to the caller: tarfile's "r|"
    copies every byte three times on the way (a third of the build's CPU for a big
    file). A member that is not a regular file is an AgentError."""
    pax = {}
    while True:
        header = archive.read(BLOCK)
        if header == bytes(BLOCK):
            return  # end of archive (drain() reads the rest)
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except tarfile.HeaderError as exc:
            raise AgentError(f"the archive is damaged: {exc}", "deploy again") from None
        if info.type in (tarfile.XHDTYPE, tarfile.XGLTYPE):
            data = archive.read(info.size + (-info.size % BLOCK))[: info.size]
            if info.type == tarfile.XHDTYPE:
                pax = _pax_records(data)
            continue
        name = pax.get("path", info.name)
        size = int(pax["size"]) if "size" in pax else info.size
        pax = {}
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise AgentError(f"archive member {name!r} is not a regular file")
        member = Member(archive, name, size, info.mode)
        yield member
        member.skip()
