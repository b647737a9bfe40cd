"""`dflashctl stacks RUN` across every node: each node's ranks answer with their threads
(the trainer's own StackWatch, in a process per rank), each node's run folder holds its
rank's flight recorder dump (torch's pickle format, as tests/test_flight_recorder.py
builds it: the CPU torch's gloo does not dump), and the analysis joins them: which rank
is behind, at which collective, and what its threads are doing, in one report and --json.

Two nodes on this machine (host.address: local, a workdir each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import yaml

from tests.json_answers import flat
from tests.test_flight_recorder import dump, entry

ROOT = Path(__file__).resolve().parents[1]
RUN_ID = "20261204-180000-node"

# One rank: the trainer's StackWatch answers requests; drafter-0 stands in `where`.
RANK = """
import sys, threading, time
sys.path.insert(0, {trainer!r})
from pathlib import Path
from dflash.pipeline.logging import RunLog
from dflash.pipeline.stacks import StackWatch

def {where}():
    threading.Event().wait()

watch = StackWatch(Path({run_dir!r}), {rank}, RunLog(sys.stdout), min_s=600)
watch.start()
for step in range(1, {last_step} + 1):
    watch.step_done(step, 100)
threading.Thread(target={where}, name="drafter-0", daemon=True).start()
print("ready", flush=True)
time.sleep(300)
"""


def start_rank(run_dir: Path, rank: int, last_step: int, where: str) -> subprocess.Popen:
    program = RANK.format(
        trainer=str(ROOT / "trainer"),
        run_dir=str(run_dir),
        rank=rank,
        last_step=last_step,
        where=where,
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(program)],
        env={**os.environ, "DFLASH_RUN_ID": RUN_ID},
        stdout=subprocess.PIPE,
        text=True,
    )
    (run_dir / "pid").write_text(f"{proc.pid}\n")
    return proc


def test_every_node_analysed_together_names_the_rank_behind_and_its_threads(tmp_path):
    nodes = {"gpu-a": (0, 10, "wait_for_gradients"), "gpu-b": (1, 9, "read_shard")}
    config = {
        "host": {"address": "local"},
        "container": {"vmid": None, "python": sys.executable},
        "nodes": [{"name": name, "container": {"workdir": str(tmp_path / name)}} for name in nodes],
        "trainer": {"source": "src", "entry": "train.py"},
    }
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("")
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump(config))
    procs = []
    try:
        for name, (rank, last_step, where) in nodes.items():
            run_dir = tmp_path / name / "runs" / RUN_ID
            (run_dir / "nccl_trace").mkdir(parents=True)
            (tmp_path / name / "active_run").write_text(RUN_ID + "\n")
            # Rank 0 issued all-reduce #11 and waits in it; rank 1 stopped after #10.
            issued = 11 if rank == 0 else 10
            entries = [entry(seq) for seq in range(1, 11)]
            if issued == 11:
                entries.append(entry(11, state="started"))
            (run_dir / "nccl_trace" / f"rank_{rank}").write_bytes(dump(entries))
            procs.append(start_rank(run_dir, rank, last_step, where))
        for proc in procs:  # importing the trainer's modules takes a while under load
            assert proc.stdout.readline().strip() == "ready"
        run = subprocess.run(
            [sys.executable, "-m", "dflashctl", "stacks", RUN_ID, "-c", str(path), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        analysis = json.loads(run.stdout)["analysis"]
        assert analysis["behind"] == [1]
        assert analysis["collective"]["collective_seq_id"] == 11
        assert analysis["collective"]["waiting"] == [0]
        by_rank = {r["rank"]: r for r in analysis["ranks"]}
        assert (by_rank[0]["node"], by_rank[1]["node"]) == ("gpu-a", "gpu-b")
        assert (by_rank[0]["last_step"], by_rank[1]["last_step"]) == (10, 9)
        [said] = analysis["said"]
        assert said.startswith("rank 1 on node gpu-b is behind (never issued collective #11")
        assert "drafter-0 at " in said and "in read_shard" in said
        # One analysis of both nodes' dumps, which neither node's alone can make.
        alone = [n["flight_recorder_summary"] for n in flat(json.loads(run.stdout))["nodes"]]
        assert all("never issued collective #11" not in json.dumps(s) for s in alone)

        shown = subprocess.run(
            [sys.executable, "-m", "dflashctl", "stacks", RUN_ID, "-c", str(path)],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
        )
        text = " ".join(shown.stdout.split())
        assert "every rank together (2 ranks on nodes gpu-a, gpu-b)" in text, text
        assert "rank 1 on node gpu-b is behind" in text
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
