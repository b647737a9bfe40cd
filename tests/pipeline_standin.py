"""A tiny stand-in workload for the pipeline tests: milliseconds per step, deterministic.

Sequences follow t[i+1] = (3 * t[i] + 1) mod V from a random start, so a drafter that
sees the "target" hidden state at an anchor can learn the next token. The anchors of a
sequence depend only on its sample id, so a batch split over two replicas holds the
same anchors as the combined batch (the replica test compares the two).

Run as a script it is the trainer's entry point with this workload, for the
subprocess tests (signals, exit codes):
    python tests/pipeline_standin.py --config x.yaml --set ...
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "trainer") not in sys.path:
    sys.path.insert(0, str(ROOT / "trainer"))

from dflash.pipeline.train_config import TrainConfig  # noqa: E402
from dflash.pipeline.workload import Batch, DrafterInputs, Workload  # noqa: E402

VOCAB = 17
HIDDEN = 12
NUM_SAMPLES = 40


class StandInTarget(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(1234)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layer1 = nn.Linear(HIDDEN, HIDDEN)
        self.layer2 = nn.Linear(HIDDEN, HIDDEN)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h0 = self.embed(input_ids)
        h1 = torch.tanh(self.layer1(h0)) + h0
        h2 = torch.tanh(self.layer2(h1)) + h1
        return torch.cat([h1, h2], dim=-1)  # [B, S, 2H]: "hidden states of 2 layers"


class StandInDrafter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fuse = nn.Linear(2 * HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)


class StandInLoss(nn.Module):
    def __init__(self, drafter: StandInDrafter) -> None:
        super().__init__()
        self.drafter = drafter

    calls = 0

    def forward(self, context, input_ids, anchors, anchor_valid, loss_mask):
        StandInLoss.calls += 1
        stall_at = int(os.environ.get("STANDIN_STALL_AT_CALL", "0"))
        if StandInLoss.calls == stall_at:  # a call that cannot be interrupted (a long compile)
            time.sleep(3600)  # longer than any test waits: an exit that waited for it fails
        picked = torch.gather(context, 1, anchors.unsqueeze(-1).expand(-1, -1, context.shape[-1]))
        logits = self.drafter.head(torch.relu(self.drafter.fuse(picked)))  # [B, A, V]
        labels = torch.gather(input_ids, 1, anchors + 1)
        weights = anchor_valid.float()
        per = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
        loss = (per * weights.flatten()).sum() / weights.sum().clamp(min=1)
        correct = (logits.argmax(-1) == labels).float() * weights
        acc = correct.sum() / weights.sum().clamp(min=1)
        return loss, {"acc": acc, "per_slot_acc": acc.reshape(1)}


class StandInWorkload(Workload):
    def __init__(self, cfg: TrainConfig) -> None:
        super().__init__(cfg)
        gen = torch.Generator().manual_seed(99)
        starts = torch.randint(0, VOCAB, (NUM_SAMPLES,), generator=gen)
        rows = [starts]
        for _ in range(self.seq_len - 1):
            rows.append((3 * rows[-1] + 1) % VOCAB)
        self.samples = torch.stack(rows, dim=1)  # [N, S]
        self.evaluated = 0

    def num_samples(self) -> int:
        return NUM_SAMPLES

    def make_batch(self, sample_ids, generator, step, shard) -> Batch:
        ids = self.samples[sample_ids]
        anchors = torch.stack(
            [
                torch.randint(
                    0,
                    self.seq_len - 1,
                    (self.num_anchors,),
                    generator=torch.Generator().manual_seed(i),
                )
                for i in sample_ids
            ]
        )
        ones = torch.ones_like(ids)
        return Batch(
            step=step,
            shard=shard,
            input_ids=ids,
            attention_mask=ones,
            loss_mask=ones,
            anchors=anchors,
            anchor_valid=torch.ones_like(anchors, dtype=torch.bool),
        )

    def build_target(self, device):
        return StandInTarget().to(device).requires_grad_(False)

    def target_context(self, target, batch):
        return target(batch.input_ids)

    def build_drafter(self, device):
        return StandInDrafter().to(device)

    def loss_module(self, drafter):
        return StandInLoss(drafter)

    def example_inputs(self, device):
        b, s, a = self.batch_size, self.seq_len, self.num_anchors
        return DrafterInputs(
            step=-1,
            shard=-1,
            context=torch.randn(b, s, 2 * HIDDEN).to(device),
            input_ids=torch.zeros(b, s, dtype=torch.long).to(device),
            anchors=torch.zeros(b, a, dtype=torch.long).to(device),
            anchor_valid=torch.ones(b, a, dtype=torch.bool).to(device),
            loss_mask=torch.ones(b, s, dtype=torch.long).to(device),
        )

    def tau_estimate(self, metrics):
        return 1.0 + float(metrics.get("acc", 0.0))

    def evaluate(self, drafter):
        from dflash.spec_decode import EvalResult

        self.evaluated += 1
        return EvalResult(
            tau=1.5, lossless=True, num_tokens=16, tokens_per_target_forward=1.5, num_prompts=1
        )

    def save_drafter(self, drafter, folder: Path) -> None:
        self.export_weights(drafter.state_dict(), folder)

    def export_weights(self, weights, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(weights, folder / "standin.pt")


def standin_config(tmp_path: Path, **sections) -> TrainConfig:
    """A fast config for the stand-in; ``sections`` override keys, e.g. train={"steps": 5}."""
    from dflash.pipeline.train_config import config_from_dict

    data = {
        "output_dir": str(tmp_path / "out"),
        "data": {"seq_len": 12, "batch_size": 4, "num_anchors": 6},
        "drafter": {"block_size": 2},
        "optim": {"lr": 0.05, "warmup_ratio": 0.1},
        "train": {"steps": 30, "log_every": 5},
        "runtime": {"warmup_iters": 1, "queue_size": 2},
        "eval": {"enabled": True},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    return config_from_dict(data)


def run_standin(tmp_path: Path, workload_cls=None, resume: bool = False, **sections):
    """Train the stand-in in process; returns (TrainResult, RunLog)."""
    import io

    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import train

    cfg = standin_config(tmp_path, **sections)
    log = RunLog(io.StringIO())
    result = train(
        cfg, (workload_cls or StandInWorkload)(cfg), log, resume=resume, handle_signals=False
    )
    return result, log


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "trainer"))
    import train_dflash_pipeline

    raise SystemExit(train_dflash_pipeline.main(sys.argv[1:], workload_factory=StandInWorkload))
