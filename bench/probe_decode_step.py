"""Where a batched greedy decode step's time goes, on the zoo's target shapes.

    python bench/probe_decode_step.py [--shape docs|code|both|tiny] [--steps 64] [--profile]
                                      [--fresh-only] [--eval [--eval-tokens 256]]

Times per step: the one-prompt greedy (target.greedy_generate), the padded batched
greedy of the eval (decode_batch.greedy_generate_batch_padded) on 32 prompts of mixed
lengths, and the same 32 prompts cut to one length (no padding), so a slow step can be
put on the padding mask, the batch or the forward itself. docs (75.5M, 12 query heads on
4 key/value heads) stepped at 60 ms at batch 32 on an H100 against code's (29.4M, 8 on 4)
few ms; on the host both issue about as many ops at batch 32 as at 1, with one sync a
step, so `--profile` shows which GPU kernels (attention with a mask and 3 heads a group
among them) take the time.

The timed steps repeat shapes already decoded once (best of 3). The eval meets each
prompt-length set once, and its key/value length grows every step: a cost paid the first
time a shape is seen (an attention plan built per shape, say) shows only there. So the
probe also decodes fresh length sets once, cold against warm, with cuDNN attention left on
and as shipped (on 2026-12-07 an H100 stepped docs at 9-14 ms warm against ~60 ms in the
eval; cold, cuDNN attention cost +47.8 ms a step, so decoding now switches it off:
trainer/dflash/decode_attention.py). `--eval` times the zoo's eval cold the same two ways.

    python bench/probe_decode_step.py --shape docs --fresh-only --eval
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402

# quality_zoo.py's targets: (vocab, hidden, ffn, layers, query heads, key/value heads)
SHAPES = {
    "docs": (8192, 768, 2048, 10, 12, 4),
    "code": (4096, 512, 1536, 8, 8, 4),
    "tiny": (512, 64, 128, 2, 4, 2),  # the CPU smoke test's
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--fresh-only",
        action="store_true",
        help="only the fresh length sets (cold against warm, cuDNN left on and as shipped)",
    )
    parser.add_argument(
        "--eval",
        action="store_true",
        help="also time the zoo's eval (32 prompts, batch 32) cold, cuDNN on and as shipped",
    )
    parser.add_argument("--eval-tokens", type=int, default=256, help="new tokens a prompt")
    args = parser.parse_args(argv)
    import transformers
    from dflash.target import build_tiny_target

    began = time.perf_counter()
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = ["docs", "code"] if args.shape == "both" else [args.shape]
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
        # The set-up's own time: on 2026-12-07 a 60-second call ended before the fresh
        # lines, and nothing said whether building the target or the decoding took it.
        print(
            f"{name}: attention {target.config._attn_implementation}, built at "
            f"{time.perf_counter() - began:.1f} s",
            flush=True,
        )
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

    if not args.fresh_only:
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
    # Fresh length sets, decoded once (cold) then again (warm): a per-shape first-time cost,
    # with cuDNN attention left on (as before dflash/decode_attention.py) and as shipped.
    longest = [torch.randint(0, vocab, (700,), generator=gen).to(device) for _ in range(32)]
    greedy_generate_batch_padded(target, longest, 4 + args.steps)  # warms the allocator
    for round_, (what, shipped) in enumerate(switches(on_gpu)):
        fresh_gen = torch.Generator().manual_seed(100 + round_)
        fresh = [
            torch.randint(0, vocab, (n,), generator=fresh_gen).to(device)
            for n in torch.randint(301, 600, (32,), generator=fresh_gen).tolist()
        ]
        run = lambda n, fresh=fresh: greedy_generate_batch_padded(target, fresh, n)  # noqa: E731
        with decode_switch(shipped):
            cold = timed(run, 4 + args.steps)
            warm = min(timed(run, 4 + args.steps) for _ in range(2))
        extra = (cold - warm) / args.steps * 1000
        tail = f" ({what})" if what else ""
        print(
            f"{name}: batch 32 padded, lengths never decoded before{tail}: first run "
            f"{cold:.2f} s, again {warm:.2f} s: {extra:+.2f} ms a step the first time",
            flush=True,
        )
    if args.eval:
        eval_rounds(name, target, vocab, device, on_gpu, args.eval_tokens)
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


def switches(on_gpu: bool) -> list[tuple[str, bool]]:
    """(label, shipped): cuDNN attention left on through the decode, then as shipped."""
    if not on_gpu:
        return [("", True)]
    return [("cuDNN attention left on", False), ("as shipped: cuDNN attention off to decode", True)]


@contextlib.contextmanager
def decode_switch(shipped: bool):
    """As shipped, or with decoding's cuDNN switch made a no-op and cuDNN attention on."""
    import dflash.decode_attention as decode_attention

    if shipped:
        yield
        return
    was_switch, was_on = decode_attention._switch, torch.backends.cuda.cudnn_sdp_enabled()
    decode_attention._switch = lambda: None
    torch.backends.cuda.enable_cudnn_sdp(True)
    try:
        yield
    finally:
        decode_attention._switch = was_switch
        torch.backends.cuda.enable_cudnn_sdp(was_on)


def eval_rounds(name, target, vocab, device, on_gpu, tokens: int) -> None:
    """The zoo's eval, timed cold: 32 prompts of 16-32 tokens, 256 new tokens, batch 32,
    speculative (an untrained 3-layer drafter, block 16: nearly every block rejected, so
    the most verify steps an eval can take) and its greedy reference, fresh prompts each
    round so no shape was met before."""
    from dflash import DFlashDrafter, DrafterConfig, target_parts
    from dflash.spec_decode import evaluate

    layers = 3 if target.config.num_hidden_layers >= 6 else 1  # the CPU smoke shape has 2
    cfg = DrafterConfig.from_target_config(
        target.config, num_layers=layers, block_size=16, mask_token_id=vocab - 1
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).bind_target(*target_parts(target)).to(device, target.dtype)
    drafter.eval()
    for round_, (what, shipped) in enumerate(switches(on_gpu)):
        gen = torch.Generator().manual_seed(200 + round_)
        prompts = [
            torch.randint(0, vocab - 1, (n,), generator=gen).to(device)
            for n in torch.randint(16, 33, (32,), generator=gen).tolist()
        ]
        with decode_switch(shipped):
            if on_gpu:
                torch.cuda.synchronize()
            began = time.perf_counter()
            result = evaluate(drafter, target, prompts, max_new_tokens=tokens, batch_size=32)
            if on_gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
        tail = f" ({what})" if what else ""
        print(
            f"{name}: eval 32 prompts x {tokens} tokens, batch 32, cold{tail}: {seconds:.2f} s "
            f"(tau {result.tau:.2f}, {result.num_tokens} tokens, lossless {result.lossless})",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
