"""dflashctl init: write a commented dflash.yaml to start from."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflashctl.config.schema import DEFAULT_CONFIG_NAME
from dflashctl.errors import UsageError
from dflashctl.resources import project_root, template_path
from dflashctl.ui import terminal


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
    # The built-in crash rules where this installation has them (a pip install has no
    # templates/ folder of its own).
    rules = template_path("crash_patterns.yaml")
    text = text.replace("templates/crash_patterns.yaml", str(rules))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    terminal.success(f"wrote {path}")
    bundled = project_root() / "trainer"
    if (bundled / "train_dflash_pipeline.py").is_file():
        source = (
            f"trainer.source: the folder deployed; the bundled trainer is {bundled} "
            "(a relative path is read from the config file's folder)"
        )
    else:
        source = (
            "trainer.source: the folder deployed; this installation has no trainer of its "
            "own: point it at yours, or at trainer/ of a dflashctl checkout (git clone) "
            "for the bundled one"
        )
    terminal.info("next, set:")
    terminal.info("  host.address and container.vmid: the Proxmox host and the LXC container")
    terminal.info(f"  {source}")
    terminal.info(
        "  container.python: the container's interpreter with torch and the trainer's "
        "packages (e.g. /opt/dflash/bin/python; README: Torch and the trainer's packages)"
    )
    where = "" if path.name == DEFAULT_CONFIG_NAME and path.parent == Path(".") else f" -c {path}"
    terminal.info(f"then run `dflashctl doctor{where}`")


def register(app: typer.Typer) -> None:
    app.command()(init)
