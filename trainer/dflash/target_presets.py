"""Random-weight targets in fixed shapes, and a target's shape without its weights.

``tiny`` for CPU runs and tests, ``small`` for a GPU smoke run, ``qwen3-8b`` for the
benchmarks (built directly on the device in its dtype: an 8B model in seconds).
"""

from __future__ import annotations

import torch
from torch import nn

from dflash.pipeline.train_config import TargetSection, TrainConfigError
from dflash.target import build_tiny_target, freeze

# Random-weight target shapes (Qwen3Config keyword arguments).
PRESETS = {
    "tiny": None,  # dflash.target.build_tiny_target's defaults
    "small": dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
    ),
}
QWEN3_MASK_ID = 151669  # <|MASK|> in the Qwen3 vocabulary


def build_random_target(
    preset: str, device: torch.device, dtype: torch.dtype, seed: int, init_std: float = 0.02
) -> nn.Module:
    if preset == "tiny":
        return build_tiny_target(seed=seed, dtype=dtype, initializer_range=init_std).to(device)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = PRESETS[preset]
    config = Qwen3Config(tie_word_embeddings=False, initializer_range=init_std, **shape)
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):  # initialise on the device: an 8B model in seconds
            model = Qwen3ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
        torch.random.set_rng_state(state)
    return freeze(model)


def target_shape(target: TargetSection):
    """The target's transformers config without its weights: the preset's shape, or the
    folder's config.json alone (a missing or unreadable one is a config error)."""
    if not target.path:
        if target.preset == "tiny":  # build_tiny_target's shape, built on the meta device
            with torch.device("meta"):
                return build_tiny_target(initializer_range=target.init_std).config
        from transformers import Qwen3Config

        return Qwen3Config(
            tie_word_embeddings=False, initializer_range=target.init_std, **PRESETS[target.preset]
        )
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(target.path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TrainConfigError(
            f"target.path: cannot read the model config in {target.path}: {exc}"
        ) from None
