"""What a fleet of one node costs `logs`: time to the first line of a finished run's log,
through follow_fleet (the code behind `logs` and deploy's following) against follow_run
called directly, on this machine (`host: local`, no container). Both run in the same
process, alternating trial by trial, so the machine's load weighs on both alike.

A fleet of one is followed in the calling thread (no thread, no prefix): its median
should be within a few percent of the direct call's. Two nodes (a thread per node, the
lines prefixed) are timed too, for comparison.

    .venv/bin/python bench/bench_fleet_first_line.py [--trials N] [--lines N]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from rich.console import Console  # noqa: E402

from dflashctl.config.schema import load_config  # noqa: E402
from dflashctl.crash import load_rules  # noqa: E402
from dflashctl.follow import follow_fleet, follow_run  # noqa: E402
from dflashctl.remote.connect import open_target  # noqa: E402
from dflashctl.remote.nodes import node_sessions  # noqa: E402
from tests.test_follow_support import launch_argv, trainer_argv, wait_for  # noqa: E402

RUN = "bench-first-line"


class FirstLine(io.StringIO):
    """A console's file that notes when the first step line reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.at: float | None = None

    def write(self, text: str) -> int:
        if self.at is None and "step " in text:
            self.at = time.perf_counter()
        return super().write(text)


def finished_run(workdir: Path, lines: int) -> None:
    rundir = workdir / "runs" / RUN
    subprocess.run(launch_argv(str(rundir), trainer_argv(sys.executable, lines, 0.0)), check=True)
    wait_for(lambda: (rundir / "exit_code").exists(), 120, "the run's end")


def config_for(root: Path, names: str) -> Path:
    nodes = [
        {"name": name, "host": "local", "container": {"vmid": None, "workdir": str(root / name)}}
        for name in names
    ]
    path = root / f"dflash-{names}.yaml"
    path.write_text(yaml.safe_dump({"container": {"python": sys.executable}, "nodes": nodes}))
    return path


def time_fleet(path: Path, rules) -> float:
    sink = FirstLine()
    console = Console(file=sink, width=200)
    quiet = Console(file=io.StringIO())  # the nodes' "finished; following the others"
    with node_sessions(load_config(path)) as nodes:
        started = time.perf_counter()
        follow_fleet(
            nodes, RUN, rules=rules, follow=False, console=lambda: console, notices=lambda: quiet
        )
    assert sink.at is not None, sink.getvalue()
    return sink.at - started


def time_direct(path: Path, rules) -> float:
    sink = FirstLine()
    config = load_config(path)
    with node_sessions(config) as nodes:
        node = nodes[0]
        started = time.perf_counter()
        # What `logs` called for one node before the fleet follower.
        follow_run(
            lambda: open_target(config),
            config.container.workdir,
            RUN,
            rules=rules,
            target=node.target,
            python=config.container.python,
            follow=False,
            console=Console(file=sink, width=200),
            hang=(config.run.hang.factor, config.run.hang.min_s),
        )
    assert sink.at is not None, sink.getvalue()
    return sink.at - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--lines", type=int, default=200)
    args = parser.parse_args()
    rules = load_rules()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name in "ab":
            finished_run(root / name, args.lines)
        one, two = config_for(root, "a"), config_for(root, "ab")
        times: dict[str, list[float]] = {"direct": [], "fleet of 1": [], "fleet of 2": []}
        time_direct(one, rules)  # imports and the page cache, out of the count
        for _ in range(args.trials):
            times["direct"].append(time_direct(one, rules))
            times["fleet of 1"].append(time_fleet(one, rules))
            times["fleet of 2"].append(time_fleet(two, rules))
    base = statistics.median(times["direct"])
    print(f"time to the first line, median of {args.trials} trials ({args.lines}-line log)")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<11} {median * 1000:7.1f} ms   {median / base:5.2f}x direct")


if __name__ == "__main__":
    main()
