"""The trainer as several processes on gloo (loopback): the same weights as one process,
exact resume across ranks, one coordinated checkpoint on SIGTERM, fail-fast on a crash or
a killed rank. The ranks are real processes of the real entry point (the stand-in
workload); torchrun starts them where its own supervision does not hide ours, otherwise
they get torchrun's environment by hand (as on separate hosts, where one host's agent
cannot see the other's ranks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.pipeline_standin import run_standin

ROOT = Path(__file__).resolve().parents[1]
ENTRY = ROOT / "tests" / "pipeline_standin.py"
STEPS = 8

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built in"
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_config(tmp_path: Path, out: Path, **extra: str) -> Path:
    """Batch 2 per rank: two ranks see the same 4 sequences per step as one process at 4."""
    config = tmp_path / "standin.yaml"
    lines = [
        f"output_dir: {out}",
        "data: {seq_len: 12, batch_size: 2, num_anchors: 6}",
        "drafter: {block_size: 2}",
        "optim: {lr: 0.05, warmup_ratio: 0.1}",
        f"train: {{steps: {extra.pop('steps', STEPS)}, log_every: 2}}",
        "runtime: {warmup_iters: 1, queue_size: 2, threads: 1"
        + "".join(f", {k}: {v}" for k, v in extra.pop("runtime", {}).items())
        + "}",
    ]
    lines += [f"{key}: {value}" for key, value in extra.items()]
    config.write_text("\n".join(lines) + "\n")
    return config


def start_ranks(config: Path, *args: str, world: int = 2) -> list[subprocess.Popen]:
    """``world`` processes with torchrun's environment; rank 0 hosts the store."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ENTRY), "--config", str(config), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def wait_for_line(proc: subprocess.Popen, prefix: str, seen: list[str]) -> None:
    """Read ``proc``'s output until a line starting with ``prefix`` (kept in ``seen``)."""
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return
    raise AssertionError(f"no line starting with {prefix!r}:\n{''.join(seen)}")


def finish(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[int, str]]:
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=timeout)
        out.append((proc.returncode, text))
    return out


def exit_times(procs: list[subprocess.Popen], timeout: float = 90) -> list[tuple[int, str, float]]:
    """(exit code, output, monotonic time of the exit) per process; output drained meanwhile."""
    outputs: list[list[str]] = [[] for _ in procs]

    def drain(proc: subprocess.Popen, sink: list[str]) -> None:
        sink.extend(proc.stdout)

    readers = [
        threading.Thread(target=drain, args=(p, out), daemon=True)
        for p, out in zip(procs, outputs, strict=True)
    ]
    for reader in readers:
        reader.start()
    ended: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(ended) < len(procs) and time.monotonic() < deadline:
        for i, proc in enumerate(procs):
            if i not in ended and proc.poll() is not None:
                ended[i] = time.monotonic()
        time.sleep(0.05)
    for reader in readers:
        reader.join(timeout=10)
    assert len(ended) == len(procs), "a rank did not exit"
    return [
        (p.returncode, "".join(out), ended[i])
        for i, (p, out) in enumerate(zip(procs, outputs, strict=True))
    ]


def trained_weights(out: Path) -> dict[str, torch.Tensor]:
    latest = (out / "checkpoints" / "latest").read_text().strip()
    state = torch.load(out / "checkpoints" / latest / "training_state.pt", weights_only=False)
    return state["model"]


def test_two_ranks_train_the_weights_of_one_process_that_saw_both_batches(tmp_path):
    """torchrun, 2 ranks x 2 sequences = 1 process x 4 sequences (within 1e-6) = 2 replica
    threads in one process (bitwise); a run stopped at step 4 and resumed on 2 ranks ends
    with the same weights as the uninterrupted one (bitwise)."""
    out = tmp_path / "torchrun"
    config = write_config(tmp_path, out)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(ENTRY), "--config", str(config)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "distributed: rank 1/2" in run.stdout and "gloo" in run.stdout
    # Past the barrier after the rendezvous, local rank 0 says so once (deploy --detach's
    # start line): rank 1 on the same node does not.
    assert run.stdout.count("rendezvous: every rank joined (2 ranks)") == 1, run.stdout
    two_ranks = trained_weights(out)

    steps = {"steps": STEPS, "log_every": 2}
    one, _ = run_standin(tmp_path / "one", data={"batch_size": 4}, train=steps)
    threads, _ = run_standin(
        tmp_path / "threads",
        runtime={"drafter_devices": ["cpu", "cpu"]},
        data={"batch_size": 2},
        train=steps,
    )
    assert one.exit_code == threads.exit_code == 0
    moved = 0.0
    for name, value in two_ranks.items():
        single = dict(one.replicas[0].model.named_parameters())[name].detach()
        paired = dict(threads.replicas[0].model.named_parameters())[name].detach()
        assert (value - single).abs().max().item() <= 1e-6, name
        assert torch.equal(value, paired), name
    initial = run_standin(tmp_path / "zero", train={"steps": 1}, optim={"lr": 0.0})[0]
    for name, value in initial.replicas[0].model.named_parameters():
        moved = max(moved, (value.detach() - two_ranks[name]).abs().max().item())
    assert moved > 1e-2  # trained weights are compared, not the initial ones

    # bf16 gradients on the wire, in buckets of a few hundred bytes (several per step).
    bf16_out = tmp_path / "bf16"
    bf16 = finish(
        start_ranks(
            write_config(
                tmp_path,
                bf16_out,
                runtime={"grad_comm_dtype": "bfloat16", "grad_bucket_mb": 0.0005},
            )
        )
    )
    assert [code for code, _ in bf16] == [0, 0], bf16
    assert "bfloat16, torch.distributed, 2 ranks" in bf16[0][1]
    for name, value in trained_weights(bf16_out).items():
        torch.testing.assert_close(value, two_ranks[name], rtol=0, atol=5e-2)

    resumed_out = tmp_path / "resumed"
    stopped = finish(
        start_ranks(write_config(tmp_path, resumed_out), "--set", "debug.stop_at_step=4")
    )
    assert [code for code, _ in stopped] == [0, 0], stopped
    assert "stopped by SIGTERM after step 4/8" in stopped[0][1]
    assert sorted(p.name for p in (resumed_out / "checkpoints").glob("step-*")) == ["step-000004"]
    resumed = finish(start_ranks(write_config(tmp_path, resumed_out), "--resume"))
    assert [code for code, _ in resumed] == [0, 0], resumed
    assert "resume: continuing from" in resumed[0][1] and "(step 4)" in resumed[1][1]
    for name, value in trained_weights(resumed_out).items():
        assert torch.equal(value, two_ranks[name]), name


def test_buckets_cover_every_gradient_in_order():
    from dflash.pipeline.replicas import DistributedAverager

    averager = DistributedAverager(2, lambda: False, torch.bfloat16, bucket_mb=1)
    averager.bucket_bytes = 100  # 50 bf16 values
    grads = [torch.zeros(n) for n in (30, 30, 10, 200, 5)]
    assert averager._plan(grads) == [(0, 2), (2, 4), (4, 5)]


def test_each_local_rank_takes_its_own_group_of_gpus():
    from dflash.pipeline.distributed import DistInfo, shift_devices

    rank = lambda r: DistInfo(rank=r, world_size=4, local_rank=r, local_world_size=4)  # noqa: E731
    assert shift_devices(["cuda:0"], rank(3), 8) == ["cuda:3"]
    assert shift_devices(["cuda:0", "cuda:1"], rank(2), 8) == ["cuda:4", "cuda:5"]
    assert shift_devices(["cuda:0"], rank(1), 1) == ["cuda:0"]  # one GPU: the ranks share it
    assert shift_devices(["cpu"], rank(3), 0) == ["cpu"]
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    info = DistInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.enabled) == (5, 8, 1, True)
    assert not DistInfo.from_env({}).enabled


def test_sigterm_to_one_rank_gives_one_checkpoint_and_exit_0_everywhere(tmp_path):
    out = tmp_path / "out"
    procs = start_ranks(write_config(tmp_path, out, steps=100000))
    seen: list[str] = []
    wait_for_line(procs[0], "step ", seen)
    procs[1].send_signal(signal.SIGTERM)
    (code0, text0), (code1, text1) = finish(procs)
    text0 = "".join(seen) + text0
    assert (code0, code1) == (0, 0), text0 + text1
    assert "received SIGTERM" in text1
    assert "stopped by a SIGTERM to another rank after step" in text0
    checkpoints = list((out / "checkpoints").glob("step-*"))
    assert len(checkpoints) == 1 and "checkpoint: " in text0 and "checkpoint: " not in text1
    stopped_at = int(checkpoints[0].name.split("-")[1])
    assert f"stopped by SIGTERM after step {stopped_at}/" in text1  # the same step everywhere


def test_a_crash_in_rank_1_ends_both_ranks_naming_rank_host_thread_and_device(tmp_path):
    config = write_config(tmp_path, tmp_path / "out", steps=100000)
    procs = start_ranks(
        config, "--set", "debug.fail_in=drafter-0@step:3", "--set", "debug.on_ranks=[1]"
    )
    # 100000 steps: rank 0 ends only because rank 1 failed (else far past the net).
    (code0, text0, _), (code1, text1, _) = exit_times(procs, timeout=300)
    assert (code0, code1) == (1, 1), text0 + text1
    host = socket.gethostname()
    assert "[rank1]: drafter-0 failed:" in text1  # the crash detector's header, torch's prefix
    assert f"training failed (rank 1/2 on host {host}" in text1
    assert (
        "drafter-0 on cpu failed: InjectedFailure: injected failure in drafter-0 at step 3" in text1
    )
    # Rank 0 names the rank, host, thread, device and exception that ended it.
    assert f"rank 1 failed: rank 1/2 on host {host}" in text0
    assert "drafter-0 on cpu failed: InjectedFailure" in text0
    assert "InjectedFailure" not in text0.split("rank 1 failed")[0]  # rank 0 itself was fine


def test_a_killed_rank_ends_the_other_naming_it(tmp_path):
    config = write_config(tmp_path, tmp_path / "out", steps=100000, runtime={"peer_timeout_s": 5})
    procs = start_ranks(config)
    seen: list[str] = []
    wait_for_line(procs[0], "step ", seen)
    procs[1].send_signal(signal.SIGKILL)  # as the OOM killer would: no chance to say why
    # 100000 steps: rank 0 ends only because it noticed rank 1 was gone.
    (code0, text0), _ = finish(procs, timeout=300)
    assert code0 == 1
    text0 = "".join(seen) + text0
    # gloo fails at once ("Connection reset by peer"); the heartbeat then names the rank.
    host = socket.gethostname()
    assert f"rank 1 on host {host} stopped answering: no heartbeat for" in text0, text0[-3000:]
    assert f"training failed (rank 0/2 on host {host}" in text0


def test_two_ranks_take_a_budget_check_at_the_same_step(tmp_path):
    """train.budget_minutes on two ranks: rank 0 times the steps and publishes the new
    count through the store; both ranks train exactly that many steps, in step."""
    out = tmp_path / "out"
    config = write_config(tmp_path, out, steps=STEPS)
    # 6 s (the stand-in's steps take milliseconds): the probe's count is in the thousands,
    # so the check is planned even where a busy machine's set-up ate part of the budget.
    config.write_text(config.read_text().replace(f"steps: {STEPS},", "budget_minutes: 0.1,"))
    results = finish(start_ranks(config), timeout=120)
    assert [code for code, _ in results] == [0, 0], "\n".join(text for _, text in results)
    lead = results[0][1]
    resized = [x for x in lead.splitlines() if "train.budget_minutes: steps " in x]
    assert len(resized) == 1, lead
    new_total = int(resized[0].split(" -> ")[1].split(":")[0])
    assert (out / "checkpoints" / "latest").read_text().strip().endswith(f"{new_total:06d}")
    for _, text in results:
        assert f"step {new_total}/{new_total}" in text or "training complete" in text, text
