"""Where a batched greedy decode step's time goes, on the zoo's docs shape (75.5M Qwen3).

    python bench/probe_decode_step.py [--steps 64] [--profile]

Times per step: the one-prompt greedy (target.greedy_generate), the padded batched
greedy of the eval (decode_batch.greedy_generate_batch_padded) on 32 prompts of mixed
lengths, and the same 32 prompts cut to one length (no padding), so a slow step can be
put on the padding mask, the batch or the forward itself.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv)
    import transformers
    from dflash.decode_batch import greedy_generate_batch_padded
    from dflash.target import greedy_generate
    from transformers import Qwen3Config, Qwen3ForCausalLM

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    config = Qwen3Config(
        vocab_size=8192,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=10,
        num_attention_heads=12,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).to(device, dtype).eval()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"attention {target.config._attn_implementation}, {device}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(30, 300, (32,), generator=gen).tolist()
    mixed = [torch.randint(0, 8192, (n,), generator=gen).to(device) for n in lengths]
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
        short, long = timed(fn, 4), timed(fn, 4 + steps)
        ms = (long - short) / steps * 1000
        print(f"{label}: {ms:.2f} ms a step", flush=True)

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
