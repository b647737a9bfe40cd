"""A run's training curves: the trainer's metrics.jsonl, read where the trainer runs and
joined across a resume lineage.

The trainer appends one JSON object per logged step to `runs/<id>/metrics.jsonl`
(`{"kind": "step", "step", "loss", "tau", "tokens_per_s", ...}`) and one per evaluation
(`{"kind": "eval", ...}`), and its resolved config at each start (`{"kind": "start"}`). A run started from another run's checkpoint names that run
in its meta.json as `resumed_from` (a run id); the agent follows those links (op
`metrics`, one round trip for every run asked about) and the curves here continue
across them: where a later run restarts at an earlier step, its records replace the
earlier run's from that step on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from dflashctl import hints
from dflashctl.errors import UsageError
from dflashctl.remote.agent_client import call_agent
from dflashctl.remote.agent_messages import MetricsAnswer, RunMetrics
from dflashctl.runs.records import RunInfo, _run_from_agent

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target

# Step records per run sent over SSH at most: a plot is a few hundred columns wide.
MAX_POINTS = 2000
# The series `runs show` plots, with their labels.
SERIES = (("loss", "loss"), ("tau", "tau~"), ("tokens_per_s", "tokens/s"))


@dataclass
class RunCurves:
    """One run (the last of its lineage) and the records of the whole lineage."""

    run: RunInfo
    lineage: list[str]  # run ids, oldest first, ending with run.id
    # Step records, joined across the lineage: the ancestors' first (each tagged with
    # its "run"), then the run's own.
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)  # the run's own
    inherited_evals: list[dict[str, Any]] = field(default_factory=list)  # its ancestors'
    config: dict[str, Any] | None = None  # the trainer's resolved config at its last start
    has_metrics: bool = False  # any run in the lineage wrote metrics.jsonl
    missing_ancestors: list[str] = field(default_factory=list)  # named but gone (pruned)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one key, records without a number left out."""
        xs, ys = [], []
        for record in self.steps:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                xs.append(int(record["step"]))
                ys.append(float(value))
        return xs, ys

    @property
    def own_steps(self) -> list[dict[str, Any]]:
        """The step records this run logged itself."""
        return [r for r in self.steps if r.get("run", self.run.id) == self.run.id]

    def inherited(self) -> list[tuple[str, int, int]]:
        """(run id, first step, last step) of each ancestor's part of the curve."""
        parts: list[tuple[str, int, int]] = []
        for record in self.steps:
            owner, step = record.get("run", self.run.id), int(record["step"])
            if owner == self.run.id:
                break
            if parts and parts[-1][0] == owner:
                parts[-1] = (owner, parts[-1][1], step)
            else:
                parts.append((owner, step, step))
        return parts

    def describe_inherited(self) -> str | None:
        """`steps up to 600 are run b273's`: where the curve is another run's."""
        parts = self.inherited()
        if not parts:
            return None
        first, *rest = parts
        words = [f"steps up to {first[2]} are run {first[0]}'s"]
        words += [f"{lo}-{hi} run {owner}'s" for owner, lo, hi in rest]
        return ", ".join(words)

    def eval_series(self) -> tuple[list[int], list[float]]:
        """(steps, tau) of the evaluations (every eval.every steps and at the end): the
        acceptance serving sees, drawn beside the training estimate tau~."""
        points = {}
        for record in self.inherited_evals + self.evals:
            tau, step = record.get("tau"), record.get("step")
            if (
                isinstance(tau, (int, float))
                and isinstance(step, int)
                and not isinstance(tau, bool)
            ):
                points[step] = float(tau)  # a re-evaluation of a step replaces the earlier one
        steps = sorted(points)
        return steps, [points[s] for s in steps]

    @property
    def last(self) -> dict[str, Any] | None:
        """The run's own last step record (None: it has logged no step yet)."""
        own = self.own_steps
        return own[-1] if own else None

    def to_json(self) -> dict[str, Any]:
        inherited = [r for r in self.steps if r.get("run", self.run.id) != self.run.id]
        return {
            "run": self.run.to_json(),
            "lineage": self.lineage,
            "missing_ancestors": self.missing_ancestors,
            "has_metrics": self.has_metrics,
            "steps": self.own_steps,
            "evals": self.evals,
            "no_step_logged": not self.own_steps,
            "inherited_steps": inherited,
            "inherited_evals": self.inherited_evals,
            "inherited": [
                {"run": owner, "first_step": lo, "last_step": hi}
                for owner, lo, hi in self.inherited()
            ],
            "config": self.config,
        }


def join_records(segments: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Step records of several files (or restarts within one), oldest first, as one
    curve: a record whose step is not past the previous one's starts over from there,
    replacing the records it repeats (a resume from an earlier checkpoint)."""
    joined: list[dict[str, Any]] = []
    for records in segments:
        for record in records:
            step = record.get("step")
            if not isinstance(step, int):
                continue
            while joined and joined[-1]["step"] >= step:
                joined.pop()
            joined.append(record)
    return joined


def read_curves(
    target: Target, workdir: str, run_ids: list[str], *, python: str, max_points: int = MAX_POINTS
) -> list[RunCurves]:
    """The curves of each run (`@active` for the run launched last), in one round trip."""
    params = {"workdir": workdir, "run_ids": run_ids, "max_points": max_points}
    answer = cast(MetricsAnswer, call_agent(target, python, "metrics", params))
    if answer["missing"]:
        shown = ", ".join(answer["missing"])
        if answer["missing"] == ["@active"]:
            raise UsageError(
                f"no runs in {workdir} on {target.describe()} yet",
                hint=f"start one with {hints.command('deploy')}",
            )
        raise UsageError(
            f"no run {shown} in {workdir}/runs on {target.describe()}",
            hint=f"list the runs with {hints.command('runs')}",
        )
    return [_curves(entry, answer.get("active_run")) for entry in answer["runs"]]


def continued_parent(part: dict[str, Any]) -> bool | None:
    """Did this run continue the run it names as `resumed_from`? RunInfo.continued, from
    its first start record (an agent that does not send it: read from its metrics)."""
    info = _run_from_agent(part["record"], None)
    starts = _kind(part, "start")
    if info.started_at_step is None and starts and isinstance(starts[0].get("step"), int):
        info.started_at_step = starts[0]["step"]
    return info.continued


def _kind(part: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [r for r in part.get("metrics") or [] if r.get("kind") == kind]


def _curves(entry: RunMetrics, active_id: str | None) -> RunCurves:
    lineage = list(entry["lineage"])
    # Only what the run really continued: a run that began anew ends its lineage.
    for index in range(len(lineage) - 1, 0, -1):
        if not lineage[index].get("missing") and not continued_parent(lineage[index]):
            lineage = lineage[index:]
            break
    present = [part for part in lineage if not part.get("missing")]
    own = present[-1]
    segments = [
        [{**r, "run": part["id"]} if part is not own else r for r in _kind(part, "step")]
        for part in present
    ]
    steps = join_records(segments)
    first_own = next(
        (r["step"] for r in _kind(own, "step") if isinstance(r.get("step"), int)), None
    )
    started = next((r["step"] for r in _kind(own, "start") if isinstance(r.get("step"), int)), None)
    handed_on = started if started is not None else first_own
    inherited_evals = [
        {**r, "run": part["id"]}
        for part in present[:-1]
        for r in _kind(part, "eval")
        if handed_on is None or (isinstance(r.get("step"), int) and r["step"] <= handed_on)
    ]
    starts = _kind(own, "start")
    config = starts[-1].get("config") if starts else None
    return RunCurves(
        run=_run_from_agent(own["record"], active_id),
        lineage=[part["id"] for part in present],
        steps=steps,
        evals=_kind(own, "eval"),
        inherited_evals=inherited_evals,
        config=config if isinstance(config, dict) else None,
        has_metrics=any(part["metrics"] is not None for part in present),
        missing_ancestors=[part["id"] for part in lineage if part.get("missing")],
    )
