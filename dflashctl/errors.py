"""Errors a user can act on, each mapped to the exit code scripts rely on.

Every command exits with one of:
  0 success, 1 the run crashed, 2 usage or config error,
  3 host / SSH / container error, 130 interrupted.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USAGE = 2
EXIT_HOST = 3
EXIT_INTERRUPTED = 130


class DflashError(Exception):
    """Base of every error dflashctl reports as one plain sentence (plus a hint)."""

    exit_code = EXIT_CRASH

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(DflashError):
    """The command line or the local input is wrong; nothing was contacted."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """dflash.yaml is missing or invalid; the message names the file and key path."""


class HostError(DflashError):
    """The host, the SSH connection, Proxmox or the container failed us."""

    exit_code = EXIT_HOST


class Notice(UserWarning):
    """Something the user should know that stops nothing (the CLI says it as a `!`
    line); logic modules raise it with `warnings.warn` since they do not draw."""


class RunCrashed(DflashError):
    """The training run ended badly (crash detected, non-zero exit or a signal)."""

    exit_code = EXIT_CRASH
