"""The real workload: a Qwen3 target, a DFlash drafter, its data and its evaluation.

Targets come from a local Hugging Face folder (``target.path``) or are built with random
weights in one of the preset shapes (``tiny`` for CPU runs and tests, ``small`` for a
GPU smoke run, ``qwen3-8b`` for benchmarks), directly on the device in their dtype.
Data: ``synthetic`` (random prompts continued greedily by the target, so a drafter can
learn them), ``random`` (uniform token ids; throughput benchmarks only), or a
``.jsonl``/``.txt`` file tokenized with the target's tokenizer.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dflash import DFlashDrafter, DrafterConfig, drafter_loss, sample_anchors, target_parts
from dflash.budget import fit_to_data
from dflash.checkpoint import load_drafter, save_drafter, save_drafter_weights
from dflash.data import (
    Sample,
    TokenizerError,
    build_tiny_tokenizer,
    collate,
    load_samples,
    load_tokenizer,
    prompts_in_training,
    split_by_prompt,
    synthetic_samples,
)
from dflash.flops import drafter_flops, target_flops
from dflash.objective import expected_acceptance_length
from dflash.pipeline.train_config import TrainConfig, TrainConfigError
from dflash.pipeline.workload import Batch, DrafterInputs, Workload
from dflash.serving_walk import blocks_per_token, walk_tau
from dflash.spec_decode import EvalResult, GreedyReferences, evaluate
from dflash.target import ContextForward, context_forward, layers_run_for_context, load_target
from dflash.target_presets import QWEN3_MASK_ID, build_random_target, target_shape
from dflash.walk_set import (
    EVAL_PROMPTS,
    HELDOUT,
    WalkSet,
    answered_prompts,
    split_heldout,
    walk_inputs,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DrafterLoss(nn.Module):
    """The compiled region: drafter forward over all blocks + weighted chunked loss."""

    def __init__(
        self, drafter: DFlashDrafter, loss_chunk: int, attention: str, attention_chunk: int
    ) -> None:
        super().__init__()
        self.drafter = drafter
        self.loss_chunk = loss_chunk
        self.attention = attention
        self.attention_chunk = attention_chunk

    def forward(self, context, input_ids, anchors, anchor_valid, loss_mask):
        return drafter_loss(
            self.drafter,
            context,
            input_ids,
            anchors,
            anchor_valid,
            loss_chunk=self.loss_chunk,
            attention=self.attention,
            attention_chunk=self.attention_chunk,
            loss_mask=loss_mask,
        )


class DFlashWorkload(Workload):
    def __init__(self, cfg: TrainConfig, say: Callable[[str], None] | None = None) -> None:
        super().__init__(cfg)
        # What the slow set-up is doing, for the run's log (rank 0 only): minutes of
        # building a target and generating data are otherwise silence.
        self._say = say or (lambda text: None)
        self.target_dtype = DTYPES[cfg.target.dtype]
        self.drafter_dtype = DTYPES[cfg.drafter.dtype]
        self._notes: list[str] = []
        self.created = time.perf_counter()  # train.budget_minutes counts set-up time too
        # Everything that can be checked from configs is checked before a weight is read:
        # the target's shape comes from its config.json (or the preset), so a drafter that
        # does not fit it fails here, not after an 8B model has been loaded.
        self.target_config = target_shape(cfg.target)
        self.heldout: list[Sample] = []  # data-file samples kept out of training for eval
        self.walk_set: WalkSet | None = None  # what the tau walk walks (None: the batch)
        self.references = GreedyReferences()  # the eval's greedy side, made once a run
        self.tokenizer = self._tokenizer()
        self._check_vocabulary()
        self.drafter_cfg = self._drafter_config()
        self.samples = self._samples()  # only synthetic data builds the target here
        if cfg.data.fit:
            fit_to_data(self, self._notes.append, lambda x: self._notes.append("warning: " + x))

    # -- setup

    def _tokenizer(self):
        source = self.cfg.data.tokenizer or self.cfg.target.path
        if source:
            try:
                return load_tokenizer(source)
            except TokenizerError as exc:
                key = "data.tokenizer" if self.cfg.data.tokenizer else "target.path"
                raise TrainConfigError(f"{key}: {exc}") from None
        if self.cfg.target.preset == "tiny":
            return build_tiny_tokenizer()
        return None  # random-weight large presets train on token ids only

    def _check_vocabulary(self) -> None:
        """A tokenizer with more ids than the target's embedding has rows makes token ids
        the target cannot look up: an index error (a device-side assert on GPUs) at the
        first batch holding one, or silently wrong training where none does. Refused
        here, before the target's weights are read."""
        if self.tokenizer is None:
            return
        ids = len(self.tokenizer)
        vocab = int(self.target_config.vocab_size)
        if ids > vocab:
            source = self.cfg.data.tokenizer or self.cfg.target.path
            raise TrainConfigError(
                f"data.tokenizer: the tokenizer ({source}) has {ids} tokens but the target's "
                f"vocabulary has {vocab} (vocab_size): token ids {vocab} to {ids - 1} have no "
                "embedding. Use the target's own tokenizer (leave data.tokenizer empty to "
                "take it from target.path) or a target whose vocab_size is at least "
                f"{ids}"
            )

    def _drafter_config(self) -> DrafterConfig:
        d = self.cfg.drafter
        mask_id = d.mask_token_id
        if mask_id is None and self.tokenizer is not None:
            found = self.tokenizer.convert_tokens_to_ids("<|MASK|>")
            mask_id = (
                found if isinstance(found, int) and found != self.tokenizer.unk_token_id else None
            )
        if mask_id is None:
            vocab = int(self.target_config.vocab_size)
            mask_id = QWEN3_MASK_ID if vocab > QWEN3_MASK_ID else vocab - 1
        try:
            return DrafterConfig.from_target_config(
                self.target_config,
                num_layers=d.num_layers,
                block_size=d.block_size,
                mask_token_id=mask_id,
                gamma=d.gamma or None,
                intermediate_size=d.intermediate_size,
            )
        except ValueError as exc:
            raise TrainConfigError(f"drafter: {exc}") from None

    def _samples(self) -> list[Sample]:
        data = self.cfg.data
        started = time.perf_counter()
        if data.source == "synthetic":
            self._say(
                f"start-up: building the target ({self.cfg.target.path or self.cfg.target.preset}) "
                f"and generating {data.num_samples} samples with it"
            )
            response = data.seq_len - data.prompt_len  # >= 2 blocks: checked by the config
            high = (
                self.drafter_cfg.mask_token_id
                if self.tokenizer is None
                else len(self.tokenizer) - 4
            )
            samples = synthetic_samples(
                self.target_for(self.cfg.runtime.target_devices[0]),
                num_samples=data.num_samples,
                prompt_len=data.prompt_len,
                response_len=response,
                seed=self.cfg.target.seed,
                max_token_id=high,
            )
            what = f"{len(samples)} synthetic samples (target continues random prompts)"
        elif data.source == "random":
            gen = torch.Generator().manual_seed(self.cfg.target.seed)
            ids = torch.randint(
                0, self.drafter_cfg.mask_token_id, (data.num_samples, data.seq_len), generator=gen
            )
            samples = [Sample(row, [True] * data.seq_len) for row in ids.tolist()]
            what = f"{len(samples)} random-token samples (throughput only)"
        else:
            path = Path(data.source)
            self._say(f"start-up: reading and tokenizing {path}")
            samples, stats = self._load_file(
                path,
                f"data.source: {path} is not a file (or synthetic / random)",
                "data.source is a file but no tokenizer: set data.tokenizer or target.path",
            )
            what = (
                f"{stats.kept} samples from {path} ({stats.too_few_loss_tokens} with too few loss tokens "
                f"and {stats.unrenderable} unrenderable dropped)"
            )
            if not samples:
                raise TrainConfigError(f"data.source: no usable samples in {path}")
            samples, self.heldout = self._split_holdout(samples)
            if self.heldout:
                what += f", {len(self.heldout)} of them held out for eval"
        samples, self.walk_set = self._walk_set(samples)
        if self.walk_set is not None and self.walk_set.label == HELDOUT:
            what += f", {self.walk_set.size} held out for the tau walk"
        self._notes.append(f"data: {what} in {time.perf_counter() - started:.1f} s")
        if self.cfg.eval.enabled and data.source not in ("synthetic", "random"):
            overlap = prompts_in_training(self.eval_prompts(), samples)
            if overlap:
                where = (
                    f"eval.source {self.cfg.eval.source}" if self.cfg.eval.source else "held-out"
                )
                raise TrainConfigError(
                    f"eval: {len(overlap)} of the {where} eval prompts (first: eval prompt "
                    f"{overlap[0]}) are also prompts of training samples in {data.source}: the eval "
                    "would measure what the drafter memorised, not what serving sees; remove them "
                    "from one of the files (or deduplicate data.source)"
                )
        return samples

    def _load_file(self, path: Path, not_a_file: str, no_tokenizer: str):
        """Samples of a .jsonl/.txt file, tokenized and cut like the training data."""
        if not path.is_file():
            raise TrainConfigError(not_a_file)
        if self.tokenizer is None:
            raise TrainConfigError(no_tokenizer)
        return load_samples(
            path,
            self.tokenizer,
            max_length=self.cfg.data.seq_len,
            block_size=self.cfg.drafter.block_size,
        )

    def _split_holdout(self, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
        """(training samples, held-out samples): a seeded choice, the same in every process."""
        ev = self.cfg.eval
        count = ev.holdout
        if count is None:
            count = ev.num_prompts if ev.enabled and not ev.source else 0
        if count == 0:
            return samples, []
        # Whole prompts: one answer each is an eval prompt, the others leave training too.
        keep, held = split_by_prompt(samples, count, self.cfg.seed * 7_919 + 17)
        if not keep:
            raise TrainConfigError(
                f"eval.holdout: {count} held-out prompts leave none of the {len(samples)} "
                "samples to train on; lower eval.holdout or set eval.source to a separate file"
            )
        return keep, [group[0] for group in held]

    def _walk_set(self, samples: list[Sample]) -> tuple[list[Sample], WalkSet | None]:
        """(training samples, what the tau walk walks where not the batch): samples kept
        from training (train.tau_walk_heldout) or the eval prompts (train.tau_walk_eval)."""
        train = self.cfg.train
        if not train.tau_walk_rows:
            return samples, None
        if train.tau_walk_eval:
            prompts = self.eval_prompts()
            if prompts:
                answer = lambda: answered_prompts(  # noqa: E731
                    self.target_for(self.cfg.runtime.target_devices[0]),
                    prompts,
                    max_new_tokens=self.cfg.eval.max_new_tokens,
                    stop_token_ids=self._eval_stops(),
                    batch_size=self.cfg.eval.batch_size,
                    references=self.references,
                )
                return samples, WalkSet(EVAL_PROMPTS, answer=answer, size=len(prompts))
            self._notes.append(
                "warning: train.tau_walk_eval: no eval prompts (set eval.source, or keep "
                "eval.holdout samples); the tau walk runs on training batches"
            )
            return samples, None
        count = min(train.tau_walk_heldout, len(samples) // 10)
        if train.tau_walk_heldout and not count:
            self._notes.append(
                f"warning: train.tau_walk_heldout {train.tau_walk_heldout}: "
                f"{len(samples)} samples are too few to keep a tenth from training; the "
                "tau walk runs on training batches"
            )
        if not count:
            return samples, None
        samples, held = split_heldout(samples, count, self.cfg.seed)
        return samples, WalkSet(HELDOUT, held)

    def describe(self) -> list[str]:
        cfg = self.drafter_cfg
        trainable = self._count_drafter_params()
        run = self._target_layers_run()
        total = self.target_config.num_hidden_layers
        layers = f"{total} layers" if run == total else f"{total} layers, {run} run for the context"
        return [
            f"target: {self.cfg.target.path or 'random ' + self.cfg.target.preset} "
            f"({layers}, hidden {self.target_config.hidden_size}, "
            f"vocab {self.target_config.vocab_size}, {self.cfg.target.dtype})",
            f"drafter: {cfg.num_hidden_layers} layers, block {cfg.block_size}, target layers "
            f"{cfg.target_layer_ids}, mask id {cfg.mask_token_id}, gamma {cfg.gamma}, "
            f"{trainable / 1e6:.1f}M trainable parameters ({self.cfg.drafter.dtype}, fp32 master)",
            *self._notes,
        ]

    def _count_drafter_params(self) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in DFlashDrafter(self.drafter_cfg).parameters())

    # -- data

    def num_samples(self) -> int:
        return len(self.samples)

    def make_batch(self, sample_ids, generator, step, shard) -> Batch:
        pad = self.tokenizer.pad_token_id if self.tokenizer is not None else 0
        collated = collate(
            [self.samples[i] for i in sample_ids], self.seq_len, self.batch_size, pad or 0
        )
        anchors, valid = sample_anchors(
            collated.loss_mask, self.drafter_cfg.block_size, self.num_anchors, generator
        )
        return Batch(
            step=step,
            shard=shard,
            input_ids=collated.input_ids,
            attention_mask=collated.attention_mask,
            loss_mask=collated.loss_mask,
            anchors=anchors,
            anchor_valid=valid,
        )

    # -- target

    def build_target(self, device: torch.device) -> nn.Module:
        t = self.cfg.target
        if t.path:
            return load_target(t.path, device=device, dtype=self.target_dtype)
        return build_random_target(t.preset, device, self.target_dtype, t.seed, t.init_std)

    def target_context(self, target: nn.Module, batch: Batch) -> torch.Tensor:
        forward = self._context_forward(target, batch.input_ids.device)
        return forward(batch.input_ids, batch.attention_mask).to(self.drafter_dtype)

    def _context_forward(self, target: nn.Module, device: torch.device) -> ContextForward:
        t, on_gpu = self.cfg.target, torch.device(device).type == "cuda"
        return context_forward(
            target,
            self.drafter_cfg.target_layer_ids,
            compile=self._target_compile() if on_gpu else False,  # CPU: eager
            fp8=t.fp8,
            fused=t.fused and on_gpu,  # CPU: exactly transformers' forward
        )

    def _target_compile(self) -> bool | str:
        # auto: only where the drafter compiles too (runtime.compile: eager asks for no
        # compile time; a small target's forward gains less than its compile costs)
        if self.cfg.target.compile == "auto" and self.cfg.runtime.compile == "eager":
            return False
        return self.cfg.target.compile

    def target_compiled(self, device: torch.device) -> bool:
        """Whether the target forward on `device` compiles (its thread warms it at the
        gate). "auto" counts where the forward may be written out; a target that is not
        runs eager after all, its warm-up then two plain forwards."""
        compile = self._target_compile()
        if torch.device(device).type != "cuda":
            return False
        return compile is True or (compile == "auto" and self.cfg.target.fused)

    def target_forward_text(self, target: nn.Module, device: torch.device) -> str:
        return self._context_forward(target, device).describe()

    def warm_target(self, target: nn.Module, device: torch.device) -> None:
        self._context_forward(target, device).warm(self.batch_size, self.seq_len, device)

    # -- drafter

    def build_drafter(self, device: torch.device) -> nn.Module:
        device = torch.device(device)
        drafter = DFlashDrafter(self.drafter_cfg).to(device=device, dtype=self.drafter_dtype)
        embed, head = target_parts(self.target_for(device))
        return drafter.bind_target(embed, head)

    def loss_module(self, drafter: nn.Module) -> nn.Module:
        chunk = self.cfg.train.loss_chunk or 64
        d = self.cfg.drafter
        return DrafterLoss(drafter, chunk, d.attention, d.attention_chunk)

    def example_inputs(self, device: torch.device) -> DrafterInputs:
        """Production shapes: made on the CPU (no GPU random numbers while others may capture).

        The context is the big one (an 8B target at batch 16 x 8192: 2.7G values), so one
        sequence's worth is drawn, in the drafter's dtype, and repeated on the device:
        warm-up needs the shapes, not distinct values."""
        b, s, a = self.batch_size, self.seq_len, self.num_anchors
        cfg = self.drafter_cfg
        gen = torch.Generator().manual_seed(12345)
        one = torch.randn(
            1, s, cfg.num_context_layers * cfg.hidden_size, generator=gen, dtype=self.drafter_dtype
        )
        context = one.to(device).expand(b, -1, -1).contiguous()
        ids = torch.randint(0, cfg.mask_token_id, (b, s), generator=gen)
        loss_mask = torch.ones(b, s, dtype=torch.bool)
        anchors, valid = sample_anchors(loss_mask, cfg.block_size, a, gen)
        return DrafterInputs(
            step=-1,
            shard=-1,
            context=context,
            input_ids=ids.to(device),
            anchors=anchors.to(device),
            anchor_valid=valid.to(device),
            loss_mask=loss_mask.to(device),
        )

    def tau_estimate(self, metrics: dict) -> float:
        if "accept_len" in metrics:  # teacher-forced acceptance length, measured directly
            return float(metrics["accept_len"])
        return expected_acceptance_length(metrics.get("per_slot_acc", []))

    def serving_estimate(self, metrics: dict) -> tuple[float, float] | None:
        if "first_miss" not in metrics:
            return None
        block = self.drafter_cfg.block_size
        blocks = blocks_per_token(metrics["first_miss"], metrics["full_accept"], block)
        return None if blocks is None else (1.0, blocks)

    def serving_tau(self, drafter: nn.Module, inputs: DrafterInputs) -> float | None:
        rows = self.cfg.train.tau_walk_rows
        if not rows:
            return None
        context, input_ids, loss_mask = inputs.context, inputs.input_ids, inputs.loss_mask
        if self.walk_set is not None:
            target = self.target_for(self.cfg.runtime.target_devices[0])
            context, input_ids, loss_mask = walk_inputs(
                self.walk_set.take(rows),
                target,
                self.drafter_cfg.target_layer_ids,
                self._pad_id(),
                like=inputs.context,
            )
        # The eager drafter, as it is (no dropout to switch off; a mode switch would
        # change what the compiled loss was guarded on).
        return walk_tau(
            drafter,
            context,
            input_ids,
            loss_mask,
            rows=rows,
            head_chunk=self.cfg.train.loss_chunk or 64,
        )

    def prepare_walk(self) -> str | None:
        return None if self.walk_set is None else self.walk_set.prepare()

    @property
    def walk_set_label(self) -> str:
        return "" if self.walk_set is None else self.walk_set.label

    @property
    def walks_at_the_end(self) -> bool:
        return self.walk_set is not None and self.walk_set.label == EVAL_PROMPTS

    @property
    def walks_to_cover(self) -> int:
        rows = self.cfg.train.tau_walk_rows
        return 1 if self.walk_set is None else self.walk_set.walks_to_cover(rows)

    def _pad_id(self) -> int:
        return (self.tokenizer.pad_token_id if self.tokenizer is not None else 0) or 0

    def _target_layers_run(self) -> int:
        first = torch.device(self.cfg.runtime.target_devices[0])
        return layers_run_for_context(self.target_for(first), self.drafter_cfg.target_layer_ids)

    def flops_per_batch(self) -> float:
        """Useful FLOPs of one drafter batch: target forward (no LM head) + drafter fwd+bwd."""
        drafter = drafter_flops(self.drafter_cfg, self.batch_size, self.seq_len, self.num_anchors)
        return self.target_flops_per_batch() + drafter

    def target_flops_per_batch(self) -> float:
        """The target forward (no LM head, the layers it runs, causal attention)."""
        return target_flops(
            self.target_config, self._target_layers_run(), self.batch_size, self.seq_len
        )

    # -- end of run

    def evaluate(self, drafter: nn.Module) -> EvalResult | None:
        """The in-memory drafter (a run without a final checkpoint)."""
        return self.evaluate_drafter(drafter, self.target_for(_device_of(drafter)))

    def evaluate_checkpoint(self, folder: Path) -> EvalResult | None:
        """The checkpoint as saved, read back from disk: what a fresh process would measure."""
        return evaluate_checkpoint(self, folder, torch.device(self.cfg.runtime.drafter_devices[0]))

    def evaluate_drafter(self, drafter: nn.Module, target: nn.Module) -> EvalResult | None:
        ev = self.cfg.eval
        prompts = self.eval_prompts()
        if not prompts:
            return None
        return evaluate(
            drafter,
            target,
            prompts,
            max_new_tokens=ev.max_new_tokens,
            stop_token_ids=self._eval_stops(),
            batch_size=ev.batch_size,
            references=self.references,
        )

    def _eval_stops(self) -> list[int] | None:
        """A data file's answers end at the tokenizer's EOS; synthetic ones run to length."""
        if self.tokenizer is None or self.cfg.data.source in ("synthetic", "random"):
            return None
        return [self.tokenizer.eos_token_id]

    def eval_prompts(self) -> list[list[int]]:
        """Prompts never trained on: another seed (synthetic data), the held-out samples of a
        data file, or `eval.source`. A sample whose loss starts at its first token (plain
        text) is prompted with its first `eval.prompt_tokens` tokens (at most half of it)."""
        data, ev = self.cfg.data, self.cfg.eval
        if ev.source:
            path = Path(ev.source)
            held, _ = self._load_file(
                path,
                f"eval.source: {path} is not a file",
                "eval.source needs a tokenizer: set data.tokenizer or target.path",
            )
        elif data.source in ("synthetic", "random"):
            high = (
                self.drafter_cfg.mask_token_id
                if self.tokenizer is None
                else len(self.tokenizer) - 4
            )
            gen = torch.Generator().manual_seed(
                self.cfg.target.seed + 7777
            )  # held out: another seed
            return torch.randint(0, high, (ev.num_prompts, data.prompt_len), generator=gen).tolist()
        else:
            held = self.heldout
        prompts = []
        for sample in held[: ev.num_prompts]:
            if sample.prompt_ids:  # chat: what a server sends (see Sample.prompt_ids)
                prompts.append(list(sample.prompt_ids))
                continue
            first_loss = next(
                (i for i, m in enumerate(sample.loss_mask) if m), len(sample.input_ids)
            )
            if first_loss == 0:  # plain text: every token is in the loss
                first_loss = min(ev.prompt_tokens, len(sample.input_ids) // 2)
            if first_loss:
                prompts.append(sample.input_ids[:first_loss])
        return prompts

    def save_drafter(self, drafter: nn.Module, folder: Path) -> None:
        save_drafter(drafter, folder, dtype=DTYPES[self.cfg.train.export_dtype])

    def export_weights(self, weights: dict[str, torch.Tensor], folder: Path) -> None:
        save_drafter_weights(
            weights, self.drafter_cfg, folder, dtype=DTYPES[self.cfg.train.export_dtype]
        )


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


EVAL_RESULTS = "eval.json"


def evaluate_checkpoint(
    workload: DFlashWorkload,
    folder: Path,
    device: torch.device,
    *,
    results_name: str = EVAL_RESULTS,
) -> EvalResult | None:
    """Evaluate the drafter saved in `folder` (a step folder holding drafter/, or a drafter
    folder) against the workload's target and held-out prompts; per-prompt results go to
    `folder/results_name`. The end of a run and `python -m dflash.evaluate` both come here."""
    folder = Path(folder)
    drafter_dir = folder / "drafter" if (folder / "drafter").is_dir() else folder
    saved_as = json.loads((drafter_dir / "config.json").read_text()).get("dtype", "float32")
    drafter = load_drafter(drafter_dir, device=device, dtype=DTYPES.get(saved_as, torch.float32))
    target = workload.target_for(device)
    drafter.bind_target(*target_parts(target))
    result = workload.evaluate_drafter(drafter, target)
    if result is None:
        return None
    saved = next(drafter.parameters()).dtype
    result.checkpoint = f"{folder} (drafter {str(saved).removeprefix('torch.')})"
    path = folder / results_name
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(result.to_dict(), indent=1) + "\n")
    os.replace(tmp, path)
    result.results_path = str(path)
    return result
