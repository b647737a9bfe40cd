"""The agent's client: one call of a verb where the trainer runs, and its answer.

The agent (the stdlib-only package dflashctl/agent/) travels as ONE program, as
Ansible's AnsiballZ does: the bundle is a generated source that carries every module
of the package as text and imports them from there. It is not installed anywhere:

- each call pipes a small bootstrap to `<python> -S -`: the verb, its parameters as
  JSON and the bundle's sha256. The bootstrap runs the copy the container keeps in
  `/tmp/dflashctl-agent-<uid>/<sha256>.py` when that copy's content has that hash;
- else it runs the bundle attached to it (compressed), and keeps it there (written
  atomically). The first call of a command there carries the bundle, the later ones
  (and the log reader, whose command line has no room for it) do not; one that finds
  no copy answers `agent_missing` having done nothing, and is sent again with it.

A `logs -f` polls the run's state every few seconds: each poll now sends the
bootstrap (about 1 KB) instead of the whole agent (tens of KB).
"""

from __future__ import annotations

import base64
import hashlib
import json
import zlib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any

from dflashctl.errors import HostError

if TYPE_CHECKING:
    from dflashctl.target import Target
    from dflashctl.transport.base import CommandResult

PACKAGE = "dflashctl.agent"
# The name the bundle gives the package where it runs (its modules import each other
# relatively, so any name does).
BUNDLED_NAME = "dflash_agent"
# Container-side modules the verbs never import: the run's supervisor travels in a
# program of its own with the crash detector (dflashctl/recovery.py).
# The commit barrier runs in the run's interpreter, which has torch (dflashctl/commit.py
# sends it along).
NOT_BUNDLED = frozenset({"supervisor", "commit_barrier"})
# The answer of a bootstrap that has no agent to run (exit status 3).
AGENT_MISSING = "agent_missing"

# Installs an importer for SOURCES; `run` is what the bootstrap calls. Python 3.6+.
_BUNDLE_BODY = '''
import sys
from importlib.machinery import ModuleSpec


class _Bundled(object):
    """Imports the agent's modules from SOURCES, not from files."""

    def _relative(self, name):
        if name == PACKAGE:
            return "__init__"
        if name.startswith(PACKAGE + "."):
            return name[len(PACKAGE) + 1 :]
        return None

    def find_spec(self, name, path=None, target=None):
        rel = self._relative(name)
        if rel not in SOURCES:
            return None
        return ModuleSpec(name, self, origin=PACKAGE + "/" + rel + ".py", is_package=rel == "__init__")

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        rel = self._relative(module.__name__)
        exec(compile(SOURCES[rel], PACKAGE + "/" + rel + ".py", "exec"), module.__dict__)


sys.meta_path.insert(0, _Bundled())


def run(op, params_json):
    main = __import__(PACKAGE + ".main", fromlist=["main"])
    return main.main(op, params_json)
'''

# Runs the cached bundle if its content has hash H, else the attached one B (and keeps
# it), else answers agent_missing. Python 3.6+, standard library only.
_BOOTSTRAP = """
import hashlib, os, sys
d = os.path.join(os.environ.get("TMPDIR") or "/tmp", "dflashctl-agent-%d" % os.getuid())
f = os.path.join(d, H + ".py")
s = None
try:
    with open(f, "rb") as x:
        s = x.read()
except OSError:
    pass
if s is not None and hashlib.sha256(s).hexdigest() != H:
    s = None
if s is None and B is not None:
    import base64, zlib
    s = zlib.decompress(base64.b64decode(B))
    try:
        os.makedirs(d, 0o700, exist_ok=True)
        t = "%s.%d.tmp" % (f, os.getpid())
        with open(t, "wb") as x:
            x.write(s)
        os.replace(t, f)
    except OSError:
        pass
if s is None:
    sys.stdout.write('{"ok": false, "agent_missing": true, "error": "no agent cached in %s"}' % d)
    sys.stdout.flush()
    sys.exit(3)
g = {"__name__": "dflash_agent_bundle"}
exec(compile(s, f, "exec"), g)
sys.exit(g["run"](OP, P))
"""


# --------------------------------------------------------------------------- the bundle


def agent_modules() -> dict[str, str]:
    """The package's modules by name (`__init__`, `files`, ...) and their source."""
    folder = resources.files(PACKAGE)
    return {
        entry.name[: -len(".py")]: entry.read_text(encoding="utf-8")
        for entry in sorted(folder.iterdir(), key=lambda e: e.name)
        if entry.name.endswith(".py") and entry.name[: -len(".py")] not in NOT_BUNDLED
    }


@cache
def bundle_source() -> str:
    """The one program that carries the whole package (deterministic: same modules,
    same text, same hash)."""
    sources = "".join(f"    {name!r}: {text!r},\n" for name, text in agent_modules().items())
    return f"PACKAGE = {BUNDLED_NAME!r}\nSOURCES = {{\n{sources}}}\n{_BUNDLE_BODY}"


@cache
def bundle_hash() -> str:
    return hashlib.sha256(bundle_source().encode("utf-8")).hexdigest()


@cache
def packed_bundle() -> str:
    """The bundle as it travels: compressed (the agent needs zlib anyway, for the
    gzip'd archives a deploy sends), in base64."""
    return base64.b64encode(zlib.compress(bundle_source().encode("utf-8"), 9)).decode("ascii")


def bootstrap(op: str, params: Mapping[str, Any], *, with_bundle: bool) -> str:
    """The program for one call: its verb and parameters, the bundle's hash, the bundle
    itself only `with_bundle`."""
    bundle = repr(packed_bundle()) if with_bundle else "None"
    header = f"H = {bundle_hash()!r}\nOP = {op!r}\nP = {json.dumps(params)!r}\nB = {bundle}\n"
    return header + _BOOTSTRAP


def agent_input(op: str, params: Mapping[str, Any], *, with_bundle: bool = True) -> bytes:
    """What `python -S -` reads on stdin for one call."""
    return bootstrap(op, params, with_bundle=with_bundle).encode("utf-8")


def agent_argv(python: str, op: str) -> list[str]:
    # -S: the agent needs only the standard library; skipping site-packages saves
    # a noticeable part of each call's start-up. `op` only shows in `ps`.
    return [python, "-S", "-", op]


def streamed_agent_argv(python: str, op: str, program_bytes: int) -> list[str]:
    """The agent reading its program (agent_input, `program_bytes` long) off stdin and
    leaving the rest of stdin, the deploy's archive, for the verb to read as it comes
    (`python -` would read stdin to its end before running anything)."""
    loader = f"import sys;exec(sys.stdin.buffer.read({int(program_bytes)}))"
    return [python, "-S", "-c", loader, op]


def log_reader_argv(
    python: str, workdir: str, run_id: str, offset: int, backlog: int, *, once: bool
) -> list[str]:
    """The `log` verb as one command line (a stream has no stdin): the bootstrap
    without the bundle, which the follower installs with `install` when it is missing."""
    params = {
        "workdir": workdir,
        "run_id": run_id,
        "offset": offset,
        "backlog": backlog,
        "once": once,
    }
    # The arguments after the program only name it in `ps` (the reader of which run).
    return [python, "-S", "-c", bootstrap("log", params, with_bundle=False), "DFLASH-LOG", run_id]


def is_agent_missing(output: bytes) -> bool:
    return b'"agent_missing": true' in output


# --------------------------------------------------------------------------- calls


class AgentFailed(HostError):
    """The agent refused or failed; `stale`: the plan it was given is out of date
    (nothing was changed), so the caller should inspect again; `aborted`: the nodes of
    a run across several decided not to launch (nothing stopped); `in_doubt`: this
    node could not learn that decision (nothing stopped here)."""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        stale: bool = False,
        aborted: bool = False,
        in_doubt: bool = False,
    ) -> None:
        super().__init__(message, hint=hint)
        self.stale = stale
        self.aborted = aborted
        self.in_doubt = in_doubt


class InterpreterMissing(HostError):
    """container.python cannot be run there: retrying will not help."""


def parse_agent_answer(result: CommandResult, python: str, op: str, where: str) -> dict[str, Any]:
    """The agent's JSON answer, or a HostError saying what went wrong and where."""
    if result.exit_status in (126, 127) and not result.stdout.strip():
        raise InterpreterMissing(
            f"{python}: cannot run it on {where}: {result.last_error_line() or 'not found'}",
            hint="set container.python to the interpreter there, e.g. /usr/bin/python3",
        )
    try:
        answer = json.loads(result.stdout_text.strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = result.last_error_line() or f"exit status {result.exit_status}, no output"
        raise HostError(
            f"dflashctl's {op} step failed on {where}: {detail}",
            hint=f"it runs with {python} there (container.python): check that it is "
            "Python 3.6 or newer",
        ) from None
    if not answer.get("ok"):
        raise AgentFailed(
            f"{answer.get('error')} (on {where})",
            hint=answer.get("hint"),
            stale=bool(answer.get("stale")),
            aborted=bool(answer.get("aborted")),
            in_doubt=bool(answer.get("in_doubt")),
        )
    return answer


# Where this process has seen the agent kept: (target, python). The first call there
# sends the bundle along (the bootstrap ignores it when it has the copy), so no call
# costs an extra round trip; the calls after it (`logs -f` asks a run's state every
# few seconds) send the bootstrap alone.
_kept: set[tuple[str, str]] = set()


def call_agent(
    target: Target,
    python: str,
    op: str,
    params: Mapping[str, Any],
    *,
    timeout: float | None = 120,
    with_bundle: bool | None = None,
) -> dict[str, Any]:
    """Run one agent verb where the trainer runs: one round trip (two only when the
    copy this process saw there went away). `with_bundle`: send the bundle along or
    not; None: only on the first call there."""
    argv = agent_argv(python, op)
    where = target.describe()
    if with_bundle is None:
        with_bundle = (where, python) not in _kept
    result = target.run(
        argv, stdin=agent_input(op, params, with_bundle=with_bundle), timeout=timeout, check=False
    )
    if not with_bundle and result.exit_status == 3 and is_agent_missing(result.stdout):
        result = target.run(argv, stdin=agent_input(op, params), timeout=timeout, check=False)
    answer = parse_agent_answer(result, python, op, where)
    _kept.add((where, python))
    return answer


def install(target: Target, python: str, *, force: bool = False) -> None:
    """Make sure the container keeps this version of the agent: nothing when this
    process has seen it there (unless `force`), else one round trip."""
    if force or (target.describe(), python) not in _kept:
        call_agent(target, python, "hello", {}, with_bundle=True)
