"""What one mid-run eval costs at the Qwen3-8B shape, and where the time goes.

    python bench/bench_eval_cost.py [--prompts 32] [--tokens 256] [--old PATH]
    python bench/bench_eval_cost.py --prompts 8 --tokens 48      # CPU: tiny-cpu.yaml
    python bench/bench_eval_cost.py --cudnn-both   # only the eval: as shipped, then cuDNN on

The trainer's eval (spec_decode.evaluate, batched) on random-weight Qwen3-8B-shape
target and 5-layer drafter (trainer/configs/qwen3-8b.yaml), random prompts of 64
tokens, no stop token: every row decodes all its tokens, and an untrained drafter is
the worst case (one token a verify step). Timed apart: the speculative pass and the
greedy reference pass (the lossless check), and with --old, the same with a decoder
file of an earlier commit (git show REV:trainer/dflash/decode_batch.py > PATH). Then
a run's first eval against a later one: the greedy reference is decoded once a run and
kept (the target is frozen), so later evals decode only speculatively.

--cudnn-both times only the eval, cold, on fresh prompts each time: as shipped (decoding
switches cuDNN attention off, trainer/dflash/decode_attention.py), then with cuDNN
attention left on as before 14c73c3 (probe_decode_step.py's switch), in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--old", type=Path, help="an earlier decode_batch.py to time beside")
    parser.add_argument(
        "--cudnn-both", action="store_true", help="only the eval: as shipped, then cuDNN left on"
    )
    args = parser.parse_args(argv)
    import dflash.spec_decode as spec_decode
    from dflash.dflash_workload import DFlashWorkload
    from dflash.pipeline.train_config import load_train_config

    on_gpu = torch.cuda.is_available()
    config = "qwen3-8b.yaml" if on_gpu else "tiny-cpu.yaml"
    cfg = load_train_config(ROOT / "trainer" / "configs" / config, ["data.num_samples=1"])
    device = torch.device("cuda:0" if on_gpu else "cpu")
    started = time.perf_counter()
    workload = DFlashWorkload(cfg)
    target = workload.target_for(device)
    torch.manual_seed(0)
    drafter = workload.build_drafter(device).eval()
    print(f"models built in {time.perf_counter() - started:.0f} s", flush=True)
    gen = torch.Generator().manual_seed(1)
    high = min(150000, workload.drafter_cfg.mask_token_id)
    prompts = torch.randint(0, high, (args.prompts, 64), generator=gen).to(device)
    prompts = list(prompts)

    def timed(fn):
        if on_gpu:
            torch.cuda.synchronize()
        began = time.perf_counter()
        value = fn()
        if on_gpu:
            torch.cuda.synchronize()
        return value, time.perf_counter() - began

    if args.cudnn_both:
        return cudnn_both(drafter, target, args, high, device, on_gpu, timed)
    decoders = {
        "now": (spec_decode.speculative_generate_batch, spec_decode.greedy_generate_batch_padded)
    }
    if args.old:
        spec = importlib.util.spec_from_file_location("dflash.decode_batch_old", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # dataclasses look their module up there
        spec.loader.exec_module(old)
        decoders["old"] = (old.speculative_generate_batch, old.greedy_generate_batch_padded)
    n = args.tokens
    with torch.no_grad():
        spec_decode.evaluate(drafter, target, prompts[:2], max_new_tokens=8, batch_size=2)  # warm
        for name, (speculative, greedy) in decoders.items():
            out, spec_s = timed(lambda s=speculative: s(drafter, target, prompts, n))
            _, greedy_s = timed(lambda g=greedy: g(target, prompts, n))
            steps = max(len(o.acceptance_lengths) for o in out)
            tau = sum(len(o.tokens) for o in out) / sum(1 + len(o.acceptance_lengths) for o in out)
            spec_decode.speculative_generate_batch = speculative
            spec_decode.greedy_generate_batch_padded = greedy
            result, eval_s = timed(
                lambda: spec_decode.evaluate(
                    drafter, target, prompts, max_new_tokens=n, batch_size=len(prompts)
                )
            )
            print(
                f"{name}: eval {args.prompts} x {n} in {eval_s:.1f} s (tau {result.tau:.2f}) = "
                f"speculative pass {spec_s:.1f} s ({steps} verify steps, "
                f"{1000 * spec_s / steps:.0f} ms a step, tokens per forward {tau:.2f}) + greedy "
                f"reference {greedy_s:.1f} s ({1000 * greedy_s / n:.0f} ms a token step)",
                flush=True,
            )
        # A run's first eval (references made) against a later one (references kept),
        # alternating, medians of 3.
        kept, firsts, laters, results = spec_decode.GreedyReferences(), [], [], []
        for _ in range(3):
            for refs, times in ((spec_decode.GreedyReferences(), firsts), (kept, laters)):
                kw = dict(max_new_tokens=n, batch_size=len(prompts), references=refs)
                result, seconds = timed(
                    lambda k=kw: spec_decode.evaluate(drafter, target, prompts, **k)
                )
                results.append(result.to_dict())
                times.append(seconds)
        assert all(r == results[0] for r in results)
        first_s, later_s = statistics.median(firsts), statistics.median(laters)
        print(
            f"a run's first eval {first_s:.2f} s, each later one {later_s:.2f} s "
            f"({first_s / later_s:.2f}x faster, the same result): the greedy reference is kept",
            flush=True,
        )
    return 0


def cudnn_both(drafter, target, args, high, device, on_gpu, timed) -> int:
    """The eval cold as shipped, then with cuDNN attention left on: fresh prompts each
    round (no attention plan built before), shipped first so the cuDNN round's plans are
    its own and it is the one that meets a warm allocator."""
    import dflash.spec_decode as spec_decode
    from probe_decode_step import decode_switch

    with torch.no_grad():
        spec_decode.evaluate(drafter, target, [torch.arange(8, device=device)] * 2,
                             max_new_tokens=8, batch_size=2)  # fmt: skip
        rounds = [("as shipped: cuDNN attention off to decode", True)]
        rounds += [("cuDNN attention left on", False)] if on_gpu else []
        seconds = {}
        for i, (label, shipped) in enumerate(rounds):
            gen = torch.Generator().manual_seed(10 + i)
            prompts = list(torch.randint(0, high, (args.prompts, 64), generator=gen).to(device))
            with decode_switch(shipped):
                result, seconds[shipped] = timed(
                    lambda p=prompts: spec_decode.evaluate(
                        drafter, target, p, max_new_tokens=args.tokens, batch_size=len(p)
                    )
                )
            print(
                f"eval {args.prompts} x {args.tokens}, batch {args.prompts}, cold ({label}): "
                f"{seconds[shipped]:.2f} s (tau {result.tau:.2f}, lossless {result.lossless})",
                flush=True,
            )
    if len(seconds) == 2:
        print(f"as shipped: {seconds[False] / seconds[True]:.2f}x faster than cuDNN left on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
