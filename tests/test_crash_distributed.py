"""Failures past one process, in the wording variants the corpus (one torch, the bundled
trainer) does not hold: torch's own `[rankN]:` prefixes on every line, torchrun's
`[defaultN]:` local-rank prefixes, summaries with a recorded traceback, gloo timeouts
without the trainer's heartbeat, stops that run past their grace period."""

from __future__ import annotations

from dflashctl.crash import CrashDetector, classify_text, load_rules

RULES = load_rules()

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a "
    "total capacity of 139.81 GiB of which 1.02 GiB is free."
)


def frames(prefix: str = "") -> list[str]:
    return [
        f'{prefix}  File "/root/dflash/current/dflash/pipeline/threads.py", line 326, in run_drafter',
        f"{prefix}    stop = _train_step(ctx, replica, inputs)",
    ]


def summary(rank: int, local_rank: int, exitcode: str, traceback: list[str]) -> list[str]:
    return [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "train_dflash_pipeline.py FAILED",
        "------------------------------------------------------------",
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-01_10:00:00",
        "  host      : gpu-b",
        f"  rank      : {rank} (local_rank: {local_rank})",
        f"  exitcode  : {exitcode}",
        "  error_file: /tmp/torchelastic_x/none_y/attempt_0/1/error.json",
        *traceback,
        "============================================================",
    ]


def test_a_cuda_oom_in_drafter_1_of_rank_1_names_the_rank():
    lines = [
        "[rank1]: distributed: rank 1/2 on host gpu-b (pid 4242), local rank 1/2, node 0/1, nccl",
        "[rank1]: drafter-1 on cuda:1: training",
        "drafter-1 on cuda:0: training",
        "[rank1]: drafter-1 failed:",
        "[rank1]: Traceback (most recent call last):",
        *frames("[rank1]: "),
        f"[rank1]: {OOM}",
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.thread, event.device) == ("cuda_oom", "drafter-1", "cuda:1")
    assert (event.rank, event.local_rank, event.host, event.pid) == (1, 1, "gpu-b", 4242)
    assert event.where == "rank 1 (local rank 1), host gpu-b"


def test_the_other_ranks_word_about_an_oom_is_not_an_oom_of_its_own():
    peer = (
        "dflash.pipeline.distributed.PeerFailure: rank 0/2 on host gpu-a (pid 7): rank 1 failed: "
        f"rank 1/2 on host gpu-b (pid 8): drafter-0 on cuda:1 failed: OutOfMemoryError: {OOM}"
    )
    lines = ["peers failed:", peer]
    [event] = classify_text(lines, 1, RULES)
    assert event.category == "peer_failure"


def test_torch_style_prefixes_on_every_line_and_a_gloo_timeout():
    """torch >= 2.2 prefixes each line of a rank's traceback; gloo names no culprit."""
    lines = [
        "[rank0]: Traceback (most recent call last):",
        *frames("[rank0]: "),
        "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 1800000ms for recv operation to complete",
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank, event.retryable) == ("gloo_timeout", 0, True)
    assert "stopped taking part" in event.hint


def test_a_gloo_timeout_names_the_rank_it_waited_for_when_the_job_has_two():
    lines = [
        "distributed: rank 0/2 on host vm (pid 10), local rank 0/2, node 0/1, gloo",
        "[rank1]: distributed: rank 1/2 on host vm (pid 11), local rank 1/2, node 0/1, gloo",
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] "
        "Timed out waiting 10000ms for recv operation to complete",
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank, event.details["waited_for"]) == ("gloo_timeout", 1, [1])
    assert event.details["noticed_by"]["rank"] == 0  # rank 1 never joined the collective
    assert "waiting for rank 1, which stopped taking part" in event.hint


def test_local_rank_prefixes_of_torchrun_tee_map_to_the_rank():
    lines = [
        "[default1]:distributed: rank 5/8 on host gpu-b (pid 77), local rank 1/4, node 1/2 (gpu-b), nccl",
        "[default1]:Traceback (most recent call last):",
        *frames("[default1]:"),
        "[default1]:RuntimeError: CUDA error: an illegal memory access was encountered",
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank, event.local_rank, event.node) == (
        "illegal_memory_access",
        5,
        1,
        "gpu-b",
    )


def test_a_recorded_traceback_in_torchruns_summary_is_the_root_cause():
    """The rank's own output went elsewhere (--redirects): the error file's traceback,
    which torchrun prints in its summary, names the failure and the rank."""
    recorded = [
        "  traceback : Traceback (most recent call last):",
        '    File "/root/dflash/current/dflash/data.py", line 154, in read_records',
        '      raise ValueError(f"{path}:{number}: not valid JSON ({exc.msg})") from None',
        "  ValueError: /data/train.jsonl:17: not valid JSON (Expecting value)",
        "  ",
    ]
    lines = ["step 3/10 | loss 2.0", *summary(1, 1, "1 (pid: 99) ", recorded)]
    crashes = classify_text(lines, 1, RULES)
    assert [(e.category, e.rank, e.local_rank, e.host) for e in crashes] == [
        ("data_error", 1, 1, "gpu-b")
    ]
    assert crashes[0].details["file"] == "/data/train.jsonl" and crashes[0].details["line"] == 17
    assert "/data/train.jsonl:17" in crashes[0].hint


def test_a_rank_killed_by_the_oom_killer_is_the_root_cause_not_the_rank_that_noticed():
    lines = [
        "[rank1]: distributed: rank 1/2 on host gpu-b (pid 99), local rank 1/2, node 0/1, gloo",
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:1234",
        *summary(
            1, 1, "-9 (pid: 99)  (SIGKILL)", ["  traceback : Signal 9 (SIGKILL) received by PID 99"]
        ),
    ]
    root, then = classify_text(lines, 1, RULES)
    assert (root.category, root.rank, root.message) == ("killed", 1, "rank 1 killed (SIGKILL)")
    assert root.is_root_cause and (then.rank, then.category, then.is_root_cause) == (
        None,
        "peer_lost",
        False,
    )
    assert then.thread == "drafter-0" and "not the cause" in then.hint


def test_a_stop_past_its_grace_period_is_said_as_such():
    lines = [
        "step 7/100 | loss 2.0",
        "received SIGTERM: finishing the current step, then writing a checkpoint",
        "Killed",
    ]
    detector = CrashDetector(RULES)
    for line in lines:
        detector.feed(line)
    detector.finish(137)
    assert detector.crashes == []
    assert detector.stop.killed_after_grace
    assert "grace period" in detector.stop.describe() and "OOM" not in detector.stop.describe()


def test_a_run_stopped_by_dflashctl_is_not_killed_by_the_oom_killer():
    """No word from the trainer (its handler never ran: stuck in native code), then
    bash's "Killed": the stop record says it was dflashctl's SIGKILL."""
    detector = CrashDetector(RULES)
    for line in ["step 7/100 | loss 2.0", "launch.sh: line 3:  4242 Killed  python train.py"]:
        detector.feed(line)
    detector.stopped_from_outside(killed=True)
    detector.finish(None)
    assert detector.crashes == [] and detector.stop.killed_after_grace


def test_a_clean_stop_under_torchrun_is_no_crash_whatever_the_exit_status():
    lines = [
        "W1201 10:00:00.0 7 torch/distributed/elastic/agent/server/api.py:753] Received 2 "
        "death signal, shutting down workers",
        "received SIGINT: finishing the current step, then writing a checkpoint",
        "stopped by SIGINT after step 42/100; a redeploy continues from it (checkpoint /o/step-42)",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/run.py", line 1032, in main',
        "    run(args)",
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 2",
    ]
    for exit_code in (0, 1, 130, -2):
        detector = CrashDetector(RULES)
        for line in lines:
            detector.feed(line)
        detector.finish(exit_code)
        assert detector.crashes == [], exit_code
        assert detector.stop.describe() == "stopped (checkpoint at step 42)"


def test_a_sigterm_that_torchrun_sends_after_a_failure_is_no_stop():
    lines = [
        "W1201 10:00:00.0 7 torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
        "process 8 closing signal SIGTERM",
        "received SIGTERM: finishing the current step, then writing a checkpoint",
        *summary(
            1, 1, "-9 (pid: 9)  (SIGKILL)", ["  traceback : Signal 9 (SIGKILL) received by PID 9"]
        ),
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank) == ("killed", 1)


def test_the_environment_is_named_with_its_particulars():
    cases = {
        "OSError: [Errno 28] No space left on device: '/data/out/step-000100/state.pt'": (
            "disk_full",
            "path",
            "/data/out/step-000100/state.pt",
        ),
        "ModuleNotFoundError: No module named 'safetensors'": (
            "setup_error",
            "pip",
            "python -m pip install safetensors",
        ),
        "ModuleNotFoundError: No module named 'yaml'": (
            "setup_error",
            "pip",
            "python -m pip install pyyaml",
        ),
        "torch.distributed.DistNetworkError: The server socket has failed to bind to [::]:29500 "
        "(errno: 98 - Address already in use).": ("port_in_use", "port", 29500),
        "RuntimeError: DefaultCPUAllocator: not enough memory: you tried to allocate "
        "68719476736 bytes.": ("host_memory", "bytes", 68719476736),
        "json.decoder.JSONDecodeError: Expecting ',' delimiter: line 1 column 30 (char 29)": (
            "data_error",
            "column",
            30,
        ),
    }
    for message, (category, key, value) in cases.items():
        lines = ["main failed:", "Traceback (most recent call last):", *frames(), message]
        [event] = classify_text(lines, 1, RULES)
        assert (event.category, event.details.get(key)) == (category, value), message
        assert "Here: " in event.hint


def test_a_bare_memory_error_is_host_memory():
    lines = ["Traceback (most recent call last):", *frames(), "MemoryError"]
    [event] = classify_text(lines, 1, RULES)
    assert event.category == "host_memory"


def test_older_torchrun_wording_and_a_traceback_without_any_prefix():
    """torch 2.0/2.1 log through `logging` (`ERROR:torch.distributed...:failed ...`), and
    a rank's plain traceback has no prefix: torchrun's summary names its rank."""
    lines = [
        "Traceback (most recent call last):",
        '  File "train.py", line 40, in <module>',
        "    main()",
        "ValueError: /data/train.jsonl:9: not valid JSON (Expecting value)",
        "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 41 closing "
        "signal SIGTERM",
        "ERROR:torch.distributed.elastic.multiprocessing.api:failed (exitcode: 1) local_rank: 1 "
        "(pid: 42) of binary: /usr/bin/python3",
        *summary(
            1, 1, "1 (pid: 42)", ["  traceback : To enable traceback see: https://pytorch.org/docs"]
        ),
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank, event.local_rank, event.pid) == ("data_error", 1, 1, 42)


def test_torchrun_told_to_stop_in_every_wording_is_no_failure():
    from dflashctl.crash.torchrun import TorchrunWatch

    for said in ("15", "Signals.SIGTERM", "SIGINT"):
        watch = TorchrunWatch()
        watch.feed(
            "W1201 10:00:00.0 7 torch/distributed/elastic/agent/server/api.py:753] Received "
            f"{said} death signal, shutting down workers"
        )
        watch.feed(
            "WARNING:torch.distributed.elastic.multiprocessing.api:Sending process 8 closing "
            "signal Signals.SIGTERM"
        )
        assert watch.told_to_stop and not watch.rank_failed, said
    failing = TorchrunWatch()
    failing.feed("W1201 x api.py:1028] Sending process 8 closing signal Signals.SIGTERM")
    assert failing.rank_failed


def test_local_rank_prefixes_without_the_trainers_line_still_name_the_rank():
    """torchrun --tee: a rank failing before it said which rank it is (an import error):
    its local rank from the prefix, its rank from torchrun's summary."""
    lines = [
        "[default0]:step 1/10 | loss 2.0",
        "[default1]:Traceback (most recent call last):",
        '[default1]:  File "train_dflash_pipeline.py", line 33, in <module>',
        "[default1]:ModuleNotFoundError: No module named 'safetensors'",
        *summary(3, 1, "1 (pid: 55)", ["  traceback : To enable traceback see: https://x"]),
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.rank, event.local_rank) == ("setup_error", 3, 1)
