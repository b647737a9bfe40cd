"""YAML text as plain data plus where each key and value was written (line, column).

A config checker reports a mistake against a key path such as ``host.port``; this module
keeps the marks of the YAML nodes so the message can also say where in the file that
key is, which is what a reader of a long config needs to find it.

A dflash.yaml often comes from someone else's repository, so the text is read as
hostile: PyYAML's safe loader still expands aliases (nine levels of eight aliases in
ten lines are 8**9 values), composes nesting recursively (20,000 ``[`` end in a
RecursionError) and keeps the last of two equal keys. Here the file's size, its
nesting depth, its number of aliases and the number of values its aliases expand to
are bounded before anything is built from it, each refusal naming the line, and a key
written twice in one mapping is reported with both lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

KeyPath = tuple[str | int, ...]

# Far above any real config (the bundled template is 5 KB, 6 levels deep, no aliases).
MAX_FILE_BYTES = 256 << 10  # PyYAML's pure-Python scanner reads about 350 KB/s
MAX_DEPTH = 64
MAX_ALIASES = 256
MAX_VALUES = 100_000  # scalars and collections, each alias counted as what it expands to

_MERGE_TAG = "tag:yaml.org,2002:merge"
# More flow openers in a row than MAX_DEPTH: refused before PyYAML's scanner, which
# looks up to 1,024 characters ahead at every `[` (a second for 20,000 of them).
_FLOW_RUN = re.compile(r"(?:[\[{][ \t]*){" + str(MAX_DEPTH + 1) + "}")


@dataclass(frozen=True)
class Place:
    line: int  # 1-based, as editors count
    column: int  # 1-based

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}"


@dataclass(frozen=True)
class DuplicateKey:
    loc: KeyPath  # the key's path
    first: Place
    again: Place


@dataclass
class YamlSource:
    data: Any
    values: dict[KeyPath, Place] = field(default_factory=dict)  # where each value starts
    keys: dict[KeyPath, Place] = field(default_factory=dict)  # where each mapping key is
    duplicates: list[DuplicateKey] = field(default_factory=list)

    def place(self, loc: KeyPath, *, key: bool = False) -> Place | None:
        """The place of ``loc`` (its key when ``key``), else of its nearest written parent."""
        table = self.keys if key else self.values
        if loc in table:
            return table[loc]
        for end in range(len(loc) - 1, 0, -1):
            if loc[:end] in self.values:
                return self.values[loc[:end]]
        return None


class YamlRefused(yaml.MarkedYAMLError):
    """The text is well-formed but past one of the limits above (a bomb, or a mistake)."""

    def __init__(self, problem: str, mark: yaml.Mark | None, hint: str) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.hint = hint


class _BoundedLoader(yaml.SafeLoader):
    """The safe loader, with a value that Python cannot build (a 5,000-digit integer, a
    31st of February) reported at its own line like any other YAML mistake."""

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError, TypeError, ArithmeticError) as exc:
            raise yaml.constructor.ConstructorError(
                None, None, f"cannot read this value: {exc}", node.start_mark
            ) from None

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        # An alias composes to its anchor's node; keep where the alias itself is written.
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            self.alias_uses.append((node, mark))
            return node
        return super().compose_node(parent, index)


def load_yaml(text: str) -> YamlSource:
    """Parse one YAML document safely within the limits above; raises yaml.YAMLError
    (YamlRefused for a limit) like yaml.safe_load would for malformed text."""
    _check_size(text)
    _check_events(text)
    loader = _BoundedLoader(text)
    loader.alias_uses = []
    try:
        node = loader.get_single_node()
        source = YamlSource(None)
        if node is not None:
            _check_expansion(node, loader.alias_uses)
            # Before construction: merge keys (<<) are flattened into the nodes then.
            _record(node, source)
            source.data = loader.construct_document(node)
    finally:
        loader.dispose()
    return source


def _check_size(text: str) -> None:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_FILE_BYTES:
        line = text[:MAX_FILE_BYTES].count("\n")
        raise YamlRefused(
            f"the file is {size:,} bytes, more than the {MAX_FILE_BYTES:,} a config may have",
            yaml.Mark("", MAX_FILE_BYTES, line, 0, None, None),
            "a dflash.yaml is a few kilobytes; is this the right file?",
        )


def _check_events(text: str) -> None:
    """Depth and alias count, from the parser's events (a loop, not a recursion), so
    that the recursive composer only ever sees a shallow document."""
    run = _FLOW_RUN.search(text)
    if run:
        line = text.count("\n", 0, run.start())
        column = run.start() - (text.rfind("\n", 0, run.start()) + 1)
        raise YamlRefused(
            f"nested more than {MAX_DEPTH} levels deep",
            yaml.Mark("", run.start(), line, column, None, None),
            "a dflash.yaml needs a few levels; check the brackets and indentation",
        )
    depth = 0
    aliases = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise YamlRefused(
                    f"nested more than {MAX_DEPTH} levels deep",
                    event.start_mark,
                    "a dflash.yaml needs a few levels; check the brackets and indentation",
                )
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        elif isinstance(event, yaml.AliasEvent):
            aliases += 1
            if aliases > MAX_ALIASES:
                raise YamlRefused(
                    f"more than {MAX_ALIASES} aliases (*name)",
                    event.start_mark,
                    "write the values out, or use fewer aliases",
                )


def _check_expansion(root: yaml.Node, alias_uses: list[tuple[yaml.Node, yaml.Mark]]) -> None:
    """Refuse a document whose aliases expand to more than MAX_VALUES values, or that
    holds itself. Each node is sized once (an alias is the same node object as its
    anchor), so this takes time linear in the text, whatever the aliases expand to."""
    sizes: dict[int, int] = {}
    in_progress: set[int] = set()
    # Iterative post-order walk: (node, children done?)
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        ident = id(node)
        children = _children(node)
        if done:
            total = 1 + sum(sizes[id(child)] for child in children)
            sizes[ident] = min(total, MAX_VALUES + 1)
            in_progress.discard(ident)
            continue
        if ident in sizes:
            continue
        if ident in in_progress:
            raise YamlRefused(
                "an alias refers to the collection it is written in",
                node.start_mark,
                "a config cannot contain itself; write the value out",
            )
        in_progress.add(ident)
        stack.append((node, True))
        for child in children:
            if id(child) in in_progress:
                raise YamlRefused(
                    "an alias refers to the collection it is written in",
                    _alias_mark(child, alias_uses),
                    "a config cannot contain itself; write the value out",
                )
            if id(child) not in sizes:
                stack.append((child, False))
    if sizes[id(root)] > MAX_VALUES:
        biggest = max(alias_uses, key=lambda use: sizes.get(id(use[0]), 0), default=None)
        raise YamlRefused(
            f"its aliases expand to more than {MAX_VALUES:,} values",
            biggest[1] if biggest else root.start_mark,
            "an alias repeats what its anchor holds; write the values out, or use fewer",
        )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _alias_mark(node: yaml.Node, alias_uses: list[tuple[yaml.Node, yaml.Mark]]) -> yaml.Mark:
    """Where the first alias of ``node`` is written (the node's own mark is its anchor's)."""
    return next((mark for used, mark in alias_uses if used is node), node.start_mark)


def _record(root: yaml.Node, source: YamlSource) -> None:
    """Places of every key and value, each node walked once: a value reached through an
    alias takes the alias's place and its contents are not walked again (they are
    reported, if wrong, at the nearest written parent)."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, KeyPath]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        source.values[loc] = _place(node.start_mark)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first_at: dict[tuple[str, str], Place] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
                    continue
                key = key_node.value
                here = _place(key_node.start_mark)
                ident = (key_node.tag, key)
                if ident in first_at:
                    source.duplicates.append(DuplicateKey((*loc, key), first_at[ident], here))
                else:
                    first_at[ident] = here
                source.keys[(*loc, key)] = here
                stack.append((value_node, (*loc, key)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                stack.append((item, (*loc, i)))


def _place(mark: yaml.Mark) -> Place:
    return Place(mark.line + 1, mark.column + 1)
