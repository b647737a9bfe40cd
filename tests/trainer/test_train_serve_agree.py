# ruff: noqa: F811  (the target_dir fixture is imported, and then asked for by name)
"""Training's acceptance and serving's acceptance agree on the target's own greedy text.

tau~ (the teacher-forced `accept_len` of `drafter_loss`) and eval tau (real speculative
decoding) measure the same thing when the training tokens are what the target says and
the decoder's committed prefix ends where the training anchor sits: then the context
hidden states, positions, block tokens and masks are the same, and so is the number of
drafted tokens the greedy target accepts. Checked here seam by seam:

- numerically: for anchors inside a greedy continuation, the training forward (a padded
  batch, as `collate` builds it) and both decoders (one prompt; batched with left padding)
  give the same block logits and the same acceptance length;
- the chat seam: a regenerated conversation, read back by the trainer, holds the very
  token ids the target was prompted with and wrote (byte-level BPE re-encoding of the
  decoded text need not give them back), and the eval prompt of a chat sample is the
  generation-prompt rendering a server sends, not a cut of the full rendering.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash import build_tiny_target, drafter_loss
from dflash.data import Sample, build_tiny_tokenizer, collate, load_samples
from dflash.decode_batch import speculative_generate_batch
from dflash.objective import drafter_block_hidden
from dflash.regenerate import main as regenerate_main
from dflash.serving_walk import dense_acceptance, walk, walk_tau
from dflash.spec_decode import DrafterCache, draft_block_logits, speculative_generate
from dflash.target import cached_forward, greedy_generate, new_cache, select_layers, target_context

from tests.trainer.test_regenerate import QUESTIONS, regenerate_config, target_dir  # noqa: F401

PROMPT_LEN, NEW = 10, 40


def _greedy_text(target, seed=11):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 500, (1, PROMPT_LEN), generator=gen)
    answer, _ = greedy_generate(target, prompt, NEW)
    return prompt[0].tolist() + answer


def _train_on(drafter, target, cfg, sequence, steps=60):
    """Fit the drafter to this continuation, so that it accepts a varying number of tokens
    (an untrained drafter accepts none anywhere and would prove nothing)."""
    ids = torch.tensor([sequence])
    context = target_context(target, ids, None, cfg.target_layer_ids)
    block = cfg.block_size
    anchors = torch.arange(PROMPT_LEN, len(sequence) - block + 1)[None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss, _ = drafter_loss(drafter, context, ids, anchors, valid)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def setup(tiny_target):
    from dflash import DFlashDrafter, DrafterConfig, target_parts

    cfg = DrafterConfig.from_target_config(
        tiny_target.config, num_layers=2, block_size=4, mask_token_id=511, gamma=4.0
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).bind_target(*target_parts(tiny_target))
    sequence = _greedy_text(tiny_target)
    return cfg, _train_on(drafter, tiny_target, cfg, sequence), sequence


def _training_view(drafter, target, cfg, sequence, anchor):
    """What training computes for one anchor: a right-padded batch of two rows (the other
    row a different sample), context from `target_context` with the attention mask."""
    other = Sample(list(range(3, 3 + len(sequence) // 2)), [True] * (len(sequence) // 2))
    batch = collate(
        [Sample(sequence, [False] * PROMPT_LEN + [True] * NEW), other], len(sequence) + 8, 2, 0
    )
    context = target_context(target, batch.input_ids, batch.attention_mask, cfg.target_layer_ids)
    anchors = torch.tensor([[anchor], [0]])
    valid = torch.tensor([[True], [False]])
    with torch.no_grad():
        hidden = drafter_block_hidden(drafter, context, batch.input_ids, anchors, valid)
        _, metrics = drafter_loss(
            drafter, context, batch.input_ids, anchors, valid, loss_mask=batch.loss_mask
        )
    return drafter.logits(hidden)[0, 0].float(), float(metrics["accept_len"])


def _serving_view(drafter, target, cfg, sequence, anchor):
    """The one-prompt decoder with its committed prefix ending right before `anchor`: the
    prompt is sequence[:anchor]; the prefill's argmax is sequence[anchor] (greedy text)."""
    prompt = torch.tensor([sequence[:anchor]])
    out = cached_forward(target, prompt, 0, new_cache(target), hidden=True)
    assert int(out.logits[0, -1].argmax()) == sequence[anchor]
    cache = DrafterCache()
    cache.extend(drafter, select_layers(out.hidden_states, cfg.target_layer_ids))
    logits = draft_block_logits(drafter, cache, sequence[anchor])[0]
    spec = speculative_generate(drafter, target, prompt, cfg.block_size + 1)
    return logits, spec.acceptance_lengths[0], spec


def test_training_accept_len_equals_served_acceptance(tiny_target, setup):
    cfg, drafter, sequence = setup
    block = cfg.block_size
    anchors = range(PROMPT_LEN, len(sequence) - block + 1)
    train_lengths, served_lengths = [], []
    for anchor in anchors:
        train_logits, train_len = _training_view(drafter, tiny_target, cfg, sequence, anchor)
        serve_logits, served, spec = _serving_view(drafter, tiny_target, cfg, sequence, anchor)
        torch.testing.assert_close(train_logits, serve_logits, atol=1e-4, rtol=1e-4)
        assert spec.tokens[:served] == sequence[anchor : anchor + served]  # lossless
        train_lengths.append(round(train_len))
        served_lengths.append(served)
    assert train_lengths == served_lengths
    assert len(set(served_lengths)) > 1, (
        f"the drafter must accept varying lengths: {served_lengths}"
    )


def test_batched_decoder_accepts_what_training_counts(tiny_target, setup):
    """The eval's batched decoder (left padding, rows of other lengths) agrees too."""
    cfg, drafter, sequence = setup
    block = cfg.block_size
    anchors = list(range(PROMPT_LEN, len(sequence) - block + 1, 3))
    prompts = [torch.tensor(sequence[:a]) for a in anchors]
    specs = speculative_generate_batch(drafter, tiny_target, prompts, block + 1)
    for anchor, spec in zip(anchors, specs, strict=True):
        _, train_len = _training_view(drafter, tiny_target, cfg, sequence, anchor)
        assert spec.tokens[0] == sequence[anchor]
        assert spec.acceptance_lengths[0] == round(train_len), anchor


# -- the chat seam: the tokens training sees are the tokens the target wrote ---------------------
def test_regenerated_samples_hold_the_targets_own_tokens(tmp_path, target_dir):
    tokenizer = build_tiny_tokenizer()
    target = build_tiny_target(seed=0)
    config, out = regenerate_config(tmp_path, target_dir, max_new_tokens=24)
    assert regenerate_main(["--config", str(config)]) == 0
    samples, stats = load_samples(out, tokenizer, max_length=512, block_size=2)
    assert stats.kept == len(QUESTIONS)
    stops = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    for question, sample in zip(QUESTIONS, samples, strict=True):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        answer, _ = greedy_generate(target, torch.tensor([prompt]), 24, sorted(stops))
        written = [t for t in answer if t not in stops]
        # Training sees the prompt the target was given and the tokens it wrote, in the loss.
        assert sample.input_ids[: len(prompt) + len(written)] == prompt + written
        assert not any(sample.loss_mask[: len(prompt)])
        assert all(sample.loss_mask[len(prompt) : len(prompt) + len(written)])
        # The eval prompt of a chat sample is what a server sends: the generation prompt.
        assert sample.prompt_ids == prompt


def test_edited_content_falls_back_to_the_text(tmp_path):
    """Stored token ids that no longer decode to the message's content are not used."""
    tokenizer = build_tiny_tokenizer()
    prompt = [{"role": "user", "content": "hello"}]
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer("four", add_special_tokens=False)["input_ids"]
    record = {
        "messages": prompt + [{"role": "assistant", "content": "five and six and seven"}],
        "token_ids": {"prompt": ids, "answer": answer_ids},
    }
    path = tmp_path / "edited.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (sample,), _ = load_samples(path, tokenizer, max_length=512, block_size=2)
    full = tokenizer.apply_chat_template(record["messages"], tokenize=False)
    assert sample.input_ids == tokenizer(full, add_special_tokens=False)["input_ids"]


# -- tau~ as serving meets the text ------------------------------------------------------------
def test_the_serving_walk_over_training_text_accepts_what_the_decoder_accepts(tiny_target, setup):
    """Acceptance at every anchor of a padded training batch, walked from the answer's
    first token (next anchor = anchor + accepted + 1), gives the decoder's own block
    lengths; the uniform mean over anchors does not."""
    cfg, drafter, sequence = setup
    other = Sample(list(range(3, 3 + len(sequence) // 2)), [True] * (len(sequence) // 2))
    batch = collate(
        [Sample(sequence, [False] * PROMPT_LEN + [True] * NEW), other], len(sequence) + 8, 2, 0
    )
    context = target_context(
        tiny_target, batch.input_ids, batch.attention_mask, cfg.target_layer_ids
    )
    lengths = dense_acceptance(drafter, context, batch.input_ids, batch.loss_mask, chunk=5)
    visited = walk(lengths[0].tolist())
    spec = speculative_generate(drafter, tiny_target, torch.tensor([sequence[:PROMPT_LEN]]), NEW)
    # The walk stops where a whole block no longer fits before the padding; up to there it
    # is the decoder's walk, block by block.
    assert visited == spec.acceptance_lengths[: len(visited)]
    assert sum(visited) > NEW - 2 * cfg.block_size
    assert len(set(visited)) > 1
    answer = lengths[0][lengths[0] > 0].float()
    walked = walk_tau(drafter, context[:1], batch.input_ids[:1], batch.loss_mask[:1], chunk=5)
    assert walked == sum(visited) / len(visited)
    assert walked != pytest.approx(float(answer.mean()), abs=1e-3)


def test_a_row_of_several_answers_is_walked_answer_by_answer():
    """Prompt tokens (0) end one walk; the next answer starts at its first token."""
    assert walk([0, 0, 3, 1, 1, 2, 1, 1, 0, 0, 2, 2, 1]) == [3, 2, 1, 2, 1]
    assert walk([0, 0, 0]) == []
