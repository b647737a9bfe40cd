"""dflashctl init: write a commented dflash.yaml to start from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflashctl import terminal
from dflashctl.config import DEFAULT_CONFIG_NAME
from dflashctl.errors import UsageError
from dflashctl.resources import template_path


def init(
    path: Annotated[
        Path, typer.Argument(help="Where to write the config.", show_default=True)
    ] = Path(DEFAULT_CONFIG_NAME),
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a commented dflash.yaml template to edit."""
    if path.is_dir():
        path = path / DEFAULT_CONFIG_NAME
    if path.exists() and not force:
        raise UsageError(
            f"{path} already exists; not overwriting it",
            hint="pass --force to replace it, or give another path",
        )
    if not path.parent.is_dir():
        raise UsageError(
            f"{path.parent}: no such folder",
            hint="create it first, or give a path in an existing folder",
        )
    text = template_path("dflash.yaml").read_text(encoding="utf-8")
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    terminal.success(f"wrote {path}")
    terminal.info(
        "next: set host.address and container.vmid, then run "
        f"`dflashctl doctor{'' if path.name == DEFAULT_CONFIG_NAME and path.parent == Path('.') else f' -c {path}'}`"
    )


def register(app: typer.Typer) -> None:
    app.command()(init)
