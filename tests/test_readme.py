"""The README starts right and stays short, the layout map (dflashctl/README.md) names
every module and stays within 30 KiB, and every relative link of the READMEs resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LAYOUT_MAP = ROOT / "dflashctl" / "README.md"
MAX_BYTES = 20 * 1024


def test_the_readme_stays_within_20_kib():
    assert len(README.read_bytes()) <= MAX_BYTES


def test_the_package_readme_stays_within_30_kib():
    # Issue 40: a guide a reader can use; figures belong in bench/README.md.
    assert len(LAYOUT_MAP.read_bytes()) <= 30 * 1024


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


def heading_anchors(path: Path) -> set[str]:
    """The #anchors GitHub makes of a markdown file's headings (repeats get -1, -2...)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            anchor = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def test_every_relative_link_in_the_readmes_resolves():
    broken = []
    for readme in (
        README,
        LAYOUT_MAP,
        ROOT / "trainer" / "README.md",
        ROOT / "bench" / "README.md",
    ):
        text = re.sub(r"```.*?```", "", readme.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (readme.parent / file) if file else readme
            if not dest.exists() or (
                anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest)
            ):
                broken.append(f"{readme.relative_to(ROOT)}: {target}")
    assert not broken, f"links that lead nowhere: {broken}"
