"""runs show draws eval tau (held-out prompts, real decoding) beside tau~ (the terminal
chart is checked by tests/test_runs_show.py against the real test host)."""

from __future__ import annotations

import json

from dflashctl.runs.metrics import RunCurves
from dflashctl.runs.records import RunInfo, RunState
from dflashctl.ui.plot_image import write_png


def _curves() -> RunCurves:
    steps = [
        {"kind": "step", "step": s, "tau": 1.0 + s / 100, "loss": 5 - s / 50}
        for s in range(10, 110, 10)
    ]
    evals = [
        {"kind": "eval", "step": 50, "tau": 1.3, "lossless": True, "during_training": True},
        {"kind": "eval", "step": 100, "tau": 1.45, "lossless": True},
        {"kind": "eval", "step": 100, "tau": 1.47, "lossless": True},  # re-evaluated: replaces
    ]
    run = RunInfo(id="r1", state=RunState(status="exited", exit_code=0))
    return RunCurves(run=run, lineage=["r1"], steps=steps, evals=evals, has_metrics=True)


def test_eval_series_is_one_point_per_step():
    assert _curves().eval_series() == ([50, 100], [1.3, 1.47])
    assert RunCurves(run=_curves().run, lineage=["r1"]).eval_series() == ([], [])


def test_the_png_carries_the_eval_curve(tmp_path):
    path = tmp_path / "curves.png"
    write_png([_curves()], path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.dumps(_curves().to_json())  # still serialisable with evals
