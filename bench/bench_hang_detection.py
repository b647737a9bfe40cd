"""How soon a deadlocked run is named hanging, by each of the three that watch it:
`logs -f` (the follower, from the times step lines reach it), `status`/`runs` (the
agent, from metrics.jsonl's step times) and the trainer's own watchdog (its stack dump).

Each trial runs the bundled trainer (configs/tiny-cpu.yaml, on CPU) in a workdir with
the layout a deploy makes (`host: local`), with `debug.hang_in=drafter-0@step:N`: the
drafter takes a lock twice and stops for good. Latency = when each watcher named the
hang - when the last step line was written (metrics.jsonl's `time` of the last step
record; the same line in train.log). The baseline, in the same run: the threshold itself
(max(min_s, factor x the run's step interval)), the lag that is designed in; what is
above it is the detection's own overhead. Then a clean run with the same thresholds:
any hang said there is a false alarm.

    .venv/bin/python bench/bench_hang_detection.py                 # run.hang defaults
    .venv/bin/python bench/bench_hang_detection.py --min-s 5 --trials 3
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from rich.console import Console  # noqa: E402

from dflashctl.agent.progress import DEFAULT_FACTOR, DEFAULT_MIN_S  # noqa: E402
from dflashctl.config.schema import load_config  # noqa: E402
from dflashctl.crash import load_rules  # noqa: E402
from dflashctl.follow import follow_run  # noqa: E402
from dflashctl.remote.connect import open_target  # noqa: E402
from dflashctl.runs.records import get_run  # noqa: E402
from dflashctl.ui import terminal  # noqa: E402
from tests.test_follow_support import kill_run, launch_argv  # noqa: E402

GOAL_S = 120.0
QUICK = [
    "--set",
    "data.num_samples=32",
    "--set",
    "eval.num_prompts=1",
    "--set",
    "eval.max_new_tokens=8",
]


class Stamped(io.StringIO):
    def __init__(self, lines: list[tuple[float, str]]) -> None:
        super().__init__()
        self.lines = lines

    def write(self, text: str) -> int:
        now = time.time()
        self.lines.extend((now, line) for line in text.splitlines())
        return len(text)


def setup(base: Path, args: argparse.Namespace) -> Path:
    config = base / "dflash.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": {"address": "local"},
                "container": {"vmid": None, "workdir": str(base), "python": sys.executable},
                "run": {"hang": {"factor": args.factor, "min_s": args.min_s}},
            }
        )
    )
    return config


def launch(
    base: Path, run_id: str, args: argparse.Namespace, hang_at: int | None, steps: int
) -> Path:
    import subprocess

    rundir = base / "runs" / run_id
    rundir.mkdir(parents=True)
    meta = {"run_id": run_id, "hang": {"factor": args.factor, "min_s": args.min_s}}
    (rundir / "meta.json").write_text(json.dumps(meta))
    command = [
        sys.executable, "train_dflash_pipeline.py", "--config", "configs/tiny-cpu.yaml", *QUICK,
        "--set", f"train.steps={steps}", "--set", f"train.log_every={args.log_every}",
        "--set", f"output_dir={rundir / 'outputs'}",
    ]  # fmt: skip
    if hang_at is not None:
        command += ["--set", f"debug.hang_in=drafter-0@step:{hang_at}"]
    env = (
        f"DFLASH_RUN_DIR={rundir} DFLASH_RUN_ID={run_id} DFLASH_HANG_FACTOR={args.factor:g} "
        f"DFLASH_HANG_MIN_S={args.min_s:g}"
    )
    wrapped = ["sh", "-c", f'cd {ROOT / "trainer"} && exec env {env} "$@"', "sh", *command]
    subprocess.run(launch_argv(str(rundir), wrapped), check=True)
    return rundir


def last_step_time(rundir: Path) -> tuple[float | None, float | None]:
    """(time of the last step record, its window's interval) from metrics.jsonl."""
    times = []
    try:
        for line in (rundir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("kind") == "step":
                times.append(record["time"])
    except (OSError, ValueError):
        return None, None
    return (times[-1] if times else None), None


def follow(config_path: Path, run_id: str, said: list, cancel: threading.Event) -> None:
    config = load_config(config_path)
    terminal.err = Console(file=Stamped(said), width=300)
    follow_run(
        lambda: open_target(config),
        config.container.workdir,
        run_id,
        rules=load_rules(),
        python=sys.executable,
        console=Console(file=io.StringIO(), width=300),
        cancel=cancel,
        hang=(config.run.hang.factor, config.run.hang.min_s),
    )


def trial(number: int, args: argparse.Namespace, hang: bool) -> dict:
    base = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    config_path = setup(base, args)
    run_id = f"bench-{number}-{'hang' if hang else 'clean'}"
    rundir = launch(
        base, run_id, args, args.hang_at if hang else None, 400 if hang else args.clean_steps
    )
    said: list[tuple[float, str]] = []
    cancel = threading.Event()
    follower = threading.Thread(
        target=follow, args=(config_path, run_id, said, cancel), daemon=True
    )
    follower.start()
    status_named = None
    status_progress = None
    config = load_config(config_path)
    target = open_target(config)
    try:
        deadline = time.time() + args.patience
        while time.time() < deadline:
            info = get_run(target, str(base), run_id, python=sys.executable)
            if info.state.status != "running":
                break
            if info.hanging and status_named is None:
                status_named, status_progress = time.time(), info.progress
            watchdog = rundir / "stacks" / "rank0.watchdog.json"
            hang_said = any("is hanging" in line for _, line in said)
            if hang and status_named and watchdog.is_file() and hang_said:
                break
            time.sleep(args.poll)
    finally:
        cancel.set()
        follower.join(30)
        kill_run(rundir)
        target.close()
    last, _ = last_step_time(rundir)
    follower_named = next((t for t, line in said if "is hanging" in line), None)
    watchdog_named = None
    watchdog = rundir / "stacks" / "rank0.watchdog.json"
    if watchdog.is_file():
        watchdog_named = json.loads(watchdog.read_text())["time"]

    def since(t):
        return None if t is None or last is None else round(t - last, 2)

    row = {
        "run": run_id,
        "threshold_s": (status_progress or {}).get("threshold_s"),
        "interval_s": (status_progress or {}).get("interval_s"),
        "logs_f_s": since(follower_named),
        "status_s": since(status_named),
        "watchdog_s": since(watchdog_named),
        "hang_reports": sum(1 for _, line in said if "is hanging" in line),
        "watchdog_dumped": watchdog.is_file(),
    }
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--factor", type=float, default=DEFAULT_FACTOR)
    parser.add_argument("--min-s", type=float, default=DEFAULT_MIN_S)
    parser.add_argument("--log-every", type=int, default=2)
    parser.add_argument("--hang-at", type=int, default=9)
    parser.add_argument("--clean-steps", type=int, default=60)
    parser.add_argument("--poll", type=float, default=0.5, help="status polls, seconds apart")
    parser.add_argument("--patience", type=float, default=600)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("NO_COLOR", "1")
    rows = [trial(n, args, hang=True) for n in range(1, args.trials + 1)]
    rows.append(trial(0, args, hang=False))
    for row in rows:
        print("  ".join(f"{k}={v}" for k, v in row.items()))
    hung = [r for r in rows if r["run"].endswith("hang")]
    worst = max((r[k] or 1e9) for r in hung for k in ("logs_f_s", "status_s", "watchdog_s"))
    overhead = max(
        (r[k] or 1e9) - (r["threshold_s"] or 0) for r in hung for k in ("logs_f_s", "status_s")
    )
    clean = rows[-1]
    print(
        f"worst last-step-to-hang {worst:.2f} s (goal < {GOAL_S:g} s: "
        f"{'met' if worst < GOAL_S else 'NOT met'}, {worst / GOAL_S:.2f} of it); worst above "
        f"the threshold {overhead:.2f} s; clean run: {clean['hang_reports']} hang reports, "
        f"watchdog dump: {clean['watchdog_dumped']}"
    )


if __name__ == "__main__":
    main()
