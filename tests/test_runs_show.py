# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
"""`dflashctl runs show`: curves joined across a resume lineage, terminal charts, the
PNG, --json; on the local target here (container: test_runs_show_container.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.errors import UsageError
from dflashctl.ops.deploy import DeployOptions, deploy
from dflashctl.remote.connect import open_target
from dflashctl.runs.metrics import join_records, read_curves
from dflashctl.ui.charts import Series, chart, compact
from tests.json_answers import flat
from tests.test_deploy_support import (  # noqa: F401
    kill_runs,
    project,
    wait_for,
    write_local_config,
)
from tests.test_runs import wait_finished

DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def step(n: int, **values) -> dict:
    return {"kind": "step", "step": n, **values}


# ------------------------------------------------------------------------- the join


def test_join_continues_a_curve_and_a_resume_replaces_the_steps_it_repeats():
    first = [step(10, loss=5.0), step(20, loss=4.0), step(30, loss=3.5)]
    resumed = [step(30, loss=3.4), step(40, loss=3.0)]  # from the step-20 checkpoint
    joined = join_records([first, resumed])
    assert [(r["step"], r["loss"]) for r in joined] == [(10, 5.0), (20, 4.0), (30, 3.4), (40, 3.0)]
    # A restart inside one file (run by hand with --resume, same output_dir) is the same.
    assert join_records([first + resumed]) == joined
    assert join_records([[step(10), {"kind": "step", "step": "x"}]]) == [step(10)]


# ------------------------------------------------------------------------- charts


def test_chart_draws_a_line_across_its_cells():
    lines = chart([Series([0, 1, 2, 3], [0.0, 1.0, 2.0, 3.0])], width=8, height=2)
    assert len(lines) == 4  # 2 rows of cells, the axis, the x labels
    rows = [line.plain for line in lines[:2]]
    assert rows[0].startswith("      3 ┤") and rows[1].startswith("      0 ┤")
    cells = [row[9:] for row in rows]
    assert all(len(c) == 8 and all(0x2800 <= ord(ch) <= 0x28FF for ch in c) for c in cells)
    # Rising from the bottom left to the top right: dots there, none in the other corners.
    assert cells[1][0] != "⠀" and cells[0][-1] != "⠀"
    assert cells[0][0] == "⠀" and cells[1][-1] == "⠀"
    assert lines[3].plain.split() == ["0", "3"]


def test_chart_colours_each_series_and_survives_odd_input():
    two = chart(
        [Series([0, 10], [1.0, 1.0], colour="cyan"), Series([0, 10], [2.0, 2.0], "magenta")],
        width=10,
        height=3,
    )
    styles = {str(span.style) for line in two[:3] for span in line.spans}
    assert {"cyan", "magenta"} <= styles
    assert chart([Series([], [])])[0].plain == "(no data)"
    flat = chart([Series([5], [2.0])], width=4, height=2)  # one point, no range
    assert len(flat) == 4


@pytest.mark.parametrize(
    ("value", "text"), [(5.7581, "5.76"), (12345, "12.3k"), (4.1e6, "4.1M"), (0.0012, "1.2e-03")]
)
def test_compact_labels(value, text):
    assert compact(value) == text


# ------------------------------------------------------------------------- real runs


def deploy_run(project, *args: str) -> str:
    code, summary = deploy(project.config(), DeployOptions(detach=True, extra_args=list(args)))
    assert code == 0
    return summary["run_id"]


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def resume_link(run_dir: Path, parent: str) -> None:
    """What a resumed deploy records in meta.json: the run it continues."""
    meta = json.loads((run_dir / "meta.json").read_text())
    meta["resumed_from"] = parent
    (run_dir / "meta.json").write_text(json.dumps(meta))


def cli(project, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, "runs", "show", "-c", str(project.config_path), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )


@pytest.fixture
def lineage(project, tiny_runs):
    """Two ended runs: the second resumed from the first's step-20 checkpoint, each with
    the real tiny run's records (the second from step 30 on)."""
    write_local_config(project.root, args=[])
    records = tiny_runs["clean"].records()
    first = deploy_run(project)
    wait_finished(project, first)
    second = deploy_run(project)
    wait_finished(project, second)
    start = dict(records[0], step=20)  # the second started at the step-20 checkpoint
    write_metrics(project.run_dir(first), [r for r in records if r["kind"] != "eval"])
    write_metrics(project.run_dir(second), [start] + [r for r in records if r["step"] >= 30])
    resume_link(project.run_dir(second), first)
    return first, second, records


def test_curves_follow_the_resume_lineage(project, lineage):
    first, second, records = lineage
    target = open_target(project.config())
    (curves,) = read_curves(target, str(project.workdir), [second], python=sys.executable)
    assert curves.run.id == second and curves.lineage == [first, second]
    assert [r["step"] for r in curves.steps] == [10, 20, 30, 40]
    assert curves.steps[-1] == [r for r in records if r["kind"] == "step"][-1]
    assert [e["kind"] for e in curves.evals] == ["eval"]
    with pytest.raises(UsageError, match=r"no run nope in .*/runs"):
        read_curves(target, str(project.workdir), ["nope"], python=sys.executable)
    # A long run is thinned out where it runs (evenly, the last record always kept).
    (thin,) = read_curves(
        target, str(project.workdir), [first], python=sys.executable, max_points=2
    )
    assert [r["step"] for r in thin.steps] == [10, 40]
    # A resume loop in meta.json ends instead of going round.
    resume_link(project.run_dir(first), second)
    (looped,) = read_curves(target, str(project.workdir), [second], python=sys.executable)
    assert looped.lineage == [first, second]


def test_cli_shows_state_lineage_and_charts(project, lineage):
    first, second, records = lineage
    shown = cli(project, second)
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout
    assert f"run        {second} on this machine" in out
    assert "state      finished (exit 0)" in out
    assert f"lineage    {first} → {second}" in out
    last = [r for r in records if r["kind"] == "step"][-1]
    assert f"progress   step 40/40 · loss {last['loss']:.4f}" in out
    assert "eval       tau " in out and "lossless yes" in out
    assert (
        "trainer    40 steps · lr 0.01 · batch 4 x 48 tokens · drafter 2 layers, block 4 · "
        "target tiny · eager on cpu"
    ) in out
    for heading in ("loss", "tau~", "tokens/s"):
        assert f"\n{heading}   last " in out
    tau_heading = next(line for line in out.splitlines() if line.startswith("tau~   last "))
    assert "   eval tau " in tau_heading  # the run's eval drawn beside tau~
    assert sum(1 for line in out.splitlines() if "┤" in line) == 6  # 3 charts, top and bottom
    assert "\x1b[" not in out  # not a terminal: plain characters


def test_cli_json_and_png(project, lineage, tmp_path):
    first, second, _ = lineage
    png = tmp_path / "curves.png"
    shown = cli(project, first, second, "--json", "--png", str(png))
    assert shown.returncode == 0, shown.stderr
    answer = flat(json.loads(shown.stdout))
    assert [r["run"]["id"] for r in answer["runs"]] == [first, second]
    assert answer["runs"][1]["lineage"] == [first, second]
    assert [r["step"] for r in answer["runs"][0]["steps"]] == [10, 20, 30, 40]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < len(data) < 100_000


def test_cli_compares_two_runs_side_by_side(project, lineage):
    first, second, _ = lineage
    shown = cli(project, first, second)
    assert shown.returncode == 0, shown.stderr
    header = next(line for line in shown.stdout.splitlines() if first in line and second in line)
    assert header.index(first) < header.index(second)
    assert f"   {first} " in shown.stdout and f"   {second} " in shown.stdout  # chart legends


def test_running_run_shows_time_left_and_a_removed_ancestor(project, tiny_runs):
    run = deploy_run(project)  # the fake trainer sleeps: still running
    try:
        records = tiny_runs["clean"].records()
        write_metrics(project.run_dir(run), [r for r in records if r["step"] <= 20])
        resume_link(project.run_dir(run), "20200101-000000-dead")
        shown = cli(project)  # the active run
        assert shown.returncode == 0, shown.stderr
        assert "state      running" in shown.stdout
        assert "progress   step 20/40 · " in shown.stdout and " · eta " in shown.stdout
        assert f"lineage    (20200101-000000-dead: removed) → {run}" in shown.stdout
    finally:
        kill_runs(project.workdir)


def test_bad_input_is_a_usage_error(project):
    write_local_config(project.root, args=[])
    nothing = cli(project)
    assert nothing.returncode == 2
    assert "error: no runs in" in nothing.stderr and "deploy" in nothing.stderr
    run = deploy_run(project)
    wait_finished(project, run)
    missing = cli(project, "nope")
    assert missing.returncode == 2 and "error: no run nope in" in missing.stderr
    assert "hint:" in missing.stderr and "runs" in missing.stderr
    outside = cli(project, "../..")  # a run id is a folder under runs/, never a path
    assert outside.returncode == 2 and "error: no run ../.. in" in outside.stderr
    three = cli(project, "a", "b", "c")
    assert three.returncode == 2 and "one run or two to compare, got 3" in three.stderr
    bare = cli(project, run)  # a run whose trainer wrote no metrics.jsonl
    assert bare.returncode == 0
    assert f"run {run} has no metrics.jsonl" in bare.stderr
