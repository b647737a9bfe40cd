"""Measure the chunked loss's peak memory and a full drafter step at a given shape (CUDA).

    cd trainer && python -m dflash.probe_memory                 # Qwen3-8B shape
    cd trainer && python -m dflash.probe_memory --full-step     # plus drafter fwd+bwd, both attention backends
    cd trainer && python -m dflash.probe_memory --full-step --compile default

Loss rows are anchors x (B-1) for one sequence; the LM head is [vocab, hidden] in bf16.
Peaks are reported above what the inputs themselves hold.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from .chunked_ce import chunked_linear_cross_entropy, peak_logits_bytes
from .config import DrafterConfig
from .model import DFlashDrafter
from .objective import drafter_loss, sample_anchors

GIB = 1024**3


def _peak_of(fn, device) -> tuple[float, float]:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / GIB, (
        time.perf_counter() - started
    ) * 1e3


def probe_loss(args, device) -> None:
    rows = args.anchors * (args.block - 1)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (
        torch.randn(args.vocab, args.hidden, device=device, dtype=torch.bfloat16, generator=gen)
        * 0.02
    )
    hidden = torch.randn(
        rows, args.hidden, device=device, dtype=torch.bfloat16, generator=gen
    ).requires_grad_()
    labels = torch.randint(0, args.vocab, (rows,), device=device, generator=gen)
    row_w = torch.full((rows,), 1.0 / rows, device=device)
    full_fp32 = rows * args.vocab * 4 / GIB
    print(
        f"loss rows {rows} ({args.anchors} anchors x {args.block - 1} slots), vocab {args.vocab}, hidden {args.hidden}"
    )
    print(f"  full fp32 logits alone would be {full_fp32:.2f} GiB")

    def naive():
        logits = (hidden @ weight.t()).float()
        loss = (F.cross_entropy(logits, labels, reduction="none") * row_w).sum()
        loss.backward()

    for _ in range(2):
        peak, ms = _peak_of(naive, device)
    print(f"  unchunked (logits materialised): peak +{peak:.2f} GiB, {ms:.1f} ms fwd+bwd")
    for chunk in args.chunks:

        def chunked(chunk=chunk):
            loss, _ = chunked_linear_cross_entropy(
                hidden, weight, labels, row_w, chunk * (args.block - 1)
            )
            loss.backward()

        for _ in range(2):
            hidden.grad = None
            peak, ms = _peak_of(chunked, device)
        analytic = peak_logits_bytes(chunk * (args.block - 1), args.vocab) / GIB
        print(
            f"  loss_chunk {chunk:4d} anchors: peak +{peak:.2f} GiB (chunk logits {analytic:.2f} GiB analytic), {ms:.1f} ms fwd+bwd"
        )


def probe_step(args, device) -> None:
    target_cfg = dict(
        hidden_size=args.hidden,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=args.vocab,
        num_hidden_layers=36,
        rope_theta=1e6,
    )
    cfg = DrafterConfig.from_target_config(
        target_cfg, num_layers=5, block_size=args.block, mask_token_id=151669
    )
    drafter = DFlashDrafter(cfg).to(device=device, dtype=torch.bfloat16)
    embed = nn.Embedding(args.vocab, args.hidden).to(device=device, dtype=torch.bfloat16)
    head = nn.Linear(args.hidden, args.vocab, bias=False).to(device=device, dtype=torch.bfloat16)
    drafter.bind_target(embed, head)
    n, s = args.batch, args.seq_len
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 150000, (n, s), generator=gen).to(device)
    loss_mask = torch.ones(n, s, dtype=torch.bool, device=device)
    anchors, valid = sample_anchors(loss_mask.cpu(), args.block, args.anchors, gen)
    anchors, valid = anchors.to(device), valid.to(device)
    context = torch.randn(n, s, 5 * args.hidden, device=device, dtype=torch.bfloat16)
    print(
        f"drafter step: {drafter.num_trainable_parameters() / 1e9:.2f}B params, batch {n} x {s} tokens, "
        f"{int(valid.sum())} valid anchors of {args.anchors} per sequence (spacing >= B caps it at S/B)"
    )
    for attention in ("flex", "sdpa_dense"):

        def loss_fn(context, ids, anchors, valid, loss_mask, attention=attention):
            return drafter_loss(
                drafter,
                context,
                ids,
                anchors,
                valid,
                loss_chunk=args.chunks[-1],
                attention=attention,
                loss_mask=loss_mask,
            )

        compiled = torch.compile(loss_fn, mode=args.compile) if args.compile else loss_fn

        def step(compiled=compiled):
            loss, _ = compiled(context, ids, anchors, valid, loss_mask)
            loss.backward()

        label = f"{attention} ({'compiled ' + args.compile if args.compile else 'eager'})"
        try:
            started = time.perf_counter()
            for _ in range(args.repeats):
                drafter.zero_grad(set_to_none=True)
                peak, ms = _peak_of(step, device)
            print(
                f"  {label}: {ms:.1f} ms fwd+bwd, peak +{peak:.2f} GiB "
                f"({time.perf_counter() - started:.0f} s with warm-up)",
                flush=True,
            )
        except Exception as exc:  # report and go on to the other backend
            print(f"  {label}: failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        drafter.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument(
        "--chunks", type=lambda v: [int(x) for x in v.split(",")], default=[16, 32, 64, 128]
    )
    parser.add_argument("--full-step", action="store_true")
    parser.add_argument("--seq-len", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument(
        "--compile", default="", help="torch.compile mode for the loss (e.g. default)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("probe_memory measures CUDA memory; run it on a GPU machine")
    device = torch.device("cuda")
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name(device)}")
    probe_loss(args, device)
    if args.full_step:
        probe_step(args, device)


if __name__ == "__main__":
    main()
