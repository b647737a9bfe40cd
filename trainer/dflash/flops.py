"""Useful FLOPs of a training batch: what MFU divides by.

Matmuls count 2 FLOPs per multiply-add; backward counts twice the forward for trained
weights and once for the frozen LM head (input gradient only); attention counts causal
(target) and the average visible context (drafter), not masked work. The target counts
the layers it runs (up to the deepest one the drafter reads), without its LM head.
"""

from __future__ import annotations

from .config import DrafterConfig

# Families whose MLP is two matrices (up, down) instead of the gated three (gate, up,
# down) of Llama, Qwen, Mistral, Gemma, Phi-3 and OLMo.
TWO_MATRIX_MLP = frozenset(
    {"gpt_neox", "gpt2", "gptj", "gpt_bigcode", "codegen", "opt", "bloom", "falcon", "phi",
     "starcoder2", "mpt"}
)  # fmt: skip


def target_flops(config, layers_run: int, batch_size: int, seq_len: int) -> float:
    """The target forward over [batch_size, seq_len] (a transformers config's shape).

    Configs without grouped-query attention (GPT-NeoX, say) name no key/value heads: one
    per query head; those without an intermediate size have the customary 4x hidden."""
    n, s, t = batch_size, seq_len, config
    h, L = int(t.hidden_size), layers_run
    heads = int(t.num_attention_heads)
    kv = int(getattr(t, "num_key_value_heads", None) or heads)
    hd = int(getattr(t, "head_dim", None) or h // heads)
    ffn = int(getattr(t, "intermediate_size", None) or 4 * h)
    mlp = 2 if getattr(t, "model_type", "") in TWO_MATRIX_MLP else 3
    layer_params = h * heads * hd * 2 + h * kv * hd * 2 + mlp * h * ffn
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
