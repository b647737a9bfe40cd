"""dflash.yaml's `setup:` section: what is installed into the run's virtual environment
in the container before the trainer starts (dflashctl/ops/setup_env.py does it).

    setup:
      requirements: requirements.txt   # inside trainer.source; installed if it exists
      pip_args: [--no-index, --find-links, wheels]
      commands: ["python -m pip install -e ."]   # shell lines, run in the venv

Kept out of schema.py so that the config's main module stays small; a Section like the
others (strict types, unknown keys refused).
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated

from pydantic import Field, field_validator

from dflashctl.config.base import Section, checked
from dflashctl.config.errors import invalid

DEFAULT_REQUIREMENTS = "requirements.txt"


class SetupConfig(Section):
    # A pip requirements file inside trainer.source (travels with the release);
    # null: none. The default is used only when the file exists.
    requirements: str | None = DEFAULT_REQUIREMENTS
    # Shell lines run after the requirements, in the release folder, with the venv's
    # bin/ first on PATH (e.g. `pip install -e .`, a build step).
    commands: list[str] = Field(default_factory=list)
    # Extra pip options for the requirements (an index, --find-links, --no-index).
    pip_args: list[str] = Field(default_factory=list)
    # The longest the whole setup may take in the container.
    timeout_s: Annotated[
        float, checked(lambda v: v > 0, "must be more than 0 seconds, got {value}")
    ] = 3600.0

    @field_validator("requirements")
    @classmethod
    def _requirements(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = PurePosixPath(value)
        if not value.strip() or path.is_absolute() or ".." in path.parts:
            raise invalid(
                f"expected a file inside trainer.source, got {value!r}",
                "e.g. requirements.txt, or null for none",
            )
        return value

    @field_validator("commands")
    @classmethod
    def _commands(cls, value: list[str]) -> list[str]:
        for index, line in enumerate(value):
            if not line.strip():
                raise invalid("an empty command", "remove it or write the command", key=str(index))
        return value
