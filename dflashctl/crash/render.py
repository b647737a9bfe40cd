"""A crash as a rich panel: what failed, where, the traceback excerpt and the hint.

Log text is escaped (a traceback may hold "[...]" that rich would read as markup).
Colour is the Console's business: it drops styles when not on a terminal or when
NO_COLOR is set.
"""

from __future__ import annotations

import re

from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from dflashctl.crash.events import CrashEvent

EXCERPT_LINES = 14  # the end of a traceback is what matters; the full log is one command away


def crash_panel(event: CrashEvent) -> Panel:
    role = "root cause" if event.is_root_cause else "consequence"
    style = "red" if event.is_root_cause else "yellow"

    facts = Table.grid(padding=(0, 2))
    facts.add_column(style="bold", no_wrap=True)
    # fold: a long path has no space to wrap at; cut to "…" it would say nothing.
    facts.add_column(overflow="fold")
    facts.add_row("category", escape(event.category))
    if event.rank is not None or event.local_rank is not None:
        rank = "-" if event.rank is None else str(event.rank)
        local = "" if event.local_rank is None else f" (local rank {event.local_rank})"
        facts.add_row("rank", escape(rank + local))
    if event.node:
        facts.add_row("node", escape(event.node))
    if event.host:
        facts.add_row("host", escape(event.host))
    facts.add_row("thread", escape(event.thread or "-"))
    facts.add_row("device", escape(event.device or "-"))
    if event.stage:
        facts.add_row("stage", escape(event.stage))
    if event.exception:
        facts.add_row("exception", escape(event.exception))
    if event.message:
        facts.add_row("message", escape(event.message))
    if event.last_frame:
        facts.add_row("last frame", readable_frame(event.last_frame))
    line_text = (
        f"{event.line}" if event.end_line == event.line else f"{event.line}-{event.end_line}"
    )
    facts.add_row("log line", line_text)

    parts: list = [facts]
    readable = [line for line in event.excerpt if not _is_caret_line(line)]
    if readable:
        shown = readable[-EXCERPT_LINES:]
        excerpt = Text()
        if len(readable) > len(shown):
            excerpt.append(f"... {len(readable) - len(shown)} lines above\n", style="dim")
        excerpt.append("\n".join(shown), style="dim")
        parts += [Text(""), excerpt]
    parts += [Text(""), Text.assemble(("hint: ", "bold"), event.hint)]

    title = f"[bold {style}]crash[/] {escape(event.category)} [dim]({role}, rule {escape(event.rule)})[/]"
    return Panel(Group(*parts), title=title, title_align="left", border_style=style, expand=True)


def render_crash(console: Console, event: CrashEvent) -> None:
    """Print one crash as a panel on `console`."""
    # soft_wrap=False: the terminal facade's consoles soft-wrap by default, which would
    # crop the panel's long lines (the hint) instead of wrapping them inside the border.
    console.print(crash_panel(event), soft_wrap=False)


def readable_frame(frame: str) -> Text:
    """ "/a/long/path/file.py:12 in fn" as "fn in file.py:12" and, dim below it, the
    folder: the part that says where fits on one line at 80 columns."""
    match = FRAME.match(frame)
    if not match:
        return Text(frame)
    path, line, function = match.groups()
    folder, _, name = path.rpartition("/")
    text = Text(f"{name}:{line} in {function}")
    if folder:
        text.append(f"\n{folder}/", style="dim")
    return text


FRAME = re.compile(r"^(.+):(\d+) in (.+)$")


def _is_caret_line(line: str) -> bool:
    """Python 3.11+ underlines the failing expression with ^ and ~; noise in a panel."""
    text = line.strip()
    return bool(text) and set(text) <= set("^~")
