"""How long `dflashctl deploy --detach` takes for 1 node and for 2 nodes, on this
machine (`host: local`, one workdir per node, the fake trainer of the tests; with 2
nodes it runs under torchrun, gloo on CPU).

Three cases per node count, each the whole CLI process (Python start-up included):

  first deploy         empty workdirs, nothing remembered here: every file travels
  one-file redeploy    one file changed; the old run stopped, a new one launched
  no-change redeploy   nothing changed: the current release launched again

Printed: the medians, and the 2-node / 1-node ratio of each case (measured in the
same run, so the ratio, not the seconds, is what compares across machines).

With --start-gate: what the start gate of a detached deploy costs (dflashctl/README.md,
"Detached: the start gate"): each case with the wait off (run.start_timeout_s: 0, the
deploy says "launched" at once) and on (run.start_line: the fake trainer's first line,
which under torchrun comes once every node's agent is past the rendezvous), measured
in the same run, and the seconds the wait adds.

    .venv/bin/python bench/bench_deploy_nodes.py [--runs N] [--start-gate]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from tests.test_deploy_support import kill_runs, write_trainer  # noqa: E402

ARGS = ["--sleep", "600", "--on-term", "checkpoint"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(root: Path, count: int, gate: bool = False) -> Path:
    config = {
        "host": {"address": "local"},
        "container": {
            "vmid": None,
            "python": sys.executable,
            "workdir": str(root / "node-0"),
        },
        "trainer": {"source": "src", "entry": "train.py", "args": ARGS},
        "run": {"stop_grace_s": 5, "start_timeout_s": 0},
    }
    if gate:
        config["run"].update(start_line="^hello from the trainer", start_timeout_s=120)
    if count > 1:
        config["torchrun"] = {"nproc_per_node": 1, "address": "127.0.0.1", "port": free_port()}
        config["nodes"] = [
            {"name": f"n{i}", "container": {"workdir": str(root / f"node-{i}")}}
            for i in range(count)
        ]
    path = root / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def deploy(config: Path, cache: Path) -> tuple[float, dict]:
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "dflashctl", "deploy", "-c", str(config), "--detach", "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"deploy failed ({result.returncode}):\n{result.stderr}")
    return elapsed, json.loads(result.stdout)


def wipe(root: Path, count: int, cache: Path) -> None:
    for i in range(count):
        workdir = root / f"node-{i}"
        if workdir.exists():
            kill_runs(workdir)
            shutil.rmtree(workdir)
    shutil.rmtree(cache, ignore_errors=True)


def measure(count: int, runs: int, gate: bool = False) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix=f"bench-deploy-{count}n-") as tmp:
        root = Path(tmp)
        source = write_trainer(root / "src", extra_files=28)
        shutil.rmtree(source / "__pycache__")
        config, cache = write_config(root, count, gate), root / "cache"
        first, one_file, no_change = [], [], []
        try:
            for i in range(runs):
                wipe(root, count, cache)
                first.append(deploy(config, cache)[0])
                (source / "helpers.py").write_text(
                    f"def greeting():\n    return 'hello from the trainer, edit {i}'\n"
                )
                one_file.append(deploy(config, cache)[0])
                no_change.append(deploy(config, cache)[0])
        finally:
            wipe(root, count, cache)
    return {
        "first": statistics.median(first),
        "one_file": statistics.median(one_file),
        "no_change": statistics.median(no_change),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="deploys timed per case")
    parser.add_argument("--start-gate", action="store_true", help="the wait off and on")
    args = parser.parse_args()
    if args.start_gate:
        return start_gate(args.runs)
    one, two = measure(1, args.runs), measure(2, args.runs)
    print(f"{args.runs} runs per case (medians)      1 node    2 nodes   2/1")
    for case in ("first", "one_file", "no_change"):
        print(f"  {case:<28} {one[case]:7.2f} s {two[case]:7.2f} s {two[case] / one[case]:5.2f}x")
    print(
        json.dumps(
            {
                "bench": "deploy_nodes",
                "one_node": {k: round(v, 3) for k, v in one.items()},
                "two_nodes": {k: round(v, 3) for k, v in two.items()},
            }
        )
    )
    return 0


def start_gate(runs: int) -> int:
    found: dict[str, dict[str, float]] = {}
    print(f"{runs} runs per case (medians)      wait off  wait on   extra")
    for count in (1, 2):
        off, on = measure(count, runs, gate=False), measure(count, runs, gate=True)
        for case in ("first", "one_file", "no_change"):
            extra = on[case] - off[case]
            found[f"{count}n_{case}"] = {"off": off[case], "on": on[case], "extra": extra}
            label = f"{count} node{'s' if count > 1 else ''}, {case}"
            print(f"  {label:<28} {off[case]:7.2f} s {on[case]:7.2f} s {extra:+6.2f} s")
    rounded = {k: {n: round(v, 3) for n, v in d.items()} for k, d in found.items()}
    print(json.dumps({"bench": "deploy_start_gate", "cases": rounded}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
