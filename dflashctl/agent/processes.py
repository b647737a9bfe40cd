"""The process table, read from /proc: who runs what, and which python runs which script."""

import os


class Proc:
    __slots__ = ("pid", "ppid", "pgid", "state", "start", "argv")

    def __init__(self, pid, ppid, pgid, state, start, argv):
        self.pid, self.ppid, self.pgid, self.state = pid, ppid, pgid, state
        self.start, self.argv = start, argv


def read_proc(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("utf-8", "replace")
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]] if raw else []
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], int(fields[19]), argv)


def process_table():
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                table[proc.pid] = proc
    return table


def alive(proc):
    return proc is not None and proc.state not in ("Z", "X")


def process_env(pid, name):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode("utf-8", "replace")
    return None


def ancestors(pid, table):
    seen = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        pid = table[pid].ppid
    return seen


def descendants(pid, table):
    children = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


# Interpreter options that take a value as the next argument.
_OPTIONS_WITH_VALUE = ("-W", "-X", "--check-hash-based-pycs")


def script_of(argv):
    """The script a python command line runs, or None (not python, -c, -m, stdin)."""
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-c", "-m", "-"):
            return None
        if arg == "--":
            i += 1
            break
        if arg.startswith("-"):
            i += 2 if arg in _OPTIONS_WITH_VALUE else 1
            continue
        break
    return argv[i] if i < len(argv) else None


def runs_entry(argv, entry):
    script = script_of(argv)
    if script is None:
        return False
    script = os.path.normpath(script)
    entry = os.path.normpath(entry)
    return script == entry or script.endswith("/" + entry)


def path_inside(path, folder):
    return os.path.realpath(path).startswith(os.path.realpath(folder).rstrip("/") + "/")


def belongs_to_workdir(proc, workdir):
    """Is this trainer process one of this workdir's? Its script or its working
    directory lies under the workdir, and it is no run that another workdir launched
    (two experiments may share a container; neither may stop the other's runs)."""
    owner = process_env(proc.pid, "DFLASH_RUN_DIR")
    if owner and not path_inside(owner, workdir):
        return False
    try:
        cwd = os.readlink(f"/proc/{proc.pid}/cwd")
    except OSError:
        return False
    script = os.path.join(cwd, script_of(proc.argv))
    return (
        path_inside(script, workdir)
        or cwd == os.path.realpath(workdir)
        or path_inside(cwd, workdir)
    )
