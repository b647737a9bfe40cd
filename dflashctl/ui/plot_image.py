"""`runs show --png FILE`: the same curves as an image, drawn with matplotlib.

matplotlib is imported here only (it takes longer to import than the whole CLI) and
with the Agg backend, which needs no display.
"""

from __future__ import annotations

from pathlib import Path

from dflashctl.errors import UsageError
from dflashctl.runs.metrics import SERIES, RunCurves

COLOURS = ("tab:cyan", "tab:purple", "tab:green", "tab:olive")
EVAL_COLOURS = ("tab:orange", "tab:red")


def write_png(curves: list[RunCurves], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--png needs matplotlib, which is not installed here",
            hint="pip install matplotlib (or dflashctl's plots extra: pip install 'dflashctl[plots]')",
        ) from None
    if not any(run.steps or run.eval_series()[0] for run in curves):
        # No curve at all: say so, rather than three empty 0-1 axes.
        figure = plt.figure(figsize=(7, 2), dpi=100)
        names = " and ".join(f"run {run.run.id}" for run in curves)
        figure.text(0.5, 0.5, f"{names}: no step logged yet", ha="center", va="center")
        _save(plt, figure, path)
        return
    figure, axes = plt.subplots(len(SERIES), 1, figsize=(7, 6.3), sharex=True, dpi=100)
    for ax, (key, label) in zip(axes, SERIES, strict=True):
        for index, run in enumerate(curves):
            xs, ys = run.series(key)
            if xs:
                ax.plot(
                    xs, ys, color=COLOURS[index % len(COLOURS)], linewidth=1.4, label=run.run.id
                )
            inherited = run.inherited()
            if inherited and xs:
                # The ancestors' part of the curve, shaded and named.
                ax.axvspan(inherited[0][1], inherited[-1][2], color="0.9", zorder=0)
                if key == SERIES[0][0] and index == 0:
                    ax.set_title(run.describe_inherited() or "", fontsize=8)
        if key == "tau":  # eval tau on held-out prompts beside the training estimate
            for index, run in enumerate(curves):
                xs, ys = run.eval_series()
                if xs:
                    name = "eval tau" if len(curves) == 1 else f"{run.run.id} eval tau"
                    ax.plot(
                        xs,
                        ys,
                        color=EVAL_COLOURS[index % len(EVAL_COLOURS)],
                        linewidth=1.4,
                        linestyle="--",
                        marker="o",
                        markersize=3,
                        label=name,
                    )
            if any(run.eval_series()[0] for run in curves):
                ax.legend(fontsize=8, loc="lower right")
        ax.set_ylabel(label if key != "tau" else "tau~ / eval tau")
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("step")
    if len(curves) > 1:
        axes[0].legend(fontsize=8, loc="upper right")
    title = " vs ".join(
        run.run.id + ("" if run.own_steps else " (no step logged yet)") for run in curves
    )
    figure.suptitle(f"run {title}", fontsize=10)
    figure.tight_layout()
    _save(plt, figure, path)


def _save(plt, figure, path: Path) -> None:
    try:
        figure.savefig(path, format="png")
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(figure)
