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
- Several answers per prompt (`regenerate.answers_per_prompt`): the first as above, the
  others sampled (the generation config's temperature when it samples, else
  `regenerate.temperature` or 0.7). A small prompt set otherwise trains the drafter on
  the same few answers for tens of epochs, and it learns them instead of the target.
  Answers are made pass by pass (every prompt's first answer, then every second one), so
  a budget cut drops the later passes, not prompts.
- Batched on the GPU with a KV cache: transformers' `generate` over left-padded
  batches of prompts of similar length.
- Sharded under torchrun: rank r takes prompts i % world == r and appends to its own
  part file; the rank that finishes last merges the parts into `regenerate.output`
  in input order.
- Resumable: every record carries `prompt_id` (a hash of its prompt messages); a rerun
  skips prompts already in the output or the parts, so an interrupted run continues.
- One target per file: every record also carries `answered_by`, a digest of what made the
  answer (the target's weights, its dtype, the tokenizer, the chat template and its kwargs,
  the generation settings). Answers made otherwise (another target, older records without
  the digest) are refused: `--restart` removes them and answers every prompt again,
  `--keep-mismatched` keeps them as they are. The merged output holds only prompts of
  the current input.
- Says how many answers ended at `max_new_tokens` instead of a stop token, and warns when
  most did (the drafter would learn answers cut short).

Exit status: 0 done, 2 bad input (config, missing files, an unreadable input line, answers
of another target in the output).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
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


def answer_key(pid: str, answer: int) -> str:
    """One answer's key: the prompt id for the first answer (as records without an
    `answer` field have it), `<prompt id>#<k>` for the k-th extra one."""
    return f"{pid}#{answer}" if answer else pid


def record_key(record: dict) -> str:
    return answer_key(record["prompt_id"], int(record.get("answer") or 0))


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


def answered(output: Path) -> dict[str, str | None]:
    """Answer key (answer_key) -> the `answered_by` digest of the answer (None: a record
    made before answers carried one), over the merged output and every rank's part file."""
    found: dict[str, str | None] = {}
    files = [output] + sorted(parts_dir(output).glob("rank-*.jsonl"))
    for path in files:
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
                found.setdefault(record_key(record), record.get("answered_by"))
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError):
                continue  # a line cut off by an interrupted write: answered again
    return found


ON_MISMATCH = ("refuse", "restart", "keep")


class MismatchedAnswers(ValueError):
    """The output holds answers made by another target or with other settings."""


def files_digest(folder: Path, patterns: tuple[str, ...]) -> str:
    """sha256 over the names and bytes of the folder's files matching `patterns`."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in folder.glob(pattern) if p.is_file()})
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "config.json")


def answer_settings(cfg, tokenizer, generator) -> dict:
    """What an answer depends on, each as a short value or digest (compared field by field)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocab = (
        backend.to_str()
        if backend is not None
        else json.dumps(sorted(tokenizer.get_vocab().items()))
    )
    template = tokenizer.chat_template or ""
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    sha = lambda text: hashlib.sha256(text.encode()).hexdigest()[:16]  # noqa: E731
    generation = {k: v for k, v in generator.kwargs.items() if v is not None}
    if generation.get("do_sample"):
        generation["seed"] = cfg.regenerate.seed
    return {
        "target weights": files_digest(Path(cfg.target.path), WEIGHT_FILES)[:16],
        "target dtype": cfg.target.dtype,
        "tokenizer": sha(vocab),
        "chat template": sha(template),
        "template kwargs": json.dumps(generator.template_kwargs, sort_keys=True),
        "generation": json.dumps(generation, sort_keys=True),
    }


def extra_settings(settings: dict, generator, seed) -> dict:
    """What the extra (sampled) answers depend on: the first answer's settings, their own
    sampling. Its own digest, so adding extra answers keeps the first ones valid."""
    extra = {k: v for k, v in generator.extra_kwargs.items() if v is not None}
    return {**settings, "extra answers": json.dumps({**extra, "seed": seed}, sort_keys=True)}


def settings_digest(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def settings_path(output: Path) -> Path:
    """Beside the output: the settings behind each `answered_by` digest seen there."""
    return output.with_name(output.name + ".answered-by.json")


def check_answered_by(
    output: Path,
    found: dict,
    settings: dict,
    on_mismatch: str,
    log,
    rank: int = 0,
    world: int = 1,
    extra: dict | None = None,
) -> dict:
    """The answers a run may count as done: refuse, drop (restart) or keep (keep) those
    made by another target or with other settings (`extra`: the settings of the extra
    answers, keys with `#`). Returns the answer keys to skip. Under torchrun each rank
    removes the merged output and its own part (every rank decides alike, from the same
    files)."""
    digest = settings_digest(settings)
    extra_digest = settings_digest(extra) if extra else None

    def expected(key: str) -> str | None:
        return extra_digest if "#" in key else digest

    other = [key for key, by in found.items() if by != expected(key)]
    known = {}
    try:
        known = json.loads(settings_path(output).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    if other and on_mismatch == "restart":
        output.unlink(missing_ok=True)
        folder = parts_dir(output)
        if folder.is_dir():
            mine = f"rank-{rank}-of-{world}."
            for path in folder.iterdir():
                if world == 1 or path.name.startswith(mine):
                    path.unlink(missing_ok=True)
        log(f"regenerate | --restart: removed {len(found)} earlier answers; answering again")
        found = {}
    elif other and on_mismatch == "keep":
        log(
            f"regenerate | warning: keeping {len(other)} answers made by another target or "
            "with other settings (--keep-mismatched)"
        )
    elif other:
        raise MismatchedAnswers(
            f"{output} already holds {len(other)} answers made "
            + _what_differs(
                {by for key, by in found.items() if by != expected(key)}, known, settings
            )
            + ". Training on a mix teaches the drafter a target that will not serve it. "
            "Rerun with --restart to remove them and answer every prompt with this target, "
            "or --keep-mismatched to keep them as they are (or set regenerate.output to a "
            "new file)"
        )
    known[digest] = settings
    if extra:
        known[extra_digest] = extra
    settings_path(output).parent.mkdir(parents=True, exist_ok=True)
    settings_path(output).write_text(json.dumps(known, indent=1) + "\n", encoding="utf-8")
    return found


def _what_differs(digests: set, known: dict, settings: dict) -> str:
    if None in digests:
        return "before answers recorded their target (no answered_by)"
    changed = sorted(
        {
            key
            for d in digests
            for key, value in (known.get(d) or {}).items()
            if settings.get(key) != value
        }
    )
    if not changed:
        return "with other settings (their target and settings are not on record)"
    return "with a different " + ", ".join(changed)


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
        # Extra answers are sampled: as the first when it samples, else at
        # regenerate.temperature or 0.7 (other text than the greedy answer, still close to
        # what the target says most).
        self.extra_kwargs = dict(self.kwargs)
        if not sample:
            self.extra_kwargs.update(
                do_sample=True,
                temperature=section.temperature or 0.7,
                top_p=section.top_p or 1.0,
                top_k=section.top_k or 0,
            )
        self.stop_ids = stop_token_ids(tokenizer, gen)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.stop_ids[0] if self.stop_ids else 0)
        for kwargs in (self.kwargs, self.extra_kwargs):
            kwargs.update(eos_token_id=self.stop_ids or None, pad_token_id=self.pad_id)

    def encode(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def answer(
        self, prompts: list[list[int]], extra: bool = False
    ) -> tuple[list[str], int, list[tuple[list[int], bool]]]:
        """Answers for token-id prompts (one batch), the tokens generated, and per answer
        its token ids (stop token left out) and whether it ended with a stop token.
        `extra`: with the extra answers' (sampled) settings."""
        import torch

        from .decode_attention import without_cudnn_attention

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding: every prompt ends at the same column
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad(), without_cudnn_attention():  # new lengths every step
            out = self.target.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                **(self.extra_kwargs if extra else self.kwargs),
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


def run(cfg, *, log=print, on_mismatch: str = "refuse") -> dict:
    """Answer this rank's share of the prompts not yet answered; merge when all ranks are
    done. Answers in the output made by another target or with other settings are refused
    (MismatchedAnswers), removed (`on_mismatch="restart"`) or kept ("keep").
    Returns counts, tokens/s and how many answers the length cap cut, for the report."""
    import torch

    from .data import load_tokenizer
    from .target import load_target

    section = cfg.regenerate
    rank, world, local_rank = rank_and_world()
    source, output = Path(section.input), Path(section.output)
    if on_mismatch not in ON_MISMATCH:
        raise ValueError(f"on_mismatch must be one of {', '.join(ON_MISMATCH)}")
    jobs = read_jobs(source)
    device = section.device or (f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    # The tokenizer first: a folder without one fails at once, not after the target's weights.
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.target.path)
    target = load_target(cfg.target.path, device=device, dtype=getattr(torch, cfg.target.dtype))
    generator = Generator(target, tokenizer, section, device)
    settings = answer_settings(cfg, tokenizer, generator)
    extra = extra_settings(settings, generator, section.seed)
    by, extra_by = settings_digest(settings), settings_digest(extra)
    per_prompt = section.answers_per_prompt
    # Answers to prompts no longer in the input (or past answers_per_prompt) do not count.
    wanted = {answer_key(j.pid, k) for j in jobs for k in range(per_prompt)}
    found = {key: by for key, by in answered(output).items() if key in wanted}
    done = check_answered_by(
        output, found, settings, on_mismatch, log, rank, world, extra if per_prompt > 1 else None
    )
    if section.seed is not None:
        torch.manual_seed(section.seed + rank)
    part = parts_dir(output) / f"rank-{rank}-of-{world}.jsonl"
    part.parent.mkdir(parents=True, exist_ok=True)
    mine = [j for j in jobs if j.index % world == rank]
    todo = [[j for j in mine if answer_key(j.pid, k) not in done] for k in range(per_prompt)]
    # Each prompt rendered once, and only where an answer to it is still missing (a rerun
    # of a large input encodes what is left, not everything again).
    needed = {j.pid: j for jobs_k in todo for j in jobs_k}
    encoded = {pid: generator.encode(j.messages) for pid, j in needed.items()}
    budget_s = section.budget_minutes * 60 if section.budget_minutes else None
    batches = []  # (answer number, [(job, prompt ids)]): pass by pass, first answers first
    for k in range(per_prompt):
        pending = [(j, encoded[j.pid]) for j in todo[k]]
        pending.sort(key=lambda item: len(item[1]))  # similar lengths: little padding per batch
        one_pass = [
            (k, pending[first : first + section.batch_size])
            for first in range(0, len(pending), section.batch_size)
        ]
        if budget_s is not None:  # a cut leaves a random share unanswered, not the longest
            random.Random((section.seed or 0) + k).shuffle(one_pass)
        batches += one_pass
    to_answer = sum(len(batch) for _, batch in batches)
    log(
        f"regenerate | rank {rank}/{world} | {len(jobs)} prompts"
        + (f" x {per_prompt} answers" if per_prompt > 1 else "")
        + f", {len(done)} already answered, {to_answer} to answer here on {device} | "
        f"{'sampled' if generator.kwargs['do_sample'] else 'greedy'}"
        + (", the extra answers sampled" if per_prompt > 1 else "")
        + f", max {section.max_new_tokens} new tokens, batch {section.batch_size}"
    )
    tokens, capped, done_count, started = 0, 0, 0, time.perf_counter()
    with part.open("a", encoding="utf-8") as out:
        for k, batch in batches:
            texts, count, answers = generator.answer([ids for _, ids in batch], extra=k > 0)
            tokens += count
            for (job, prompt), text, (kept, ended) in zip(batch, texts, answers, strict=True):
                capped += not ended
                answer = {"role": "assistant", "content": text}
                # The exact ids: the trainer trains on them, not on a re-tokenization of
                # the text (dflash.data._sample_from_ids says why).
                ids = {"prompt": prompt, "answer": kept, "ended": ended}
                record = {
                    **job.record,
                    "messages": job.messages + [answer],
                    "prompt_id": job.pid,
                    **({"answer": k} if k else {}),
                    "answered_by": extra_by if k else by,
                    "token_ids": ids,
                }
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()  # an interrupted run keeps every finished batch
            done_count += len(batch)
            log(f"regenerate | rank {rank} | {done_count}/{to_answer}")
            if budget_s is not None and time.perf_counter() - started > budget_s:
                if done_count < to_answer:
                    log(
                        f"regenerate | rank {rank} | regenerate.budget_minutes "
                        f"{section.budget_minutes:g} spent: {done_count} of {to_answer} "
                        "answered (a rerun answers the rest)"
                    )
                break
    seconds = time.perf_counter() - started
    (parts_dir(output) / f"rank-{rank}-of-{world}.done").write_text(str(done_count))
    merged = merge_if_complete(jobs, output, world, log, per_prompt)
    rate = tokens / seconds if seconds > 0 else 0.0
    log(
        f"regenerate | rank {rank} | {done_count} answered, {tokens} tokens in {seconds:.1f} s "
        f"({rate:.0f} tokens/s) | {capped} of {done_count} ended at the length cap "
        f"(max_new_tokens {section.max_new_tokens})"
        + (f" | merged into {output}" if merged else "")
    )
    if done_count and capped * 2 > done_count:
        log(
            f"regenerate | warning: {capped} of {done_count} answers ({capped / done_count:.0%}) "
            f"were cut at regenerate.max_new_tokens={section.max_new_tokens} before the target "
            "ended them: the drafter would learn answers that stop mid-way. Raise "
            "regenerate.max_new_tokens (and data.seq_len to hold them)"
        )
    return {
        "answered": done_count,
        "tokens": tokens,
        "seconds": seconds,
        "merged": merged,
        "capped": capped,
    }


def merge_if_complete(
    jobs: list[Job], output: Path, world: int, log=print, per_prompt: int = 1
) -> bool:
    """Once every rank has marked itself done: the output in input order (a prompt's
    answers together), parts removed. The output keeps what it had (an earlier run) for
    prompts still in the input and gains the parts' records; answers to prompts no longer
    in the input (or past `per_prompt`) are left out."""
    folder = parts_dir(output)
    if any(not (folder / f"rank-{r}-of-{world}.done").exists() for r in range(world)):
        return False
    by_id: dict[str, str] = {}
    for path in [output] + sorted(folder.glob("rank-*.jsonl")):
        if not path.is_file():
            continue
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                by_id.setdefault(record_key(json.loads(line)), line)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue
    keys = (answer_key(j.pid, k) for j in jobs for k in range(per_prompt))
    order = [key for key in keys if key in by_id]
    dropped = len(by_id) - len(order)
    if dropped:
        log(
            f"regenerate | {dropped} answers to prompts no longer in the input (or past "
            "regenerate.answers_per_prompt): left out"
        )
    tmp = output.with_name(output.name + ".tmp")
    tmp.write_text("".join(by_id[pid] + "\n" for pid in order), encoding="utf-8")
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
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument(
        "--restart",
        action="store_true",
        help="remove answers made by another target or with other settings; answer again",
    )
    choice.add_argument(
        "--keep-mismatched",
        action="store_true",
        help="keep answers made by another target or with other settings as they are",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = _parse(argv)
    from .pipeline.train_config import TrainConfigError, load_train_config

    try:
        cfg = load_train_config(args.config, args.set)
        check_inputs(cfg)
        on_mismatch = "restart" if args.restart else "keep" if args.keep_mismatched else "refuse"
        run(cfg, log=lambda line: print(line, flush=True), on_mismatch=on_mismatch)
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
