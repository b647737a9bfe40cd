"""The export loads through transformers' AutoModel (trust_remote_code) and drafts the same logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from dflash.checkpoint import save_drafter
from dflash.masks import sdpa_attend
from dflash.target import target_context, target_parts
from transformers import AutoModel

CONTEXT = 9


def _trained_like(make_drafter):
    drafter = make_drafter(seed=4)
    with torch.no_grad():  # every weight away from its initial value (norms included)
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return drafter


def _ours(drafter, context, block_ids):
    with torch.no_grad():
        positions = torch.arange(CONTEXT)[None]
        kv = drafter.context_kv(drafter.fuse(context), positions)
        block_pos = torch.arange(CONTEXT, CONTEXT + block_ids.shape[1])[None]
        hidden = drafter(drafter.embed_blocks(block_ids), block_pos, kv, sdpa_attend(None))
        return drafter.logits(hidden)


def _inputs(tiny_target, tiny_cfg):
    ids = torch.randint(0, 500, (1, CONTEXT), generator=torch.Generator().manual_seed(2))
    context = target_context(tiny_target, ids, None, tiny_cfg.target_layer_ids)
    block = torch.full((1, tiny_cfg.block_size), tiny_cfg.mask_token_id)
    block[0, 0] = 17
    return context, block


def test_automodel_builds_our_drafter_with_the_same_logits(
    tmp_path, tiny_target, tiny_cfg, make_drafter
):
    drafter = _trained_like(make_drafter)
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"}
    assert config["transformers_version"] == transformers.__version__
    model, info = AutoModel.from_pretrained(
        str(tmp_path), trust_remote_code=True, output_loading_info=True
    )
    assert type(model).__name__ == "DFlashDraftModel"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.target_layer_ids == tiny_cfg.target_layer_ids
    assert model.block_size == tiny_cfg.block_size
    assert model.mask_token_id == tiny_cfg.mask_token_id

    context, block = _inputs(tiny_target, tiny_cfg)
    embed, head = target_parts(tiny_target)
    with torch.no_grad():
        hidden = model(
            position_ids=torch.arange(CONTEXT + block.shape[1])[None],
            noise_embedding=embed(block),
            target_hidden=context,
        )
        theirs = model.compute_logits(hidden, head)
    torch.testing.assert_close(theirs, _ours(drafter, context, block), rtol=1e-5, atol=1e-5)


def test_the_cache_path_gives_the_same_logits(tmp_path, tiny_target, tiny_cfg, make_drafter):
    """Context fed once into a cache, then the block alone: as a serving loop calls it."""
    from dflash.target import crop_cache, new_cache

    drafter = _trained_like(make_drafter)
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    model = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True)
    context, block = _inputs(tiny_target, tiny_cfg)
    embed, head = target_parts(tiny_target)
    cache = new_cache(model)
    with torch.no_grad():
        model(  # the first 5 context positions, with the block after them (then cropped)
            position_ids=torch.arange(5 + block.shape[1])[None],
            noise_embedding=embed(block),
            target_hidden=context[:, :5],
            past_key_values=cache,
            use_cache=True,
        )
        crop_cache(cache, 5)
        hidden = model(
            position_ids=torch.arange(5, CONTEXT + block.shape[1])[None],
            noise_embedding=embed(block),
            target_hidden=context[:, 5:],
            past_key_values=cache,
            use_cache=True,
        )
        theirs = model.compute_logits(hidden, head)
    torch.testing.assert_close(theirs, _ours(drafter, context, block), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_export_dtype_is_what_automodel_loads(tmp_path, make_drafter, dtype):
    save_drafter(make_drafter(), tmp_path, dtype=dtype)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.")
    model = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True, dtype="auto")
    assert model.fc.weight.dtype == dtype


def test_the_export_carries_what_serving_engines_read(tmp_path, tiny_cfg, make_drafter):
    """vLLM reads eagle_aux_hidden_state_layer_ids (its ids count the embedding as 0) and
    the mask token; the method is named in the folder, not only by its path."""
    save_drafter(make_drafter(), tmp_path / "plain-name")
    config = json.loads((tmp_path / "plain-name" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in tiny_cfg.target_layer_ids]
    assert config["dflash_config"]["mask_token_id"] == tiny_cfg.mask_token_id
    assert config["dflash_config"]["target_layer_ids"] == tiny_cfg.target_layer_ids
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["speculators_config"]["algorithm"] == "dflash"
    assert config["num_speculative_tokens"] == tiny_cfg.block_size - 1
    assert config["layer_types"] == ["full_attention"] * tiny_cfg.num_hidden_layers


def test_spec_generate_is_the_targets_greedy_output(tmp_path, tiny_target, make_drafter):
    """z-lab's entry point on the exported class: lossless at temperature 0, and its tau
    equals the trainer's own speculative decoding of the same drafter."""
    from dflash.spec_decode import speculative_generate
    from dflash.target import greedy_generate

    drafter = _trained_like(make_drafter)
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    model = AutoModel.from_pretrained(str(tmp_path), trust_remote_code=True).eval()
    prompt = torch.randint(0, 500, (1, 7), generator=torch.Generator().manual_seed(5))
    ids, lengths = model.spec_generate(
        input_ids=prompt,
        max_new_tokens=20,
        temperature=0.0,
        target=tiny_target,
        return_acceptance=True,
    )
    reference, _ = greedy_generate(tiny_target, prompt, 20)
    assert ids[0, :7].tolist() == prompt[0].tolist()
    assert ids[0, 7:].tolist() == reference
    ours = speculative_generate(drafter, tiny_target, prompt, 20)
    assert lengths == ours.acceptance_lengths
    sampled = model.spec_generate(
        input_ids=prompt, max_new_tokens=12, temperature=1.0, target=tiny_target
    )
    assert sampled.shape == (1, 19) and int(sampled.max()) < tiny_target.config.vocab_size
