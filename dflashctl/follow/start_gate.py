"""The start gate of a detached deploy or restart: it says the run started only once
every node's log shows the trainer's start line (every rank past the rendezvous), and
reports the crash when the run died before that, the way following it would have.

    outcome = wait_for_start(nodes, run_id, rules=rules, line=r"^rendezvous: ", timeout_s=300)
    outcome.status   # "started", "died", "ended", "timeout" or "interrupted"
    code = outcome.report()   # the closing word; the CLI's exit code

It is the follower of `logs -f` (follow_fleet, for one node as for several), with
the lines not shown: it stops following once every node showed the line (or any
node's run ended before it did, or `timeout_s` passed). A node whose run died first
ends the wait at once, whatever the other nodes still do (under torchrun they wait
at the rendezvous for it, until their own timeout): the run cannot start without it.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.markup import escape

from dflashctl import hints
from dflashctl.crash.ranks import split_prefix
from dflashctl.follow.fleet import follow_fleet
from dflashctl.follow.fleet_report import FleetResult, report_fleet
from dflashctl.remote.nodes import names_each_node
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.remote.nodes import Node

# What the gate is waiting for, in the words said while it waits and when it times out.
WAITING_FOR = "every rank past the rendezvous"


@dataclass(eq=False)
class StartGate:
    """Which nodes showed the start line so far (fed from each node's follower thread)."""

    pattern: re.Pattern[str]
    count: int
    cancel: threading.Event = field(default_factory=threading.Event)
    passed: dict[int, float] = field(default_factory=dict)  # node index -> time.monotonic()
    ended_first: list[int] = field(default_factory=list)  # nodes whose run ended before it
    timed_out: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def line(self, index: int, text: str) -> None:
        if index in self.passed:
            return
        body, _, _ = split_prefix(text)  # torchrun's ranks other than 0: `[rank1]: `
        if self.pattern.search(body):
            with self._lock:
                self.passed[index] = time.monotonic()
                if len(self.passed) == self.count:
                    self.cancel.set()

    def ended(self, index: int) -> None:
        """That node's following ended: its run ended (or it was lost) before the line."""
        with self._lock:
            if index not in self.passed and not self.cancel.is_set():
                self.ended_first.append(index)
                self.cancel.set()

    def time_out(self) -> None:
        with self._lock:
            if not self.cancel.is_set():
                self.timed_out = True
                self.cancel.set()

    @property
    def all_passed(self) -> bool:
        return len(self.passed) == self.count


@dataclass
class StartOutcome:
    run_id: str
    status: str  # started | died | ended | timeout | interrupted
    seconds: float
    line: str
    timeout_s: float
    result: FleetResult
    nodes: list[str]
    waiting: list[str] = field(default_factory=list)  # nodes that had not shown the line

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "seconds": round(self.seconds, 3),
            "line": self.line,
            "timeout_s": self.timeout_s,
            "waiting_for": self.waiting,
        }

    def report(self) -> int:
        """Say how the start went; return the CLI's exit code: 0 started (or still
        starting when the wait timed out: a warning, the run goes on), the follower's
        code when the run died or ended before its start line."""
        run, result = self.run_id, self.result
        follow = hints.command(f"logs -f {run}")
        several = names_each_node(self.nodes)
        where = f" on all {len(self.nodes)} nodes" if several else ""
        if self.status == "started":
            last = "the last " if several else ""
            terminal.success(
                f"run {run} started{where}: its start line came {last}{self.seconds:.1f} s "
                "after the launch"
            )
            terminal.info(f"follow it with {follow}")
            return 0
        if self.status == "timeout":
            names = ", ".join(self.waiting)
            on = f" on {names}" if several else ""
            terminal.warning(
                f"run {run} is still running but has not shown its start line{on} after "
                f"{self.timeout_s:g} s (run.start_timeout_s): waited for {WAITING_FOR}, a line "
                f"matching {self.line!r}; it may still be loading or waiting for a node"
            )
            terminal.info(f"follow it with {follow}")
            return 0
        if self.status == "interrupted":
            return report_fleet(result)
        for node in result.nodes:  # the crash panels following would have shown
            crashes = node.result.crashes if node.result is not None else []
            if crashes:
                from dflashctl.crash.render import render_crash

                render_crash(terminal.out, crashes[0])
        code = report_fleet(result)
        if self.status == "died":
            still = [n.name for n in result.nodes if n.result and n.result.status == "running"]
            if still:
                terminal.info(
                    f"  {escape(', '.join(still))} still running (waiting for the others at "
                    f"the rendezvous, most likely): {hints.command('stop')} ends it"
                )
        return code


def wait_for_start(
    nodes: list[Node], run_id: str, *, rules: Any, line: str, timeout_s: float
) -> StartOutcome:
    """Follow run `run_id` on every node, without showing its lines, until every node's
    log has a line that `line` (a regex) finds (the rank prefix torchrun's ranks carry
    left out), its run ended on a node before that, `timeout_s` passed, or Ctrl-C."""
    gate = StartGate(re.compile(line), len(nodes))
    timer = threading.Timer(timeout_s, gate.time_out)
    timer.daemon = True
    started = time.monotonic()
    timer.start()
    try:
        result = follow_fleet(
            nodes,
            run_id,
            rules=rules,
            from_offset=0,
            show_lines=False,
            waiting_notice=False,
            on_line=gate.line,
            on_end=gate.ended,
            cancel=gate.cancel,
        )
    finally:
        timer.cancel()
    seconds = (max(gate.passed.values()) if gate.all_passed else time.monotonic()) - started
    waiting = [n.name for n in nodes if n.index not in gate.passed]
    by_gate = gate.cancel.is_set() and (gate.all_passed or gate.ended_first or gate.timed_out)
    if result.interrupted and not by_gate:
        status = "interrupted"  # Ctrl-C: the run is left alone, as `logs -f` leaves it
    else:
        # The gate stopped the following, not the user: the runs still going are
        # `running`, as a follower that read to the end of their logs would say.
        result.interrupted = False
        for node in result.nodes:
            if node.result is not None:
                node.result.interrupted = False
        if gate.all_passed:
            status = "started"
        elif result.status in ("crashed", "unreachable"):
            status = "died"
        elif gate.timed_out:
            status = "timeout"
        else:
            status = "ended"  # finished or stopped before its start line: said as such
    return StartOutcome(
        run_id, status, seconds, line, timeout_s, result, [n.name for n in nodes], waiting
    )
