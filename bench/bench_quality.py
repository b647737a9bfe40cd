"""Drafter quality on a real target: data file vs target-regenerated data, against prompt lookup.

    python bench/bench_quality.py --scale gpu --out ./bench-quality    # one H200: about 10 min
    python bench/bench_quality.py --scale tiny --out /tmp/bq            # CPU, tiny (the tests)

No downloads. In one run:
1. A corpus that ships with the machine: the Python standard library's sources, split
   by file three ways: the target's, a pool it never sees, held-out (quality_target.py).
2. A real target: its own byte-level BPE tokenizer (the `tokenizers` library) and ChatML
   chat template, and a Qwen3-shaped LM trained for a fixed time on conversations made
   from the training files ("Continue this code:" + lines -> the next lines), saved as
   a Hugging Face folder (bf16 on GPU).
3. Chat JSONL: conversations from the training files (data) and prompts from the
   held-out files (eval, never trained on).
4. `python -m dflash.regenerate`'s code: the target answers the training prompts
   (batched), timed against a one-prompt-at-a-time loop on the same prompts.
5. The drafter trained twice with the project's trainer, same config and steps: (a) on
   the data file, (b) on the regenerated file, with eval.every on the held-out prompts.
6. transformers' prompt-lookup decoding (`prompt_lookup_num_tokens`) on the same prompts.
Prints one table: eval tau (and its curve), train tau~, prompt lookup's tau, the
lossless headline. Writes results.json and the logs under --out.
"""

from __future__ import annotations

import argparse
import faulthandler
import io
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402
from quality_target import (  # noqa: E402  (bench/ is the script's folder)
    build_tokenizer,
    conversations,
    log,
    split_files,
    stdlib_files,
    token_stream,
    train_target,
    write_jsonl,
)

SCALES = {
    # vocab, hidden, layers, heads, kv heads, ffn; target training seconds; data sizes;
    # drafter layers, block, steps; eval prompts and new tokens.
    "gpu": dict(
        vocab=4096,
        hidden=512,
        layers=8,
        heads=8,
        kv_heads=4,
        ffn=1536,
        target_seconds=75,
        target_max_steps=0,  # 0: the wall time alone
        target_batch=64,
        target_len=512,
        target_convs=60000,
        target_held_convs=200,
        target_check_every=100,
        target_patience=3,
        prompt_lines=12,
        answer_lines=16,
        train_convs=4000,
        regen_convs=12000,
        eval_prompts=64,
        eval_batch=64,
        regen_tokens=128,
        regen_batch=512,
        loop_prompts=1,
        loop_eval_prompts=8,
        seq_len=640,
        drafter_layers=3,
        block=16,
        anchors=32,
        batch=16,
        steps=2500,
        eval_every=250,
        eval_tokens=128,  # as long as the regenerated answers: tau~ walks them whole
        device="cuda:0",
        dtype="bfloat16",
        compile="eager",
        lr=6e-4,
        tokenizer_files=400,
        walk_rows=16,
    ),
    "tiny": dict(
        vocab=384,
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn=128,
        target_seconds=600,  # a bound; target_max_steps ends it
        target_max_steps=60,
        target_batch=8,
        target_len=96,
        target_convs=200,
        target_held_convs=16,
        target_check_every=20,
        target_patience=2,
        prompt_lines=2,
        answer_lines=2,
        train_convs=40,
        regen_convs=40,
        eval_prompts=2,
        eval_batch=2,
        regen_tokens=16,
        regen_batch=16,
        loop_prompts=2,
        loop_eval_prompts=2,
        seq_len=160,
        drafter_layers=1,
        block=4,
        anchors=4,
        batch=4,
        steps=8,
        eval_every=4,
        eval_tokens=12,
        device="cpu",
        dtype="float32",
        compile="eager",
        lr=1e-2,
        tokenizer_files=30,
        walk_rows=2,
    ),
}


# -- regeneration ------------------------------------------------------------------------------
def regenerate_data(target_dir: Path, source: Path, output: Path, s: dict) -> dict:
    from dflash.pipeline.train_config import config_from_dict
    from dflash.regenerate import run

    def cfg(out: Path, batch: int, src: Path):
        return config_from_dict(
            {
                "target": {"path": str(target_dir), "dtype": s["dtype"]},
                "regenerate": {
                    "input": str(src),
                    "output": str(out),
                    "max_new_tokens": s["regen_tokens"],
                    "batch_size": batch,
                    "device": s["device"],
                },
            }
        )

    batched = run(cfg(output, s["regen_batch"], source), log=log)
    # The same code one prompt at a time, on the first few prompts: the baseline.
    few = output.with_name("loop-input.jsonl")
    lines = source.read_text().splitlines()[: s["loop_prompts"]]
    few.write_text("\n".join(lines) + "\n")
    loop = run(cfg(output.with_name("loop.jsonl"), 1, few), log=log)
    rate = lambda r: r["tokens"] / r["seconds"] if r["seconds"] else 0.0  # noqa: E731
    return {
        "prompts": batched["answered"],
        "tokens": batched["tokens"],
        "seconds": round(batched["seconds"], 1),
        "tokens_per_s": round(rate(batched)),
        "loop_tokens_per_s": round(rate(loop)),
        "speedup": round(rate(batched) / rate(loop), 1) if rate(loop) else None,
    }


# -- drafter training --------------------------------------------------------------------------
def train_drafter(name: str, target_dir: Path, data: Path, evals: Path, out: Path, s: dict) -> dict:
    from dflash.pipeline.train_config import config_from_dict

    device = s["device"]
    cfg = config_from_dict(
        {
            "output_dir": str(out),
            "target": {"path": str(target_dir), "dtype": s["dtype"]},
            "drafter": {
                "num_layers": s["drafter_layers"],
                "block_size": s["block"],
                "dtype": s["dtype"],
                "attention": "sdpa_chunked" if device.startswith("cuda") else "sdpa_dense",
            },
            "data": {
                "source": str(data),
                "seq_len": s["seq_len"],
                "batch_size": s["batch"],
                "num_anchors": s["anchors"],
            },
            "optim": {"lr": s["lr"], "warmup_ratio": 0.04, "min_lr_ratio": 0.1},
            "train": {
                "steps": s["steps"],
                "log_every": max(1, s["steps"] // 20),
                "tau_walk_rows": s["walk_rows"],
            },
            "runtime": {
                "target_devices": [device],
                "drafter_devices": [device],
                "compile": s["compile"],
                "threads": 0 if device.startswith("cuda") else 2,
            },
            "eval": {
                "enabled": True,
                "source": str(evals),
                "num_prompts": s["eval_prompts"],
                "max_new_tokens": s["eval_tokens"],
                "every": s["eval_every"],
                "batch_size": s["eval_batch"],
            },
        }
    )

    return train_drafter_from(name, cfg, out)


def train_drafter_from(name: str, cfg, out: Path) -> dict:
    """Train the drafter `cfg` describes into `out` (a fresh run); its curves and eval."""
    from dflash.dflash_workload import DFlashWorkload
    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import train

    class Tee(io.TextIOBase):
        def __init__(self, path: Path) -> None:
            self.file = path.open("w")

        def write(self, text: str) -> int:
            self.file.write(text)
            self.file.flush()
            sys.stdout.write(f"[{name}] " + text if text.strip() else text)
            sys.stdout.flush()
            return len(text)

    # A fresh run each time: an earlier attempt's metrics.jsonl would be appended to
    # (its curves read twice) and its checkpoints continued.
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.perf_counter()
    result = train(cfg, DFlashWorkload(cfg), RunLog(Tee(out / "train.log")), handle_signals=False)
    seconds = time.perf_counter() - started
    if result.exit_code != 0:
        raise SystemExit(
            f"drafter run {name} failed (exit {result.exit_code}); see {out}/train.log"
        )
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    evals_ = [r for r in records if r["kind"] == "eval"]
    # Each step line walks a few rows; the last quarter of the run's lines (at least
    # three) average out which rows a line happened to draw.
    last = steps[-max(3, len(steps) // 4) :]
    # The walks on text never trained on (train.tau_walk_eval: the eval prompts answered
    # by the target; train.tau_walk_heldout: samples kept from training): the last walks
    # that take each of its rows once, the drafter nearest the one evaluated.
    walked = [r for r in steps if r.get("tau_walk_heldout") and r.get("tau_walk")]
    cover = (walked[-1].get("tau_walk_cover") or 1) if walked else 1
    held = [r["tau_walk"] for r in walked[-cover:]]
    return {
        "steps": steps[-1]["step"],
        "headline": result.eval_line.split(" | ")[2],
        "accepted_by_position": evals_[-1].get("accepted_by_position"),
        "train_tau": sum(r["tau"] for r in last) / len(last),
        "train_tau_anchors": sum(r.get("tau_anchors", r["tau"]) for r in last) / len(last),
        "heldout_tau": sum(held) / len(held) if held else None,
        "heldout_walks": len(held),
        "heldout_set": walked[-1].get("tau_walk_set") if walked else None,
        "heldout_step": walked[-1]["step"] if walked else None,
        "train_curve": [(r["step"], round(r["tau"], 3)) for r in steps],
        "eval_tau": evals_[-1]["tau"],
        "eval_curve": [(e["step"], round(e["tau"], 3)) for e in evals_],
        "eval_line": result.eval_line,
        "lossless": evals_[-1]["lossless"],
        "tokens_per_target_forward": evals_[-1]["tokens_per_target_forward"],
        "seconds": round(seconds, 1),
        "checkpoint": str(result.checkpoint),
    }


# What the target and the regenerated data depend on: a run with the same values may reuse them.
TARGET_KEYS = (
    "vocab hidden layers heads kv_heads ffn target_seconds target_max_steps "
    "target_batch target_len "
    "target_convs target_held_convs target_check_every target_patience prompt_lines "
    "answer_lines tokenizer_files device dtype"
).split()
REGEN_KEYS = ("regen_convs", "regen_tokens", "regen_batch", "loop_prompts")


def _earlier_results(out: Path, s: dict) -> dict:
    """The phases of an earlier run in `out` that this one may reuse (--reuse)."""
    try:
        earlier = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    settings = earlier.get("settings") or {}
    same = lambda keys: all(settings.get(k) == s[k] for k in keys)  # noqa: E731
    kept = {}
    if "target" in earlier and same(TARGET_KEYS) and (out / "target" / "config.json").is_file():
        kept["target"] = earlier["target"]
        regen = out / "regenerated.jsonl"
        if "regenerate" in earlier and same(REGEN_KEYS) and regen.is_file():
            kept["regenerate"] = earlier["regenerate"]
    return kept


# -- where the tau goes -----------------------------------------------------------------------
def where_tau_goes(target_dir: Path, train_file: Path, evals: Path, checkpoint: str, s: dict):
    """The final drafter's serving tau on prompts it WAS trained on (its own data file's
    first prompts) beside the held-out ones, and the held-out tau one prompt at a time
    (the batched eval's cross-check on this device). Trained-on close to tau~ while
    held-out stays low: the drafter learned its samples, not the target (too little
    distinct data); both low: serving differs from training."""
    from dflash.checkpoint import load_drafter
    from dflash.data import load_tokenizer
    from dflash.spec_decode import evaluate
    from dflash.target import load_target, target_parts

    device, dtype = s["device"], getattr(torch, s["dtype"])
    target = load_target(target_dir, device=device, dtype=dtype)
    drafter = load_drafter(Path(checkpoint) / "drafter", device=device, dtype=dtype)
    drafter.bind_target(*target_parts(target))
    tokenizer = load_tokenizer(target_dir)

    def prompts(path: Path) -> list[list[int]]:
        out = []
        for line in path.read_text().splitlines()[: s["eval_prompts"]]:
            text = tokenizer.apply_chat_template(
                json.loads(line)["messages"][:1], tokenize=False, add_generation_prompt=True
            )
            out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        return out

    stops = [tokenizer.eos_token_id]
    kw = dict(max_new_tokens=s["eval_tokens"], stop_token_ids=stops)
    seen = evaluate(drafter, target, prompts(train_file), batch_size=s["eval_batch"], **kw)
    walked, walked_rows = walk_training_rows(drafter, target, tokenizer, train_file, s)
    held = prompts(evals)
    batched = evaluate(drafter, target, held, batch_size=s["eval_batch"], **kw)
    few = held[: s["loop_eval_prompts"]]
    one = evaluate(drafter, target, few, batch_size=1, **kw)
    again = evaluate(drafter, target, few, batch_size=s["eval_batch"], **kw)
    return {
        "trained_prompts_tau": round(seen.tau, 3),
        "trained_rows_walk_tau": None if walked is None else round(walked, 3),
        "trained_rows_walked": walked_rows,
        "held_out_tau": round(batched.tau, 3),
        "one_at_a_time_tau": round(one.tau, 3),
        "batched_same_prompts_tau": round(again.tau, 3),
        "one_at_a_time_line": one.format_line(),
    }


def walk_training_rows(drafter, target, tokenizer, train_file: Path, s: dict):
    """tau~ as the trainer computes it (the serving walk, dflash/serving_walk.py) over the
    same first rows of the training file whose prompts `where_tau_goes` decodes: on the
    same text, the walk and real decoding must agree, so a gap between eval tau and
    train tau~ is then the prompts', not the measure's."""
    from dflash.data import collate, prepare_samples, read_records
    from dflash.serving_walk import walk_tau
    from dflash.target import target_context

    records = read_records(train_file)[: s["eval_prompts"]]
    samples, _ = prepare_samples(records, tokenizer, max_length=s["seq_len"], block_size=s["block"])
    if not samples:
        return None, 0
    batch = collate(samples, s["seq_len"], len(samples), tokenizer.pad_token_id).to(s["device"])
    with torch.no_grad():
        context = target_context(
            target, batch.input_ids, batch.attention_mask, drafter.cfg.target_layer_ids
        ).to(next(drafter.parameters()).dtype)
    tau = walk_tau(drafter, context, batch.input_ids, batch.loss_mask, rows=len(samples))
    return tau, len(samples)


# -- prompt lookup -----------------------------------------------------------------------------
def prompt_lookup_tau(target_dir: Path, evals: Path, s: dict) -> dict:
    """transformers' prompt-lookup decoding on the eval prompts: tokens per verifying
    forward (prefill left out, as eval tau counts it) and tokens per target forward."""
    from dflash.data import load_tokenizer
    from dflash.decode_attention import without_cudnn_attention
    from dflash.regenerate import prompt_messages
    from dflash.target import load_target

    target = load_target(target_dir, device=s["device"], dtype=getattr(torch, s["dtype"]))
    tokenizer = load_tokenizer(target_dir)
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    new_tokens = forwards = 0
    for line in evals.read_text().splitlines()[: s["eval_prompts"]]:
        messages = prompt_messages(json.loads(line))  # every turn before the last answer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        calls[0] = 0
        # Without cuDNN attention, as the drafter's eval decodes: it builds a plan per new
        # length, 48-136 ms a step cold on an H100 (dflash/decode_attention.py).
        with torch.no_grad(), without_cudnn_attention():
            out = target.generate(
                input_ids=ids.to(s["device"]),
                attention_mask=torch.ones_like(ids).to(s["device"]),
                max_new_tokens=s["eval_tokens"],
                do_sample=False,
                prompt_lookup_num_tokens=s["block"] - 1,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        new_tokens += out.shape[1] - ids.shape[1]
        forwards += calls[0]
    prompts = min(s["eval_prompts"], len(evals.read_text().splitlines()))
    verify = max(1, forwards - prompts)
    return {
        "tau": round((new_tokens - prompts) / verify, 3),
        "tokens_per_target_forward": round(new_tokens / max(1, forwards), 3),
    }


def main(argv=None) -> int:
    # One H200 run died of a segmentation fault as (a)'s training ended (the rerun did
    # not): the next one names its stack.
    faulthandler.enable()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    parser.add_argument(
        "--zoo",
        action="store_true",
        help="one recipe on three targets made differently (quality_zoo.py): a row each",
    )
    parser.add_argument("--out", type=Path, default=Path("bench-quality"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scale value, e.g. steps=2000",
    )
    parser.add_argument(
        "--only",
        choices=("a-data-file", "b-regenerated"),
        help="train one of the two drafters (a shorter diagnostic run: one line, no table)",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep the target and the regenerated data an earlier run left in --out with "
        "the same target and regeneration settings (drafter runs only)",
    )
    args = parser.parse_args(argv)
    if args.zoo:
        from quality_zoo import main as zoo

        return zoo(["--scale", args.scale, "--out", str(args.out)])
    s = dict(SCALES[args.scale])
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in s:
            parser.error(f"--set {item}: unknown key {key!r}; known: {', '.join(sorted(s))}")
        s[key] = type(s[key])(value)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    results: dict = {"scale": args.scale, "settings": s, "torch": torch.__version__}

    target_files, pool_files, held_files = split_files(stdlib_files())
    target_dir = out / "target"
    target_dir.mkdir(exist_ok=True)
    tokenizer = build_tokenizer(target_files, s["vocab"], target_dir, s["tokenizer_files"])
    # An eval conversation must fit the drafter's seq_len (the trainer drops what does not).
    fits = lambda r: len(token_stream(tokenizer, [r])) <= s["seq_len"]  # noqa: E731
    evals = [r for r in conversations(held_files, 4 * s["eval_prompts"], s, seed=2) if fits(r)]
    evals = evals[: s["eval_prompts"]]
    if not evals:
        raise SystemExit(f"no held-out conversation fits seq_len {s['seq_len']}: raise seq_len")
    never = frozenset(r["messages"][0]["content"] for r in evals)
    # The target's own training text: many distinct windows of its files, few passes each.
    target_data = conversations(target_files, s["target_convs"], s, seed=3, avoid=never)
    data = target_data[: s["train_convs"]]  # (a)'s data file: text the target was trained on
    pool = conversations(pool_files, s["regen_convs"] + s["target_held_convs"], s, 4, never)
    regen_prompts, target_held = pool[: s["regen_convs"]], pool[s["regen_convs"] :]
    write_jsonl(out / "data.jsonl", data)
    write_jsonl(out / "regen-prompts.jsonl", regen_prompts)
    write_jsonl(out / "eval.jsonl", evals)
    log(
        f"corpus | {len(target_files)} target files, {len(pool_files)} regeneration-pool files, "
        f"{len(held_files)} eval files | {len(target_data)} target conversations, "
        f"{len(data)} in the data file, {len(regen_prompts)} regeneration prompts, "
        f"{len(evals)} eval prompts | {time.perf_counter() - began:.0f} s"
    )
    earlier = _earlier_results(out, s) if args.reuse else {}
    if "target" in earlier:
        results["target"] = earlier["target"]
        log(f"target | reused from {out / 'results.json'} | {results['target']}")
    else:
        results["target"] = train_target(tokenizer, target_data, target_held, s, target_dir)
        log(f"target | {results['target']} | {time.perf_counter() - began:.0f} s")
    save = lambda: (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")  # noqa: E731
    save()  # after every phase: a run cut short still leaves what it measured

    regen = out / "regenerated.jsonl"
    if "regenerate" in earlier:
        results["regenerate"] = earlier["regenerate"]
        log(f"regenerate | reused {regen} | {results['regenerate']}")
    else:
        for stale in (regen, out / "loop.jsonl"):
            stale.unlink(missing_ok=True)
        results["regenerate"] = regenerate_data(target_dir, out / "regen-prompts.jsonl", regen, s)
        log(f"regenerate | {results['regenerate']} | {time.perf_counter() - began:.0f} s")
    save()

    for name, source in (("a-data-file", out / "data.jsonl"), ("b-regenerated", regen)):
        if args.only and name != args.only:
            continue
        results[name] = train_drafter(name, target_dir, source, out / "eval.jsonl", out / name, s)
        log(f"drafter {name} | {results[name]} | {time.perf_counter() - began:.0f} s")
        save()
        results[name]["where"] = where_tau_goes(
            target_dir, source, out / "eval.jsonl", results[name]["checkpoint"], s
        )
        log(
            f"where tau goes {name} | {results[name]['where']} | {time.perf_counter() - began:.0f} s"
        )
        save()
    results["prompt_lookup"] = prompt_lookup_tau(target_dir, out / "eval.jsonl", s)
    results["seconds"] = round(time.perf_counter() - began, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    lookup = results["prompt_lookup"]["tau"]
    if args.only:
        r = results[args.only]
        log(
            f"{args.only}: eval tau {r['eval_tau']:.2f}, train tau~ {r['train_tau']:.2f} "
            f"(anchors' mean {r['train_tau_anchors']:.2f}), {r['eval_tau'] / lookup:.2f}x "
            f"prompt lookup ({lookup:.2f}); eval curve {r['eval_curve']}; "
            f"train curve {r['train_curve']} | total {results['seconds']:.0f} s"
        )
        return 0
    log("")
    log(
        f"block {s['block']}, {s['drafter_layers']} draft layers, {s['steps']} steps, "
        f"{s['eval_prompts']} held-out prompts x {s['eval_tokens']} tokens"
    )
    log(
        f"{'drafter':<16}{'eval tau':>9}{'train tau~':>11}{'eval/train':>11}{'x lookup':>9}  headline"
    )
    for name in ("a-data-file", "b-regenerated"):
        r = results[name]
        headline = r["eval_line"].split(" | ")[2]
        log(
            f"{name:<16}{r['eval_tau']:>9.2f}{r['train_tau']:>11.2f}"
            f"{r['eval_tau'] / r['train_tau']:>11.2f}{r['eval_tau'] / lookup:>9.2f}  {headline}"
        )
        log(f"{'':<16}eval curve (step, tau): {r['eval_curve']}")
        log(
            f"{'':<16}train tau~ is the serving walk over training rows; the sampled anchors' "
            f"mean acceptance: {r['train_tau_anchors']:.2f}"
        )
        w = r["where"]
        log(
            f"{'':<16}serving tau on {s['eval_prompts']} prompts it trained on: "
            f"{w['trained_prompts_tau']:.2f} (tau~'s walk over those {w['trained_rows_walked']} "
            f"rows: {w['trained_rows_walk_tau']}), held out: {w['held_out_tau']:.2f}; "
            f"{s['loop_eval_prompts']} held-out one at a time {w['one_at_a_time_tau']:.2f} vs "
            f"batched {w['batched_same_prompts_tau']:.2f}"
        )
    log(f"{'prompt lookup':<16}{lookup:>9.2f}   (prompt_lookup_num_tokens={s['block'] - 1})")
    log(
        f"regenerate: {results['regenerate']['tokens_per_s']} tokens/s batched vs "
        f"{results['regenerate']['loop_tokens_per_s']} one prompt at a time "
        f"({results['regenerate']['speedup']}x)"
    )
    b = results["b-regenerated"]
    ratio, times_lookup = b["eval_tau"] / b["train_tau"], b["eval_tau"] / lookup
    goals = {  # name: (value, met)
        "eval tau >= 3.0": (round(b["eval_tau"], 2), b["eval_tau"] >= 3.0),
        "drafter run <= 10 min (s)": (round(b["seconds"]), b["seconds"] <= 600),
        "eval within 15% of train tau~": (f"{ratio - 1:+.0%}", abs(ratio - 1) <= 0.15),
        ">= 1.5x prompt lookup": (round(times_lookup, 2), times_lookup >= 1.5),
        "lossless yes": (bool(b["lossless"]), bool(b["lossless"])),
    }
    results["goals"] = {k: {"value": v, "met": met} for k, (v, met) in goals.items()}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    log(
        "goals, drafter (b): "
        + "; ".join(f"{k} ({v}) {'met' if met else 'NOT met'}" for k, (v, met) in goals.items())
    )
    log(f"total {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
