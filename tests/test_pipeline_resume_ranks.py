"""Under torchrun, rank 0's resume decision is every rank's: the real trainer (tiny Qwen3
target) as two gloo ranks, each with its own run dir, as on two hosts. Where a rank must
not see rank 0's checkpoint (storage not shared), it runs in its own mount namespace
with the first run's folder covered by an empty tmpfs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.test_pipeline_distributed import exit_times, free_port

TRAINER = Path(__file__).resolve().parents[1] / "trainer"
STEPS, STOP_AT = 10, 6
QUICK = [
    *("--set", f"train.steps={STEPS}", "--set", "train.log_every=2"),
    *("--set", "train.checkpoint_every=3", "--set", "data.num_samples=32"),
    *("--set", "eval.enabled=false", "--set", "runtime.threads=1"),
]


def can_hide_folders() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return probe.returncode == 0


pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not built in"
)
needs_mount_namespaces = pytest.mark.skipif(
    not can_hide_folders(), reason="needs `unshare -m` (mount namespaces) to hide a folder"
)


def trainer_command() -> list[str]:
    return [sys.executable, "train_dflash_pipeline.py", "--config", "configs/tiny-cpu.yaml"]


def start_ranks(
    rank_envs: list[dict[str, str]], *args: str, hidden: Path | None = None
) -> list[subprocess.Popen]:
    """Two ranks with torchrun's environment; ``hidden`` is covered by an empty tmpfs for
    rank 1 (its host does not have that folder)."""
    port = free_port()
    procs = []
    for rank, own in enumerate(rank_envs):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")},
            "PYTHONUNBUFFERED": "1",
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **own,
        }
        command = [*trainer_command(), *QUICK, *args]
        if rank == 1 and hidden is not None:
            mount = f"mount -t tmpfs none '{hidden}' && exec \"$@\""
            command = ["unshare", "-m", "sh", "-c", mount, "sh", *command]
        procs.append(
            subprocess.Popen(
                command,
                cwd=TRAINER,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def final_state(run_dir: Path) -> dict:
    folder = run_dir / "outputs" / "checkpoints" / f"step-{STEPS:06d}"
    return torch.load(folder / "training_state.pt", weights_only=False)


def assert_same_tensors(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_tensors(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tensors(x, y, f"{where}[{i}]")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> Path:
    """One process, stopped after step 6 (as by SIGTERM): checkpoints at steps 3 and 6."""
    run_dir = tmp_path_factory.mktemp("first")
    env = {**os.environ, "DFLASH_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DFLASH_RESUME_FROM"):
        env.pop(key, None)
    command = [*trainer_command(), *QUICK, "--set", f"debug.stop_at_step={STOP_AT}"]
    run = subprocess.run(command, cwd=TRAINER, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr
    return run_dir


@needs_mount_namespaces
def test_a_rank_without_the_checkpoint_gets_rank_0s_state_and_ends_bit_identical(
    first_run, tmp_path
):
    checkpoints = first_run / "outputs" / "checkpoints"
    step6, step3 = checkpoints / f"step-{STOP_AT:06d}", checkpoints / "step-000003"
    lead = {"DFLASH_RESUME_FROM": str(step6), "DFLASH_RESUMED_RUN": "first"}

    # Not shared: rank 1 has no DFLASH_RESUME_FROM, and the first run's folder is empty there.
    alone = [tmp_path / "alone-0", tmp_path / "alone-1"]
    procs = start_ranks(
        [{**lead, "DFLASH_RUN_DIR": str(alone[0])}, {"DFLASH_RUN_DIR": str(alone[1])}],
        hidden=first_run,
    )
    (code0, text0, _), (code1, text1, _) = exit_times(procs, timeout=240)
    assert (code0, code1) == (0, 0), text0 + text1
    assert f"resuming run first at step {STOP_AT} from {step6}\n" in text0
    assert f"[rank1]: resuming run first at step {STOP_AT} from {step6} (from rank 0)" in text1
    assert f"step {STOP_AT + 2}/{STEPS}" in text0 and f"step {STOP_AT}/" not in text0
    assert not (alone[1] / "outputs" / "checkpoints").exists()  # only rank 0 writes

    # Shared: rank 1 reads the same folder itself, though its own setting names step 3.
    shared = [tmp_path / "shared-0", tmp_path / "shared-1"]
    procs = start_ranks(
        [
            {**lead, "DFLASH_RUN_DIR": str(shared[0])},
            {"DFLASH_RESUME_FROM": str(step3), "DFLASH_RUN_DIR": str(shared[1])},
        ]
    )
    (code0, text0, _), (code1, text1, _) = exit_times(procs, timeout=240)
    assert (code0, code1) == (0, 0), text0 + text1
    assert f"resume: rank 0 resumes from {step6}; this rank's own {step3} is not used" in text1
    assert f"from {step6} (rank 0's choice, read here)" in text1

    received, read_here = final_state(alone[0]), final_state(shared[0])
    assert received["step"] == read_here["step"] == STEPS
    assert_same_tensors(received["model"], read_here["model"], "model")
    assert_same_tensors(received["optimizer"], read_here["optimizer"], "optimizer")
    started = torch.load(step6 / "training_state.pt", weights_only=False)["model"]
    assert any(not torch.equal(started[k], v) for k, v in received["model"].items())


@needs_mount_namespaces
def test_a_checkpoint_that_does_not_fit_rank_0_ends_every_rank_with_exit_2_at_once(
    first_run, tmp_path
):
    step6 = first_run / "outputs" / "checkpoints" / f"step-{STOP_AT:06d}"
    procs = start_ranks(
        [
            {"DFLASH_RESUME_FROM": str(step6), "DFLASH_RUN_DIR": str(tmp_path / "r0")},
            {"DFLASH_RUN_DIR": str(tmp_path / "r1")},
        ],
        "--set",
        "drafter.num_layers=3",
        hidden=first_run,
    )
    (code0, text0, ended0), (code1, text1, ended1) = exit_times(procs, timeout=120)
    assert (code0, code1) == (2, 2), text0 + text1
    assert "config error: the checkpoint" in text0 and "drafter.num_layers=2" in text0
    assert "config error: rank 0 refused its checkpoint, so no rank resumes:" in text1
    assert "drafter.num_layers=2" in text1
    assert abs(ended1 - ended0) < 15  # promptly, not after a store or collective timeout
    assert "step 1/" not in text0 + text1


def test_the_fingerprint_tells_another_checkpoint_at_the_same_path_from_rank_0s(tmp_path):
    from dflash.pipeline import checkpointing as ckpt
    from dflash.pipeline.resume import fingerprint

    def write(value: float) -> str:
        state = ckpt.TrainingState(
            step=3, model={"w": torch.full((64,), value)}, optimizer={}, config={}, rng={}
        )
        return fingerprint(ckpt.save_checkpoint(tmp_path, state))

    first = write(1.0)
    assert write(1.0) == first  # the same content written again: rank 0's checkpoint
    assert write(2.0) != first  # same path, same size, other weights: not rank 0's
