"""Checkpoints: the published layout, and an identical drafter after a round trip."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.checkpoint import load_drafter, save_drafter
from dflash.config import DrafterConfig
from dflash.objective import drafter_block_hidden
from dflash.target import target_context, target_parts
from safetensors import safe_open


def test_round_trip_gives_identical_logits(tmp_path, tiny_target, make_drafter, tiny_cfg):
    drafter = make_drafter(seed=6)
    with torch.no_grad():  # make every weight differ from its initial value
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    save_drafter(drafter, tmp_path / "ckpt", metadata={"step": 12})
    loaded = load_drafter(tmp_path / "ckpt").bind_target(*target_parts(tiny_target))
    assert loaded.cfg == drafter.cfg

    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(0))
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    anchors, valid = torch.tensor([[4, 11, 20]]), torch.ones(1, 3, dtype=torch.bool)
    with torch.no_grad():
        before = drafter.logits(drafter_block_hidden(drafter, context, ids, anchors, valid))
        after = loaded.logits(drafter_block_hidden(loaded, context, ids, anchors, valid))
    assert torch.equal(before, after)


def test_layout_matches_published_drafters(tmp_path, make_drafter, tiny_cfg):
    save_drafter(make_drafter(), tmp_path, dtype=torch.bfloat16, metadata={"step": 3})
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["model_type"] == "qwen3"
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"]["mask_token_id"] == tiny_cfg.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    assert config["num_hidden_layers"] == 2 and config["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.metadata()["step"] == "3"
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert "layers.1.self_attn.k_norm.weight" in keys and "layers.0.mlp.gate_proj.weight" in keys
    assert not any("embed" in k or "lm_head" in k for k in keys)  # the target's, never saved


def test_reads_a_published_config():
    published = {  # the shape of z-lab's Qwen3-8B drafter config.json
        "architectures": ["DFlashDraftModel"],
        "block_size": 16,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
        "head_dim": 128,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_attention_heads": 32,
        "num_hidden_layers": 5,
        "num_key_value_heads": 8,
        "num_target_layers": 36,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "vocab_size": 151936,
    }
    cfg = DrafterConfig.from_hf_dict(published)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.block_size == 16 and cfg.gamma == 7.0
    assert DrafterConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


def test_mismatched_weights_are_refused(tmp_path, make_drafter, tiny_cfg):
    save_drafter(make_drafter(), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(tmp_path)
    with pytest.raises(ValueError, match="not a drafter checkpoint"):
        load_drafter(tmp_path / "nowhere")
