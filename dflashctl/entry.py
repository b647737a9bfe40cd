"""The program's entry point (`dflashctl`, `python -m dflashctl`).

Ctrl-C must read the same at every moment: one line, exit status 130. Until the
command line is parsed and a command runs (a few hundred milliseconds of imports:
typer, rich, pydantic, yaml), a KeyboardInterrupt would surface from deep inside
whichever import it struck, with a traceback through importlib. So SIGINT first gets
a handler that says so and leaves at once (nothing has been done yet that needs
undoing); cli.main puts Python's own back before any command runs, whose
KeyboardInterrupt handling undoes or reports what was under way.

Only the standard library is imported here, before the handler is in place.
"""

from __future__ import annotations

import os
import signal
import sys

EXIT_INTERRUPTED = 130  # as dflashctl.errors says, not imported: that is after the handler


def _interrupted_while_starting(signum: int, frame: object) -> None:
    mine = sys.argv[1 : sys.argv.index("--")] if "--" in sys.argv else sys.argv[1:]
    if "--json" in mine:
        # json_output's error envelope, written by hand: nothing more is imported here.
        words = [w for w in mine if not w.startswith("-")]
        command = "runs show" if words[:2] == ["runs", "show"] else (words or [None])[0]
        name = f'"{command}"' if command else "null"
        os.write(
            1,
            (
                f'{{"schema_version":1,"command":{name},"nodes":[],"error":"interrupted",'
                '"exit_code":130,"hint":null}\n'
            ).encode(),
        )
    os.write(2, b"interrupted\n")
    os._exit(EXIT_INTERRUPTED)


def _say_early_interrupts() -> None:
    signal.signal(signal.SIGINT, _interrupted_while_starting)


# At import, not only in main(): `python -m dflashctl` and the console script import
# this module first, and the moment it is imported the handler is in place (a test
# that sees the import end may send SIGINT at once). What Python runs before this
# (its own start-up, site and any .pth file, runpy) is outside our reach: `make
# install` installs dflashctl in a mode whose .pth file imports nothing.
_say_early_interrupts()


def _interrupted_while_ending(signum: int, frame: object) -> None:
    # The command is over (its answer said, its exit status chosen); what is left is
    # Python's teardown: joining threads, closing connections. A KeyboardInterrupt
    # there would end the process by the signal, with a traceback from threading.
    try:
        sys.stdout.flush()
    except Exception:  # a closed or broken stdout: nothing more can be said there
        pass
    os.write(2, b"interrupted (after the command had finished)\n")
    os._exit(EXIT_INTERRUPTED)


def main() -> None:
    _say_early_interrupts()
    from dflashctl.ops import early_upload

    early_upload.start(sys.argv[1:])  # a redeploy's upload starts while the CLI imports
    from dflashctl.cli import main as run

    try:
        run()
    finally:
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, _interrupted_while_ending)
