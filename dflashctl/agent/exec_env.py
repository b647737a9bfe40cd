"""The `exec` verb: replace this process with a command in the run's environment, so
that its output, its stdin and its exit status are the command's own.

The run's environment: the workdir as cwd, trainer.env (sent by the client), the
active run's DFLASH_RUN_ID and DFLASH_RUN_DIR, and its venv (VIRTUAL_ENV, bin/ first
on PATH): the active run's, else the ready one for the current release's setup; with
no venv, the folder of container.python first on PATH (`python` is the run's).

trainer.env holds secrets (API keys): it never travels on a command line, which every
user of the host reads in /proc/*/cmdline. The client first leaves the parameters in a
ticket (`exec_ticket`, on the agent's stdin), a file only this user can read; the exec
command line names the ticket, and the exec verb reads and removes it.
"""

import json
import os
import stat
import sys
import tempfile

from .releases import current_release, releases_dir
from .runs import active_run_id, base_env, run_meta, runs_dir
from .venvs import ready_venv, setup_spec, venv_path


def run_environment(p):
    """(cwd, env) for a command run as the active run would see it."""
    workdir = p["workdir"]
    env = dict(base_env(), **(p.get("env") or {}))
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
    elif os.path.isabs(p.get("python") or ""):
        folder = os.path.dirname(p["python"])
        rest = [d for d in env.get("PATH", "").split(os.pathsep) if d and d != folder]
        env["PATH"] = os.pathsep.join([folder] + rest)
    return workdir, env


def op_exec_ticket(p):
    """Keep an exec's parameters in a new file of this user's alone (mode 0600, a random
    name, never through a link); answers its path."""
    fd, path = tempfile.mkstemp(prefix="dflashctl-exec-", suffix=".json")
    with os.fdopen(fd, "w") as out:
        json.dump(p, out)
    return {"ticket": path}


def _redeem(path):
    """The parameters a ticket holds, once: the file is removed as it is read. Only a
    plain file of this user's that nobody else can read or write counts."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as ticket:
        info = os.fstat(ticket.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise OSError(f"not a ticket of this user's: {path}")
        os.unlink(path)
        return json.load(ticket)


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
    p = json.loads(params_json)
    if "ticket" in p:
        try:
            p = _redeem(p["ticket"])
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"dflashctl: cannot read the exec's parameters: {exc}\n")
            return 2
    return exec_command(p)
