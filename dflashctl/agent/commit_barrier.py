"""The commit barrier of a deploy or restart across N nodes: every node's agent, with
its release built and checked and nothing stopped yet, asks here whether to go on
(stop the old run, swap `current`, launch) or to leave everything as it is.

It runs in the run's own interpreter (the one with torch), as

    <python> -c <this file's text> '<json params>'

started by the agent (commit.py), which stays standard-library only. The decision
lives in a torch.distributed TCPStore hosted by node 0 on the rendezvous address at
torchrun.commit_port, under keys prefixed by the run id and the deploy's secret
(DFLASH_COMMIT_SECRET, in the environment: the store has no authentication, so a peer
that cannot name a key cannot arrive or decide; torchrun's own store is as open):

  - each node adds 1 to `arrived` (and sets `node/<rank>`);
  - the node whose arrival makes `arrived` == N writes `decision` = "commit";
  - a node that must abort (its abort marker file appeared: the client saw a node
    fail; or its deadline passed) writes `decision` = "abort:<why>";
  - both writes are compare_set(decision, "", ...): the first one wins, atomically,
    and every node follows what is there. So a commit needs all N arrivals, and once
    any node has decided abort no late arrival can commit.

Nodes other than 0 add 1 to `acked` once they read the decision; node 0 keeps the
store up until every one did (bounded), so none is left without an answer.

A node that never reached the store never arrived: it aborts on its own, which is
safe, because without its arrival nobody can commit. A node that arrived and then
lost the store (node 0 gone) cannot know the outcome: it answers "in doubt" and
aborts; the agent says so.

Prints one JSON line: {"decision": "commit" | "abort", "reason": ..., "in_doubt": bool}.
With `wait_for_release` it is started while the release is still being built, and
waits for `{"release": ...}` on stdin before it arrives (the deadline counts from then).

With `gate`, a commit is followed by the stop gate: the agent stops its old run, says
`{"stopped": true}` on stdin (or closes it: the stop failed), and the barrier sets
`stopped/<rank>` and prints `{"gate": "open"}` once every node has stopped its old run
(`{"gate": "timeout" | "closed" | "lost", ...}` otherwise). No node launches before
that: node 0's old torchrun holds torchrun.port (the job's store) until its rank has
stopped, which takes as long as its checkpoint on SIGTERM, and a new rank elsewhere that
started meanwhile would join that old store and die with it.

Then the launch round: each agent says `{"launched": true}`, or `{"launched": false,
"why": ...}` (its stdin closed: it did not launch), and the barrier sets
`launched/<rank>` and prints `{"launch": "all"}` once every node launched, or
`{"launch": "failed", "failed": [{"node", "why"}]}` as soon as any node could not. On a
failure every node takes its new run down and says `{"unlaunched": true}`; the barrier
prints `{"rollback": "open"}` once every node has (`unlaunched/<rank>`), and only then
do they launch the previous release again, for the reason the stop gate gives: no old
rank may join a new run's store that is still going away.
"""

import datetime
import json
import os
import sys
import time

POLL_S = 0.1
CONNECT_TRY_S = 2.0  # one connection attempt: short, so the abort marker is seen meanwhile
OP_TIMEOUT_S = 30.0
ACK_WAIT_S = 15.0  # how long node 0 keeps the store up for the others to read the decision
LAUNCH_WAIT_S = 120.0  # how long a node that launched waits to hear from the others


def aborted(reason, in_doubt=False):
    return {"decision": "abort", "reason": reason, "in_doubt": in_doubt}


COMMITTED = {"decision": "commit", "reason": None, "in_doubt": False}


def first_line(exc):
    """The first line of an exception's text ("" without any)."""
    return str(exc).strip().splitlines()[0] if str(exc).strip() else ""


def read_marker(path):
    """The abort marker's reason, or None while there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "aborted"
    except OSError:
        return None


def connect(p, deadline):
    """The run's prefixed view of node 0's store (node 0 hosts it), or (None, why) when
    it cannot be had before the deadline or an abort marker appears meanwhile.

    Each try waits twice as long as the one before (CONNECT_TRY_S first): torch's
    TCPStore looks up its peer's name once connected, which takes about 10 s where the
    DNS server does not answer, so a fixed short try would never connect there. Node 0
    gives up at once only when it cannot listen on the port (taken by another job)."""
    import torch.distributed as dist

    master = int(p["rank"]) == 0
    try_s = CONNECT_TRY_S
    while True:
        remaining = deadline - time.monotonic()
        try:
            store = dist.TCPStore(
                p["address"],
                int(p["port"]),
                None,
                master,
                datetime.timedelta(seconds=max(min(try_s, remaining), 0.5)),
                wait_for_workers=False,
            )
            store.set_timeout(datetime.timedelta(seconds=OP_TIMEOUT_S))
            return dist.PrefixStore(f"dflash-commit/{p['run_id']}/{p['secret']}/", store), None
        except Exception as exc:  # noqa: BLE001 - any failure to connect is a reason to wait or abort
            why = first_line(exc) or type(exc).__name__
            if master and _cannot_listen(why):  # node 0 cannot host the store
                first = p["names"][0]
                return (
                    None,
                    f"node {first} could not host the commit store on port {p['port']}: {why}",
                )
        try_s *= 2
        reason = read_marker(p["marker"])
        if reason is not None:
            return None, reason
        if time.monotonic() >= deadline:
            first, within = p["names"][0], float(p["deadline_s"])
            return (
                None,
                f"node {first} was not reachable at {p['address']}:{p['port']} within {within:.0f} s",
            )
        time.sleep(POLL_S)


def _cannot_listen(why):
    """Whether a store's failure to start is its port (in use, not allowed), not a
    connection that was slow."""
    lowered = why.lower()
    return any(
        mark in lowered for mark in ("address already in use", "eaddrinuse", "permission denied")
    )


def text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def cas(store, desired):
    """Write the decision unless one is there; the one that is there afterwards."""
    return text(store.compare_set("decision", "", desired))


def differing_releases(store, p):
    """With `same_release` (a restart, which launches each node's current release):
    the abort naming each node's release when they are not one and the same."""
    if not p.get("same_release"):
        return None
    found = [text(store.get(f"release/{r}")) for r in range(int(p["world"]))]
    if len(set(found)) == 1:
        return None
    which = ", ".join(f"{p['names'][r]}: {rel}" for r, rel in enumerate(found))
    return (
        f"abort:the nodes have different current releases ({which}); "
        "a run across nodes needs the same trainer on each"
    )


def decide(store, p, deadline):
    """Arrive, then wait for the decision; returns its text ("commit" or "abort:...")."""
    store.set(f"node/{int(p['rank'])}", "1")
    store.set(f"release/{int(p['rank'])}", p.get("release") or "")
    if store.add("arrived", 1) == int(p["world"]):
        return cas(store, differing_releases(store, p) or "commit")
    while True:
        if store.check(["decision"]):
            return text(store.get("decision"))
        reason = read_marker(p["marker"])
        if reason is not None:
            return cas(store, "abort:" + reason)
        if time.monotonic() >= deadline:
            missing = unmarked(store, p, "node")
            who, within = ", ".join(missing) or "?", float(p["deadline_s"])
            return cas(store, f"abort:node {who} did not arrive within {within:.0f} s")
        time.sleep(POLL_S)


def after_decision(store, p):
    """Node 0 keeps the store up until the others read the decision; they say so."""
    if int(p["rank"]) != 0:
        store.add("acked", 1)
        return
    wait_for_acks(store, p, time.monotonic() + float(p.get("ack_wait_s", ACK_WAIT_S)))


def wait_for_acks(store, p, until):
    """Node 0: poll until every other node acked the decision, or `until` passes."""
    while store.add("acked", 0) < int(p["world"]) - 1 and time.monotonic() < until:
        time.sleep(POLL_S)


def say(answer):
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()


def gate(store, p, key, name):
    """Mark this node `key/<rank>` when the agent says `{key: true}` on stdin, then wait
    until every node is marked (bounded by gate_s); {name: "open"}, or "timeout" with
    the nodes missing, or "closed" at once when this node is not marked (the agent
    closed stdin: the others are not held for it), or "lost" (the store went away)."""
    here = bool(said().get(key))
    try:
        if here:
            store.set(f"{key}/{int(p['rank'])}", "1")
        until = time.monotonic() + (float(p.get("gate_s", 120.0)) if here else 0.0)
        missing = wait_for_every(store, p, key, until)
        if not missing:
            return {name: "open"}
        return {name: "timeout" if here else "closed", "missing": missing}
    except Exception as exc:  # noqa: BLE001 - the store went away: go on without waiting
        return {name: "lost", "why": first_line(exc)}


def said():
    """The agent's next line on stdin as a dict; {} when it closed stdin instead."""
    line = sys.stdin.readline()
    return json.loads(line) if line.strip() else {}


def unmarked(store, p, key):
    """The nodes not (yet) marked `key/<rank>` in the store."""
    return [p["names"][r] for r in range(int(p["world"])) if not store.check([f"{key}/{r}"])]


def wait_for_every(store, p, key, until):
    """The nodes not yet marked `key/<rank>`, polled until none is missing or `until`
    (a time.monotonic()) passes; the last missing ones."""
    while True:
        missing = unmarked(store, p, key)
        if not missing or time.monotonic() >= until:
            return missing
        time.sleep(POLL_S)


def launch_round(store, p):
    """After the gate: whether every node's new run started. A node that could not
    launch makes every node roll back, at once."""
    rank, names, world = int(p["rank"]), p["names"], int(p["world"])
    told = said()
    try:
        if told.get("launched"):
            store.set(f"launched/{rank}", "ok")
        else:
            why = told.get("why") or "it did not launch (its old run could not be stopped)"
            store.set(f"launched/{rank}", "failed:" + why)
            store.set(f"unlaunched/{rank}", "1")  # no new run here to take down
        until = time.monotonic() + float(p.get("launch_s", LAUNCH_WAIT_S))
        while True:
            failed, missing = [], []
            for r in range(world):
                if not store.check([f"launched/{r}"]):
                    missing.append(names[r])
                    continue
                value = text(store.get(f"launched/{r}"))
                if value.startswith("failed:"):
                    failed.append({"node": names[r], "why": value[len("failed:") :]})
            if failed:
                return {"launch": "failed", "failed": failed}
            if not missing:
                return {"launch": "all"}
            if time.monotonic() >= until:
                return {"launch": "timeout", "missing": missing}
            time.sleep(POLL_S)
    except Exception as exc:  # noqa: BLE001 - the store went away: nobody can roll back with us
        return {"launch": "lost", "why": first_line(exc)}


def join(p):
    import torch.distributed  # noqa: F401 - first: on a loaded machine this takes seconds

    deadline = time.monotonic() + float(p["deadline_s"])
    store, why = connect(p, deadline)
    if store is None:
        return aborted(why)
    try:
        decision = decide(store, p, deadline)
    except Exception as exc:  # noqa: BLE001 - the store went away after we arrived
        return aborted(
            f"lost the commit store on node {p['names'][0]} after arriving "
            f"({first_line(exc)}): the other nodes may have committed",
            in_doubt=True,
        )
    if decision == "commit" and p.get("gate"):
        say(COMMITTED)
        # After a commit: no node launches before every node has stopped its old run.
        say(gate(store, p, "stopped", "gate"))
        outcome = launch_round(store, p)
        say(outcome)
        if outcome["launch"] == "failed":
            # No node launches the previous release again before every node's new
            # run is down.
            say(gate(store, p, "unlaunched", "rollback"))
    try:
        after_decision(store, p)
    except Exception:  # noqa: BLE001 - the decision is known; the ack is a courtesy
        pass
    if decision == "commit" and p.get("gate"):
        return None
    return outcome_of(decision)


def outcome_of(decision):
    """The answer for a decision's text ("commit" or "abort:<why>")."""
    return COMMITTED if decision == "commit" else aborted(decision[len("abort:") :])


def abort(p):
    """A node that failed before it could arrive: write abort if nothing is decided,
    without arriving (so it can never complete a commit). Best effort, started in the
    background by the failing node's agent. Node 0 hosts the store with the decision
    in it for `deadline_s`, for the others to read when they arrive."""
    deadline = time.monotonic() + float(p["deadline_s"])
    store, why = connect(p, time.monotonic() + CONNECT_TRY_S)
    if store is None:
        return aborted(why)
    decision = cas(store, "abort:" + p["reason"])
    if int(p["rank"]) == 0:
        wait_for_acks(store, p, deadline)
    return outcome_of(decision)


def wait_for_release(p):
    """Started ahead (`wait_for_release`): import torch while the agent builds the
    release, then read it from stdin. None when the agent closed stdin instead (the
    build failed, or the agent is gone): this node never arrives."""
    import torch.distributed  # noqa: F401 - the seconds this start ahead is for

    line = sys.stdin.readline()
    if not line.strip():
        return None
    return dict(p, release=json.loads(line)["release"])


def main(argv):
    p = json.loads(argv[1])
    p["secret"] = os.environ.get("DFLASH_COMMIT_SECRET", "")
    if not p["secret"]:
        say(aborted("the deploy gave no commit secret"))
        return 0
    if p.get("wait_for_release"):
        p = wait_for_release(p)
        if p is None:
            return 0
    answer = abort(p) if p.get("mode") == "abort" else join(p)
    if answer is not None:  # None: join said all it had to, line by line
        say(answer)
    return 0


if __name__ == "__main__":
    # Started from a detached child with no terminal: a hangup must not end it
    # before it decides.
    import signal

    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    sys.exit(main(sys.argv))
