"""Follow a run's log live, with crash detection: the code behind `logs`, `deploy` and `restart`.

Use it right after launching a run (or to look at one):

    from dflashctl.follow import follow_run

    result = follow_run(
        reconnect,                      # () -> Target: a fresh connection, used after a drop
        config.container.workdir,
        run_id,
        rules=rules_for(config),        # built-in crash rules + the config's crash_patterns
        target=target,                  # the connection already open; left open for the caller
        python=config.container.python, # runs the small log reader in the container
        from_offset=0,                  # the whole log of a new run (or lines=N: the last N)
    )
    sys.exit(result.cli_exit_code)  # 1: crashed or hung

follow_run prints every line as it comes and a panel for every crash the moment the
detector is sure of it, and returns a FollowResult once the run has ended (or at the end
of the log with follow=False, or when Ctrl-C stops the following: `interrupted`, exit
130; the run is left alone). It raises UsageError for a run that does not exist, and
HostError (exit 3) when the connection cannot be had back within `reconnect_timeout_s`
(the run may then still be running) or the container stopped.

How it works:
- One command through the connection streams the log: the agent's `log` verb in the
  container (dflashctl/agent/logreader.py) sends framed chunks of `runs/<id>/train.log` from a byte
  offset, a heartbeat every second of silence, and `E` once the run looks over (its
  exit_code file exists, or its pid is gone or belongs to another process) and the file was read to its end. The reader
  dies on its next write once nobody reads it, so a dropped connection leaves nothing
  behind; the run itself is never touched.
- The follower keeps the offset just past the last complete line it printed. After a drop
  it reconnects with backoff (0.2, 0.5, 1, 2, then 5 s) and starts a reader at that
  offset: a partial line is read again whole, no line is printed twice or lost.
- The end of a run is decided by the run's real state (dflashctl.runs.records.run_state), asked
  when the reader says `E`, when its stream ends, and every STATE_POLL_S as a safety
  net; never by the stream ending alone. After the end the log is read to its last byte
  before the crash detector weighs the exit code.

Every node of the fleet (one, or a `nodes:` list in dflash.yaml) is followed the same
way: follow_fleet runs one follow_run per node, each in its own thread, and report_fleet
says how the run ended (on each node, and its root cause across nodes, the first failure
in time). Only the printing depends on the number of nodes (nodes.names_each_node: one
node's lines carry no prefix); the result and its --json keys do not:

    with node_sessions(config) as nodes:
        result = follow_fleet(nodes, resolve_run(nodes, None), rules=rules_for(config))
    sys.exit(report_fleet(result, json_mode=json_mode))

Modules: reader.py (the reader's frames), lines.py (lines out of bytes,
printed and fed to the crash detector), follower.py (follow_run: streaming, reconnecting,
the end of the run), report.py (FollowResult, the closing word, classify_log for a copied
log), fleet.py (follow_fleet: every node at once, the report when a node fails),
fleet_report.py (FleetResult and its closing word),
root_cause.py (the first failure across nodes; torchrun's failure summary), prefixed.py
(names_each_node; several nodes' lines prefixed, whole, under one lock).
"""

from dflashctl.follow.fleet import follow_fleet, resolve_run
from dflashctl.follow.fleet_report import FleetResult, report_fleet
from dflashctl.follow.follower import follow_run
from dflashctl.follow.lines import LineSink, LineSplitter
from dflashctl.follow.reader import FrameParser, ReaderBroken
from dflashctl.follow.report import FollowResult, classify_log, report_result

__all__ = [
    "FleetResult",
    "FollowResult",
    "FrameParser",
    "LineSink",
    "LineSplitter",
    "ReaderBroken",
    "classify_log",
    "follow_fleet",
    "follow_run",
    "report_fleet",
    "report_result",
    "resolve_run",
]
