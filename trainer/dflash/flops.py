"""Useful FLOPs of a training batch: what MFU divides by.

Matmuls count 2 FLOPs per multiply-add; backward counts twice the forward for trained
weights and once for the frozen LM head (input gradient only); attention counts causal
(target) and the average visible context (drafter), not masked work. The target counts
the layers it runs (up to the deepest one the drafter reads), without its LM head.
"""

from __future__ import annotations

from .config import DrafterConfig


def target_flops(config, layers_run: int, batch_size: int, seq_len: int) -> float:
    """The target forward over [batch_size, seq_len] (a transformers config's shape)."""
    n, s, t = batch_size, seq_len, config
    h, L = int(t.hidden_size), layers_run
    heads, kv = int(t.num_attention_heads), int(t.num_key_value_heads)
    hd = int(getattr(t, "head_dim", None) or h // heads)
    ffn = int(t.intermediate_size)
    layer_params = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * ffn
    return float(2 * layer_params * L * n * s + 2 * L * n * s * s * heads * hd)


def drafter_flops(d: DrafterConfig, batch_size: int, seq_len: int, num_anchors: int) -> float:
    """The drafter's forward and backward over num_anchors blocks of each row."""
    n, s = batch_size, seq_len
    blocks = n * num_anchors * d.block_size
    dh, dheads, dkv, dhd, dffn = (
        d.hidden_size,
        d.num_attention_heads,
        d.num_key_value_heads,
        d.head_dim,
        d.intermediate_size,
    )
    q_o = dh * dheads * dhd * 2
    k_v = dh * dkv * dhd * 2
    per_layer = 2 * (q_o + 3 * dh * dffn) * blocks + 2 * k_v * (blocks + n * s)
    avg_visible = s / 2 + d.block_size
    attention = 4 * blocks * avg_visible * dheads * dhd
    fuse = 2 * d.num_context_layers * dh * dh * n * s
    trained_fwd = d.num_hidden_layers * (per_layer + attention) + fuse
    head_fwd = 2 * dh * d.vocab_size * n * num_anchors * (d.block_size - 1)
    return float(3 * trained_fwd + 2 * head_fwd)
