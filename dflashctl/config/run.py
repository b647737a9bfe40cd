"""dflash.yaml's `run:` section: how the trainer's run is stopped, kept, retried after a
crash (run.retry) and judged to hang (run.hang)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field, field_validator

from dflashctl.config.base import Section, TextList, checked
from dflashctl.config.errors import invalid

# Seconds that may be 0 (run.stop_grace_s, run.retry's waits).
Seconds = Annotated[float, checked(lambda v: v >= 0, "must be 0 or more seconds, got {value}")]


class RetryConfig(Section):
    """Automatic recovery: the run's supervisor restarts the trainer after a crash a
    restart fixes, resuming from the run's latest checkpoint (dflashctl/ops/recovery.py)."""

    max_restarts: Annotated[
        int, checked(lambda v: v >= 0, "must be 0 (off) or more, got {value}")
    ] = 3  # 0: off
    # Categories to retry; None: those whose crash rule says `retryable: true`.
    categories: list[str] | None = None
    backoff_s: Seconds = 10.0  # the first wait, doubled for each restart within the window
    max_backoff_s: Seconds = 300.0
    window_s: Seconds = 3600.0  # restarts counted within this window (0: the whole run)
    resume_args: TextList = Field(default_factory=lambda: ["--resume"])

    @field_validator("categories")
    @classmethod
    def _categories(cls, value: list[str] | None) -> list[str] | None:
        for category in value or []:
            if not re.match(r"^[a-z][a-z0-9_]*$", category):
                raise invalid(
                    f"{category!r} is not a crash category (lower_snake_case)",
                    "see the categories in templates/crash_patterns.yaml",
                )
        return value


class HangConfig(Section):
    """When a running run is said to hang: no step line for `factor` times its own
    recent interval between step lines, and at least `min_s` (dflashctl/agent/progress.py).
    The trainer's own watchdog dumps every thread's stack at the same threshold."""

    # (NaN and infinity are refused for every section)
    factor: Annotated[
        float,
        checked(
            lambda v: v > 1,
            "must be more than 1 (times the run's recent step interval), got {value}",
            "e.g. 4: hanging after 4 times the usual time between step lines",
        ),
    ] = 4.0
    min_s: Annotated[
        float,
        checked(
            lambda v: v > 0,
            "must be more than 0 seconds, got {value}",
            "e.g. 60: never hanging before a minute without a step line",
        ),
    ] = 60.0


class RunConfig(Section):
    stop_grace_s: Seconds = 20.0
    keep_releases: Annotated[
        int, checked(lambda v: v >= 1, "must be at least 1 (the current release), got {value}")
    ] = 5
    # A shell command run where the trainer ran once it has ended (exit_code written),
    # with DFLASH_RUN_ID, DFLASH_RUN_DIR and DFLASH_EXIT_CODE set: a notification
    # that works with nobody following the log.
    on_exit: str | None = None
    retry: RetryConfig = Field(default_factory=RetryConfig)
    hang: HangConfig = Field(default_factory=HangConfig)
    # The GPUs this run may use (indices as the container sees them): CUDA_VISIBLE_DEVICES
    # and torchrun's nproc_per_node (when `gpu`/`auto`) follow; None: every GPU.
    gpus: list[int] | None = None
    # deploy/restart --detach say "started" only once every node's log has a line this
    # regex finds (the rank prefix left out); None: the bundled trainer's `rendezvous:`
    # line where the entry script names DFLASH_START_GATE, else no wait at all.
    start_line: str | None = None
    # ... for at most this long (then a warning, exit 0: the run goes on); 0: no wait.
    start_timeout_s: Annotated[
        float, checked(lambda v: v >= 0, "must be 0 (no wait) or more seconds, got {value}")
    ] = 300.0
    # On several nodes: how long each node, its release built and nothing stopped, waits
    # at the commit barrier for the others before every node aborts; the largest upload
    # (at 1 MB/s) and setup.timeout_s come on top. Half of it when nothing is uploaded.
    commit_timeout_s: Annotated[
        float,
        checked(
            lambda v: v > 0,
            "must be more than 0 seconds, got {value}",
            "e.g. 120: how long the nodes wait for each other before all of them abort",
        ),
    ] = 120.0

    @field_validator("start_line")
    @classmethod
    def _start_line(cls, value: str | None) -> str | None:
        if value is None:
            return value
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError, ValueError, MemoryError) as exc:
            raise invalid(
                f"not a regular expression: {exc}",
                "e.g. '^rendezvous: ' (a line your trainer prints once every rank started)",
            ) from None
        if not value:
            raise invalid("empty: it would find any line", "leave it out, or name a line")
        return value

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list) and (
            not value
            or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in value)
            or len(set(value)) != len(value)
        ):
            raise invalid(
                f"GPU indices are distinct whole numbers from 0, got {value}",
                "e.g. [0, 1], or leave run.gpus out for every GPU",
            )
        return value
