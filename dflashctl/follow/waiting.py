"""While a followed run has logged nothing yet (the trainer imports torch, builds its
models), say so: a live `waiting for the first line (N s)` on a terminal, erased when
the first line arrives; nothing anywhere else (a log or a pipe gets only real lines)."""

from __future__ import annotations

import time
from typing import Any

from dflashctl.ui import terminal

# A log that starts within this long needs no notice.
NOTICE_AFTER_S = 1.0


class FirstLineWait:
    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and terminal.interactive()
        self._started = time.monotonic()
        self._status: Any = None
        self._shown = -1

    def tick(self) -> None:
        """Still nothing logged: show or refresh the notice (at most once a second)."""
        if not self.enabled:
            return
        seconds = int(time.monotonic() - self._started)
        if seconds < NOTICE_AFTER_S or seconds == self._shown:
            return
        self._shown = seconds
        text = f"waiting for the first line ({seconds} s)"
        if self._status is None:
            self._status = terminal.err.status(text)
            self._status.start()
        else:
            self._status.update(text)

    def done(self) -> None:
        """The first line came (or the following ended): erase the notice for good."""
        self.enabled = False
        if self._status is not None:
            self._status.stop()
            self._status = None
