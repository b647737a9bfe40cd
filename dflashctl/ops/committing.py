"""Every node's launch call at once, and what a failure left on each node.

Where the nodes meet (ops/launch_command.py: several nodes), every node's agent waits
at the commit barrier before it stops anything, so the containers, not this process,
decide whether all of them launch:

  - when a node's call fails, the others are told to abort (the agent's `abort` verb,
    best effort): those still waiting at the barrier then abort, and every node keeps
    its old run;
  - once every node has arrived the decision is commit, and neither a Ctrl-C here nor
    a lost connection can undo it; a node whose connection was lost while the others
    committed committed too (the decision needed it), and the error says so.

The error (NodesFailed) carries, for every node, its outcome and what it left, as
data; its message is written from them (a fleet of one: the node's own error's).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from dflashctl.errors import DflashError
from dflashctl.ops.launch_command import meet
from dflashctl.remote import agent_client
from dflashctl.remote.agent_messages import LaunchAnswer
from dflashctl.remote.nodes import (
    Node,
    NodeOutcome,
    NodesFailed,
    error_text,
    names_each_node,
    on_every_node,
)
from dflashctl.reporting import SILENT, Reporter

# What a node left, in the words the error and --json use.
NEW_RUN = "new run"
OLD_RUN = "old run untouched"
# The new run could not start on every node once the old runs were stopped: every node
# took it down and launched the previous release again (or could not: nothing runs).
OLD_RELAUNCHED = "old run relaunched"
NOTHING = "nothing running"
UNKNOWN = "unknown"


@dataclass
class NodeLeft:
    node: str
    left: str  # NEW_RUN, OLD_RUN or UNKNOWN
    error: BaseException | None
    detail: str  # one sentence: what happened there


def launch_failed(run_id: str, outcomes: list[NodeOutcome], first: Node, nodes: list[NodeLeft]):
    """A launch across nodes that did not happen (or not everywhere): `first` is the
    node whose own step failed, `nodes` what each node left."""
    cause = next(n.error for n in nodes if n.node == first.name)
    committed = [n.node for n in nodes if n.left == NEW_RUN]
    rolled_back = any(n.left in (OLD_RELAUNCHED, NOTHING) for n in nodes)
    if committed:
        head = f"run {run_id} launched on {', '.join(committed)} but {first.describe()} failed"
    elif rolled_back:
        head = (
            f"run {run_id} could not start on {first.describe()}, so it was taken down "
            "on every node"
        )
    else:
        head = f"run {run_id} was launched nowhere: {first.describe()} failed"
    lines = "\n".join(f"  {n.node}: {n.detail}" for n in nodes)
    message = error_text(cause)
    if names_each_node(nodes):  # one node's own error says it all
        message = f"{head}: {message}\nwhat each node left:\n{lines}"
    failure = NodesFailed(
        outcomes,
        "launching",
        first=next(o for o in outcomes if o.node is first),
        message=message,
        facts={n.node: {"left": n.left, "detail": n.detail} for n in nodes},
    )
    if failure.hint is None and names_each_node(nodes):
        failure.hint = "fix what the error names, then deploy again"
    return failure


def launch_everywhere(
    nodes: list[Node],
    run_id: str,
    call: Callable[[Node], LaunchAnswer],
    report: Reporter = SILENT,
) -> list[LaunchAnswer]:
    """`call(node)` on every node at once; every answer, or NodesFailed."""
    pool = ThreadPoolExecutor(max_workers=len(nodes), thread_name_prefix="launch")
    futures = {node.index: pool.submit(_guarded, node, call) for node in nodes}
    aborted = False
    try:
        pending = set(futures.values())
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            failed = [n for n in nodes if futures[n.index].done() and futures[n.index].exception()]
            if failed and not aborted:
                aborted = True
                why = _reason(failed[0], futures[failed[0].index].exception())
                abort_others(nodes, [n for n in nodes if n not in failed], run_id, why, report)
    except KeyboardInterrupt:
        # Nothing decided yet: abort everywhere; decided: the nodes finish without us.
        if meet(nodes):  # a node that meets nobody has no barrier to abort at
            abort_others(nodes, nodes, run_id, "the deploy was interrupted (Ctrl-C)", report)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    errors = {n.index: futures[n.index].exception() for n in nodes}
    if not any(errors.values()):
        return [futures[n.index].result() for n in nodes]
    # An interrupt raised in a node's thread is an interrupt, as on_every_node lets it
    # through (the others were told to abort above), not a node's failure to report.
    interrupt = next((e for e in errors.values() if isinstance(e, KeyboardInterrupt)), None)
    if interrupt is not None:
        raise interrupt
    raise _failure(nodes, run_id, futures, errors)


def _guarded(node: Node, call: Callable[[Node], LaunchAnswer]) -> LaunchAnswer:
    from dflashctl.remote.connect import as_host_error

    with as_host_error(node.target):
        return call(node)


def _reason(node: Node, error: BaseException | None) -> str:
    text = error.message if isinstance(error, DflashError) else str(error)
    return f"node {node.name} failed: {text.splitlines()[0] if text else type(error).__name__}"


def abort_others(
    nodes: list[Node], targets: list[Node], run_id: str, reason: str, report: Reporter = SILENT
) -> None:
    """The agent's `abort` on `targets` (best effort: a node that cannot be told aborts
    at its deadline, or learns the decision from the others)."""

    def mark(node: Node) -> None:
        agent_client.call_agent(
            node.target,
            node.config.container.python,
            "abort",
            {"workdir": node.config.container.workdir, "run_id": run_id, "reason": reason},
            timeout=30,
        )

    for outcome in on_every_node(targets, mark):
        if not outcome.ok:
            report.warning(
                f"could not tell {outcome.node.describe()} to abort ({outcome.error}); "
                "it decides with the others at its deadline"
            )


def _failure(nodes, run_id, futures, errors) -> NodesFailed:
    outcomes = [NodeOutcome(n, value=None, error=errors[n.index]) for n in nodes]
    committed = any(err is None for err in errors.values())
    left = []
    for node in nodes:
        error = errors[node.index]
        if error is None:
            state, detail = NEW_RUN, f"run {run_id} launched"
        elif getattr(error, "aborted", False):
            state, detail = OLD_RUN, "aborted: nothing stopped"
        elif getattr(error, "in_doubt", False):
            state, detail = OLD_RUN, "in doubt: nothing stopped there"
        elif getattr(error, "rolled_back", None):
            left.append(rolled_back(node, error, run_id))
            continue
        elif isinstance(error, agent_client.AgentFailed):
            # It answered: the launch failed there (before the barrier, unless the
            # others committed and it failed after stopping its old run).
            state = UNKNOWN if committed else OLD_RUN
            detail = "failed after the commit" if committed else "failed: nothing stopped"
        elif committed:
            state = NEW_RUN
            detail = (
                f"connection lost, but the other nodes committed, so it did too (the "
                f"decision needs every node): run {run_id} runs there"
            )
        else:
            state = OLD_RUN
            detail = (
                "no answer (connection lost); the other nodes aborted, so it did not "
                "launch: its old run goes on"
            )
        left.append(NodeLeft(node.name, state, error, detail))
    # The node to name: the one whose own step failed, not one that aborted or rolled
    # back because of it.
    first = next(
        (
            n
            for n in nodes
            if errors[n.index] is not None
            and not getattr(errors[n.index], "aborted", False)
            and getattr(errors[n.index], "rolled_back", None) != "peer"
        ),
        next(n for n in nodes if errors[n.index] is not None),
    )
    return launch_failed(run_id, outcomes, first, left)


def rolled_back(node: Node, error: BaseException, run_id: str) -> NodeLeft:
    """A node that took the new run down after the stop (its own launch failed, or
    another node's did) and launched the previous release again, or could not."""
    relaunched = bool(getattr(error, "relaunched", False))
    why = (
        "its launch failed after the old run was stopped"
        if getattr(error, "rolled_back", None) == "here"
        else f"run {run_id} was stopped there, as another node could not launch it"
    )
    now = "the previous release runs again" if relaunched else "nothing runs there"
    return NodeLeft(node.name, OLD_RELAUNCHED if relaunched else NOTHING, error, f"{why}; {now}")
