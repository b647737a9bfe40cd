"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

ConfigOption = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        metavar="PATH",
        help="Path to dflash.yaml (default: $DFLASHCTL_CONFIG, then ./dflash.yaml).",
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout instead of text.")
]
TrainerArgsArgument = Annotated[
    list[str] | None,
    typer.Argument(
        help="Extra trainer arguments, after `--`; appended to trainer.args.",
        metavar="-- TRAINER_ARGS",
        show_default=False,
    ),
]
FreshOption = Annotated[
    bool,
    typer.Option(
        "--fresh",
        help="Start training at step 0 instead of continuing the replaced run's latest "
        "checkpoint (a run that finished is continued only when train.steps was raised).",
    ),
]
WaitOption = Annotated[
    bool,
    typer.Option(
        "--wait",
        help="If another deploy, restart or stop is in flight on this workdir, queue "
        "behind it instead of being refused.",
    ),
]
DetachOption = Annotated[
    bool,
    typer.Option(
        "--detach",
        "-d",
        help="Return once the run started (its start line on every node: every rank past the "
        "rendezvous), or died (exit 1); do not follow the log.",
    ),
]
