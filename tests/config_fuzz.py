"""Hostile dflash.yaml files, and the verdicts doctor and deploy reach on them.

Shared by tests/test_config_fuzz.py (a fixed number of hypothesis examples in the
suite) and bench/bench_config_fuzz.py (thousands, with counts). Each config is run
in-process through the code doctor and `deploy --dry-run` run before they contact
anything: doctor's run_checks up to its "trainer source" check, and deploy's
load_config, rules_for and preflight. A verdict is ("ok" | "config" | "source",
message); anything else raised is a traceback the user would have seen.
"""

from __future__ import annotations

import contextlib
import signal
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from dflashctl.commands.doctor import run_checks
from dflashctl.config.schema import load_config
from dflashctl.crash import rules_for
from dflashctl.errors import ConfigError, DflashError
from dflashctl.ops.deploy import preflight

SEED_SINGLE = """\
host:
  address: local
  port: 22
  connect_timeout_s: 10
  keepalive_s: 15
proxmox:
  node: pve
  api: ssh
  start_timeout_s: 300
container:
  vmid: null
  workdir: {workdir}
  python: python3
trainer:
  source: trainer
  entry: train.py
  args: [--steps, 100]
  env: {{OMP_NUM_THREADS: "1"}}
  confirm_above_mb: 100
run:
  stop_grace_s: 20
  keep_releases: 5
  retry:
    max_restarts: 3
    backoff_s: 10
    max_backoff_s: 300
    window_s: 3600
torchrun:
  nproc_per_node: gpu
  port: 29400
crash_patterns:
  - name: my_oom
    category: oom
    hint: lower the batch size
    regex: "CUDA out of memory"
    keywords: [CUDA]
    retryable: false
"""

SEED_NODES = """\
host:
  address: local
container:
  vmid: null
  workdir: {workdir}
nodes:
  - name: a
    container: {{workdir: {workdir}/a}}
  - name: b
    host: {{address: local}}
    container: {{workdir: {workdir}/b}}
trainer:
  source: trainer
  entry: train.py
torchrun:
  nproc_per_node: 1
"""


class Hang(Exception):
    """A call ran past its budget."""


@contextlib.contextmanager
def budget(seconds: float) -> Iterator[None]:
    """Raise Hang in the main thread once `seconds` have passed (SIGALRM)."""

    def ring(signum: int, frame: Any) -> None:
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def make_workspace(root: Path) -> Path:
    """A folder with a trainer the seeds point at; returns it."""
    trainer = root / "trainer"
    trainer.mkdir(parents=True, exist_ok=True)
    (trainer / "train.py").write_text("print('step 1')\n")
    return root


def seeds(root: Path) -> list[str]:
    workdir = str(root / "work")
    return [SEED_SINGLE.format(workdir=workdir), SEED_NODES.format(workdir=workdir)]


class _DoctorStopped(Exception):
    pass


def doctor_verdict(path: Path) -> tuple[str, str]:
    """What doctor says of the config before it contacts anything."""
    seen: dict[str, Any] = {}

    def on_check(check: Any) -> None:
        seen[check.name] = check
        if check.name not in ("config valid", "trainer source"):
            raise _DoctorStopped  # the next check would contact the host

    with contextlib.suppress(_DoctorStopped):
        run_checks(str(path), on_check)
    config = seen["config valid"]
    if config.status != "pass":
        return "config", config.detail
    source = seen.get("trainer source")
    if source is not None and source.status != "pass":
        return "source", source.detail
    return "ok", ""


def deploy_verdict(path: Path) -> tuple[str, str]:
    """What `deploy --dry-run` says of the config before it contacts anything."""
    try:
        config = load_config(path)
        rules_for(config)
    except ConfigError as exc:
        return "config", exc.message
    try:
        preflight(config)
    except DflashError as exc:
        return "source", exc.message
    return "ok", ""


# ----------------------------------------------------------------------- mutations

# Text without path separators or ~: a fuzzed trainer.source must not name a real,
# large folder (a deploy would scan it, which is not what is being tested here).
_SAFE_TEXT = st.text(
    alphabet=st.characters(blacklist_characters="/~\\\x00", blacklist_categories=("Cs",)),
    max_size=12,
)
_KEYS = st.sampled_from(
    ["host", "address", "port", "vmid", "workdir", "retry", "window_s", "regex", "name",
     "nodes", "proxmox", "container", "<<", "x", "1", "true", "null"]
)  # fmt: skip

hostile_scalars = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), float("-inf")]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.booleans(),
    st.none(),
    _SAFE_TEXT,
)
hostile_values = st.recursive(
    hostile_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)),
    max_leaves=6,
)


def _paths(data: Any, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _paths(value, (*prefix, i))
    return found


def _set(data: Any, path: tuple, value: Any, *, delete: bool = False) -> Any:
    if not path:
        return value
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return data


def alias_bomb(levels: int, fan: int) -> str:
    lines = ['bomb0: &b0 ["lol"]']
    for level in range(1, levels + 1):
        refs = ", ".join([f"*b{level - 1}"] * fan)
        lines.append(f"bomb{level}: &b{level} [{refs}]")
    return "\n".join(lines) + "\n"


@st.composite
def snippets(draw: st.DrawFn) -> str:
    """A few hostile lines to insert into a config's text."""
    # Weighted towards what breaks a loader (hypothesis favours small numbers itself).
    kind = draw(st.sampled_from(["bomb", "bomb", "deep", "deep", "dup", "scalar", "merge", "junk"]))
    if kind == "bomb":
        size = st.sampled_from([1, 2, 3, 5, 8, 9, 10])
        return alias_bomb(draw(size), draw(size))
    if kind == "deep":
        depth = draw(st.sampled_from([10, 63, 64, 65, 200, 2000, 20000]))
        opener = draw(st.sampled_from(["[", "{a: ", "- "]))
        closer = {"[": "]", "{a: ": "}", "- ": ""}[opener]
        if opener == "- ":  # block sequences: one more indent per level
            return "deep:\n" + "".join(f"{'  ' * i}-\n" for i in range(min(depth, 400)))
        return f"deep: {opener * depth}1{closer * draw(st.sampled_from([0, depth]))}\n"
    if kind == "dup":
        key = draw(st.sampled_from(["host", "run", "trainer", "container", "x"]))
        return f"{key}: {{}}\n{key}: {{}}\n"
    if kind == "scalar":
        return draw(st.sampled_from(
            ["a: .nan\n", "b: -.inf\n", f"c: {'9' * 5000}\n", "d: 2001-02-30\n",
             "e: !!binary '%%%'\n", "f: !!python/object:os.system ls\n", "g: &x\n  h: *x\n",
             "? [a, b]\n: 1\n", "i: \t1\n", "\ufeffj: 1\n", "k: *undefined\n"]
        ))  # fmt: skip
    if kind == "merge":
        return "m0: &m0 {a: 1}\nm1: &m1 {<<: [*m0, *m0, *m0]}\nm2: {<<: [*m1, *m1, *m1]}\n"
    return draw(st.text(max_size=40))


@st.composite
def hostile_configs(draw: st.DrawFn, seed_texts: list[str]) -> str:
    """A seed config with one to four mutations of its data or of its text."""
    text = draw(st.sampled_from(seed_texts))
    data = yaml.safe_load(text)
    structural = draw(st.booleans())
    for _ in range(draw(st.integers(1, 4))):
        if structural:
            path = draw(st.sampled_from(_paths(data)))
            action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
            if action == "delete" and path:
                data = _set(data, path, None, delete=True)
            elif action == "add":
                key = draw(_KEYS)
                holder = data
                for part in path:
                    holder = holder[part]
                if isinstance(holder, dict):
                    holder[key] = draw(hostile_values)
                elif isinstance(holder, list):
                    holder.append(draw(hostile_values))
            else:
                data = _set(data, path, draw(hostile_values))
        else:
            lines = text.splitlines(keepends=True)
            at = draw(st.integers(0, len(lines)))
            if draw(st.integers(0, 5)) == 0:  # cut the file short
                text = "".join(lines[:at])
            else:
                snippet = draw(snippets())
                if at < len(lines) and lines[at].startswith(" ") and draw(st.booleans()):
                    snippet = textwrap.indent(snippet, "  ")
                text = "".join(lines[:at]) + snippet + "".join(lines[at:])
    if structural:
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    return text


def check_one(path: Path, text: str, *, seconds: float = 60.0) -> tuple[str, str] | None:
    """Write `text` to `path`, ask doctor and deploy; returns None when they agree and
    neither raised or ran out of time, else (what went wrong, details)."""
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    answers = {}
    for name, verdict in (("doctor", doctor_verdict), ("deploy", deploy_verdict)):
        try:
            with budget(seconds):
                answers[name] = verdict(path)
        except Hang as exc:
            return "hang", f"{name}: {exc}"
        except Exception as exc:  # noqa: BLE001 - any other exception is the bug sought
            return "traceback", f"{name}: {type(exc).__name__}: {exc}"
    if answers["doctor"] != answers["deploy"]:
        return "disagreement", f"doctor {answers['doctor']} / deploy {answers['deploy']}"
    return None
