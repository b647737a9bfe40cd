"""dflashctl runs show RUN [RUN2]: one run (or two, compared) at a glance: its state,
config, lineage and its loss, tau~ and tokens/s curves, drawn in the terminal or with
--png into an image. Works while the run trains, and after it finished or stopped."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.text import Text

from dflashctl import hints
from dflashctl.commands.common import ConfigOption, JsonOption
from dflashctl.commands.run_ids import complete_run_id
from dflashctl.errors import UsageError
from dflashctl.ui import terminal

RunsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help="One run id, or two to compare (default: the active run).",
        metavar="[RUN [RUN2]]",
        show_default=False,
        autocompletion=complete_run_id,
    ),
]
PngOption = Annotated[
    Path | None,
    typer.Option(
        "--png",
        metavar="FILE",
        help="Also draw the curves into a PNG image.",
        show_default=False,
        dir_okay=False,
    ),
]


def show(
    run_ids: RunsArgument = None,
    png: PngOption = None,
    json_output: JsonOption = False,
    config: ConfigOption = None,
) -> None:
    """A run's state, config, lineage and loss, tau~ and tokens/s curves (two: compared)."""
    from dflashctl.config.schema import load_config
    from dflashctl.remote.nodes import names_each_node, node_sessions
    from dflashctl.runs.metrics import read_curves

    if json_output:
        terminal.set_quiet_stdout(True)
    wanted = list(run_ids or ["@active"])
    if len(wanted) > 2:
        raise UsageError(f"runs show takes one run or two to compare, got {len(wanted)}")
    cfg = load_config(config)
    # Rank 0 writes metrics.jsonl and the checkpoints, and it runs on the first node
    # (the top-level sections are that node's), so this reads the first node alone.
    first = cfg.nodes[0].label()
    note = None
    if names_each_node(cfg.nodes):
        note = (
            f"metrics from the first node, {first}: rank 0 writes them there "
            f"({len(cfg.nodes)} nodes; every node's state: {hints.command('runs')})"
        )
    with node_sessions(cfg.for_node(0)) as (node,):
        place = node.target.describe() if note is None else f"{first} ({node.target.describe()})"
        curves = read_curves(
            node.target, node.config.container.workdir, wanted, python=node.config.container.python
        )
    if png is not None:
        from dflashctl.ui.plot_image import write_png

        write_png(curves, png)
    if json_output:
        answer: dict[str, Any] = {"node": first, "target": place}
        answer["runs"] = [c.to_json() for c in curves]
        answer["note"] = note  # null on one node: every answer has the same keys
        terminal.print_json({"nodes": [answer]}, command="runs show")
        return
    if note is not None:
        terminal.info(note)
    _print(curves, place)
    if png is not None:
        terminal.success(f"wrote {png}")


def _print(curves: list, place: str) -> None:
    from dflashctl.runs.metrics import SERIES
    from dflashctl.ui.charts import COLOURS, EVAL_COLOURS, LABEL_WIDTH, Series, chart, compact

    out = terminal.out
    if len(curves) == 1:
        for label, value in _facts(curves[0], place):
            out.print(Text(f"{label:<10} ", style="bold").append(value))
    else:
        _print_side_by_side(curves, place)
    for run in curves:
        if not run.has_metrics:
            terminal.warning(
                f"run {run.run.id} has no metrics.jsonl: its trainer writes none, or it ran "
                "before dflashctl's trainer wrote one"
            )
    if not any(run.steps for run in curves):
        return
    width = max(20, min(100, out.width - LABEL_WIDTH - 2))
    for key, label in SERIES:
        heading = Text(f"\n{label}", style="bold")
        for index, run in enumerate(curves):
            _, ys = run.series(key)
            if ys:
                heading.append(f"   {run.run.id if len(curves) > 1 else 'last'} ", style="dim")
                heading.append(compact(ys[-1], digits=4), style=COLOURS[index])
        drawn = [Series(*run.series(key), colour=COLOURS[i]) for i, run in enumerate(curves)]
        if key == "tau":  # eval tau (held-out prompts, real decoding) beside the estimate
            for index, run in enumerate(curves):
                xs, ys = run.eval_series()
                if ys:
                    colour = EVAL_COLOURS[index % len(EVAL_COLOURS)]
                    heading.append("   eval tau ", style="dim")
                    heading.append(compact(ys[-1], digits=4), style=colour)
                    drawn.append(Series(xs, ys, colour=colour))
        out.print(heading)
        for line in chart(drawn, width=width, height=6):
            out.print(line, no_wrap=True, overflow="crop")
    out.print(Text(" " * LABEL_WIDTH + " step", style="dim"))


def _facts(run, place: str) -> list[tuple[str, str]]:
    """(label, value) lines about one run, only for what is known."""
    info, meta = run.run, run.run.meta
    facts = [("run", f"{info.id} on {place}"), ("state", info.describe_state())]
    if info.started:
        facts.append(("started", info.started.replace("T", " ").rstrip("Z") + " UTC"))
    if info.release:
        facts.append(("release", info.release))
    if info.command:
        facts.append(("command", " ".join(info.command)))
    if run.config:
        facts.append(("trainer", _config_text(run.config)))
    if meta.get("git_commit"):
        dirty = " (dirty)" if meta.get("git_dirty") else ""
        facts.append(("git", f"{str(meta['git_commit'])[:12]}{dirty}"))
    if meta.get("config_path"):
        digest = f" (digest {str(meta['config_digest'])[:12]})" if meta.get("config_digest") else ""
        facts.append(("config", f"{meta['config_path']}{digest}"))
    if len(run.lineage) > 1 or run.missing_ancestors:
        chain = " → ".join(run.lineage)
        if run.missing_ancestors:
            chain = f"({', '.join(run.missing_ancestors)}: removed) → " + chain
        facts.append(("lineage", chain))
    last = run.last
    if last is not None:
        facts.append(("progress", _progress(last, running=info.state.status == "running")))
    elif run.has_metrics or info.state.status == "running":
        facts.append(("progress", "no step logged yet"))
    inherited = run.describe_inherited()
    if inherited:
        facts.append(("curves", inherited))
    if run.evals:
        facts.append(("eval", _eval_text(run.evals[-1])))
    return facts


def _config_text(config: dict[str, Any]) -> str:
    """The few settings that tell runs apart, from the trainer's resolved config."""

    def section(name: str) -> dict[str, Any]:
        value = config.get(name)
        return value if isinstance(value, dict) else {}

    train, data, optim = section("train"), section("data"), section("optim")
    drafter, target, runtime = section("drafter"), section("target"), section("runtime")
    parts = []
    if train.get("steps") is not None:
        parts.append(f"{train['steps']} steps")
    if isinstance(optim.get("lr"), (int, float)):
        parts.append(f"lr {optim['lr']:g}")
    if data.get("batch_size") is not None and data.get("seq_len") is not None:
        parts.append(f"batch {data['batch_size']} x {data['seq_len']} tokens")
    if drafter.get("num_layers") is not None:
        parts.append(f"drafter {drafter['num_layers']} layers, block {drafter.get('block_size')}")
    if target.get("path") or target.get("preset"):
        parts.append(f"target {target.get('path') or target.get('preset')}")
    if runtime.get("compile"):
        devices = runtime.get("drafter_devices") or []
        parts.append(f"{runtime['compile']} on {', '.join(map(str, devices)) or '?'}")
    return " · ".join(parts) or "(no known settings)"


def _progress(last: dict[str, Any], *, running: bool) -> str:
    from dflashctl.ui.charts import compact

    parts = [f"step {last['step']}/{last.get('total_steps', '?')}"]
    if isinstance(last.get("loss"), (int, float)):
        parts.append(f"loss {last['loss']:.4f}")
    if isinstance(last.get("tau"), (int, float)):
        parts.append(f"tau~ {last['tau']:.2f}")
    if isinstance(last.get("tokens_per_s"), (int, float)):
        parts.append(f"{compact(last['tokens_per_s'])} tok/s")
    if isinstance(last.get("mfu"), (int, float)):
        parts.append(f"mfu {100 * last['mfu']:.1f}%")
    if running and isinstance(last.get("eta_s"), (int, float)):
        ago = time.time() - float(last.get("time") or time.time())
        parts.append(f"eta {terminal.human_duration(int(last['eta_s']))}")
        parts.append(f"last record {terminal.human_duration(int(max(0, ago)))} ago")
    return " · ".join(parts)


def _eval_text(record: dict[str, Any]) -> str:
    parts = []
    if isinstance(record.get("tau"), (int, float)):
        parts.append(f"tau {record['tau']:.2f}")
    if "lossless" in record:
        parts.append("lossless " + ("yes" if record["lossless"] else "NO"))
    if record.get("tokens"):
        parts.append(f"{record['tokens']} tokens")
    return " · ".join(parts) + f" (after step {record.get('step')})"


def _print_side_by_side(curves: list, place: str) -> None:
    from dflashctl.ui.charts import COLOURS
    from dflashctl.ui.tables import print_side_by_side

    facts = [dict(_facts(run, place)) for run in curves]
    labels = list(dict.fromkeys(label for run_facts in facts for label in run_facts))
    labels.remove("run")
    headers = [(run.run.id, COLOURS[index]) for index, run in enumerate(curves)]
    rows = [[label, *(run_facts.get(label, "-") for run_facts in facts)] for label in labels]
    print_side_by_side(f"on {place}", headers, rows)
