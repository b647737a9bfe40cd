"""How a run stands once following stopped (FollowResult), the closing word printed for
it, and classify_log for a log copied off a machine."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from dflashctl import hints
from dflashctl.errors import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_OK
from dflashctl.follow.lines import LineSink, LineSplitter
from dflashctl.runs.summary import RunSummary
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent


@dataclass
class FollowResult:
    """How a run stands once following stopped."""

    run_id: str | None
    status: str  # "finished" | "crashed" | "hung" | "stopped" | "running"
    exit_code: int | None
    crashes: list[CrashEvent] = field(default_factory=list)
    state: str | None = None  # dflashctl.runs.records status: running, exited, killed, lost
    signal: int | None = None
    stopped: dict[str, Any] | None = None  # status "stopped": by which command, when, successor
    interrupted: bool = False  # Ctrl-C stopped the following (the run was left alone)
    source: str | None = None  # a local file classified with --file
    summary: RunSummary = field(default_factory=RunSummary)  # loss, tau, checkpoint
    # Automatic recovery (run.retry): the earlier attempts' crashes, the attempt the
    # log ended in, and why the supervisor did not restart the run again.
    recovered: list[CrashEvent] = field(default_factory=list)
    attempt: int = 1
    not_retried: str | None = None
    # The trainer was asked to stop (crash/stops.py StopInfo.to_json): its checkpoint's
    # step, or the SIGKILL that ended a stop past its grace period.
    stop: dict[str, Any] | None = None
    rundir: str | None = None  # workdir/runs/<id> on the target
    where: str | None = None  # "CT 200 on root@pve:22", "this machine"
    # A run still going whose step lines stopped (dflashctl/agent/progress.py's judgement).
    hanging: dict[str, Any] | None = None

    @property
    def cli_exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_CRASH if self.status in ("crashed", "hung") else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "run": self.run_id,
            "status": self.status,
            "exit_code": self.exit_code,
            "crashes": [event.to_json() for event in self.crashes],
        }
        if self.stopped is not None:
            data["stopped"] = self.stopped
        if self.stop is not None:
            data["stop"] = self.stop
        if self.source is not None:
            data["file"] = self.source
        if self.interrupted:
            data["interrupted"] = True
        if not self.summary.empty:
            data["summary"] = self.summary.to_json()
        if self.rundir is not None:
            data["run_dir"] = self.rundir
        if self.attempt > 1 or self.recovered:
            data["attempt"] = self.attempt
            data["recovered"] = [event.to_json() for event in self.recovered]
        if self.not_retried:
            data["not_retried"] = self.not_retried
        if self.hanging is not None:
            data["hanging"] = self.hanging
        return data


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
    error_files: list | None = None,
) -> FollowResult:
    """Classify a log copied off a machine, the way follow_run would have: print its last
    `lines` lines (all when None) and its crashes; weigh `exit_code` when known, and
    torchelastic's `error_files` (crash/error_files.py records) of the run folder."""
    sink = LineSink(
        rules,
        console if console is not None else terminal.out,
        keep_last=lines,
        show_lines=show_lines,
    )
    sink.detector.add_error_files(error_files or [])
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
    status = ended_as(crashes, failed)
    if not crashes and stopped_cleanly(sink.stop):
        status = "stopped"
    return FollowResult(
        run_id=None,
        status=status,
        exit_code=exit_code,
        crashes=crashes,
        source=name,
        summary=sink.summary,
        stop=sink.stop,
    )


def ended_as(crashes: list[CrashEvent], failed: bool) -> str:
    """`hung` when the root cause is a hang (whatever ended the run after it), `stopped`
    when it was interrupted during start-up, `crashed` for any other failure."""
    if not crashes:
        return "crashed" if failed else "finished"
    category = crashes[0].category
    return {"hang": "hung", "interrupted": "stopped"}.get(category, "crashed")


def hung_before_the_stop(result: FollowResult) -> str | None:
    """What the hang was, when the run hung and was then stopped: the stop's record
    (the agent found it hanging), else the log's own watchdog line (crash/hangs.py)."""
    said = (result.stopped or {}).get("hung")
    if said:
        return str(said)
    root = result.crashes[0] if result.crashes else None
    return root.message if root is not None and root.category == "hang" else None


def stopped_cleanly(stop: dict[str, Any] | None) -> bool:
    """The trainer stopped as asked: its checkpoint written (or nothing to write), or
    killed by the stop itself when its grace period ran out."""
    return bool(stop) and bool(stop.get("clean") or stop.get("killed_after_grace"))


# --------------------------------------------------------------------------- the report


def report_result(result: FollowResult, *, json_mode: bool = False) -> int:
    """A classified log file's closing word (or the JSON object on stdout); return the
    exit code. (A followed run's is fleet_report.report_fleet's.)"""
    if json_mode:
        terminal.print_json(result.to_json(), command="logs")
    else:
        say_outcome(result)
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


def say_outcome(result: FollowResult) -> None:
    """How the run (or log) ended, in words on stderr."""
    what = f"run {result.run_id}" if result.run_id else (result.source or "the log")
    if result.status == "finished" and result.source is not None and result.exit_code is None:
        # A copied log alone cannot prove the run ended well (it may be cut off).
        terminal.success(
            f"no crash found in {what}; its exit status is unknown (pass --exit-code N to weigh it)"
        )
        _say_where_and_what(result)  # a copied log has no run dir: what it achieved
        return
    if result.status == "finished":
        code = "" if result.exit_code is None else f" (exit code {result.exit_code})"
        terminal.success(f"{what} finished{code}{_recovery_note(result)}")
        _say_where_and_what(result)
        return
    if result.status == "stopped":
        from dflashctl.runs.records import describe_stop

        if result.stopped is not None:
            said = f" ({result.stop['outcome']})" if stopped_cleanly(result.stop) else ""
            hung = hung_before_the_stop(result)
            if hung:  # a stop after a hang does not make it a clean stop
                terminal.warning(
                    f"{what} hung ({escape(hung)}), then was {describe_stop(result.stopped)}"
                )
            else:
                terminal.info(f"{what} was {describe_stop(result.stopped)}{escape(said)}")
        else:
            said = result.stop["said"] if result.stop else "stopped"
            code = "" if result.exit_code is None else f"; exit code {result.exit_code}"
            terminal.info(f"{what} {escape(said)}{code}")
        _say_where_and_what(result)
        return
    if result.status == "running":
        if result.hanging is not None:
            from dflashctl.follow.hangs import describe_hang

            terminal.warning(
                f"{what} is still running but {describe_hang(result.hanging)}; see where it "
                f"is stuck with {hints.command(f'stacks {result.run_id}')}"
            )
            return
        terminal.info(
            f"{what} is still running; follow it with {hints.command(f'logs -f {result.run_id}')}"
        )
        return
    causes = [_root_words(result.crashes[0])] if result.crashes else []
    if result.state == "lost":
        causes.append("the process is gone and left no exit code")
    elif result.state == "running":
        causes.append("the process is still running")
    elif result.signal:
        from dflashctl.runs.records import signal_name

        causes.append(f"killed by {signal_name(result.signal)}")
    elif result.exit_code not in (0, None):
        # The detector's own exit-status event already says it.
        if not any(f"exit status {result.exit_code}" in cause for cause in causes):
            causes.append(f"exit code {result.exit_code}")
    detail = "; ".join(causes)
    terminal.err.print(
        f"[bold red]✗[/bold red] {what} {'hung' if result.status == 'hung' else 'crashed'}"
        + escape(_recovery_note(result))
        + (f": {escape(detail)}" if detail else "")
    )
    if result.not_retried:
        terminal.info(f"  not retried: {result.not_retried}")


def _recovery_note(result: FollowResult) -> str:
    """` in attempt 3, after recovering from killed, nccl_timeout` (run.retry)."""
    if result.attempt <= 1 and not result.recovered:
        return ""
    after = ", ".join(dict.fromkeys(event.category for event in result.recovered))
    return f" in attempt {result.attempt}" + (f", after recovering from {after}" if after else "")


def _root_words(event: CrashEvent) -> str:
    """`rank 1 (local rank 1), thread drafter-0: InjectedFailure: ...`: where, then what."""
    where = event.where
    if event.thread:
        where = f"{where}, thread {event.thread}" if where else ""
    if not where or event.summary.startswith(("rank ", "local rank ")):
        return event.summary
    return f"{where}: {event.summary}"
