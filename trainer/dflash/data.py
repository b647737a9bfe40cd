"""Training data: chat JSONL or plain text -> tokens + assistant loss mask -> static batches.

Inputs:
  - JSONL, one conversation per line: {"messages": [{"role": ..., "content": ...}, ...]},
    rendered with the target's chat template; the loss mask is on the tokens of
    assistant turns (their content and end-of-turn marker).
  - JSONL with {"text": ...} lines, or a .txt file (documents separated by blank
    lines): every token is in the loss.
Samples are truncated to the longest sequence length, and dropped when fewer than
2*B tokens remain in the loss. Batches are padded to fixed lengths (one length, or
the smallest of a few buckets) and to a fixed number of rows, so compiled shapes
stay static; padding rows carry no loss.

`regenerate` rewrites the final assistant turn of each conversation with the
target's own greedy answer, one conversation at a time (`python -m dflash.data
regenerate --help`); for real data use `python -m dflash.regenerate` (batched on the
GPU, sharded under torchrun, resumable, greedy or sampled as the target's generation
config says).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .target import greedy_generate, greedy_generate_batch

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>")
_TINY_CORPUS = (
    "The drafter proposes a block of tokens and the target verifies them in one pass. "
    "Speculative decoding keeps the output of the target exactly, token for token. "
    "A small model learns to guess what a large model would say next, from its hidden states. "
    "user assistant system hello thanks please write a short answer about numbers, lists and code. "
    "def main(): return sum(range(10)) # prints 45\nfor i in range(3): print(i * i)\n"
    "Questions: what is two plus two? Four. Name three colours: red, green and blue. "
)


# -- tokenizer ---------------------------------------------------------------------------------
def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer of exactly `vocab_size` ids with a ChatML template, built in code.

    The last four ids are <|endoftext|>, <|im_start|>, <|im_end|>, <|MASK|>, so the
    mask token is vocab_size - 1 and exists in the target's embedding.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = vocab_size - len(TINY_SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    fillers = [f"<|reserved_{i}|>" for i in range(base - tokenizer.get_vocab_size())]
    tokenizer.add_special_tokens(fillers + list(TINY_SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"tiny tokenizer has {tokenizer.get_vocab_size()} ids, wanted {vocab_size}"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|MASK|>"],
        chat_template=CHATML_TEMPLATE,
    )


# Any one of these makes a folder a tokenizer's (fast, sentencepiece, byte-level BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class TokenizerError(ValueError):
    """No tokenizer in the folder named, said with what to do (not transformers' traceback)."""


def load_tokenizer(path: str | Path):
    """The target's own tokenizer from a local directory (never downloads)."""
    from transformers import AutoTokenizer

    fix = (
        "copy the target's tokenizer files there, or name a folder that holds them with "
        "data.tokenizer"
    )
    folder = Path(path)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise TokenizerError(
            f"{path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); {fix}"
        )
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as exc:  # transformers' words for "no usable tokenizer here"
        said = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise TokenizerError(
            f"the tokenizer in {path} could not be loaded ({said}); {fix}"
        ) from exc


# -- tokenizing --------------------------------------------------------------------------------
@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]
    # A chat sample's prompt as a server sends it: the messages before the last assistant
    # turn rendered with the generation prompt and tokenized alone (the eval's prompt).
    # Cut from the full rendering instead, byte-level BPE may have merged the prompt's
    # final "\n" with the answer's first characters: a prompt no server ever sends.
    prompt_ids: list[int] | None = None

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)


def _render(tokenizer, messages, generation_prompt: bool, template_kwargs: dict) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt, **template_kwargs
    )


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    *,
    template_kwargs: dict | None = None,
    token_ids: dict | None = None,
) -> Sample:
    """Render with the chat template; loss mask on tokens inside assistant turns.

    An assistant turn spans from the end of the generation prompt that precedes it
    to the end of its own rendering, so it includes the end-of-turn marker.
    `token_ids` ({"prompt", "answer", "ended"}, written by `dflash.regenerate`): the
    exact ids the target was prompted with and wrote; used when they still decode to the
    final assistant turn, see `_sample_from_ids`.
    """
    template_kwargs = template_kwargs or {}
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=None)
    prompt_ids = None
    if last is not None:
        prompt_text = _render(tokenizer, messages[:last], True, template_kwargs) if last else ""
        prompt_ids = list(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        if token_ids and last == len(messages) - 1:
            exact = _sample_from_ids(tokenizer, messages, prompt_ids, token_ids, template_kwargs)
            if exact is not None:
                return exact
    full = _render(tokenizer, messages, False, template_kwargs)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, template_kwargs) if i else ""
        through = _render(tokenizer, messages[: i + 1], False, template_kwargs)
        if not (full.startswith(through) and through.startswith(before)):
            raise ValueError(
                "the chat template renders earlier turns differently once later turns follow, "
                "so assistant spans cannot be located; regenerate single-turn data or pass template_kwargs"
            )
        spans.append((len(before), len(through)))
    encoded = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [any(lo <= start < hi for lo, hi in spans) for start, _ in encoded["offset_mapping"]]
    return Sample(list(encoded["input_ids"]), mask, prompt_ids)


def split_by_prompt(
    samples: list[Sample], count: int, seed: int, *, count_samples: bool = False
) -> tuple[list[Sample], list[list[Sample]]]:
    """(training samples, held-out prompts, each with all of its samples): `count` prompts
    (`count_samples`: prompts until `count` samples) in a seeded order, the same in every
    process. Samples share a prompt when it was answered several times
    (regenerate.answers_per_prompt); a held-out prompt takes every answer to it out of
    training, or what is held out would read what the drafter learnt. Samples without a
    prompt (plain text) are each their own."""
    keys = [tuple(s.prompt_ids) if s.prompt_ids else i for i, s in enumerate(samples)]
    members: dict = {}
    for sample, key in zip(samples, keys, strict=True):
        members.setdefault(key, []).append(sample)
    held: dict = {}
    taken = 0
    for i in torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist():
        if (taken if count_samples else len(held)) >= count:
            break
        if keys[i] not in held:
            held[keys[i]] = members[keys[i]]
            taken += len(members[keys[i]])
    return [s for s, key in zip(samples, keys, strict=True) if key not in held], list(held.values())


def _sample_from_ids(tokenizer, messages, prompt_ids, token_ids, template_kwargs):
    """The sample as the target saw and wrote it: prompt ids + answer ids + the turn's end.

    Re-tokenizing the decoded answer inside the full rendering does not give the target's
    tokens back: byte-level BPE merges the generation prompt's "\n" with the answer's
    leading whitespace, and a target may write a non-canonical split. The drafter would
    then train on token sequences the target never produces while serving. None (use the
    text) when the ids are stale: another prompt rendering, or content edited since."""
    prompt, answer = token_ids.get("prompt"), token_ids.get("answer")
    if not isinstance(prompt, list) or not isinstance(answer, list) or prompt != prompt_ids:
        return None
    content = messages[-1].get("content", "")
    if tokenizer.decode(answer, skip_special_tokens=True) != content:
        return None
    through = _render(tokenizer, messages, False, template_kwargs)
    before = _render(tokenizer, messages[:-1], True, template_kwargs)
    if not through.startswith(before + content):
        return None
    tail = list(
        tokenizer(through[len(before) + len(content) :], add_special_tokens=False)["input_ids"]
    )
    # An answer cut at max_new_tokens did not end: its end-of-turn marker is not the
    # target's, so it is not a label.
    ended = bool(token_ids.get("ended", True))
    ids = list(prompt) + list(answer) + tail
    mask = [False] * len(prompt) + [True] * len(answer) + [ended] * len(tail)
    return Sample(ids, mask, list(prompt))


def tokenize_text(tokenizer, text: str) -> Sample:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return Sample(list(ids), [True] * len(ids))


def read_records(path: str | Path) -> list[dict]:
    """JSONL records, or {"text": ...} records from a .txt file split on blank lines."""
    path = Path(path)
    if path.suffix == ".txt":
        docs = [d.strip() for d in path.read_text().split("\n\n")]
        return [{"text": d} for d in docs if d]
    records = []
    offset = 0
    for number, raw in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            # The whole file's decode error says only a byte offset: name the line too.
            raise ValueError(
                f"{path}:{number}: not valid UTF-8 (byte {offset + exc.start} of the file, "
                f"column {exc.start + 1}: {exc.reason})"
            ) from None
        offset += len(raw)
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict) or not ("messages" in record or "text" in record):
            raise ValueError(f'{path}:{number}: expected an object with "messages" or "text"')
        records.append(record)
    return records


@dataclass
class DataStats:
    kept: int = 0
    too_few_loss_tokens: int = 0
    unrenderable: int = 0


def prepare_samples(
    records: list[dict],
    tokenizer,
    *,
    max_length: int,
    block_size: int,
    template_kwargs: dict | None = None,
) -> tuple[list[Sample], DataStats]:
    """Tokenize, truncate to `max_length`, drop samples with fewer than 2*B loss tokens."""
    samples, stats = [], DataStats()
    for record in records:
        try:
            if "messages" in record:
                sample = tokenize_conversation(
                    tokenizer,
                    record["messages"],
                    template_kwargs=template_kwargs,
                    token_ids=record.get("token_ids"),
                )
            else:
                sample = tokenize_text(tokenizer, record["text"])
        except ValueError:
            stats.unrenderable += 1
            continue
        sample = Sample(
            sample.input_ids[:max_length], sample.loss_mask[:max_length], sample.prompt_ids
        )
        if sample.num_loss_tokens < 2 * block_size:
            stats.too_few_loss_tokens += 1
            continue
        samples.append(sample)
    stats.kept = len(samples)
    return samples, stats


def load_samples(path: str | Path, tokenizer, *, max_length: int, block_size: int, **kwargs):
    return prepare_samples(
        read_records(path), tokenizer, max_length=max_length, block_size=block_size, **kwargs
    )


# -- batching ----------------------------------------------------------------------------------
@dataclass
class Batch:
    input_ids: torch.Tensor  # [N, S] long
    loss_mask: torch.Tensor  # [N, S] bool
    attention_mask: torch.Tensor  # [N, S] long, 1 on real tokens
    doc_ids: torch.Tensor | None = None  # [N, S] long, for packed sequences (not produced here)

    def to(self, device, non_blocking: bool = False) -> Batch:
        move = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Batch(
            move(self.input_ids),
            move(self.loss_mask),
            move(self.attention_mask),
            move(self.doc_ids),
        )

    def pin_memory(self) -> Batch:
        pin = lambda t: None if t is None else t.pin_memory()  # noqa: E731
        return Batch(
            pin(self.input_ids), pin(self.loss_mask), pin(self.attention_mask), pin(self.doc_ids)
        )


def bucket_for(length: int, seq_lens: list[int]) -> int:
    for s in sorted(seq_lens):
        if length <= s:
            return s
    return max(seq_lens)


def collate(samples: list[Sample], seq_len: int, batch_size: int, pad_id: int) -> Batch:
    """Right-pad samples to seq_len and add empty rows up to batch_size."""
    if len(samples) > batch_size:
        raise ValueError(f"{len(samples)} samples do not fit a batch of {batch_size}")
    ids = torch.full((batch_size, seq_len), pad_id, dtype=torch.long)
    loss = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    attn = torch.zeros(batch_size, seq_len, dtype=torch.long)
    for row, sample in enumerate(samples):
        n = min(len(sample.input_ids), seq_len)
        ids[row, :n] = torch.tensor(sample.input_ids[:n])
        loss[row, :n] = torch.tensor(sample.loss_mask[:n])
        attn[row, :n] = 1
    return Batch(ids, loss, attn)


def iterate_batches(
    samples: list[Sample],
    *,
    batch_size: int,
    seq_lens: list[int] | int,
    pad_id: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
) -> Iterator[Batch]:
    """One epoch of static-shaped batches: each sample goes to the smallest length that holds it."""
    seq_lens = [seq_lens] if isinstance(seq_lens, int) else sorted(seq_lens)
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(samples)))
    if shuffle:
        rng.shuffle(order)
    buckets: dict[int, list[Sample]] = {s: [] for s in seq_lens}
    for index in order:
        buckets[bucket_for(len(samples[index].input_ids), seq_lens)].append(samples[index])
    groups = [
        (seq_len, members[i : i + batch_size])
        for seq_len, members in buckets.items()
        for i in range(0, len(members), batch_size)
    ]
    if shuffle:
        rng.shuffle(groups)
    for seq_len, members in groups:
        yield collate(members, seq_len, batch_size, pad_id)


# -- data made by a target (tests, CPU demo) and regeneration ----------------------------------
def synthetic_samples(
    target: nn.Module,
    *,
    num_samples: int,
    prompt_len: int,
    response_len: int,
    seed: int = 0,
    max_token_id: int | None = None,
) -> list[Sample]:
    """Random prompts continued greedily by the target; the loss covers the continuation."""
    gen = torch.Generator().manual_seed(seed)
    high = max_token_id or int(target.config.vocab_size) - 1
    device = next(target.parameters()).device
    prompts = torch.randint(0, high, (num_samples, prompt_len), generator=gen)
    samples = []
    for chunk in prompts.split(256):
        responses = greedy_generate_batch(target, chunk.to(device), response_len).cpu()
        for prompt, response in zip(chunk.tolist(), responses.tolist(), strict=True):
            samples.append(Sample(prompt + response, [False] * prompt_len + [True] * response_len))
    return samples


def random_prompts(num: int, length: int, max_token_id: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, max_token_id, (num, length), generator=gen).tolist()


def regenerate(
    target: nn.Module,
    tokenizer,
    records: list[dict],
    *,
    max_new_tokens: int,
    template_kwargs: dict | None = None,
) -> list[dict]:
    """Conversations whose final assistant turn is the target's own greedy answer.

    The prompt is every message before the last assistant turn (or all messages
    when none); text records are passed through unchanged.
    """
    template_kwargs = template_kwargs or {}
    device = next(target.parameters()).device
    stop_ids = [t for t in {tokenizer.eos_token_id, tokenizer.pad_token_id} if t is not None]
    out = []
    for record in records:
        if "messages" not in record:
            out.append(record)
            continue
        messages = list(record["messages"])
        last = max(
            (i for i, m in enumerate(messages) if m.get("role") == "assistant"),
            default=len(messages),
        )
        prompt_messages = messages[:last]
        prompt = _render(tokenizer, prompt_messages, True, template_kwargs)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"].to(
            device
        )
        answer, _ = greedy_generate(target, ids, max_new_tokens, stop_ids)
        text = tokenizer.decode(answer, skip_special_tokens=True)
        out.append(
            {**record, "messages": prompt_messages + [{"role": "assistant", "content": text}]}
        )
    return out


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash.data", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    regen = sub.add_parser(
        "regenerate", help="rewrite final assistant turns with the target's greedy answers"
    )
    regen.add_argument(
        "--target", required=True, help="local directory of the target model and tokenizer"
    )
    regen.add_argument("--input", required=True, help="JSONL of conversations")
    regen.add_argument("--output", required=True, help="JSONL to write")
    regen.add_argument("--max-new-tokens", type=int, default=2048)
    regen.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    regen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)

    from .target import load_target

    target = load_target(args.target, device=args.device, dtype=getattr(torch, args.dtype))
    tokenizer = load_tokenizer(args.target)
    records = read_records(args.input)
    output = Path(args.output)
    with output.open("w") as f:
        for i, record in enumerate(records, start=1):
            (new,) = regenerate(target, tokenizer, [record], max_new_tokens=args.max_new_tokens)
            f.write(json.dumps(new, ensure_ascii=False) + "\n")
            if i % 100 == 0 or i == len(records):
                print(f"regenerated {i}/{len(records)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())


def prompts_in_training(prompts: list[list[int]], samples: list[Sample]) -> list[int]:
    """Indices of eval prompts that begin some training sample (or are its chat prompt):
    a prompt trained on.
    One look-up per sample, keyed by as many first tokens as the shortest prompt has (chat
    prompts share their template's opening, so a short key would match them all)."""
    head = min(len(p) for p in prompts) if prompts else 1
    by_head: dict[tuple[int, ...], list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_head.setdefault(tuple(prompt[:head]), []).append(index)
    found: set[int] = set()
    for sample in samples:
        for index in by_head.get(tuple(sample.input_ids[:head]), ()):
            prompt = prompts[index]
            # A chat sample re-tokenized from its text may have merged the prompt's last
            # "\n" into its answer: its own generation prompt is compared as well.
            if sample.input_ids[: len(prompt)] == prompt or sample.prompt_ids == prompt:
                found.add(index)
    return sorted(found)
