"""Shared tiny setup for the drafter tests: a random-weight Qwen3 target and a 2-layer drafter."""

from __future__ import annotations

import pytest
import torch
from dflash import DFlashDrafter, DrafterConfig, build_tiny_target, target_parts

MASK_ID = 511  # reserved: never produced by the tiny tokenizer or used in test prompts
BLOCK = 4


@pytest.fixture(scope="session")
def tiny_target():
    torch.set_num_threads(2)
    return build_tiny_target(seed=0)


@pytest.fixture()
def tiny_cfg(tiny_target) -> DrafterConfig:
    return DrafterConfig.from_target_config(
        tiny_target.config, num_layers=2, block_size=BLOCK, mask_token_id=MASK_ID, gamma=4.0
    )


@pytest.fixture()
def make_drafter(tiny_target, tiny_cfg):
    def make(seed: int = 0, cfg: DrafterConfig | None = None) -> DFlashDrafter:
        torch.manual_seed(seed)
        return DFlashDrafter(cfg or tiny_cfg).bind_target(*target_parts(tiny_target))

    return make
