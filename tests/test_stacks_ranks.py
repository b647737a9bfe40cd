"""Two ranks of the real entry point on gloo, rank 1 deadlocked: the `stacks` verb asks
both, each answers with its own threads, and the view groups them by rank."""

from __future__ import annotations

import json
import time

import pytest

from dflashctl.agent.stacks import op_stacks
from dflashctl.commands.stacks import print_answer
from tests.test_pipeline_distributed import start_ranks, write_config

RUN_ID = "20261201-000000-abcd"


def test_every_rank_answers_with_its_own_threads(tmp_path, monkeypatch, capsys):
    workdir = tmp_path / "work"
    run_dir = workdir / "runs" / RUN_ID
    run_dir.mkdir(parents=True)
    monkeypatch.setenv("DFLASH_RUN_DIR", str(run_dir))
    monkeypatch.setenv("DFLASH_RUN_ID", RUN_ID)
    monkeypatch.setenv("DFLASH_HANG_MIN_S", "600")  # the watchdog stays out of this test
    config = write_config(
        tmp_path,
        tmp_path / "out",
        steps=400,
        debug="{hang_in: 'drafter-0@step:5', on_ranks: [1]}",
    )
    procs = start_ranks(config)
    try:
        (run_dir / "pid").write_text(f"{procs[0].pid}\n")  # the run's process, as a wrapper's
        stacks = run_dir / "stacks"
        deadline = time.monotonic() + 300  # start-up on a loaded machine: a safety net
        while not all((stacks / f"rank{r}.pid").is_file() for r in (0, 1)):
            assert time.monotonic() < deadline, "the ranks never started"
            assert all(p.poll() is None for p in procs), "a rank ended"
            time.sleep(0.2)
        # Rank 1 deadlocks at step 5; rank 0 then waits for it in a collective.
        answer = None
        while time.monotonic() < deadline:
            answer = op_stacks({"workdir": str(workdir), "run_id": RUN_ID, "wait_s": 30})
            frames = {
                (d["rank"], t["name"]): t["frames"][-1]["function"]
                for d in answer["answers"]
                for t in d["threads"]
            }
            if frames.get((1, "drafter-0")) == "deadlock":
                break
            time.sleep(0.5)
        assert answer["asked"] == [0, 1] and answer["missing"] == []
        assert [d["rank"] for d in answer["answers"]] == [0, 1]
        assert frames[(1, "drafter-0")] == "deadlock"
        assert frames[(0, "drafter-0")] != "deadlock"
        assert {d["pid"] for d in answer["answers"]} == {p.pid for p in procs}
        assert answer["flight_recorder"] == []  # gloo: no NCCL dumps
        answer["where"] = "this machine"
        answer["flight_recorder_summary"] = None
        print_answer(answer)
        out = capsys.readouterr().out
        assert out.index("rank 0 (pid") < out.index("rank 1 (pid")
        assert "in deadlock" in out.split("rank 1 (pid")[1]
        assert not list(stacks.glob("rank*.*.json")) or all(
            json.loads(p.read_text())["reason"] == "watchdog" for p in stacks.glob("rank*.*.json")
        )  # answered requests are taken away
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("run_id", ["../etc", "nope"])
def test_a_run_that_is_not_there(tmp_path, run_id):
    from dflashctl.agent.errors import AgentError

    (tmp_path / "runs").mkdir()
    with pytest.raises(AgentError, match="no run"):
        op_stacks({"workdir": str(tmp_path), "run_id": run_id})
