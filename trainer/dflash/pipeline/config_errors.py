"""The trainer config's YAML with line/column marks, and pydantic's errors as one sentence.

``TrainConfigError`` messages name the source (the file with the line and column of the
key, or the ``--set`` that gave the value), the dotted key path and what is allowed:
``c.yaml, line 2, column 3: unknown key train.stepz (did you mean train.steps?); allowed
under train: ...``. The trainer ships on its own (only torch, transformers, safetensors,
pydantic and PyYAML in the container), so this mirrors dflashctl/config/errors.py
instead of importing it.
"""

from __future__ import annotations

import difflib
import typing
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

KeyPath = tuple[str | int, ...]
_OUR_CHECK = "dflash_train_config"

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
}


class TrainConfigError(ValueError):
    """A user mistake in the trainer config or its overrides."""


def invalid(message: str, *, key: str | tuple[str, ...] | None = None) -> PydanticCustomError:
    """A failed check in a model; ``key`` names a field below the one being checked."""
    keys = (key,) if isinstance(key, str) else tuple(key or ())
    return PydanticCustomError(_OUR_CHECK, "{message}", {"message": message, "keys": keys})


def load_yaml_with_marks(text: str) -> tuple[Any, dict[KeyPath, str]]:
    """The document's data, and "line L, column C" for every key path written in it."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    places: dict[KeyPath, str] = {}

    def record(node: yaml.Node, loc: KeyPath) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = (*loc, key_node.value)
                mark = key_node.start_mark
                places[key] = f"line {mark.line + 1}, column {mark.column + 1}"
                record(value_node, key)

    if node is not None:
        record(node, ())
    return data, places


def key_path(loc: KeyPath) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}" if text else str(part)
    return text


def first_mistake(exc: ValidationError, model: type[BaseModel]) -> tuple[KeyPath, str]:
    """The key path and sentence of the first mistake (unknown keys before the rest)."""
    errors = exc.errors(include_url=False)
    first = min(errors, key=lambda e: e["type"] != "extra_forbidden")
    loc = tuple(first["loc"])
    kind, ctx = first["type"], first.get("ctx") or {}
    if kind == "extra_forbidden":
        parent, key = loc[:-1], str(loc[-1])
        allowed = _field_names(model, parent)
        close = (
            difflib.get_close_matches(key, allowed, n=1)
            or [name for name in allowed if len(key) >= 3 and name.startswith(key)][:1]
        )
        prefix = key_path(parent) + "." if parent else ""
        suggestion = f" (did you mean {prefix}{close[0]}?)" if close else ""
        return loc, (
            f"unknown key {prefix}{key}{suggestion}; allowed under "
            f"{key_path(parent) or 'the top level'}: {', '.join(allowed)}"
        )
    if kind == _OUR_CHECK:
        loc = (*loc, *ctx["keys"])
        return loc, f"{key_path(loc)}: {ctx['message']}" if loc else ctx["message"]
    expected = _EXPECTED.get(kind)
    if expected is None:  # a pydantic check we did not word ourselves
        return loc, f"{key_path(loc)}: {first['msg']}, got {first['input']!r}"
    return loc, f"{key_path(loc)}: expected {expected}, got {first['input']!r}"


def _field_names(model: type[BaseModel], loc: KeyPath) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        current = _model_in(current.model_fields[part].annotation)
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
