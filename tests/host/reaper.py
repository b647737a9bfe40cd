"""Run a command as a child subreaper, and clean up everything it left behind.

    python reaper.py -- sshd -D -e -f sshd_config

Sessions on the test host start detached processes (container sandboxes, runs started with
setsid) that outlive the session that started them. Orphans are adopted by the nearest
subreaper; without one they go to pid 1, which on some machines never reaps them. As a
subreaper this process reaps them all, and once the command exits (SIGTERM is passed on to
it) it kills whatever is still left, so that nothing started by the tests survives them.
If its own parent (the test process) dies without stopping it, it gets SIGTERM and does
the same.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.append(int(entry))
    return found


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--":
        argv = argv[1:]
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        sys.stderr.write("reaper: prctl(PR_SET_CHILD_SUBREAPER) failed\n")
        return 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the line above
        return 1
    main_pid = os.fork()
    if main_pid == 0:
        try:
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)

    def forward(signum, _frame):
        try:
            os.kill(main_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while True:
        try:
            pid, wait_status = os.wait()
        except InterruptedError:
            continue
        except ChildProcessError:
            break
        if pid == main_pid:
            status = os.waitstatus_to_exitcode(wait_status)
            break
    # The command is gone: kill what is left. Killing one orphan can hand us its children
    # (a sandbox's pid 1 when its monitor dies), so repeat until there are none.
    while True:
        for pid in _children(os.getpid()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.wait()
        except ChildProcessError:
            break
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
