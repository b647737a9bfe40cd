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

from dflashctl.errors import EXIT_USAGE, HostError

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target
    from dflashctl.remote.transport.base import CommandResult

PACKAGE = "dflashctl.agent"
# The name the bundle gives the package where it runs (its modules import each other
# relatively, so any name does).
BUNDLED_NAME = "dflash_agent"
# Container-side modules the verbs never import: the run's supervisor travels in a
# program of its own with the crash detector (dflashctl/ops/recovery.py).
# The commit barrier runs in the run's interpreter, which has torch (dflashctl/commit.py
# sends it along).
NOT_BUNDLED = frozenset({"supervisor", "commit_barrier"})

# Installs an importer for SOURCES; `run` is what the bootstrap calls. Python 3.6+.
_BUNDLE_BODY = '''
import hashlib
import marshal
import os
import sys
from importlib.machinery import ModuleSpec

# The modules' compiled code, kept beside the cached bundle with its hash and the
# interpreter's cache tag in the name (a new bundle or another Python never reads an
# old one's): compiling the agent from source was about a third of every call's CPU
# in the container. Unreadable or not a dict: compiled afresh, and written again.
_CACHE = globals().get("CODE_CACHE") if sys.implementation.cache_tag else None
_CODES = {}
_FRESH = []


def _load_codes():
    # Read without following a link, and only from a file of this user's that no one
    # else can write, whose content has the digest it starts with (a swapped or cut
    # file is compiled afresh, never run).
    try:
        fd = os.open(_CACHE, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as cached:
            info = os.fstat(cached.fileno())
            data = cached.read()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return {}
        if hashlib.sha256(_CACHE.encode("utf-8") + data[32:]).digest() != data[:32]:
            return {}
        codes = marshal.loads(data[32:])
    except Exception:
        return {}
    return codes if isinstance(codes, dict) else {}


if _CACHE:
    _CODES = _load_codes()


def _save_codes():
    if not (_CACHE and _FRESH):
        return
    temporary = "%s.%d.tmp" % (_CACHE, os.getpid())
    try:
        payload = marshal.dumps(_CODES)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        with os.fdopen(os.open(temporary, flags, 0o600), "wb") as out:
            out.write(hashlib.sha256(_CACHE.encode("utf-8") + payload).digest() + payload)
        os.replace(temporary, _CACHE)
    except Exception:
        try:
            os.unlink(temporary)
        except OSError:
            pass


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
        code = _CODES.get(rel)
        if type(code) is not type(_save_codes.__code__):
            code = compile(SOURCES[rel], PACKAGE + "/" + rel + ".py", "exec")
            _CODES[rel] = code
            _FRESH.append(rel)
        exec(code, module.__dict__)


sys.meta_path.insert(0, _Bundled())


def run(op, params_json):
    try:
        main = __import__(PACKAGE + ".main", fromlist=["main"])
        return main.main(op, params_json)
    finally:
        _save_codes()
'''

# The folder the agent is kept in, or None: only a real folder of this user's that no
# one else can enter. Another user's folder (or a link) made beforehand in the shared
# /tmp is moved aside and a private one made; when that is not allowed, nothing is
# kept or read there. Python 3.6+, standard library only.
_CACHE_FOLDER = """
import hashlib, os, sys
N = os.O_NOFOLLOW
def _folder():
 d = os.path.join(os.environ.get("TMPDIR") or "/tmp", "dflashctl-agent-%d" % os.getuid())
 for i in 0, 1:
  try:
   os.mkdir(d, 0o700)
  except OSError:
   pass
  try:
   s = os.lstat(d)
   if s.st_uid == os.getuid() and s.st_mode & 0o170077 == 0o40000:
    return d
   i or os.rename(d, d + ".unsafe-%d" % os.getpid())
  except OSError:
   return
"""

# Runs the cached bundle if its content has hash H, else the attached one B (and keeps
# it, in a file made anew: never through a link), else answers agent_missing. (One
# space a level: a poll sends this every few seconds, and the log reader's command
# line carries it.)
_BOOTSTRAP = """
d = _folder()
f = d and os.path.join(d, H + ".py")
s = None
try:
 with os.fdopen(os.open(f, N), "rb") as x:
  s = x.read()
except Exception:
 pass
if s is not None and hashlib.sha256(s).hexdigest() != H:
 s = None
if s is None and B is not None:
 import base64, zlib
 s = zlib.decompress(base64.b64decode(B))
 try:
  t = f + ".%d.tmp" % os.getpid()
  with os.fdopen(os.open(t, N | os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as x:
   x.write(s)
  os.replace(t, f)
 except Exception:
  pass
if s is None:
 print('{"ok": false, "agent_missing": true, "error": "no agent in %s"}' % (d or "a folder of this user's own"))
 sys.exit(3)
g = {"__name__": "dflash_agent_bundle", "CODE_CACHE": f and f[:-2] + sys.implementation.cache_tag + ".code"}
exec(compile(s, f or "agent", "exec"), g)
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
    gzip'd archives a deploy sends), in base64. Level 6: a third of level 9's CPU on
    every call, for 1% more bytes."""
    return base64.b64encode(zlib.compress(bundle_source().encode("utf-8"), 6)).decode("ascii")


def bootstrap(op: str, params: Mapping[str, Any], *, with_bundle: bool) -> str:
    """The program for one call: its verb and parameters, the bundle's hash, the bundle
    itself only `with_bundle`."""
    bundle = repr(packed_bundle()) if with_bundle else "None"
    header = f"H = {bundle_hash()!r}\nOP = {op!r}\nP = {json.dumps(params)!r}\nB = {bundle}\n"
    return header + _CACHE_FOLDER + _BOOTSTRAP


def agent_input(op: str, params: Mapping[str, Any], *, with_bundle: bool = True) -> bytes:
    """What agent_argv's interpreter reads on stdin for one call: the program, framed
    by its length (LOADER)."""
    program = bootstrap(op, params, with_bundle=with_bundle).encode("utf-8")
    return b"%d\n" % len(program) + program


# Reads one program framed as "<length>\n<bytes>" off stdin and runs it, leaving the
# rest of stdin (a deploy's archive) for the program to read as it comes. The program
# is read as bytes and exec'd: `python -` would read stdin to its end first, and
# tokenizes the bundle's one long line at 15 ms of CPU. Nothing framed (stdin closed
# first): nothing runs, so an agent started ahead of its call (transport.prepare_bulk)
# that never gets one ends having done nothing.
LOADER = (
    "import sys;r=sys.stdin.buffer;n=int(r.readline() or 0);p=r.read(n);len(p)==n>0 and exec(p)"
)

# Before LOADER, for an agent started ahead of its call: the modules of the bundle with
# hash H, from the copy kept in the container (as _BOOTSTRAP finds and checks it), are
# imported while the call is still being planned; the program that follows finds them
# imported. No such copy: nothing is imported, the program brings the bundle.
_PRELOAD = """
def _preload(h):
    try:
        f = os.path.join(_folder(), h + ".py")
        with os.fdopen(os.open(f, N), "rb") as x:
            s = x.read()
        if hashlib.sha256(s).hexdigest() != h:
            return
        g = {"__name__": "dflash_agent_bundle", "CODE_CACHE": "%s.%s.code" % (f[:-3], sys.implementation.cache_tag)}
        exec(compile(s, f, "exec"), g)
        if len(sys.argv) > 2:  # a deploy's workdir: its trainer config check starts first
            __import__(g["PACKAGE"] + ".trainer_check", fromlist=["prestart"]).prestart(sys.argv[2])
        __import__(g["PACKAGE"] + ".verbs")
        g["_save_codes"]()
    except Exception:
        pass
"""


def agent_argv(
    python: str, op: str, *, preload: bool = False, check_in: str | None = None
) -> list[str]:
    """The agent's command: it reads its program off stdin (agent_input). `preload`:
    it imports the kept bundle first, for a command started ahead of its call; with
    `check_in` (a workdir) it also starts the trainer config check's interpreter there
    (agent/trainer_check.py's prestart)."""
    # -S: the agent needs only the standard library; skipping site-packages saves
    # a noticeable part of each call's start-up. `op` only shows in `ps`.
    program = (
        f"{_CACHE_FOLDER}{_PRELOAD}_preload({bundle_hash()!r})\n{LOADER}" if preload else LOADER
    )
    return [python, "-S", "-c", program, op, *([check_in] if preload and check_in else [])]


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
    node could not learn that decision (nothing stopped here); `rolled_back`: the new
    run could not start on every node after the old runs were stopped ("here": this
    node's launch failed; "peer": another node's did), so it was stopped here and the
    previous release launched again (`relaunched`) or nothing runs."""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        stale: bool = False,
        aborted: bool = False,
        in_doubt: bool = False,
        rolled_back: str | None = None,
        relaunched: bool = False,
    ) -> None:
        super().__init__(message, hint=hint)
        self.stale = stale
        self.aborted = aborted
        self.in_doubt = in_doubt
        self.rolled_back = rolled_back
        self.relaunched = relaunched


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
        failed = AgentFailed(
            f"{answer.get('error')} (on {where})",
            hint=answer.get("hint"),
            stale=bool(answer.get("stale")),
            aborted=bool(answer.get("aborted")),
            in_doubt=bool(answer.get("in_doubt")),
            rolled_back=answer.get("rolled_back"),
            relaunched=bool(answer.get("relaunched")),
        )
        if answer.get("config_refused"):  # the trainer's own config check (agent/trainer_check)
            failed.exit_code = EXIT_USAGE
        raise failed
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
