"""The `exec` verb: replace this process with a command in the run's environment, so
that its output, its stdin and its exit status are the command's own.

The run's environment: the workdir as cwd, trainer.env (sent by the client), the
active run's DFLASH_RUN_ID and DFLASH_RUN_DIR, and its venv (VIRTUAL_ENV, bin/ first
on PATH): the active run's, else the ready one for the current release's setup.
"""

import json
import os
import sys

from .lineage import run_meta
from .releases import current_release, releases_dir
from .runs import active_run_id, runs_dir
from .venvs import ready_venv, setup_spec, venv_path


def run_environment(p):
    """(cwd, env) for a command run as the active run would see it."""
    workdir = p["workdir"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(p.get("env") or {})
    venv = None
    run_id = active_run_id(workdir)
    if run_id:
        env["DFLASH_RUN_ID"] = run_id
        env["DFLASH_RUN_DIR"] = os.path.join(runs_dir(workdir), run_id)
        venv = run_meta(workdir, run_id).get("venv")
        if venv and not os.path.isdir(venv):
            venv = None
    release = current_release(workdir)
    if venv is None and release:
        key, _ = setup_spec(os.path.join(releases_dir(workdir), release), p.get("setup"))
        venv = ready_venv(workdir, key) if key else None
    if venv:
        env["VIRTUAL_ENV"] = venv
        env["PATH"] = venv_path(venv, env.get("PATH"))
    return workdir, env


def exec_command(p):
    """Never returns on success; on failure says why on stderr, with a shell's status."""
    argv = list(p["argv"])
    cwd, env = run_environment(p)
    try:
        os.chdir(cwd)
    except OSError as exc:
        sys.stderr.write(f"dflashctl: cannot enter {cwd}: {exc.strerror}\n")
        return 2
    if p.get("describe"):
        run, venv = env.get("DFLASH_RUN_ID", "(none)"), env.get("VIRTUAL_ENV", "(none)")
        sys.stderr.write(f"dflashctl: in {cwd}, run {run}, venv {venv}\n")
        sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        sys.stderr.write(f"dflashctl: {argv[0]}: command not found in the container\n")
        return 127
    except PermissionError:
        sys.stderr.write(f"dflashctl: {argv[0]}: permission denied\n")
        return 126
    except OSError as exc:
        sys.stderr.write(f"dflashctl: cannot run {argv[0]}: {exc.strerror}\n")
        return 126
    return 0  # not reached


def main_exec(params_json):
    return exec_command(json.loads(params_json))
