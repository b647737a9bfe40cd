"""torchelastic's error files: where a run puts them, and how they are read back."""

from __future__ import annotations

import json
import subprocess
import sys

from dflashctl.agent.runs import error_file_env
from dflashctl.crash.error_files import (
    READER_PROGRAM,
    parse_error_file,
    read_error_files,
    records_from_reader,
)


def recorded(message: str, stack: str, timestamp: int = 1764630000) -> str:
    return json.dumps(
        {
            "message": {
                "message": message,
                "extraInfo": {"py_callstack": stack, "timestamp": str(timestamp)},
            }
        }
    )


def test_a_run_puts_them_in_its_folder_unless_trainer_env_says_otherwise():
    env = error_file_env({}, "/w/runs/r1")
    assert env == {
        "TORCHELASTIC_ERROR_FILE": "/w/runs/r1/error.json",
        "PET_LOG_DIR": "/w/runs/r1/torchelastic",
    }
    assert error_file_env({"TORCHELASTIC_ERROR_FILE": "/x", "PET_LOG_DIR": "/y"}, "/r") == {}


def test_each_ranks_file_and_the_runs_own_are_read_with_their_local_rank(tmp_path):
    rank_dir = tmp_path / "torchelastic" / "none_ab12" / "attempt_0" / "1"
    rank_dir.mkdir(parents=True)
    stack = 'Traceback (most recent call last):\n  File "t.py", line 1, in m\nRuntimeError: boom\n'
    (rank_dir / "error.json").write_text(recorded("RuntimeError: boom", stack))
    (tmp_path / "error.json").write_text(recorded("RuntimeError: boom", stack))
    own, rank = read_error_files(tmp_path)
    assert own.local_rank is None and own.timestamp == 1764630000
    assert (rank.local_rank, rank.attempt, rank.traceback[-1]) == (1, 0, "RuntimeError: boom")
    # The same files read in a container by the follower's one-round-trip program.
    answer = subprocess.run(
        [sys.executable, "-c", READER_PROGRAM, str(tmp_path)], capture_output=True, text=True
    )
    assert [r.local_rank for r in records_from_reader(answer.stdout)] == [None, 1]


def test_what_is_not_torchelastics_format_is_left_alone():
    assert parse_error_file("e.json", "not json") is None
    assert parse_error_file("e.json", "[1, 2]") is None
    plain = parse_error_file("e.json", json.dumps({"message": "agent failed"}))
    assert plain is not None and plain.traceback == ["agent failed"]
    assert records_from_reader("garbage") == []
