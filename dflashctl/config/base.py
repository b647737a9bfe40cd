"""What every section of dflash.yaml's models shares: strict types with no NaN or
infinity, numbers read as text where they end up on a command line, and paths made
absolute against the config's folder."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, ValidationInfo

from dflashctl.config.errors import invalid


def scalar_text(value: Any) -> Any:
    """true/2/1.5 -> "true"/"2"/"1.5"; anything else is left for the type check."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return value


def texts(value: Any) -> Any:
    # Numbers in an args list are a common slip (`args: [--steps, 100]`).
    return [scalar_text(v) for v in value] if isinstance(value, list) else value


def text_mapping(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): scalar_text(v) for k, v in value.items()}
    return value


TextList = Annotated[list[str], BeforeValidator(texts)]
TextMapping = Annotated[dict[str, str], BeforeValidator(text_mapping)]


def checked(ok: Callable[[Any], Any], message: str, hint: str | None = None) -> AfterValidator:
    """A field's check, written in its type: `message` (its {value} filled in) and `hint`
    when `ok(value)` is false. None (an optional field left null) is not checked."""

    def check(value: Any) -> Any:
        if value is not None and not ok(value):
            raise invalid(message.format(value=value), hint)
        return value

    return AfterValidator(check)


def resolve_path(value: str, info: ValidationInfo) -> str:
    """A path from the file, made absolute against the config's folder (when loading one)."""
    base = (info.context or {}).get("base")
    expanded = Path(value).expanduser()
    if base is None or expanded.is_absolute():
        return os.path.normpath(expanded) if base is not None else value
    return os.path.normpath(base / expanded)


class Section(BaseModel):
    # Defaults go through the validators too: a default path is resolved like a written one.
    # No .nan or .inf anywhere: every comparison with them is false, so a check such as
    # `value < 0` lets them through to a sleep, a timeout or a vmid.
    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
        defer_build=True,
    )
