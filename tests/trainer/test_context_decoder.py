"""The written-out target forward (`context_decoder`) gives transformers' hidden states.

Checked on three Llama-shaped families built differently (qwen3 with per-head q/k norms,
llama with grouped-query attention, qwen2 with q/k/v biases), for middle layers and for
the model's last layer (read normed, as transformers gives it), compiled and as FP8."""

from __future__ import annotations

import pytest
import torch
from dflash import build_tiny_target
from dflash.context_decoder import ContextDecoder, unsupported_reason
from dflash.target import ContextForward, _decoder, target_context


def _llama(bias: bool = False, family: str = "llama"):
    import transformers

    kw = dict(
        vocab_size=300,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if family == "qwen2":
        config = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**kw, attention_bias=bias, rope_theta=5000.0)
        model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(3)
    for p in model.parameters():  # random norms and biases too: no weight is a no-op
        p.data.normal_(0.0, 0.2 if p.dim() == 1 else 0.05)
        if p.dim() == 1 and p.shape[0] in (48, 8):
            p.data.add_(1.0)
    return model.eval().requires_grad_(False)


TARGETS = {
    "qwen3": lambda: build_tiny_target(seed=1),
    "llama": lambda: _llama(),
    "llama-bias": lambda: _llama(bias=True),
    "qwen2": lambda: _llama(family="qwen2"),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
@pytest.mark.parametrize("layer_ids", [[1, 2], [0, 3]])
def test_written_out_forward_matches_transformers(name, layer_ids):
    target = TARGETS[name]()
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))
    reference = target_context(target, ids, None, layer_ids)
    assert unsupported_reason(_decoder(target)) is None
    got = ContextDecoder(_decoder(target), layer_ids)(ids)
    assert got.shape == reference.shape
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-5)
    # the target's own layers now read slices of the fused weights: same numbers
    torch.testing.assert_close(target_context(target, ids, None, layer_ids), reference)


def test_the_training_forward_checks_itself_and_keeps_the_last_layer_normed():
    target = build_tiny_target(seed=2)
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    forward = ContextForward(target, [1, 5], compile=False, fp8=False, fused=True)
    assert forward.decoder is not None and forward.describe().startswith("written out")
    got = forward(ids, torch.ones_like(ids))
    assert forward.checked_error is not None and forward.checked_error < 1e-5
    torch.testing.assert_close(got, target_context(target, ids, None, [1, 5]))


def test_fp8_written_out_is_close_but_not_equal():
    target = build_tiny_target(seed=2)
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(4))
    reference = target_context(target, ids, None, [1, 3])
    forward = ContextForward(target, [1, 3], compile=False, fp8=True, fused=True)
    got = forward(ids, None)
    error = float((got - reference).norm() / reference.norm())
    assert 0 < error < 0.15


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("mistake", ["norm scaled", "no q/k norm"])
def test_a_target_that_computes_otherwise_falls_back_at_the_first_call_and_says_why(mistake, fp8):
    target = build_tiny_target(seed=2)
    forward = ContextForward(target, [1, 3], compile=False, fp8=fp8, fused=True)
    layer = forward.decoder.layers[0]
    if mistake == "norm scaled":
        layer.norm_in = (layer.norm_in[0] * 3.0, 1e-6)
    else:
        layer.q_norm = None
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="not written out: it differs from transformers'"):
        got = forward(ids, None)
    assert forward.decoder is None and forward.checked_error > ContextForward.TOLERANCE
    assert forward.plain is not fp8
    if not fp8:  # transformers' own forward from then on
        torch.testing.assert_close(got, target_context(target, ids, None, [1, 3]), rtol=0, atol=0)


def test_fp8_is_checked_against_transformers_with_the_same_fp8_matmuls():
    """The first-call check is of the writing-out: FP8's own rounding (judged by serving
    the drafter against the bf16 target, bench/quality_zoo.py --fp8-twin) is not held
    against it, so a deep target does not fall back for quantisation noise."""
    target = build_tiny_target(seed=2)
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(4))
    forward = ContextForward(target, [1, 3], compile=False, fp8=True, fused=True)
    forward(ids, None)
    assert forward.decoder is not None and forward.checked_error < 1e-3


def test_other_shapes_fall_back_to_transformers_and_say_why():
    target = _llama()
    target.model.config.hidden_act = "gelu"
    assert "activation" in unsupported_reason(_decoder(target))
    forward = ContextForward(target, [1], compile=False, fp8=False, fused=True)
    assert forward.decoder is None and forward.plain
    off = ContextForward(build_tiny_target(), [1], compile=True, fp8=False, fused=False)
    assert off.decoder is None and off.describe() == "transformers, compiled"


def test_compile_auto_compiles_the_written_out_forward_only():
    """target.compile: auto (the default) compiles where the forward is written out and
    keeps transformers' forward eager (compiled, it measured slower than eager), also
    where the written-out forward falls back at its first call."""
    written = ContextForward(build_tiny_target(), [1, 3], compile="auto", fp8=False, fused=True)
    assert written.compiled and written.describe().endswith(", compiled")
    kept = ContextForward(build_tiny_target(), [1, 3], compile="auto", fp8=False, fused=False)
    assert not kept.compiled and kept.plain and kept.describe() == ""
    gelu = _llama()
    gelu.model.config.hidden_act = "gelu"
    unsupported = ContextForward(gelu, [1], compile="auto", fp8=False, fused=True)
    assert not unsupported.compiled and unsupported.plain

    target = build_tiny_target(seed=2)
    falls_back = ContextForward(target, [1, 3], compile="auto", fp8=False, fused=True)
    falls_back.decoder.layers[0].q_norm = None
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(5))
    with pytest.warns(UserWarning, match="not written out"):
        got = falls_back(ids, None)  # eager: no compile was started for a forward dropped
    assert not falls_back.compiled and falls_back.plain
    torch.testing.assert_close(got, target_context(target, ids, None, [1, 3]), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("given", "kept"), [("auto", "auto"), ("true", True), ("False", False), (True, True)]
)
def test_target_compile_takes_true_false_or_auto(given, kept):
    from dflash.pipeline.train_config import TargetSection

    assert TargetSection(compile=given).compile == kept


def test_a_wrong_target_compile_says_what_it_takes():
    from dflash.pipeline.train_config import load_train_config

    with pytest.raises(Exception, match="true, false or auto"):
        load_train_config(None, ["target.compile=sometimes"])


@pytest.mark.parametrize(
    ("mode", "target_compile", "compiled"),
    [
        ("eager", "auto", False),
        ("default", "auto", True),
        ("eager", True, True),
        ("default", False, False),
    ],
)
def test_auto_compiles_the_target_only_where_the_drafter_compiles(mode, target_compile, compiled):
    from dflash.dflash_workload import DFlashWorkload
    from dflash.pipeline.train_config import config_from_dict

    cfg = config_from_dict(
        {
            "runtime": {"compile": mode},
            "target": {"compile": target_compile},
            "eval": {"enabled": False},
        }
    )
    workload = DFlashWorkload(cfg)
    assert workload.target_compiled(torch.device("cuda:0")) is compiled
    assert workload.target_compiled(torch.device("cpu")) is False  # CPU: always eager
