"""Automatic recovery (run.retry): the supervisor's rules, the program it travels as, and
runs that crash and recover (or not) as a user sees them: `dflashctl deploy` follows the
run across its restarts, `runs` tells its attempts, and attempts.json records them."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflashctl.agent import supervisor
from dflashctl.agent.supervisor import backoff_s, decide
from dflashctl.crash import load_rules
from dflashctl.follow.lines import LineSink
from dflashctl.ops import recovery
from dflashctl.runs.records import describe_attempts
from tests.json_answers import flat
from tests.test_deploy_support import kill_runs, pid_alive, wait_for

DFLASHCTL = [sys.executable, "-m", "dflashctl"]
POLICY = {
    "max_restarts": 3,
    "categories": None,
    "backoff_s": 10,
    "max_backoff_s": 60,
    "window_s": 3600,
}
KILLED = {"category": "killed", "retryable": True, "rule": "killed"}
TRACEBACK = {"category": "python_exception", "retryable": False, "rule": "python_traceback"}


def attempt(number, *, step, retried=True, ended=1000.0, category="killed"):
    return {
        "attempt": number,
        "step": step,
        "retried": retried,
        "ended_unix": ended,
        "category": category,
    }


# --------------------------------------------------------------------------- the rules


def test_a_retryable_crash_is_retried():
    assert decide(POLICY, [], KILLED, 40, now=1000.0) == (True, "killed is retryable")


def test_a_crash_that_is_not_retryable_is_not_retried_and_says_why():
    retry, reason = decide(POLICY, [], TRACEBACK, 40, now=1000.0)
    assert not retry
    assert reason == (
        "python_exception is not retryable (crash rule python_traceback): "
        "a restart would fail the same way"
    )


def test_nothing_recognised_is_not_retried():
    retry, reason = decide(POLICY, [], None, 40, now=1000.0)
    assert not retry and "no failure dflashctl recognises" in reason


def test_run_retry_categories_names_them_instead_of_the_rules():
    policy = dict(POLICY, categories=["python_exception"])
    assert decide(policy, [], TRACEBACK, 40, now=1000.0)[0]
    retry, reason = decide(policy, [], KILLED, 40, now=1000.0)
    assert not retry and reason == "killed is not in run.retry.categories (python_exception)"


def test_max_restarts_0_turns_recovery_off():
    retry, reason = decide(dict(POLICY, max_restarts=0), [], KILLED, 40, now=1000.0)
    assert not retry and "max_restarts is 0" in reason


def test_a_crash_at_the_same_step_as_the_last_one_is_not_retried():
    retry, reason = decide(POLICY, [attempt(1, step=40)], KILLED, 40, now=1000.0)
    assert not retry
    assert reason == "it crashed at step 40 again, as attempt 1 did: a restart does not get past it"
    # Progress since: retried.
    assert decide(POLICY, [attempt(1, step=40)], KILLED, 55, now=1000.0)[0]


def test_a_crash_loop_stops_at_max_restarts_within_the_window():
    history = [attempt(i + 1, step=10 * (i + 1), ended=1000.0 + i) for i in range(3)]
    retry, reason = decide(POLICY, history, KILLED, 45, now=1010.0)
    assert not retry
    assert reason == "3 restarts within 3600 s already (run.retry.max_restarts 3): a crash loop"


def test_restarts_older_than_the_window_no_longer_count():
    history = [attempt(i + 1, step=10 * (i + 1), ended=1000.0 + i) for i in range(3)]
    assert decide(POLICY, history, KILLED, 45, now=1000.0 + 3600 + 10)[0]


def test_the_backoff_doubles_with_each_restart_in_the_window_up_to_its_cap():
    history = []
    waits = []
    for number in range(1, 6):
        waits.append(backoff_s(POLICY, history, now=1000.0))
        history.append(attempt(number, step=number))
    assert waits == [10, 20, 40, 60, 60]


def test_runs_tells_the_attempts_as_one_lineage():
    running = {"max_attempts": 4, "attempts": [dict(attempt(1, step=18433), resume_step=18400)]}
    assert (
        describe_attempts(running, running=True)
        == "attempt 2/4, resumed at step 18400 after killed"
    )
    ended = {
        "max_attempts": 4,
        "attempts": [
            dict(attempt(1, step=10), resume_step=8),
            dict(attempt(2, step=30, retried=False), reason="finished"),
        ],
    }
    assert describe_attempts(ended, running=False) == "attempt 2/4, after recovering from killed"
    refused = {
        "max_attempts": 4,
        "attempts": [dict(attempt(1, step=3, retried=False), reason="python_exception is ...")],
    }
    assert describe_attempts(refused, running=False) == "not retried: python_exception is ..."
    plain = {
        "max_attempts": 4,
        "attempts": [dict(attempt(1, step=9, retried=False), reason="finished")],
    }
    assert describe_attempts(plain, running=False) is None
    assert describe_attempts(None, running=False) is None


def test_the_log_follower_starts_a_fresh_detector_for_each_attempt(capsys):
    from rich.console import Console

    sink = LineSink(load_rules(), Console(file=open(os.devnull, "w")))
    for line in [
        "step 1/9 | loss 2.0",
        "Killed",
        "dflashctl: attempt 1/4 crashed at step 1 (killed, exit code 137); restarting in 0 s, "
        "resuming from checkpoint /w/runs/r/outputs/checkpoints/step-000000 (run.retry)",
        "dflashctl: attempt 2/4, resumed at step 0 after killed",
        "step 1/9 | loss 2.0",
        "training complete",
    ]:
        sink.line(line)
    sink.finish(0)
    assert sink.crashes == []
    assert [event.category for event in sink.recovered] == ["killed"]
    assert sink.attempt == 2


@pytest.mark.parametrize(
    ("line", "category"),
    [
        ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.", "gpu_hardware"),
        ("RuntimeError: CUDA error: uncorrectable ECC error encountered", "gpu_hardware"),
        (
            "dflash.pipeline.distributed.PeerFailure: rank 1 on host gpu-b stopped answering: "
            "no heartbeat for 12 s",
            "peer_lost",
        ),
    ],
)
def test_hardware_faults_and_lost_ranks_are_retryable(line, category):
    from dflashctl.crash import classify_text

    [event] = classify_text([line], 1, load_rules())
    assert (event.category, event.retryable) == (category, True)


# --------------------------------------------------------------------------- the program


def test_the_supervisor_runs_on_the_oldest_python_the_agent_promises():
    source = Path(supervisor.__file__).read_text()
    tree = ast.parse(source, feature_version=(3, 6))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AnnAssign)):
            assert not isinstance(node, ast.AnnAssign)
            assert node.returns is None and not any(a.annotation for a in node.args.args)
        if isinstance(node, ast.ImportFrom) and node.module == "__future__":
            assert all(alias.name != "annotations" for alias in node.names)


def test_the_program_carries_the_crash_detector_and_needs_only_the_standard_library():
    modules = recovery.program_modules()
    assert {"dflash_supervisor", "dflashctl.crash.detector", "dflashctl.crash.rules"} <= set(
        modules
    )
    for name, (_, source) in modules.items():
        # The container's python may be old: 3.7 is what README promises.
        for node in ast.walk(ast.parse(source, feature_version=(3, 7))):
            found = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found = [node.module]
            for module in found:
                top = module.split(".")[0]
                carried = module in modules or top == "dflashctl" and module in modules
                if top == "yaml":
                    continue  # rules.py reads YAML only in the CLI (never called there)
                assert top in sys.stdlib_module_names or carried, f"{name} imports {module}"


def test_the_program_decides_with_the_rules_it_was_given(tmp_path):
    """The program alone, as the container runs it (python -S, nothing installed): a
    user rule shipped in recovery.json makes a crash retryable."""
    rule = {
        "name": "flaky_storage",
        "category": "storage",
        "regex": "Stale file handle",
        "retryable": True,
        "hint": "the NFS mount went away",
    }
    settings = recovery.recovery_settings(_config_with(tmp_path, crash_patterns=[rule]))
    settings["retry"].update(backoff_s=0)
    marker = tmp_path / "failed-once"
    saved, unfinished = tmp_path / "ckpt" / "step-000002", tmp_path / "ckpt" / "step-000004"
    saved.mkdir(parents=True)
    script = (
        "import os, sys\n"
        f"m = {str(marker)!r}\n"
        "print('step', os.environ['DFLASH_ATTEMPT'], '| loss 1.0', flush=True)\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close()\n"
        f"    print('checkpoint: {saved} (0.1 s)', flush=True)\n"
        f"    print('checkpoint: {unfinished} (0.1 s)', flush=True)\n"
        "    print('OSError: [Errno 116] Stale file handle', flush=True)\n"
        "    sys.exit(1)\n"
        "print('args', sys.argv[1:], os.environ.get('DFLASH_RESUME_FROM'), flush=True)\n"
    )
    run_dir, done, text = run_program(tmp_path, settings, script)
    assert done.returncode == 0, text
    assert "dflashctl: attempt 2/4, resumed at step 2 after storage" in text
    # run.retry.resume_args on the restart only, and the run's own latest checkpoint
    # that exists (step 4's folder never made it) in the variable of continued runs.
    assert f"args ['--resume'] {saved}" in text
    record = json.loads((run_dir / "attempts.json").read_text())
    assert [(a["attempt"], a.get("category"), a["retried"]) for a in record["attempts"]] == [
        (1, "storage", True),
        (2, None, False),
    ]
    assert (run_dir / "exit_code").read_text() == "0\n"


def run_program(tmp_path, settings, script, **env):
    """Run the supervisor program as the agent would, on a `python -c script` trainer;
    (run dir, the completed process, train.log)."""
    settings = dict(settings, command=[sys.executable, "-c", script])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recovery.json").write_text(json.dumps(settings))
    (run_dir / "supervise.py").write_text(recovery.supervisor_program())
    with open(run_dir / "train.log", "wb") as log:
        done = subprocess.run(
            [sys.executable, "-S", str(run_dir / "supervise.py"), str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={"PATH": os.environ["PATH"], **env},
            timeout=60,
        )
    return run_dir, done, (run_dir / "train.log").read_text()


def test_without_a_checkpoint_of_its_own_a_continued_run_restarts_where_it_started(tmp_path):
    settings = recovery.recovery_settings(_config_with(tmp_path))
    settings["retry"].update(backoff_s=0)
    script = (
        "import os, signal\n"
        "print('from', os.environ.get('DFLASH_RESUME_FROM'), flush=True)\n"
        "if os.environ['DFLASH_ATTEMPT'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    earlier = "/w/runs/earlier/outputs/checkpoints/step-000300"
    _, done, text = run_program(tmp_path, settings, script, DFLASH_RESUME_FROM=earlier)
    assert done.returncode == 0, text
    assert "resuming from checkpoint " + earlier in text
    assert "dflashctl: attempt 2/4, resumed at step 300 after killed" in text
    assert text.count("from " + earlier) == 2  # the variable as the run was given it


def test_a_checkpoint_on_disk_that_the_log_never_named_is_resumed_from(tmp_path):
    """Killed between writing a checkpoint and logging it: the folder is the truth."""
    settings = recovery.recovery_settings(_config_with(tmp_path))
    settings["retry"].update(backoff_s=0)
    folder = tmp_path / "run" / "outputs" / "checkpoints" / "step-000004"
    script = (
        "import os, signal\n"
        "print('from', os.environ.get('DFLASH_RESUME_FROM'), flush=True)\n"
        "if os.environ['DFLASH_ATTEMPT'] == '1':\n"
        "    print('step 6/8 | loss 1.0', flush=True)\n"
        f"    os.makedirs({str(folder)!r})\n"
        f"    open(os.path.join({str(folder)!r}, 'state'), 'w').close()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    run_dir, done, text = run_program(tmp_path, settings, script)
    assert done.returncode == 0, text
    assert "dflashctl: attempt 2/4, resumed at step 4 after killed" in text
    assert f"from {folder}" in text
    first = json.loads((run_dir / "attempts.json").read_text())["attempts"][0]
    assert (first["checkpoint"], first["checkpointed"]) == (str(folder), True)


def test_a_restart_before_any_checkpoint_of_a_finished_runs_successor_says_step_0(tmp_path):
    """The run continues a finished one (a new training from step 0): a restart before
    its first checkpoint starts at step 0 again, and says so, not "step 300"."""
    settings = recovery.recovery_settings(_config_with(tmp_path))
    settings["retry"].update(backoff_s=0)
    script = (
        "import os, signal\n"
        "if os.environ['DFLASH_ATTEMPT'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    earlier = "/w/runs/earlier/outputs/checkpoints/step-000300"
    _, done, text = run_program(
        tmp_path, settings, script, DFLASH_RESUME_FROM=earlier, DFLASH_RESUMED_FINISHED="1"
    )
    assert done.returncode == 0, text
    assert "the run it continues had finished" in text
    assert "dflashctl: attempt 2/4, resumed at step 0 after killed" in text


def _config_with(tmp_path, **extra):
    from dflashctl.config.schema import load_config

    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump({"host": {"address": "local"}, **extra}))
    return load_config(path)


# --------------------------------------------------------------------------- runs on this machine

FLAKY_TRAINER = r"""
import os, signal, sys, time
attempt = int(os.environ["DFLASH_ATTEMPT"])
mode = sys.argv[1]
print(f"trainer attempt {attempt} args {sys.argv[2:]}", flush=True)
if mode == "traceback":
    print("step 1/10 | loss 2.0", flush=True)
    raise ValueError("learning rate must be positive")
if mode == "loop":  # progresses a little each time, then dies like the OOM killer
    print(f"step {attempt * 10}/100 | loss 2.0", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "same-step":
    print("step 5/100 | loss 2.0", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "orphan":  # leaves a worker behind in the run's process group
    if attempt == 1:
        child = os.fork()
        if child == 0:
            time.sleep(120)
            os._exit(0)
        print(f"worker {child}", flush=True)
        print("step 2/4 | loss 2.0", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("training complete", flush=True)
if mode == "wait":  # dies of the SIGTERM `stop` sends (no handler)
    print("step 1/100 | loss 2.0", flush=True)
    time.sleep(60)
if mode == "slow-start":  # a step long ago, killed; attempt 2 starts up until told to go
    run_dir = os.environ["DFLASH_RUN_DIR"]
    if attempt == 1:
        with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
            f.write('{"kind": "start", "step": 0, "time": %f}\n' % (time.time() - 600))
            f.write('{"kind": "step", "step": 3, "total_steps": 6, "time": %f}\n' % (time.time() - 600))
        print("step 3/6 | loss 2.0", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("starting up", flush=True)
    while not os.path.exists(os.path.join(run_dir, "go")):
        time.sleep(0.05)
    print("step 6/6 | loss 1.0", flush=True)
    print("training complete", flush=True)
if mode == "once":
    if attempt == 1:
        print("step 3/6 | loss 2.0", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    print("step 6/6 | loss 1.0", flush=True)
    print("training complete", flush=True)
"""


@pytest.fixture
def flaky(tmp_path):
    """write(mode, **retry) -> dflash.yaml of a project whose trainer fails as `mode` says."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text(FLAKY_TRAINER)
    workdir = tmp_path / "workdir"

    def write(mode, on_exit=None, **retry):
        config = {
            "host": {"address": "local"},
            "container": {"vmid": None, "workdir": str(workdir), "python": sys.executable},
            "trainer": {"source": "src", "entry": "train.py", "args": [mode]},
            "run": {
                "stop_grace_s": 3,
                "on_exit": on_exit,
                "retry": {"backoff_s": 0, **retry},
            },
        }
        path = tmp_path / "dflash.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    yield write
    kill_runs(workdir)


def cli(*args, timeout=120):
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    env.pop("DFLASHCTL_CONFIG", None)
    return subprocess.run(
        [*DFLASHCTL, *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def only_run(path: Path) -> Path:
    runs = list((path.parent / "workdir" / "runs").iterdir())
    assert len(runs) == 1
    return runs[0]


def test_a_crash_a_restart_fixes_is_followed_across_the_restart_and_ends_well(flaky):
    hook = 'echo "$DFLASH_EXIT_CODE $DFLASH_ATTEMPTS" >> "$DFLASH_RUN_DIR/notified"'
    path = flaky("once", on_exit=hook)
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "crash killed" in out  # the first attempt's crash is shown as it happens
    assert "dflashctl: attempt 2/4, resumed at step 0 after killed" in out
    assert "trainer attempt 2 args ['--resume']" in out
    assert "finished (exit code 0) in attempt 2, after recovering from killed" in done.stderr
    run_dir = only_run(path)
    assert (run_dir / "notified").read_text() == "0 2\n"  # on_exit once, at the real end
    runs = cli("runs", "-c", str(path))
    assert "finished (exit 0), attempt 2/4, after recovering from killed" in runs.stdout
    listed = flat(json.loads(cli("runs", "-c", str(path), "--json").stdout))["runs"][0]
    assert [a["exit_code"] for a in listed["attempts"]] == [137, 0]


def test_the_hang_clock_starts_again_with_each_attempt(flaky):
    """Attempt 1's last step is long past; attempt 2 is still starting up (no step
    yet): not a hang, in `status` and `runs`."""
    path = flaky("slow-start")
    launched = cli("deploy", "-c", str(path), "--detach")
    assert launched.returncode == 0, launched.stdout + launched.stderr
    run_dir = only_run(path)
    wait_for(lambda: "starting up" in (run_dir / "train.log").read_text(), 60, "attempt 2")
    status = flat(json.loads(cli("status", "-c", str(path), "--json").stdout))
    run = status["active_run"]
    assert run["status"] == "running" and run["hanging"] is False, status
    listed = flat(json.loads(cli("runs", "-c", str(path), "--json").stdout))["runs"][0]
    assert listed["hanging"] is False and listed["progress"] is None, listed
    (run_dir / "go").write_text("")
    wait_for(lambda: (run_dir / "exit_code").exists(), 60, "the run's end")


def test_a_crash_that_is_not_retryable_ends_the_run_with_the_reason(flaky):
    path = flaky("traceback")
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    reason = "python_exception is not retryable"
    assert (
        f"dflashctl: attempt 1 crashed at step 1 (python_exception, exit code 1); not retried: {reason}"
        in (done.stdout)
    )
    assert f"not retried: {reason}" in done.stderr  # in the closing word too
    assert "ValueError: learning rate must be positive" in done.stderr
    run_dir = only_run(path)
    assert "trainer attempt 2" not in (run_dir / "train.log").read_text()
    assert (run_dir / "exit_code").read_text() == "1\n"
    status = cli("status", "-c", str(path))
    assert "crashed (exit 1, python_exception), not retried: " + reason in status.stdout
    # `runs` keeps its state cell short; the category and the reason are in `runs show`.
    listed = cli("runs", "-c", str(path))
    assert "crashed (exit 1)" in listed.stdout and "not retried" not in listed.stdout
    assert "python_exception" not in listed.stdout
    shown = cli("runs", "show", "-c", str(path))
    assert "crashed (exit 1, python_exception), not retried: " + reason in shown.stdout


def test_a_crash_loop_stops_after_max_restarts(flaky):
    path = flaky("loop", max_restarts=2)
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    log = (only_run(path) / "train.log").read_text()
    assert [line for line in log.splitlines() if line.startswith("trainer attempt")] == [
        "trainer attempt 1 args []",
        "trainer attempt 2 args ['--resume']",
        "trainer attempt 3 args ['--resume']",
    ]
    assert "not retried: 2 restarts within 3600 s already (run.retry.max_restarts 2)" in log
    assert "crashed in attempt 3, after recovering from killed" in done.stderr
    record = json.loads((only_run(path) / "attempts.json").read_text())
    assert [a["retried"] for a in record["attempts"]] == [True, True, False]
    assert [a["step"] for a in record["attempts"]] == [10, 20, 30]


def test_a_crash_repeating_at_the_same_step_is_not_retried(flaky):
    path = flaky("same-step")
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 1
    log = (only_run(path) / "train.log").read_text()
    assert log.count("trainer attempt") == 2
    assert "not retried: it crashed at step 5 again, as attempt 1 did" in log


def test_what_a_crashed_attempt_left_behind_is_killed_before_the_restart(flaky):
    path = flaky("orphan")
    done = cli("deploy", "-c", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    log = (only_run(path) / "train.log").read_text()
    worker = int(log.split("worker ")[1].split()[0])
    assert f"killed 1 process(es) attempt 1 left behind (pid {worker})" in log
    assert log.index("left behind") < log.index("attempt 2/4, resumed")
    assert not pid_alive(worker)


def test_a_run_stopped_while_it_trains_is_not_restarted(flaky):
    path = flaky("wait")
    assert cli("deploy", "-c", str(path), "--detach").returncode == 0
    run_dir = only_run(path)
    wait_for(lambda: "step 1/100" in (run_dir / "train.log").read_text(), what="the trainer")
    assert cli("stop", "-c", str(path)).returncode == 0
    assert (run_dir / "exit_code").read_text() == "143\n"
    record = json.loads((run_dir / "attempts.json").read_text())
    assert [(a["exit_code"], a["reason"]) for a in record["attempts"]] == [(143, "stopped")]
    assert "trainer attempt 2" not in (run_dir / "train.log").read_text()


def test_stop_during_the_wait_ends_the_recovery(flaky):
    hook = 'echo "$DFLASH_EXIT_CODE $DFLASH_ATTEMPTS" >> "$DFLASH_RUN_DIR/notified"'
    path = flaky("loop", on_exit=hook, backoff_s=120)
    assert cli("deploy", "-c", str(path), "--detach").returncode == 0
    run_dir = only_run(path)
    log = run_dir / "train.log"
    wait_for(lambda: "restarting in 120 s" in log.read_text(), timeout=120, what="the wait")
    stopped = cli("stop", "-c", str(path))
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped while waiting to restart" in log.read_text()
    assert "trainer attempt 2" not in log.read_text()
    assert (run_dir / "exit_code").read_text() == "143\n"
    assert (run_dir / "notified").read_text() == "143 1\n"


# --------------------------------------------------------------------------- run.retry in dflash.yaml


def test_run_retry_defaults_and_what_the_supervisor_gets(tmp_path):
    config = _config_with(tmp_path)
    retry = config.run.retry
    assert (retry.max_restarts, retry.categories, retry.backoff_s, retry.window_s) == (
        3,
        None,
        10,
        3600,
    )
    settings = recovery.recovery_settings(config)
    assert settings["retry"]["resume_args"] == ["--resume"]
    by_name = {rule["name"]: rule for rule in settings["rules"]}
    assert by_name["nccl_watchdog_timeout"]["retryable"] is True
    json.dumps(settings)  # it travels as JSON


@pytest.mark.parametrize(
    ("retry", "expected"),
    [
        ({"max_restarts": -1}, "run.retry.max_restarts: must be 0 (off) or more, got -1"),
        ({"backoff_s": -5}, "run.retry.backoff_s: must be 0 or more seconds"),
        ({"categories": ["NCCL timeout"]}, "'NCCL timeout' is not a crash category"),
        ({"retries": 3}, "unknown key run.retry.retries"),
    ],
)
def test_run_retry_mistakes_are_named(tmp_path, retry, expected):
    from dflashctl.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        _config_with(tmp_path, run={"retry": retry})
    assert expected in str(info.value)


def test_logs_of_a_run_waiting_to_restart_say_it_is_running(flaky):
    path = flaky("loop", backoff_s=120)
    assert cli("deploy", "-c", str(path), "--detach").returncode == 0
    log = only_run(path) / "train.log"
    wait_for(lambda: "restarting in 120 s" in log.read_text(), timeout=120, what="the wait")
    shown = cli("logs", "-c", str(path))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "is still running" in shown.stderr
    assert cli("stop", "-c", str(path)).returncode == 0


def test_a_trainer_that_stopped_as_asked_is_recorded_as_stopped_not_crashed(tmp_path):
    """A SIGTERM or Ctrl-C from outside dflashctl: the trainer checkpoints and says so,
    then exits 130 (a second Ctrl-C): not retried, `runs` says stopped at its step."""
    settings = recovery.recovery_settings(_config_with(tmp_path))
    script = (
        "import sys\n"
        "print('step 3/100 | loss 1.0', flush=True)\n"
        "print('received SIGINT: finishing the current step, then writing a checkpoint', flush=True)\n"
        "print('stopped by SIGINT after step 4/100; a redeploy continues from it (checkpoint /o/step-4)', flush=True)\n"
        "sys.exit(130)\n"
    )
    run_dir, done, text = run_program(tmp_path, settings, script)
    record = json.loads((run_dir / "attempts.json").read_text())
    [attempt] = record["attempts"]
    assert (attempt["reason"], attempt["stop"], attempt["retried"]) == (
        "stopped",
        "stopped (checkpoint at step 4)",
        False,
    )
    assert "category" not in attempt and "not retried" not in text
