"""The rank that failed rather than the one that noticed, a hang named after the fact,
the trainer's own line naming its failed thread, and the environment's new categories,
in wordings the real corpus (tests/data/logs) does not hold one by one."""

from __future__ import annotations

from dflashctl.crash import classify_text, load_rules
from tests.test_crash_distributed import frames

RULES = load_rules()
RANKS = [
    "distributed: rank 0/2 on host gpu-a (pid 10), local rank 0/1, node 0/2 (gpu-a), gloo",
]


def root(lines: list[str], exit_code: int | None = 1):
    crashes = classify_text(lines, exit_code, RULES)
    assert crashes and crashes[0].is_root_cause
    return crashes[0], crashes[1:]


def test_a_lost_peer_as_the_root_cause_names_the_silent_rank_not_the_one_that_noticed():
    event, _ = root(
        [
            *RANKS,
            "drafter-0 on cuda:3: training",
            "peers failed:",
            "dflash.pipeline.distributed.PeerFailure: rank 0/2 on host gpu-a (pid 10): rank 1 on "
            "host gpu-b stopped answering: no heartbeat for 15 s (killed, out of memory, or its "
            "host is gone)",
        ]
    )
    assert (event.category, event.rank, event.host) == ("peer_lost", 1, "gpu-b")
    # Nothing of rank 0's own is mixed into it: not its thread, device nor node.
    assert (event.thread, event.device, event.node) == (None, None, None)
    assert event.details["noticed_by"]["rank"] == 0
    assert event.details["noticed_by"]["node"] == "gpu-a"


def test_a_peer_failure_names_the_rank_with_its_thread_and_device():
    event, _ = root(
        [
            *RANKS,
            "peers failed:",
            "dflash.pipeline.distributed.PeerFailure: rank 1 failed: rank 1/2 on host gpu-b (pid "
            "11): drafter-2 on cuda:2 failed: KeyError: 'hidden_states'",
        ]
    )
    assert (event.category, event.rank, event.thread, event.device) == (
        "peer_failure",
        1,
        "drafter-2",
        "cuda:2",
    )


def test_a_rank_that_never_issued_the_collective_is_named_with_its_stuck_thread():
    """Rank 0's all-reduce timed out; rank 1 said nothing but, at the stop torchrun sent
    it, that its drafter-0 never ended."""
    event, rest = root(
        [
            "distributed: rank 0/2 on host vm (pid 10), local rank 0/2, node 0/1, gloo",
            "[rank1]: distributed: rank 1/2 on host vm (pid 11), local rank 1/2, node 0/1, gloo",
            "[rank1]: drafter-0 on cpu: training",
            "drafter-0 failed:",
            "Traceback (most recent call last):",
            *frames(),
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed "
            "out waiting 10000ms for recv operation to complete",
            "[rank1]: received SIGTERM: finishing the current step, then writing a checkpoint",
            "[rank1]: threads still running 8 s after the stop: drafter-0; exiting",
        ]
    )
    assert (event.category, event.rank, event.pid) == ("gloo_timeout", 1, 11)
    assert (event.thread, event.device) == ("drafter-0", "cpu")
    assert event.details["never_joined"] == [1]
    assert event.details["noticed_by"]["rank"] == 0
    assert not rest


WATCHDOG = (
    "watchdog: no step finished for 64 s (threshold 60 s) after step 10; waiting: drafter-0 "
    "at entry.py:14 in push_metrics; every thread's stack written to /r/stacks/rank{r}.watchdog.json"
)


def test_a_hang_is_named_after_the_fact_though_a_stop_killed_it_after_its_grace():
    lines = [
        "step 10/4000 | loss 6.0 | acc 0.1",
        "drafter-0 on cpu: training",
        WATCHDOG.format(r=0),
        "received SIGTERM: finishing the current step, then writing a checkpoint",
    ]
    [event] = classify_text(lines, 137, RULES)
    assert (event.category, event.thread, event.device) == ("hang", "drafter-0", "cpu")
    assert event.details["silent_s"] == 64 and event.details["last_step"] == 10
    assert "entry.py:14 in push_metrics" in event.message
    assert "/r/stacks/rank0.watchdog.json" in event.hint


def test_a_watchdog_line_followed_by_steps_is_no_hang():
    lines = [
        "step 10/4000 | loss 6.0 | acc 0.1",
        WATCHDOG.format(r=0),
        "step 15/4000 | loss 5.9 | acc 0.1",
        "training complete",
    ]
    assert classify_text(lines, 0, RULES) == []


def test_a_hang_before_the_first_step():
    lines = [
        "drafter-0 on cpu: warming up",
        "watchdog: no step finished for 52 s after the start (threshold 50 s), before the first "
        "step; waiting: drafter-0 at entry.py:30 in _inject_and_more; every thread's stack "
        "written to /r/stacks/rank0.watchdog.json",
    ]
    [event] = classify_text(lines, -9, RULES)
    assert (event.category, event.thread, event.stage) == ("hang", "drafter-0", "warming up")
    assert event.details["before_first_step"] and event.details["silent_s"] == 52
    assert "before the first step" in event.message


def test_a_hung_rank_is_the_root_cause_over_the_collective_that_waited_for_it():
    lines = [
        "distributed: rank 0/2 on host vm (pid 10), local rank 0/2, node 0/1, gloo",
        "[rank1]: distributed: rank 1/2 on host vm (pid 11), local rank 1/2, node 0/1, gloo",
        "step 10/4000 | loss 6.0 | acc 0.1",
        "[rank1]: " + WATCHDOG.format(r=1),
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "RuntimeError: Application timeout caused pair closure",
    ]
    event, rest = root(lines)
    assert (event.category, event.rank, event.thread) == ("hang", 1, "drafter-0")
    assert [(e.category, e.rank) for e in rest] == [("gloo_timeout", 0)]


def test_the_trainers_own_line_names_the_failed_thread_over_a_users_thread():
    lines = [
        "drafter-0 on cpu: training",
        "Exception in thread sample-upload:",
        "Traceback (most recent call last):",
        '  File "/srv/entry.py", line 9, in upload_samples',
        "OSError: [Errno 5] upload of samples: the server answered 503",
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        *frames(),
        "KeyError: 'hidden_states'",
        "training failed: drafter-0 on cpu failed: KeyError: 'hidden_states'",
    ]
    event, rest = root(lines)
    assert (event.thread, event.exception, event.device) == ("drafter-0", "KeyError", "cpu")
    assert [e.thread for e in rest] == ["sample-upload"]


def test_an_import_error_in_the_trainers_own_module_is_a_code_error_with_its_file_and_line():
    event, _ = root(
        [
            "Traceback (most recent call last):",
            '  File "/root/dflash/current/train_dflash_pipeline.py", line 89, in main',
            '  File "/root/dflash/current/dflash/pipeline/threads.py", line 27, in <module>',
            "    from dflash.pipeline import stacks, tls_cache",
            "ImportError: cannot import name 'tls_cache' from 'dflash.pipeline' "
            "(/root/dflash/current/dflash/pipeline/__init__.py)",
        ]
    )
    assert event.category == "code_error"
    assert "/root/dflash/current/dflash/pipeline/threads.py:27" in event.hint
    assert "pip install" not in event.hint


def test_an_import_error_from_an_installed_package_is_still_a_setup_error():
    event, _ = root(
        [
            "Traceback (most recent call last):",
            '  File "/root/dflash/current/dflash/model.py", line 3, in <module>',
            "ImportError: cannot import name 'flex_attention' from 'torch.nn.attention' "
            "(/usr/lib/python3/dist-packages/torch/nn/attention/__init__.py)",
        ]
    )
    assert event.category == "setup_error"


def test_bad_utf8_from_a_trainer_not_ours_is_a_data_error_with_its_offset():
    event, _ = root(
        [
            "Exception in thread loader:",
            "Traceback (most recent call last):",
            '  File "/srv/train.py", line 40, in load',
            "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff in position 25065: "
            "invalid start byte",
        ]
    )
    assert (event.category, event.details["byte"]) == ("data_error", 25065)
    assert "byte 25065" in event.hint


def test_ctrl_c_during_start_up_is_an_interruption_not_a_crash():
    event, _ = root(
        [
            "Traceback (most recent call last):",
            '  File "/root/dflash/current/train_dflash_pipeline.py", line 32, in <module>',
            '  File "<frozen importlib._bootstrap>", line 216, in _lock_unlock_module',
            "KeyboardInterrupt",
        ],
        exit_code=130,
    )
    assert (event.category, event.severity) == ("interrupted", "warning")
    assert "fix the code" not in event.hint


def test_a_wrong_master_address_is_a_rendezvous_failure_naming_the_address():
    event, _ = root(
        [
            "Traceback (most recent call last):",
            '  File "/usr/lib/python3/dist-packages/torch/distributed/rendezvous.py", line 67, '
            "in next_rendezvous",
            "torch.distributed.DistNetworkError: The client socket has timed out after 30000ms "
            "while trying to connect to (10.9.0.2, 29400).",
        ]
    )
    assert (event.category, event.details["address"], event.details["port"]) == (
        "rendezvous",
        "10.9.0.2",
        29400,
    )
    assert "fix the code" not in event.hint


def test_a_port_in_use_at_the_rendezvous_stays_port_in_use():
    event, _ = root(
        [
            "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
            "local network address. port: 29400, useIpv6: false, code: -98, name: EADDRINUSE, "
            "message: address already in use",
        ]
    )
    assert event.category == "port_in_use"


BANNER = [
    "*****************************************",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default",
    "*****************************************",
]


def test_killed_while_torchrun_waits_at_the_rendezvous_is_a_hang_in_start_up():
    [event] = classify_text(BANNER, -9, RULES)
    assert event.category == "hang" and event.details["before_first_line"]


def test_an_empty_log_killed_is_a_kill_not_a_hang():
    [event] = classify_text([], -9, RULES)
    assert event.category == "killed"


def test_a_thread_that_never_ended_at_a_stop_before_any_step_is_a_start_up_hang():
    """A trainer without the start-up watchdog: only the stop finds drafter-0 stuck."""
    lines = [
        "drafter-0 on cpu: warming up",
        "received SIGTERM: finishing the current step, then writing a checkpoint",
        "threads still running 8 s after the stop: drafter-0; exiting",
    ]
    [event] = classify_text(lines, 1, RULES)
    assert (event.category, event.thread, event.stage) == ("hang", "drafter-0", "warming up")
    assert event.details["before_first_step"] and "before the first step" in event.message


def test_a_missing_submodule_of_the_trainers_own_package_is_a_code_error():
    event, _ = root(
        [
            "Traceback (most recent call last):",
            '  File "/root/dflash/current/dflash/pipeline/run.py", line 26, in <module>',
            "    from dflash.pipeline.threadz import run_drafter",
            "ModuleNotFoundError: No module named 'dflash.pipeline.threadz'",
        ]
    )
    assert event.category == "code_error"
    assert "/root/dflash/current/dflash/pipeline/run.py:26" in event.hint
    assert "pip install" not in event.hint
    assert "own pip" not in event.hint and "not a missing package" in event.hint
