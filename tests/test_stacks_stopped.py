"""`stacks` on a run whose process is stopped (SIGSTOP, Ctrl-Z, a debugger): it says so,
state T, and how to continue it, not that its Python holds the GIL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from dflashctl.agent.stacks import op_stacks, process_state
from dflashctl.commands.stacks import print_answer

RUN_ID = "20261204-000000-stop"


def test_a_stopped_rank_is_said_to_be_stopped_with_how_to_continue_it(tmp_path, capsys):
    run_dir = tmp_path / "work" / "runs" / RUN_ID
    (run_dir / "stacks").mkdir(parents=True)
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "DFLASH_RUN_ID": RUN_ID},
    )
    try:
        (run_dir / "pid").write_text(f"{sleeper.pid}\n")
        (run_dir / "stacks" / "rank0.pid").write_text(
            json.dumps({"rank": 0, "pid": sleeper.pid, "host": "here"})
        )
        os.kill(sleeper.pid, signal.SIGSTOP)
        os.waitpid(sleeper.pid, os.WUNTRACED)  # stopped for certain
        assert process_state(sleeper.pid) == "T"
        answer = op_stacks({"workdir": str(tmp_path / "work"), "run_id": RUN_ID, "wait_s": 0.3})
        assert answer["missing"] == [0]
        assert answer["stopped"] == {"0": sleeper.pid}
        answer.update(where="this machine", flight_recorder_summary=None)
        print_answer(answer)
        said = " ".join(capsys.readouterr().err.split())
        assert "is stopped (state T" in said, said
        assert f"kill -CONT {sleeper.pid}" in said
        assert "GIL" not in said
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_running_rank_that_does_not_answer_is_not_called_stopped(tmp_path):
    assert process_state(os.getpid()) in "RS"
    assert process_state(2**22 + 12345) == "?"  # no such process
