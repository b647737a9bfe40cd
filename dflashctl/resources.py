"""Where the files shipped with dflashctl live (templates/, the bundled trainer/)."""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def project_root() -> Path:
    """The checkout (or editable install) that holds templates/ and trainer/."""
    return _PACKAGE_DIR.parent


def template_path(name: str) -> Path:
    """A file under templates/, e.g. template_path("crash_patterns.yaml")."""
    for base in (project_root() / "templates", _PACKAGE_DIR / "_templates"):
        candidate = base / name
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"dflashctl template {name!r} is missing from this installation")
