"""The README starts right and stays short, and the layout map (dflashctl/README.md)
names every module."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAYOUT_MAP = ROOT / "dflashctl" / "README.md"
MAX_BYTES = 20 * 1024


def test_the_readme_stays_within_20_kib():
    assert len(README.read_bytes()) <= MAX_BYTES


def test_the_readme_opens_with_what_it_is_and_the_two_commands():
    text = README.read_text()
    lines = text.splitlines()
    assert lines[0] == "# dflashctl"
    assert lines[2].startswith("dflashctl ") and lines[3].startswith("DFlash is ")
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    # The CPU wheel index is PyTorch's, not a placeholder.
    assert "--index-url https://download.pytorch.org/whl/cpu" in text
    assert "<that index>" not in text + makefile


def layout_entries() -> list[str]:
    block = LAYOUT_MAP.read_text().split("### Layout", 1)[1].split("```", 2)[1]
    entries: list[str] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        if line.startswith(" ") and entries:
            entries[-1] += " " + line.strip()
        else:
            entries.append(line.strip())
    return entries


def named(module: Path, entries: list[str]) -> bool:
    rel = module.relative_to(ROOT).as_posix()
    folder, stem = rel.rsplit("/", 1)[0] + "/", module.stem
    word = re.compile(rf"(?<![\w/]){re.escape(stem)}(?:\.py)?(?!\w)")
    for entry in entries:
        head = entry.split()[0].rstrip(",")
        if rel in entry:
            return True
        # A folder's entry (`dflashctl/agent/  main verbs ...`), or a module's entry in
        # the same folder naming its neighbours (`dflashctl/runs/records.py ... run_summary`).
        same_folder = head == folder or (
            head.startswith(folder) and "/" not in head[len(folder) :].rstrip("/")
        )
        if same_folder and word.search(entry):
            return True
    return False


def test_the_layout_map_names_every_module():
    entries = layout_entries()
    modules = [
        path
        for top in ("dflashctl", "trainer")
        for path in sorted((ROOT / top).rglob("*.py"))
        if path.name != "__init__.py"
        and "__pycache__" not in path.parts
        and "configs" not in path.parts
    ]
    missing = [m.relative_to(ROOT).as_posix() for m in modules if not named(m, entries)]
    assert not missing, f"add these to the layout map in dflashctl/README.md: {missing}"
