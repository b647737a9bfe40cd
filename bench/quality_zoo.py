"""bench_quality on a zoo: one recipe, untouched, on targets made differently.

    python bench/quality_zoo.py --scale gpu --out ./bench-zoo     # one H200, targets in parallel
    python bench/quality_zoo.py --scale tiny --out /tmp/zoo        # CPU, tiny (the tests)

Three targets, each with its own tokenizer, chat template, data and held-out prompts,
none of which the recipe was tuned on:
- code: the bench_quality target (Python standard library, "Continue this code", ChatML);
- chat: dialogues from templates whose answers end (several turns, a Phi-style template,
  `<|end|>` ends a turn), entities split so eval dialogues name words never trained on;
- docs: another size and vocabulary (twice the vocabulary, wider and deeper), prose: the
  standard library's docstrings, "### Question/### Answer" template, `</s>` ends.

Per target, in its own process (they share the GPU: each gets less than a whole one):
build the target, then the measured part, sized by the same RECIPE: regenerate its
prompts (regenerate.budget_minutes), train the drafter (train.budget_minutes, data.fit),
the trainer's final eval on the held-out prompts (tau, per-position acceptance,
lossless with near-ties counted), prompt lookup on the same prompts. Then, one row at a
time with the GPU to itself (zoo_cost.py), the eval's own cost: 32 prompts x 256 tokens
batched, and batch-1 speculative vs plain greedy tokens/s in the same process. One
table, a row per target, every goal judged in the run.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))
sys.path.insert(0, str(ROOT / "bench"))

from quality_target import (  # noqa: E402
    build_tokenizer,
    conversations,
    file_lines,
    log,
    split_files,
    stdlib_files,
    token_stream,
    train_target,
    write_jsonl,
)
from zoo_cost import add_eval_cost, cost_inputs  # noqa: E402

# The one recipe: every target gets exactly this (paths and devices aside). Budgets in
# minutes; seq_len and anchors are ceilings that data.fit brings down to the data.
RECIPE = {
    "gpu": {
        "drafter": {"num_layers": 3, "block_size": 16, "attention": "sdpa_chunked"},
        "data": {"seq_len": 1024, "batch_size": 16, "num_anchors": 512, "fit": True},
        "optim": {"lr": 6e-4, "warmup_ratio": 0.04, "min_lr_ratio": 0.1},
        "train": {
            "budget_minutes": 4.0,
            "log_every": 100,
            "tau_walk_rows": 32,  # all the eval prompts in each walk
            "tau_walk_eval": True,
        },
        "eval": {"num_prompts": 32, "max_new_tokens": 256, "every": 0, "batch_size": 32},
        # Up to 8 answers a prompt, the budget deciding: few prompts get more of the
        # target's text (the docs target has ~1,000), many get one each.
        "regenerate": {"budget_minutes": 1.75, "max_new_tokens": 256, "batch_size": 512,
                       "answers_per_prompt": 8},
        "dtype": "bfloat16",
        "compile": "eager",
    },
    "tiny": {
        "drafter": {"num_layers": 1, "block_size": 4, "attention": "sdpa_dense"},
        "data": {"seq_len": 256, "batch_size": 4, "num_anchors": 64, "fit": True},
        "optim": {"lr": 1e-2, "warmup_ratio": 0.04, "min_lr_ratio": 0.1},
        "train": {"budget_minutes": 0.25, "log_every": 2, "tau_walk_rows": 2,
                  "tau_walk_eval": True},
        "eval": {"num_prompts": 2, "max_new_tokens": 12, "every": 0, "batch_size": 2},
        "regenerate": {"budget_minutes": 0.2, "max_new_tokens": 16, "batch_size": 16,
                       "answers_per_prompt": 8},
        "dtype": "float32",
        "compile": "eager",
    },
}  # fmt: skip

# Targets: shape, tokenizer and how long the target itself trains (not in the budget:
# the target is the user's, made before the recipe runs).
GPU_TARGET = dict(
    target_max_steps=0, target_batch=64, target_len=512, target_check_every=100,
    target_patience=3, device="cuda:0", dtype="bfloat16", tokenizer_files=400,
    regen_tokens=256,
)  # fmt: skip
TINY_TARGET = dict(
    target_seconds=600, target_max_steps=40, target_batch=8, target_len=96,
    target_check_every=20, target_patience=2, device="cpu", dtype="float32",
    tokenizer_files=30, regen_tokens=16,
)  # fmt: skip
ZOO = {
    "gpu": {
        "code": dict(GPU_TARGET, vocab=4096, hidden=512, layers=8, heads=8, kv_heads=4,
                     ffn=1536, target_seconds=75, convs=60000, held=200, regen=12000,
                     prompt_lines=12, answer_lines=16),
        "chat": dict(GPU_TARGET, vocab=2048, hidden=384, layers=6, heads=6, kv_heads=2,
                     ffn=1024, target_seconds=60, convs=60000, held=200, regen=12000),
        "docs": dict(GPU_TARGET, vocab=8192, hidden=768, layers=10, heads=12, kv_heads=4,
                     ffn=2048, target_seconds=90, convs=30000, held=200, regen=12000),
    },
    "tiny": {
        "code": dict(TINY_TARGET, vocab=384, hidden=64, layers=4, heads=4, kv_heads=2,
                     ffn=128, convs=60, held=16, regen=8, prompt_lines=2, answer_lines=2),
        "chat": dict(TINY_TARGET, vocab=320, hidden=48, layers=3, heads=4, kv_heads=2,
                     ffn=96, convs=60, held=16, regen=8),
        "docs": dict(TINY_TARGET, vocab=448, hidden=96, layers=2, heads=4, kv_heads=2,
                     ffn=192, convs=60, held=16, regen=8),
    },
}  # fmt: skip

PHI = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
PHI_SPECIALS = ("<|pad|>", "<|user|>", "<|end|>", "<|mask|>")
QA = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '### Question:\n' + message['content'] + '\n\n' }}"
    "{% else %}{{ '### Answer:\n' + message['content'] + '</s>\n\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Answer:\n' }}{% endif %}"
)
QA_SPECIALS = ("<pad>", "<s>", "</s>", "<mask>")


# -- corpora: (tokenizer texts, target data, target held-out, regeneration prompts, eval) --------
def code_corpus(s: dict, eval_count: int):
    target_files, pool_files, held_files = split_files(stdlib_files())
    evals = conversations(held_files, eval_count, s, seed=2)
    never = frozenset(r["messages"][0]["content"] for r in evals)
    data = conversations(target_files, s["convs"], s, seed=3, avoid=never)
    pool = conversations(pool_files, s["regen"] + s["held"], s, 4, never)
    texts = [t for p in target_files[: s["tokenizer_files"]] if (t := _text(p))]
    return texts, data, pool[s["regen"] :], pool[: s["regen"]], evals


def _text(path: Path) -> str | None:
    lines = file_lines(path)
    return "\n".join(lines) if lines else None


def _identifiers(files: list[Path]) -> list[str]:
    found = set()
    for path in files:
        for line in file_lines(path) or []:
            word = line.strip().removeprefix("def ").split("(")[0]
            if line.lstrip().startswith("def ") and word.isidentifier() and 4 <= len(word) <= 14:
                found.add(word)
    return sorted(found)


def _dialogue(rng: random.Random, words: list[str]) -> dict:
    """One to three turns; every answer follows from its question and ends."""

    def turn() -> tuple[str, str]:
        w = rng.choice(words)
        a, b = rng.randrange(2, 99), rng.randrange(2, 99)
        picks = sorted(rng.sample(words, 3))
        kind = rng.randrange(5)
        if kind == 0:
            return (
                f"Tell me about the word {w}.",
                f"Sure. The word {w} has {len(w)} letters. Spelled backwards it is {w[::-1]}, "
                f"in upper case it is {w.upper()}, and it starts with the letter {w[0]}. "
                "Is there anything else you would like to know about it?",
            )
        if kind == 1:
            return (
                f"What is {a} plus {b}, and what is {a} times {b}?",
                f"Let me work it out. {a} plus {b} is {a + b}. {a} times {b} is {a * b}. "
                f"So the sum is {a + b} and the product is {a * b}. Happy to help with more sums.",
            )
        if kind == 2:
            shuffled = rng.sample(picks, 3)
            return (
                f"Please sort these words: {', '.join(shuffled)}.",
                f"Here they are in alphabetical order: {picks[0]}, {picks[1]}, {picks[2]}. "
                f"The first one is {picks[0]} and the last one is {picks[2]}. "
                "Let me know if you want them in reverse order too.",
            )
        if kind == 3:
            return (
                f"Write a Python function called {w} that returns {a}.",
                f"Here is the function you asked for:\n\ndef {w}():\n    return {a}\n\n"
                f"Calling {w}() returns {a}. You can change the value {a} to anything you need.",
            )
        return (
            f"Repeat the word {w} three times, then count to {a % 5 + 3}.",
            f"Of course. {w} {w} {w}. Now counting: "
            + ", ".join(str(i) for i in range(1, a % 5 + 4))
            + ". Done! That was the word three times and the count you asked for.",
        )

    messages = []
    for _ in range(rng.randrange(1, 4)):
        question, answer = turn()
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": answer},
        ]
    return {"messages": messages}


def chat_corpus(s: dict, eval_count: int):
    words = _identifiers(stdlib_files())
    random.Random(0).shuffle(words)
    cut = max(3, len(words) // 10)
    held_words, train_words = words[:cut], words[cut:]  # eval names words never trained on
    rng = random.Random(5)
    data = [_dialogue(rng, train_words) for _ in range(s["convs"] + s["held"] + s["regen"])]
    evals = [_dialogue(random.Random(9 + i), held_words) for i in range(eval_count)]
    texts = [m["content"] for r in data[:5000] for m in r["messages"]]
    regen = data[s["convs"] + s["held"] :]
    return texts, data[: s["convs"]], data[s["convs"] : s["convs"] + s["held"]], regen, evals


def _docstrings(files: list[Path], count: int, seed: int) -> list[dict]:
    out = []
    for path in files:
        text = _text(path)
        if text is None:
            continue
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                continue
            doc = ast.get_docstring(node) or ""
            lines = [x for x in doc.splitlines() if x.strip()]
            name = getattr(node, "name", path.stem)
            for told in (1, 2):  # the first line or two asked, the rest the answer
                if len(lines) < told + 2:
                    continue
                question = f"What does {name} in {path.stem} do? " + " ".join(lines[:told])
                answer = "\n".join(lines[told : told + 12])
                out.append(
                    {
                        "messages": [
                            {"role": "user", "content": question},
                            {"role": "assistant", "content": answer},
                        ]
                    }
                )
    random.Random(seed).shuffle(out)
    return out[:count]


def docs_corpus(s: dict, eval_count: int):
    target_files, pool_files, held_files = split_files(stdlib_files())
    evals = _docstrings(held_files, eval_count, seed=2)
    data = _docstrings(target_files, s["convs"], seed=3)
    pool = _docstrings(pool_files, s["regen"] + s["held"], seed=4)
    texts = [m["content"] for r in data for m in r["messages"]]
    # Docstrings are fewer than the pool asks for: the held-out share first, the rest answered.
    return texts, data, pool[: s["held"]], pool[s["held"] :], evals


CORPORA = {
    "code": (code_corpus, None, None),
    "chat": (chat_corpus, PHI, PHI_SPECIALS),
    "docs": (docs_corpus, QA, QA_SPECIALS),
}


# -- one target ---------------------------------------------------------------------------------
def prompt_key(record: dict) -> str:
    from dflash.regenerate import prompt_messages

    return json.dumps(prompt_messages(record), sort_keys=True)


def recipe_config(scale: str, target_dir: Path, data: Path, evals: Path, out: Path) -> dict:
    """The recipe as a trainer config: only paths and devices come from the target."""
    r = RECIPE[scale]
    device = "cuda:0" if scale == "gpu" else "cpu"
    return {
        "output_dir": str(out),
        "target": {"path": str(target_dir), "dtype": r["dtype"]},
        "drafter": {**r["drafter"], "dtype": r["dtype"]},
        "data": {**r["data"], "source": str(data)},
        "optim": r["optim"],
        "train": r["train"],
        "runtime": {
            "target_devices": [device],
            "drafter_devices": [device],
            "compile": r["compile"],
            "threads": 0 if scale == "gpu" else 2,
        },
        "eval": {**r["eval"], "enabled": True, "source": str(evals)},
        "regenerate": {**r["regenerate"], "device": device},
    }


REGENERATED = "regenerated.done"  # written once a target's regeneration is complete
PARTIAL = "partial.json"  # a row's results once its drafter is trained and evaluated


def run_fp8_twin(name: str, scale: str, out: Path, wait_s: float = 900.0) -> dict:
    """The recipe with target.fp8 on `name`'s own target and regenerated data (made by
    the bf16 row's process, waited for): the drafter trains on FP8 context and is
    evaluated, like every row, served against the bf16 target."""
    from bench_quality import prompt_lookup_tau, train_drafter_from
    from dflash.pipeline.train_config import config_from_dict

    twin, r = out.parent / name, RECIPE[scale]
    began = time.perf_counter()
    while not (twin / REGENERATED).exists():
        if time.perf_counter() - began > wait_s:
            raise SystemExit(f"{name}'s regeneration did not finish within {wait_s:.0f} s")
        time.sleep(2)
    out.mkdir(parents=True, exist_ok=True)
    results = json.loads((twin / REGENERATED).read_text())
    results["target"] = f"{name}+fp8"
    cfg = recipe_config(scale, twin / "target", twin / "regenerated.jsonl", twin / "eval.jsonl",
                        out / "drafter")  # fmt: skip
    cfg["target"]["fp8"] = True
    measured = time.perf_counter()
    results["drafter"] = train_drafter_from(
        results["target"], config_from_dict(cfg), out / "drafter"
    )
    results["budget_seconds"] = round(results["regen_seconds"] + time.perf_counter() - measured, 1)
    s_lookup = lookup_settings(cfg, r)
    results["prompt_lookup"] = prompt_lookup_tau(twin / "target", twin / "eval.jsonl", s_lookup)
    results["cost_inputs"] = cost_inputs(
        twin / "target", results["drafter"]["checkpoint"], twin, s_lookup
    )
    results["seconds"] = round(time.perf_counter() - began, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def lookup_settings(drafter_cfg: dict, r: dict) -> dict:
    return {
        "device": drafter_cfg["runtime"]["drafter_devices"][0],
        "dtype": r["dtype"],
        "eval_prompts": r["eval"]["num_prompts"],
        "eval_tokens": r["eval"]["max_new_tokens"],
        "block": r["drafter"]["block_size"],
    }


def run_target(name: str, scale: str, out: Path) -> dict:
    from bench_quality import prompt_lookup_tau, train_drafter_from
    from dflash.pipeline.train_config import config_from_dict
    from dflash.regenerate import run as regenerate

    s, r = ZOO[scale][name], RECIPE[scale]
    out.mkdir(parents=True, exist_ok=True)
    (out / PARTIAL).unlink(missing_ok=True)  # an earlier run's: not this one's
    began = time.perf_counter()
    corpus, template, specials = CORPORA[name]
    texts, data, held, regen_prompts, evals = corpus(s, 4 * r["eval"]["num_prompts"])
    target_dir = out / "target"
    target_dir.mkdir(exist_ok=True)
    extra = {"template": template, "specials": specials} if template else {}
    tokenizer = build_tokenizer([], s["vocab"], target_dir, texts=iter(texts), **extra)
    fits = lambda rec: len(token_stream(tokenizer, [rec])) <= r["data"]["seq_len"]  # noqa: E731
    # Held out means held out: no eval prompt is a prompt the target or drafter trains on.
    seen = {prompt_key(x) for x in data + regen_prompts}
    # ... and has a reference answer the trainer keeps (2 blocks of loss tokens at least).
    block = r["drafter"]["block_size"]

    def long_enough(rec: dict) -> bool:
        return len(tokenizer(rec["messages"][-1]["content"])["input_ids"]) >= 2 * block

    evals = [e for e in evals if fits(e) and long_enough(e) and prompt_key(e) not in seen]
    evals = evals[: r["eval"]["num_prompts"]]
    write_jsonl(out / "regen-prompts.jsonl", regen_prompts)
    write_jsonl(out / "eval.jsonl", evals)
    results: dict = {"target": name, "scale": scale, "shape": s}
    results["target_model"] = train_target(tokenizer, data, held, s, target_dir)
    log(f"[{name}] target | {results['target_model']} | {time.perf_counter() - began:.0f} s")

    measured = time.perf_counter()  # the recipe's part: regeneration + drafter, in the budget
    regen = out / "regenerated.jsonl"
    regen.unlink(missing_ok=True)
    drafter_cfg = recipe_config(scale, target_dir, regen, out / "eval.jsonl", out / "drafter")
    cfg = config_from_dict(drafter_cfg)
    cfg.regenerate.input, cfg.regenerate.output = str(out / "regen-prompts.jsonl"), str(regen)
    results["regenerate"] = regenerate(cfg, log=lambda x: log(f"[{name}] {x}"))
    results["regen_seconds"] = round(time.perf_counter() - measured, 1)
    (out / REGENERATED).write_text(json.dumps(results) + "\n")  # for an FP8 twin
    results["drafter"] = train_drafter_from(name, config_from_dict(drafter_cfg), out / "drafter")
    results["budget_seconds"] = round(time.perf_counter() - measured, 1)
    (out / PARTIAL).write_text(json.dumps(results) + "\n")  # what a deadline cannot take back
    s_lookup = lookup_settings(drafter_cfg, r)
    results["prompt_lookup"] = prompt_lookup_tau(target_dir, out / "eval.jsonl", s_lookup)
    (out / PARTIAL).write_text(json.dumps(results) + "\n")  # a later deadline keeps the ratio
    results["cost_inputs"] = cost_inputs(
        target_dir, results["drafter"]["checkpoint"], out, s_lookup
    )
    results["seconds"] = round(time.perf_counter() - began, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    return results


def partial_line(name: str, row: Path) -> str | None:
    """What a row stopped before its end (--deadline, a crash) had measured, once its
    drafter was trained and evaluated; None before that."""
    path = row / PARTIAL
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    d = r["drafter"]
    walk = d.get("heldout_tau")
    against = f", walk {walk:.2f} (eval {d['eval_tau'] / walk - 1:+.0%})" if walk else ""
    lookup, missing = "", "prompt lookup, eval cost"
    if "prompt_lookup" in r:
        tau = r["prompt_lookup"]["tau"]
        lookup, missing = f", {d['eval_tau'] / tau:.2f}x prompt lookup ({tau:.2f})", "eval cost"
    return (
        f"{name} before it stopped: eval tau {d['eval_tau']:.2f}{against}{lookup}, "
        f"{d['headline']}, {d['steps']} steps, regen + drafter {r['budget_seconds']:.0f} s; "
        f"not measured: {missing} (rerun the row with a later --deadline)"
    )


def _tau_estimate(d: dict) -> float:
    """The trainer's estimate of serving tau: the walk's on text never trained on (the
    recipe's: the eval prompts answered by the target) where there is one."""
    return d.get("heldout_tau") or d["train_tau"]


def goals_of(r: dict) -> dict:
    d, lookup = r["drafter"], r["prompt_lookup"]["tau"]
    ratio, times = d["eval_tau"] / _tau_estimate(d), d["eval_tau"] / lookup
    goals = {
        "eval tau >= 3.0": (round(d["eval_tau"], 2), d["eval_tau"] >= 3.0),
        ">= 1.5x prompt lookup": (round(times, 2), times >= 1.5),
        # against the walk on text never trained on (the recipe walks the eval prompts,
        # answered by the target, as training goes); the training rows' tau~ (printed
        # beside it) also measures what many epochs memorised
        "eval within 15% of tau~ (walk)": (f"{ratio - 1:+.0%}", abs(ratio - 1) <= 0.15),
        "lossless (near-ties counted)": (bool(d["lossless"]), bool(d["lossless"])),
        "regen + drafter <= 10 min (s)": (r["budget_seconds"], r["budget_seconds"] <= 600),
    }
    return {k: {"value": v, "met": met} for k, (v, met) in goals.items()}


def _same(c: dict) -> str:
    """Batch 1 against greedy: the same tokens, or where they part, near-ties or a bug."""
    if c["batch1_same_tokens"]:
        return "same tokens"
    ties, parted = c["batch1_parted_at_near_ties"], c["batch1_parted"]
    verdict = "lossless" if c["batch1_lossless"] else "NOT lossless"
    return f"{verdict}: {parted} of {c['batch1_prompts']} prompts part from greedy, {ties} at near-ties"


def table(rows: list[dict]) -> list[str]:
    lines = [
        f"{'target':<9}{'params':>7}{'vocab':>6}{'eval tau':>9}{'tau~':>6}{'walk':>6}"
        f"{'eval/walk':>10}"
        f"{'lookup':>7}{'x lookup':>9}{'steps':>6}{'regen':>6}{'budget s':>9}"
        f"{'eval s':>7}{'b1 x':>6}  lossless / goals"
    ]
    for r in rows:
        d, c, g = r["drafter"], r["eval_cost"], r["goals"]
        lookup = r["prompt_lookup"]["tau"]
        met = sum(v["met"] for v in g.values())
        lines.append(
            f"{r['target']:<9}{r['target_model']['params_M']:>6.1f}M{r['shape']['vocab']:>6}"
            f"{d['eval_tau']:>9.2f}{d['train_tau']:>6.2f}{d.get('heldout_tau') or 0:>6.2f}"
            f"{d['eval_tau'] / _tau_estimate(d):>10.2f}"
            f"{lookup:>7.2f}{d['eval_tau'] / lookup:>9.2f}{d['steps']:>6}"
            f"{r['regenerate']['answered']:>6}{r['budget_seconds']:>9.0f}{c['eval_seconds']:>7.1f}"
            f"{c['batch1_speedup']:>6.2f}  {d['headline']} / {met} of {len(g)} goals met"
        )
    for r in rows:
        c = r["eval_cost"]
        lines.append(
            f"{r['target']}: eval {c['eval_prompts']} x {c['eval_max_new_tokens']} in "
            f"{c['eval_seconds']} s (tau {c['eval_tau']}); accepted by position "
            f"{c['accepted_by_position']}; batch 1: speculative "
            f"{c['batch1_speculative_tokens_per_s']} tokens/s vs greedy "
            f"{c['batch1_greedy_tokens_per_s']} ({c['batch1_speedup']}x, {_same(c)}); "
            f"regenerated {r['regenerate']['answered']} answers, "
            f"{r['regenerate']['capped']} at the length cap"
        )
        lines.append(
            f"{r['target']} goals: "
            + "; ".join(
                f"{k} ({v['value']}) {'met' if v['met'] else 'NOT met'}"
                for k, v in r["goals"].items()
            )
        )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(RECIPE), default="gpu")
    parser.add_argument("--out", type=Path, default=Path("bench-zoo"))
    parser.add_argument("--target", choices=sorted(CORPORA), help="one target, in this process")
    parser.add_argument("--only", action="append", choices=sorted(CORPORA), help="a subset")
    parser.add_argument(
        "--fp8-twin",
        action="append",
        default=[],
        choices=sorted(CORPORA),
        help="also train this target's drafter with target.fp8 on the same target and data",
    )
    parser.add_argument("--fp8", action="store_true", help=argparse.SUPPRESS)  # a twin's process
    # a row's process under the parent: the eval cost is timed later, with the GPU to itself
    parser.add_argument("--defer-cost", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--deadline", type=float, default=3600.0, help="seconds before unfinished targets stop"
    )
    args = parser.parse_args(argv)
    if args.target:
        row = args.out / (f"{args.target}+fp8" if args.fp8 else args.target)
        (run_fp8_twin if args.fp8 else run_target)(args.target, args.scale, row)
        if not args.defer_cost:
            add_eval_cost(row)
        return 0
    names = args.only or sorted(CORPORA)
    twins = [n for n in args.fp8_twin if n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    left = lambda: max(1.0, args.deadline - (time.perf_counter() - began))  # noqa: E731
    # On the GPU the targets run side by side (small models leave most of an H200
    # idle); on CPU one after the other (two cores).
    parallel = args.scale == "gpu"
    procs, failed = {}, {}
    jobs = [(name, ["--target", name]) for name in names]
    jobs += [(f"{name}+fp8", ["--target", name, "--fp8"]) for name in twins]
    cmd = [sys.executable, __file__, "--scale", args.scale, "--out", str(args.out)]
    for job, flags in jobs:
        handle = (args.out / f"{job}.log").open("w")
        procs[job] = subprocess.Popen(cmd + flags + ["--defer-cost"], stdout=handle, stderr=handle)
        if not parallel and not flags[-1] == "--fp8":
            procs[job].wait()
    for name, proc in procs.items():
        failed[name] = _finished(proc, left())
    # Then each row's eval cost, one at a time: batch-1 rates taken beside another
    # target's training measure that training (zoo_cost.py says why).
    cost = [sys.executable, str(Path(__file__).with_name("zoo_cost.py"))]
    for name in [n for n, why in failed.items() if why is None]:
        with (args.out / f"{name}.log").open("a") as handle:
            proc = subprocess.Popen(cost + [str(args.out / name)], stdout=handle, stderr=handle)
            failed[name] = _finished(proc, left())
    for name, why in failed.items():
        if why:
            print((args.out / f"{name}.log").read_text()[-3000:], file=sys.stderr)
    rows = []
    for name, _ in jobs:
        if failed[name]:
            continue
        r = json.loads((args.out / name / "results.json").read_text())
        r["goals"] = goals_of(r)
        rows.append(r)
    summary = {"scale": args.scale, "recipe": RECIPE[args.scale], "rows": rows}
    summary["seconds"] = round(time.perf_counter() - began, 1)
    summary["stopped"] = {
        name: {"why": why, "measured": partial_line(name, args.out / name)}
        for name, why in failed.items()
        if why
    }
    (args.out / "zoo.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"one recipe ({json.dumps(RECIPE[args.scale])}), {len(rows)} targets")
    for line in table(rows):
        log(line)
    for name, why in failed.items():
        if why:
            log(f"{name}: FAILED ({why}): see {args.out / name}.log")
            if line := partial_line(name, args.out / name):
                log(line)
    log(f"total {summary['seconds']:.0f} s")
    return 1 if any(failed.values()) else 0


def _finished(proc: subprocess.Popen, timeout: float) -> str | None:
    """Wait for a row's process; None when it succeeded, else why it did not."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()  # past --deadline: the row is missing, the others still count
        proc.wait()
        return "killed at --deadline"
    return None if proc.returncode == 0 else f"exit status {proc.returncode}"


if __name__ == "__main__":
    raise SystemExit(main())
