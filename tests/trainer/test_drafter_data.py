"""Data: chat template and assistant loss masks, filtering, static batches, regeneration."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.data import (
    Sample,
    build_tiny_tokenizer,
    iterate_batches,
    load_samples,
    prepare_samples,
    read_records,
    regenerate,
    synthetic_samples,
    tokenize_conversation,
)
from dflash.data import (
    _main as data_main,
)
from dflash.target import greedy_generate

CHAT = [
    {"role": "system", "content": "Be short."},
    {"role": "user", "content": "what is two plus two?"},
    {"role": "assistant", "content": "Four."},
    {"role": "user", "content": "Name three colours"},
    {"role": "assistant", "content": "red, green and blue"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def test_tiny_tokenizer_fits_the_tiny_target(tokenizer):
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids("<|MASK|>") == 511
    text = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nwhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer("hello, colours: 4 + 4", add_special_tokens=False)["input_ids"]
    assert max(ids) < 508 and tokenizer.decode(ids) == "hello, colours: 4 + 4"


def test_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    sample = tokenize_conversation(tokenizer, CHAT)
    masked = tokenizer.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    )
    assert masked == "Four.<|im_end|>\nred, green and blue<|im_end|>\n"
    unmasked = tokenizer.decode(
        [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if not m]
    )
    assert "two plus two" in unmasked and "Four" not in unmasked and "green" not in unmasked


def test_short_samples_are_dropped_and_long_ones_truncated(tokenizer):
    long_answer = " ".join(["red green blue"] * 20)
    records = [
        {"messages": CHAT},  # about 12 assistant tokens: fewer than 2*B = 16 for B = 8
        {
            "messages": [
                {"role": "user", "content": "colours?"},
                {"role": "assistant", "content": long_answer},
            ]
        },
        {
            "text": "The drafter proposes a block of tokens and the target verifies them in one pass."
        },
    ]
    samples, stats = prepare_samples(records, tokenizer, max_length=40, block_size=8)
    assert stats.kept == 2 and stats.too_few_loss_tokens == 1
    assert all(len(s.input_ids) <= 40 and s.num_loss_tokens >= 16 for s in samples)
    assert all(samples[1].loss_mask)  # plain text: every token counts


def test_records_from_jsonl_and_text_files(tmp_path, tokenizer):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text(json.dumps({"messages": CHAT}) + "\n\n" + json.dumps({"text": "hello"}) + "\n")
    assert [sorted(r) for r in read_records(jsonl)] == [["messages"], ["text"]]
    text = tmp_path / "book.txt"
    text.write_text("first document\nstill first\n\nsecond document\n")
    assert read_records(text) == [
        {"text": "first document\nstill first"},
        {"text": "second document"},
    ]
    samples, _ = load_samples(text, tokenizer, max_length=64, block_size=2)
    assert len(samples) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_records(bad)


def test_batches_have_static_shapes_and_cover_every_sample():
    samples = [Sample(list(range(1, n + 1)), [True] * n) for n in (5, 9, 16, 17, 30, 3, 12)]
    batches = list(iterate_batches(samples, batch_size=3, seq_lens=[16, 32], pad_id=0, seed=4))
    seen = []
    for batch in batches:
        n, s = batch.input_ids.shape
        assert n == 3 and s in (16, 32)
        assert batch.loss_mask.shape == batch.attention_mask.shape == (3, s)
        for row in range(3):
            length = int(batch.attention_mask[row].sum())
            if length:
                seen.append(length)
                assert s == (16 if length <= 16 else 32)  # the smallest bucket that holds it
            assert not batch.loss_mask[row, length:].any()
            assert (batch.input_ids[row, length:] == 0).all()
    assert sorted(seen) == [3, 5, 9, 12, 16, 17, 30]
    again = list(iterate_batches(samples, batch_size=3, seq_lens=[16, 32], pad_id=0, seed=4))
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(batches, again, strict=True))


def test_synthetic_samples_are_the_targets_greedy_continuations(tiny_target):
    samples = synthetic_samples(
        tiny_target, num_samples=3, prompt_len=6, response_len=10, seed=2, max_token_id=500
    )
    for sample in samples:
        prompt = torch.tensor([sample.input_ids[:6]])
        reference, _ = greedy_generate(tiny_target, prompt, 10)
        assert sample.input_ids[6:] == reference
        assert sample.loss_mask == [False] * 6 + [True] * 10


def test_greedy_generate_matches_transformers_generate(tiny_target):
    prompt = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(3))
    ours, forwards = greedy_generate(tiny_target, prompt, 12)
    theirs = tiny_target.generate(
        prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
    )
    assert ours == theirs[0, 9:].tolist() and forwards == 12


def test_regenerate_replaces_the_final_answer_with_the_targets(tiny_target, tokenizer):
    records = [{"messages": CHAT, "id": 7}, {"text": "unchanged"}]
    out = regenerate(tiny_target, tokenizer, records, max_new_tokens=8)
    assert out[1] == {"text": "unchanged"}
    assert out[0]["id"] == 7 and out[0]["messages"][:4] == CHAT[:4]
    prompt = tokenizer.apply_chat_template(CHAT[:4], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    expected = tiny_target.generate(
        ids, max_new_tokens=8, do_sample=False, eos_token_id=[510, 508], pad_token_id=508
    )
    answer = out[0]["messages"][4]
    assert answer["role"] == "assistant"
    assert answer["content"] == tokenizer.decode(
        expected[0, ids.shape[1] :], skip_special_tokens=True
    )


def test_regenerate_command_runs_offline_from_a_local_target(tmp_path, tiny_target, tokenizer):
    model_dir = tmp_path / "target"
    tiny_target.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (tmp_path / "in.jsonl").write_text(json.dumps({"messages": CHAT[:2]}) + "\n")
    code = data_main(
        [
            "regenerate",
            "--target",
            str(model_dir),
            "--input",
            str(tmp_path / "in.jsonl"),
            "--output",
            str(tmp_path / "out.jsonl"),
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
    )
    assert code == 0
    (record,) = read_records(tmp_path / "out.jsonl")
    assert record["messages"][:2] == CHAT[:2] and record["messages"][2]["role"] == "assistant"
    assert (
        record == regenerate(tiny_target, tokenizer, [{"messages": CHAT[:2]}], max_new_tokens=6)[0]
    )
