"""The bench_quality target: a small Qwen3-shaped LM made on the machine, no downloads.

The Python standard library's sources split by file three ways (the target's training
files, a pool the target never sees whose prompts it answers for the regenerated data,
and the held-out eval files), a byte-level BPE tokenizer of their own, a ChatML chat
template, and the LM trained on conversations from the training files, kept at the step
where its loss on unseen text was lowest (a target that generalises, not one that
memorises). Used by bench_quality.py.
"""

from __future__ import annotations

import json
import random
import sysconfig
import time
from pathlib import Path

import torch

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
INSTRUCTION = "Continue this Python code:\n"


def log(line: str) -> None:
    print(line, flush=True)


# -- corpus ------------------------------------------------------------------------------------
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no Python sources under {root}")
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """(target's, regeneration pool, eval's held-out) files: three disjoint pools, by file
    (a stable choice). The target never sees a line of the other two, so regenerating on
    the pool shows the drafter what the target says on prompts it was not trained on,
    which is what the eval's held-out prompts ask of it."""
    rng = random.Random(0)
    shuffled = files[:]
    rng.shuffle(shuffled)
    held = max(1, len(shuffled) // 10)
    pool = max(1, len(shuffled) * 3 // 10)
    return shuffled[held + pool :], shuffled[held : held + pool], shuffled[:held]


_lines_of: dict[Path, list[str] | None] = {}


def file_lines(path: Path) -> list[str] | None:
    """A file's lines, read once (conversations take many windows of each file)."""
    if path not in _lines_of:
        try:
            _lines_of[path] = path.read_text(encoding="utf-8").splitlines()
        except (UnicodeDecodeError, OSError):
            _lines_of[path] = None
    return _lines_of[path]


def conversations(
    files: list[Path], count: int, s: dict, seed: int, avoid: frozenset = frozenset()
) -> list[dict]:
    """'Continue this code' conversations from windows of non-trivial lines; a window whose
    prompt is in `avoid` (boilerplate shared across files, e.g. an eval prompt) is skipped."""
    rng = random.Random(seed)
    window = s["prompt_lines"] + s["answer_lines"]
    out, seen = [], set()
    order = files[:]
    rng.shuffle(order)
    for path in order * max(50, 4 * count // max(1, len(files))):
        if len(out) >= count:
            break
        lines = file_lines(path)
        if lines is None or len(lines) < window + 1:
            continue
        start = rng.randrange(0, len(lines) - window)
        chunk = lines[start : start + window]
        prompt = "\n".join(chunk[: s["prompt_lines"]])
        answer = "\n".join(chunk[s["prompt_lines"] :])
        if len(prompt.strip()) < 40 or len(answer.strip()) < 40 or prompt in seen:
            continue
        if INSTRUCTION + prompt in avoid:
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
def build_tokenizer(
    files: list[Path],
    vocab: int,
    folder: Path,
    s_files: int = 400,
    *,
    texts=None,
    template: str = CHATML,
    specials: tuple[str, ...] = SPECIALS,
):
    """A byte-level BPE of `vocab` ids learnt from the files (or `texts`), with `specials`
    as its last ids (pad, turn start, end of turn, mask) and `template` as chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def file_texts():
        for path in files[:s_files]:
            try:
                yield path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue

    tok.train_from_iterator(texts if texts is not None else file_texts(), trainer=trainer)
    tok.add_special_tokens(list(specials))  # the last ids: the mask is vocab - 1
    pad, start, end, mask = specials
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=end,
        pad_token=pad,
        bos_token=None,
        additional_special_tokens=[start, mask],
    )
    fast.chat_template = template
    fast.save_pretrained(folder)
    return fast


def token_stream(tokenizer, records: list[dict]) -> torch.Tensor:
    texts = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return torch.tensor([t for row in ids for t in row])


def train_target(
    tokenizer, records: list[dict], held_out: list[dict], s: dict, folder: Path
) -> dict:
    """A Qwen3-shaped LM trained on the rendered conversations for at most a fixed wall
    time, stopped early once its loss on `held_out` (conversations from files it never
    sees) stops falling: a target that generalises, not one that recites its data."""
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
    data = token_stream(tokenizer, records)
    length, batch = s["target_len"], s["target_batch"]
    held = token_stream(tokenizer, held_out)
    usable = (len(held) - 1) // length * length
    held_batches = held[:usable].view(-1, length)[: 4 * batch].to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.1
    )
    autocast = torch.autocast("cuda", torch.bfloat16) if device.type == "cuda" else _nothing()

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad(), autocast:
            losses = [
                float(model(input_ids=chunk, labels=chunk).loss)
                for chunk in held_batches.split(batch)
            ]
        model.train()
        return sum(losses) / len(losses)

    started, step, best, best_step, worse = time.perf_counter(), 0, float("inf"), 0, 0
    best_state, curve = None, []
    gen = torch.Generator().manual_seed(1)
    check = s["target_check_every"]
    # A step cap makes the tiny target the same on any machine: trained by wall time
    # alone, a fast idle machine taught it to end every answer at once (no samples).
    max_steps = s.get("target_max_steps") or float("inf")
    while time.perf_counter() - started < s["target_seconds"] and step < max_steps:
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
        if step % check == 0:
            held_loss = held_out_loss()
            curve.append((step, round(float(loss.detach()), 3), round(held_loss, 3)))
            log(
                f"target | step {step} | loss {curve[-1][1]:.3f} | held-out loss {held_loss:.3f}"
                f" | {time.perf_counter() - started:.0f} s"
            )
            if held_loss < best:
                best, best_step, worse = held_loss, step, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                worse += 1
                if worse >= s["target_patience"]:
                    log(
                        f"target | held-out loss rose {worse} checks running: stop, keep step {best_step}"
                    )
                    break
    if best_state is not None:
        model.load_state_dict(best_state)
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
        "kept_step": best_step,
        "tokens_seen_M": round(step * batch * length / 1e6, 1),
        "train_tokens_M": round(len(data) / 1e6, 2),
        "held_out_loss": round(best, 3) if best_state is not None else None,
        "curve": curve,
    }


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
