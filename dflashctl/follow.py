"""Follow a run's log live, with crash detection: the code behind `logs`, `deploy` and `restart`.

Use it right after launching a run (or to look at one):

    from dflashctl.follow import follow_run, report_result

    result = follow_run(
        reconnect,                      # () -> Target: a fresh connection, used after a drop
        config.container.workdir,
        run_id,
        rules=rules_for(config),        # built-in crash rules + the config's crash_patterns
        target=target,                  # the connection already open; left open for the caller
        python=config.container.python, # runs the small log reader in the container
        from_offset=0,                  # the whole log of a new run (or lines=N: the last N)
    )
    sys.exit(report_result(result, json_mode=json_mode))

follow_run prints every line as it comes and a panel for every crash the moment the
detector is sure of it, and returns a FollowResult once the run has ended (or at the end
of the log with follow=False, or when Ctrl-C stops the following: `interrupted`, exit
130; the run is left alone). It raises UsageError for a run that does not exist, and
HostError (exit 3) when the connection cannot be had back within `reconnect_timeout_s`
(the run may then still be running) or the container stopped.

How it works:
- One command through the connection streams the log: a small Python reader in the
  container (READER below) sends framed chunks of `runs/<id>/train.log` from a byte
  offset, a heartbeat every second of silence, and `E` once the run looks over (its
  exit_code file exists, or its pid is gone) and the file was read to its end. The reader
  dies on its next write once nobody reads it, so a dropped connection leaves nothing
  behind; the run itself is never touched.
- The follower keeps the offset just past the last complete line it printed. After a drop
  it reconnects with backoff (0.2, 0.5, 1, 2, then 5 s) and starts a reader at that
  offset: a partial line is read again whole, no line is printed twice or lost.
- The end of a run is decided by the run's real state (dflashctl.runs.run_state), asked
  when the reader says `E`, when its stream ends, and every `state_poll_s` as a safety
  net; never by the stream ending alone. After the end the log is read to its last byte
  before the crash detector weighs the exit code.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from dflashctl import hints, terminal
from dflashctl.errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK, HostError, UsageError
from dflashctl.run_summary import RunSummary

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent

# Reconnect delays after a dropped connection; the last one repeats.
RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# Past this much log before the start, only its tail is read (and classified).
BACKLOG_MAX_BYTES = 64 << 20
PROTOCOL_MAGIC = b"DFLASH-LOG 1\n"
# After this long without new log bytes, an open traceback is taken as complete (the
# detector otherwise waits a few more lines for a chained one). Python writes a whole
# traceback, chained parts included, within milliseconds; the reader polls every 50 ms.
QUIET_S = 0.1
READ_TIMEOUT_S = 0.05

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


@dataclass
class FollowResult:
    """How a run stands once following stopped."""

    run_id: str | None
    status: str  # "finished" | "crashed" | "running"
    exit_code: int | None
    crashes: list[CrashEvent] = field(default_factory=list)
    state: str | None = None  # dflashctl.runs status: running, exited, killed, lost
    signal: int | None = None
    interrupted: bool = False  # Ctrl-C stopped the following (the run was left alone)
    source: str | None = None  # a local file classified with --file
    summary: RunSummary = field(default_factory=RunSummary)  # loss, tau, checkpoint
    rundir: str | None = None  # workdir/runs/<id> on the target
    where: str | None = None  # "CT 200 on root@pve:22", "this machine"

    @property
    def cli_exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_CRASH if self.status == "crashed" else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "run": self.run_id,
            "status": self.status,
            "exit_code": self.exit_code,
            "crashes": [event.to_json() for event in self.crashes],
        }
        if self.source is not None:
            data["file"] = self.source
        if self.interrupted:
            data["interrupted"] = True
        if not self.summary.empty:
            data["summary"] = self.summary.to_json()
        if self.rundir is not None:
            data["run_dir"] = self.rundir
        return data


# --------------------------------------------------------------------------- lines out


def _line_style(line: str) -> str | None:
    lowered = line.lower()
    if line.startswith("Traceback") or " failed:" in line or "error" in lowered:
        return "red"
    if "warning" in lowered or "non-finite" in lowered:
        return "yellow"
    return None


class LineSink:
    """Prints log lines and feeds them to the crash detector, rendering each crash panel
    as soon as the detector is sure of it.

    With `keep_last` set, lines are held back (the backlog) until `go_live()`: then only
    the last `keep_last` of them are printed, followed by panels for crashes found in
    all of them, so `-n 50` still reports a crash from line 3.
    """

    def __init__(
        self,
        rules: Any,
        console: Console,
        *,
        keep_last: int | None = None,
        show_lines: bool = True,
        on_crash: Callable[[CrashEvent], None] | None = None,
    ) -> None:
        from dflashctl.crash import CrashDetector

        self.detector = CrashDetector(rules)
        self.summary = RunSummary()
        self.console = console
        self.show_lines = show_lines
        self.on_crash = on_crash
        self.backlog: deque[str] | None = deque(maxlen=keep_last) if keep_last is not None else None
        self._held_events: list[CrashEvent] = []
        self.count = 0
        self._flushed_at = 0

    def line(self, text: str) -> None:
        self.count += 1
        events = self.detector.feed(text)
        self.summary.feed(text)
        if self.backlog is not None:
            self.backlog.append(text)
            self._held_events.extend(events)
        else:
            self._print(text)
            self._render(events)
        if self.on_crash is not None:
            for event in events:
                self.on_crash(event)

    def quiet(self) -> None:
        """The log went quiet: a traceback that may still continue is final after all
        (the detector otherwise waits a few lines for a chained traceback)."""
        if self.backlog is None and self.count != self._flushed_at:
            self._flushed_at = self.count
            events = self.detector.flush()
            self._render(events)
            if self.on_crash is not None:
                for event in events:
                    self.on_crash(event)

    def go_live(self) -> None:
        if self.backlog is None:
            return
        for text in self.backlog:
            self._print(text)
        self.backlog = None
        self._render(self._held_events)
        self._held_events = []

    def finish(self, exit_code: int | None) -> None:
        """The run ended: weigh the exit code (a crash may only now be certain)."""
        self.go_live()
        events = self.detector.finish(exit_code)
        self._render(events)
        if self.on_crash is not None:
            for event in events:
                self.on_crash(event)

    @property
    def crashes(self) -> list[CrashEvent]:
        return list(self.detector.crashes)

    def _print(self, text: str) -> None:
        if self.show_lines:
            self.console.print(Text(text, style=_line_style(text) or ""), soft_wrap=True)

    def _render(self, events: Iterable[CrashEvent]) -> None:
        if not self.show_lines:
            return
        from dflashctl.crash.render import render_crash

        for event in events:
            render_crash(self.console, event)


class LineSplitter:
    """Cuts a byte stream into lines and remembers the file offset just past the last
    complete line: the place to resume from after a drop."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self._partial = bytearray()

    @property
    def received_end(self) -> int:
        """Offset just past the last byte received (complete line or not)."""
        return self.offset + len(self._partial)

    def reset(self, offset: int) -> None:
        self.offset = offset
        self._partial.clear()

    def feed(self, data: bytes) -> list[str]:
        self._partial += data
        lines = []
        start = 0
        while (end := self._partial.find(b"\n", start)) >= 0:
            lines.append(_decode(self._partial[start:end]))
            start = end + 1
        if start:
            del self._partial[:start]
            self.offset += start
        return lines

    def flush(self) -> str | None:
        """The last line of a log that does not end with a newline (the run is over)."""
        if not self._partial:
            return None
        text = _decode(self._partial)
        self.offset += len(self._partial)
        self._partial.clear()
        return text


def _decode(raw: bytes | bytearray) -> str:
    return bytes(raw).decode("utf-8", errors="replace").rstrip("\r")


# --------------------------------------------------------------------------- reader frames


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


# --------------------------------------------------------------------------- following


class _Dropped(Exception):
    """The stream went silent or broke: reconnect."""


# A stopped or missing container, a container.python that cannot run, or a host key that no longer matches, will not come
# back by retrying: those end the following at once. (Not "auth": a connection cut during
# the handshake shows up as an authentication failure.)
_FINAL_CONNECT_REASONS = ("host_key_unknown", "host_key_changed")


def _is_connection_trouble(exc: BaseException) -> bool:
    from dflashctl.pct import ContainerNotFound, ContainerNotRunning
    from dflashctl.runs import InterpreterMissing

    if isinstance(exc, (ContainerNotFound, ContainerNotRunning, InterpreterMissing)):
        return False
    if getattr(exc, "reason", None) in _FINAL_CONNECT_REASONS:
        return False
    return isinstance(exc, (HostError, OSError, EOFError, _Dropped))


def follow_run(
    reconnect: Callable[[], Any] | None,
    workdir: str,
    run_id: str,
    *,
    rules: Any,
    target: Any | None = None,
    python: str = "python3",
    follow: bool = True,
    from_offset: int = 0,
    lines: int | None = None,
    console: Console | None = None,
    show_lines: bool = True,
    on_crash: Callable[[CrashEvent], None] | None = None,
    reconnect_timeout_s: float = 120.0,
    state_poll_s: float = 5.0,
    stall_s: float = 10.0,
    state_of: Callable[[Any, str, str], Any] | None = None,
) -> FollowResult:
    """Print run `run_id`'s log and crashes; return how the run ended.

    reconnect: makes a new Target after a drop (and the first one when `target` is None);
      None: a drop is fatal (HostError). Targets it makes are closed here.
    follow: False reads what the log holds now and returns (status "running" while the
      run goes on, unless a crash was seen).
    from_offset / lines: start at a byte offset (0: the whole log), or show only the last
      `lines` lines that exist at the start (all earlier lines still reach the detector).
    console: where lines and crash panels go (default terminal.out, which --json turns
      to stderr). show_lines=False prints nothing; on_crash is called for each crash as
      soon as it is certain, either way.
    state_of: (target, workdir, run_id) -> RunState; default dflashctl.runs.run_state.
    """
    if state_of is None:
        from dflashctl.runs import run_state

        def state_of(target: Any, workdir: str, run_id: str) -> Any:
            return run_state(target, workdir, run_id, python=python)

    follower = _Follower(
        reconnect=reconnect,
        rundir=f"{workdir.rstrip('/')}/runs/{run_id}",
        run_id=run_id,
        workdir=workdir,
        target=target,
        python=python,
        follow=follow,
        splitter=LineSplitter(from_offset),
        sink=LineSink(
            rules,
            console if console is not None else terminal.out,
            keep_last=lines,
            show_lines=show_lines,
            on_crash=on_crash,
        ),
        backlog_max=BACKLOG_MAX_BYTES if lines is not None else -1,
        reconnect_timeout_s=reconnect_timeout_s,
        state_poll_s=state_poll_s,
        stall_s=stall_s,
        state_of=state_of,
    )
    return follower.run()


@dataclass(kw_only=True, eq=False)
class _Follower:
    reconnect: Callable[[], Any] | None
    rundir: str
    run_id: str
    workdir: str
    target: Any
    python: str
    follow: bool
    splitter: LineSplitter
    sink: LineSink
    backlog_max: int
    reconnect_timeout_s: float
    state_poll_s: float
    stall_s: float
    state_of: Callable[[Any, str, str], Any]
    _owned: list[Any] = field(default_factory=list, init=False)  # made here, closed at the end
    _stream: Any = field(default=None, init=False)
    # The log's size when first opened: the backlog ends there.
    _live_from: int | None = field(default=None, init=False)
    # The next reader reads to the end of the log and stops.
    _read_to_end: bool = field(default=False, init=False)
    _trouble_since: float | None = field(default=None, init=False)
    _attempt: int = field(default=0, init=False)
    _empty_readers: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self._read_to_end = not self.follow

    # -- the whole run ---------------------------------------------------------------

    def run(self) -> FollowResult:
        try:
            if self.target is None:
                if self.reconnect is None:
                    raise ValueError("follow_run needs a target or a way to connect")
                self.target = self._new_target()
            state = self._follow()
        except KeyboardInterrupt:
            self._close_stream()
            self.sink.go_live()
            self.sink.quiet()
            return self._result(None, interrupted=True)
        finally:
            self._close_stream()
            for target in self._owned:
                _close_quietly(target)
        if state.status != "running":
            last = self.splitter.flush()  # a last line without its newline
            if last is not None:
                self.sink.line(last)
        self.sink.go_live()
        if state.status != "running":
            self.sink.finish(state.exit_code)
        else:
            self.sink.quiet()  # the log as it stands: a traceback at its end is complete
        return self._result(state)

    def _follow(self):
        while True:
            try:
                saw_end = self._pump()
                state = self.state_of(self.target, self.workdir, self.run_id)
            except Exception as exc:
                if not _is_connection_trouble(exc):
                    final = self._final_error(exc)
                    if final is exc:
                        raise
                    raise final from exc
                self._recover(exc)
                continue
            if state.status != "running":
                if saw_end:
                    return state
                self._read_to_end = True  # the log may hold more: read it to the end first
                continue
            if not self.follow and saw_end:
                return state
            self._reader_stopped()

    def _final_error(self, exc: Exception) -> Exception:
        from dflashctl.pct import ContainerNotRunning

        if isinstance(exc, ContainerNotRunning):
            return HostError(
                f"{exc.message}, so run {self.run_id} is not running either",
                hint=exc.hint,
            )
        if isinstance(exc, ReaderBroken):
            return HostError(
                f"cannot read {self.rundir}/train.log: {exc}",
                hint="something on the host or in the container prints on stdout first; "
                "check the shell start-up files there",
            )
        return exc

    def _reader_stopped(self) -> None:
        """The reader stopped while the run goes on: its end check disagreed with the
        run's state, or it died. Start another, but not forever if it never answers."""
        self._empty_readers += 1
        if self._empty_readers >= 3:
            stderr = self._stream_stderr()
            raise HostError(
                f"cannot read {self.rundir}/train.log: the log reader in the container keeps "
                f"stopping{': ' + stderr if stderr else ''}",
                hint=f"check that `{self.python}` runs in the container (container.python)",
            )
        time.sleep(0.5)

    # -- one reader ------------------------------------------------------------------

    def _pump(self) -> bool:
        """Run one reader from the current offset; True when it said the log is complete."""
        once = self._read_to_end
        argv = [
            self.python,
            "-c",
            READER,
            self.rundir,
            str(self.splitter.offset),
            str(self.backlog_max if self._live_from is None else -1),
            "once" if once else "follow",
        ]
        self._close_stream()
        self._stream = self.target.stream(argv)
        parser = FrameParser()
        last_data = time.monotonic()
        next_poll = last_data + self.state_poll_s
        while True:
            chunk = self._stream.read(READ_TIMEOUT_S)
            now = time.monotonic()
            if chunk is None:
                if now - last_data >= QUIET_S:
                    self.sink.quiet()
                if now - last_data > self.stall_s:
                    raise _Dropped(f"no word from the log reader for {self.stall_s:g} s")
                if self.follow and not once and now >= next_poll:
                    next_poll = now + self.state_poll_s
                    if self.state_of(self.target, self.workdir, self.run_id).status != "running":
                        return False  # read the rest of the log, then decide
                continue
            if chunk == b"":
                return False
            last_data = now
            for kind, numbers, payload in parser.feed(chunk):
                self._progress()
                if kind == "E":
                    self._go_live_if_caught_up(final=True)
                    return True
                self._frame(kind, numbers, payload)

    def _frame(self, kind: str, numbers: list[int], payload: bytes) -> None:
        if kind == "D":
            for text in self.splitter.feed(payload):
                self.sink.line(text)
            self._go_live_if_caught_up()
        elif kind == "S":
            start, size = numbers
            if start != self.splitter.offset:
                self.splitter.reset(start)  # a huge backlog, read from its tail
            if self._live_from is None:
                self._live_from = size
            self._go_live_if_caught_up()
        elif kind == "R":
            terminal.warning(
                f"{self.rundir}/train.log was truncated or replaced; reading it from the start"
            )
            self.splitter.reset(0)
            self.sink.go_live()
        elif kind == "W":
            self._live_from = self._live_from or 0
            self._go_live_if_caught_up()
        elif kind == "N":
            raise UsageError(
                f"no run {self.run_id} in {self.workdir}/runs",
                hint=f"list the runs with {hints.command('runs')}",
            )
        # "H": a heartbeat only proves the connection is alive.

    def _go_live_if_caught_up(self, final: bool = False) -> None:
        if self.sink.backlog is None:
            return
        if final or (self._live_from is not None and self.splitter.received_end >= self._live_from):
            self.sink.go_live()

    # -- reconnecting ------------------------------------------------------------------

    def _progress(self) -> None:
        if self._trouble_since is not None:
            terminal.info(f"[dim]reconnected; resuming at byte {self.splitter.offset}[/dim]")
        self._trouble_since = None
        self._attempt = 0
        self._empty_readers = 0

    def _recover(self, exc: BaseException) -> None:
        """After a drop: back off, reconnect, and let the caller start a reader again.
        Any partial line is forgotten; the next reader sends it again whole."""
        self._close_stream()
        self.splitter.reset(self.splitter.offset)
        if self.reconnect is None:
            raise _lost_error(self.run_id, exc) from exc
        now = time.monotonic()
        if self._trouble_since is None:
            self._trouble_since = now
            terminal.warning(f"lost the log stream ({_reason(exc)}); reconnecting")
        while True:
            delay = RECONNECT_DELAYS_S[min(self._attempt, len(RECONNECT_DELAYS_S) - 1)]
            self._attempt += 1
            if time.monotonic() + delay - self._trouble_since > self.reconnect_timeout_s:
                raise _lost_error(self.run_id, exc, self.reconnect_timeout_s) from exc
            time.sleep(delay)
            try:
                old, self.target = self.target, self._new_target()
            except Exception as again:
                if not _is_connection_trouble(again):
                    raise
                exc = again
                continue
            if old in self._owned:
                self._owned.remove(old)
                _close_quietly(old)
            return

    def _new_target(self):
        target = self.reconnect()
        self._owned.append(target)
        return target

    def _close_stream(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.close()
            except Exception:  # a dead connection may fail to close; nothing is lost
                pass

    def _stream_stderr(self) -> str:
        stream = self._stream
        try:
            text = stream.stderr.decode("utf-8", errors="replace") if stream is not None else ""
        except Exception:
            return ""
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    # -- the answer ----------------------------------------------------------------------

    def _result(self, state, *, interrupted: bool = False) -> FollowResult:
        crashes = self.sink.crashes
        if state is None or state.status == "running":
            exit_code, signal = None, None
            status = "crashed" if crashes else "running"
            run_status = None if state is None else state.status
        else:
            exit_code, signal, run_status = state.exit_code, state.signal, state.status
            failed = state.status in ("killed", "lost") or exit_code not in (0, None)
            status = "crashed" if crashes or failed else "finished"
        return FollowResult(
            run_id=self.run_id,
            status=status,
            exit_code=exit_code,
            crashes=crashes,
            state=run_status,
            signal=signal,
            interrupted=interrupted,
            summary=self.sink.summary,
            rundir=self.rundir,
            where=self.target.describe() if self.target is not None else None,
        )


def _close_quietly(target: Any) -> None:
    try:
        target.close()
    except Exception:  # closing a dead connection: nothing more to do
        pass


def _reason(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _lost_error(run_id: str, exc: BaseException, waited: float | None = None) -> HostError:
    after = f" for {waited:g} s" if waited else ""
    return HostError(
        f"lost the connection while following run {run_id} and could not get it back{after} "
        f"({_reason(exc)}); the run may still be running",
        hint=f"check the host, then follow it again with {hints.command(f'logs -f {run_id}')}",
    )


# --------------------------------------------------------------------------- local files


def classify_log(
    source: Iterable[bytes],
    *,
    rules: Any,
    exit_code: int | None = None,
    lines: int | None = None,
    name: str | None = None,
    console: Console | None = None,
    show_lines: bool = True,
) -> FollowResult:
    """Classify a log copied off a machine, the way follow_run would have: print its last
    `lines` lines (all when None) and its crashes; weigh `exit_code` when known."""
    sink = LineSink(
        rules,
        console if console is not None else terminal.out,
        keep_last=lines,
        show_lines=show_lines,
    )
    splitter = LineSplitter()
    for chunk in source:
        for text in splitter.feed(chunk):
            sink.line(text)
    last = splitter.flush()
    if last is not None:
        sink.line(last)
    sink.finish(exit_code)
    crashes = sink.crashes
    failed = exit_code not in (0, None)
    return FollowResult(
        run_id=None,
        status="crashed" if crashes or failed else "finished",
        exit_code=exit_code,
        crashes=crashes,
        source=name,
        summary=sink.summary,
    )


# --------------------------------------------------------------------------- the report


def report_result(result: FollowResult, *, json_mode: bool = False) -> int:
    """Print the closing word (or the JSON object on stdout); return the exit code."""
    run = result.run_id
    if json_mode:
        terminal.print_json(result.to_json())
    if result.interrupted:
        terminal.info(
            f"stopped following; run {run} keeps running. Resume with {hints.command(f'logs -f {run}')}"
        )
    elif not json_mode:
        _say_outcome(result)
    return result.cli_exit_code


def _say_where_and_what(result: FollowResult) -> None:
    """Where the run's files are and what it achieved, as far as the log told us."""
    lines = []
    if result.rundir:
        where = f"  ({result.where})" if result.where else ""
        lines.append(f"run dir     {result.rundir}{where}")
        lines.append(f"log         {result.rundir}/train.log")
    lines.extend(result.summary.describe())
    for line in lines:
        terminal.info(f"  {line}")


def _say_outcome(result: FollowResult) -> None:
    what = f"run {result.run_id}" if result.run_id else (result.source or "the log")
    if result.status == "finished" and result.source is not None and result.exit_code is None:
        # A copied log alone cannot prove the run ended well (it may be cut off).
        terminal.success(
            f"no crash found in {what}; its exit status is unknown (pass --exit-code N to weigh it)"
        )
        for line in result.summary.describe():
            terminal.info(f"  {line}")
        return
    if result.status == "finished":
        code = "" if result.exit_code is None else f" (exit code {result.exit_code})"
        terminal.success(f"{what} finished{code}")
        _say_where_and_what(result)
        return
    if result.status == "running":
        terminal.info(
            f"{what} is still running; follow it with {hints.command(f'logs -f {result.run_id}')}"
        )
        return
    causes = [result.crashes[0].summary] if result.crashes else []
    if result.state == "lost":
        causes.append("the process is gone and left no exit code")
    elif result.state == "running":
        causes.append("the process is still running")
    elif result.signal:
        from dflashctl.runs import signal_name

        causes.append(f"killed by {signal_name(result.signal)}")
    elif result.exit_code not in (0, None):
        # The detector's own exit-status event already says it.
        if not any(f"exit status {result.exit_code}" in cause for cause in causes):
            causes.append(f"exit code {result.exit_code}")
    detail = "; ".join(causes)
    terminal.err.print(
        f"[bold red]✗[/bold red] {what} crashed" + (f": {escape(detail)}" if detail else "")
    )
