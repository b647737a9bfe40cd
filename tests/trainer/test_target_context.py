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
