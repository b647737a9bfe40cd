"""The target model: loading it, building the tiny test one, reading its hidden states.

The target is any Hugging Face causal LM that can return hidden states; Qwen3
first. `hidden_states[i + 1]` of a transformers model is the output of decoder
layer i (index 0 is the embedding output).
"""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

from dflash.context_decoder import (  # noqa: F401 (Fp8Linear: its public home was here)
    ContextDecoder,
    Fp8Linear,
    relative_error,
    unsupported_reason,
)
from dflash.decode_attention import decoding


def build_tiny_target(
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 6,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    initializer_range: float = 0.03,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A random-weight Qwen3ForCausalLM for tests and CPU runs (no download)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        model = Qwen3ForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return freeze(model.to(dtype))


def load_target(
    path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> nn.Module:
    """A local Hugging Face causal LM, frozen, in eval mode (never downloads)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)
    return freeze(model.to(device))


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    model.requires_grad_(False)
    return model


def target_parts(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(embed_tokens, lm_head) for `DFlashDrafter.bind_target`."""
    return target.get_input_embeddings(), target.get_output_embeddings()


def num_layers(target: nn.Module) -> int:
    return int(target.config.num_hidden_layers)


def _decoder(target: nn.Module) -> nn.Module:
    """The transformer body without the LM head (training never needs target logits)."""
    body = getattr(target, "model", None)
    return body if isinstance(body, nn.Module) else target.base_model


_context_bodies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def context_body(target: nn.Module, layer_ids: list[int]) -> nn.Module:
    """The target's decoder cut after the deepest layer the drafter reads.

    Qwen3-8B with layers [1, 9, 17, 25, 33] runs 34 of its 36 layers: the last two
    (5.5% of the target forward) would only feed the LM head, which training never
    calls. The cut copy shares every parameter with the target (no memory). Its final
    norm becomes the identity, so its last hidden state is the raw output of the deepest
    layer, exactly `hidden_states[deepest + 1]` of the full model; where the deepest layer
    is the model's last one, the whole decoder runs as before. A decoder without a
    `layers` list and a `norm` (not Llama/Qwen-like) also runs whole.
    """
    decoder = _decoder(target)
    keep = max(layer_ids) + 1
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(decoder, "norm"):
        return decoder
    if keep >= len(layers):
        return decoder
    cached = _context_bodies.get(decoder)
    if cached is not None and cached[0] == keep:
        return cached[1]
    _install_capture_hooks(decoder)  # before copying: the copy must inherit "installed"
    body = copy.copy(decoder)  # a new module object sharing the submodules
    for name, value in vars(decoder).items():
        if isinstance(value, dict):  # own tables (submodules, hooks, ...): edits stay here
            setattr(body, name, copy.copy(value))
    body._modules["layers"] = nn.ModuleList(list(layers)[:keep])
    body._modules["norm"] = nn.Identity()
    body.config = copy.copy(decoder.config)
    body.config.num_hidden_layers = keep
    if isinstance(getattr(body.config, "layer_types", None), list):
        body.config.layer_types = body.config.layer_types[:keep]
    _context_bodies[decoder] = (keep, body)
    return body


def _install_capture_hooks(decoder: nn.Module) -> None:
    """Install transformers' hidden-state hooks on the whole decoder now, once.

    transformers 5 collects hidden states with forward hooks it installs lazily on the
    decoder layers the first time a model is asked for them, and marks only that model
    object as hooked (`_output_capturing_hooks_installed`). The cut copy shares the layer
    modules but is another object: were it asked first, it would hook the shared layers
    and mark only itself, and the full target would later hook them a second time; every
    shared layer then records its output twice (11 hidden states instead of 7 for a
    6-layer target cut after layer 3, `hidden_states[2]` being layer 0's output again),
    and the end-of-run eval read the wrong layers. Hooking the full decoder first and
    copying its mark makes both objects use the one set of hooks. Older transformers
    (hooks added and removed per call) have no such function and need nothing.
    """
    try:
        from transformers.utils.output_capturing import maybe_install_capturing_hooks
    except ImportError:
        return
    maybe_install_capturing_hooks(decoder)


def _check_hidden_states(hidden_states, expected: int) -> None:
    if len(hidden_states) != expected:
        raise RuntimeError(
            f"the target returned {len(hidden_states)} hidden states, expected {expected} "
            "(one per decoder layer plus the embedding): its hidden-state capture is "
            "hooked twice or the model is not a plain decoder stack"
        )


@torch.no_grad()
def target_context(
    target: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    layer_ids: list[int],
) -> torch.Tensor:
    """Concatenated outputs of the selected target layers, [N, S, k*H]."""
    out = context_body(target, layer_ids)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        use_cache=False,
    )
    _check_hidden_states(out.hidden_states, layers_run_for_context(target, layer_ids) + 1)
    return select_layers(out.hidden_states, layer_ids)


class ContextForward:
    """`target_context` for the training loop: written out, compiled, with FP8 matmuls.

    fused: the target's layers run as `context_decoder.ContextDecoder` (one q/k/v and one
    gate/up matmul, SDPA's causal kernel) where the target is Llama-shaped; checked
    against the transformers forward on a short input on the first call. Other targets,
    and fused off, run the cut transformers decoder.
    compile: torch.compile with static shapes and no CUDA graphs, so it needs no CUDA Graph
    Trees state in the thread that runs it and holds no graph-owned outputs that a later
    call would overwrite while the drafter still reads them from the queue. "auto"
    compiles the written-out forward only: transformers' forward compiled measured slower
    than eager (0.93x on an H100), the written-out one faster (1.30x).
    Both are called without the attention mask: batches are right-padded
    (`data.collate`), and under a causal mask a real token never sees the padding after
    it, so every real token gets the same hidden states (the drafter reads only context
    before its anchors, which are real tokens), and attention keeps its fused causal kernel.
    fp8: the decoder layers' linear layers run as FP8 (e4m3) matmuls with one scale per
    weight row and per token (`Fp8Linear`); the target itself (evaluation, the drafter's
    embedding and LM head) stays as it is."""

    # Relative error allowed against transformers' forward (FP8 against transformers' with
    # the same FP8 matmuls) at the first call. Summation order alone (fused matmuls,
    # compiled kernels) moves bf16 hidden states by up to ~0.04 through the 34 layers of
    # a random 8B target (measured on an H100); a written-out forward that computes
    # something else (a norm, the rotary layout, a head split) is off by 0.3 and more.
    TOLERANCE = 0.1

    def __init__(
        self,
        target: nn.Module,
        layer_ids: list[int],
        *,
        compile: bool | str,
        fp8: bool,
        fused: bool = False,
    ):
        self.target, self.layer_ids, self.fp8 = target, list(layer_ids), fp8
        self.body = context_body(target, self.layer_ids)
        self.why_not_fused = unsupported_reason(_decoder(target)) if fused else "target.fused off"
        self.decoder = None
        if self.why_not_fused is None:
            self.decoder = ContextDecoder(_decoder(target), self.layer_ids, fp8=fp8)
        elif fp8:
            self.body = with_fp8_linears(self.body)
        self.compile_auto = compile == "auto"
        self.compiled = compile is True or (self.compile_auto and self.decoder is not None)
        self.plain = not (self.compiled or fp8 or self.decoder)
        self.checked_error: float | None = None
        self._run = torch.compile(self._forward, dynamic=False) if self.compiled else self._forward

    def describe(self) -> str:
        """What runs the target forward, for the run's log ("" for the plain forward)."""
        if self.plain:
            return ""
        how = "written out (fused q/k/v and gate/up)" if self.decoder else "transformers"
        if self.decoder is None and self.why_not_fused != "target.fused off":
            how += f" (not written out: {self.why_not_fused})"
        extras = [word for word, on in (("compiled", self.compiled), ("fp8", self.fp8)) if on]
        return how + "".join(f", {word}" for word in extras)

    def _forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        if self.decoder is not None:
            return self.decoder(input_ids)
        out = self.body(
            input_ids=input_ids,
            attention_mask=attention_mask,
            output_hidden_states=True,
            use_cache=False,
        )
        return select_layers(out.hidden_states, self.layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        if self.plain:  # exactly target_context, its hidden-state count checked
            return target_context(self.target, input_ids, attention_mask, self.layer_ids)
        if self.decoder is not None and self.checked_error is None:
            self._check(input_ids)
        return self._run(input_ids, None if self.compiled or self.decoder else attention_mask)

    def _check(self, input_ids: torch.Tensor) -> None:
        """The written-out forward against transformers' on the first row's first tokens
        (eager, a few ms). A target that passed the shape checks but computes something
        else goes back to transformers' forward, with a warning that says why: training
        goes on, on the hidden states serving will see."""
        ids = input_ids[:1, : min(128, input_ids.shape[1])]
        if self.fp8:  # like for like: the check is of the writing-out, not of FP8
            out = with_fp8_linears(self.body)(
                input_ids=ids, output_hidden_states=True, use_cache=False
            )
            reference = select_layers(out.hidden_states, self.layer_ids)
        else:
            reference = target_context(self.target, ids, None, self.layer_ids)
        self.checked_error = relative_error(self.decoder(ids), reference)
        if self.checked_error <= self.TOLERANCE:
            return
        self.why_not_fused = (
            f"it differs from transformers' forward by {self.checked_error:.3g} (relative; at "
            f"most {self.TOLERANCE:g} expected)"
        )
        warnings.warn(
            f"target forward: not written out: {self.why_not_fused}; running transformers' "
            "forward (target.fused: false says so from the start)",
            stacklevel=2,
        )
        self.decoder = None
        if self.fp8:
            self.body = with_fp8_linears(self.body)
        if self.compile_auto:  # only the written-out forward gains from a compile
            self.compiled, self._run = False, self._forward
        self.plain = not (self.compiled or self.fp8)

    def warm(self, batch_size: int, seq_len: int, device) -> None:
        """Compile and run once with the production shapes (token ids: only the shapes
        matter), made on the CPU: no GPU random numbers while another thread may capture."""
        gen = torch.Generator().manual_seed(54321)
        ids = torch.randint(0, 100, (batch_size, seq_len), generator=gen).to(device)
        for _ in range(2):
            self(ids, torch.ones_like(ids))


_context_forwards: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def context_forward(
    target: nn.Module, layer_ids: list[int], *, compile: bool | str, fp8: bool, fused: bool = False
) -> ContextForward:
    """The target's ContextForward for these settings, made once (a compile is kept)."""
    key = (tuple(layer_ids), compile, fp8, fused)
    made = _context_forwards.setdefault(target, {})
    if key not in made:
        made[key] = ContextForward(target, layer_ids, compile=compile, fp8=fp8, fused=fused)
    return made[key]


def with_fp8_linears(module: nn.Module) -> nn.Module:
    """A copy of `module` whose nn.Linear layers are Fp8Linear; every other submodule and
    parameter is shared with the original, which is left untouched."""
    if isinstance(module, nn.Linear):
        return Fp8Linear(module)
    children = dict(module.named_children())
    swapped = {name: with_fp8_linears(child) for name, child in children.items()}
    if all(swapped[name] is child for name, child in children.items()):
        return module
    clone = copy.copy(module)
    for name, value in vars(module).items():
        if isinstance(value, dict):  # own tables (submodules, hooks, ...): edits stay here
            setattr(clone, name, copy.copy(value))
    for name, child in swapped.items():
        clone._modules[name] = child
    return clone


def layers_run_for_context(target: nn.Module, layer_ids: list[int]) -> int:
    """How many decoder layers `target_context` runs (for FLOP counts)."""
    body = context_body(target, layer_ids)
    layers = getattr(body, "layers", None)
    return len(layers) if layers is not None else int(target.config.num_hidden_layers)


def select_layers(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


# -- cached forwards for decoding (transformers 4.x/5.x compatible) ---------------------------
def new_cache(target: nn.Module):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _cache_kwarg(target: nn.Module) -> str:
    # transformers 5.2x renamed `past_key_values` to `cache`; older versions only know the former.
    params = inspect.signature(target.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cached_forward(target: nn.Module, input_ids: torch.Tensor, start: int, cache, *, hidden: bool):
    """Run `input_ids` at positions start.. on top of `cache`; returns the model output."""
    positions = torch.arange(start, start + input_ids.shape[1], device=input_ids.device)[None]
    kwargs = {_cache_kwarg(target): cache}
    out = target(
        input_ids=input_ids,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=hidden,
        **kwargs,
    )
    if hidden:
        _check_hidden_states(out.hidden_states, num_layers(target) + 1)
    return out


def masked_forward(
    target: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache,
    *,
    hidden: bool,
):
    """A batched cached forward: `input_ids` [N, q] at per-row `position_ids` [N, q] on top of
    `cache`; `attention_mask` [N, cached + q] (0 = a slot no query may see: left padding, or
    a rejected draft left in the cache). Rows then need not hold equally many real tokens."""
    kwargs = {_cache_kwarg(target): cache}
    out = target(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        output_hidden_states=hidden,
        **kwargs,
    )
    if hidden:
        _check_hidden_states(out.hidden_states, num_layers(target) + 1)
    return out


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions (a negative crop means 'remove' in every version)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)


@decoding
@torch.no_grad()
def greedy_generate(
    target: nn.Module,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None = None,
    margins: list[float] | None = None,
) -> tuple[list[int], int]:
    """The target's own greedy continuation of one prompt [1, P] -> (new token ids, target forwards).

    `margins`, when given, receives the top-1 minus top-2 logit of every chosen token.
    """
    cache = new_cache(target)
    out = cached_forward(target, prompt_ids, 0, cache, hidden=False)
    token = int(out.logits[0, -1].argmax())
    _record_margin(margins, out.logits[0, -1])
    generated, forwards = [token], 1
    stops = set(stop_token_ids or [])
    while len(generated) < max_new_tokens and token not in stops:
        step = torch.tensor([[token]], device=prompt_ids.device)
        out = cached_forward(
            target, step, prompt_ids.shape[1] + len(generated) - 1, cache, hidden=False
        )
        token = int(out.logits[0, -1].argmax())
        _record_margin(margins, out.logits[0, -1])
        generated.append(token)
        forwards += 1
    return generated, forwards


def _record_margin(margins: list[float] | None, logits: torch.Tensor) -> None:
    if margins is not None:
        top = logits.float().topk(2).values
        margins.append(float(top[0] - top[1]))


@decoding
@torch.no_grad()
def greedy_generate_batch(
    target: nn.Module, prompt_ids: torch.Tensor, num_new_tokens: int
) -> torch.Tensor:
    """Greedy continuations of equal-length prompts [N, P] -> [N, num_new_tokens] (no stop tokens)."""
    cache = new_cache(target)
    out = cached_forward(target, prompt_ids, 0, cache, hidden=False)
    tokens = [out.logits[:, -1].argmax(-1)]
    for step in range(1, num_new_tokens):
        out = cached_forward(
            target, tokens[-1][:, None], prompt_ids.shape[1] + step - 1, cache, hidden=False
        )
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.stack(tokens, dim=1)
