"""python -m dflash.regenerate: the target's own answers, batched, sharded and resumable."""

from __future__ import annotations

import json

import pytest
import yaml
from dflash import build_tiny_target
from dflash.data import build_tiny_tokenizer, load_samples
from dflash.regenerate import main, prompt_id

QUESTIONS = [
    "what is two plus two?",
    "name three colours",
    "write a short answer about lists",
    "hello",
    "def main(): return sum(range(10))",
    "please write code for numbers and lists and a short answer about them",
]


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("target")
    build_tiny_target(seed=0).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def regenerate_config(tmp_path, target_dir, **regenerate):
    """(regenerate config path, output path) for QUESTIONS as a chat JSONL."""
    data = tmp_path / "chat.jsonl"
    lines = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "old"}]}
        for q in QUESTIONS
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in lines))
    config = tmp_path / "regen.yaml"
    section = {"input": str(data), "output": str(tmp_path / "regen.jsonl"), "max_new_tokens": 8}
    section.update({"device": "cpu", "batch_size": 4, **regenerate})
    config.write_text(yaml.safe_dump({"target": {"path": str(target_dir)}, "regenerate": section}))
    return config, tmp_path / "regen.jsonl"


def _answers(path):
    return [
        (r["prompt_id"], r["messages"][-1]["content"])
        for r in map(json.loads, path.read_text().splitlines())
    ]


def test_the_target_answers_every_prompt_and_the_trainer_reads_it(tmp_path, target_dir, capsys):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["messages"][0]["content"] for r in records] == QUESTIONS  # input order
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    assert all(r["messages"][-1]["content"] != "old" for r in records)
    assert records[0]["prompt_id"] == prompt_id(records[0]["messages"][:1])
    assert "greedy" in capsys.readouterr().out
    tokenizer = build_tiny_tokenizer()
    samples, stats = load_samples(output, tokenizer, max_length=64, block_size=2)
    assert stats.unrenderable == 0 and stats.kept + stats.too_few_loss_tokens == len(QUESTIONS)

    # Batched with left padding gives what one prompt at a time gives (greedy).
    (tmp_path / "one").mkdir()
    single, single_out = regenerate_config(tmp_path / "one", target_dir, batch_size=1)
    assert main(["--config", str(single)]) == 0
    assert _answers(single_out) == _answers(output)


def test_a_rerun_answers_only_what_is_missing(tmp_path, target_dir, capsys):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    full = output.read_text().splitlines()
    output.write_text("\n".join(full[:3]) + "\n" + full[3][:10])  # interrupted mid-line
    capsys.readouterr()
    assert main(["--config", str(config)]) == 0
    assert "3 already answered, 3 to answer" in capsys.readouterr().out
    assert output.read_text().splitlines() == full
    assert main(["--config", str(config)]) == 0
    assert "6 already answered, 0 to answer" in capsys.readouterr().out


def test_ranks_take_their_shares_and_the_last_one_merges(tmp_path, target_dir, monkeypatch):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    whole = output.read_text()
    output.unlink()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["--config", str(config)]) == 0
    assert not output.exists()  # rank 0 has not finished: nothing merged yet
    part = (tmp_path / "regen.jsonl.parts" / "rank-1-of-2.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["messages"][0]["content"] for x in part) == sorted(QUESTIONS[1::2])
    monkeypatch.setenv("RANK", "0")
    assert main(["--config", str(config)]) == 0
    assert output.read_text() == whole and not (tmp_path / "regen.jsonl.parts").exists()


def test_bad_input_is_a_clear_error(tmp_path, target_dir, capsys):
    config, _ = regenerate_config(tmp_path, target_dir, input=str(tmp_path / "missing.jsonl"))
    assert main(["--config", str(config)]) == 2
    assert "regenerate.input" in capsys.readouterr().err
    config.write_text(yaml.safe_dump({"regenerate": {"input": str(config), "output": "x.jsonl"}}))
    assert main(["--config", str(config)]) == 2
    assert "target.path" in capsys.readouterr().err


@pytest.fixture(scope="module")
def other_target_dir(tmp_path_factory):
    """Another target of the same shape and tokenizer: only its weights differ."""
    folder = tmp_path_factory.mktemp("other-target")
    build_tiny_target(seed=1).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def _with(config, **changes):
    """The config file with its target/regenerate keys changed."""
    data = yaml.safe_load(config.read_text())
    for key, value in changes.items():
        section, leaf = key.split("__")
        data[section][leaf] = value
    config.write_text(yaml.safe_dump(data))
    return config


def test_answers_of_another_target_are_refused_then_restarted_or_kept(
    tmp_path, target_dir, other_target_dir, capsys
):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    first = output.read_text()
    _with(config, target__path=str(other_target_dir))
    capsys.readouterr()
    assert main(["--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "6 answers made with a different target weights" in err
    assert "--restart" in err and "--keep-mismatched" in err
    assert output.read_text() == first  # refused: nothing touched

    assert main(["--config", str(config), "--restart"]) == 0
    assert "0 already answered, 6 to answer" in capsys.readouterr().out
    records = [json.loads(x) for x in output.read_text().splitlines()]
    assert len(records) == 6 and len({r["answered_by"] for r in records}) == 1
    assert records[0]["answered_by"] != json.loads(first.splitlines()[0])["answered_by"]

    # Back to the first target, keeping the other one's answers on purpose.
    _with(config, target__path=str(target_dir))
    assert main(["--config", str(config), "--keep-mismatched"]) == 0
    out = capsys.readouterr().out
    assert "keeping 6 answers made by another target" in out
    assert "6 already answered, 0 to answer" in out


def test_other_generation_settings_or_unkeyed_answers_are_refused(tmp_path, target_dir, capsys):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    _with(config, regenerate__max_new_tokens=12)
    capsys.readouterr()
    assert main(["--config", str(config)]) == 2
    assert "with a different generation" in capsys.readouterr().err
    # Records written before answers named their target count as another target's.
    _with(config, regenerate__max_new_tokens=8)
    records = [json.loads(x) for x in output.read_text().splitlines()]
    output.write_text("".join(json.dumps({**r, "answered_by": None}) + "\n" for r in records))
    assert main(["--config", str(config)]) == 2
    assert "before answers recorded their target" in capsys.readouterr().err


def test_answers_to_prompts_no_longer_in_the_input_are_left_out(tmp_path, target_dir, capsys):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    source = tmp_path / "chat.jsonl"
    lines = source.read_text().splitlines()
    new = {"messages": [{"role": "user", "content": "a new question"}]}
    source.write_text("\n".join(lines[:3] + [json.dumps(new)]) + "\n")
    capsys.readouterr()
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "3 already answered, 1 to answer" in out
    assert "3 answers to prompts no longer in the input (or past" in out
    kept = [json.loads(x)["messages"][0]["content"] for x in output.read_text().splitlines()]
    assert kept == QUESTIONS[:3] + ["a new question"]


def test_answers_cut_at_the_length_cap_are_counted_and_most_of_them_warned(
    tmp_path, target_dir, capsys
):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    records = [json.loads(x) for x in output.read_text().splitlines()]
    capped = sum(not r["token_ids"]["ended"] for r in records)
    out = capsys.readouterr().out
    assert f"{capped} of 6 ended at the length cap (max_new_tokens 8)" in out
    assert capped > 3  # a random tiny target seldom says its stop token in 8 tokens
    assert "were cut at regenerate.max_new_tokens=8" in out


def test_a_regeneration_budget_answers_a_share_and_a_rerun_the_rest(tmp_path, target_dir, capsys):
    # A budget far below one batch's time: one batch is answered, then it stops.
    config, output = regenerate_config(tmp_path, target_dir, batch_size=2, budget_minutes=1e-6)
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "regenerate.budget_minutes 1e-06 spent: 2 of 6 answered" in out
    assert len(output.read_text().splitlines()) == 2
    assert main(["--config", str(config)]) == 0
    assert "2 already answered, 4 to answer" in capsys.readouterr().out


def test_extra_answers_per_prompt_are_sampled_pass_by_pass_and_keep_the_first(
    tmp_path, target_dir, capsys
):
    config, output = regenerate_config(tmp_path, target_dir)
    assert main(["--config", str(config)]) == 0
    first = _answers(output)
    capsys.readouterr()
    # Raising answers_per_prompt keeps the greedy answers and adds sampled ones.
    config, output = regenerate_config(tmp_path, target_dir, answers_per_prompt=3)
    assert main(["--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "6 prompts x 3 answers, 6 already answered, 12 to answer" in out
    assert "the extra answers sampled" in out
    records = [json.loads(x) for x in output.read_text().splitlines()]
    assert [(r["prompt_id"], r.get("answer", 0)) for r in records] == [
        (pid, k) for pid, _ in first for k in range(3)
    ]  # input order, a prompt's answers together
    assert [(r["prompt_id"], r["messages"][-1]["content"]) for r in records[::3]] == first
    texts = {pid: set() for pid, _ in first}
    for r in records:
        texts[r["prompt_id"]].add(r["messages"][-1]["content"])
    assert sum(len(t) for t in texts.values()) > len(first)  # sampled, not the greedy again
    tokenizer = build_tiny_tokenizer()
    samples, stats = load_samples(output, tokenizer, max_length=64, block_size=2)
    assert stats.unrenderable == 0 and stats.kept + stats.too_few_loss_tokens == 18

    # A rerun has nothing to do; fewer answers per prompt leaves the extra ones out.
    assert main(["--config", str(config)]) == 0
    assert "18 already answered, 0 to answer" in capsys.readouterr().out
    config, output = regenerate_config(tmp_path, target_dir, answers_per_prompt=2)
    assert main(["--config", str(config)]) == 0
    assert "6 answers to prompts no longer in the input (or past" in capsys.readouterr().out
    assert [r.get("answer", 0) for r in map(json.loads, output.read_text().splitlines())] == [
        0,
        1,
    ] * 6


def test_a_budget_cut_drops_later_passes_before_any_prompt(tmp_path, target_dir, capsys):
    # A budget below one batch's time answers one batch: of first answers, never an extra.
    config, output = regenerate_config(
        tmp_path, target_dir, batch_size=6, budget_minutes=1e-6, answers_per_prompt=4
    )
    assert main(["--config", str(config)]) == 0
    assert "spent: 6 of 24 answered" in capsys.readouterr().out
    records = [json.loads(x) for x in output.read_text().splitlines()]
    assert len(records) == 6 and all("answer" not in r for r in records)
