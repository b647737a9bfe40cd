"""YAML text as plain data plus where each key and value was written (line, column).

A config checker reports a mistake against a key path such as ``host.port``; this module
keeps the marks of the YAML nodes so the message can also say where in the file that
key is, which is what a reader of a long config needs to find it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import yaml

KeyPath = tuple[str | int, ...]


@dataclass(frozen=True)
class Place:
    line: int  # 1-based, as editors count
    column: int  # 1-based

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}"


@dataclass
class YamlSource:
    data: Any
    values: dict[KeyPath, Place] = field(default_factory=dict)  # where each value starts
    keys: dict[KeyPath, Place] = field(default_factory=dict)  # where each mapping key is

    def place(self, loc: KeyPath, *, key: bool = False) -> Place | None:
        """The place of ``loc`` (its key when ``key``), else of its nearest written parent."""
        table = self.keys if key else self.values
        if loc in table:
            return table[loc]
        for end in range(len(loc) - 1, 0, -1):
            if loc[:end] in self.values:
                return self.values[loc[:end]]
        return None


def load_yaml(text: str) -> YamlSource:
    """Parse one YAML document safely; raises yaml.YAMLError like yaml.safe_load."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        data = loader.construct_document(node) if node is not None else None
    finally:
        loader.dispose()
    source = YamlSource(data)
    if node is not None:
        _record(node, (), source)
    return source


def _record(node: yaml.Node, loc: KeyPath, source: YamlSource) -> None:
    source.values[loc] = _place(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            key = key_node.value
            source.keys[(*loc, key)] = _place(key_node.start_mark)
            _record(value_node, (*loc, key), source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record(item, (*loc, i), source)


def _place(mark: yaml.Mark) -> Place:
    return Place(mark.line + 1, mark.column + 1)
