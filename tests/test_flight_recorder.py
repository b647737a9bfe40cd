"""The NCCL flight recorder's dumps summarised: which rank missed which collective.
The dumps are built in the recorder's own pickle format (FlightRecorder.hpp's `dump`:
version, pg_config, pg_status, entries)."""

from __future__ import annotations

import pickle

import pytest

from dflashctl.ops.flight_recorder import DumpError, load_dump, summarise_files


def entry(
    seq,
    name="nccl:all_reduce",
    state="completed",
    pg=("0", "default_pg"),
    sizes=((1024,),),
    record=None,
):
    return {
        "record_id": record if record is not None else seq,
        "pg_id": int(pg[0]) if pg[0].isdigit() else 1,
        "process_group": pg,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": name,
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "input_sizes": [list(s) for s in sizes],
        "input_dtypes": ["Float"],
        "output_sizes": [list(s) for s in sizes],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": 1,
        "time_discovered_completed_ns": 2 if state == "completed" else 0,
        "retired": state == "completed",
        "timeout_ms": 600000,
        "is_p2p": False,
        "frames": [{"name": "all_reduce", "filename": "replicas.py", "line": 120}],
        "thread_id": "140000",
        "thread_name": "pt_main_thread",
        "duration_ms": 1.5,
    }


def dump(entries, ranks="[0, 1]", extra_pgs=None):
    pg_config = {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}}
    pg_config.update(extra_pgs or {})
    last = max((e["collective_seq_id"] for e in entries), default=0)
    done = max((e["collective_seq_id"] for e in entries if e["state"] == "completed"), default=0)
    return pickle.dumps(
        {
            "version": "2.10",
            "pg_config": pg_config,
            "comm_lib_version": "2.21.5",
            "pg_status": {
                "0": {
                    "last_enqueued_collective": last,
                    "last_started_collective": last,
                    "last_completed_collective": done,
                }
            },
            "entries": entries,
        }
    )


def test_the_rank_that_never_issued_the_collective_is_named():
    rank0 = [entry(s) for s in range(1, 42)] + [entry(42, state="started")]
    rank1 = [entry(s) for s in range(1, 42)]  # stopped before #42 (a hung thread)
    summary = summarise_files({0: dump(rank0), 1: dump(rank1)})
    (finding,) = summary.findings
    assert (finding.kind, finding.seq, finding.op, finding.ranks, finding.waiting) == (
        "missed",
        42,
        "nccl:all_reduce",
        [1],
        [0],
    )
    assert summary.lines() == [
        "rank 1 never issued collective #42 (nccl:all_reduce) of process group 0 (default_pg); "
        "rank 0 issued it and waits in it"
    ]


def test_a_rank_without_a_dump_is_named():
    rank0 = [entry(1), entry(2, state="started")]
    summary = summarise_files({0: dump(rank0)})
    assert summary.absent == [1]
    assert summary.lines()[0].startswith("rank 1 left no dump")
    # rank 0 alone reached #2 and it never completed
    assert summary.findings[0].kind == "stuck" and summary.findings[0].ranks == [0]


def test_ranks_that_disagree_on_a_collective():
    rank0 = [entry(1), entry(2, "nccl:all_reduce", state="started")]
    rank1 = [entry(1), entry(2, "nccl:broadcast", state="started")]
    summary = summarise_files({0: dump(rank0), 1: dump(rank1)})
    kinds = {f.kind: f for f in summary.findings}
    assert "mismatch" in kinds and kinds["mismatch"].seq == 2
    assert "rank 0: nccl:all_reduce, rank 1: nccl:broadcast" in kinds["mismatch"].describe()


def test_different_sizes_in_one_collective():
    rank0 = [entry(1, sizes=((1024,),), state="started")]
    rank1 = [entry(1, sizes=((2048,),), state="started")]
    summary = summarise_files({0: dump(rank0), 1: dump(rank1)})
    assert any(
        f.kind == "mismatch" and "different input sizes" in f.describe() for f in summary.findings
    )


def test_groups_are_judged_apart_and_p2p_is_left_out():
    side = ("1", "drafters")
    extra = {"1": {"name": "1", "desc": "drafters", "ranks": "[0, 1, 2]"}}
    rank0 = [
        entry(1),
        entry(2),
        entry(1, pg=side, record=10),
        entry(2, pg=side, state="started", record=11),
    ]
    rank1 = [
        entry(1),
        entry(2),
        entry(1, pg=side, record=10),
        entry(2, pg=side, state="started", record=11),
    ]
    rank2 = [entry(1), entry(2), entry(1, pg=side, record=10)]
    p2p = dict(entry(7, "nccl:send", state="started"), is_p2p=True)
    rank2.append(p2p)
    files = {
        r: dump(e, ranks="[0, 1, 2]", extra_pgs=extra) for r, e in enumerate([rank0, rank1, rank2])
    }
    (finding,) = summarise_files(files).findings
    assert (finding.group, finding.seq, finding.ranks, finding.waiting) == (
        "1 (drafters)",
        2,
        [2],
        [0, 1],
    )


def test_all_in_step_says_the_hang_is_elsewhere():
    both = [entry(s) for s in range(1, 5)]
    summary = summarise_files({0: dump(both), 1: dump(both)})
    assert summary.findings == []
    assert "outside NCCL" in summary.lines()[0]


def test_a_pickle_naming_code_is_refused_and_garbage_is_named():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    with pytest.raises(DumpError, match="refused"):
        load_dump(pickle.dumps({"entries": [Evil()]}))
    summary = summarise_files({0: b"not a pickle", 1: dump([entry(1)])})
    assert summary.errors and summary.errors[0].startswith("rank 0's dump could not be read")


def test_the_dumps_a_run_left_are_collected_and_summarised(tmp_path):
    """A run's nccl_trace/ as the recorder leaves it on a timeout (rank appended to the
    prefix the launch sets), read by the `stacks` verb and summarised by the client."""
    from dflashctl.agent.runs import flight_recorder_env
    from dflashctl.agent.stacks import op_stacks
    from dflashctl.ops.stacks import summarise_dumps

    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    env = flight_recorder_env({}, str(run_dir))
    assert (
        env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    )
    prefix = env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert prefix == env["TORCH_FR_DUMP_TEMP_FILE"] == str(run_dir / "nccl_trace" / "rank_")
    (run_dir / "exit_code").write_text("1\n")  # the run ended: its dumps stay readable
    for rank, entries in {0: [entry(1), entry(2, state="started")], 1: [entry(1)]}.items():
        with open(f"{prefix}{rank}", "wb") as f:
            f.write(dump(entries))
    answer = op_stacks({"workdir": str(tmp_path), "run_id": "r1"})
    assert answer["status"] == "exited" and answer["asked"] == []
    assert [d["rank"] for d in answer["flight_recorder"]] == [0, 1]
    summary = summarise_dumps(answer["flight_recorder"])
    assert summary["summary"] == [
        "rank 1 never issued collective #2 (nccl:all_reduce) of process group 0 (default_pg); "
        "rank 0 issued it and waits in it"
    ]


def test_a_trainer_env_that_sets_the_recorder_wins(tmp_path):
    from dflashctl.agent.runs import flight_recorder_env

    assert flight_recorder_env({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}, str(tmp_path)) == {}
