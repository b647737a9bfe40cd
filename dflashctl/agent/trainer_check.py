"""The trainer's own check of its config, before anything is stopped.

A trainer whose entry script names DFLASH_CHECK_CONFIG (the bundled one does) is run
once with DFLASH_CHECK_CONFIG=1, the run's interpreter (the setup venv's python), the
new release as its working folder and the run's arguments and environment: it reads
its config (the file, every `--set`, the packages the trackers it enables need) and
exits 0, or non-zero saying what is wrong. A mistake is then refused before the old
run is stopped, instead of ending the new run seconds after the old one was stopped.
An entry script that does not name the variable is not run (it would start training).
"""

import os
import subprocess

from .errors import AgentError
from .files import read_text
from .lineage import fill_placeholders
from .runs import bytecode_env

CHECK_ENV = "DFLASH_CHECK_CONFIG"
TIMEOUT_S = 300


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(p.get("env") or {})
    if p.get("venv"):
        env["VIRTUAL_ENV"] = p["venv"]
        env["PATH"] = os.path.join(p["venv"], "bin") + ":" + env.get("PATH", "/usr/bin:/bin")
    env.update({CHECK_ENV: "1", "PYTHONUNBUFFERED": "1"})
    env.update(bytecode_env(env, p["workdir"]))  # the run's bytecode cache: warm for it too
    return env


def check_trainer_config(release_dir, p):
    """None when the trainer accepts its config (or cannot be asked), else raises
    TrainerConfigRefused with the trainer's own words."""
    entry = p["entry"]
    argv = check_argv(list(p["command"]), entry)
    if argv is None or not supports_check(release_dir, entry):
        return None
    try:
        done = subprocess.run(  # noqa: UP022 (capture_output is Python 3.7+; the agent 3.6+)
            argv,
            cwd=release_dir,
            env=check_env(p),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            timeout=TIMEOUT_S,
        )
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
    if done.returncode == 0:
        return None
    said = done.stderr.decode("utf-8", "replace") + done.stdout.decode("utf-8", "replace")
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    reason = next((line for line in lines if line.startswith("config error:")), None)
    reason = reason or next((line for line in lines if line.startswith("setup error:")), None)
    reason = reason or (lines[-1] if lines else f"exit status {done.returncode}")
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
