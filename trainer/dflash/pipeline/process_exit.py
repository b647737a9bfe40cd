"""How a trainer process ends: its exit status, the error file, and leaving the world.

Exit status: 0 finished (or stopped by SIGTERM after writing a checkpoint), 1 a thread
or the set-up failed (its traceback is in the log), 2 the config is wrong.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

from dflash.pipeline.distributed import World
from dflash.pipeline.error_file import record_exception
from dflash.pipeline.logging import RunLog

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2


def config_error(exc: BaseException, world: World | None = None, *, printed: bool = False) -> int:
    """One ``config error:`` line (unless rank 0 printed it at once), the other ranks told."""
    if not printed:
        print(f"config error: {exc}", file=sys.stderr, flush=True)
    if world is not None:
        world.leave_after_failure(f"config error: {exc}")
    return EXIT_CONFIG


def crashed(world: World, log: RunLog, exc: BaseException) -> NoReturn:
    """The set-up or the end of the run raised: the same report as a thread's failure."""
    log.block("main failed:\n" + traceback.format_exc())
    record_exception(exc)
    world.leave_after_failure(f"main failed: {type(exc).__name__}: {exc}")
    exit_without_teardown(EXIT_FAILED)


def run_status(world: World, result) -> NoReturn:
    """End the process with the status of a run that returned (a run.TrainResult). A
    failed one has logged why and joined its threads (up to run.STOP_GRACE_S); no run ends
    through interpreter teardown (exit_without_teardown says why)."""
    failed = result.exit_code != EXIT_OK or bool(result.stuck_threads)
    if failed:
        world.leave_after_failure()  # the failing thread posted its cause already
    if result.failure is not None:
        record_exception(result.failure)
    if failed:
        exit_without_teardown(result.exit_code or EXIT_FAILED)
    # A clean finish (or a stop with its checkpoint written): the exit handlers run (a
    # tracker's last upload), then the process ends without finalizing the interpreter.
    # A thread torch started in C++ can outlive training, and the C++ runtime's teardown
    # then aborts on it ("terminate called without an active exception", SIGABRT) after
    # "training complete": seen on CPU in the test suite, turning a good run into exit -6.
    atexit._run_exitfuncs()
    exit_without_teardown(result.exit_code)


def exit_without_teardown(code: int) -> NoReturn:
    """Flush and end the process with ``code``, skipping interpreter teardown.

    A thread may still be alive here: stuck in a call we cannot interrupt (a long
    compile), or just finishing inside torch's C++ code after a failure. A normal exit
    finalizes the interpreter under it; the thread is then unwound out of torch's C++
    frames, which ends in "terminate called without an active exception" and SIGABRT
    (exit 134) instead of our status. Nothing is lost by skipping teardown: every log
    line is flushed as it is written and checkpoints are complete (written, then renamed)
    before train() returns.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def recorded(entry: Callable[[], int]) -> Callable[[], int | None]:
    """`entry` under torchelastic's `record`: an exception leaving it is written to the
    error file torchrun names in its root cause (see error_file.py)."""
    try:
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # a torch without torch.distributed
        return entry
    return record(entry)
