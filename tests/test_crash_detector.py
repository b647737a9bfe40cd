"""The streaming detector: grouping tracebacks, attributing threads, root causes, exits."""

from __future__ import annotations

import pytest

from dflashctl.crash import CrashDetector, classify_text, load_rules
from dflashctl.crash.detector import TAIL_REACH

SP = "/usr/local/lib/python3.11/site-packages"
OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total "
    "capacity of 139.72 GiB of which 1.12 GiB is free."
)


@pytest.fixture(scope="module")
def rules():
    return load_rules()


def classify(rules, text: str, exit_code: int | None = 1):
    return classify_text(text.strip("\n").splitlines(), exit_code, rules)


def frames(func: str = "run") -> list[str]:
    return [
        '  File "/root/dflash/current/dflash/pipeline/drafter_worker.py", line 211, in ' + func,
        "    loss = self._train_step(batch)",
        "           ^^^^^^^^^^^^^^^^^^^^^^^",
    ]


def test_interleaved_lines_do_not_break_a_traceback(rules):
    lines = [
        "drafter-5 on cuda:5: recording new shape",
        "drafter-5 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "drafter-0 on cuda:0: step 12 replay",
        "step 12/100 | loss 2.31 | acc 0.52",
        f'  File "{SP}/torch/nn/modules/linear.py", line 125, in forward',
        "drafter-1 on cuda:1: step 12 replay",
        "    return F.linear(input, self.weight, self.bias)",
        OOM,
        "step 13/100 | loss 2.30 | acc 0.52",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.category, event.thread, event.device, event.stage) == (
        "cuda_oom",
        "drafter-5",
        "cuda:5",
        "recording new shape",
    )
    assert event.exception == "torch.OutOfMemoryError"
    assert event.message.startswith("CUDA out of memory. Tried to allocate 2.00 GiB.")
    assert event.last_frame == "torch/nn/modules/linear.py:125 in forward"
    assert event.line == 2 and event.is_root_cause
    assert "step 12/100 | loss 2.31 | acc 0.52" not in event.excerpt
    assert event.excerpt[-1] == OOM


def test_the_stage_is_the_threads_own_last_stage(rules):
    lines = [
        "drafter-2 on cuda:7: warming compiled graphs",
        "drafter-3 on cuda:3: ready (warm-up 40.1 s)",
        "drafter-2 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "ValueError: bad batch",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.thread, event.device, event.stage) == (
        "drafter-2",
        "cuda:7",
        "warming compiled graphs",
    )
    assert event.category == "thread_exception"


def test_python_thread_names_with_spaces_are_kept(rules):
    lines = [
        "Exception in thread Thread-3 (prefetch):",
        "Traceback (most recent call last):",
        *frames("prefetch"),
        "KeyError: 'hidden_states'",
    ]
    [event] = classify_text(lines, 0, rules)
    assert (event.category, event.thread, event.exception) == (
        "thread_exception",
        "Thread-3 (prefetch)",
        "KeyError",
    )


def test_an_announcement_long_before_the_traceback_is_not_used(rules):
    lines = ["drafter-2 failed:"] + [f"step {i}/100 | loss 2.0" for i in range(20)]
    lines += ["Traceback (most recent call last):", *frames(), "ValueError: x"]
    [event] = classify_text(lines, 1, rules)
    assert event.thread is None and event.category == "python_exception"


def test_chained_exceptions_are_one_event_named_by_the_matching_exception(rules):
    lines = [
        "drafter-1 failed:",
        "Traceback (most recent call last):",
        *frames(),
        OOM,
        "",
        "During handling of the above exception, another exception occurred:",
        "",
        "Traceback (most recent call last):",
        *frames("_recover"),
        "RuntimeError: could not free the CUDA graph pool",
    ]
    [event] = classify_text(lines, 1, rules)
    assert event.category == "cuda_oom"
    assert event.exception == "torch.OutOfMemoryError"
    assert event.excerpt[-1] == "RuntimeError: could not free the CUDA graph pool"


def test_a_generic_chain_reports_the_exception_that_ended_the_run(rules):
    lines = [
        "Traceback (most recent call last):",
        *frames(),
        "KeyError: 'labels'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        *frames("main"),
        "RuntimeError: drafter-0 failed",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.category, event.exception, event.message) == (
        "python_exception",
        "RuntimeError",
        "drafter-0 failed",
    )


def test_the_first_failure_is_the_root_cause_and_later_ones_consequences(rules):
    lines = [
        "drafter-2 on cuda:7: warming compiled graphs",
        "drafter-2 failed:",
        "Traceback (most recent call last):",
        f'  File "{SP}/torch/_inductor/cudagraph_trees.py", line 341, in get_obj',
        "    assert torch._C._is_key_in_tls(attr_name)",
        "AssertionError",
        "drafter-4 on cuda:4: warming compiled graphs",
        "drafter-4 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "threading.BrokenBarrierError",
    ]
    events = classify_text(lines, 1, rules)
    assert [(e.category, e.thread, e.is_root_cause) for e in events] == [
        ("cudagraph_tls", "drafter-2", True),
        ("thread_exception", "drafter-4", False),
    ]
    assert events[0].message == "assert torch._C._is_key_in_tls(attr_name)"
    assert [e.to_json()["root_cause"] for e in events] == [True, False]


def test_an_assertion_elsewhere_is_not_the_cudagraph_tls_bug(rules):
    lines = [
        "Traceback (most recent call last):",
        f'  File "{SP}/torch/_inductor/cudagraph_trees.py", line 951, in run',
        "    assert data_ptr == new_inputs[idx].data_ptr()",
        f'  File "{SP}/torch/_inductor/graph.py", line 12, in check',
        "    assert ok",
        "AssertionError",
    ]
    [event] = classify_text(lines, 1, rules)
    assert event.category == "python_exception"


def test_a_traceback_is_reported_once_the_tail_window_passes(rules):
    detector = CrashDetector(rules)
    for line in ["drafter-1 failed:", "Traceback (most recent call last):", *frames()]:
        assert detector.feed(line) == []
    assert detector.feed("ValueError: bad batch") == []  # a chained traceback may follow
    reported = []
    for i in range(TAIL_REACH):
        reported += detector.feed(f"step {i}/100 | loss 2.0")
    assert [e.category for e in reported] == ["thread_exception"]
    assert detector.finish(1) == []


def test_flush_reports_what_waits_when_the_log_goes_quiet(rules):
    detector = CrashDetector(rules)
    for line in ["Traceback (most recent call last):", *frames(), "ValueError: bad batch"]:
        detector.feed(line)
    assert [e.exception for e in detector.flush()] == ["ValueError"]
    assert detector.finish(1) == []


def test_a_multi_line_message_keeps_the_inner_error(rules):
    lines = [
        "Traceback (most recent call last):",
        *frames(),
        "torch._dynamo.exc.BackendCompilerFailed: backend='inductor' raised:",
        "RuntimeError: lowering failed for aten.index_put",
        "",
        "Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace",
    ]
    [event] = classify_text(lines, 1, rules)
    assert event.category == "compile_error"
    assert (
        event.message
        == "backend='inductor' raised: RuntimeError: lowering failed for aten.index_put"
    )


def test_torchrun_rank_prefixes_are_understood(rules):
    lines = ["[rank3]:Traceback (most recent call last):"]
    lines += [f"[rank3]:{line}" for line in frames()]
    lines += ["[rank3]:RuntimeError: CUDA error: an illegal memory access was encountered"]
    [event] = classify_text(lines, 1, rules)
    assert event.category == "illegal_memory_access"
    assert event.rank == 3


def test_threads_of_different_ranks_keep_their_own_device(rules):
    """One torchrun log: rank 0's drafter-0 (unprefixed) and rank 1's, whose lines carry
    torch's [rank1]: prefix; the failure is rank 1's, on rank 1's device."""
    lines = [
        "drafter-0 on cuda:0: warming compiled graphs",
        "[rank1]: drafter-0 on cuda:1: warming compiled graphs",
        "drafter-0 on cuda:0: training",
        "[rank1]: drafter-0 failed:",
        "[rank1]: Traceback (most recent call last):",
        *(f"[rank1]: {line}" for line in frames()),
        "[rank1]: RuntimeError: CUDA error: an illegal memory access was encountered",
        "drafter-0 on cuda:0: training",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.thread, event.device, event.rank) == ("drafter-0", "cuda:1", 1)
    assert event.stage == "warming compiled graphs"
    assert event.to_json()["rank"] == 1


def test_a_rank_stopped_by_another_ranks_failure_names_that_rank(rules):
    """Rank 0's own log (another host): its drafter's collective failed because rank 1
    died; the trainer names rank 1's cause (a real gloo run's lines, paths shortened)."""
    cause = (
        "rank 1 failed: rank 1/2 on host gpu-b (pid 16368): drafter-0 on cuda:1 failed: "
        "InjectedFailure: injected failure in drafter-0 at step 3 (debug.fail_in)"
    )
    lines = [
        "drafter-0 on cuda:0: training",
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        '  File "/root/dflash/current/dflash/pipeline/replicas.py", line 293, in _average',
        "    work.wait()",
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:434. This is typically caused by a remote worker crashing.",
        "The above exception was the direct cause of the following exception:",
        "Traceback (most recent call last):",
        '  File "/root/dflash/current/dflash/pipeline/replicas.py", line 262, in average',
        "    raise cause from exc",
        f"dflash.pipeline.distributed.PeerFailure: {cause}",
        f"training failed (rank 0/2 on host gpu-a (pid 16367)): drafter-0 on cuda:0 failed: "
        f"PeerFailure: {cause}",
    ]
    event = classify_text(lines, 1, rules)[0]
    assert (event.category, event.thread, event.device) == ("peer_failure", "drafter-0", "cuda:0")
    assert "rank 1/2 on host gpu-b" in event.message and "drafter-0 on cuda:1" in event.message


def test_a_crash_after_a_progress_bar_redraw_is_found(rules):
    [event] = classify(
        rules, "eval:  99%|#########9| 99/100\rFatal Python error: Segmentation fault", -11
    )
    assert event.category == "segfault"


def test_kernel_assertion_lines_join_the_device_assert_traceback(rules):
    kernel = (
        "/pytorch/aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: "
        "block: [0,0,0], thread: [{t},0,0] Assertion `t >= 0 && t < n_classes` failed."
    )
    lines = [kernel.format(t=t) for t in range(50)]
    lines += ["drafter-0 failed:", "Traceback (most recent call last):", *frames()]
    lines += ["RuntimeError: CUDA error: device-side assert triggered"]
    [event] = classify_text(lines, 1, rules)
    assert event.category == "device_assert" and event.line == 1 and event.thread == "drafter-0"
    assert len(event.excerpt) <= 60 and event.excerpt[-1].endswith("device-side assert triggered")


def test_repeated_one_line_failures_are_one_event(rules):
    watchdog = (
        "[rank{r}]:[E1129 10:31:07.412345678 ProcessGroupNCCL.cpp:632] [Rank {r}] Watchdog caught "
        "collective operation timeout: WorkNCCL(SeqNum=4821, OpType=ALLREDUCE, NumelIn=1, "
        "NumelOut=1, Timeout(ms)=600000) ran for 600012 milliseconds before timing out."
    )
    events = classify(rules, "\n".join(watchdog.format(r=r) for r in range(8)), None)
    assert [e.category for e in events] == ["nccl_timeout"]
    assert len(events[0].excerpt) == 8


@pytest.mark.parametrize(
    ("exit_code", "category", "rule"),
    [
        (137, "killed", "killed"),
        (-9, "killed", "killed"),
        (-11, "segfault", "segfault"),
        (139, "segfault", "segfault"),
        (134, "aborted", "aborted"),
        (1, "exit_status", "nonzero_exit"),
    ],
)
def test_the_exit_status_names_a_crash_the_log_does_not_show(rules, exit_code, category, rule):
    [event] = classify(rules, "step 1/10 | loss 2.0\nstep 2/10 | loss 1.9", exit_code)
    assert (event.category, event.rule) == (category, rule)
    assert event.line == 2 and event.excerpt[-1] == "step 2/10 | loss 1.9"
    assert str(exit_code) in event.message


@pytest.mark.parametrize("exit_code", [0, 130, 143, -2, -15, None])
def test_a_run_that_ended_or_was_stopped_is_not_a_crash(rules, exit_code):
    assert classify(rules, "step 2/10 | loss 1.9\ncheckpoint written", exit_code) == []


def test_the_exit_status_adds_nothing_when_the_log_explains_it(rules):
    log = "step 1/10 | loss 2.0\n/root/launch.sh: line 31: 48213 Killed      python3 train.py"
    assert [e.rule for e in classify(rules, log, 137)] == ["killed"]
    traceback = "\n".join(["Traceback (most recent call last):", *frames(), "ValueError: x"])
    assert [e.category for e in classify(rules, traceback, 1)] == ["python_exception"]
    assert [e.category for e in classify(rules, traceback, 134)] == ["python_exception"]
    assert classify(rules, "training complete", 0) == []


def test_the_trainers_config_error_is_named_not_just_its_exit_status(rules):
    # What train_dflash_pipeline.py prints for `--set bogus.key=1`, then exits 2.
    log = (
        "config error: configs/tiny-cpu.yaml: unknown key bogus; allowed under the top "
        "level: seed, output_dir, target, drafter, data, optim, train, runtime, eval, debug"
    )
    [event] = classify(rules, log, 2)
    assert (event.category, event.rule, event.line) == ("config_error", "trainer_config_error", 1)
    assert "unknown key bogus" in event.message and "--set" in event.hint
    assert classify(rules, "step 1/10 | loss 2.0 | config error: none", 0) == []


def test_non_finite_loss_is_a_crash_only_when_the_trainer_gives_up(rules):
    tolerated = "step 120/10000 | loss nan | non-finite loss (1/3 allowed)"
    assert classify(rules, tolerated, None) == []
    [event] = classify(rules, "step 300/10000 | loss: nan | lr 1e-4", None)
    assert event.category == "nan_loss" and event.line == 1


@pytest.mark.parametrize(
    "line",
    [
        "step 212/10000 | loss 2.08 | grad_norm: nan | skipped optimizer step",
        "step 213/10000 | skipped: loss nan in 1 of 16 micro-batches",
        "data check: 812344 samples, 0 errors, 41 dropped",
        "/usr/lib/python3.11/warnings.py:12: UserWarning: error in mask; nan replaced by 0",
        "WARNING:dflash.data:shard 12: read error, retrying (1/3)",
        "WARNING: skipped batch 7: CUDA out of memory. Tried to allocate 2.00 GiB (retrying smaller)",
        "AssertionError",
        "    assert torch._C._is_key_in_tls(attr_name)",
        "Loading checkpoint shards:  40%|####      | 2/5\rLoading checkpoint shards:  60%|######",
        "eval | tau 2.41 | lossless yes | 512 tokens | 3.1 tokens/target forward",
        "NCCL INFO comm 0x7f1928e6e060 rank 0 nRanks 8 - Init COMPLETE",
        "Exception ignored in: <function _after_fork at 0x7f>",
        "drafter-1 on cuda:1: failed: 0 graphs",
    ],
)
def test_ordinary_training_lines_are_not_crashes(rules, line):
    assert classify(rules, line, 0) == []


def test_exceptions_cpython_ignored_are_not_crashes(rules):
    lines = [
        "Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f3a>",
        "Traceback (most recent call last):",
        *frames("__del__"),
        "AttributeError: '_MultiProcessingDataLoaderIter' object has no attribute '_shutdown'",
        "training complete",
    ]
    assert classify_text(lines, 0, rules) == []


def test_an_exception_class_without_a_usual_suffix_still_ends_the_traceback(rules):
    lines = ["drafter-0 failed:", "Traceback (most recent call last):", *frames()]
    lines += ["StopTraining: budget of 10 hours reached", "drafter-1 on cuda:1: step 9"]
    lines += ["    an indented line from another thread"]
    [event] = classify_text(lines, 1, rules)
    assert (event.exception, event.message) == ("StopTraining", "budget of 10 hours reached")


def test_a_syntax_error_is_a_python_exception(rules):
    lines = [
        "Traceback (most recent call last):",
        '  File "/root/dflash/current/train_dflash_pipeline.py", line 12, in <module>',
        "    from dflash.pipeline import run",
        '  File "/root/dflash/current/dflash/pipeline/run.py", line 40',
        "    def step(self, batch:",
        "                        ^",
        "SyntaxError: '(' was never closed",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.category, event.exception) == ("python_exception", "SyntaxError")
    assert event.last_frame == "/root/dflash/current/dflash/pipeline/run.py:40"


def test_an_indented_stage_line_is_not_part_of_a_traceback(rules):
    lines = ["drafter-2 failed:", "Traceback (most recent call last):", *frames()]
    lines += ["  drafter-3 on cuda:3: warming compiled graphs", "ValueError: x"]
    [event] = classify_text(lines, 1, rules)
    assert "  drafter-3 on cuda:3: warming compiled graphs" not in event.excerpt


def test_a_traceback_header_without_frames_does_not_swallow_the_log(rules):
    lines = ['print("Traceback (most recent call last):")', "Traceback (most recent call last):"]
    lines += ["step 1/10 | loss 2.0"] * 250
    lines += ["drafter-1 failed:", "Traceback (most recent call last):", *frames(), "ValueError: x"]
    [event] = classify_text(lines, 1, rules)
    assert (event.thread, event.exception, event.line) == ("drafter-1", "ValueError", 253)


def test_a_one_line_failure_inside_a_long_traceback_is_reported_after_it(rules):
    lines = ["drafter-1 failed:", "Traceback (most recent call last):", *frames()]
    lines += ["Fatal Python error: Segmentation fault"]
    lines += [f"drafter-2 on cuda:2: step {i}" for i in range(60)]
    lines += [*frames("inner"), "ValueError: x"]
    detector = CrashDetector(rules)
    emitted = []
    for line in lines:
        emitted += detector.feed(line)
    emitted += detector.finish(-11)
    assert [e.category for e in emitted] == ["thread_exception", "segfault"]
    assert [e.is_root_cause for e in emitted] == [True, False]


def test_a_crash_line_of_a_thread_keeps_the_stage_before_it(rules):
    lines = [
        "drafter-6 on cuda:6: recording new shape",
        "drafter-6 on cuda:6: RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    [event] = classify_text(lines, 1, rules)
    assert (event.category, event.thread, event.device, event.stage) == (
        "illegal_memory_access",
        "drafter-6",
        "cuda:6",
        "recording new shape",
    )
    assert event.exception == "RuntimeError"
