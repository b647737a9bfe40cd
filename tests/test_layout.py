"""The layout the code promises (dflashctl/README.md): packages by concern with a small
root, no import circles, small modules, one path for one node and many, and logic that
returns data while only the commands and the terminal facade draw. Read from the source
with `ast`, as a reviewer would."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 600
# The package root holds the entry point, the CLI app and what every package uses; the
# rest lives in packages by concern (config/, remote/, ops/, runs/, ui/, ...).
MAX_ROOT_MODULES = 10

# The modules that draw: the CLI, its commands, the terminal facade, the follower (it
# streams the log) and the crash panel and charts it shows. Everything else in dflashctl/
# (but the agent, which runs in the container and answers on its stdout) is logic.
DRAWS = (
    "dflashctl/cli.py",
    "dflashctl/commands/",
    "dflashctl/ui/terminal.py",
    "dflashctl/ui/tables.py",
    "dflashctl/follow/",
    "dflashctl/crash/render.py",
    "dflashctl/ui/charts.py",
)
REMOTE = ("dflashctl/agent/",)
# Printing that is not drawing: the warning OpenSSH itself prints when it trusts a new
# host key, said the same way by the paramiko transport.
MAY_PRINT = {"dflashctl/remote/transport/host_keys.py": 1}


# The trainer runs with its own folder on sys.path (`from dflash.pipeline import ...`):
# its modules are named from there.
ON_PATH = {"trainer"}


def modules(package: str) -> dict[str, Path]:
    found = {}
    base = ROOT / package if package in ON_PATH else ROOT
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(base).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of the package that `name` imports, at the top or inside a
    function (a circle through a function-level import is still a circle)."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        else:
            continue
        found |= {t for t in map(resolve, targets) if t and t != name}
    return found


def circles(package: str) -> list[list[str]]:
    known = modules(package)
    graph = {name: imported(name, path, known) for name, path in known.items()}
    # Tarjan's strongly connected components: each one of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return found


def source_files() -> list[Path]:
    return sorted(p for package in ("dflashctl", "trainer") for p in (ROOT / package).rglob("*.py"))


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("package", ["dflashctl", "trainer"])
def test_no_import_circles(package):
    assert circles(package) == []


def test_the_circle_finder_finds_a_circle(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (pkg / "c.py").write_text("from . import a\n")
    (pkg / "d.py").write_text("import pkg.a\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert circles("pkg") == [["pkg.a", "pkg.b", "pkg.c"]]


def root_modules(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "dflashctl").glob("*.py"))


def packages_without_a_docstring(root: Path) -> list[str]:
    """Every package's __init__.py says what the package owns."""
    return sorted(
        rel_to(init, root)
        for init in (root / "dflashctl").rglob("__init__.py")
        if not (ast.get_docstring(ast.parse(init.read_text())) or "").strip()
    )


def rel_to(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def test_the_package_root_stays_small():
    assert len(root_modules(ROOT)) <= MAX_ROOT_MODULES, root_modules(ROOT)


def test_every_package_says_what_it_owns():
    assert packages_without_a_docstring(ROOT) == []


def test_the_root_and_docstring_rules_catch_a_sprawl(tmp_path):
    pkg = tmp_path / "dflashctl"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "ops" / "__init__.py").write_text("from dflashctl.ops.deploy import deploy\n")
    for n in range(MAX_ROOT_MODULES):
        (pkg / f"module_{n}.py").write_text("")
    assert len(root_modules(tmp_path)) == MAX_ROOT_MODULES + 1
    assert packages_without_a_docstring(tmp_path) == ["dflashctl/ops/__init__.py"]


def test_no_module_over_the_line_limit():
    long = {rel(p): n for p in source_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_one_path_for_one_node_and_many():
    flagged = [rel(p) for p in source_files() if "multi_node" in p.read_text()]
    assert flagged == []


# What a list of nodes (or their outcomes, targets, fleet) is called: comparing its
# length forks one node from several.
FLEET_NAMES = re.compile(r"nodes|targets|fleet|outcomes", re.IGNORECASE)
# Where the node count may be asked, as (module, function; "*" for the whole module):
# the decision whether to name a node when saying something, and the launch (torchrun's
# flags, the rendezvous and the commit barrier: only nodes that meet need them).
COUNT_MAY_BE_ASKED = {
    ("dflashctl/remote/nodes.py", "names_each_node"),
    ("dflashctl/ops/launch_command.py", "*"),
    # not the fleet: the node ids torchrun wrote into one log (one id: the log is that node's)
    ("dflashctl/crash/ranks.py", "node_of"),
}


def node_count_forks(tree: ast.AST) -> list[tuple[str, int, str]]:
    """Every comparison (==, !=, <, >, <=, >=, in any chain) with `len(<a list of
    nodes>)` on a side: (the function it is in, its line, its text)."""
    found = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inside = (
                child.name
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
                else function
            )
            if isinstance(child, ast.Compare):
                for side in (child.left, *child.comparators):
                    if (
                        isinstance(side, ast.Call)
                        and isinstance(side.func, ast.Name)
                        and side.func.id == "len"
                        and side.args
                        and FLEET_NAMES.search(ast.unparse(side.args[0]))
                    ):
                        found.append((inside, child.lineno, ast.unparse(child)))
            visit(child, inside)

    visit(tree, "*")
    return found


def forks_outside_the_allow_list(path: str, text: str) -> list[str]:
    return [
        f"{path}:{line} in {function}: {code}"
        for function, line, code in node_count_forks(ast.parse(text))
        if (path, function) not in COUNT_MAY_BE_ASKED and (path, "*") not in COUNT_MAY_BE_ASKED
    ]


def test_the_node_count_is_asked_only_where_the_launch_or_the_wording_needs_it():
    """A fleet of one takes the path of many: `names_each_node` decides whether a line
    names its node; anything else that compares a node list's length is a fork."""
    flagged = [
        f for p in source_files() for f in forks_outside_the_allow_list(rel(p), p.read_text())
    ]
    assert flagged == [], "use remote.nodes.names_each_node, or one path for any count"


def test_the_fork_finder_finds_a_fork():
    snippet = (
        "def status(outcomes, cfg):\n"
        "    if len(outcomes) == 1:\n"
        "        return outcomes[0]\n"
        "    several = 1 < len(cfg.nodes)\n"
        "    return len(targets) >= 2 or len(rows) > 1\n"
    )
    found = forks_outside_the_allow_list("dflashctl/commands/status.py", snippet)
    assert [f.split(": ", 1)[0] for f in found] == [
        "dflashctl/commands/status.py:2 in status",
        "dflashctl/commands/status.py:4 in status",
        "dflashctl/commands/status.py:5 in status",
    ]
    helper = "def names_each_node(nodes):\n    return len(nodes) > 1\n"
    assert forks_outside_the_allow_list("dflashctl/remote/nodes.py", helper) == []
    assert forks_outside_the_allow_list("dflashctl/commands/stop.py", helper) != []


UI = "dflashctl/ui/"


def is_ui(module: str) -> bool:
    return module == "dflashctl.ui" or module.startswith("dflashctl.ui.")


def draws(path: str) -> bool:
    return path.startswith(DRAWS)


def logic_nodes(tree: ast.AST):
    """Every node but those under `if __name__ == "__main__":` (a module run as a
    maintainer's script may print)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def test_only_the_commands_and_the_terminal_draw():
    """The logic (deploy, restart, stop, pull, doctor's checks...) hands what it does
    to a reporting.Reporter and returns data; it never imports rich or dflashctl/ui/
    (the terminal facade, its tables and charts, the --json shape, the help), and never
    prints."""
    problems = []
    for path in (ROOT / "dflashctl").rglob("*.py"):
        name = rel(path)
        if draws(name) or name.startswith(REMOTE):
            continue
        prints = 0
        for node in logic_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {f"{node.module}.{a.name}" for a in node.names}
                if any(map(is_ui, names | {node.module})) and not name.startswith(UI):
                    problems.append(f"{name}:{node.lineno} imports {node.module}")
                elif node.module.startswith("rich"):
                    problems.append(f"{name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("rich") or (
                        is_ui(alias.name) and not name.startswith(UI)
                    ):
                        problems.append(f"{name}:{node.lineno} imports {alias.name}")
            elif isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name) and func.id == "print":
                    prints += 1
                elif isinstance(func, ast.Attribute) and func.attr == "write":
                    target = ast.unparse(func.value)
                    if target in ("sys.stdout", "sys.stderr"):
                        problems.append(f"{name}:{node.lineno} writes to {target}")
        if prints > MAY_PRINT.get(name, 0):
            problems.append(f"{name} prints")
    assert problems == []


# Issue 40: every module of dflashctl/ is imported by some test, but for a few. The count
# may only go down: lower it here when a test comes for one of them.
MAX_UNTESTED_MODULES = 5


def imported_by_tests(root: Path) -> set[str]:
    """Every module of dflashctl/ that a file under tests/ imports itself, at the top or
    inside a function (`import dflashctl.x.y`, `from dflashctl.x import y`, `from
    dflashctl.x.y import z`)."""
    known = set(package_modules(root))
    found = set()
    for path in (root / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                continue
            for dotted in targets:
                # `from dflashctl.ops import launch_command` names the module; `from
                # dflashctl.ops.deploy import deploy` names a function of the module.
                while dotted and dotted not in known:
                    dotted = dotted.rpartition(".")[0]
                if dotted:
                    found.add(dotted)
    return found


def package_modules(root: Path) -> dict[str, Path]:
    """dflashctl/'s modules by dotted name; a package's __init__.py counts only where it
    holds more than its docstring and imports."""
    found = {}
    for path in sorted((root / "dflashctl").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            body = ast.parse(path.read_text()).body
            if all(
                isinstance(n, (ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))
                for n in body
            ):
                continue
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def untested_modules(root: Path) -> list[str]:
    return sorted(set(package_modules(root)) - imported_by_tests(root))


def test_few_modules_are_left_without_a_test_importing_them():
    untested = untested_modules(ROOT)
    assert len(untested) <= MAX_UNTESTED_MODULES, untested


def test_the_untested_count_sees_every_form_of_import(tmp_path):
    pkg = tmp_path / "dflashctl"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""The package."""\n')
    (pkg / "ops" / "__init__.py").write_text("from dflashctl.ops.a import f\n")
    for name in ("a", "b", "c", "d", "e"):
        (pkg / "ops" / f"{name}.py").write_text("def f():\n    pass\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import dflashctl.ops.a\n"
        "from dflashctl.ops import b\n"
        "def test():\n    from dflashctl.ops.c import f\n"
    )
    assert untested_modules(tmp_path) == ["dflashctl.ops.d", "dflashctl.ops.e"]
