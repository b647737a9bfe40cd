"""The log reader that runs in the container, and the parser of its framed output."""

from __future__ import annotations

PROTOCOL_MAGIC = b"DFLASH-LOG 1\n"

# The reader that runs in the container (`python -c READER RUNDIR OFFSET BACKLOG MODE`).
# Frames on stdout, each a header line, `D` followed by that many bytes of log:
#   S <start> <size>  the log is open; reading starts at byte <start>, it had <size> bytes
#   D <n>             n bytes of log
#   R                 the log was truncated or replaced: offsets start again at 0
#   W                 no log yet (a run that is starting)
#   H                 heartbeat, after a second of silence
#   N                 no such run folder
#   E                 the run looks over (or MODE is "once") and the log was read to its end
# The end check comes before each read, so the read that finds the end of the file after
# it has seen everything the run wrote.
READER = r"""
import os, sys, time
rundir, pos, backlog, once = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "once"
log = os.path.join(rundir, "train.log")
out = sys.stdout.buffer
last = 0.0

def emit(head, data=b""):
    global last
    out.write(head.encode() + b"\n" + data)
    out.flush()
    last = time.monotonic()

def run_over():
    if os.path.exists(os.path.join(rundir, "exit_code")):
        return True
    try:
        with open(os.path.join(rundir, "pid")) as f:
            pid = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return False
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return False

def main():
    global pos
    out.write(b"DFLASH-LOG 1\n")
    if not os.path.isdir(rundir):
        emit("N")
        return
    f, inode, waiting = None, None, False
    while True:
        over = run_over()
        if f is None:
            try:
                f = open(log, "rb")
            except FileNotFoundError:
                if over or once:
                    emit("E")
                    return
                if not waiting:
                    emit("W")
                    waiting = True
            else:
                st = os.fstat(f.fileno())
                inode = st.st_ino
                if pos > st.st_size:
                    emit("R")
                    pos = 0
                if 0 <= backlog < st.st_size - pos:
                    f.seek(st.st_size - backlog)
                    f.readline()
                    pos = f.tell()
                f.seek(pos)
                emit("S %d %d" % (pos, st.st_size))
                continue
        else:
            data = f.read(1 << 16)
            if data:
                emit("D %d" % len(data), data)
                pos += len(data)
                continue
            if over or once:
                emit("E")
                return
            try:
                st = os.stat(log)
            except FileNotFoundError:
                st = None
            if st is None or st.st_ino != inode:
                f.close()
                f, pos = None, 0
                emit("R")
                continue
            if st.st_size < pos:
                f.seek(0)
                pos = 0
                emit("R")
                continue
        if time.monotonic() - last >= 1.0:
            emit("H")
        time.sleep(0.05)

try:
    main()
except BrokenPipeError:
    os._exit(0)
"""


class ReaderBroken(Exception):
    """The reader's output is not the protocol (a shell that prints on stdout, an old Python)."""


class FrameParser:
    """Splits the reader's stdout into (kind, numbers, payload) frames.

    A `D` frame's bytes are handed on as they arrive (several ("D", ...) pieces for one
    frame), so whatever came before a drop mid-frame is still used.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._synced = False
        self._data_left = 0  # bytes of the current D frame still to come

    def feed(self, data: bytes) -> list[tuple[str, list[int], bytes]]:
        self._buf += data
        if not self._synced:
            # Anything before the magic line is noise from the remote login (a chatty rc file).
            at = self._buf.find(PROTOCOL_MAGIC)
            if at < 0:
                if len(self._buf) > 1 << 16:
                    raise ReaderBroken(f"no log reader answer in {bytes(self._buf[:200])!r}")
                return []
            del self._buf[: at + len(PROTOCOL_MAGIC)]
            self._synced = True
        frames = []
        while self._buf:
            if self._data_left:
                piece = bytes(self._buf[: self._data_left])
                del self._buf[: len(piece)]
                self._data_left -= len(piece)
                frames.append(("D", [len(piece)], piece))
                continue
            newline = self._buf.find(b"\n")
            if newline < 0:
                break
            line = bytes(self._buf[:newline])
            head = line.split()
            del self._buf[: newline + 1]
            try:
                kind = head[0].decode("ascii")
                numbers = [int(x) for x in head[1:]]
            except (IndexError, UnicodeDecodeError, ValueError):
                raise ReaderBroken(f"unexpected reader output {line[:200]!r}") from None
            if kind == "D":
                self._data_left = numbers[0]
            else:
                frames.append((kind, numbers, b""))
        return frames
