"""bench/bench_quality.py at tiny scale on CPU: the whole path runs and reports every number."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_quality.py"


@pytest.mark.timeout(900)  # about 2 min alone; several times that on a busy machine
def test_the_tiny_quality_bench_reports_both_drafters_and_prompt_lookup(tmp_path):
    shrink = [
        "train_convs=8",
        "regen_convs=8",
        "target_convs=60",
        "steps=4",
        "eval_every=2",
        "regen_tokens=8",
        "eval_tokens=8",
    ]
    done = subprocess.run(
        [sys.executable, str(BENCH), "--scale", "tiny", "--out", str(tmp_path)]
        + [arg for item in shrink for arg in ("--set", item)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    for name in ("a-data-file", "b-regenerated"):
        run = results[name]
        assert run["eval_tau"] >= 1.0 and run["train_tau"] >= 1.0
        assert [step for step, _ in run["eval_curve"]] == [2, 4]  # eval.every, then the end
        assert run["lossless"] is True
        where = run["where"]  # the batched eval agrees with the one-prompt path here
        assert where["one_at_a_time_tau"] == where["batched_same_prompts_tau"]
        assert where["trained_prompts_tau"] >= 1.0
        # tau~'s walk over the same training rows whose prompts were decoded
        assert where["trained_rows_walked"] > 0 and where["trained_rows_walk_tau"] >= 1.0
    assert results["prompt_lookup"]["tau"] >= 1.0
    assert results["regenerate"]["prompts"] > 0 and results["regenerate"]["tokens_per_s"] > 0
    regenerated = [json.loads(x) for x in (tmp_path / "regenerated.jsonl").read_text().splitlines()]
    assert all(r["messages"][-1]["role"] == "assistant" and r["prompt_id"] for r in regenerated)
    out = done.stdout
    assert "eval tau train tau~" in out and "prompt lookup" in out and "lossless yes" in out
    assert "eval curve (step, tau): [(2, " in out
    # every goal of the bench is judged in the run itself, met or not
    assert len(results["goals"]) == 5 and "goals, drafter (b): eval tau >= 3.0" in out

    # Held-out prompts are never training prompts, nor regeneration prompts.
    def prompts(name):
        return {json.loads(x)["messages"][0]["content"] for x in (tmp_path / name).open()}

    held = prompts("eval.jsonl")
    assert held and not prompts("data.jsonl") & held and not prompts("regen-prompts.jsonl") & held
    assert not prompts("data.jsonl") & prompts("regen-prompts.jsonl")  # the target never saw them

    # --reuse: a second drafter run keeps the target and the regenerated data.
    before = (tmp_path / "regenerated.jsonl").read_bytes()
    again = subprocess.run(
        [sys.executable, str(BENCH), "--scale", "tiny", "--out", str(tmp_path), "--reuse"]
        + ["--only", "b-regenerated"]
        + [arg for item in shrink for arg in ("--set", item)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "target | reused" in again.stdout and "regenerate | reused" in again.stdout
    assert (tmp_path / "regenerated.jsonl").read_bytes() == before


@pytest.mark.timeout(900)
def test_the_tiny_zoo_runs_the_one_recipe_and_judges_every_goal(tmp_path):
    """bench_quality --zoo at tiny scale, one target (the whole zoo is the GPU run)."""
    zoo = BENCH.with_name("quality_zoo.py")
    done = subprocess.run(
        [sys.executable, str(zoo), "--scale", "tiny", "--out", str(tmp_path), "--only", "chat"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "zoo.json").read_text())
    (row,) = summary["rows"]
    assert row["target"] == "chat" and row["drafter"]["eval_tau"] >= 1.0
    assert len(row["goals"]) == 5 and row["eval_cost"]["batch1_greedy_tokens_per_s"] > 0
    assert len(row["eval_cost"]["accepted_by_position"]) == 3  # block 4: three drafted slots
    # batch 1 judged as the eval judges: float32 parts from greedy nowhere
    assert row["eval_cost"]["batch1_lossless"] and row["eval_cost"]["batch1_parted"] == 0
    # The recipe sized the run to its budget and fitted the shapes to the data.
    log = (tmp_path / "chat.log").read_text()
    assert "train.budget_minutes 0.25:" in log and "data.fit: seq_len" in log
    # The recipe walks the eval prompts, answered by the target before training: the
    # table's tau~ is that walk's, the last one (2 rows: both eval prompts at once).
    assert "tau walk: 2 eval prompts answered by the target" in log
    assert "| eval prompts" in log and row["drafter"]["heldout_set"] == "eval prompts"
    assert row["drafter"]["heldout_tau"] >= 1.0 and row["drafter"]["heldout_walks"] == 1
    assert "chat goals: eval tau >= 3.0" in done.stdout and "target    params" in done.stdout


def test_a_row_stopped_after_its_drafter_still_says_what_it_measured(tmp_path):
    """A row killed at --deadline after the drafter's eval (as the code row was on one
    H100): the zoo prints what it had, and what it did not measure."""
    sys.path.insert(0, str(BENCH.parent))
    import quality_zoo

    row = tmp_path / "code"
    row.mkdir()
    assert quality_zoo.partial_line("code", row) is None  # nothing trained yet
    drafter = {"eval_tau": 3.67, "heldout_tau": 3.72, "steps": 5667, "headline": "lossless yes"}
    (row / quality_zoo.PARTIAL).write_text(
        json.dumps({"drafter": drafter, "budget_seconds": 471.2})
    )
    line = quality_zoo.partial_line("code", row)
    assert line.startswith("code before it stopped: eval tau 3.67, walk 3.72 (eval -1%)")
    assert "5667 steps, regen + drafter 471 s" in line
    assert "not measured: prompt lookup, eval cost" in line
    # Stopped after prompt lookup: the ratio (a goal) is kept, only the eval cost is missing.
    (row / quality_zoo.PARTIAL).write_text(
        json.dumps({"drafter": drafter, "budget_seconds": 471.2, "prompt_lookup": {"tau": 1.91}})
    )
    line = quality_zoo.partial_line("code", row)
    assert "eval -1%), 1.92x prompt lookup (1.91), lossless yes" in line
    assert "not measured: eval cost (rerun" in line
