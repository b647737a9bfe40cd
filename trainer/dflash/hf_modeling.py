"""DFlash drafter for transformers' AutoModel (shipped as `dflash.py` beside the weights).

    model = AutoModel.from_pretrained(folder, trust_remote_code=True)  # -> DFlashDraftModel

Self-contained: torch and transformers only, nothing from the trainer. The class name,
its attributes (`layers`, `norm`, `fc`, `hidden_norm`, `block_size`, `mask_token_id`,
`target_layer_ids`), the parameter names and `forward(position_ids, attention_mask,
noise_embedding, target_hidden, past_key_values, use_cache)` follow the published
DFlash drafters, so code written for those runs this one.

`spec_generate(input_ids=..., max_new_tokens=..., temperature=0.0, target=target,
stop_token_ids=[...])` runs speculative decoding with a transformers target (batch 1):
greedy at temperature 0 (the target's own greedy output, token for token), else
speculative sampling (each drafted token kept with the target's probability of it,
a rejected one resampled without it), so the output follows the target's distribution.

The drafter has no embedding or LM head: `noise_embedding` is the target's embedding of
the block [last verified token, MASK, ...], `target_hidden` the concatenated hidden
states of the target layers `target_layer_ids` (`hidden_states[i + 1]` of a transformers
model) for the context positions not yet in `past_key_values`, and `compute_logits`
applies the target's LM head. `position_ids` covers those context positions followed by
the block's. Attention inside the block is bidirectional; keys and values of every
layer are [k/v_proj(fused context) ; k/v_proj(block)].
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


def _dflash_value(config, name, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(config, "rope_theta", 1_000_000.0))


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class DFlashRotary(nn.Module):
    """Default (unscaled) RoPE in fp32. The frequencies are computed per call, not kept in
    a buffer: transformers builds models on the meta device and would leave one empty."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype):
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / (self.theta ** (steps / self.head_dim))
        freqs = position_ids.float()[..., None] * inv_freq
        angles = torch.cat([freqs, freqs], dim=-1)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class DFlashMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, count: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], count, self.head_dim)

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        n, q_len, _ = hidden.shape
        both = torch.cat([context, hidden], dim=1)  # [context ; block], one projection
        q = self.q_norm(self._heads(self.q_proj(hidden), self.num_heads)).transpose(1, 2)
        k = self.k_norm(self._heads(self.k_proj(both), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(both), self.num_kv_heads).transpose(1, 2)
        q = _rotate(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rotate(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(n, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, context, cos, sin, attention_mask=None, past_key_values=None):
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), context, cos, sin, attention_mask, past_key_values
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DFlashDraftModel(PreTrainedModel):
    config_class = Qwen3Config
    base_model_prefix = ""
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config) -> None:
        super().__init__(config)
        self.target_layer_ids = _dflash_value(config, "target_layer_ids")
        if self.target_layer_ids is None:
            raise ValueError("config.json must define dflash_config.target_layer_ids")
        self.block_size = int(_dflash_value(config, "block_size", 16))
        self.mask_token_id = _dflash_value(config, "mask_token_id")
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = DFlashRotary(head_dim, _rope_theta(config))
        self.fc = nn.Linear(
            len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False
        )
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.normal_(0.0, 0.02)
            if module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, DFlashRMSNorm):
            module.weight.data.fill_(1.0)

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Final-normed hidden states [N, block, H] of the block rows."""
        dtype = self.fc.weight.dtype
        hidden = noise_embedding.to(dtype)
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        cos, sin = self.rotary_emb(position_ids, dtype)
        cache = past_key_values if use_cache else None
        for layer in self.layers:
            hidden = layer(hidden, context, cos, sin, attention_mask, cache)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        return output_head(hidden.to(output_head.weight.dtype))

    @torch.no_grad()
    def spec_generate(
        self,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        target: nn.Module,
        temperature: float = 0.0,
        stop_token_ids: list[int] | None = None,
        return_acceptance: bool = False,
    ):
        """Prompt [1, P] -> [1, P + new] token ids (and, when asked, the tokens each
        target forward produced: the acceptance lengths whose mean is tau)."""
        if input_ids.shape[0] != 1:
            raise ValueError("spec_generate decodes one prompt at a time (batch 1)")
        stops = set(stop_token_ids or [])
        embed = target.get_input_embeddings()
        head = target.get_output_embeddings()
        target_cache, draft_cache = _new_cache(target), _new_cache(self)
        prompt_len = input_ids.shape[1]
        out = _target_forward(target, input_ids, 0, target_cache)
        context = _layers(out.hidden_states, self.target_layer_ids)
        token = _choose(out.logits[0, -1], temperature)
        generated, lengths = [token], []
        start = prompt_len  # position of `token`; the target has not processed it yet
        while len(generated) < max_new_tokens and token not in stops:
            block = torch.full(
                (1, self.block_size), int(self.mask_token_id), device=input_ids.device
            )
            block[0, 0] = token
            cached = draft_cache.get_seq_length()
            positions = torch.arange(cached, start + self.block_size, device=input_ids.device)
            hidden = self(
                position_ids=positions[None],
                noise_embedding=embed(block),
                target_hidden=context,
                past_key_values=draft_cache,
                use_cache=True,
            )
            _crop(draft_cache, start)  # the block's own keys are not context
            proposal = self.compute_logits(hidden[:, 1:], head)[0].argmax(-1)
            block[0, 1:] = proposal
            out = _target_forward(target, block, start, target_cache)
            new_tokens = _verify(proposal, out.logits[0].float(), temperature)
            accepted = len(new_tokens) - 1
            for i, t in enumerate(new_tokens):
                if t in stops:
                    new_tokens = new_tokens[: i + 1]
                    break
            new_tokens = new_tokens[: max_new_tokens - len(generated)]
            generated.extend(new_tokens)
            lengths.append(len(new_tokens))
            _crop(target_cache, start + accepted + 1)
            context = _layers(out.hidden_states, self.target_layer_ids)[:, : accepted + 1]
            start += accepted + 1
            token = new_tokens[-1]
        ids = torch.cat([input_ids, input_ids.new_tensor([generated])], dim=1)
        return (ids, lengths) if return_acceptance else ids


def _new_cache(model):
    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _crop(cache, length: int) -> None:
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


def _target_forward(target, input_ids, start, cache):
    # transformers 5.2x names the cache argument `cache`; older versions `past_key_values`.
    params = inspect.signature(target.forward).parameters
    name = "cache" if "cache" in params else "past_key_values"
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    return target(
        input_ids=input_ids,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=True,
        **{name: cache},
    )


def _layers(hidden_states, layer_ids):
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def _choose(logits: torch.Tensor, temperature: float) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1))


def _verify(proposal: torch.Tensor, logits: torch.Tensor, temperature: float) -> list[int]:
    """Kept drafted tokens plus the target's own next one. Greedy: the matching prefix and
    the target's argmax. Sampling (a drafted token has draft probability 1): keep it with
    the target's probability p(x); on rejection sample from p without x, renormalised."""
    if temperature <= 0:
        verified = logits.argmax(-1)
        accepted = int((proposal == verified[: proposal.shape[0]]).long().cumprod(0).sum())
        return proposal[:accepted].tolist() + [int(verified[accepted])]
    probs = torch.softmax(logits / temperature, -1)
    kept: list[int] = []
    for i, t in enumerate(proposal.tolist()):
        if float(torch.rand(())) < float(probs[i, t]):
            kept.append(t)
            continue
        rest = probs[i].clone()
        rest[t] = 0.0
        if float(rest.sum()) <= 0:  # p(x) was 1: x is the only choice
            return kept + [t]
        return kept + [int(torch.multinomial(rest / rest.sum(), 1))]
    return kept + [int(torch.multinomial(probs[len(kept)], 1))]
