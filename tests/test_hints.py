"""Suggested commands carry the --config the user gave, so they can be pasted."""

from __future__ import annotations

import subprocess
import sys

from dflashctl import hints


def test_command_adds_an_explicit_config_only():
    hints.remember_config(None)
    assert hints.command("runs") == "`dflashctl runs`"
    hints.remember_config("templates/my demo.yaml")
    assert hints.command("logs -f r1") == "`dflashctl logs -f r1 -c 'templates/my demo.yaml'`"
    hints.remember_config(None)


def test_cli_hint_repeats_the_config_flag(tmp_path):
    config = tmp_path / "local.yaml"
    config.write_text(
        "host:\n  address: local\ncontainer:\n  vmid: null\n  workdir: work\n"
        "trainer:\n  source: .\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "dflashctl", "logs", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"`dflashctl deploy -c {config}`" in result.stderr
