"""The crash detector's parts, each fed lines of the real logs in tests/data/logs/: who
wrote a line (ranks), a clean stop (stops), a hang (hangs), the keyword gate, the root
cause and the culprit it names (ordering, culprit), a category's particulars (facts),
and the small text helpers of tracebacks and endings."""

from __future__ import annotations

import copy
from pathlib import Path

from dflashctl.crash import classify_text, load_rules
from dflashctl.crash.culprit import blame, own_rank, unblame
from dflashctl.crash.endings import is_torchrun_summary, utc_seconds
from dflashctl.crash.events import CrashEvent
from dflashctl.crash.facts import add_facts
from dflashctl.crash.gate import keyword_gate
from dflashctl.crash.hangs import HangLines
from dflashctl.crash.ordering import choose_root, is_consequence, training_failed
from dflashctl.crash.ranks import RankBook, split_prefix
from dflashctl.crash.stops import StopWatch
from dflashctl.crash.trace_parts import last_redraw, short_path, trim_excerpt

LOGS = Path(__file__).parent / "data" / "logs"


def log_lines(name: str) -> list[str]:
    return (LOGS / f"{name}.log").read_text().splitlines()


def event(category: str, line: int, **fields) -> CrashEvent:
    return CrashEvent(
        rule=category,
        category=category,
        severity="error",
        retryable=False,
        hint="",
        line=line,
        end_line=line,
        **fields,
    )


def test_ranks_are_told_by_prefix_and_by_the_trainers_distributed_lines():
    assert split_prefix("[rank1]: watchdog: x") == ("watchdog: x", 1, None)
    assert split_prefix("[default0]: boom") == ("boom", None, 0)
    assert split_prefix("[rankX]: boom") == ("[rankX]: boom", None, None)

    book = RankBook()
    for name in ("nodes-sigkill-rank1.node0", "nodes-sigkill-rank1.node1"):
        for raw in log_lines(name):
            text, rank, _ = split_prefix(raw)
            book.feed(text, rank)
    assert book.world_size == 2
    assert book.node_of(0) == "node-a" and book.node_of(1) == "node-b"
    assert book.others(1) == [0]
    assert book.info(1).pid is not None and book.info(1).pid != book.info(0).pid
    # the unprefixed lines are node 0's rank 0 (the first log's own)
    assert book.rank_of(None, None) == 0


def test_a_log_of_one_node_names_its_node_for_torchruns_words():
    book = RankBook(node="gpu-b")
    book.feed("distributed: rank 3/4 on host h (pid 7), local rank 1/2", None)
    assert book.node_of(None) == "gpu-b"
    assert book.rank_of(None, 1) == 3 and book.rank_of(None, 0) is None


def test_a_sigterm_stop_is_seen_with_its_checkpoint():
    watch = StopWatch()
    for number, line in enumerate(log_lines("trainer-sigterm-stop"), 1):
        watch.feed(line, number)
    info = watch.info
    assert info.signal == "SIGTERM" and info.requested_line == 56 and info.line == 59
    assert info.step == 11 and info.checkpoint.endswith("step-000011")
    assert watch.info.describe() == "stopped (checkpoint at step 11)"
    # what the stopped job prints after its stop line is its end, not a failure
    assert watch.is_echo(event("terminated", 60))
    assert not watch.is_echo(event("cuda_oom", 60))


def test_a_stop_killed_after_its_grace_says_so_and_torchruns_own_sigterm_is_no_stop():
    watch = StopWatch()
    watch.feed("received SIGTERM: finishing the current step, then writing a checkpoint", 3)
    assert watch.takes_kill()
    assert "grace period ran out" in watch.info.describe()

    failing = StopWatch()
    failing.feed(
        "received SIGTERM: finishing the current step, then writing a checkpoint",
        3,
        torchrun_failing=True,
    )
    assert not failing.info.requested and not failing.takes_kill()


def test_the_watchdogs_hang_names_the_stuck_thread_and_where_it_waits():
    hangs = HangLines()
    for number, raw in enumerate(log_lines("torchrun-deadlock-rank1"), 1):
        text, rank, _ = split_prefix(raw)
        hangs.feed(text, rank, number)
    silences = {s.rank: s for s in hangs.open}
    assert set(silences) >= {1}
    one = silences[1]
    assert one.last_step == 9 and one.silent_s == 5
    assert one.threads[0] == "drafter-0" and one.waiting_at == "entry.py:26 in _inject_and_more"
    assert one.message() == (
        "no step finished for 5 s after step 9; drafter-0 stuck at entry.py:26 in _inject_and_more"
    )
    assert one.stacks_file.endswith("rank1.watchdog.json")


def test_a_hang_before_the_first_step_and_steps_coming_again():
    hangs = HangLines()
    for number, line in enumerate(log_lines("trainer-startup-deadlock"), 1):
        hangs.feed(line, None, number)
    [silence] = hangs.open
    assert silence.before_first_step and silence.where() == "before the first step"

    hangs.feed("step 1/10 | loss 2.0", None, 999)
    assert hangs.open == []  # the steps came again: no hang is open


def test_the_keyword_gate_finds_every_keyword_and_only_them():
    keywords = ["CUDA out of memory", "Traceback (most recent call last)", "nan loss", " "]
    gate = keyword_gate(keywords)
    assert gate("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    assert gate("Traceback (most recent call last):")
    assert gate("step 3 | nan loss at step 3")
    assert not gate("step 3/10 | loss 2.31 | 120 tok/s")
    assert not keyword_gate([])("anything")
    # every line of a real log that holds a rule's keyword passes the gate
    rules_gate = keyword_gate(["Error", "Killed"])
    lines = log_lines("kernel-oom-killer")
    assert [line for line in lines if "Error" in line or "Killed" in line] == [
        line for line in lines if rules_gate(line)
    ]


def test_the_root_cause_is_the_failure_not_the_peers_that_noticed_it():
    crashes = classify_text(log_lines("nodes-sigkill-rank1.node0"), 1, load_rules())
    root = crashes[0]
    assert root.category == "peer_lost" and root.rank == 1
    assert own_rank(root) == 0  # rank 0's lines told of it
    unblame(root)
    assert root.rank == 0 and "noticed_by" not in root.details

    book = RankBook()
    for raw in log_lines("nodes-sigkill-rank1.node0"):
        text, rank, _ = split_prefix(raw)
        book.feed(text, rank)
    blame(root, crashes, book)
    assert root.rank == 1 and root.details["noticed_by"]["rank"] == 0


def test_a_consequence_yields_to_the_failure_it_follows():
    own = event("python_exception", 10, exception="KeyError", message="'x'", rank=1)
    echo = event("python_exception", 5, exception="RuntimeError", message="Broken pipe", rank=0)
    assert is_consequence(echo) and not is_consequence(own)
    assert choose_root([echo, own], None) is own
    assert training_failed("training failed: drafter-0 on cpu failed: KeyError: 'x'") == (
        "drafter-0",
        "cpu",
        "KeyError",
        "'x'",
    )
    assert training_failed("training finished") is None


def test_facts_name_the_file_the_disk_and_the_allocation():
    found = {}
    for name in ("trainer-disk-full", "trainer-data-error", "trainer-host-memory"):
        [root, *_] = classify_text(log_lines(name), 1, load_rules())
        bare = copy.deepcopy(root)
        bare.details, bare.hint = {}, "Fix it."
        add_facts(bare, [])
        assert bare.details == root.details and bare.hint.startswith("Fix it. Here: ")
        found[name] = bare
    assert found["trainer-disk-full"].details["path"].endswith("checkpoints/step-000060")
    assert found["trainer-data-error"].details["line"] == 3
    assert found["trainer-host-memory"].hint.endswith("one allocation of 29.1 TiB.")

    nothing = event("unknown_category", 1, message="x")
    add_facts(nothing, [])
    assert nothing.details == {} and nothing.hint == ""


def test_small_text_helpers_of_tracebacks_and_endings():
    assert short_path("/usr/lib/python3/site-packages/torch/nn/module.py") == "torch/nn/module.py"
    assert last_redraw("10%\r50%\r100% done\r") == "100% done"
    long = [f"line {i}" for i in range(200)]
    trimmed = trim_excerpt(long)
    assert len(trimmed) == 60 and trimmed[0] == "line 0" and trimmed[-1] == "line 199"
    assert "lines left out" in trimmed[20]
    assert is_torchrun_summary("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    assert not is_torchrun_summary(None)
    assert utc_seconds("1970-01-02 00:00:00") == 86400.0
    assert utc_seconds("yesterday") is None
