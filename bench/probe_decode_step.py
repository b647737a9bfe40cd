"""Where a batched greedy decode step's time goes, on the zoo's target shapes.

    python bench/probe_decode_step.py [--shape docs|code|both] [--steps 64] [--profile]

Times per step: the one-prompt greedy (target.greedy_generate), the padded batched
greedy of the eval (decode_batch.greedy_generate_batch_padded) on 32 prompts of mixed
lengths, and the same 32 prompts cut to one length (no padding), so a slow step can be
put on the padding mask, the batch or the forward itself. docs (75.5M, 12 query heads on
4 key/value heads) stepped at 60 ms at batch 32 on an H100 against code's (29.4M, 8 on 4)
few ms; on the host both issue about as many ops at batch 32 as at 1, with one sync a
step, so `--profile` shows which GPU kernels (attention with a mask and 3 heads a group
among them) take the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402

# quality_zoo.py's targets: (vocab, hidden, ffn, layers, query heads, key/value heads)
SHAPES = {"docs": (8192, 768, 2048, 10, 12, 4), "code": (4096, 512, 1536, 8, 8, 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    import transformers
    from dflash.target import build_tiny_target

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = list(SHAPES) if args.shape == "both" else [args.shape]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    for name in shapes:
        vocab, hidden, ffn, layers, heads, kv_heads = SHAPES[name]
        target = build_tiny_target(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=ffn,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=64,
            dtype=dtype,
        ).to(device)
        print(f"{name}: attention {target.config._attn_implementation}", flush=True)
        with torch.no_grad():
            probe(name, target, vocab, device, on_gpu, args)
        del target
    return 0


def probe(name, target, vocab, device, on_gpu, args) -> None:
    from dflash.decode_batch import greedy_generate_batch_padded
    from dflash.target import greedy_generate

    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(30, 300, (32,), generator=gen).tolist()
    mixed = [torch.randint(0, vocab, (n,), generator=gen).to(device) for n in lengths]
    even = [p[:30] for p in mixed]

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    def timed(fn, n):
        sync()
        began = time.perf_counter()
        fn(n)
        sync()
        return time.perf_counter() - began

    def per_step(label, fn, steps):
        # Two lengths of decode, the same prompts: the difference is the decode steps
        # alone, without the prefill both pay.
        fn(4)  # warm-up
        # Best of 3 each: a busy machine only ever adds time.
        short = min(timed(fn, 4) for _ in range(3))
        long = min(timed(fn, 4 + steps) for _ in range(3))
        ms = (long - short) / steps * 1000
        print(f"{name}: {label}: {ms:.2f} ms a step", flush=True)

    per_step("batch 1 greedy", lambda n: greedy_generate(target, mixed[0][None], n), args.steps)
    per_step(
        "batch 32 padded greedy (mixed lengths)",
        lambda n: greedy_generate_batch_padded(target, mixed, n),
        args.steps,
    )
    per_step(
        "batch 32 padded greedy (one length)",
        lambda n: greedy_generate_batch_padded(target, even, n),
        args.steps,
    )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
        with profile(activities=activities) as prof:
            greedy_generate_batch_padded(target, mixed, 16)
            sync()
        key = "cuda_time_total" if on_gpu else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
        print(
            prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=25, max_name_column_width=60
            )
        )


if __name__ == "__main__":
    sys.exit(main())
