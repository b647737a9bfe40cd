"""follow_run: stream a run's log through the reader, reconnect after a drop, and decide
the end of the run by its real state."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console

from dflashctl import hints
from dflashctl.errors import HostError, UsageError
from dflashctl.follow.hangs import HangWatch, describe_hang
from dflashctl.follow.lines import LineSink, LineSplitter
from dflashctl.follow.reader import FrameParser, ReaderBroken
from dflashctl.follow.report import FollowResult, stopped_cleanly
from dflashctl.follow.waiting import FirstLineWait
from dflashctl.remote import agent_client
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent
    from dflashctl.remote.deploy_target import Target
    from dflashctl.runs.records import RunState

# Reconnect delays after a dropped connection; the last one repeats.
RECONNECT_DELAYS_S = (0.2, 0.5, 1.0, 2.0, 5.0)
# Past this much log before the start, only its tail is read (and classified).
BACKLOG_MAX_BYTES = 64 << 20
# `logs -n N` without --follow reads only the log's tail, from its end: the lines
# shown and what comes just before them (a traceback they end), this much at least and
# TAIL_BYTES_PER_LINE a line shown. Classifying a 64 MiB backlog to print two lines
# took half a minute.
TAIL_MIN_BYTES = 1 << 20
TAIL_BYTES_PER_LINE = 4 << 10
# After this long without new log bytes, an open traceback is taken as complete (the
# detector otherwise waits a few more lines for a chained one). Python writes a whole
# traceback, chained parts included, within milliseconds; the reader polls every 50 ms.
QUIET_S = 0.1
READ_TIMEOUT_S = 0.05
STATE_POLL_S = 5.0  # the run's state is asked this often, as a safety net
STALL_S = 10.0  # a reader that sent nothing this long (not even a heartbeat) is dropped


class _Dropped(Exception):
    """The stream went silent or broke: reconnect."""


# A stopped or missing container, a container.python that cannot run, or a host key that no longer matches, will not come
# back by retrying: those end the following at once. (Not "auth": a connection cut during
# the handshake shows up as an authentication failure.)
_FINAL_CONNECT_REASONS = ("host_key_unknown", "host_key_changed")


def _is_connection_trouble(exc: BaseException) -> bool:
    from dflashctl.remote.agent_client import InterpreterMissing
    from dflashctl.remote.pct import ContainerNotFound, ContainerNotRunning

    if isinstance(exc, (ContainerNotFound, ContainerNotRunning, InterpreterMissing)):
        return False
    if getattr(exc, "reason", None) in _FINAL_CONNECT_REASONS:
        return False
    return isinstance(exc, (HostError, OSError, EOFError, _Dropped))


def _backlog_max(lines: int | None, follow: bool) -> int:
    """How much of the log before the start is read: all of it (-1) without `lines`,
    its tail when following, less when only the last lines are wanted."""
    if lines is None:
        return -1
    if follow:
        return BACKLOG_MAX_BYTES
    return min(BACKLOG_MAX_BYTES, max(TAIL_MIN_BYTES, lines * TAIL_BYTES_PER_LINE))


def follow_run(
    reconnect: Callable[[], Target] | None, workdir: str, run_id: str, **options: Any
) -> FollowResult:
    """Print run `run_id`'s log and crashes; return how the run ended. `options` are
    _Follower's keyword arguments (rules, required; target, python, follow, ...):

    reconnect: makes a new Target after a drop (and the first one when `target` is None);
      None: a drop is fatal (HostError). Targets it makes are closed here.
    follow: False reads what the log holds now and returns (status "running" while the
      run goes on, unless a crash was seen).
    from_offset / lines: start at a byte offset (0: the whole log), or show only the last
      `lines` lines that exist at the start (the earlier lines still reach the detector,
      up to BACKLOG_MAX_BYTES when following; without following only the log's tail is
      read: _backlog_max).
    console: where lines and crash panels go (default terminal.out, which --json turns
      to stderr). show_lines=False prints nothing; on_crash is called for each crash as
      soon as it is certain, either way.
    state_of: (target, workdir, run_id) -> RunState; default dflashctl.runs.records.run_state.
    waiting_notice: while following a run that has logged nothing yet, show a live
      "waiting for the first line" on a terminal (never elsewhere).
    on_line: called with each line and whether it came live (not from the backlog).
    on_caught_up: called once the backlog is read while the run may still go on: from
      then on the follower is live, whether or not new lines come.
    node: the node's name, said in the follower's own notices (reconnecting, ...).
    cancel: set from another thread to stop following as Ctrl-C would (interrupted).
    hang: (factor, min_s) of run.hang: a live run whose step lines stop for that long is
      said to hang (a warning, and FollowResult.hanging), and said again when they come.
    progress_of: the run's progress as the agent last judged it (RunInfo.progress), for
      a run that hangs before any step line came live; the default state_of keeps it.
    """
    return _Follower(reconnect=reconnect, workdir=workdir, run_id=run_id, **options).run()


@dataclass(kw_only=True, eq=False)
class _Follower:
    reconnect: Callable[[], Target] | None
    workdir: str
    run_id: str
    rules: Any
    target: Target | None = None
    python: str = "python3"
    follow: bool = True
    from_offset: int = 0
    lines: int | None = None
    console: Console | None = None
    show_lines: bool = True
    on_crash: Callable[[CrashEvent], None] | None = None
    reconnect_timeout_s: float = 120.0
    state_of: Callable[[Target, str, str], RunState] | None = None
    waiting_notice: bool = True
    on_line: Callable[[str, bool], None] | None = None
    on_caught_up: Callable[[], None] | None = None
    node: str | None = None
    cancel: threading.Event | None = None
    hang: tuple[float, float] | None = None
    progress_of: Callable[[], dict[str, Any] | None] | None = None
    _owned: list[Any] = field(default_factory=list, init=False)  # made here, closed at the end
    _stream: Any = field(default=None, init=False)
    # The log's size when first opened: the backlog ends there.
    _live_from: int | None = field(default=None, init=False)
    _trouble_since: float | None = field(default=None, init=False)
    _attempt: int = field(default=0, init=False)
    _empty_readers: int = field(default=0, init=False)
    _caught_up: bool = field(default=False, init=False)  # step lines now come live

    def __post_init__(self) -> None:
        self.rundir = f"{self.workdir.rstrip('/')}/runs/{self.run_id}"
        self.notice_prefix = f"node {self.node}: " if self.node else ""
        # The next reader reads to the end of the log and stops.
        self._read_to_end = not self.follow
        if self.state_of is None:
            from dflashctl.runs.records import get_run

            latest: dict[str, Any] = {}

            def state_of(target: Target, workdir: str, run_id: str) -> RunState:
                info = get_run(target, workdir, run_id, python=self.python)
                latest["progress"] = info.progress
                return info.state

            self.state_of = state_of
            self.progress_of = self.progress_of or (lambda: latest.get("progress"))
        self.splitter = LineSplitter(self.from_offset)
        self.sink = LineSink(
            self.rules,
            self.console if self.console is not None else terminal.out,
            keep_last=self.lines,
            show_lines=self.show_lines,
            on_crash=self.on_crash,
            on_line=self.on_line,
            node=self.node,
            collapse_config=self.follow,
        )
        self.backlog_max = _backlog_max(self.lines, self.follow)
        self.waiting = FirstLineWait(self.waiting_notice and self.follow and self.show_lines)
        self.hangs = HangWatch(
            *(self.hang or ()),
            progress_of=self.progress_of,
            announce=self._announce if self.follow else None,
        )

    def _announce(self, kind: str, progress: dict[str, Any]) -> None:
        if kind == "hanging":
            terminal.warning(f"{self.notice_prefix}run {self.run_id} is {describe_hang(progress)}")
        else:
            terminal.info(
                f"{self.notice_prefix}run {self.run_id} makes progress again "
                f"(step {progress.get('last_step')})"
            )

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
            self.waiting.done()
            self._close_stream()
            for target in self._owned:
                _close_quietly(target)
        if state.status != "running":
            last = self.splitter.flush()  # a last line without its newline
            if last is not None:
                self.sink.line(last)
        self.sink.go_live()
        if state.status == "stopped":
            # The exit status a stop leaves (SIGKILL after the grace period, say) is
            # the stop's doing, not the trainer's: not weighed as a crash.
            killed = state.signal == 9 or state.exit_code in (137, -9)
            self.sink.detector.stopped_from_outside(killed)
            self.sink.finish(None)
        elif state.status != "running":
            if state.exit_code not in (0, None) or state.status in ("killed", "lost"):
                self.sink.detector.add_error_files(self._error_files())
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
        from dflashctl.remote.pct import ContainerNotRunning

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
        self._sleep(0.5)

    def _sleep(self, seconds: float) -> None:
        """Wait, unless the following is cancelled (from another thread) meanwhile."""
        if self.cancel is None:
            time.sleep(seconds)
        elif self.cancel.wait(seconds):
            raise KeyboardInterrupt

    # -- one reader ------------------------------------------------------------------

    def _pump(self) -> bool:
        """Run one reader from the current offset; True when it said the log is complete."""
        once = self._read_to_end
        argv = agent_client.log_reader_argv(
            self.python,
            self.workdir,
            self.run_id,
            self.splitter.offset,
            self.backlog_max if self._live_from is None else -1,
            once=once,
        )
        self._close_stream()
        # The reader's command line carries no agent (a stream has no stdin): it must
        # be kept there already.
        agent_client.install(self.target, self.python)
        self._stream = self.target.stream(argv)
        parser = FrameParser()
        last_data = time.monotonic()
        next_poll = last_data + STATE_POLL_S
        while True:
            chunk = self._stream.read(READ_TIMEOUT_S)
            if self.cancel is not None and self.cancel.is_set():
                raise KeyboardInterrupt
            now = time.monotonic()
            if self.splitter.received_end == 0:
                self.waiting.tick()
            if chunk is None:
                if now - last_data >= QUIET_S:
                    self.sink.quiet()
                if self.follow and not once:
                    self.hangs.check()
                if now - last_data > STALL_S:
                    raise _Dropped(f"no word from the log reader for {STALL_S:g} s")
                if self.follow and not once and now >= next_poll:
                    next_poll = now + STATE_POLL_S
                    if self.state_of(self.target, self.workdir, self.run_id).status != "running":
                        return False  # read the rest of the log, then decide
                continue
            if chunk == b"":
                if parser.agent_missing:
                    # Its copy went away meanwhile (a cleaned /tmp): send it again.
                    agent_client.install(self.target, self.python, force=True)
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
            if payload:
                self.waiting.done()
            for text in self.splitter.feed(payload):
                self.sink.line(text)
                self.hangs.line(text, self._caught_up)
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
                f"{self.notice_prefix}{self.rundir}/train.log was truncated or replaced; reading it from the start"
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
        caught_up = self._live_from is not None and self.splitter.received_end >= self._live_from
        self._caught_up = self._caught_up or caught_up
        if caught_up and not final and self.on_caught_up is not None:
            self.on_caught_up()
            self.on_caught_up = None
        if final or caught_up:
            self.sink.go_live()  # (nothing to do once live)

    # -- reconnecting ------------------------------------------------------------------

    def _progress(self) -> None:
        if self._trouble_since is not None:
            terminal.info(
                f"[dim]{self.notice_prefix}reconnected; resuming at byte {self.splitter.offset}[/dim]"
            )
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
            terminal.warning(
                f"{self.notice_prefix}lost the log stream ({drop_reason(exc)}); reconnecting"
            )
        while True:
            delay = RECONNECT_DELAYS_S[min(self._attempt, len(RECONNECT_DELAYS_S) - 1)]
            self._attempt += 1
            if time.monotonic() + delay - self._trouble_since > self.reconnect_timeout_s:
                raise _lost_error(self.run_id, exc, self.reconnect_timeout_s) from exc
            self._sleep(delay)
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
            _close_quietly(stream)

    def _stream_stderr(self) -> str:
        stream = self._stream
        try:
            text = stream.stderr.decode("utf-8", errors="replace") if stream is not None else ""
        except Exception:
            return ""
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1].strip() if lines else ""

    def _error_files(self) -> list:
        """torchelastic's error files in the run's folder (one round trip; none when the
        connection is gone: the log alone then names the failure)."""
        from dflashctl.crash.error_files import READER_PROGRAM, records_from_reader

        try:
            answer = self.target.run(
                [self.python, "-c", READER_PROGRAM, self.rundir], check=False, timeout=30
            )
        except Exception:  # noqa: BLE001 - best effort: the log has been read already
            return []
        if answer.exit_status != 0:
            return []
        return records_from_reader(answer.stdout.decode("utf-8", "replace"))

    # -- the answer ----------------------------------------------------------------------

    def _result(self, state, *, interrupted: bool = False) -> FollowResult:
        crashes = self.sink.crashes
        ended = state is not None and state.status != "running"
        if not ended:
            # A crash the run's supervisor is restarting from does not end the run.
            status = "crashed" if crashes and not self.sink.restarting else "running"
        elif state.status == "stopped":
            status = "stopped"
        else:
            failed = state.status in ("killed", "lost") or state.exit_code not in (0, None)
            status = "crashed" if crashes or failed else "finished"
            if not crashes and stopped_cleanly(self.sink.stop):
                status = "stopped"  # asked to stop (SIGTERM, Ctrl-C), whatever the exit status
        return FollowResult(
            run_id=self.run_id,
            status=status,
            exit_code=state.exit_code if ended else None,
            crashes=crashes,
            state=None if state is None else state.status,
            signal=state.signal if ended else None,
            stopped=getattr(state, "stopped", None),
            interrupted=interrupted,
            summary=self.sink.summary,
            recovered=self.sink.recovered,
            attempt=self.sink.attempt,
            not_retried=self.sink.not_retried,
            stop=self.sink.stop,
            rundir=self.rundir,
            where=self.target.describe() if self.target is not None else None,
            hanging=self.hangs.final() if status == "running" else None,
        )


def _close_quietly(closable: Any) -> None:
    try:
        closable.close()
    except Exception:  # a dead connection may fail to close; nothing is lost
        pass


def drop_reason(exc: BaseException) -> str:
    """A drop's cause in a few words: never the agent's command line (a program of its
    own), only its first line, cut to REASON_CHARS."""
    short = getattr(exc, "short", None)
    if isinstance(short, str):
        return short
    text = (str(exc) or type(exc).__name__).strip().splitlines()[0]
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 1] + "…"


REASON_CHARS = 100


def _lost_error(run_id: str, exc: BaseException, waited: float | None = None) -> HostError:
    after = f" for {waited:g} s" if waited else ""
    return HostError(
        f"lost the connection while following run {run_id} and could not get it back{after} "
        f"({drop_reason(exc)}); the run may still be running",
        hint=f"check the host, then follow it again with {hints.command(f'logs -f {run_id}')}",
    )
