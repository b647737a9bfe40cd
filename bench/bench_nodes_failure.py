"""How fast `logs -f` across nodes reports a dead rank, with the bundled trainer under
real torchrun as 2 nodes on this machine (two workdirs, `host: local`, gloo on CPU or
one GPU per node), and what it names as the root cause.

Each trial launches `torch.distributed.run --nnodes=2 --node-rank=k` in each node's
workdir (the layout a deploy makes: runs/<id>/train.log, pid, exit_code), with
`debug.fail_in=drafter-0@step:N` on rank 1 only (`--fail-kind sigkill`: the process
killed, as the OOM killer does; `exception`: a Python exception in drafter-0), and
follows both nodes with follow_fleet (the code behind `logs -f`). Latency = when the
report naming node b was printed - when rank 1's first word of its failure (its
"injected SIGKILL ..." line, written just before it dies, or "drafter-0 failed:")
reached the follower. Goal: under 2 s.

    .venv/bin/python bench/bench_nodes_failure.py                       # 1 trial, CPU, sigkill
    .venv/bin/python bench/bench_nodes_failure.py --trials 3 --fail-kind exception
    .venv/bin/python bench/bench_nodes_failure.py --gpu                 # node k on cuda:k
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
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
from dflashctl.follow.fleet import follow_fleet  # noqa: E402
from dflashctl.remote.nodes import node_sessions  # noqa: E402
from tests.test_follow_support import kill_run, launch_argv  # noqa: E402

GOAL_S = 2.0
NODES = ("a", "b")


class Stamped(io.StringIO):
    """A console file that keeps when each line was written."""

    def __init__(self, lines: list[tuple[float, str]]) -> None:
        super().__init__()
        self.lines = lines

    def write(self, text: str) -> int:
        now = time.monotonic()
        self.lines.extend((now, line) for line in text.splitlines())
        return len(text)


def launch(base: Path, run_id: str, port: int, args: argparse.Namespace) -> list[Path]:
    rundirs = []
    for rank, node in enumerate(NODES):
        rundir = base / node / "runs" / run_id
        rundir.mkdir(parents=True)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={rank}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            f"--rdzv-id={run_id}",
            "train_dflash_pipeline.py",
            "--config",
            args.config,
            "--set",
            f"debug.fail_in=drafter-0@step:{args.fail_step}",
            "--set",
            "debug.on_ranks=[1]",
            "--set",
            f"debug.fail_kind={args.fail_kind}",
            "--set",
            f"output_dir={base / node / 'outputs'}",
        ]
        env = f"CUDA_VISIBLE_DEVICES={rank} " if args.gpu else ""
        wrapped = ["sh", "-c", f'cd {ROOT / "trainer"} && exec env {env}"$@"', "sh", *command]
        subprocess.run(launch_argv(str(rundir), wrapped), check=True)
        rundirs.append(rundir)
    return rundirs


def trial(number: int, args: argparse.Namespace) -> dict:
    base = Path(tempfile.mkdtemp(prefix="bench-nodes-"))
    config_path = base / "dflash.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "container": {"python": sys.executable},
                "nodes": [
                    {
                        "name": n,
                        "host": "local",
                        "container": {"vmid": None, "workdir": str(base / n)},
                    }
                    for n in NODES
                ],
            }
        )
    )
    run_id = f"bench-{number}"
    rundirs = launch(base, run_id, 29600 + number, args)
    printed: list[tuple[float, str]] = []
    said: list[tuple[float, str]] = []
    try:
        with node_sessions(load_config(config_path)) as nodes:
            result = follow_fleet(
                nodes,
                run_id,
                rules=load_rules(),
                console=lambda: Console(file=Stamped(printed), width=200),
                notices=lambda: Console(file=Stamped(said), width=200),
            )
    finally:
        for rundir in rundirs:
            kill_run(rundir)
    # Rank 1's first word of its failure: "injected SIGKILL ..." just before it kills
    # itself, or "drafter-0 failed:" before the exception's traceback.
    injected = next(
        (
            t
            for t, line in printed
            if line.startswith("b | [rank1]: ") and ("injected" in line or " failed:" in line)
        ),
        None,
    )
    reported = next((t for t, line in said if line.startswith("✗ node b")), None)
    latency = reported - injected if injected is not None and reported is not None else None
    cause = result.root_cause
    row = {
        "trial": number,
        "fail_kind": args.fail_kind,
        "latency_s": None if latency is None else round(latency, 3),
        "report": next((line for _, line in said if line.startswith("✗ node b")), None),
        "others": [line.strip() for _, line in said if line.startswith("  a: ")][:1],
        "root_cause": cause.describe() if cause else None,
        "consequences": [f.describe() for f in result.consequences],
        "exit_code": result.cli_exit_code,
    }
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--fail-kind", choices=("sigkill", "exception"), default="sigkill")
    parser.add_argument("--fail-step", type=int, default=5)
    parser.add_argument("--config", default="configs/tiny-cpu.yaml")
    parser.add_argument("--gpu", action="store_true", help="node k on GPU k (two GPUs)")
    parser.add_argument("--keep", action="store_true", help="keep the workdirs")
    args = parser.parse_args()
    if args.gpu and args.config == "configs/tiny-cpu.yaml":
        args.config = "configs/gpu-smoke.yaml"
    os.environ.setdefault("NO_COLOR", "1")
    rows = [trial(n, args) for n in range(1, args.trials + 1)]
    for row in rows:
        for key, value in row.items():
            print(f"{key:13} {value}")
        print()
    latencies = [r["latency_s"] for r in rows if r["latency_s"] is not None]
    if latencies:
        worst = max(latencies)
        verdict = "met" if worst < GOAL_S and len(latencies) == len(rows) else "NOT met"
        print(
            f"kill-to-report: worst {worst:.3f} s of {len(rows)} trial(s); goal < {GOAL_S} s {verdict}"
        )
    else:
        print("no latency measured (see the rows above)")


if __name__ == "__main__":
    main()
