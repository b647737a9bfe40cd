"""The remote half of deploy, restart, stop and runs: one stdlib-only script.

It runs where the trainer runs (inside the container, or on the host when there is
no container), fed on stdin to `<container.python> -S - <op>`, so nothing has to be
installed there. Its parameters arrive as a `PARAMS_JSON = '...'` line put in
front of this text; each operation prints one JSON object on stdout:
`{"ok": true, ...}` or `{"ok": false, "error": ..., "hint": ...}` (exit status 1).

Operations (each one round trip):
  inspect  the current release and its real manifest, runs to stop; changes nothing
  launch   stop stale runs, swap `current` to the release, start the run detached,
           record it, garbage-collect old releases (a deploy with nothing to send,
           and restart)
  deploy   build the release (unpack an archive of changed files into
           releases/<id>.partial, link the unchanged ones from the base release,
           validate, rename to releases/<id>), then launch, in one call
  stop     stop the active run and hand-started ones
  runs     runs and their real state (from pid and exit_code files, never from logs)
  prune    remove ended runs' folders beyond the newest N (never the active or a running one)
  metrics  runs' metrics.jsonl records, following each run's resumed-from lineage

Runs on Python 3.6 and later (f-strings, no annotations, no walrus), since the
container's python may be older than ours.
"""

import errno
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tarfile
import time

MANIFEST_NAME = "MANIFEST.json"
KILL_WAIT_S = 5.0
ABANDONED_UPLOAD_S = 60
POLL_MIN_S = 0.005
POLL_MAX_S = 0.1


class AgentError(Exception):
    def __init__(self, message, hint=None):
        Exception.__init__(self, message)
        self.message = message
        self.hint = hint


class StaleBase(AgentError):
    """The release the caller built its plan on is not what is here (any more): it
    should inspect again and send what is really missing. Nothing was changed."""


# --------------------------------------------------------------------------- small file helpers


def read_text(path, default=None):
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return default


def write_atomic(path, text):
    """Write via a temporary name and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def lock_workdir(workdir):
    """One deploy/stop at a time per workdir; the lock dies with the process."""
    os.makedirs(workdir, exist_ok=True)
    fd = os.open(os.path.join(workdir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise AgentError(
            f"another dflashctl deploy, restart or stop is running on {workdir}",
            "wait for it to finish, then try again",
        ) from None
    return fd


# --------------------------------------------------------------------------- releases


def releases_dir(workdir):
    return os.path.join(workdir, "releases")


def current_release(workdir):
    """The release id `current` points at, or None (nothing deployed, or dangling)."""
    try:
        target = os.readlink(os.path.join(workdir, "current"))
    except OSError:
        return None
    release = os.path.basename(target.rstrip("/"))
    if not os.path.isdir(os.path.join(releases_dir(workdir), release)):
        return None
    return release


def file_mode(st_mode):
    """What a manifest keeps of a file's permissions (as dflashctl/sync.py does)."""
    return "755" if st_mode & 0o100 else "644"


def real_manifest(release_dir):
    """The release's manifest checked against its files: a file edited in place
    (or removed) since it was deployed gets its real size and hash, or is left out,
    so the next deploy sends it again."""
    text = read_text(os.path.join(release_dir, MANIFEST_NAME))
    if text is None:
        return {}
    try:
        recorded = json.loads(text)
    except ValueError:
        return {}
    manifest = {}
    for rel in recorded:
        path = os.path.join(release_dir, rel)
        try:
            st = os.stat(path)
            manifest[rel] = [st.st_size, sha256_file(path), file_mode(st.st_mode)]
        except OSError:
            continue
    return manifest


def swap_current(workdir, release):
    """Point `current` at releases/<release>: a new symlink renamed over the old one."""
    link = os.path.join(workdir, "current")
    tmp = f"{link}.tmp-{os.getpid()}"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(os.path.join("releases", release), tmp)
    os.replace(tmp, link)


def safe_member_path(name):
    norm = os.path.normpath(name)
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm == ".":
        raise AgentError(f"archive member {name!r} escapes the release folder")
    return norm


def remove_leftovers(workdir, keep_archive, upload_prefix):
    """Partial releases and uploaded archives left by an interrupted deploy."""
    removed = []
    base = releases_dir(workdir)
    if os.path.isdir(base):
        for name in os.listdir(base):
            if name.endswith(".partial"):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
                removed.append(os.path.join("releases", name))
    if not upload_prefix:
        return removed
    tmpdir = os.path.dirname(keep_archive)
    try:
        names = os.listdir(tmpdir)
    except OSError:
        names = []
    for name in names:
        path = os.path.join(tmpdir, name)
        if path == keep_archive or not name.lstrip(".").startswith(upload_prefix):
            continue
        try:
            # An upload still being written keeps changing; one untouched for a while
            # was abandoned (several test hosts or users may share one /tmp).
            if time.time() - os.stat(path).st_mtime < ABANDONED_UPLOAD_S:
                continue
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


def oldest_first(base, names, stamp):
    """Ids carry their UTC second; within one second, the age of `stamp` (a file written
    once, when the release or run was made) decides."""

    def age(name):
        try:
            mtime = os.stat(os.path.join(base, name, stamp)).st_mtime_ns
        except OSError:
            mtime = 0
        return (name[:15], mtime, name)

    return sorted(names, key=age)


def gc_releases(workdir, keep, protect):
    """Keep the newest `keep` releases (ids sort by time) plus those in `protect`."""
    base = releases_dir(workdir)
    if not os.path.isdir(base):
        return []
    names = [n for n in os.listdir(base) if not n.endswith(".partial")]
    names = oldest_first(
        base, [n for n in names if os.path.isdir(os.path.join(base, n))], MANIFEST_NAME
    )
    kept = set(names[-keep:]) if keep > 0 else set()
    kept.update(p for p in protect if p)
    removed = []
    for name in names:
        if name not in kept:
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


# --------------------------------------------------------------------------- processes


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


# --------------------------------------------------------------------------- runs


def runs_dir(workdir):
    return os.path.join(workdir, "runs")


def read_int(path):
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text.split()[0])
    except (ValueError, IndexError):
        return None


def run_pid_alive(pid, run_id, table=None):
    """Is `pid` still this run's wrapper? A recycled pid belongs to someone else."""
    if pid is None:
        return False
    proc = table.get(pid) if table is not None else read_proc(pid)
    if not alive(proc):
        return False
    owner = process_env(pid, "DFLASH_RUN_ID")
    if owner is not None:
        return owner == run_id
    return any(run_id in arg for arg in proc.argv)


def run_state(workdir, run_id, table=None):
    """{"status": running|exited|killed|lost, "exit_code", "signal"} from the real state."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    code = read_int(os.path.join(run_dir, "exit_code"))
    if code is None:
        if run_pid_alive(read_int(os.path.join(run_dir, "pid")), run_id, table):
            return {"status": "running", "exit_code": None, "signal": None}
        # The wrapper may have written its exit code between the two reads.
        code = read_int(os.path.join(run_dir, "exit_code"))
    if code is None:
        return {"status": "lost", "exit_code": None, "signal": None}
    if 128 < code < 128 + 65:
        return {"status": "killed", "exit_code": code, "signal": code - 128}
    return {"status": "exited", "exit_code": code, "signal": None}


def run_record(workdir, run_id, table=None):
    run_dir = os.path.join(runs_dir(workdir), run_id)
    meta_text = read_text(os.path.join(run_dir, "meta.json"))
    try:
        meta = json.loads(meta_text) if meta_text else {}
    except ValueError:
        meta = {}
    record = {"id": run_id, "meta": meta, "pid": read_int(os.path.join(run_dir, "pid"))}
    record.update(run_state(workdir, run_id, table))
    return record


def run_ids(workdir):
    try:
        names = os.listdir(runs_dir(workdir))
    except OSError:
        return []
    base = runs_dir(workdir)
    return oldest_first(
        base, [n for n in names if os.path.isdir(os.path.join(base, n))], "launch.sh"
    )


def active_run_id(workdir):
    text = read_text(os.path.join(workdir, "active_run"))
    return text.strip() if text and text.strip() else None


# --------------------------------------------------------------------------- what to stop


def script_inside(proc, workdir):
    """Does the script `proc` runs live under workdir (resolved against its cwd)?"""
    script = script_of(proc.argv)
    try:
        cwd = os.readlink(f"/proc/{proc.pid}/cwd")
    except OSError:
        return False
    path = os.path.realpath(os.path.join(cwd, script))
    return path.startswith(os.path.realpath(workdir).rstrip("/") + "/")


def find_targets(workdir, entry, scope="container"):
    """Process groups (or single processes) to stop: our running runs, then any other
    process whose command line runs the entry script. Nothing else, and never the
    agent itself or its ancestors.

    scope "container": the container is the trainer's own, so the entry script run
    from anywhere is a stale run. scope "workdir" (no container: this machine or a
    shared host): only a script under the workdir is ours; another project's script
    of the same name is left alone."""
    table = process_table()
    mine = ancestors(os.getpid(), table)
    my_groups = set(table[p].pgid for p in mine if p in table)
    targets = []
    covered_groups = set()
    covered_pids = set()  # children of a stale trainer (e.g. data loader workers)
    active = active_run_id(workdir)

    for run_id in run_ids(workdir):
        pid = read_int(os.path.join(runs_dir(workdir), run_id, "pid"))
        if read_text(os.path.join(runs_dir(workdir), run_id, "exit_code")) is not None:
            continue
        if not run_pid_alive(pid, run_id, table) or pid in mine:
            continue
        targets.append(
            {
                "kind": "active" if run_id == active else "run",
                "run_id": run_id,
                "pid": pid,
                "pgid": pid,
                "group": True,
                "cmdline": " ".join(table[pid].argv),
            }
        )
        covered_groups.add(pid)

    for proc in sorted(table.values(), key=lambda p: p.pid):
        if not alive(proc) or proc.pid in mine or proc.pgid in covered_groups:
            continue
        if proc.pid in covered_pids:
            continue
        if not runs_entry(proc.argv, entry):
            continue
        if scope != "container" and not script_inside(proc, workdir):
            continue
        members = [p.pid for p in table.values() if p.pgid == proc.pgid and alive(p)]
        family = descendants(proc.pid, table) | set([proc.pid])
        # Signal the whole group only when it holds nothing but this process and its
        # children (the usual `setsid`/job-control case); a group shared with a shell
        # or other work gets the signal on this process and its children only.
        whole_group = proc.pgid not in my_groups and all(
            m in family or (m in table and runs_entry(table[m].argv, entry)) for m in members
        )
        run_id = process_env(proc.pid, "DFLASH_RUN_ID")
        targets.append(
            {
                "kind": "stale",
                "run_id": run_id,
                "pid": proc.pid,
                "pgid": proc.pgid if whole_group else None,
                "group": whole_group,
                "pids": sorted(family),
                "cmdline": " ".join(proc.argv),
            }
        )
        if whole_group:
            covered_groups.add(proc.pgid)
        covered_pids.update(family)
    return targets


def target_alive(target, table):
    if target["group"]:
        return any(alive(p) for p in table.values() if p.pgid == target["pgid"])
    return any(alive(table.get(pid)) for pid in target["pids"])


def send(target, sig):
    try:
        if target["group"]:
            os.killpg(target["pgid"], sig)
        else:
            for pid in target["pids"]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
    except ProcessLookupError:
        pass


def wait_gone(targets, deadline):
    """Poll until every target has exited or the deadline passes; returns when each went."""
    pending = list(targets)
    pause = POLL_MIN_S
    while pending:
        table = process_table()
        now = time.monotonic()
        for target in list(pending):
            if not target_alive(target, table):
                target["_gone_at"] = now
                pending.remove(target)
        if not pending or now >= deadline:
            break
        # Most runs end within milliseconds of SIGTERM: look again soon, then less often.
        time.sleep(min(pause, max(deadline - now, 0)))
        pause = min(pause * 2, POLL_MAX_S)
    return pending


def stop_targets(workdir, targets, grace_s):
    """SIGTERM to each group, `grace_s` to exit, then SIGKILL. Reports how each ended."""
    if not targets:
        return []
    started = time.monotonic()
    for target in targets:
        send(target, signal.SIGTERM)
    left = wait_gone(targets, started + grace_s)
    killed_at = time.monotonic()
    for target in left:
        send(target, signal.SIGKILL)
    still = wait_gone(left, killed_at + KILL_WAIT_S) if left else []
    report = []
    for target in targets:
        entry = {k: v for k, v in target.items() if not k.startswith("_")}
        if target in still:
            entry["ended"] = "still running after SIGKILL"
        elif target in left:
            entry["ended"] = "killed"
            entry["seconds"] = round(target["_gone_at"] - started, 2)
        else:
            entry["ended"] = "terminated"
            entry["seconds"] = round(target["_gone_at"] - started, 2)
        if target.get("run_id") and entry["ended"] != "still running after SIGKILL":
            entry["exit_code"] = settle_exit_code(workdir, target["run_id"], target in left)
        report.append(entry)
    return report


def settle_exit_code(workdir, run_id, was_killed):
    """The exit code the wrapper wrote; if SIGKILL took the wrapper too, write 137 for it."""
    run_dir = os.path.join(runs_dir(workdir), run_id)
    path = os.path.join(run_dir, "exit_code")
    code = read_int(path)
    if code is None and os.path.isdir(run_dir):
        code = 128 + (signal.SIGKILL if was_killed else signal.SIGTERM)
        write_atomic(path, f"{code}\n")
    return code


# --------------------------------------------------------------------------- operations


def op_inspect(p):
    workdir, entry = p["workdir"], p["entry"]
    release = current_release(workdir)
    manifest = real_manifest(os.path.join(releases_dir(workdir), release)) if release else None
    return {
        "python": platform.python_version(),
        "release": release,
        "manifest": manifest,
        "active_run": active_run_id(workdir),
        "to_stop": find_targets(workdir, entry, p.get("scope", "container")),
    }


def build_release(p):
    workdir, release, archive = p["workdir"], p["release"], p["archive"]
    base = p.get("base")
    lock = lock_workdir(workdir)
    try:
        leftovers = remove_leftovers(workdir, archive, p.get("upload_prefix"))
        os.makedirs(releases_dir(workdir), exist_ok=True)
        final = os.path.join(releases_dir(workdir), release)
        if os.path.exists(final):
            raise AgentError(f"release {release} already exists in {workdir}")
        if "expect" in p and current_release(workdir) != base:
            raise StaleBase(f"the current release is {current_release(workdir)}, not {base}")
        partial = final + ".partial"
        os.mkdir(partial)
        try:
            base_dir = base and os.path.join(releases_dir(workdir), base)
            counts = fill_release(partial, archive, base_dir)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        os.rename(partial, final)
    finally:
        try:
            os.unlink(archive)
        except OSError:
            pass
        os.close(lock)
    counts.update({"release": release, "leftovers_removed": leftovers})
    return counts


def fill_release(partial, archive, base_dir):
    unpacked = {}
    manifest = None
    with tarfile.open(archive, "r:*") as tar:
        for member in tar:
            name = safe_member_path(member.name)
            if name == MANIFEST_NAME:
                manifest = json.loads(tar.extractfile(member).read().decode("utf-8"))
                continue
            if not member.isfile():
                raise AgentError(f"archive member {member.name!r} is not a regular file")
            dest = os.path.join(partial, name)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            digest = hashlib.sha256()
            src = tar.extractfile(member)
            with open(dest, "wb") as out:
                while True:
                    chunk = src.read(1 << 20)
                    if not chunk:
                        break
                    digest.update(chunk)
                    out.write(chunk)
            os.chmod(dest, member.mode & 0o7777)
            unpacked[name] = [member.size, digest.hexdigest()]
    if manifest is None:
        raise AgentError(f"the uploaded archive has no {MANIFEST_NAME}")
    linked = copied = 0
    for rel, entry in sorted(manifest.items()):
        size, sha, mode = entry
        rel = safe_member_path(rel)
        if rel in unpacked:
            if unpacked[rel] != [size, sha]:
                raise AgentError(
                    f"{rel} arrived damaged (size or sha256 differs)",
                    "deploy again; if it repeats, check the connection",
                )
            continue
        if not base_dir:
            raise StaleBase(
                f"{rel} was not sent and there is no previous release to take it from",
                "deploy again",
            )
        src = os.path.join(base_dir, rel)
        dest = os.path.join(partial, rel)
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        try:
            os.link(src, dest)
            linked += 1
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                raise StaleBase(
                    f"{rel} is missing from the previous release",
                    "deploy again; the release was changed meanwhile",
                ) from None
            shutil.copy2(src, dest)
            copied += 1
        # Validate what we reuse: the previous release may have been edited in place.
        st = os.stat(dest)
        if st.st_size != size or sha256_file(dest) != sha:
            raise StaleBase(
                f"{rel} in the previous release changed since it was inspected", "deploy again"
            )
        if file_mode(st.st_mode) != mode:
            # Only a chmod in place since the inspection gets here (a mode change
            # locally is sent); a link shares the mode, so fix this release's own copy.
            os.unlink(dest)
            shutil.copyfile(src, dest)
            os.chmod(dest, int(mode, 8))
    write_atomic(os.path.join(partial, MANIFEST_NAME), json.dumps(manifest, sort_keys=True))
    return {"files": len(manifest), "unpacked": len(unpacked), "linked": linked, "copied": copied}


def op_stop(p):
    workdir = p["workdir"]
    lock = lock_workdir(workdir)
    try:
        stopped = stop_targets(
            workdir,
            find_targets(workdir, p["entry"], p.get("scope", "container")),
            float(p["grace_s"]),
        )
    finally:
        os.close(lock)
    return {
        "stopped": stopped,
        "all_stopped": all(s["ended"] != "still running after SIGKILL" for s in stopped),
    }


def op_launch(p):
    """Stop what runs, point `current` at the release, start the run, record it, clean up.

    The release is checked before anything is stopped; `current` is swapped only
    after the old run is gone, so an interruption before that leaves both as they were.
    """
    workdir, run_id = p["workdir"], p["run_id"]
    release = p.get("release") or current_release(workdir)
    expect = p.get("expect")
    if expect is not None and current_release(workdir) != expect["release"]:
        # The caller's plan (from its last deploy) is out of date; nothing was changed.
        raise StaleBase(
            f"the current release is {current_release(workdir)}, not {expect['release']}"
        )
    if not release:
        raise AgentError(f"nothing is deployed in {workdir} yet", "run `dflashctl deploy` first")
    release_dir = os.path.join(releases_dir(workdir), release)
    if not os.path.isdir(release_dir):
        raise AgentError(
            f"release {release} is not in {releases_dir(workdir)}", "run `dflashctl deploy`"
        )
    if not os.path.isfile(os.path.join(release_dir, p["entry"])):
        raise AgentError(
            f"{p['entry']} is not in release {release}",
            "check trainer.entry and trainer.source, then deploy again",
        )
    if expect is not None and real_manifest(release_dir) != expect["manifest"]:
        raise StaleBase(f"release {release} was changed in place")
    lock = lock_workdir(workdir)
    try:
        t0 = time.monotonic()
        stopped = stop_targets(
            workdir,
            find_targets(workdir, p["entry"], p.get("scope", "container")),
            float(p["grace_s"]),
        )
        stop_s = time.monotonic() - t0
        if any(s["ended"] == "still running after SIGKILL" for s in stopped):
            raise AgentError(
                "a previous run did not exit after SIGKILL; not launching another",
                "check the container with `ps -ef`; the process may be stuck in I/O",
            )
        launch_started = time.monotonic()
        if current_release(workdir) != release:
            swap_current(workdir, release)
        run = start_run(workdir, run_id, release, p)
        protect = [release] + [
            (r.get("meta") or {}).get("release")
            for r in (run_record(workdir, rid) for rid in run_ids(workdir) if rid != run_id)
            if r["status"] == "running"
        ]
        removed = gc_releases(workdir, int(p.get("keep_releases", 5)), protect)
        launch_s = time.monotonic() - launch_started
    finally:
        os.close(lock)
    return {
        "stopped": stopped,
        "stop_seconds": round(stop_s, 3),
        "launch_seconds": round(launch_s, 3),
        "release": release,
        "run": run,
        "releases_removed": removed,
    }


def op_deploy(p):
    """build, then launch, in one call: the new release is complete and validated
    before anything is stopped; a failed build stops nothing."""
    started = time.monotonic()
    built = build_release(p)
    built["seconds"] = round(time.monotonic() - started, 3)
    launch = {k: v for k, v in p.items() if k != "expect"}
    launched = op_launch(dict(launch, release=built["release"]))
    launched["build"] = built
    return launched


def start_run(workdir, run_id, release, p):
    run_dir = os.path.join(runs_dir(workdir), run_id)
    os.makedirs(run_dir)
    wrapper = os.path.join(run_dir, "launch.sh")
    with open(wrapper, "w", encoding="utf-8") as f:
        f.write(p["launch_script"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(p.get("env") or {})
    env.update({"DFLASH_RUN_ID": run_id, "DFLASH_RUN_DIR": run_dir, "PYTHONUNBUFFERED": "1"})
    command = list(p["command"])
    log = open(os.path.join(run_dir, "train.log"), "ab")
    try:
        # New session (pid = pgid = sid), no terminal, stdin from /dev/null and our
        # pipes closed, so the exec session that started us returns at once.
        proc = subprocess.Popen(
            ["/bin/sh", wrapper, run_dir] + command,
            cwd=os.path.join(workdir, "current"),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
        )
    except OSError as exc:
        raise AgentError(f"could not start {command[0]}: {exc.strerror}") from None
    finally:
        log.close()
    proc.returncode = 0  # never waited for here: the run outlives this script
    started = time.time()
    write_atomic(os.path.join(run_dir, "pid"), f"{proc.pid}\n")
    meta = dict(p.get("meta") or {})
    meta.update(
        {
            "run_id": run_id,
            "release": release,
            "command": command,
            "pid": proc.pid,
            "cwd": os.path.join(workdir, "current"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "started_unix": round(started, 3),
        }
    )
    write_atomic(os.path.join(run_dir, "meta.json"), json.dumps(meta, indent=2, sort_keys=True))
    write_atomic(os.path.join(workdir, "active_run"), run_id + "\n")
    return {"id": run_id, "pid": proc.pid, "run_dir": run_dir, "started": meta["started"]}


def op_runs(p):
    workdir = p["workdir"]
    table = process_table()
    wanted = p.get("run_id")
    if wanted == "@active":
        wanted = active_run_id(workdir)
        wanted = [wanted] if wanted else []
    else:
        wanted = [wanted] if wanted else run_ids(workdir)
    runs = [
        run_record(workdir, rid, table)
        for rid in wanted
        if os.path.isdir(os.path.join(runs_dir(workdir), rid))
    ]
    return {"active_run": active_run_id(workdir), "release": current_release(workdir), "runs": runs}


def tree_bytes(path):
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def op_prune(p):
    """Remove the folders of ended runs beyond the newest `keep`. Never the active run
    (launched last) nor one still running, whatever its age. `only` limits it to the
    ids a user confirmed (a run launched meanwhile shifts the oldest ones); `dry` only
    says what would go."""
    workdir = p["workdir"]
    keep = int(p["keep"])
    only = set(p["only"]) if p.get("only") is not None else None
    table = process_table()
    active = active_run_id(workdir)
    ids = run_ids(workdir)
    older = ids[: max(0, len(ids) - keep)]
    removed, spared = [], []
    for rid in older:
        if only is not None and rid not in only:
            continue
        state = run_state(workdir, rid, table)
        if rid == active or state["status"] == "running":
            spared.append(rid)
            continue
        path = os.path.join(runs_dir(workdir), rid)
        size = tree_bytes(path)
        if not p.get("dry"):
            shutil.rmtree(path)
        removed.append(dict(state, id=rid, bytes=size))
    return {"removed": removed, "spared": spared, "runs": len(ids), "dry": bool(p.get("dry"))}


# --------------------------------------------------------------------------- metrics

METRICS_FILE = "metrics.jsonl"  # written by the trainer in its run folder
LINEAGE_MAX = 100  # resumed-from hops followed at most (a loop in meta.json ends too)


def read_metrics(run_dir, max_points):
    """The records of run_dir/metrics.jsonl: every eval record, and at most `max_points`
    step records, evenly spread, the last always kept. A line still being written (or
    any line that is not a JSON object) is skipped."""
    steps, others = [], []
    try:
        f = open(os.path.join(run_dir, METRICS_FILE), "rb")
    except OSError:
        return None, 0
    with f:
        for raw in f:
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            (steps if record.get("kind") == "step" else others).append(record)
    total = len(steps)
    if max_points and total > max_points:
        stride = total / float(max_points)
        picked = [steps[int(i * stride)] for i in range(max_points - 1)]
        steps = picked + [steps[-1]]
    return steps + others, total


def is_run_folder(workdir, run_id):
    """A run id names a folder right under runs/ (never a path elsewhere)."""
    if not run_id or "/" in run_id or run_id.startswith("."):
        return False
    return os.path.isdir(os.path.join(runs_dir(workdir), run_id))


def op_metrics(p):
    """Each run's metrics.jsonl, with those of the runs it resumed from (meta.json's
    `resumed_from`, a run id), oldest first, so a curve can continue across redeploys."""
    workdir = p["workdir"]
    table = process_table()
    answers, missing = [], []
    for wanted in p["run_ids"]:
        run_id = active_run_id(workdir) if wanted == "@active" else wanted
        if not is_run_folder(workdir, run_id):
            missing.append(wanted)
            continue
        lineage, seen = [], set()
        while run_id and run_id not in seen and len(lineage) < LINEAGE_MAX:
            seen.add(run_id)
            if not is_run_folder(workdir, run_id):
                lineage.append({"id": run_id, "missing": True})  # pruned since
                break
            record = run_record(workdir, run_id, table)
            rows, total = read_metrics(os.path.join(runs_dir(workdir), run_id), p.get("max_points"))
            lineage.append({"id": run_id, "record": record, "metrics": rows, "step_records": total})
            meta = record["meta"] if isinstance(record["meta"], dict) else {}
            parent = meta.get("resumed_from")
            run_id = parent if isinstance(parent, str) else None
        lineage.reverse()
        answers.append({"id": lineage[-1]["id"], "lineage": lineage})
    return {"runs": answers, "missing": missing, "active_run": active_run_id(workdir)}


OPERATIONS = {
    "inspect": op_inspect,
    "deploy": op_deploy,
    "launch": op_launch,
    "stop": op_stop,
    "runs": op_runs,
    "prune": op_prune,
    "metrics": op_metrics,
}


def main(argv, params_json):
    if len(argv) < 1 or argv[0] not in OPERATIONS:
        sys.stdout.write(
            json.dumps(
                {"ok": False, "error": f"unknown agent operation {(argv[:1] or [None])[0]!r}"}
            )
        )
        return 2
    try:
        result = OPERATIONS[argv[0]](json.loads(params_json))
    except AgentError as exc:
        answer = {"ok": False, "error": exc.message, "hint": exc.hint}
        if isinstance(exc, StaleBase):
            answer["stale"] = True
        sys.stdout.write(json.dumps(answer))
        return 1
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        sys.stdout.write(json.dumps({"ok": False, "error": f"{exc.strerror or exc}{where}"}))
        return 1
    result["ok"] = True
    sys.stdout.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    # Fed on stdin, PARAMS_JSON precedes this text; run as a file, params are argv[2].
    _params = globals().get("PARAMS_JSON") or (sys.argv[2] if len(sys.argv) > 2 else "{}")
    sys.exit(main(sys.argv[1:2], _params))
