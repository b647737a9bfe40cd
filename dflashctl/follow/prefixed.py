"""Output of the nodes' followers on one terminal: with several nodes every line prefixed
with its node (`gpu-a | `, aligned, a colour per node), written whole under one lock so that
threads never interleave within a line (nor within a crash panel: rich writes a
panel in one piece).
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable

from rich.console import Console
from rich.text import Text

from dflashctl.remote.nodes import names_each_node

# One lock for everything the followers of one command print.
OUTPUT_LOCK = threading.RLock()
NODE_COLOURS = ("cyan", "magenta", "green", "blue", "yellow", "bright_cyan", "bright_magenta")
MIN_WIDTH = 40


def node_consoles(base: Callable[[], Console], names: list[str]) -> list[Console]:
    """A console per node: `base()` itself for one node, else one prefixing each line
    with its node (`gpu-a   | `, aligned on the longest name)."""
    if not names_each_node(names):
        return [base()]
    width = max(len(name) for name in names)
    return [
        prefixed_console(base, f"{name.ljust(width)} | ", index) for index, name in enumerate(names)
    ]


class _PrefixedFile(io.TextIOBase):
    """A file for a rich Console: whole lines, each prefixed, onto another console's file."""

    def __init__(self, base: Callable[[], Console], prefix: str) -> None:
        super().__init__()
        self._base = base
        self._prefix = prefix
        self._partial = ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._partial += text
        if "\n" in self._partial:
            *lines, self._partial = self._partial.split("\n")
            block = "".join(f"{self._prefix}{line}\n" for line in lines)
            with OUTPUT_LOCK:
                file = self._base().file
                file.write(block)
                file.flush()
        return len(text)

    def flush(self) -> None:
        pass  # a line goes out when it is complete

    def isatty(self) -> bool:
        return self._base().is_terminal


def prefixed_console(base: Callable[[], Console], name_prefix: str, index: int) -> Console:
    """A Console whose every line goes to `base()`'s file with `name_prefix` in front,
    coloured like `base()` would colour it. `base` is asked at each write: --json turns
    terminal.out to stderr after the import."""
    real = base()
    styled = _styled(name_prefix, NODE_COLOURS[index % len(NODE_COLOURS)], real)
    return Console(
        file=_PrefixedFile(base, styled),
        width=max(real.width - len(name_prefix), MIN_WIDTH),
        force_terminal=real.is_terminal,
        color_system=real.color_system,  # type: ignore[arg-type]
        no_color=real.no_color,
        highlight=False,
        soft_wrap=True,
    )


def _styled(text: str, style: str, like: Console) -> str:
    """`text` in `style` as `like` would print it (plain when it prints no colour)."""
    capture = Console(
        file=io.StringIO(),
        force_terminal=like.is_terminal,
        color_system=like.color_system,  # type: ignore[arg-type]
        no_color=like.no_color,
        width=len(text) + 10,
    )
    capture.print(Text(text, style=style), end="")
    return capture.file.getvalue()  # type: ignore[attr-defined]
