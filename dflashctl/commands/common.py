"""Options shared by several commands."""

from __future__ import annotations

from typing import Annotated

import typer

ConfigOption = Annotated[
    str | None,
    typer.Option(
        "--config",
        "-c",
        help="Path to dflash.yaml (default: $DFLASHCTL_CONFIG, then ./dflash.yaml).",
        show_default=False,
    ),
]
JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON object on stdout instead of text.")
]
