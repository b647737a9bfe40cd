"""Regenerate training data with the target: its own assistant turns for a chat JSONL's prompts.

    cd trainer && python -m dflash.regenerate --config configs/regenerate.yaml [--set KEY=VALUE]
    torchrun --nproc-per-node 8 -m dflash.regenerate --config ...   # one shard per rank

The published DFlash drafters are trained on what the target says, not on what a data
file says: a drafter trained on the file learns the file. This writes, for every
conversation of `regenerate.input`, the messages before its last assistant turn (the
prompt) followed by the target's own answer, as chat JSONL the trainer reads as it is
(`data.source: <regenerate.output>`).

- Greedy or sampled as the target's `generation_config.json` says (do_sample,
  temperature, top_p, top_k); `regenerate.sample`/`temperature` override it.
- Batched on the GPU with a KV cache: transformers' `generate` over left-padded
  batches of prompts of similar length.
- Sharded under torchrun: rank r takes prompts i % world == r and appends to its own
  part file; the rank that finishes last merges the parts into `regenerate.output`
  in input order.
- Resumable: every record carries `prompt_id` (a hash of its prompt messages); a rerun
  skips prompts already in the output or the parts, so an interrupted run continues.

Exit status: 0 done, 2 bad input (config, missing files, an unreadable input line).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

EXIT_OK, EXIT_BAD_INPUT = 0, 2


def prompt_messages(record: dict) -> list[dict]:
    """The messages before the last assistant turn (all of them when there is none)."""
    messages = list(record["messages"])
    last = max(
        (i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=len(messages)
    )
    return messages[:last]


def prompt_id(messages: list[dict]) -> str:
    """Stable across runs and machines: the same prompt always gets the same id."""
    text = json.dumps(messages, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass
class Job:
    index: int  # line order in the input (the merged output keeps it)
    pid: str
    messages: list[dict]
    record: dict


def read_jobs(path: Path) -> list[Job]:
    from .data import read_records

    jobs, seen = [], set()
    for index, record in enumerate(read_records(path)):
        if "messages" not in record:
            continue  # plain text has no prompt to answer
        messages = prompt_messages(record)
        if not messages:
            continue
        pid = prompt_id(messages)
        if pid in seen:  # the same prompt twice: answered once
            continue
        seen.add(pid)
        jobs.append(Job(index, pid, messages, record))
    return jobs


def parts_dir(output: Path) -> Path:
    return output.with_name(output.name + ".parts")


def done_ids(output: Path) -> set[str]:
    """Prompt ids already answered, in the merged output or any rank's part file."""
    found: set[str] = set()
    files = [output] + sorted(parts_dir(output).glob("rank-*.jsonl"))
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                found.add(json.loads(line)["prompt_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut off by an interrupted write: answered again
    return found


class Generator:
    """Batched generation with the target's KV cache (transformers `generate`, left padding)."""

    def __init__(self, target, tokenizer, section, device) -> None:
        self.target, self.tokenizer, self.device = target, tokenizer, device
        self.max_new_tokens = section.max_new_tokens
        self.template_kwargs = dict(section.template_kwargs or {})
        gen = getattr(target, "generation_config", None)
        sample = (
            section.sample if section.sample is not None else bool(getattr(gen, "do_sample", False))
        )
        self.kwargs: dict = {"do_sample": sample, "max_new_tokens": section.max_new_tokens}
        if sample:
            self.kwargs["temperature"] = (
                section.temperature or getattr(gen, "temperature", 1.0) or 1.0
            )
            self.kwargs["top_p"] = section.top_p or getattr(gen, "top_p", 1.0) or 1.0
            self.kwargs["top_k"] = (
                section.top_k if section.top_k is not None else (getattr(gen, "top_k", 0) or 0)
            )
        else:  # greedy: no sampling knobs (transformers warns about stray ones)
            self.kwargs.update(temperature=None, top_p=None, top_k=None)
        self.stop_ids = stop_token_ids(tokenizer, gen)
        self.kwargs["eos_token_id"] = self.stop_ids or None
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        self.kwargs["pad_token_id"] = self.pad_id

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer(
        self, prompts: list[list[int]]
    ) -> tuple[list[str], int, list[tuple[list[int], bool]]]:
        """Answers for token-id prompts (one batch), the tokens generated, and per answer
        its token ids (stop token left out) and whether it ended with a stop token."""
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            out = self.target.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **self.kwargs
            )
        texts, count, ids_out = [], 0, []
        for row in out[:, width:].tolist():
            kept = []
            for t in row:
                if t in self.stop_ids:
                    break
                kept.append(t)
            ended = len(kept) < len(row)
            count += len(kept) + (1 if ended else 0)
            texts.append(self.tokenizer.decode(kept, skip_special_tokens=True))
            ids_out.append((kept, ended))
        return texts, count, ids_out


def stop_token_ids(tokenizer, generation_config) -> list[int]:
    """The end-of-turn ids: the generation config's eos, the tokenizer's eos, <|im_end|>."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None)
    for value in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id and end not in ids:
        ids.append(end)
    return ids


def rank_and_world() -> tuple[int, int, int]:
    """torchrun's RANK, WORLD_SIZE and LOCAL_RANK (0, 1, 0 when run plainly)."""
    return (
        int(os.environ.get("RANK", 0)),
        int(os.environ.get("WORLD_SIZE", 1)),
        int(os.environ.get("LOCAL_RANK", 0)),
    )


def run(cfg, *, log=print) -> dict:
    """Answer this rank's share of the prompts not yet answered; merge when all ranks are
    done. Returns counts and tokens/s for the report."""
    import torch

    from .data import load_tokenizer
    from .target import load_target

    section = cfg.regenerate
    rank, world, local_rank = rank_and_world()
    source, output = Path(section.input), Path(section.output)
    jobs = read_jobs(source)
    done = done_ids(output)
    mine = [j for j in jobs if j.index % world == rank and j.pid not in done]
    device = section.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    target = load_target(cfg.target.path, device=device, dtype=getattr(torch, cfg.target.dtype))
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.target.path)
    generator = Generator(target, tokenizer, section, device)
    if section.seed is not None:
        torch.manual_seed(section.seed + rank)
    log(
        f"regenerate | rank {rank}/{world} | {len(jobs)} prompts, {len(done)} already answered, "
        f"{len(mine)} to answer here on {device} | "
        f"{'sampled' if generator.kwargs['do_sample'] else 'greedy'}, "
        f"max {section.max_new_tokens} new tokens, batch {section.batch_size}"
    )
    part = parts_dir(output) / f"rank-{rank}-of-{world}.jsonl"
    part.parent.mkdir(parents=True, exist_ok=True)
    encoded = [(j, generator.encode(j.messages)) for j in mine]
    encoded.sort(key=lambda item: len(item[1]))  # similar lengths: little padding per batch
    tokens, started = 0, time.perf_counter()
    with part.open("a", encoding="utf-8") as out:
        for first in range(0, len(encoded), section.batch_size):
            batch = encoded[first : first + section.batch_size]
            texts, count, answers = generator.answer([ids for _, ids in batch])
            tokens += count
            for (job, prompt), text, (kept, ended) in zip(batch, texts, answers, strict=True):
                answer = {"role": "assistant", "content": text}
                # The exact ids: the trainer trains on them, not on a re-tokenization of
                # the text (dflash.data._sample_from_ids says why).
                ids = {"prompt": prompt, "answer": kept, "ended": ended}
                record = {
                    **job.record,
                    "messages": job.messages + [answer],
                    "prompt_id": job.pid,
                    "token_ids": ids,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()  # an interrupted run keeps every finished batch
            log(
                f"regenerate | rank {rank} | {min(first + len(batch), len(encoded))}/{len(encoded)}"
            )
    seconds = time.perf_counter() - started
    (parts_dir(output) / f"rank-{rank}-of-{world}.done").write_text(str(len(mine)))
    merged = merge_if_complete(jobs, output, world)
    rate = tokens / seconds if seconds > 0 else 0.0
    log(
        f"regenerate | rank {rank} | {len(mine)} answered, {tokens} tokens in {seconds:.1f} s "
        f"({rate:.0f} tokens/s)" + (f" | merged into {output}" if merged else "")
    )
    return {"answered": len(mine), "tokens": tokens, "seconds": seconds, "merged": merged}


def merge_if_complete(jobs: list[Job], output: Path, world: int) -> bool:
    """Once every rank has marked itself done: the output in input order, parts removed.
    The output keeps what it had (an earlier run) and gains the parts' records."""
    folder = parts_dir(output)
    if any(not (folder / f"rank-{r}-of-{world}.done").exists() for r in range(world)):
        return False
    by_id: dict[str, str] = {}
    for path in [output] + sorted(folder.glob("rank-*.jsonl")):
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                by_id.setdefault(json.loads(line)["prompt_id"], line)
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
    order = [j.pid for j in jobs if j.pid in by_id]
    extra = [pid for pid in by_id if pid not in set(order)]  # from an older input: kept
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(by_id[pid] + "\n" for pid in order + extra), encoding="utf-8")
    os.replace(tmp, output)
    for path in folder.iterdir():
        path.unlink(missing_ok=True)
    folder.rmdir()
    return True


def _parse(argv):
    parser = argparse.ArgumentParser(
        prog="python -m dflash.regenerate", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--config", required=True, help="trainer config YAML with a regenerate: section"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override a key; repeatable"
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    from .pipeline.train_config import TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, args.set)
        check_inputs(cfg)
        run(cfg, log=lambda line: print(line, flush=True))
    except (TrainConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_OK


def check_inputs(cfg) -> None:
    from .pipeline.train_config import TrainConfigError

    section = cfg.regenerate
    if not section.input or not section.output:
        raise TrainConfigError("regenerate.input and regenerate.output must name JSONL files")
    if not Path(section.input).is_file():
        raise TrainConfigError(f"regenerate.input: {section.input} is not a file")
    if Path(section.input).resolve() == Path(section.output).resolve():
        raise TrainConfigError("regenerate.output must differ from regenerate.input")
    if not cfg.target.path or not Path(cfg.target.path).is_dir():
        raise TrainConfigError(
            f"target.path: {cfg.target.path!r} is not a local model folder; regeneration needs "
            "the real target (a Hugging Face folder with its tokenizer)"
        )


if __name__ == "__main__":
    raise SystemExit(main())
