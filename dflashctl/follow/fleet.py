"""Follow one run on every node of the fleet (one node or several: one path): the code
behind `logs` and the following of deploy and restart.

    with node_sessions(config) as nodes:
        run_id = resolve_run(nodes, run_id)         # RUN, or node 0's active run
        result = follow_fleet(nodes, run_id, rules=rules_for(config))
    sys.exit(report_fleet(result, json_mode=False))   # fleet_report.py

One follower (follow_run, with its own reconnecting) per node, each in a thread of its
own. Only what is printed depends on how many nodes there are (nodes.names_each_node):
several nodes' lines go out prefixed with the node (`gpu-a | `), whole, under one lock,
and the moment a node fails (a crash certain in its log, or its run ending badly), a
report says so on stderr, with what every other node is doing right then; following
goes on until every node's run has ended. The root cause across nodes is the first
failure in time (root_cause.py); the other nodes' failures are its consequences.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from dflashctl import hints
from dflashctl.crash.ordering import is_consequence
from dflashctl.errors import DflashError, UsageError
from dflashctl.follow.fleet_report import FleetResult, NodeFollow
from dflashctl.follow.follower import follow_run
from dflashctl.follow.prefixed import OUTPUT_LOCK, node_consoles
from dflashctl.follow.root_cause import NodeFailure, TorchrunWatch, first_failure
from dflashctl.remote.nodes import names_each_node
from dflashctl.ui import terminal

if TYPE_CHECKING:
    from dflashctl.crash import CrashEvent
    from dflashctl.follow.report import FollowResult
    from dflashctl.remote.deploy_target import Target
    from dflashctl.remote.nodes import Node
    from dflashctl.runs.records import RunInfo, RunState

LINE_SHOWN = 100  # characters of another node's last line in a failure report


# --------------------------------------------------------------------------- the run id


def resolve_run(nodes: list[Node], run_id: str | None) -> str:
    """RUN, or node 0's active run. Every node not known to have it yet is asked (every
    node for RUN; the others for node 0's active run): a node without it is a UsageError
    naming it, and a node whose active run is another one is said (a warning): the run
    is followed there anyway."""
    from dflashctl.runs.records import active_run

    first = nodes[0]
    named = run_id is not None
    if run_id is not None and ("/" in run_id or run_id in ("", ".", "..")):
        raise UsageError(f"not a run id: {run_id!r}", hint="`dflashctl runs` lists the runs")
    if run_id is None:
        from dflashctl.remote.connect import as_host_error

        with as_host_error(first.target):
            active = active_run(
                first.target, first.config.container.workdir, python=first.config.container.python
            )
        if active is None:
            where = first.describe() if names_each_node(nodes) else first.target.describe()
            raise UsageError(
                f"no runs in {first.config.container.workdir} on {where} yet",
                hint=f"start one with {hints.command('deploy')}",
            )
        run_id = active.id
    _every_node_has(nodes, nodes if named else nodes[1:], run_id, named=named)
    return run_id


def _every_node_has(nodes: list[Node], asked: list[Node], run_id: str, *, named: bool) -> None:
    from dflashctl.remote.nodes import on_every_node, values_or_raise
    from dflashctl.runs.records import find_run

    if not asked:
        return
    found = values_or_raise(
        on_every_node(
            asked,
            lambda node: find_run(
                node.target,
                node.config.container.workdir,
                run_id,
                python=node.config.container.python,
            ),
        ),
        "reading its runs",
    )
    for node, (run, active_id) in zip(asked, found, strict=True):
        if run is None:
            where = f"{node.describe()} has " if names_each_node(nodes) else ""
            raise UsageError(
                f"{where}no run {run_id} in {node.config.container.workdir}/runs",
                hint=f"list the runs with {hints.command('runs')}",
            )
        if not named and active_id != run_id:
            terminal.warning(
                f"node {node.name}'s active run is {active_id or 'none'}, not {run_id} "
                f"(node {nodes[0].name}'s); following {run_id} on every node"
            )


# --------------------------------------------------------------------------- following


@dataclass(eq=False)
class _NodeWatch:
    """What one node's follower has seen so far (written by its thread, read by the
    others for their reports)."""

    node: Node
    console: Console
    live: bool = True  # the last line came live, not from the backlog
    last_line: str | None = None
    last_line_at: float | None = None  # time.monotonic()
    first_crash: CrashEvent | None = None
    seen_at: dict[int, float | None] = field(default_factory=dict)  # id(event) -> time.time()
    torchrun: TorchrunWatch = field(default_factory=TorchrunWatch)
    info: RunInfo | None = None  # the run's record, as last asked
    result: FollowResult | None = None
    error: BaseException | None = None
    reported: bool = False
    failing_since: float | None = None  # time.time() of the first sign of a failure (live)
    # Set when its thread is done with it (result or error in place).
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ended(self) -> bool:
        return self.result is not None or self.error is not None


def follow_fleet(
    nodes: list[Node],
    run_id: str,
    *,
    console: Callable[[], Console] | None = None,
    on_line: Callable[[int, str], None] | None = None,
    on_end: Callable[[int], None] | None = None,
    cancel: threading.Event | None = None,
    **options: Any,
) -> FleetResult:
    """Follow run `run_id` on every node until every node's run has ended (or, with
    follow=False, read what each log holds now). Each node has its own follower thread;
    what one node's lines, crashes and errors print is said as it comes (prefixed with
    the node when there are several: nodes.names_each_node).

    Never raises for one node's trouble: a node that cannot be reached within
    `reconnect_timeout_s` (or that lacks the run) is said at once and ends with its
    error in the result (its exit code, 3 for HostError), while the others are followed on.

    options: follow_run's for every node: rules (required), follow, from_offset / lines
    (deploy follows a new run from byte 0; `logs` shows the last `lines` of each node
    first), show_lines, reconnect_timeout_s, and waiting_notice (the live
    "waiting for the first line" of an unprefixed terminal).
    console: where the lines and panels go (default terminal.out, asked at each write);
    several nodes' failure reports go to terminal.err.
    on_line(node index, line): each line of each node (from that node's thread);
    on_end(node index): that node's following ended (its run ended, or it could not be
    reached); cancel: set from any thread to stop following every node, as Ctrl-C
    would (the results say interrupted): the start gate's (dflashctl/start_gate.py).
    """
    if names_each_node(nodes):
        options["waiting_notice"] = False  # a live notice per node would fight over the terminal
    follower = _FleetFollower(
        nodes=nodes,
        run_id=run_id,
        console=console or (lambda: terminal.out),
        on_line=on_line,
        on_end=on_end,
        cancel=cancel or threading.Event(),
    )
    return follower.run(options)


@dataclass(eq=False)
class _FleetFollower:
    nodes: list[Node]
    run_id: str
    console: Callable[[], Console]
    on_line: Callable[[int, str], None] | None = None
    on_end: Callable[[int], None] | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _watches: list[_NodeWatch] = field(default_factory=list)

    def run(self, kwargs: dict[str, Any]) -> FleetResult:
        consoles = node_consoles(self.console, [node.name for node in self.nodes])
        self._watches = [
            _NodeWatch(node, console, live=kwargs.get("lines") is None)  # no backlog: all new
            for node, console in zip(self.nodes, consoles, strict=True)
        ]
        threads = [
            threading.Thread(
                target=self._follow_node, args=(watch, kwargs), name=f"follow-{watch.node.name}"
            )
            for watch in self._watches
        ]
        for thread in threads:
            thread.start()
        # Each node's `done`, not Thread.join: a Ctrl-C landing inside join() can leave
        # CPython (3.11) taking a thread that still runs for ended, and its result was
        # then read before its follower had written it (the node said "unreachable").
        interrupted = False
        try:
            for watch in self._watches:
                while not watch.done.wait(0.1):  # short: Ctrl-C reaches the main thread
                    pass
        except KeyboardInterrupt:
            interrupted = True
            self.cancel.set()
            for watch in self._watches:
                watch.done.wait()
        return self._result(interrupted)

    # -- one node (its own thread) -------------------------------------------------------

    def _follow_node(self, watch: _NodeWatch, kwargs: dict[str, Any]) -> None:
        from dflashctl.remote.connect import as_host_error, open_target

        node = watch.node
        config = node.config
        try:
            with as_host_error(node.target):
                watch.result = follow_run(
                    lambda: open_target(config),
                    config.container.workdir,
                    self.run_id,
                    target=node.target,
                    python=config.container.python,
                    console=watch.console,
                    on_crash=partial(self._on_crash, watch),
                    on_line=partial(self._on_line, watch),
                    # Caught up with the log while the run may go on: what happens from
                    # now on happens live, new lines or not.
                    on_caught_up=partial(setattr, watch, "live", True),
                    state_of=partial(self._state_of, watch),
                    hang=(config.run.hang.factor, config.run.hang.min_s),
                    progress_of=lambda: getattr(getattr(watch, "info", None), "progress", None),
                    node=node.name if names_each_node(self.nodes) else None,
                    cancel=self.cancel,
                    **kwargs,
                )
        except Exception as exc:  # this node's; the others are followed on
            watch.error = exc
            named = names_each_node(self.nodes)
            if named and isinstance(exc, DflashError) and not exc.message.startswith("node "):
                exc.message = f"{node.describe()}: {exc.message}"
                exc.args = (exc.message,)
            with OUTPUT_LOCK:
                terminal.error(getattr(exc, "message", str(exc)), getattr(exc, "hint", None))
        else:
            self._ended(watch)
        finally:
            try:
                if self.on_end is not None:
                    self.on_end(watch.node.index)
            finally:
                watch.done.set()

    def _state_of(self, watch: _NodeWatch, target: Target, workdir: str, run_id: str) -> RunState:
        from dflashctl.runs.records import get_run

        info = get_run(target, workdir, run_id, python=watch.node.config.container.python)
        watch.info = info
        return info.state

    def _on_line(self, watch: _NodeWatch, text: str, live: bool) -> None:
        watch.last_line, watch.last_line_at, watch.live = text, time.monotonic(), live
        if self.on_line is not None:
            self.on_line(watch.node.index, text)
        knew = watch.torchrun.rank_failed
        watch.torchrun.feed(text)
        if watch.torchrun.rank_failed and not knew:
            # torchrun stops the node's other ranks first (their grace period) and
            # names the failed one only then: say now that this node is failing.
            with self._lock:
                report = not self._failing(watch)
            if report:
                self._report_failure(
                    watch,
                    NodeFailure(
                        watch.node.name,
                        watch.node.index,
                        seen_at=watch.failing_since,
                        state="a rank failed; torchrun is stopping the node's other ranks "
                        "(it names the failed one once they stopped)",
                    ),
                )

    def _on_crash(self, watch: _NodeWatch, event: CrashEvent) -> None:
        """A crash is certain in this node's log (called before its panel is shown)."""
        # A crash already in the backlog happened before we looked: when is unknown here.
        watch.seen_at[id(event)] = time.time() if watch.live else None
        with self._lock:
            self._failing(watch)
            first_here = watch.first_crash is None
            if first_here:
                watch.first_crash = event
            # Across nodes only the first failure is the root cause: a failure another
            # rank caused, or one after another node's, is a consequence here too.
            # Alone, the node's own ranking stands: no other node can be the cause.
            others = [w for w in self._watches if w is not watch]
            earlier = [w for w in others if w.first_crash and not is_consequence(w.first_crash)]
            if earlier or (others and is_consequence(event)):
                event.is_root_cause = False
        # Its first crash is said even after torchrun's first sign was: it names it.
        if first_here:
            # From the backlog, what the other nodes do now says nothing about then.
            self._report_failure(watch, _failure_of(watch, event), others=watch.live)

    def _failing(self, watch: _NodeWatch) -> bool:
        """The node shows a failure (under self._lock): when, if live; whether it was
        reported already (it is reported now)."""
        if watch.live and watch.failing_since is None:
            watch.failing_since = time.time()
        reported, watch.reported = watch.reported, True
        return reported

    def _ended(self, watch: _NodeWatch) -> None:
        """This node's run ended (or its log was read, without --follow)."""
        result = watch.result
        assert result is not None
        if result.interrupted or result.status == "running":
            return
        with self._lock:
            report = result.status == "crashed" and not watch.reported
            watch.reported = watch.reported or report
        if report:
            event = result.crashes[0] if result.crashes else None
            self._report_failure(watch, _failure_of(watch, event), others=watch.live)
        elif result.status in ("finished", "stopped") and any(
            not w.ended for w in self._watches if w is not watch
        ):
            with OUTPUT_LOCK:
                terminal.err.print(
                    f"[green]✓[/green] node {watch.node.name}: {escape(_ended_words(watch))}; "
                    "following the other nodes"
                )

    # -- the report when a node fails ------------------------------------------------------

    def _report_failure(
        self, watch: _NodeWatch, failure: NodeFailure, *, others: bool = True
    ) -> None:
        """Said at once: which node failed with what; the first one also says what every
        other node is doing at this moment. (One node's crash panel and closing word
        say it all.)"""
        if not names_each_node(self.nodes):
            return
        with self._lock:
            first = others and not any(w.reported and w is not watch for w in self._watches)
        what = failure.describe()
        role = ""
        if failure.consequence:
            role = " (stopped by another rank's failure)"
        block = [f"[bold red]✗[/bold red] {escape(what)}{role}"]
        if first:
            block += [
                f"  {escape(other.node.name)}: {escape(_doing(other))}"
                for other in self._watches
                if other is not watch
            ]
        with OUTPUT_LOCK:
            # One print: the report and what the others do stay together, whatever
            # another node's follower prints meanwhile.
            terminal.err.print("\n".join(block), soft_wrap=True)

    # -- the answer --------------------------------------------------------------------

    def _result(self, interrupted: bool) -> FleetResult:
        nodes, failures = [], []
        for watch in self._watches:
            failure = None
            result = watch.result
            if result is not None and result.status in ("crashed", "hung"):
                event = result.crashes[0] if result.crashes else watch.first_crash
                failure = _failure_of(watch, event)
                failures.append(failure)
            nodes.append(
                NodeFollow(
                    name=watch.node.name,
                    where=watch.node.describe(),
                    result=result,
                    error=watch.error,
                    failure=failure,
                )
            )
        cause, consequences = first_failure(failures)
        return FleetResult(
            run_id=self.run_id,
            nodes=nodes,
            root_cause=cause,
            consequences=consequences,
            interrupted=interrupted
            or any(w.result and w.result.interrupted for w in self._watches),
        )


def _failure_of(watch: _NodeWatch, event: CrashEvent | None) -> NodeFailure:
    info = watch.info
    ended_at = None
    state = None
    if info is not None and info.state.status != "running":
        attempts = (info.attempts or {}).get("attempts") or []
        if attempts and attempts[-1].get("ended_unix") is not None:
            ended_at = float(attempts[-1]["ended_unix"])
        state = info.describe_state()
    seen = [watch.seen_at.get(id(event)) if event is not None else None, watch.failing_since]
    known = [when for when in seen if when is not None]
    return NodeFailure(
        node=watch.node.name,
        index=watch.node.index,
        event=event,
        seen_at=min(known) if known else (time.time() if watch.live else None),
        ended_at=ended_at,
        state=state,
        torchrun=watch.torchrun.failure,
    )


def _ended_words(watch: _NodeWatch) -> str:
    if watch.info is not None:
        return f"run {watch.info.describe_state()}"
    result = watch.result
    return f"run {result.status}" if result is not None else "ended"


def _doing(watch: _NodeWatch) -> str:
    """What a node's ranks are doing right now, as far as its follower knows."""
    if watch.error is not None:
        return f"unreachable: {watch.error}"
    if watch.result is not None:
        return _ended_words(watch)
    if watch.first_crash is not None:
        event = watch.first_crash
        return f"stopping: {event.category} ({_cut(event.summary)})"
    if watch.last_line_at is None:
        return "running, nothing logged yet"
    ago = time.monotonic() - watch.last_line_at
    return f"running, last line {ago:.1f} s ago: {_cut(watch.last_line or '')}"


def _cut(text: str) -> str:
    return text if len(text) <= LINE_SHOWN else text[: LINE_SHOWN - 3] + "..."
