"""The run log: one writer shared by all threads, the header and the step lines.

The line formats are a contract with the crash detector that follows the log:
``drafter-0 on cpu: ready (warm-up 1.2 s)``, ``drafter-0 failed:`` + traceback,
``step 120/10000 | loss 2.31 | acc 0.52 | tau~ 3.1 | lr 5.9e-4 | grad_norm 0.84 | 1830 tok/s | mfu 41.2% | queue 3/8 | eta 1h05m``
(dflashctl's run summary reads the step and loss; the fields after them may grow).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

import torch


class RunLog:
    """Thread-safe line writer; every line is flushed so a follower sees it at once."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stdout
        self._lock = threading.Lock()
        self.lines: list[str] = []  # kept for tests and the final summary

    def line(self, text: str) -> None:
        with self._lock:
            self.lines.append(text)
            try:
                self._stream.write(text + "\n")
                self._stream.flush()
            except (ValueError, OSError):  # stream closed under us at shutdown
                pass

    def block(self, text: str) -> None:
        for part in text.rstrip("\n").split("\n"):
            self.line(part)


def stage_line(thread: str, device: str, message: str) -> str:
    return f"{thread} on {device}: {message}"


def format_lr(lr: float) -> str:
    mantissa, exponent = f"{lr:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def format_step_line(
    *,
    step: int,
    total: int,
    loss: float,
    acc: float,
    tau: float,
    lr: float,
    tokens_per_s: float,
    mfu: float | None,
    queue_depth: int,
    queue_size: int,
    eta_s: float | None = None,
    grad_norm: float | None = None,
) -> str:
    norm_text = f"grad_norm {format_norm(grad_norm)} | " if grad_norm is not None else ""
    mfu_text = f"{100 * mfu:.1f}%" if mfu is not None else "n/a"
    eta_text = f" | eta {format_eta(eta_s)}" if eta_s is not None else ""
    return (
        f"step {step}/{total} | loss {loss:.4f} | acc {acc:.2f} | tau~ {tau:.2f} | "
        f"lr {format_lr(lr)} | {norm_text}{tokens_per_s:.0f} tok/s | mfu {mfu_text} | queue {queue_depth}/{queue_size}"
        f"{eta_text}"
    )


def format_norm(norm: float) -> str:
    """`0.842`, `12.3`, `3.1e+04`, `nan`: three significant digits."""
    if not math.isfinite(norm):
        return "nan" if math.isnan(norm) else "inf"
    return f"{norm:.3g}"


def format_eta(seconds: float) -> str:
    """`45s`, `3m12s`, `1h05m`, `2d03h`: the time left at the precision that matters."""
    seconds = max(0, round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_nonfinite_line(*, step: int, total: int, loss: float, count: int, allowed: int) -> str:
    shown = "nan" if math.isnan(loss) else ("inf" if loss > 0 else "-inf")
    return f"step {step}/{total} | loss {shown} | non-finite loss ({count}/{allowed} allowed)"


def git_commit(start: Path) -> str:
    """The commit of the tree we run from: the run's meta.json (written by dflashctl, which
    deploys a release without .git), else git, else a GIT_COMMIT file above us."""
    run_dir = os.environ.get("DFLASH_RUN_DIR")
    if run_dir:
        try:
            meta = json.loads((Path(run_dir) / "meta.json").read_text())
            if meta.get("git_commit"):
                return str(meta["git_commit"])[:12] + (" (dirty)" if meta.get("git_dirty") else "")
        except (OSError, ValueError):
            pass
    try:
        out = subprocess.run(
            ["git", "-C", str(start), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    for folder in (start, *start.parents):
        meta = folder / "GIT_COMMIT"
        if meta.is_file():
            return meta.read_text().strip() or "unknown"
    return "unknown"


def device_descriptions(devices: list[str]) -> list[str]:
    described = []
    for dev in dict.fromkeys(devices):
        if dev.startswith("cuda") and torch.cuda.is_available():
            index = torch.device(dev).index or 0
            props = torch.cuda.get_device_properties(index)
            described.append(f"{dev} {props.name} {props.total_memory / 2**30:.0f} GiB")
        else:
            described.append(
                f"{dev} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
            )
    return described


def header_lines(config_dict: dict, devices: list[str], source_dir: Path) -> list[str]:
    import yaml

    lines = [
        "dflash trainer: train_dflash_pipeline.py",
        f"started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"versions: python {platform.python_version()}, torch {torch.__version__}"
        + (f", cuda {torch.version.cuda}" if torch.version.cuda else "")
        + _transformers_version(),
        f"git commit: {git_commit(source_dir)}",
        "devices: " + "; ".join(device_descriptions(devices)),
        "config:",
    ]
    dumped = yaml.safe_dump(config_dict, sort_keys=False, default_flow_style=None).rstrip("\n")
    lines.extend("  " + row for row in dumped.split("\n"))
    return lines


def _transformers_version() -> str:
    try:
        import transformers

        return f", transformers {transformers.__version__}"
    except Exception:  # optional for the header only
        return ""
