"""Print the declared minimum of every dependency in pyproject.toml, pinned
(`typer>=0.13` -> `typer==0.13`), one per line: what `make test-min` installs.

pyproject.toml is read with a regex, not tomllib: Python 3.10 (the oldest supported)
has no tomllib, and the `dependencies` list is plain strings.
"""

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def minimum_pins(text: str) -> list[str]:
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    if block is None:
        sys.exit("min_pins: no dependencies list in pyproject.toml")
    pins = []
    without_comments = re.sub(r"#[^\n]*", "", block.group(1))
    for spec in re.findall(r'"([^"]+)"', without_comments):
        found = re.fullmatch(r"([A-Za-z0-9_.\[\]-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)(?:,.*)?", spec)
        if found is None:
            sys.exit(f"min_pins: {spec!r} declares no minimum (name>=version)")
        pins.append(f"{found.group(1)}=={found.group(2)}")
    return pins


def check_installed(pins: list[str]) -> None:
    """`--check`, run by the test venv's python: each is installed at its minimum."""
    from importlib.metadata import PackageNotFoundError, version

    wrong = []
    for pin in pins:
        name, wanted = pin.split("==")
        try:
            got = version(name)
        except PackageNotFoundError:
            got = "missing"
        if got.split("+")[0] not in (wanted, wanted + ".0", wanted + ".0.0"):
            wrong.append(f"{name} {got} (declared minimum {wanted})")
    if wrong:
        sys.exit("not at the declared minimum: " + ", ".join(wrong))
    print("at the declared minimum: " + ", ".join(pins))


if __name__ == "__main__":
    pins = minimum_pins(PYPROJECT.read_text())
    if sys.argv[1:] == ["--check"]:
        check_installed(pins)
    else:
        print("\n".join(pins))
