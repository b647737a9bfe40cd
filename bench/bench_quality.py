"""Drafter quality on a real target: data file vs target-regenerated data, against prompt lookup.

    python bench/bench_quality.py --scale gpu --out ./bench-quality    # one H200: about 9-10 min
    python bench/bench_quality.py --scale tiny --out /tmp/bq            # CPU, tiny (the tests)

No downloads. In one run:
1. A corpus that ships with the machine: the Python standard library's sources, split
   by file into training files and held-out files.
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
import io
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "trainer"))

import torch  # noqa: E402

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INSTRUCTION = "Continue this Python code:\n"

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
        target_seconds=60,
        target_batch=64,
        target_len=512,
        prompt_lines=12,
        answer_lines=16,
        train_convs=4000,
        eval_prompts=32,
        regen_tokens=160,
        regen_batch=512,
        loop_prompts=2,
        seq_len=640,
        drafter_layers=3,
        block=16,
        anchors=32,
        batch=16,
        steps=1200,
        eval_every=600,
        eval_tokens=64,
        device="cuda:0",
        dtype="bfloat16",
        compile="eager",
        lr=6e-4,
        tokenizer_files=400,
    ),
    "tiny": dict(
        vocab=384,
        hidden=64,
        layers=4,
        heads=4,
        kv_heads=2,
        ffn=128,
        target_seconds=4,
        target_batch=8,
        target_len=96,
        prompt_lines=3,
        answer_lines=3,
        train_convs=40,
        eval_prompts=2,
        regen_tokens=16,
        regen_batch=16,
        loop_prompts=2,
        seq_len=96,
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
    ),
}


def log(line: str) -> None:
    print(line, flush=True)


# -- corpus ------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no Python sources under {root}")
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """Held out by file (a stable choice): no line of a held-out file is trained on."""
    rng = random.Random(0)
    shuffled = files[:]
    rng.shuffle(shuffled)
    cut = max(1, len(shuffled) // 10)
    return shuffled[cut:], shuffled[:cut]


def conversations(files: list[Path], count: int, s: dict, seed: int) -> list[dict]:
    """'Continue this code' conversations from windows of non-trivial lines."""
    rng = random.Random(seed)
    window = s["prompt_lines"] + s["answer_lines"]
    out, seen = [], set()
    order = files[:]
    rng.shuffle(order)
    for path in order * 50:
        if len(out) >= count:
            break
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        if len(lines) < window + 1:
            continue
        start = rng.randrange(0, len(lines) - window)
        chunk = lines[start : start + window]
        prompt = "\n".join(chunk[: s["prompt_lines"]])
        answer = "\n".join(chunk[s["prompt_lines"] :])
        if len(prompt.strip()) < 40 or len(answer.strip()) < 40 or prompt in seen:
            continue
        seen.add(prompt)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": INSTRUCTION + prompt},
                    {"role": "assistant", "content": answer},
                ]
            }
        )
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


# -- target ------------------------------------------------------------------------------------
def build_tokenizer(files: list[Path], vocab: int, folder: Path, s_files: int = 400):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def texts():
        for path in files[:s_files]:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tok.train_from_iterator(texts(), trainer=trainer)
    tok.add_special_tokens(list(SPECIALS))  # the last ids: <|MASK|> is vocab - 1
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>", "<|MASK|>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(folder)
    return fast


def train_target(tokenizer, records: list[dict], s: dict, folder: Path) -> dict:
    """A Qwen3-shaped LM trained for a fixed wall time on the rendered conversations."""
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    device = torch.device(s["device"])
    vocab = len(tokenizer)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["hidden"] // s["heads"],
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(device)
    stream: list[int] = []
    for record in records:
        text = tokenizer.apply_chat_template(record["messages"], tokenize=False)
        stream.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    data = torch.tensor(stream)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    length, batch = s["target_len"], s["target_batch"]
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _nothing()
    started, step, losses = time.perf_counter(), 0, []
    gen = torch.Generator().manual_seed(1)
    while time.perf_counter() - started < s["target_seconds"]:
        starts = torch.randint(0, len(data) - length - 1, (batch,), generator=gen)
        ids = torch.stack([data[i : i + length] for i in starts.tolist()]).to(device)
        warm = min(1.0, (step + 1) / 100)
        for group in optimizer.param_groups:
            group["lr"] = 1.5e-3 * warm
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % 100 == 0:
            losses.append(float(loss.detach()))
            log(
                f"target | step {step} | loss {losses[-1]:.3f} | {time.perf_counter() - started:.0f} s"
            )
    model = model.to(getattr(torch, s["dtype"]))
    model.generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        max_new_tokens=s["regen_tokens"],
    )
    model.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    return {
        "params_M": round(params / 1e6, 1),
        "steps": step,
        "final_loss": round(float(loss.detach()), 3),
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


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
    from dflash.dflash_workload import DFlashWorkload
    from dflash.pipeline.logging import RunLog
    from dflash.pipeline.run import train
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
            "train": {"steps": s["steps"], "log_every": max(1, s["steps"] // 20)},
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
            },
        }
    )

    class Tee(io.TextIOBase):
        def __init__(self, path: Path) -> None:
            self.file = path.open("w")

        def write(self, text: str) -> int:
            self.file.write(text)
            self.file.flush()
            sys.stdout.write(f"[{name}] " + text if text.strip() else text)
            sys.stdout.flush()
            return len(text)

    out.mkdir(parents=True, exist_ok=True)
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
    return {
        "train_tau": steps[-1]["tau"],
        "eval_tau": evals_[-1]["tau"],
        "eval_curve": [(e["step"], round(e["tau"], 3)) for e in evals_],
        "eval_line": result.eval_line,
        "lossless": evals_[-1]["lossless"],
        "tokens_per_target_forward": evals_[-1]["tokens_per_target_forward"],
        "seconds": round(seconds, 1),
        "checkpoint": str(result.checkpoint),
    }


# -- prompt lookup -----------------------------------------------------------------------------
def prompt_lookup_tau(target_dir: Path, evals: Path, s: dict) -> dict:
    """transformers' prompt-lookup decoding on the eval prompts: tokens per verifying
    forward (prefill left out, as eval tau counts it) and tokens per target forward."""
    from dflash.data import load_tokenizer
    from dflash.target import load_target

    target = load_target(target_dir, device=s["device"], dtype=getattr(torch, s["dtype"]))
    tokenizer = load_tokenizer(target_dir)
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    new_tokens = forwards = 0
    for line in evals.read_text().splitlines()[: s["eval_prompts"]]:
        messages = json.loads(line)["messages"][:1]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        calls[0] = 0
        with torch.no_grad():
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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=sorted(SCALES), default="gpu")
    parser.add_argument("--out", type=Path, default=Path("bench-quality"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a scale value, e.g. steps=2000",
    )
    args = parser.parse_args(argv)
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

    train_files, held_files = split_files(stdlib_files())
    target_dir = out / "target"
    target_dir.mkdir(exist_ok=True)
    tokenizer = build_tokenizer(train_files, s["vocab"], target_dir, s["tokenizer_files"])
    data = conversations(train_files, s["train_convs"], s, seed=1)
    trained = {r["messages"][0]["content"] for r in data}
    evals = [  # a held-out window can still repeat a training one (boilerplate): left out
        r
        for r in conversations(held_files, 2 * s["eval_prompts"], s, seed=2)
        if r["messages"][0]["content"] not in trained
    ][: s["eval_prompts"]]
    write_jsonl(out / "data.jsonl", data)
    write_jsonl(out / "eval.jsonl", evals)
    log(
        f"corpus | {len(train_files)} training files, {len(held_files)} held out | "
        f"{len(data)} conversations, {len(evals)} eval prompts | {time.perf_counter() - began:.0f} s"
    )
    results["target"] = train_target(tokenizer, data, s, target_dir)
    log(f"target | {results['target']} | {time.perf_counter() - began:.0f} s")

    regen = out / "regenerated.jsonl"
    for stale in (regen, out / "loop.jsonl"):
        stale.unlink(missing_ok=True)
    results["regenerate"] = regenerate_data(target_dir, out / "data.jsonl", regen, s)
    log(f"regenerate | {results['regenerate']} | {time.perf_counter() - began:.0f} s")

    for name, source in (("a-data-file", out / "data.jsonl"), ("b-regenerated", regen)):
        results[name] = train_drafter(name, target_dir, source, out / "eval.jsonl", out / name, s)
        log(f"drafter {name} | {results[name]} | {time.perf_counter() - began:.0f} s")
    results["prompt_lookup"] = prompt_lookup_tau(target_dir, out / "eval.jsonl", s)
    results["seconds"] = round(time.perf_counter() - began, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")

    lookup = results["prompt_lookup"]["tau"]
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
    log(f"{'prompt lookup':<16}{lookup:>9.2f}   (prompt_lookup_num_tokens={s['block'] - 1})")
    log(
        f"regenerate: {results['regenerate']['tokens_per_s']} tokens/s batched vs "
        f"{results['regenerate']['loop_tokens_per_s']} one prompt at a time "
        f"({results['regenerate']['speedup']}x)"
    )
    log(f"total {results['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
