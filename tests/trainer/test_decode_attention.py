"""Decoding runs without cuDNN attention (a plan built per new length: dflash/decode_attention.py)
and leaves PyTorch's process-wide switch as it found it, from any number of threads."""

from __future__ import annotations

import threading

import pytest
import torch
from dflash.decode_attention import without_cudnn_attention
from dflash.decode_batch import greedy_generate_batch_padded, speculative_generate_batch
from dflash.spec_decode import evaluate, speculative_generate
from dflash.target import greedy_generate, greedy_generate_batch

cudnn_on = torch.backends.cuda.cudnn_sdp_enabled


@pytest.fixture()
def switch_seen(tiny_target):
    """What the switch read at every target forward."""
    seen: list[bool] = []
    handle = tiny_target.register_forward_pre_hook(lambda *_: seen.append(cudnn_on()))
    yield seen
    handle.remove()


@pytest.fixture(params=[True, False], ids=["on before", "off before"])
def before(request):
    was = cudnn_on()
    torch.backends.cuda.enable_cudnn_sdp(request.param)
    yield request.param
    torch.backends.cuda.enable_cudnn_sdp(was)


def test_every_decode_path_runs_without_cudnn_and_restores_the_switch(
    tiny_target, make_drafter, switch_seen, before
):
    drafter = make_drafter().eval()
    prompts = [torch.tensor([3, 17, 42, 9, 100]), torch.tensor([7, 8, 9])]
    greedy_generate(tiny_target, prompts[0][None], 6)
    greedy_generate_batch(tiny_target, prompts[0][None], 6)
    greedy_generate_batch_padded(tiny_target, prompts, 6)
    speculative_generate(drafter, tiny_target, prompts[0][None], 8)
    speculative_generate_batch(drafter, tiny_target, prompts, 8)
    evaluate(drafter, tiny_target, prompts, max_new_tokens=8, batch_size=2)
    assert len(switch_seen) > 10
    assert not any(switch_seen), "a decode step ran with cuDNN attention on"
    assert cudnn_on() is before
    tiny_target(torch.tensor([[1, 2, 3]]))  # outside decoding: the process's own choice
    assert switch_seen[-1] is before


def test_an_error_inside_a_decode_still_restores_the_switch(before):
    with pytest.raises(RuntimeError, match="boom"), without_cudnn_attention():
        raise RuntimeError("boom")
    assert cudnn_on() is before


def test_overlapping_decodes_on_two_threads_restore_it_only_when_both_left(before):
    first_in, second_in, first_out, second_may_leave = (threading.Event() for _ in range(4))
    seen = {}

    def first():
        with without_cudnn_attention():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():
        first_in.wait(10)
        with without_cudnn_attention():
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = cudnn_on()
            second_may_leave.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    first_out.wait(10)
    second_may_leave.set()
    for t in threads:
        t.join(10)
    assert seen == {"after the first left": False}
    assert cudnn_on() is before
