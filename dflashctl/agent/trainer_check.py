"""The trainer's own check of its config, before anything is stopped.

A trainer whose entry script names DFLASH_CHECK_CONFIG (the bundled one does) is run
once with DFLASH_CHECK_CONFIG=1, the run's interpreter (the setup venv's python), the
new release as its working folder and the run's arguments and environment: it reads
its config (the file, every `--set`, the packages the trackers it enables need) and
exits 0, or non-zero saying what is wrong. A mistake is then refused before the old
run is stopped, instead of ending the new run seconds after the old one was stopped.
An entry script that does not name the variable is not run (it would start training).

Started early, it costs the deploy almost nothing: the check's interpreter (RUNNER) is
started by the upload's agent as soon as that starts (`prestart`, from the preload of
agent_client.agent_argv), while the client still plans the deploy, with the interpreter
and environment the last check of this workdir had (`.trainer-check.json`); it imports
what that check imported from outside the releases (pydantic, yaml, ...), then waits.
Once the release is built, the launch tells it the release and the final arguments; it
runs the entry script there as `python ENTRY ARGS` would, and the launch waits for its
exit status right before the stop. A runner whose interpreter or environment is not
the run's (trainer.env or the setup changed) is not used: a new one starts then. Its
answer is taken only when it accepts; anything else is decided by the plain command
(`python ENTRY ARGS`), whose words a refusal then gives.
"""

import json
import os
import subprocess

from .errors import AgentError
from .files import read_text, write_atomic
from .lineage import fill_placeholders
from .releases import releases_dir
from .runs import base_env, bytecode_env, run_env

CHECK_ENV = "DFLASH_CHECK_CONFIG"
TIMEOUT_S = 300
SPEC_FILE = ".trainer-check.json"  # the last check's interpreter and environment (0600)
MODULES_FILE = ".trainer-check-modules.json"  # the modules it imported, the releases' left out

# The check's interpreter (Python 3.6+). Line 1 on stdin: a file of module names to import
# first (or null); line 2: {"cwd", "argv", "record", "releases"}. It then runs argv[0] from
# cwd as `python ENTRY ARGS` does: the script's real folder first on sys.path (not the
# folder it started in), argv, __main__, and its exit status. At exit it records which
# modules came from outside the releases, for the next runner to import ahead.
RUNNER = r"""
import json, os, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
def _line():
    line = sys.stdin.buffer.readline()
    return json.loads(line.decode("utf-8")) if line.strip() else None
_ahead = _line()
if _ahead:
    try:
        with open(_ahead) as f:
            _names = json.load(f)
    except Exception:
        _names = []
    for _name in _names if isinstance(_names, list) else []:
        try:
            __import__(_name)
        except BaseException:  # not there any more, or it exits: the trainer will say
            pass
_go = _line()
if _go is None:
    sys.exit(3)
def _record():
    tops = [_go["releases"] + os.sep, os.path.realpath(_go["releases"]) + os.sep]
    names = []
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        if name == "__main__" or not isinstance(where, str):
            continue
        paths = (os.path.abspath(where), os.path.realpath(where))
        if not any(p.startswith(t) for p in paths for t in tops):
            names.append(name)
    try:
        tmp = "%s.%d.tmp" % (_go["record"], os.getpid())
        with open(tmp, "w") as f:
            json.dump(names[:5000], f)
        os.replace(tmp, _go["record"])
    except Exception:
        pass
import atexit, runpy
atexit.register(_record)
os.chdir(_go["cwd"])
_entry = os.path.join(_go["cwd"], _go["argv"][0])
if not getattr(sys.flags, "safe_path", False):
    sys.path.insert(0, os.path.realpath(os.path.dirname(_entry)))
sys.argv = list(_go["argv"])
runpy.run_path(_entry, run_name="__main__")
"""

_warm = None  # (python, env, process): the runner `prestart` started, until a check takes it


class TrainerConfigRefused(AgentError):
    """The trainer said its config is wrong (`reason`, its own words); nothing was stopped."""

    def __init__(self, message, hint=None, reason=None):
        AgentError.__init__(self, message, hint)
        self.reason = reason or message


def supports_check(release_dir, entry):
    return CHECK_ENV in (read_text(os.path.join(release_dir, entry)) or "")


def check_argv(command, entry):
    """The trainer's own command line out of the launch command (plain, or after
    torchrun's options), run with the launch command's interpreter; None when the entry
    script is not in it."""
    try:
        at = command.index(entry, 1)
    except ValueError:
        return None
    return [command[0], entry, *fill_placeholders(command[at + 1 :], None)]


def check_env(p):
    """The run's environment as start_run gives it (without what names the run)."""
    env = run_env(p)
    env.update({CHECK_ENV: "1", "PYTHONUNBUFFERED": "1"})
    env.update(bytecode_env(env, p["workdir"]))  # the run's bytecode cache: warm for it too
    return env


def start_runner(python, env, ahead):
    """RUNNER in `python` with `env`, importing the modules named in file `ahead` (None:
    none) as it starts; it waits for `tell_runner`."""
    proc = subprocess.Popen(
        [python, "-c", RUNNER, "dflash-config-check"],
        cwd="/",
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdin.write((json.dumps(ahead) + "\n").encode("utf-8"))
    proc.stdin.flush()
    return proc


def prestart(workdir):
    """In the upload's agent, before its call arrives: start the runner as the last
    check of `workdir` ran (its interpreter and environment), importing what it
    imported. Best effort: without it the check starts its own."""
    global _warm
    try:
        spec = json.loads(read_text(os.path.join(workdir, SPEC_FILE)) or "null")
        if not isinstance(spec, dict):
            return
        env = dict(base_env(), **spec["env"])
        ahead = os.path.join(workdir, MODULES_FILE)
        _warm = (spec["python"], env, start_runner(spec["python"], env, ahead))
    except (OSError, ValueError, KeyError, TypeError):
        _warm = None


def take_runner(python, env):
    """The runner started ahead when it has this interpreter and environment, else None
    (one that has not is ended)."""
    global _warm
    warm, _warm = _warm, None
    if warm is None:
        return None
    if warm[0] == python and warm[1] == env and warm[2].poll() is None:
        return warm[2]
    try:  # a runner that will not be told to run: it ends when it reads the end of stdin
        warm[2].stdin.close()
    except OSError:
        pass
    return None


def remember(workdir, python, env):
    """This check's interpreter and environment, for the next upload's agent to start its
    runner with (only what the check adds to the agent's environment; 0600: trainer.env
    may hold secrets). Best effort."""
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    path = os.path.join(workdir, SPEC_FILE)
    text = json.dumps({"python": python, "env": extra}, sort_keys=True)
    if read_text(path) == text:
        return
    try:
        write_atomic(path, text, 0o600)
    except OSError:
        pass


def tell_runner(proc, release_dir, argv, workdir):
    """Run the check in `proc` (a runner): (exit status, stdout, stderr)."""
    go = {
        "cwd": release_dir,
        "argv": argv[1:],
        "record": os.path.join(workdir, MODULES_FILE),
        "releases": releases_dir(workdir),
    }
    try:
        out, err = proc.communicate((json.dumps(go) + "\n").encode("utf-8"), TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


def run_plain(release_dir, argv, env):
    """The plain command, `python ENTRY ARGS`: (exit status, stdout, stderr)."""
    done = subprocess.run(  # noqa: UP022 (capture_output is Python 3.7+; the agent 3.6+)
        argv,
        cwd=release_dir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        timeout=TIMEOUT_S,
    )
    return done.returncode, done.stdout, done.stderr


def check_trainer_config(release_dir, p):
    """None when the trainer accepts its config (or cannot be asked), else raises
    TrainerConfigRefused with the trainer's own words. Uses the runner `prestart`
    started when it fits, else starts one; a runner that does not accept leaves the
    answer to the plain command."""
    entry, workdir = p["entry"], p["workdir"]
    argv = check_argv(list(p["command"]), entry)
    if argv is None or not supports_check(release_dir, entry):
        take_runner(None, None)  # ends the one started ahead, if any
        return None
    env = check_env(p)
    try:
        try:
            runner = take_runner(argv[0], env) or start_runner(argv[0], env, None)
            code, out, err = tell_runner(runner, release_dir, argv, workdir)
        except OSError:  # it could not be started or told: the plain command says
            code = None
        if code != 0:
            code, out, err = run_plain(release_dir, argv, env)
    except subprocess.TimeoutExpired:
        raise TrainerConfigRefused(
            f"the trainer's config check ({entry} with {CHECK_ENV}=1) did not finish in "
            f"{TIMEOUT_S} s; nothing was stopped",
            f"run it by hand in the container: {CHECK_ENV}=1 {' '.join(argv)}",
        ) from None
    except OSError as exc:
        raise TrainerConfigRefused(
            f"could not run {argv[0]} to check the trainer's config: {exc.strerror}; "
            "nothing was stopped"
        ) from None
    if code == 0:
        remember(workdir, argv[0], env)
        return None
    said = err.decode("utf-8", "replace") + out.decode("utf-8", "replace")
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("config error:")), None)
    reason = reason or next((line for line in lines if line.startswith("setup error:")), None)
    reason = reason or (lines[-1] if lines else f"exit status {code}")
    raise TrainerConfigRefused(
        f"the trainer refuses this config: {reason}; nothing was stopped",
        "fix the trainer config or the --set after `--`, then deploy again "
        "(`dflashctl doctor` runs the same check)",
        reason=reason,
    )


def op_trainer_check(p):
    """doctor: the same check, on the current release with the interpreter a run of it
    uses (its setup venv's python when that is made, else container.python)."""
    from .venvs import ready_venv, release_folder, setup_spec, venv_python

    release_dir = release_folder(p["workdir"], None)
    command = list(p["command"])
    key, _ = setup_spec(release_dir, p.get("setup"))
    venv = ready_venv(p["workdir"], key) if key else None
    if venv:
        command[0] = venv_python(venv)
    p = dict(p, command=command, venv=venv)
    answer = {"release": os.path.basename(release_dir), "python": command[0]}
    if check_argv(command, p["entry"]) is None or not supports_check(release_dir, p["entry"]):
        return dict(answer, checked=False)
    try:
        check_trainer_config(release_dir, p)
    except TrainerConfigRefused as exc:
        return dict(answer, checked=True, refused=exc.reason)
    return dict(answer, checked=True)
