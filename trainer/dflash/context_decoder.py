"""The target's context forward for training, written out for Llama-shaped decoders.

Training only needs the hidden states of a few target layers, for whole sequences, with
a causal mask: no cache, no padding mask, no LM head. Transformers' forward serves every
use, and costs for it at the 8B shape: three query/key/value matmuls and two gate/up
matmuls where one each would do, RMSNorm and rotary embedding as chains of small
kernels, and under torch.compile a materialised causal mask that turns SDPA's fused
causal kernel into a masked one (measured: the compiled transformers forward was slower
than the eager one, bench/results/h200/trainer-measurements.txt).

`ContextDecoder` runs the same layers from the same parameters with:
- one matmul for q, k and v and one for gate and up: the target's weights are concatenated
  once and its own linear layers are pointed at slices of the result, so no second copy
  of the weights is kept and evaluation (which runs the transformers model) reads the
  very same numbers;
- `F.scaled_dot_product_attention(is_causal=True)`, so flash attention stays in use
  compiled or not;
- nothing the compiler has to guess about: static shapes, positions 0..S-1.

Compiled (target.compile), the norms, rotary embedding, SiLU-and-multiply and residual
adds fuse into the matmuls' neighbours. With target.fp8 the fused matmuls run as FP8.

Only decoders whose layers are plain pre-norm attention + SwiGLU with RMSNorm
(transformers' llama, mistral without a sliding window, qwen2, qwen3) are written out;
any other target runs its own transformers forward. `relative_error` compares both on
a short input before training relies on it.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

# model_type -> whether its attention normalises q and k per head (qwen3's q_norm/k_norm)
_SUPPORTED = {"llama": False, "mistral": False, "qwen2": False, "qwen3": True}


def unsupported_reason(decoder: nn.Module) -> str | None:
    """Why `decoder` cannot be written out (None: it can)."""
    config = getattr(decoder, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in _SUPPORTED:
        return f"model type {kind!r} is not one of {', '.join(sorted(_SUPPORTED))}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r} is not silu"
    layer_types = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        return "some layers use sliding-window attention"
    if getattr(config, "use_sliding_window", False) or (
        kind == "mistral" and getattr(config, "sliding_window", None)
    ):
        return "sliding-window attention"
    for part in ("embed_tokens", "layers", "rotary_emb"):
        if not hasattr(decoder, part):
            return f"the decoder has no {part}"
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = ("q_proj", "k_proj", "v_proj", "o_proj")
        if attn is None or not all(isinstance(getattr(attn, n, None), nn.Linear) for n in names):
            return "a layer's attention is not q/k/v/o linear layers"
        names = ("gate_proj", "up_proj", "down_proj")
        if mlp is None or not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in names):
            return "a layer's MLP is not gate/up/down linear layers"
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if _SUPPORTED[kind]:
            norms += [attn.q_norm, attn.k_norm]
        if not all("RMSNorm" in type(norm).__name__ for norm in norms):
            return "a layer's norms are not RMSNorm"
    return None


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Transformers' RMSNorm, to the rounding: in float32, cast back, then scaled."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for linear layers that read the same input. The layers'
    own parameters become slices of it: the same values, no second copy in memory."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    biased = any(linear.bias is not None for linear in linears)
    bias = None
    if biased:
        bias = torch.cat(
            [
                linear.bias.detach()
                if linear.bias is not None
                else weight.new_zeros(linear.out_features)
                for linear in linears
            ]
        )
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start : start + rows]
        if linear.bias is not None and bias is not None:
            linear.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


class Fp8Linear(nn.Module):
    """A frozen linear layer as an FP8 matmul: weights e4m3 with one scale per output row,
    activations quantised per token on the fly (torch._scaled_mm on GPUs; dequantised
    matmul elsewhere, for tests)."""

    MAX = 448.0  # largest finite float8_e4m3fn

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.MAX
        self.register_buffer("weight_fp8", (weight.float() / scale).to(torch.float8_e4m3fn))
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.bias = linear.bias
        self.out_dtype = weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        scale = rows.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / self.MAX
        quantised = (rows.float() / scale).to(torch.float8_e4m3fn)
        if rows.is_cuda:
            out = torch._scaled_mm(
                quantised,
                self.weight_fp8.t(),
                scale_a=scale,
                scale_b=self.weight_scale,
                out_dtype=self.out_dtype,
            )
        else:
            weight = self.weight_fp8.float() * self.weight_scale.t()
            out = ((quantised.float() * scale) @ weight.t()).to(self.out_dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*shape[:-1], out.shape[-1])


class _Matmul:
    """x @ W.T + b, as bf16/fp32 or as an FP8 matmul (`Fp8Linear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fp8: bool) -> None:
        self.weight, self.bias = weight, bias
        self.fp8 = Fp8Linear(SimpleNamespace(weight=weight, bias=bias)) if fp8 else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 is not None:
            return self.fp8(x)
        return F.linear(x, self.weight, self.bias)


class _Layer:
    def __init__(self, layer: nn.Module, qk_norm: bool, fp8: bool) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.heads = attn.q_proj.out_features // attn.head_dim
        self.kv_heads = attn.k_proj.out_features // attn.head_dim
        self.head_dim, self.scaling = attn.head_dim, float(attn.scaling)
        self.qkv = _Matmul(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), fp8)
        self.out = _Matmul(attn.o_proj.weight, attn.o_proj.bias, fp8)
        self.gate_up = _Matmul(*_fuse([mlp.gate_proj, mlp.up_proj]), fp8)
        self.down = _Matmul(mlp.down_proj.weight, mlp.down_proj.bias, fp8)
        self.norm_in = (layer.input_layernorm.weight, _eps(layer.input_layernorm))
        self.norm_mlp = (
            layer.post_attention_layernorm.weight,
            _eps(layer.post_attention_layernorm),
        )
        self.q_norm = (attn.q_norm.weight, _eps(attn.q_norm)) if qk_norm else None
        self.k_norm = (attn.k_norm.weight, _eps(attn.k_norm)) if qk_norm else None

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n, s, _ = h.shape
        d = self.head_dim
        q, k, v = self.qkv(rms_norm(h, *self.norm_in)).split(
            [self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1
        )
        q, k, v = q.view(n, s, -1, d), k.view(n, s, -1, d), v.view(n, s, -1, d)
        if self.q_norm is not None:
            q, k = rms_norm(q, *self.q_norm), rms_norm(k, *self.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_heads != self.heads:  # grouped-query attention, as transformers repeats
            group = self.heads // self.kv_heads
            k = k[:, :, None].expand(n, self.kv_heads, group, s, d).reshape(n, self.heads, s, d)
            v = v[:, :, None].expand(n, self.kv_heads, group, s, d).reshape(n, self.heads, s, d)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)
        h = h + self.out(attn.transpose(1, 2).reshape(n, s, -1))
        gate, up = self.gate_up(rms_norm(h, *self.norm_mlp)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class ContextDecoder:
    """The selected layers' outputs, concatenated ([N, S, k*H]), as the cut transformers
    decoder gives them (`target.target_context` without an attention mask)."""

    def __init__(self, decoder: nn.Module, layer_ids: list[int], *, fp8: bool = False) -> None:
        reason = unsupported_reason(decoder)
        if reason:
            raise ValueError(f"cannot write out this target's forward: {reason}")
        self.layer_ids = list(layer_ids)
        keep = max(self.layer_ids) + 1
        qk_norm = _SUPPORTED[decoder.config.model_type]
        self.embed, self.rotary = decoder.embed_tokens, decoder.rotary_emb
        self.layers = [_Layer(layer, qk_norm, fp8) for layer in list(decoder.layers)[:keep]]
        # transformers' last hidden state is the final norm's output: where the drafter
        # reads the model's last layer, it reads it normed
        last_normed = keep == len(decoder.layers) and hasattr(decoder, "norm")
        self.final_norm = (decoder.norm.weight, _eps(decoder.norm)) if last_normed else None

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.rotary(h, positions)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        wanted, outputs = set(self.layer_ids), {}
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin)
            if index in wanted:
                outputs[index] = h
        if self.final_norm is not None:
            last = len(self.layers) - 1
            outputs[last] = rms_norm(outputs[last], *self.final_norm)
        return torch.cat([outputs[i] for i in self.layer_ids], dim=-1)


def relative_error(got: torch.Tensor, reference: torch.Tensor) -> float:
    """How far the written-out forward's output is from transformers' (relative L2)."""
    return float((got.float() - reference.float()).norm() / reference.float().norm())
