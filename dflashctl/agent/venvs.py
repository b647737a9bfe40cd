"""The run's virtual environment: setup.requirements and setup.commands installed into
`<workdir>/venvs/<key>/`, where key is a hash of the requirements' text, the setup
commands, the pip options and the container's Python (its version, the path it is
named by and the file that resolves to, its prefix).
So the install runs once per content: a deploy whose setup did not change finds the
environment ready (a marker file written last says it is complete).

The venv is made with `--system-site-packages`: what the container's Python already has
(torch with its CUDA build, often gigabytes and matched to the driver) is reused, not
installed again; the requirements add to it, and win over it. When container.python is
itself a venv, its own site-packages are added by a .pth file for the same reason. It
is made `--without-pip` when the container's pip is importable from it (seconds instead
of ensurepip's install), else with its own pip.

A failure leaves no environment behind (the next try starts clean) and names the
package pip could not find.
"""

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from urllib.parse import urlsplit

from .errors import AgentError
from .files import read_text, write_atomic
from .releases import current_release, releases_dir

VENVS = "venvs"
MARKER = ".dflash-setup.json"
PARENT_PTH = "_dflash_parent_site.pth"

_NO_DISTRIBUTION = re.compile(r"No matching distribution found for (\S+)")
_NO_VERSION = re.compile(r"Could not find a version that satisfies the requirement (\S+)")
_NOT_INSTALLABLE = re.compile(
    r"ERROR: (?:Directory|File) '?([^'\s]+)'? (?:is not installable|does not exist)"
    r"|ERROR: Invalid requirement: '?([^'\n]+?)'?(?::|$)",
    re.MULTILINE,
)
_BUILD_FAILED = re.compile(r"Failed (?:to build|building wheel for) (\S+)")
# pip retries a connection it could not make, then says it found no version: the index
# was never reached, the name may well be right.
_NO_NAME_RESOLUTION = re.compile(
    r"Failed to resolve '([^']+)'|Temporary failure in name resolution|Name or service not "
    r"known|No address associated with hostname|nodename nor servname"
)
_NO_CONNECTION = re.compile(
    r"Failed to establish a new connection: (?:\[Errno -?\d+\] )?([^'\")]+)"
    r"|ConnectTimeoutError|Read timed out|Network is unreachable"
)
_INDEX_URL = re.compile(r"Looking in indexes: (\S+?)(?:,|\s|$)")
_REQUIREMENT_NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")
_PYPROJECT_NAME = re.compile(r'^\s*name\s*=\s*["\']([^"\']+)["\']', re.MULTILINE)


class SetupFailed(AgentError):
    def __init__(self, message, hint=None, package=None, step=None):
        AgentError.__init__(self, message, hint)
        self.package = package
        self.step = step


def venvs_dir(workdir):
    return os.path.join(workdir, VENVS)


def venv_python(venv):
    return os.path.join(venv, "bin", "python")


def release_folder(workdir, release):
    release = release or current_release(workdir)
    if not release:
        raise AgentError(f"nothing is deployed in {workdir} yet", "run `dflashctl deploy` first")
    return os.path.join(releases_dir(workdir), release)


def setup_spec(release_dir, setup):
    """(key, spec) for this release's setup, or (None, None) when there is nothing to
    install (no requirements file, no commands)."""
    setup = setup or {}
    name = setup.get("requirements")
    text = read_text(os.path.join(release_dir, name)) if name else None
    commands = list(setup.get("commands") or [])
    if text is None and not commands:
        return None, None
    spec = {
        "requirements": text,
        "requirements_file": name if text is not None else None,
        "commands": commands,
        "pip_args": list(setup.get("pip_args") or []),
        "python": sys.version,
        "executable": os.path.realpath(sys.executable),
        # The interpreter as named, not only the file it resolves to: two venvs of one
        # base Python share that file, and each setup venv reads its parent's packages.
        "interpreter": os.path.abspath(sys.executable),
        "prefix": sys.prefix,
    }
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode("utf-8")).hexdigest()
    return digest[:16], spec


def ready_venv(workdir, key):
    """The venv folder for `key` when it is complete, else None."""
    venv = os.path.join(venvs_dir(workdir), key)
    return venv if os.path.isfile(os.path.join(venv, MARKER)) else None


def _lock(workdir, blocking=True):
    os.makedirs(venvs_dir(workdir), exist_ok=True)
    fd = os.open(os.path.join(venvs_dir(workdir), ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except OSError:
        os.close(fd)
        return None
    return fd


def ensure_venv(workdir, release, setup, out):
    """The venv for this release's setup, made if missing; `out(line)` gets every line
    of the output. Returns {"key", "venv", "python", "built", "seconds"}, or None when
    the setup installs nothing; raises SetupFailed."""
    release_dir = release_folder(workdir, release)
    key, spec = setup_spec(release_dir, setup)
    wanted = (setup or {}).get("requirements")
    if wanted and (spec is None or spec["requirements"] is None):
        # The client saw the file in trainer.source; the release does not have it.
        raise SetupFailed(
            f"setup.requirements {wanted} is not in the deployed release; nothing was stopped",
            "check that trainer.exclude does not leave it out",
        )
    if key is None:
        return None
    venv = os.path.join(venvs_dir(workdir), key)
    answer = {
        "key": key,
        "venv": venv,
        "python": venv_python(venv),
        "made_from": spec["interpreter"],  # container.python: the venv's base, its packages
        "built": False,
    }
    if ready_venv(workdir, key):
        answer["seconds"] = 0.0
        return answer
    fd = _lock(workdir)
    try:
        if ready_venv(workdir, key):  # another deploy made it meanwhile
            answer["seconds"] = 0.0
            return answer
        started = time.monotonic()
        deadline = started + float((setup or {}).get("timeout_s") or 3600)
        shutil.rmtree(venv, ignore_errors=True)  # a half-made one from a cut setup
        try:
            _build(venv, release_dir, spec, out, deadline)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        seconds = round(time.monotonic() - started, 3)
        record = {"key": key, "python": spec["python"], "seconds": seconds, "at": time.time()}
        write_atomic(os.path.join(venv, MARKER), json.dumps(record))
    finally:
        os.close(fd)
    answer.update(built=True, seconds=seconds)
    return answer


def _build(venv, release_dir, spec, out, deadline):
    out(f"setup: making the environment {venv} (system site-packages reused)")
    _step(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv],
        "making the venv",
        out,
        deadline,
    )
    _link_parent_site(venv)
    python = venv_python(venv)
    if spec["requirements"] is not None:
        if not _runs([python, "-m", "pip", "--version"]):
            out("setup: no pip reachable from the venv: installing its own (ensurepip)")
            _step(
                [sys.executable, "-m", "venv", "--system-site-packages", "--clear", venv],
                "making the venv with pip",
                out,
                deadline,
            )
            _link_parent_site(venv)
        argv = [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
        argv += spec["pip_args"] + ["-r", spec["requirements_file"]]
        out(f"setup: pip install -r {spec['requirements_file']}")
        _step(argv, "pip install", out, deadline, cwd=release_dir)
    env = dict(os.environ, VIRTUAL_ENV=venv, PATH=venv_path(venv, os.environ.get("PATH")))
    for command in spec["commands"]:
        out(f"setup: $ {command}")
        _step(["/bin/sh", "-c", command], command, out, deadline, cwd=release_dir, env=env)


def venv_path(venv, path):
    return os.path.join(venv, "bin") + (":" + path if path else "")


def _runs(argv):
    try:
        done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError:
        return False
    return done.returncode == 0


def _link_parent_site(venv):
    """container.python may be a venv itself: its packages then live in its own
    site-packages, which --system-site-packages does not reach. A .pth file adds them
    after the new venv's own (so the requirements still win)."""
    probe = (
        "import json, site, sys; print(json.dumps([sys.prefix != sys.base_prefix, "
        "site.getsitepackages()]))"
    )
    try:
        found = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.PIPE, timeout=60)
        is_venv, folders = json.loads(found.stdout.decode() or "[false, []]")
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return
    if not is_venv:
        return
    inner = subprocess.run(
        [venv_python(venv), "-c", "import site; print(site.getsitepackages()[0])"],
        stdout=subprocess.PIPE,
    )
    target = inner.stdout.decode().strip()
    if inner.returncode == 0 and target:
        write_atomic(os.path.join(target, PARENT_PTH), "\n".join(folders) + "\n")


def _step(argv, what, out, deadline, cwd=None, env=None):
    """Run one step, its output line by line to `out`; SetupFailed when it fails."""
    tail = deque(maxlen=400)
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=dict(env or os.environ, PYTHONUNBUFFERED="1", PIP_NO_INPUT="1"),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except OSError as exc:
        raise SetupFailed(f"setup could not run {argv[0]}: {exc.strerror}", step=what) from None
    timed_out = False
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        tail.append(line)
        out(line)
        if time.monotonic() > deadline:
            timed_out = True
            os.killpg(proc.pid, 9)
            break
    proc.stdout.close()
    code = proc.wait()
    if timed_out:
        raise SetupFailed(
            f"setup ran past setup.timeout_s during {what}; nothing was stopped",
            "raise setup.timeout_s, or make the install faster (a wheel folder, a nearer index)",
            step=what,
        )
    if code != 0:
        raise failure(what, code, "\n".join(tail))


def failure(what, code, text):
    """The SetupFailed for a step's output: the package pip could not get, named (or
    the index it could not reach)."""
    unreachable = _unreachable_index(text)
    if unreachable:
        return unreachable
    for pattern, reason in (
        (_NO_DISTRIBUTION, "pip found no distribution of it"),
        (_NO_VERSION, "pip found no version of it that satisfies the requirement"),
        (_NOT_INSTALLABLE, "pip cannot install it"),
        (_BUILD_FAILED, "building it failed"),
    ):
        found = list(pattern.finditer(text))
        if found:
            package = next(g for g in found[-1].groups() if g)
            return SetupFailed(
                f"setup failed: {package}: {reason}; nothing was stopped, the previous "
                "run and release stay",
                "check its name and version in the requirements file, and that setup.pip_args "
                "point pip at an index or --find-links folder that has it",
                package=package,
                step=what,
            )
    last = [line for line in text.splitlines() if line.strip()]
    detail = last[-1].strip() if last else f"exit status {code}"
    return SetupFailed(
        f"setup failed during {what} (exit status {code}): {detail}; nothing was stopped",
        "the output above says why; fix it and deploy again",
        step=what,
    )


def _unreachable_index(text):
    """A SetupFailed saying that pip never reached its index (no DNS, no route), or None."""
    if re.search(r"\(from versions: (?!none\))", text):
        return None  # the index answered (after a retry, perhaps): a version problem
    resolution = _NO_NAME_RESOLUTION.search(text)
    connection = None if resolution else _NO_CONNECTION.search(text)
    if not (resolution or connection):
        return None
    wanted = _NO_DISTRIBUTION.findall(text) or _NO_VERSION.findall(text)
    index = _INDEX_URL.search(text)
    host = resolution.group(1) if resolution and resolution.group(1) else None
    where = host or (urlsplit(index.group(1)).hostname if index else None) or "its package index"
    if resolution:
        why = f"name resolution failed for {where}: the container has no working DNS"
    else:
        detail = (connection.group(1) or connection.group(0)).strip()
        why = f"could not connect to {where}: {detail}"
    package = wanted[-1] if wanted else None
    looking = f" while looking for {package}" if package else ""
    return SetupFailed(
        f"setup failed: pip could not reach the package index ({why}){looking}; nothing was "
        "stopped, the previous run and release stay",
        "give the container a DNS server (its /etc/resolv.conf) and a route to the index, or "
        "install from a folder of wheels: setup.pip_args: [--no-index, --find-links, wheels]",
        package=package,
        step="pip install",
    )


# --------------------------------------------------------------------------- checks


def requirement_names(release_dir, text):
    """The distribution names a requirements file asks for (options and files it
    includes are left out; a local wheel or project folder is named by its metadata)."""
    names = []
    for raw in (text or "").splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#") or line.startswith("-"):
            continue
        direct = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*@", line)
        if direct:
            names.append(direct.group(1))
        elif line.endswith(".whl"):
            names.append(os.path.basename(line).split("-", 1)[0])
        elif "/" in line or line.startswith("."):
            path = line[len("file://") :] if line.startswith("file://") else line
            pyproject = read_text(os.path.join(release_dir, path, "pyproject.toml")) or ""
            found = _PYPROJECT_NAME.search(pyproject)
            if found:
                names.append(found.group(1))
        else:
            found = _REQUIREMENT_NAME.match(line)
            if found:
                names.append(found.group(1))
    return names


# Run by the venv's python: each distribution's top-level modules, imported.
_IMPORT_CHECK = r"""
import importlib, json, sys
import importlib.metadata as md
out = {}
for name in json.loads(sys.argv[1]):
    try:
        dist = md.distribution(name)
    except Exception:
        out[name] = "not installed"
        continue
    tops = (dist.read_text("top_level.txt") or "").split()
    if not tops:
        for f in dist.files or []:
            part = str(f).split("/")[0]
            if part.endswith((".dist-info", ".pth", ".egg-info")) or part in ("..", "__pycache__"):
                continue
            part = part[:-3] if part.endswith(".py") else part
            if part and part.isidentifier() and part not in tops:
                tops.append(part)
    errors = []
    for top in tops:
        if top.startswith("_"):
            continue
        try:
            importlib.import_module(top)
        except Exception as exc:
            errors.append("%s: %s: %s" % (top, type(exc).__name__, exc))
    out[name] = "; ".join(errors) or "ok"
print(json.dumps(out))
"""


def op_setup_check(p):
    """doctor: is the venv of the current release's setup there, and does its python
    import what the requirements name?"""
    workdir = p["workdir"]
    release_dir = release_folder(workdir, p.get("release"))
    key, spec = setup_spec(release_dir, p.get("setup"))
    if key is None:
        return {"needed": False}
    venv = ready_venv(workdir, key)
    answer = {"needed": True, "key": key, "venv": os.path.join(venvs_dir(workdir), key)}
    answer["ready"] = venv is not None
    if venv is None:
        return answer
    names = requirement_names(release_dir, spec["requirements"])
    answer["imports"] = {}
    if names:
        done = subprocess.run(  # noqa: UP022 (capture_output is Python 3.7+; the agent 3.6+)
            [venv_python(venv), "-c", _IMPORT_CHECK, json.dumps(names)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=release_dir,
            timeout=300,
        )
        try:
            answer["imports"] = json.loads(done.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            err = done.stderr.decode("utf-8", "replace").strip().splitlines()
            answer["imports"] = {n: (err[-1] if err else "the check failed") for n in names}
    return answer


# --------------------------------------------------------------------------- cleaning up


def gc_venvs(workdir, keep, protect):
    """Keep the newest `keep` complete venvs plus those in `protect` (paths); a venv
    being made (no marker yet) is left alone, and nothing is removed while one is."""
    base = venvs_dir(workdir)
    if not os.path.isdir(base):
        return []
    fd = _lock(workdir, blocking=False)
    if fd is None:
        return []
    try:
        done = []
        for name in os.listdir(base):
            marker = os.path.join(base, name, MARKER)
            if os.path.isfile(marker):
                done.append((os.stat(marker).st_mtime, name))
        done.sort()
        kept = {name for _, name in done[-keep:]} if keep > 0 else set()
        kept.update(os.path.basename(p.rstrip("/")) for p in protect if p)
        removed = []
        for _, name in done:
            if name not in kept:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
                removed.append(name)
        return removed
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- streamed


RESULT_PREFIX = "DFLASH-SETUP-RESULT "


def stream_setup(p):
    """The `setup` verb, streamed: every output line on stdout as it comes, then one
    line `DFLASH-SETUP-RESULT {json}` (the client prints the rest). Exit 0 or 1."""

    def out(line):
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    try:
        answer = ensure_venv(p["workdir"], p.get("release"), p.get("setup"), out)
        result = {"ok": True, "venv": answer}
    except SetupFailed as exc:
        result = {"ok": False, "error": exc.message, "hint": exc.hint, "package": exc.package}
    except AgentError as exc:
        result = {"ok": False, "error": exc.message, "hint": exc.hint}
    except OSError as exc:
        result = {"ok": False, "error": f"setup failed: {exc.strerror or exc} ({exc.filename})"}
    out(RESULT_PREFIX + json.dumps(result))
    return 0 if result["ok"] else 1
