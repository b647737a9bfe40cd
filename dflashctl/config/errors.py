"""pydantic's validation errors as dflashctl's one-sentence ConfigErrors.

Each message names the file, the place in it (line, column), the dotted key path and
what is allowed: ``dflash.yaml, line 3, column 3: unknown key host.adress (did you mean
host.address?)``. Checks written in the models raise ``invalid(...)``, which carries the
sentence (and a hint) through pydantic unchanged.
"""

from __future__ import annotations

import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from dflashctl.config.yaml_source import KeyPath, Place, YamlSource
from dflashctl.errors import ConfigError

_OUR_CHECK = "dflash_config"

# pydantic's error type -> what the value should have been.
_EXPECTED = {
    "bool_type": "true or false",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "finite_number": "a finite number (not .nan or .inf)",
}


@dataclass(frozen=True)
class Problem:
    """One mistake in the file: where, what, and what to do."""

    place: Place | None
    text: str
    hint: str | None = None


def config_error(path: Path, problems: list[Problem]) -> ConfigError:
    """Every mistake at once, in the order of the file (one per line of the message);
    a file with one mistake reads as it always has: `file, line, column: what`."""
    unique = _once_per_place(list(dict.fromkeys(problems)))
    unique.sort(key=lambda p: (p.place is None, p.place.line if p.place else 0))
    sentences = [f"{path}, {p.place}: {p.text}" if p.place else f"{path}: {p.text}" for p in unique]
    if len(unique) == 1:
        return ConfigError(sentences[0], hint=unique[0].hint)
    # Several: each with what to do about it, under one heading.
    lines = [f"{path}: {len(unique)} mistakes"]
    for sentence, problem in zip(sentences, unique, strict=True):
        lines.append(f"  {sentence}")
        if problem.hint:
            lines.append(f"    hint: {problem.hint}")
    return ConfigError("\n".join(lines))


_NODE_PREFIX = re.compile(r"nodes\[\d+\]\.")


def _once_per_place(problems: list[Problem]) -> list[Problem]:
    """A mistake in a section every node inherits comes back once per node, at the line
    the top level wrote it (`nodes[0].host.addreso`, `nodes[1].host.addreso`,
    `host.addreso`): said once, as the top level's (else the first node's)."""
    kept: dict[tuple[Any, ...], Problem] = {}
    for problem in problems:
        if problem.place is None:  # (nothing says where: not known to be the same)
            kept[(id(problem),)] = problem
            continue
        same = (problem.place, _NODE_PREFIX.sub("", problem.text))
        if same not in kept or ("nodes[" in kept[same].text and "nodes[" not in problem.text):
            kept[same] = problem
    return list(kept.values())


def duplicate_problems(source: YamlSource) -> list[Problem]:
    """A key written twice in one mapping: YAML would keep the second silently."""
    return [
        Problem(
            dup.again,
            f"{key_path(dup.loc)} is written twice, at line {dup.first.line} and "
            f"line {dup.again.line}",
            "keep one of them (YAML would silently use the last)",
        )
        for dup in source.duplicates
    ]


def invalid(
    message: str, hint: str | None = None, *, key: str | tuple[str, ...] | None = None
) -> PydanticCustomError:
    """A failed check in a model; ``key`` names a field below the one being checked."""
    keys = (key,) if isinstance(key, str) else tuple(key or ())
    return PydanticCustomError(
        _OUR_CHECK, "{message}", {"message": message, "hint": hint, "keys": keys}
    )


def describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


def key_path(loc: KeyPath) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def problems(exc: ValidationError, model: type[BaseModel], source: YamlSource) -> list[Problem]:
    return [_problem(error, model, source) for error in exc.errors(include_url=False)]


def _problem(first: Any, model: type[BaseModel], source: YamlSource) -> Problem:
    loc = tuple(first["loc"])
    kind, ctx = first["type"], first.get("ctx") or {}
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        allowed = _field_names(model, parent)
        # A near spelling, else a longer key that starts with this one (keep -> keep_releases).
        close = (
            difflib.get_close_matches(key, allowed, n=1)
            or [name for name in allowed if len(key) >= 3 and name.startswith(key)][:1]
        )
        prefix = key_path(parent) + "." if parent else ""
        suggestion = f" (did you mean {prefix}{close[0]}?)" if close else ""
        text = f"unknown key {prefix}{key}{suggestion}"
        hint = f"allowed keys in {key_path(parent) or 'the top level'}: {', '.join(allowed)}"
        return Problem(source.place(loc, key=True), text, hint)
    if kind == "missing":
        parent = loc[:-1]
        text = f"missing required value {key_path(loc)}"
        hint = (
            f"add `{loc[-1]}:` under `{key_path(parent)}`"
            if parent
            else f"add a `{loc[-1]}:` section"
        )
        return Problem(source.place(parent) if parent else None, text, hint)
    if kind == _OUR_CHECK:
        loc = (*loc, *ctx["keys"])
        return Problem(source.place(loc), f"{key_path(loc)}: {ctx['message']}", ctx.get("hint"))
    # A pydantic check: what it expected in our words, else in its own.
    expected = f"expected {_EXPECTED[kind]}" if kind in _EXPECTED else first["msg"]
    return Problem(
        source.place(loc), f"{key_path(loc)}: {expected}, got {describe(first['input'])}"
    )


def _field_names(model: type[BaseModel], loc: KeyPath) -> list[str]:
    """The keys allowed in the mapping at ``loc`` below ``model``."""
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        annotation = current.model_fields[part].annotation
        current = _model_in(annotation)
        if current is None:
            return []
    return list(current.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
