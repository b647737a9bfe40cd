"""What to stop and how: our runs and hand-started trainers, SIGTERM, a grace period,
then SIGKILL."""

import os
import signal
import time

from .files import read_int, read_text
from .processes import (
    alive,
    ancestors,
    belongs_to_workdir,
    descendants,
    process_env,
    process_table,
    runs_entry,
)
from .runs import active_run_id, record_stop, run_ids, run_pid_alive, runs_dir, settle_exit_code

KILL_WAIT_S = 5.0
STUCK = "still running after SIGKILL"
POLL_MIN_S = 0.005
POLL_MAX_S = 0.1


def find_targets(workdir, entry):
    """Process groups (or single processes) to stop: our running runs, then any other
    process whose command line runs the entry script from under this workdir (its
    script or its working directory lies there). Nothing else: never a run another
    workdir launched, never the agent itself or its ancestors.

    The `scope` clients send plays no part: the rule is the same everywhere, since one
    container may hold several workdirs (experiments) that must not stop each other."""
    table = process_table()
    mine = ancestors(os.getpid(), table)
    my_groups = set(table[p].pgid for p in mine if p in table)
    targets = []
    covered_groups = set()
    covered_pids = set()  # children of a stale trainer (e.g. data loader workers)
    active = active_run_id(workdir)

    for run_id in run_ids(workdir):
        pid = read_int(os.path.join(runs_dir(workdir), run_id, "pid"))
        if read_text(os.path.join(runs_dir(workdir), run_id, "exit_code")) is not None:
            continue
        if not run_pid_alive(pid, run_id, table) or pid in mine:
            continue
        targets.append(
            {
                "kind": "active" if run_id == active else "run",
                "run_id": run_id,
                "pid": pid,
                "pgid": pid,
                "group": True,
                "cmdline": " ".join(table[pid].argv),
            }
        )
        covered_groups.add(pid)

    for proc in sorted(table.values(), key=lambda p: p.pid):
        if not alive(proc) or proc.pid in mine or proc.pgid in covered_groups:
            continue
        if proc.pid in covered_pids or not runs_entry(proc.argv, entry):
            continue
        if not belongs_to_workdir(proc, workdir):
            continue
        members = [p.pid for p in table.values() if p.pgid == proc.pgid and alive(p)]
        family = descendants(proc.pid, table) | set([proc.pid])
        # Signal the whole group only when it holds nothing but this process and its
        # children (the usual `setsid`/job-control case); a group shared with a shell
        # or other work gets the signal on this process and its children only.
        whole_group = proc.pgid not in my_groups and all(
            m in family or (m in table and runs_entry(table[m].argv, entry)) for m in members
        )
        run_id = process_env(proc.pid, "DFLASH_RUN_ID")
        # A process of a run being stopped, outside its group: torchrun starts each
        # rank in a session of its own. Stopped with it, said as part of it.
        of_run = any(t["run_id"] == run_id and t["kind"] in ("active", "run") for t in targets)
        targets.append(
            {
                "kind": "member" if run_id and of_run else "stale",
                "run_id": run_id,
                "pid": proc.pid,
                "pgid": proc.pgid if whole_group else None,
                "group": whole_group,
                "pids": sorted(family),
                "cmdline": " ".join(proc.argv),
            }
        )
        if whole_group:
            covered_groups.add(proc.pgid)
        covered_pids.update(family)
    return targets


def stop_runs(p, how):
    """Stop what `find_targets` finds for a verb's parameters (workdir, entry, grace_s);
    `how` as for stop_targets."""
    targets = find_targets(p["workdir"], p["entry"])
    return stop_targets(p["workdir"], targets, float(p["grace_s"]), how)


def stuck(entry):
    """Did this target of stop_targets' report outlive SIGKILL?"""
    return entry["ended"] == STUCK


def target_alive(target, table):
    if target["group"]:
        return any(alive(p) for p in table.values() if p.pgid == target["pgid"])
    return any(alive(table.get(pid)) for pid in target["pids"])


def send(target, sig):
    try:
        if target["group"]:
            os.killpg(target["pgid"], sig)
        else:
            for pid in target["pids"]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    except ProcessLookupError:
        pass


def wait_gone(targets, deadline):
    """Poll until every target has exited or the deadline passes; returns when each went."""
    pending = list(targets)
    pause = POLL_MIN_S
    while pending:
        table = process_table()
        now = time.monotonic()
        for target in list(pending):
            if not target_alive(target, table):
                target["_gone_at"] = now
                pending.remove(target)
        if not pending or now >= deadline:
            break
        # Most runs end within milliseconds of SIGTERM: look again soon, then less often.
        time.sleep(min(pause, max(deadline - now, 0)))
        pause = min(pause * 2, POLL_MAX_S)
    return pending


def stop_targets(workdir, targets, grace_s, how=None):
    """SIGTERM to each group, `grace_s` to exit, then SIGKILL. Reports how each ended.
    `how` ({"by": command, "replaced_by": run id}) is recorded in each run's folder first."""
    if not targets:
        return []
    for target in targets:
        if target.get("run_id") and how is not None:
            record_stop(workdir, target["run_id"], how)
    started = time.monotonic()
    for target in targets:
        send(target, signal.SIGTERM)
    left = wait_gone(targets, started + grace_s)
    killed_at = time.monotonic()
    for target in left:
        send(target, signal.SIGKILL)
    still = wait_gone(left, killed_at + KILL_WAIT_S) if left else []
    report = []
    for target in targets:
        entry = {k: v for k, v in target.items() if not k.startswith("_")}
        if target in still:
            entry["ended"] = STUCK
        else:
            entry["ended"] = "killed" if target in left else "terminated"
            entry["seconds"] = round(target["_gone_at"] - started, 2)
        if target.get("run_id") and not stuck(entry):
            entry["exit_code"] = settle_exit_code(workdir, target["run_id"], target in left)
        report.append(entry)
    return report
