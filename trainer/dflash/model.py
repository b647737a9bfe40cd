"""The DFlash drafter: Qwen3-style decoder layers that denoise a block of tokens.

A block is [last verified token, MASK, MASK, ...]. Every layer's attention has
queries from the block only and keys/values from [fused target context ; block],
both projected with the same k_proj/v_proj (KV injection); attention inside the
block is bidirectional. The context is k target layers' hidden states fused by
`fc` (Linear(k*H -> H, bias=False)) and `hidden_norm` (RMSNorm), the same for
every layer. Embedding and LM head are the target's, frozen and not owned here.

Parameter names mirror z-lab's published `dflash/model.py` (`fc`, `hidden_norm`,
`layers.N.self_attn.{q,k,v,o}_proj`, `q_norm`, `k_norm`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`, `norm`) so weights map 1:1.

How attention is masked is the caller's business: `forward` takes an `attend`
function (see masks.py) so one body serves training (many blocks, masked) and
cached inference (one block, nothing masked).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import DrafterConfig

# attend(q [N, heads, Q, d], k [N, kv_heads, K, d], v [N, kv_heads, K, d]) -> [N, heads, Q, d]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE, computed in fp32 like the Qwen3 target's."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat([freqs, freqs], dim=-1)  # [N, L, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, L, d]; cos/sin [N, L, d]."""
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + _rotate_half(x) * sin


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LayerKV:
        """Keys (normed, rotated) and values [N, kv_heads, L, d] for context or block rows."""
        n, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(n, length, self.num_kv_heads, self.head_dim)).transpose(
            1, 2
        )
        v = self.v_proj(x).view(n, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context_kv: LayerKV,
        attend: Attend,
    ) -> torch.Tensor:
        n, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(n, length, self.num_heads, self.head_dim)).transpose(
            1, 2
        )
        q = apply_rope(q, cos, sin)
        k_block, v_block = self.key_value(x, cos, sin)
        k = torch.cat([context_kv[0], k_block], dim=2)
        v = torch.cat([context_kv[1], v_block], dim=2)
        out = attend(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(n, length, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, context_kv: LayerKV, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_kv, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)
        # The target's embedding and LM head; a tuple is not registered as submodules,
        # so they stay out of parameters(), state_dict() and the optimizer.
        self._target_parts: tuple[nn.Module, nn.Module] | None = None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    # -- the target's frozen parts ---------------------------------------------------------
    def bind_target(self, embed_tokens: nn.Module, lm_head: nn.Module) -> DFlashDrafter:
        vocab, hidden = embed_tokens.weight.shape
        if (vocab, hidden) != (
            self.cfg.vocab_size,
            self.cfg.hidden_size,
        ) or lm_head.weight.shape != (
            self.cfg.vocab_size,
            self.cfg.hidden_size,
        ):
            raise ValueError(
                f"target embedding {tuple(embed_tokens.weight.shape)} / LM head {tuple(lm_head.weight.shape)} "
                f"do not match the drafter's vocab {self.cfg.vocab_size} x hidden {self.cfg.hidden_size}"
            )
        for module in (embed_tokens, lm_head):
            module.requires_grad_(False)
        self._target_parts = (embed_tokens, lm_head)
        return self

    def _target_part(self, index: int) -> nn.Module:
        if self._target_parts is None:
            raise RuntimeError(
                "call drafter.bind_target(embed_tokens, lm_head) before running the drafter"
            )
        return self._target_parts[index]

    @property
    def embed_tokens(self) -> nn.Module:
        return self._target_part(0)

    @property
    def lm_head(self) -> nn.Module:
        return self._target_part(1)

    # -- building blocks -------------------------------------------------------------------
    def fuse(self, context: torch.Tensor) -> torch.Tensor:
        """[N, C, k*H] target hidden states -> [N, C, H] fused context."""
        return self.hidden_norm(self.fc(context.to(self.fc.weight.dtype)))

    def context_kv(self, fused: torch.Tensor, positions: torch.Tensor) -> list[LayerKV]:
        """Per-layer keys/values of the fused context at the given positions [N, C]."""
        cos, sin = self.rotary(positions, fused.dtype)
        return [layer.self_attn.key_value(fused, cos, sin) for layer in self.layers]

    def embed_blocks(self, block_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(block_ids).to(self.fc.weight.dtype)

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context_kv: list[LayerKV],
        attend: Attend,
    ) -> torch.Tensor:
        """Final-normed hidden states [N, Q, H] of the block rows."""
        cos, sin = self.rotary(block_positions, block_embeds.dtype)
        x = block_embeds
        for layer, kv in zip(self.layers, context_kv, strict=True):
            x = layer(x, cos, sin, kv, attend)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        return head(hidden.to(head.weight.dtype))

    def num_trainable_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad)
