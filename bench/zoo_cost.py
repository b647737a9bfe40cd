"""What a zoo row's eval costs and what speculative decoding buys at batch 1.

Timed alone: quality_zoo.py trains its targets side by side on one GPU, and a small
model's batch-1 decoding is bound by kernel launches and host syncs, so a measurement
taken while another target trains reads the other process's load (the 2026-12-07 H100
run read 0.94x at batch 1 for a drafter with eval tau 7.7 while docs trained beside it).
The parent runs this phase for one row at a time, after every target has finished.

    python bench/zoo_cost.py ROW_DIR     # adds "eval_cost" to ROW_DIR/results.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402


def eval_cost(target_dir: Path, checkpoint: str, out: Path, s: dict) -> dict:
    """What the eval costs and what speculative decoding buys, in one process: the
    batched eval (all prompts x max tokens, the greedy reference included), and at batch
    1 speculative decoding against the target's plain greedy decoding, tokens/s each."""
    from dflash.checkpoint import load_drafter
    from dflash.data import load_tokenizer
    from dflash.regenerate import prompt_messages
    from dflash.spec_decode import NEAR_TIE_MARGIN, _divergence, evaluate, speculative_generate
    from dflash.target import greedy_generate, load_target, target_parts

    device, dtype = s["device"], getattr(torch, s["dtype"])
    target = load_target(target_dir, device=device, dtype=dtype)
    drafter = load_drafter(Path(checkpoint) / "drafter", device=device, dtype=dtype)
    drafter.bind_target(*target_parts(target))
    drafter.eval()
    tokenizer = load_tokenizer(target_dir)
    prompts = []
    for line in (out / "eval.jsonl").read_text().splitlines()[: s["eval_prompts"]]:
        text = tokenizer.apply_chat_template(
            prompt_messages(json.loads(line)), tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    stops = [tokenizer.eos_token_id]
    kw = dict(max_new_tokens=s["eval_tokens"], stop_token_ids=stops)

    def timed(fn):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        value = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return value, time.perf_counter() - started

    evaluate(drafter, target, prompts[:2], batch_size=2, **kw)  # warm-up (kernels, allocator)
    batched, eval_s = timed(
        lambda: evaluate(drafter, target, prompts, batch_size=len(prompts), **kw)
    )
    few = [torch.tensor([p], device=device) for p in prompts[: max(1, len(prompts) // 4)]]
    with torch.no_grad():  # warm-up of both batch-1 paths: first-call costs are not rates
        greedy_generate(target, few[0], 2 * s["block"], stops)
        speculative_generate(drafter, target, few[0], 2 * s["block"], stops)
        greedy, greedy_s = timed(
            lambda: [greedy_generate(target, p, s["eval_tokens"], stops)[0] for p in few]
        )
        spec, spec_s = timed(
            lambda: [speculative_generate(drafter, target, p, s["eval_tokens"], stops) for p in few]
        )
    greedy_tokens = sum(len(g) for g in greedy)
    spec_tokens = sum(len(x.tokens) for x in spec)
    greedy_rate, spec_rate = greedy_tokens / greedy_s, spec_tokens / spec_s
    # Where batch 1 parts from greedy, the eval's judgement (untimed): a bf16 near-tie, or not.
    parted = []
    for i, (ids, g, x) in enumerate(zip(few, greedy, spec, strict=True)):
        if g != x.tokens:
            margins: list[float] = []
            with torch.no_grad():
                greedy_generate(target, ids, s["eval_tokens"], stops, margins=margins)
            parted.append(_divergence(i, x, g, margins, NEAR_TIE_MARGIN.get(dtype, 0.25)))
    return {
        "eval_prompts": len(prompts),
        "eval_max_new_tokens": s["eval_tokens"],
        "eval_seconds": round(eval_s, 2),
        "eval_tau": round(batched.tau, 3),
        "accepted_by_position": batched.accepted_by_position,
        "batch1_prompts": len(few),
        "batch1_greedy_tokens_per_s": round(greedy_rate, 1),
        "batch1_speculative_tokens_per_s": round(spec_rate, 1),
        "batch1_speedup": round(spec_rate / greedy_rate, 2),
        "batch1_same_tokens": not parted,
        "batch1_parted": len(parted),
        "batch1_parted_at_near_ties": sum(d.verdict.startswith("near-tie") for d in parted),
        "batch1_lossless": all(d.verdict.startswith("near-tie") for d in parted),
    }


def cost_inputs(target_dir: Path, checkpoint: str, evals_dir: Path, settings: dict) -> dict:
    """What `add_eval_cost` needs, kept in a row's results.json so another process runs it."""
    return {"target_dir": str(target_dir), "checkpoint": checkpoint,
            "evals_dir": str(evals_dir), "settings": settings}  # fmt: skip


def add_eval_cost(row_dir: Path) -> dict:
    """Measure the row in `row_dir` and write its results.json back with "eval_cost"."""
    path = row_dir / "results.json"
    results = json.loads(path.read_text())
    i = results["cost_inputs"]
    results["eval_cost"] = eval_cost(
        Path(i["target_dir"]), i["checkpoint"], Path(i["evals_dir"]), i["settings"]
    )
    path.write_text(json.dumps(results, indent=1) + "\n")
    return results


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/zoo_cost.py ROW_DIR (a quality_zoo row's folder)")
    add_eval_cost(Path(sys.argv[1]))
