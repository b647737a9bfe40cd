"""The run's wrapper where the trainer runs: it starts the trainer, and when the trainer
crashes with a failure a restart fixes (run.retry), starts it again resuming from the
run's own latest checkpoint, with nobody following and the laptop closed.

    python -S runs/<id>/supervise.py <run-dir>

It is started by the agent (runs.start_run) in a new session: its pid is the run's pid
file, the run's process group and session. The trainer runs as its child in the same
process group, so `dflashctl stop` (SIGTERM to the group) reaches the trainer directly
(which checkpoints and exits) and tells this wrapper to stop recovering. At the run's
real end, and only then, the exit status (128+N for signal N) goes to
<run-dir>/exit_code (atomically) and run.on_exit runs once, with DFLASH_EXIT_CODE and
DFLASH_ATTEMPTS set.

What a crash was is decided by dflashctl's own crash detector and the run's crash
rules (the built-in ones plus dflash.yaml's crash_patterns), which travel with this
program (see dflashctl/ops/recovery.py): no second copy of the rules. Every attempt is
recorded in <run-dir>/attempts.json: when, how it ended, its category, the last step
logged, the checkpoint the next attempt resumes from, and whether and why it was
retried.

Written for Python 3.6 and the standard library only, like the rest of the agent; the
crash detector it imports needs 3.7 (the trainer's interpreter has it: torch does).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

from dflashctl.agent.checkpoint_folders import checkpoint_step, newest_complete

ATTEMPTS_FILE = "attempts.json"
SETTINGS_FILE = "recovery.json"
# The line that starts each attempt after the first ("dflashctl: attempt 2/4, resumed
# at step 18400 after nccl_timeout"): `logs -f` (dflashctl/follow) takes it as the
# start of a fresh attempt, whose crashes are its own.
NEW_ATTEMPT = re.compile(r"^dflashctl: attempt (\d+)(?:/\d+)?, resumed at ")
# "dflashctl: attempt 1/4 crashed at step 3 (killed, exit code 137); ...": the exit
# status lets `logs -f` weigh the attempt's end as it would a run's.
CRASHED = re.compile(r"^dflashctl: attempt \d+(?:/\d+)? crashed.*, exit code (\d+)\); ")
NOT_RETRIED = re.compile(r"^dflashctl: attempt \d+ crashed.*; not retried: (.*)$")
_STEP = re.compile(r"^(?:\[rank\d+\]:\s?)?step (\d+)\b")
_CHECKPOINT = re.compile(r"(?:^|\s)checkpoint: (/\S+)")


# --------------------------------------------------------------------------- the policy


def decide(policy, history, crash, step, now, current=None):
    """Should the run be restarted after this crash? (retry, reason): pure, so that the
    rules are tested on their own.

    policy: run.retry (max_restarts, on, window_s); history: the earlier attempts'
    records; crash: {"category", "retryable", "rule"} of the root cause, or None when
    nothing was recognised; step: the last step this attempt logged (None: unknown);
    current: this attempt's record so far ("resumed_from", "checkpointed"), when known.

    Every crash loop ends: a retry that would start from the checkpoint this attempt
    started from, after this attempt got no further than the one before it, is the
    same crash again; and restarts are counted since the last new checkpoint as well
    as within window_s, so a window shorter than an attempt still ends the loop.

    Progress counts by the steps logged too: after an attempt that wrote a new
    checkpoint, the next one resumes from it, and logging steps past it is progress
    even when it dies at the same step as the one before (both killed while writing
    the next checkpoint, as an OOM at checkpoint time does)."""
    limit = int(policy.get("max_restarts") or 0)
    if limit <= 0:
        return False, "automatic recovery is off (run.retry.max_restarts is 0)"
    if crash is None:
        return False, "no failure dflashctl recognises, so nothing says a restart would help"
    category = crash["category"]
    allowed = policy.get("categories")
    if allowed is not None:
        if category not in allowed:
            return False, "{} is not in run.retry.categories ({})".format(
                category, ", ".join(allowed) or "empty"
            )
    elif not crash.get("retryable"):
        return (
            False,
            "{} is not retryable (crash rule {}): a restart would fail the same way".format(
                category, crash.get("rule")
            ),
        )
    previous = history[-1] if history else None
    # The attempt before wrote a checkpoint this one resumed from: measure this one's
    # progress from there, not from where the attempt before got to.
    moved_on = previous is not None and bool(previous.get("checkpointed"))
    start = current.get("resumed_from") if current else None
    start_step = (checkpoint_step(start) or 0) if start else 0
    if (
        step is not None
        and previous is not None
        and previous.get("step") == step
        and not (moved_on and step > start_step)
    ):
        return (
            False,
            "it crashed at step {} again, as attempt {} did: a restart does not get past it".format(
                step, previous["attempt"]
            ),
        )
    checkpointed = bool(current and current.get("checkpointed"))
    if previous is not None and current is not None and not checkpointed:
        before = start_step if moved_on else previous.get("step")
        if step is None or (before is not None and step <= before):
            start = current.get("resumed_from")
            where = f"checkpoint {start}" if start else "the start"
            got = "no step logged after the resume" if step is None else f"step {step}"
            return (
                False,
                f"it resumed from {where} and made no progress past it (no new checkpoint, {got}): "
                "a restart from the same checkpoint would crash the same way",
            )
    window = float(policy.get("window_s") or 0)
    recent = _recent(policy, history, now)
    if len(recent) >= limit:
        within = f" within {window:g} s" if window > 0 else ""
        return (
            False,
            f"{len(recent)} restarts{within} already (run.retry.max_restarts {limit}): a crash loop",
        )
    if current is not None and not checkpointed:
        stalled = 1  # this attempt, then the ones before it since the last new checkpoint
        for earlier in reversed(history):
            if earlier.get("checkpointed"):
                break
            stalled += 1
        if stalled > limit:
            return (
                False,
                f"{stalled - 1} restarts since the last new checkpoint already "
                f"(run.retry.max_restarts {limit}, whatever run.retry.window_s): a crash loop",
            )
    return True, f"{category} is retryable"


def backoff_s(policy, history, now):
    """The wait before the next attempt: backoff_s, doubled for each restart within the
    window, at most max_backoff_s."""
    base = float(policy.get("backoff_s") or 0)
    most = float(policy.get("max_backoff_s") or base)
    return min(base * (2 ** len(_recent(policy, history, now))), most)


def _recent(policy, history, now):
    """The earlier attempts that were retried within run.retry.window_s (0: ever)."""
    window = float(policy.get("window_s") or 0)
    return [
        a for a in history if a.get("retried") and (window <= 0 or now - a["ended_unix"] <= window)
    ]


# --------------------------------------------------------------------------- classifying


def classify(lines, exit_code, rules):
    """The root cause of this attempt's end as {"category", "retryable", "rule",
    "summary"}, by dflashctl's crash detector; None when nothing was recognised.
    (None too when the detector cannot be loaded: then nothing is retried.)"""
    from dflashctl.crash.detector import CrashDetector
    from dflashctl.crash.rules import parse_rule_list

    detector = CrashDetector(parse_rule_list(rules, where=SETTINGS_FILE))
    for line in lines:
        detector.feed(line)
    detector.finish(exit_code)
    events = detector.crashes
    if not events:
        stop = detector.stop
        if stop is not None and (stop.clean or stop.killed_after_grace):
            # Asked to stop (SIGTERM, Ctrl-C) and stopped: not a crash, whatever the
            # exit status (torchrun's 1, a second Ctrl-C's 130).
            return {
                "category": "stopped",
                "retryable": False,
                "rule": "clean_stop",
                "summary": stop.describe(),
            }
        return None
    root = events[0]
    if root.category == "exit_status":  # the detector's "non-zero, nothing recognised"
        return None
    return {
        "category": root.category,
        "retryable": bool(root.retryable),
        "rule": root.rule,
        "summary": root.summary,
    }


def _said(lines, exit_code, rules, category):
    """classify's answer when it is `category`, else None (also when the engine cannot
    run: it then decides nothing)."""
    try:
        said = classify(lines, exit_code, rules)
    except Exception:  # noqa: BLE001 - an engine that cannot run decides nothing
        return None
    return said if said and said["category"] == category else None


def _clean_stop(lines, exit_code, rules):
    """`stopped (checkpoint at step N)` when the trainer says it stopped as asked."""
    said = _said(lines, exit_code, rules, "stopped")
    return said["summary"] if said else None


def _hung(lines, exit_code, rules):
    """A run stopped while it hung (the trainer's watchdog said so, and no step came
    after): the hang stays its end state, {"category": "hang", ...}; else {}."""
    said = _said(lines, exit_code, rules, "hang")
    return {"category": "hang", "rule": said["rule"], "summary": said["summary"]} if said else {}


def last_step(lines):
    step = None
    for line in lines:
        found = _STEP.match(line)
        if found:
            step = int(found.group(1))
    return step


def last_checkpoint(lines):
    """The last checkpoint folder the trainer said it wrote ("checkpoint: /path") that
    is there (a folder being written when the crash came may not be)."""
    found = None
    for line in lines:
        match = _CHECKPOINT.search(line)
        if match and os.path.isdir(match.group(1)):
            found = match.group(1)
    return found


# --------------------------------------------------------------------------- the loop


class Supervisor:
    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.log = os.path.join(run_dir, "train.log")  # our stdout and the trainer's
        with open(os.path.join(run_dir, SETTINGS_FILE), encoding="utf-8") as f:
            settings = json.load(f)
        self.command = list(settings["command"])
        self.policy = settings.get("retry") or {}
        self.rules = settings.get("rules") or []
        self.attempts = []
        self.stop_signal = None

    def _on_signal(self, signum, frame):
        # The trainer, in our process group, got the same signal from `stop`; it is
        # not sent again (a second SIGTERM makes the trainer abandon its step).
        self.stop_signal = signum

    def say(self, text):
        try:
            sys.stdout.write("dflashctl: " + text + "\n")
            sys.stdout.flush()
        except OSError:  # train.log on a full disk: the run goes on, unsaid
            pass

    def run(self):
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)
        limit = int(self.policy.get("max_restarts") or 0)
        checkpoint = None
        while True:
            number = len(self.attempts) + 1
            if number > 1 and self.stop_signal is not None:  # came after the wait
                self.say("stopped before the restart; not restarting")
                return self.end(128 + self.stop_signal)
            argv = list(self.command)
            env = dict(os.environ, DFLASH_ATTEMPT=str(number))
            if number > 1:
                argv += list(self.policy.get("resume_args") or [])
                if checkpoint:
                    # The variable a continued run reads its checkpoint from (it may
                    # name the checkpoint of the run this one continues): now this
                    # run's own latest one. Without one yet, it stays as it was.
                    env.update(
                        DFLASH_RESUME_FROM=checkpoint,
                        DFLASH_RESUMED_RUN=os.environ.get("DFLASH_RUN_ID", ""),
                        DFLASH_RESUMED_STEP=str(checkpoint_step(checkpoint) or ""),
                        DFLASH_RESUMED_FINISHED="",  # this run's own: not a finished one
                    )
            # Where this attempt starts: its own run's latest checkpoint, else the one
            # the run was launched to continue (None: step 0).
            resumed_from = checkpoint or os.environ.get("DFLASH_RESUME_FROM") or None
            offset = _size(self.log)
            started = time.time()
            try:
                child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, env=env)
            except OSError as exc:
                self.say(f"could not start {argv[0]}: {exc.strerror}")
                return self.end(127)
            code = child.wait()  # a signal does not cut it short (PEP 475)
            code = 128 - code if code < 0 else code
            lines = _lines_from(self.log, offset)
            step = last_step(lines)
            written = last_checkpoint(lines) or _on_disk_past(self.run_dir, checkpoint)
            checkpoint = written or checkpoint
            record = {
                "attempt": number,
                "started": _utc(started),
                "ended": _utc(time.time()),
                "ended_unix": round(time.time(), 3),
                "exit_code": code,
                "step": step,
                "checkpoint": checkpoint,
                "resumed_from": resumed_from,
                # A checkpoint past the one it started from: progress a restart keeps.
                "checkpointed": _is_newer(written, resumed_from),
                "retried": False,
            }
            if code == 0 or self.stop_signal is not None:
                record["reason"] = "finished" if code == 0 else "stopped"
                if code == 0:  # a SIGTERM from elsewhere: the trainer stops with exit 0
                    stopped = _clean_stop(lines, code, self.rules)
                    if stopped:
                        record.update(reason="stopped", stop=stopped)
                else:
                    record.update(_hung(lines, code, self.rules))
                self.record(record)
                return self.end(code)
            try:
                crash = classify(lines, code, self.rules)
            except Exception as exc:  # an engine that cannot run decides nothing
                crash = None
                self.say(f"cannot classify the crash ({exc}); not retrying")
            if crash is not None and crash["category"] == "stopped":
                record.update(reason="stopped", stop=crash["summary"])
                self.record(record)
                return self.end(code)
            if crash is not None:
                record.update(
                    category=crash["category"], rule=crash["rule"], summary=crash["summary"]
                )
            retry, reason = decide(
                self.policy, self.attempts, crash, step, time.time(), current=record
            )
            record["retried"], record["reason"] = retry, reason
            what = crash["category"] if crash else "unrecognised"
            at = f" at step {step}" if step is not None else ""
            if not retry:
                self.record(record)
                if limit > 0:
                    self.say(
                        f"attempt {number} crashed{at} ({what}, exit code {code}); not retried: {reason}"
                    )
                return self.end(code)
            wait = backoff_s(self.policy, self.attempts, time.time())
            record["backoff_s"] = wait
            # Without a checkpoint of its own yet, the run starts again where it
            # started: step 0, or the checkpoint of the run it continues.
            start = checkpoint or os.environ.get("DFLASH_RESUME_FROM") or None
            # The checkpoint of a run that finished is where a new training starts
            # from step 0 (the trainer's choice, from DFLASH_RESUMED_FINISHED).
            over = not checkpoint and os.environ.get("DFLASH_RESUMED_FINISHED") == "1"
            record["resume_step"] = checkpoint_step(start) if start and not over else 0
            self.record(record)
            if over:
                resume = "from the start (no checkpoint yet; the run it continues had finished)"
            elif start:
                resume = f"from checkpoint {start}"
            else:
                resume = "from the start (no checkpoint yet)"
            self.say(
                f"attempt {_numbered(number, limit)} crashed{at} ({what}, exit code {code}); restarting in {wait:g} s, resuming {resume} (run.retry)"
            )
            if not self.sleep(wait):
                self.say("stopped while waiting to restart; not restarting")
                return self.end(128 + self.stop_signal)
            self.reap_leftovers(number)
            at = record["resume_step"]
            resumed_at = f"step {at}" if at is not None else f"checkpoint {start}"
            self.say(
                f"attempt {_numbered(number + 1, limit)}, resumed at {resumed_at} after {what}"
            )

    def reap_leftovers(self, number):
        """Processes the crashed attempt left in the run's process group (data loader
        workers, ranks) hold memory and GPUs the next attempt needs: they go first."""
        left = _group_members()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if left:
            pids = ", ".join(map(str, left))
            self.say(f"killed {len(left)} process(es) attempt {number} left behind (pid {pids})")

    def sleep(self, seconds):
        """Wait, unless `stop` comes first (then False)."""
        deadline = time.monotonic() + seconds
        while self.stop_signal is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.2))  # a signal cuts it short: its handler sets the flag
        return False

    def record(self, record):
        self.attempts.append(record)
        most = int(self.policy.get("max_restarts") or 0) + 1
        data = {"max_attempts": most, "attempts": self.attempts}
        _write_atomic(os.path.join(self.run_dir, ATTEMPTS_FILE), json.dumps(data, indent=2))

    def end(self, code):
        """The real end: exit_code (atomically), then run.on_exit once."""
        try:
            _write_atomic(os.path.join(self.run_dir, "exit_code"), f"{code}\n")
        except OSError as exc:  # a full disk: the run still ends, and on_exit runs
            self.say(f"could not record exit status {code}: {exc.strerror or exc}")
        hook = os.environ.get("DFLASH_ON_EXIT")
        if hook:
            env = dict(
                os.environ, DFLASH_EXIT_CODE=str(code), DFLASH_ATTEMPTS=str(len(self.attempts))
            )
            sys.stdout.flush()
            status = subprocess.call(["/bin/sh", "-c", hook], stdin=subprocess.DEVNULL, env=env)
            if status != 0:
                self.say(f"run.on_exit failed with exit status {status}")
        return code


def _numbered(number, limit):
    """`2/4`; past the limit (restarts older than the window no longer count) just `6`."""
    return f"{number}/{limit + 1}" if number <= limit + 1 else str(number)


def _group_members():
    """Live processes of our process group, other than this one (from /proc)."""
    me, group = os.getpid(), os.getpgid(0)
    if group != me:
        # Not started as the run's own group leader (by hand, from a shell): the group
        # is somebody else's, and nothing in it is ours to kill.
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and int(fields[2]) == group and fields[0] not in "ZX":
            found.append(int(name))
    return sorted(found)


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _lines_from(path, offset):
    """This attempt's lines of train.log: from `offset` on."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return []
    return data.decode("utf-8", "replace").splitlines()


def _on_disk_past(run_dir, known):
    """This run's newest complete checkpoint on disk when it is past `known`: one whose
    "checkpoint:" line never reached the log (the trainer killed between the write
    and the line). None otherwise."""
    found = newest_complete(run_dir)
    return found if found and _is_newer(found, known) else None


def _is_newer(written, start):
    """Whether checkpoint `written` is progress past `start` (None: step 0)."""
    if not written or written == start:
        return False
    new, old = checkpoint_step(written), checkpoint_step(start) if start else 0
    return new is None or old is None or new > old


def _utc(seconds):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _write_atomic(path, text):
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        try:  # no half-written temporary left on a full disk
            os.unlink(tmp)
        except OSError:
            pass
        raise


def main(argv):
    if len(argv) != 1:
        sys.stderr.write("usage: supervise.py <run-dir>\n")
        return 2
    return Supervisor(argv[0]).run()
