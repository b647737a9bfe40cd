"""How the logic says what it is doing without printing anything.

deploy, restart and the other long commands are logic: they return data (the JSON
summary) and hand what a user watching would want to see, as it happens, to the
`Reporter` their caller gives them. This class is the silent one (a script or a test
calling the logic directly); the commands pass the terminal's (ui/terminal.py's
TerminalReporter), which draws spinners, progress bars and step lines. So the logic
never imports the terminal, and one deploy has one place that decides how it looks.

Every method may be called from any thread: work on several nodes runs in threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class Reporter:
    """Says nothing, asks nobody."""

    @contextlib.contextmanager
    def step(self, message: str) -> Iterator[dict]:
        """A step that takes a while; the caller may set the finished line as
        `result["done"]`."""
        yield {"done": message}

    def done(self, message: str, seconds: float) -> None:
        """A step finished, and how long it took."""

    def info(self, message: str) -> None:
        """A detail under the last step."""

    def warning(self, message: str) -> None:
        """Something went wrong that did not stop the command."""

    def busy(self, message: str) -> contextlib.AbstractContextManager:
        """Something is under way whose end is reported by a `done` after it."""
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def transfer(self, total: int, message: str, then: str) -> Iterator[Callable[[int], None]]:
        """`total` bytes going out: yields `sent(n)`; `then` is what the other side does
        once all of them arrived."""
        yield lambda n: None

    def output(self, label: str, line: str) -> None:
        """One line of a command's output in the container (pip, during setup);
        `label` names the node on several nodes."""

    def confirm(self, question: str) -> bool | None:
        """Ask the user; None when there is nobody to ask."""
        return None


SILENT = Reporter()
