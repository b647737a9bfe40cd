"""The target forward for training stops at the deepest layer the drafter reads."""

from __future__ import annotations

import torch
from dflash.target import (
    _decoder,
    context_body,
    layers_run_for_context,
    select_layers,
    target_context,
)


def _full_context(target, ids, mask, layer_ids):
    with torch.no_grad():
        out = _decoder(target)(
            input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False
        )
    return select_layers(out.hidden_states, layer_ids)


def test_cut_forward_gives_exactly_the_full_models_hidden_states(tiny_target):
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding: the masks must be built the same way in the cut copy
    for layer_ids in ([1, 3], [0], [2, 4]):
        got = target_context(tiny_target, ids, mask, layer_ids)
        torch.testing.assert_close(
            got, _full_context(tiny_target, ids, mask, layer_ids), rtol=0, atol=0
        )


def test_the_layers_past_the_deepest_one_do_not_run(tiny_target):
    decoder = _decoder(tiny_target)
    calls = [0] * len(decoder.layers)
    hooks = [
        layer.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(decoder.layers)
    ]
    try:
        target_context(tiny_target, torch.randint(0, 500, (1, 8)), None, [1, 3])
    finally:
        for hook in hooks:
            hook.remove()
    assert calls == [1, 1, 1, 1, 0, 0]
    assert layers_run_for_context(tiny_target, [1, 3]) == 4


def test_the_target_itself_is_untouched_and_the_last_layer_runs_whole(tiny_target):
    decoder = _decoder(tiny_target)
    body = context_body(tiny_target, [1, 3])
    assert body is not decoder and body.layers[0] is decoder.layers[0]  # shared weights
    assert len(decoder.layers) == decoder.config.num_hidden_layers == 6
    assert type(decoder.norm).__name__ != "Identity"
    # Reading the last layer: hidden_states[L] is the normed output, as before.
    assert context_body(tiny_target, [1, 5]) is decoder
    assert layers_run_for_context(tiny_target, [1, 5]) == 6


def test_training_through_the_cut_copy_leaves_the_full_target_unchanged():
    """The cut copy used first (as in training) must not make the full target hook its
    layers twice: the end-of-run eval then read doubled, shifted hidden states."""
    from dflash import build_tiny_target
    from dflash.target import cached_forward, new_cache

    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(1))
    fresh, used = build_tiny_target(seed=0), build_tiny_target(seed=0)
    target_context(used, ids, None, [1, 3])  # the first hidden-state request goes to the copy
    expected = cached_forward(fresh, ids, 0, new_cache(fresh), hidden=True).hidden_states
    got = cached_forward(used, ids, 0, new_cache(used), hidden=True).hidden_states
    assert len(got) == len(expected) == 7
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fp8_context_is_close_and_leaves_the_target_as_it_was(tiny_target):
    """target.fp8: the decoder's linear layers run as FP8 matmuls on a copy of the body;
    evaluation and the drafter's embedding and LM head keep using the target as loaded."""
    from dflash.target import ContextForward, Fp8Linear

    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    before = target_context(tiny_target, ids, mask, [1, 3])
    fp8 = ContextForward(tiny_target, [1, 3], compile=False, fp8=True)
    assert isinstance(fp8.body.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(fp8.body.layers[0].mlp.down_proj, Fp8Linear)
    got = fp8(ids, mask)
    error = float((got - before).norm() / before.norm())
    assert 0 < error < 0.15  # e4m3: 3 mantissa bits, so close but not equal
    assert type(tiny_target.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    torch.testing.assert_close(
        target_context(tiny_target, ids, mask, [1, 3]), before, rtol=0, atol=0
    )


def test_fp8_linear_quantises_rows_and_tokens():
    from dflash.target import Fp8Linear

    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 16, bias=True)
    x = torch.randn(3, 5, 32) * torch.logspace(-2, 2, 5)[None, :, None]  # tokens of any scale
    fp8 = Fp8Linear(linear)
    out, ref = fp8(x), linear(x)
    assert out.shape == ref.shape
    per_token = ((out - ref).norm(dim=-1) / ref.norm(dim=-1)).max()
    assert float(per_token) < 0.1  # a scale per token: small tokens keep their precision


def test_the_compiled_context_needs_no_mask_for_right_padded_rows(tiny_target):
    """The compiled forward runs without the attention mask (a causal mask alone): with
    right padding every real token's hidden states are the same."""
    from dflash.target import ContextForward

    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 15:] = 0  # right padding, as data.collate pads
    masked = target_context(tiny_target, ids, mask, [1, 3])
    forward = ContextForward(tiny_target, [1, 3], compile=False, fp8=False)
    forward.compiled = True  # what the compiled one is called with, run eagerly here
    got = forward(ids, mask)
    torch.testing.assert_close(got[0], masked[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1, :15], masked[1, :15], rtol=1e-5, atol=1e-5)
