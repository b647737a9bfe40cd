"""The crash panel the follower prints, and the --json form of a crash."""

from __future__ import annotations

import io
import json

from rich.console import Console

from dflashctl.crash import CrashEvent, classify_text, load_rules
from dflashctl.crash.render import render_crash

JSON_KEYS = {
    "rule",
    "category",
    "thread",
    "device",
    "stage",
    "exception",
    "message",
    "line",
    "hint",
    "excerpt",
}


def tls_crash() -> CrashEvent:
    lines = [
        "drafter-2 on cuda:7: warming compiled graphs",
        "drafter-2 failed:",
        "Traceback (most recent call last):",
        '  File "/root/dflash/current/train_dflash_pipeline.py", line 988, in _prepare_drafter_thread',
        "    loss, _ = self.drafter(",
        '  File "/usr/lib/python3/site-packages/torch/_inductor/cudagraph_trees.py", line 341, in get_obj',
        "    assert torch._C._is_key_in_tls(attr_name)",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        "AssertionError",
    ]
    [event] = classify_text(lines, 1, load_rules())
    return event


def render(event: CrashEvent, **console_options) -> str:
    buffer = io.StringIO()
    render_crash(Console(file=buffer, width=100, **console_options), event)
    return buffer.getvalue()


def test_the_panel_shows_what_a_user_needs_to_act():
    text = render(tls_crash(), force_terminal=False)
    for needed in (
        "cudagraph_tls",
        "root cause",
        "drafter-2",
        "cuda:7",
        "warming compiled graphs",
        "AssertionError",
        "assert torch._C._is_key_in_tls(attr_name)",
        "cudagraph_trees.py:341 in get_obj",
        "/usr/lib/python3/site-packages/torch/_inductor/",
        "2-9",
        "TLS-safe warm-up",
    ):
        assert needed in text, needed
    assert "^^^^" not in text  # caret lines are noise in a short excerpt


def test_no_colour_off_a_terminal_or_with_no_color(monkeypatch):
    assert "\x1b[" not in render(tls_crash(), force_terminal=False)
    assert "\x1b[31m" in render(tls_crash(), force_terminal=True)
    monkeypatch.setenv("NO_COLOR", "1")
    coloured = render(tls_crash(), force_terminal=True)
    assert "\x1b[31m" not in coloured and "\x1b[33m" not in coloured


def test_log_text_is_not_read_as_markup():
    event = tls_crash()
    event.excerpt.append("[rank0]:[E1129 10:31:07] [bold]watchdog[/bold]")
    assert "[rank0]:[E1129 10:31:07] [bold]watchdog[/bold]" in render(event, force_terminal=False)


def test_consequences_are_labelled_as_such():
    event = tls_crash()
    event.is_root_cause = False
    assert "consequence" in render(event, force_terminal=False)


def test_json_form_has_the_documented_keys():
    data = tls_crash().to_json()
    assert JSON_KEYS <= set(data)
    assert data["category"] == "cudagraph_tls" and data["line"] == 2 and data["root_cause"] is True
    assert json.loads(json.dumps(data)) == data


def test_the_last_frame_stays_readable_at_80_columns():
    """A deep path has no space to wrap at: the file, line and function come first, on
    one line, and the folder under them is folded whole, never cut to "…"."""
    lines = [
        "drafter-0 failed:",
        "Traceback (most recent call last):",
        '  File "/root/dflash/releases/20260101-120000-ab12/dflash/pipeline/'
        'dflash_workload.py", line 412, in drafter_step',
        "    raise RuntimeError('boom')",
        "RuntimeError: boom",
    ]
    [event] = classify_text(lines, 1, load_rules())
    buffer = io.StringIO()
    render_crash(Console(file=buffer, width=80, force_terminal=False), event)
    text = buffer.getvalue()
    assert "dflash_workload.py:412 in drafter_step" in text
    assert "…" not in text
    joined = "".join(line.strip(" │") for line in text.splitlines())
    assert "/root/dflash/releases/20260101-120000-ab12/dflash/pipeline/" in joined
