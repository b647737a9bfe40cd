"""Targets the recipe was never built on: other transformers families regenerate, train,
evaluate and checkpoint end to end, and a target folder without its tokenizer is a config
error that says what to do.

GPT-NeoX (Pythia's family) names no key/value heads in its config and has a two-matrix
MLP: its runs died in the FLOP count before the first step line (AttributeError)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_regenerate import regenerate_config

TRAINER = Path(__file__).resolve().parents[2] / "trainer"
VOCAB, HIDDEN, LAYERS = 512, 64, 6


def families():
    import transformers as T

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        max_position_embeddings=512,
    )
    return {
        "gpt_neox": lambda: T.GPTNeoXConfig(**common),
        "llama": lambda: T.LlamaConfig(num_key_value_heads=2, **common),
        # sliding-window and soft-capped attention, head_dim not hidden / heads
        "gemma2": lambda: T.Gemma2Config(num_key_value_heads=2, head_dim=32, **common),
    }


def save_target(folder: Path, family: str, *, tokenizer: bool = True) -> Path:
    import torch
    import transformers
    from dflash.data import build_tiny_tokenizer

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(families()[family]())
    with torch.no_grad():  # small weights: repetitive greedy text, learnable in a few steps
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(std=0.03)
    model.save_pretrained(folder)
    if tokenizer:
        build_tiny_tokenizer(VOCAB).save_pretrained(folder)
    return folder


def train(tmp_path: Path, target: Path, *sets: str) -> subprocess.CompletedProcess:
    quick = [
        f"target.path={target}",
        f"output_dir={tmp_path / 'out'}",
        "train.steps=12",
        "train.log_every=4",
        "data.num_samples=24",
        "eval.num_prompts=2",
        "eval.max_new_tokens=8",
        *sets,
    ]
    args = [sys.executable, "train_dflash_pipeline.py", "--config", "configs/tiny-cpu.yaml"]
    for item in quick:
        args += ["--set", item]
    return subprocess.run(args, cwd=TRAINER, capture_output=True, text=True, timeout=300)


def regenerate(folder: Path, target: Path, batch_size: int) -> list[str]:
    """The target's answers to test_regenerate's chat prompts (`python -m dflash.regenerate`)."""
    from dflash.regenerate import main

    folder.mkdir()
    config, output = regenerate_config(folder, target, batch_size=batch_size)
    assert main(["--config", str(config)]) == 0
    return [json.loads(line)["messages"][-1]["content"] for line in output.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_neox", "llama", "gemma2"])
def test_a_target_of_another_family_trains_evaluates_and_checkpoints(tmp_path, family):
    target = save_target(tmp_path / family, family)
    # Regeneration: left-padded batches answer as one prompt at a time does, in this
    # family's attention and positions too.
    batched = regenerate(tmp_path / "batched", target, batch_size=4)
    assert batched == regenerate(tmp_path / "one", target, batch_size=1)
    assert all(answer != "old" for answer in batched)
    run = train(tmp_path, target)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "step 12/12" in out and "mfu" in out  # the FLOP count read this config
    assert "eval | tau" in out and "lossless yes" in out, out
    assert (tmp_path / "out" / "checkpoints" / "step-000012").is_dir()


def test_target_flops_read_configs_without_grouped_query_attention():
    import transformers as T
    from dflash.flops import target_flops

    neox = T.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4)
    llama = T.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4
    )
    attention = 4 * 64 * 64  # q, k, v, o with one key/value head per query head
    matmuls = lambda mlp: 2 * (attention + mlp * 64 * 128) * 3 * 2 * 10  # noqa: E731
    scores = 2 * 3 * 2 * 10 * 10 * 4 * 16
    # GPT-NeoX: up and down; Llama: gate, up and down
    assert target_flops(neox, 3, 2, 10) == matmuls(2) + scores
    assert target_flops(llama, 3, 2, 10) == matmuls(3) + scores


def test_a_target_folder_without_a_tokenizer_is_a_config_error_that_says_what_to_do(
    tmp_path, capsys
):
    target = save_target(tmp_path / "bare", "llama", tokenizer=False)
    run = train(tmp_path, target)
    assert run.returncode == 2, run.stdout + run.stderr
    assert f"config error: target.path: {target} holds no tokenizer" in run.stderr
    assert "copy the target's tokenizer files there" in run.stderr
    assert "name a folder that holds them with data.tokenizer" in run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    # Regeneration says the same, before it reads the target's weights.
    from dflash.regenerate import EXIT_BAD_INPUT, main

    config, _ = regenerate_config(tmp_path, target)
    assert main(["--config", str(config)]) == EXIT_BAD_INPUT
    assert f"error: {target} holds no tokenizer" in capsys.readouterr().err
    # A tokenizer folder that transformers cannot read: its reason, on one line.
    (target / "tokenizer_config.json").write_text("{}")
    broken = train(tmp_path, target)
    assert broken.returncode == 2, broken.stdout + broken.stderr
    assert f"the tokenizer in {target} could not be loaded (" in broken.stderr
    assert "Traceback" not in broken.stdout + broken.stderr
