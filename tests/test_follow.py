"""The follower on this machine (host.address local, no container): lines, end of run,
crashes, backlog, truncation, and resuming after a broken stream without losing or
repeating a line."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading

import pytest
from rich.console import Console

from dflashctl.crash import load_rules
from dflashctl.errors import HostError, UsageError
from dflashctl.follow import FrameParser, LineSplitter, ReaderBroken, follow_run
from dflashctl.remote.deploy_target import Target
from dflashctl.remote.transport.base import ConnectionLost
from dflashctl.remote.transport.local import LocalTransport
from tests.test_follow_support import (
    expected_lines,
    kill_run,
    launch_argv,
    local_target,
    trainer_argv,
    wait_for,
)
from tests.waiting import returns

RULES = load_rules()


def step_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(("step ", "training complete"))]


class Runs:
    """Starts fake runs under tmp_path/dflash/runs and kills them after the test."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.rundirs = []

    def start(self, run_id: str, lines: int, delay: float, mode: str = "finish"):
        rundir = self.workdir / "runs" / run_id
        self.rundirs.append(rundir)
        argv = launch_argv(str(rundir), trainer_argv(sys.executable, lines, delay, mode))
        subprocess.run(argv, check=True)
        wait_for(lambda: (rundir / "pid").exists(), what="the pid file")
        return rundir


@pytest.fixture
def runs(tmp_path):
    made = Runs(tmp_path / "dflash")
    yield made
    for rundir in made.rundirs:
        kill_run(rundir)


def follow(runs, run_id, **kwargs):
    out = io.StringIO()
    kwargs.setdefault("target", local_target())
    kwargs.setdefault("rules", RULES)
    kwargs.setdefault("python", sys.executable)
    result = follow_run(
        kwargs.pop("reconnect", None),
        str(runs.workdir),
        run_id,
        console=Console(file=out, width=200),
        **kwargs,
    )
    return result, out.getvalue()


def readers_of_mine() -> list[int]:
    """This process's log readers (the agent's `log` verb, run by the local transport)."""
    mine = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = open(f"/proc/{entry}/cmdline", "rb").read().split(b"\0")
            parent = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"DFLASH-LOG" in argv and parent == os.getpid():
            mine.append(int(entry))
    return mine


# --------------------------------------------------------------------------- pieces


def test_splitter_keeps_the_offset_of_the_last_complete_line():
    splitter = LineSplitter(100)
    assert splitter.feed(b"one\ntw") == ["one"]
    assert (splitter.offset, splitter.received_end) == (104, 106)
    assert splitter.feed(b"o\r\nthree\n") == ["two", "three"]
    assert splitter.offset == 115
    splitter.feed(b"par")
    splitter.reset(splitter.offset)  # a drop: the partial line will come again whole
    assert splitter.feed(b"partial\n") == ["partial"]
    assert splitter.feed(b"no newline") == [] and splitter.flush() == "no newline"


def test_frame_parser_skips_login_noise_and_waits_for_whole_frames():
    parser = FrameParser()
    assert parser.feed(b"Welcome to the host\nDFLASH-LOG 1\nS 0 9\nD 9\nabc") == [
        ("S", [0, 9], b""),
        ("D", [3], b"abc"),
    ]
    assert parser.feed(b"\ndefg") == [("D", [5], b"\ndefg")]  # pieces as they come
    assert parser.feed(b"\nH\nE\n") == [("D", [1], b"\n"), ("H", [], b""), ("E", [], b"")]


def test_frame_parser_refuses_garbage():
    parser = FrameParser()
    with pytest.raises(ReaderBroken):
        parser.feed(b"DFLASH-LOG 1\n\xff\xfe oops\n")


# --------------------------------------------------------------------------- whole runs


def test_follows_a_run_to_a_clean_finish(runs):
    runs.start("r1", lines=12, delay=0.03)
    result, out = follow(runs, "r1")
    assert step_lines(out) == expected_lines(12)
    assert (result.status, result.exit_code, result.crashes) == ("finished", 0, [])
    assert result.cli_exit_code == 0
    data = result.to_json()
    assert {k: data[k] for k in ("run", "status", "exit_code", "crashes")} == {
        "run": "r1",
        "status": "finished",
        "exit_code": 0,
        "crashes": [],
    }
    assert data["run_dir"].endswith("/runs/r1")
    assert data["summary"]["last_step"] == "12/12"


def test_a_thread_crash_is_reported_with_its_thread(runs):
    runs.start("r2", lines=3, delay=0.02, mode="thread-crash")
    seen = []
    result, out = follow(runs, "r2", on_crash=seen.append)
    assert step_lines(out) == expected_lines(3, "thread-crash")
    assert result.status == "crashed" and result.exit_code == 1 and result.cli_exit_code == 1
    root = result.crashes[0]
    assert root.is_root_cause and root.thread == "drafter-2" and root.exception == "AssertionError"
    assert seen and seen[0] is root
    assert "AssertionError" in out and "drafter-2" in out  # the panel
    assert result.to_json()["crashes"][0]["thread"] == "drafter-2"


def test_death_by_signal_is_a_crash(runs):
    rundir = runs.start("r3", lines=2, delay=0.01, mode="hang")
    wait_for(lambda: "step 2/2" in (rundir / "train.log").read_text(), what="the log")
    kill_run(rundir)  # SIGKILL to the session: the wrapper dies too -> "lost"
    result, _ = follow(runs, "r3")
    assert result.status == "crashed" and result.cli_exit_code == 1


def test_starts_before_the_log_exists(runs):
    rundir = runs.workdir / "runs" / "r4"
    rundir.mkdir(parents=True)
    # A live pid and no log yet: a run that is still starting (its wrapper carries the
    # run's id, as the supervisor does: a pid that does not is someone else's).
    placeholder = subprocess.Popen(["sleep", "30"], env=dict(os.environ, DFLASH_RUN_ID="r4"))
    (rundir / "pid").write_text(f"{placeholder.pid}\n")

    def launch_later():
        # Once the follower's reader waits for the log (not after a guessed delay).
        wait_for(lambda: readers_of_mine(), timeout=120, what="the follower's log reader")
        (rundir / "pid").unlink()
        runs.start("r4", lines=4, delay=0.02)

    launcher = threading.Thread(target=launch_later)
    launcher.start()
    try:
        result, out = follow(runs, "r4")
    finally:
        launcher.join()
        placeholder.kill()
        placeholder.wait()
    assert step_lines(out) == expected_lines(4)
    assert result.status == "finished"


def test_last_lines_of_a_finished_run_still_classify_the_whole_log(runs):
    rundir = runs.start("r5", lines=30, delay=0, mode="thread-crash")
    wait_for(lambda: (rundir / "exit_code").exists(), what="the end of the run")
    result, out = follow(runs, "r5", lines=3, follow=False)
    # The last three lines are the end of the traceback; the step lines are all earlier.
    assert step_lines(out) == []
    assert result.status == "crashed" and result.crashes[0].thread == "drafter-2"
    result, out = follow(runs, "r5", lines=40)
    assert step_lines(out) == expected_lines(30, "thread-crash")


def test_last_lines_of_a_long_finished_log_are_read_from_its_end(runs):
    rundir = runs.workdir / "runs" / "r9"
    rundir.mkdir(parents=True)
    total = 200_000  # about 6 MiB
    with (rundir / "train.log").open("w") as log:
        for i in range(1, total + 1):
            log.write(f"step {i}/{total} | loss 2.0000 | acc 0.50 | tau~ 2.00\n")
    (rundir / "exit_code").write_text("0\n")
    seen = []
    result, out = follow(
        runs, "r9", lines=2, follow=False, on_line=lambda text, live: seen.append(text)
    )
    assert step_lines(out) == [
        f"step {i}/{total} | loss 2.0000 | acc 0.50 | tau~ 2.00" for i in (total - 1, total)
    ]
    assert result.status == "finished"
    # Only the log's tail was read (and classified), not its 6 MiB.
    assert 2 <= len(seen) < total // 4


def test_not_following_a_running_run_returns_at_once(runs):
    rundir = runs.start("r6", lines=3, delay=0.01, mode="hang")
    wait_for(lambda: "step 3/3" in (rundir / "train.log").read_text(), what="the log")
    # The run never ends by itself: returning at all is returning at once.
    result, out = returns(lambda: follow(runs, "r6", follow=False, lines=2))
    assert step_lines(out) == expected_lines(3, "hang")[-2:]
    assert (result.status, result.exit_code, result.cli_exit_code) == ("running", None, 0)


def test_unknown_run_is_a_usage_error(runs):
    (runs.workdir / "runs").mkdir(parents=True)
    with pytest.raises(UsageError, match="no run nope"):
        follow(runs, "nope")


def test_a_truncated_log_is_read_again_from_the_start(runs):
    rundir = runs.workdir / "runs" / "r7"
    rundir.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "30"], env=dict(os.environ, DFLASH_RUN_ID="r7"))
    try:
        (rundir / "pid").write_text(f"{sleeper.pid}\n")
        (rundir / "train.log").write_text("old 1\nold 2\n")

        printed: list[str] = []

        def rotate():
            # Each step once the follower has printed what came before it: however slow
            # the machine, the truncation comes after the old lines were read.
            wait_for(lambda: "old 2" in printed, timeout=120, what="the old lines")
            (rundir / "train.log").write_text("new 1\n")  # truncates in place
            wait_for(lambda: "new 1" in printed, timeout=120, what="the new line")
            sleeper.kill()

        rotator = threading.Thread(target=rotate, daemon=True)
        rotator.start()
        result, out = follow(
            runs, "r7", reconnect=local_target, on_line=lambda text, _: printed.append(text)
        )
        rotator.join(10)
    finally:
        sleeper.kill()
        sleeper.wait()
    lines = [line for line in out.splitlines() if line.startswith(("old", "new"))]
    assert lines == ["old 1", "old 2", "new 1"]
    assert result.status == "crashed"  # the process vanished without an exit code


# --------------------------------------------------------------------------- drops


class BreakingStream:
    """A stream whose connection drops after `cut` bytes."""

    def __init__(self, inner, cut: int):
        self.inner, self.left = inner, cut

    def read(self, timeout):
        if self.left <= 0:
            raise ConnectionLost("local", "streaming")
        data = self.inner.read(timeout)
        if data:
            data = data[: self.left]
            self.left -= len(data)
        return data

    def close(self):
        self.inner.close()

    @property
    def stderr(self):
        return self.inner.stderr


class BreakingTarget(Target):
    """Each stream breaks after a few hundred bytes, mid-line and mid-frame."""

    made = 0

    def __init__(self, cut: int | None = None):
        super().__init__(LocalTransport(), None)
        BreakingTarget.made += 1
        self.cut = cut or 150 + 37 * BreakingTarget.made

    def stream(self, argv):
        return BreakingStream(super().stream(argv), self.cut)


def test_every_line_once_across_dropped_streams(runs, capsys):
    BreakingTarget.made = 0
    runs.start("r8", lines=40, delay=0.01, mode="split")
    result, out = follow(runs, "r8", target=BreakingTarget(), reconnect=BreakingTarget)
    assert step_lines(out) == expected_lines(40, "split")
    assert result.status == "finished"
    assert BreakingTarget.made > 3  # it really did reconnect, several times
    assert "reconnecting" in capsys.readouterr().err


def test_gives_up_after_the_reconnect_budget(runs):
    runs.start("r9", lines=2, delay=0.01, mode="hang")

    attempts = []

    def cannot_connect():
        attempts.append(1)
        raise HostError("connection refused")

    with pytest.raises(HostError, match="may still be running") as caught:
        follow(
            runs,
            "r9",
            target=BreakingTarget(cut=60),
            reconnect=cannot_connect,
            reconnect_timeout_s=1.0,
        )
    # Delays of 0.2 and 0.5 s fit in the 1 s budget, the next (1 s) does not: a busy
    # machine makes fewer attempts, never more.
    assert 1 <= len(attempts) <= 2, attempts
    assert caught.value.exit_code == 3
    assert "dflashctl logs -f r9" in caught.value.hint


def test_a_last_line_without_newline_is_printed_once_the_run_ended(runs):
    rundir = runs.workdir / "runs" / "r10"
    rundir.mkdir(parents=True)
    (rundir / "train.log").write_text("step 1/2 | loss 2.0\nstep 2/2 | loss 1.9")
    (rundir / "exit_code").write_text("0\n")
    result, out = follow(runs, "r10")
    assert step_lines(out) == ["step 1/2 | loss 2.0", "step 2/2 | loss 1.9"]
    assert result.status == "finished"


def test_a_crash_in_a_run_that_still_runs_counts_as_a_crash(runs):
    rundir = runs.start("r11", lines=2, delay=0.01, mode="crash-hang")
    wait_for(lambda: "AssertionError" in (rundir / "train.log").read_text(), what="the crash")
    result, _ = follow(runs, "r11", follow=False)
    assert (result.status, result.state, result.exit_code) == ("crashed", "running", None)
    assert result.crashes[0].thread == "drafter-2" and result.cli_exit_code == 1
