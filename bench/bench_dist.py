"""The trainer on several GPUs: throughput, warm-up, fail-fast and the TLS crash, one call.

    python bench/bench_dist.py                    # every part the machine allows
    python bench/bench_dist.py --part perf        # throughput and warm-up only
    python bench/bench_dist.py --part faults      # crash, SIGTERM, TLS fix off/on only
    python bench/bench_dist.py --steps 20 --out /tmp/dist

perf (qwen3-8b.yaml on GPUs, tiny-cpu.yaml on a CPU-only machine):
  one-gpu      plain ``python``, target + drafter on cuda:0 (today's path)
  torchrun-1   the same under ``torchrun --nproc-per-node 1`` (the torch.distributed path)
  threads-2    one process, a replica on each of 2 GPUs, in-process NCCL averaging
  torchrun-2   ``torchrun --standalone --nproc-per-node 2``: one process per GPU, NCCL
  (with one GPU: torchrun-2 runs both ranks on cuda:0 over gloo, for the warm-up only)
faults (gpu-smoke.yaml, eager unless the case needs CUDA graphs; 2 ranks under torchrun):
  crash-rank1    debug.fail_in=drafter-0@step:3 on rank 1: both ranks end within 30 s,
                 the log names rank, host, thread and device
  sigterm-rank1  SIGTERM to rank 1's pid once training runs: one checkpoint (rank 0's),
                 exit 0 everywhere
  tls-off-rank1  reduce-overhead, debug.tls_fix=false on rank 1: rank 1's drafter-0 dies
                 with the cudagraph_trees AssertionError on cuda:1
  tls-on         the same run with the fix on trains

Each case is a fresh process tree (fresh compile, fresh CUDA graphs). Throughput is the
median of the step windows between the first and the last (see bench_trainer.py).
Writes ``<out>/results.json``, ``<out>/summary.txt`` and ``<out>/dist-logs.tar.gz`` (every
case's log) and prints the summary; ``bench/layout_8gpu.py <out>/results.json`` turns
the measured per-part times into the 8-GPU layout table.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "trainer"
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_trainer import PEAK, READY, STEP  # noqa: E402

ALL_READY = re.compile(r"^warm-up \| (\d+) drafters \| all ready ([\d.]+) s")
TIMING = re.compile(r"^timing \| (.*)$")
PART = re.compile(r"(drafter step|waiting for inputs|grad averaging|target forward) ([\d.]+) ms")
RANK_PID = re.compile(r"^\[rank(\d+)\]: distributed: rank \d+/\d+ on host \S+ \(pid (\d+)\)")
LIMIT_S = 30.0  # a crash or a stop must end every rank within this


class Case:
    """One trainer process tree: its output streamed to a log, timed line by line."""

    def __init__(self, name: str, argv: list[str], out: Path, timeout: float, env=None) -> None:
        self.name, self.argv, self.timeout = name, argv, timeout
        self.log_path = out / f"{name}.log"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.lines: list[tuple[float, str]] = []  # (seconds since start, line)
        self.exit_code: int | str | None = None
        self.wall_s = 0.0
        self.proc: subprocess.Popen | None = None

    def run(self, on_line=None) -> Case:
        started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            cwd=TRAINER,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        lines: queue.Queue = queue.Queue()

        def pump() -> None:
            for line in self.proc.stdout:
                lines.put(line.rstrip("\n"))
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        with open(self.log_path, "w") as log:
            while True:
                left = self.timeout - (time.monotonic() - started)
                try:
                    line = lines.get(timeout=max(0.01, left))
                except queue.Empty:
                    line = ""
                if line is None:
                    break
                if time.monotonic() - started > self.timeout:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.exit_code = "timeout"
                    break
                if line == "":
                    continue
                now = time.monotonic() - started
                self.lines.append((now, line))
                log.write(line + "\n")
                log.flush()
                if on_line is not None:
                    on_line(self, now, line)
        code = self.proc.wait()
        self.exit_code = self.exit_code or code
        self.wall_s = round(time.monotonic() - started, 1)
        return self

    def first(self, predicate) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if predicate(line)), None)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


# ---------------------------------------------------------------- commands


def trainer(config: Path, sets: list[str]) -> list[str]:
    argv = [sys.executable, "train_dflash_pipeline.py", "--config", str(config)]
    for item in sets:
        argv += ["--set", item]
    return argv


def torchrun(nproc: int, config: Path, sets: list[str]) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    launcher += ["--nproc-per-node", str(nproc), "--monitor-interval", "0.5"]
    return launcher + trainer(config, sets)[1:]


def measured(case: Case) -> dict:
    lines = [line for _, line in case.lines]
    windows = [m for m in map(STEP.match, lines) if m]
    steady = windows[1:-1] if len(windows) >= 3 else (windows[1:] or windows)
    mfus = [float(m.group(4).rstrip("%")) for m in steady if m.group(4) != "n/a"]
    parts: dict[str, list[float]] = {}
    timing = [m.group(1) for m in map(TIMING.match, lines) if m]
    for text in timing[1:-1] if len(timing) >= 3 else timing:
        for name, value in PART.findall(text):
            parts.setdefault(name, []).append(float(value))
    ready = [m for m in map(ALL_READY.match, lines) if m]
    return {
        "case": case.name,
        "exit_code": case.exit_code,
        "wall_s": case.wall_s,
        "tokens_per_s": statistics.median(int(m.group(3)) for m in steady) if steady else None,
        "mfu_percent": statistics.median(mfus) if mfus else None,
        "drafters": int(ready[0].group(1)) if ready else None,
        "warmup_all_s": float(ready[0].group(2)) if ready else None,
        "warmup_each_s": [float(m.group(1)) for m in map(READY.search, lines) if m],
        "parts_ms": {k: round(statistics.median(v), 1) for k, v in parts.items()},
        "peak_gib": {m.group(1): float(m.group(2)) for m in map(PEAK.search, lines) if m},
        "first_loss": float(windows[0].group(2)) if windows else None,
        "last_loss": float(windows[-1].group(2)) if windows else None,
    }


# ---------------------------------------------------------------- parts


class Results(list):
    """Results, written to results.json as each case ends: a call cut short keeps them."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def append(self, result: dict) -> None:
        super().append(result)
        self.path.write_text(json.dumps(self, indent=2) + "\n")


def perf(args, gpus: int, out: Path, results: Results) -> None:
    common = [
        f"train.steps={args.steps}",
        f"train.log_every={args.log_every}",
        "eval.enabled=false",
        "train.checkpoint_every=0",
        "train.final_checkpoint=false",
        *args.set,
    ]
    on_gpu = gpus > 0
    one = ["runtime.target_devices=[cuda:0]", "runtime.drafter_devices=[cuda:0]"] if on_gpu else []
    cases = [
        ("one-gpu", trainer(args.config, common + one + ["output_dir=/tmp/bench-dist/one"])),
        ("torchrun-1", torchrun(1, args.config, common + one + ["output_dir=/tmp/bench-dist/tr1"])),
    ]
    if gpus >= 2 or not on_gpu:
        pair = "[cuda:0,cuda:1]" if on_gpu else "[cpu,cpu]"
        cases.append(
            (
                "threads-2",
                trainer(
                    args.config,
                    common
                    + [f"runtime.target_devices={pair}", f"runtime.drafter_devices={pair}"]
                    + ["output_dir=/tmp/bench-dist/threads2"],
                ),
            )
        )
    two = common + one + ["output_dir=/tmp/bench-dist/tr2"]
    if on_gpu and gpus < 2:
        # NCCL refuses two ranks on one GPU; gloo stages 4 GB of gradients through the host
        # (seconds a step): here the case measures the parallel warm-up, and a few steps.
        two += ["runtime.dist_backend=gloo", "train.steps=3", "train.log_every=1"]
    cases.append(("torchrun-2", torchrun(2, args.config, two)))
    if args.bf16:
        cases.append(
            (
                "torchrun-2-bf16",
                torchrun(2, args.config, two + ["runtime.grad_comm_dtype=bfloat16"]),
            )
        )
    if args.split and gpus >= 2:
        split = ["runtime.target_devices=[cuda:0]", "runtime.drafter_devices=[cuda:1]"]
        cases.append(
            ("split", trainer(args.config, common + split + ["output_dir=/tmp/bench-dist/split"]))
        )
    for name, argv in cases:
        result = measured(Case(name, argv, out, args.timeout).run())
        result["shared_gpu"] = name.startswith("torchrun-2") and 0 < gpus < 2
        print(
            f"{name}: exit {result['exit_code']}, {result['wall_s']} s, {result['tokens_per_s']} tok/s",
            flush=True,
        )
        results.append(result)


def faults(args, gpus: int, out: Path, results: Results) -> None:
    on_gpu = gpus > 0
    config = args.smoke_config
    rank1_device = "cuda:1" if gpus >= 2 else ("cuda:0" if on_gpu else "cpu")
    base = ["eval.enabled=false", "train.log_every=2", *args.set]
    if on_gpu:
        base += ["runtime.target_devices=[cuda:0]", "runtime.drafter_devices=[cuda:0]"]
        if gpus < 2:
            base += ["runtime.dist_backend=gloo"]

    # 1. a crash in rank 1
    case = Case(
        "crash-rank1",
        torchrun(
            2,
            config,
            base
            + ["runtime.compile=eager", "train.steps=100000", "output_dir=/tmp/bench-dist/crash"]
            + ["debug.fail_in=drafter-0@step:3", "debug.on_ranks=[1]"],
        ),
        out,
        args.timeout,
    ).run()
    failed = case.first(lambda line: line.startswith("[rank1]: drafter-0 failed:"))
    named = case.first(
        lambda line: (
            line.startswith("[rank1]: training failed (rank 1/2 on host")
            and f"drafter-0 on {rank1_device} failed: InjectedFailure" in line
        )
    )
    rank0 = case.first(
        lambda line: (
            line.startswith("training failed (rank 0/2 on host") and "rank 1 failed" in line
        )
    )
    ended = round(case.wall_s - failed[0], 1) if failed else None
    results.append(
        {
            "case": case.name,
            "exit_code": case.exit_code,
            "wall_s": case.wall_s,
            "ended_after_failure_s": ended,
            "rank1_line": named[1] if named else None,
            "rank0_line": rank0[1] if rank0 else None,
            "ok": bool(failed and named and rank0 and ended is not None and ended < LIMIT_S)
            and case.exit_code not in (0, "timeout"),
        }
    )

    # 2. SIGTERM to rank 1 once training runs
    ckpt_dir = Path("/tmp/bench-dist/sigterm")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    state = {"pids": {}, "sent": None}

    def signal_rank1(case: Case, now: float, line: str) -> None:
        match = RANK_PID.match(line)
        if match:
            state["pids"][int(match.group(1))] = int(match.group(2))
        if state["sent"] is None and line.startswith("step ") and 1 in state["pids"]:
            os.kill(state["pids"][1], signal.SIGTERM)
            state["sent"] = now

    case = Case(
        "sigterm-rank1",
        torchrun(
            2,
            config,
            base + ["runtime.compile=eager", "train.steps=100000", f"output_dir={ckpt_dir}"],
        ),
        out,
        args.timeout,
    ).run(signal_rank1)
    checkpoints = sorted(p.name for p in (ckpt_dir / "checkpoints").glob("step-*"))
    text = case.text()
    ended = round(case.wall_s - state["sent"], 1) if state["sent"] is not None else None
    results.append(
        {
            "case": case.name,
            "exit_code": case.exit_code,
            "wall_s": case.wall_s,
            "ended_after_signal_s": ended,
            "checkpoints": checkpoints,
            "ok": case.exit_code == 0
            and len(checkpoints) == 1
            and "stopped by a SIGTERM to another rank" in text
            and "[rank1]: stopped by SIGTERM after step" in text
            and ended is not None
            and ended < LIMIT_S,
        }
    )

    # 3. the TLS fix off on rank 1, then on (CUDA graphs: GPUs only)
    if on_gpu:
        graphs = base + ["runtime.compile=reduce-overhead", "train.steps=10"]
        case = Case(
            "tls-off-rank1",
            torchrun(
                2,
                config,
                graphs
                + [
                    "debug.tls_fix=false",
                    "debug.on_ranks=[1]",
                    "output_dir=/tmp/bench-dist/tls-off",
                ],
            ),
            out,
            args.timeout,
        ).run()
        text = case.text()
        named = case.first(
            lambda line: (
                line.startswith("[rank1]: training failed (rank 1/2")
                and f"drafter-0 on {rank1_device} failed: AssertionError" in line
            )
        )
        results.append(
            {
                "case": case.name,
                "exit_code": case.exit_code,
                "wall_s": case.wall_s,
                "rank1_line": named[1] if named else None,
                "detector": _classify(case),
                "ok": case.exit_code not in (0, "timeout")
                and "[rank1]: drafter-0 failed:" in text
                and "_is_key_in_tls" in text
                and named is not None,
            }
        )
        case = Case(
            "tls-on",
            torchrun(2, config, graphs + ["output_dir=/tmp/bench-dist/tls-on"]),
            out,
            args.timeout,
        ).run()
        result = measured(case)
        result["ok"] = case.exit_code == 0 and result["last_loss"] is not None
        results.append(result)
    for r in results:
        if "ok" in r:
            print(f"{r['case']}: exit {r['exit_code']}, {r['wall_s']} s, ok {r['ok']}", flush=True)


def _classify(case: Case) -> dict | None:
    """What `dflashctl logs --file` would say about this log (when dflashctl is installed)."""
    try:
        sys.path.insert(0, str(ROOT))
        from dflashctl.crash import classify_text, load_rules
    except Exception:  # noqa: BLE001 - the GPU machine may have only the trainer's deps
        return None
    events = classify_text([line for _, line in case.lines], case.exit_code, load_rules())
    if not events:
        return {}
    first = events[0]
    return {"category": first.category, "thread": first.thread, "device": first.device}


# ---------------------------------------------------------------- report


def summary(results: list[dict]) -> list[str]:
    by = {r["case"]: r for r in results}
    rows = ["| case | exit | wall s | tokens/s | MFU | warm-up (all ready) | per-part ms | note |"]
    rows.append("|---|---|---|---|---|---|---|---|")
    base = (by.get("one-gpu") or {}).get("tokens_per_s")
    # The one-drafter warm-up to compare with: torchrun-1's, which runs after one-gpu and
    # so finds inductor's caches as warm as the 2-drafter cases find theirs (the caches
    # are keyed by device index: threads-2 compiles cuda:1's graphs before torchrun-2).
    single_warm = (by.get("torchrun-1") or by.get("one-gpu") or {}).get("warmup_all_s")
    for r in results:
        note = ""
        tok = r.get("tokens_per_s")
        if r.get("shared_gpu"):
            note = "2 ranks share cuda:0 over gloo: the warm-up is the measurement"
        elif tok and base and r["case"] in ("threads-2", "torchrun-2", "torchrun-2-bf16"):
            note = f"{100 * tok / (2 * base):.1f}% of 2x one-gpu"
        elif tok and base and r["case"] == "torchrun-1":
            note = f"{100 * tok / base:.1f}% of one-gpu"
        if r.get("warmup_all_s") and single_warm and r.get("drafters", 1) > 1:
            note += f"; warm-up {r['warmup_all_s'] / single_warm:.2f}x one drafter's (torchrun-1)"
        for key, what in (
            ("ended_after_failure_s", "failure"),
            ("ended_after_signal_s", "SIGTERM"),
        ):
            if r.get(key) is not None:
                note += f"all ranks ended {r[key]} s after the {what}"
        if "checkpoints" in r:
            note += f", checkpoints {r['checkpoints']}"
        if r.get("rank1_line"):
            note += f"; {r['rank1_line'][:140]}"
        if r.get("detector"):
            note += f"; dflashctl: {r['detector']}"
        if "ok" in r:
            note = ("PASS " if r["ok"] else "FAIL ") + note
        parts = ", ".join(f"{k} {v}" for k, v in (r.get("parts_ms") or {}).items())
        rows.append(
            f"| {r['case']} | {r['exit_code']} | {r['wall_s']} | {_fmt(tok, 0)} | "
            f"{_fmt(r.get('mfu_percent'), 1)} | {_fmt(r.get('warmup_all_s'), 1)} | {parts} | {note} |"
        )
    return rows


def _fmt(value, digits: int) -> str:
    return f"{value:,.{digits}f}" if isinstance(value, (int, float)) else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["all", "perf", "faults"], default="all")
    parser.add_argument("--config", type=Path, default=None, help="perf config (default by device)")
    parser.add_argument("--smoke-config", type=Path, default=None, help="faults config")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=240, help="seconds per case")
    parser.add_argument("--bf16", action="store_true", help="also torchrun-2 with bf16 all-reduce")
    parser.add_argument("--split", action="store_true", help="also target cuda:0 + drafter cuda:1")
    parser.add_argument("--set", action="append", default=[], help="extra override, every case")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    configs = TRAINER / "configs"
    args.config = (
        args.config or configs / ("qwen3-8b.yaml" if gpus else "tiny-cpu.yaml")
    ).resolve()
    args.smoke_config = (
        args.smoke_config or configs / ("gpu-smoke.yaml" if gpus else "tiny-cpu.yaml")
    ).resolve()
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-dist-"))
    logs = out / "dist-logs"
    logs.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}, {gpus} GPU(s); logs under {logs}", flush=True)
    results = Results(out / "results.json")
    if args.part in ("all", "perf"):
        perf(args, gpus, logs, results)
    if args.part in ("all", "faults"):
        faults(args, gpus, logs, results)
    rows = summary(results)
    (out / "summary.txt").write_text("\n".join(rows) + "\n")
    with tarfile.open(out / "dist-logs.tar.gz", "w:gz") as tar:
        tar.add(logs, arcname="dist-logs")
    shutil.rmtree(logs)  # one archive comes back instead of a file per case
    print("\n" + "\n".join(rows))
    print(f"\nresults.json, summary.txt and dist-logs.tar.gz under {out}")
    failed = [r["case"] for r in results if r.get("ok") is False or r["exit_code"] == "timeout"]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
