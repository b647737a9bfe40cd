"""Following's parts on files the test writes: the log reader's frames (the agent's `log`
verb, through its entry) parsed back in odd-sized pieces, a copied log classified into
how the run ended and the closing word said for it, the detached start gate's
bookkeeping, and the `waiting for the first line` notice."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from dflashctl.agent.logreader import _stream
from dflashctl.agent.main import main as agent_main
from dflashctl.crash import load_rules
from dflashctl.follow import waiting
from dflashctl.follow.reader import FrameParser, ReaderBroken
from dflashctl.follow.report import FollowResult, classify_log, report_result
from dflashctl.follow.start_gate import StartGate
from dflashctl.remote.agent_messages import RunRecord, RunsAnswer
from dflashctl.ui import terminal

LOGS = Path(__file__).parent / "data" / "logs"


def finished_run(workdir: Path, run_id: str, text: bytes) -> None:
    rundir = workdir / "runs" / run_id
    rundir.mkdir(parents=True)
    (rundir / "train.log").write_bytes(text)
    (rundir / "exit_code").write_text("0\n")


def parse_in_pieces(stream: bytes, size: int) -> list[tuple[str, list[int], bytes]]:
    parser = FrameParser()
    frames = []
    for at in range(0, len(stream), size):
        frames += parser.feed(stream[at : at + size])
    return frames


@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_the_readers_frames_give_back_the_log_whatever_the_pieces(tmp_path, piece):
    log = "".join(f"step {i}/50 | loss {i * 0.1:.2f} | é\n" for i in range(50)).encode()
    finished_run(tmp_path, "20260101-120000-ab12", log)
    out = io.BytesIO()
    _stream(out, str(tmp_path), "20260101-120000-ab12", 0, -1, False)
    # a chatty login shell's words come before the reader's magic line
    frames = parse_in_pieces(b"Welcome to the host!\n" + out.getvalue(), piece)
    kinds = [kind for kind, _, _ in frames]
    assert kinds[0] == "S" and kinds[-1] == "E"
    assert frames[0][1] == [0, len(log)]
    assert b"".join(data for kind, _, data in frames if kind == "D") == log


def test_the_reader_starts_from_the_backlog_and_says_a_missing_run(tmp_path):
    finished_run(tmp_path, "R1", b"one\ntwo\nthree\n")
    out = io.BytesIO()
    _stream(out, str(tmp_path), "R1", 0, 9, True)  # 9 bytes back: the partial line is skipped
    frames = FrameParser().feed(out.getvalue())
    assert b"".join(d for k, _, d in frames if k == "D") == b"three\n"

    missing = io.BytesIO()
    _stream(missing, str(tmp_path), "nope", 0, -1, True)
    assert [k for k, _, _ in FrameParser().feed(missing.getvalue())] == ["N"]


def test_output_that_is_not_the_readers_is_refused_with_what_came():
    parser = FrameParser()
    parser.feed(b"DFLASH-LOG 1\n")
    with pytest.raises(ReaderBroken, match="unexpected reader output b'Traceback"):
        parser.feed(b"Traceback (most recent call last):\n")
    with pytest.raises(ReaderBroken, match="no log reader answer"):
        FrameParser().feed(b"x" * 70000)
    missing = FrameParser()
    assert missing.feed(b'{"ok": false, "agent_missing": true}') == []
    assert missing.agent_missing


def test_the_agents_entry_streams_the_log_and_answers_json(tmp_path, capsysbinary):
    finished_run(tmp_path, "R1", b"hello\n")
    params = {"workdir": str(tmp_path), "run_id": "R1", "offset": 0, "backlog": -1, "once": True}
    assert agent_main("log", json.dumps(params)) == 0
    frames = FrameParser().feed(capsysbinary.readouterr().out)
    assert [k for k, _, _ in frames] == ["S", "D", "E"] and frames[1][2] == b"hello\n"

    assert agent_main("launch-rockets", "{}") == 2
    answer = json.loads(capsysbinary.readouterr().out)
    assert answer == {"ok": False, "error": "unknown agent operation 'launch-rockets'"}

    assert agent_main("runs", json.dumps({"workdir": str(tmp_path)})) == 0
    answer = json.loads(capsysbinary.readouterr().out)
    assert answer["ok"] and [run["id"] for run in answer["runs"]] == ["R1"]
    assert answer["runs"][0]["status"] == "exited"
    # the answer has every key the client's message types say it always has
    assert RunsAnswer.__required_keys__ <= answer.keys()
    assert RunRecord.__required_keys__ <= answer["runs"][0].keys()


def classify(name: str, exit_code: int | None) -> FollowResult:
    text = (LOGS / f"{name}.log").read_bytes()
    pieces = [text[at : at + 333] for at in range(0, len(text), 333)]
    sink = Console(file=io.StringIO())
    return classify_log(pieces, rules=load_rules(), exit_code=exit_code, name=name, console=sink)


def test_a_copied_log_is_classified_as_the_run_ended(capsys):
    stopped = classify("trainer-sigterm-stop", 0)
    assert stopped.status == "stopped" and stopped.cli_exit_code == 0
    assert stopped.stop["step"] == 11

    oom = classify("cuda-oom", 1)
    assert oom.status == "crashed" and oom.cli_exit_code == 1
    assert oom.crashes[0].category == "cuda_oom"

    clean = classify("trainer-clean", None)
    assert clean.status == "finished" and clean.crashes == []
    assert report_result(clean) == 0
    said = capsys.readouterr().err
    assert "no crash found in trainer-clean" in said and "--exit-code N" in said


def test_the_closing_word_of_a_crashed_log_names_the_cause(capsys):
    oom = classify("cuda-oom", 1)
    assert report_result(oom) == 1
    said = capsys.readouterr().err
    assert "✗ cuda-oom crashed: " in said and "OutOfMemoryError" in said

    answer = oom.to_json()  # what `logs --file X --json` says of it
    assert answer["status"] == "crashed" and answer["file"] == "cuda-oom"
    assert answer["crashes"][0]["root_cause"] is True


def test_the_start_gate_opens_when_every_node_showed_the_line():
    gate = StartGate(re.compile(r"^rendezvous: "), count=2)
    gate.line(0, "rendezvous: 2 ranks joined")
    assert not gate.cancel.is_set()
    gate.line(1, "[rank1]: rendezvous: 2 ranks joined")  # torchrun's prefix is looked past
    assert gate.all_passed and gate.cancel.is_set()
    gate.ended(1)  # ending after the line is no early end
    assert gate.ended_first == []


def test_a_node_ending_before_the_line_ends_the_wait_and_a_late_timeout_is_not_one():
    gate = StartGate(re.compile(r"^rendezvous: "), count=2)
    gate.line(0, "rendezvous: 2 ranks joined")
    gate.ended(1)
    assert gate.cancel.is_set() and gate.ended_first == [1] and not gate.all_passed
    gate.time_out()
    assert not gate.timed_out

    slow = StartGate(re.compile(r"^rendezvous: "), count=1)
    slow.time_out()
    assert slow.timed_out and slow.cancel.is_set()


def test_the_first_line_notice_shows_on_a_terminal_only(monkeypatch):
    monkeypatch.setattr(terminal, "interactive", lambda: False)
    piped = waiting.FirstLineWait(enabled=True)
    piped.tick()
    assert not piped.enabled

    monkeypatch.setattr(terminal, "interactive", lambda: True)
    clock = [100.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: clock[0])
    wait = waiting.FirstLineWait(enabled=True)
    shown = []

    class Status:
        def __init__(self, text):
            shown.append(text)

        def start(self):
            pass

        def update(self, text):
            shown.append(text)

        def stop(self):
            shown.append("erased")

    monkeypatch.setattr(terminal.err, "status", Status)
    wait.tick()  # at once: nothing yet
    clock[0] += 2.5
    wait.tick()
    wait.tick()  # the same second: not said again
    clock[0] += 1
    wait.tick()
    wait.done()
    wait.tick()  # after the first line: never again
    assert shown == [
        "waiting for the first line (2 s)",
        "waiting for the first line (3 s)",
        "erased",
    ]
