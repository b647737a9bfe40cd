"""The parser of the log reader's framed output (the reader is the agent's `log` verb)."""

from __future__ import annotations

from dflashctl.remote import agent_client

# The reader is the agent's `log` verb (dflashctl/agent/logreader.py, which documents
# the frames); this is the same magic line it starts with.
PROTOCOL_MAGIC = b"DFLASH-LOG 1\n"


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

    @property
    def agent_missing(self) -> bool:
        """The bootstrap answered that the container keeps no agent (before any frame)."""
        return not self._synced and agent_client.is_agent_missing(bytes(self._buf))

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
        frames: list[tuple[str, list[int], bytes]] = []
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
