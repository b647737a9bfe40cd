"""The training's target forward alone: transformers' against the written-out one.

    python bench/bench_target_forward.py                       # GPU: Qwen3-8B shape, 8192 tokens
    python bench/bench_target_forward.py --preset tiny --seq-len 256   # CPU smoke run

Builds a random-weight target of the preset's shape and times, on the same weights and
the same token ids, one context forward (the layers the drafter reads, [1, 9, 17, 25, 33]
for the 8B drafter) per variant:

- `hf`: transformers' forward, eager (the trainer's forward before target.fused);
- `hf-compiled`: the same under torch.compile (static shapes, no CUDA graphs);
- `fused`, `fused-compiled`: `dflash.context_decoder.ContextDecoder`;
- `fp8`, `fp8-compiled`: the written-out forward with FP8 matmuls.

Prints milliseconds (median of --repeat), tokens/s, achieved TFLOP/s, the ratio to `hf`
and each variant's relative error against `hf`. The GPU alone, no drafter beside it:
bench_trainer.py measures the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402
from dflash.target import ContextForward, layers_run_for_context, target_context  # noqa: E402

VARIANTS = {
    "hf": dict(compile=False, fp8=False, fused=False),
    "hf-compiled": dict(compile=True, fp8=False, fused=False),
    "fused": dict(compile=False, fp8=False, fused=True),
    "fused-compiled": dict(compile=True, fp8=False, fused=True),
    "fp8": dict(compile=False, fp8=True, fused=True),
    "fp8-compiled": dict(compile=True, fp8=True, fused=True),
}


def target_flops(target, layers: int, tokens: int, seq_len: int) -> float:
    c = target.config
    h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // heads
    params = h * heads * hd * 2 + h * kv * hd * 2 + 3 * h * c.intermediate_size
    return 2.0 * params * layers * tokens + 2.0 * layers * tokens * seq_len * heads * hd


def timed(fn, repeat: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - began))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default=None, help="default: qwen3-8b on GPUs, tiny on CPU")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", default="1,9,17,25,33")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from dflash.target_presets import build_random_target

    cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if cuda else "cpu")
    preset = args.preset or ("qwen3-8b" if cuda else "tiny")
    dtype = torch.bfloat16 if cuda else torch.float32
    target = build_random_target(preset, device, dtype, 0, 0.02)
    depth = len(target.model.layers)
    layer_ids = [i for i in map(int, args.layers.split(",")) if i < depth] or [depth // 2]
    vocab = int(target.config.vocab_size)
    ids = torch.randint(
        0, min(1000, vocab), (args.batch, args.seq_len), generator=torch.Generator()
    )
    ids = ids.to(device)
    tokens = args.batch * args.seq_len
    flops = target_flops(target, layers_run_for_context(target, layer_ids), tokens, args.seq_len)
    reference = target_context(target, ids, None, layer_ids)
    print(
        f"target {preset} ({depth} layers, {layers_run_for_context(target, layer_ids)} run), "
        f"{tokens} tokens, layers {layer_ids}, {dtype}, {torch.__version__}, "
        f"{torch.cuda.get_device_name(0) if cuda else 'cpu'}",
        flush=True,
    )
    rows = []
    for name in args.variants.split(","):
        forward = ContextForward(target, layer_ids, **VARIANTS[name])
        began = time.perf_counter()
        with torch.no_grad():
            got = forward(ids, None)
            forward(ids, None)
        if cuda:
            torch.cuda.synchronize()
        first_s = time.perf_counter() - began
        error = float((got.float() - reference.float()).norm() / reference.float().norm())
        times = timed(lambda f=forward: f(ids, None), args.repeat, cuda)
        ms = statistics.median(times)
        rows.append(
            {
                "variant": name,
                "ms": round(ms, 2),
                "tokens_per_s": round(tokens / ms * 1000),
                "tflops": round(flops / ms / 1e9, 1),
                "rel_error": error,
                "first_two_calls_s": round(first_s, 1),
                "forward": forward.describe() or "transformers",
            }
        )
        print(
            f"{name:<16} {ms:8.2f} ms  {rows[-1]['tflops']:7.1f} TFLOP/s  rel err {error:.2e}  "
            f"(first two calls {first_s:.1f} s; {rows[-1]['forward']})",
            flush=True,
        )
        del forward
    base = next((r for r in rows if r["variant"] == "hf"), rows[0])
    print(f"\n{'variant':<16}{'ms':>9}{'TFLOP/s':>9}{'vs ' + base['variant']:>9}{'rel err':>10}")
    for r in rows:
        print(
            f"{r['variant']:<16}{r['ms']:>9.2f}{r['tflops']:>9.1f}"
            f"{base['ms'] / r['ms']:>8.2f}x{r['rel_error']:>10.1e}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
