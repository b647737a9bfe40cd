"""`pct` stand-in: status, start, stop, exec, push, pull, list, config, create, set,
snapshot, listsnapshot, rollback and destroy on the sandboxes in state.py.

Messages and exit statuses follow Proxmox's pct (pve-container, src/PVE/CLI/pct.pm and
src/PVE/API2/LXC/Status.pm) and lxc-attach; each one says where it comes from. Errors of
the Perl tools are `die` messages: printed on stderr, exit status 255 unless errno was set.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import sys

try:  # imported by the tests as tests.host.<module>
    from . import pct_create, state
except ImportError:  # run as bin/pct or bin/pvesh, with this folder on sys.path
    import pct_create
    import state
PveError = state.PveError

CLONE_NEWNS = 0x00020000
PVE_CLI_PATH = "/sbin:/bin:/usr/sbin:/usr/bin"
USAGE = """\
USAGE: pct <COMMAND> [ARGS] [OPTIONS]
       pct status <vmid>
       pct start <vmid>
       pct stop <vmid>
       pct exec <vmid> [<extra-args>]
       pct push <vmid> <file> <destination> [OPTIONS]
       pct pull <vmid> <path> <destination> [OPTIONS]
       pct list
       pct config <vmid>
       pct create <vmid> <ostemplate> [OPTIONS]
       pct set <vmid> [OPTIONS]
       pct snapshot <vmid> <snapname>
       pct listsnapshot <vmid>
       pct rollback <vmid> <snapname> [OPTIONS]
       pct destroy <vmid>
       pct resize <vmid> <disk> <size> [OPTIONS]
"""


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write(USAGE)
        return 255
    command, args = argv[0], argv[1:]
    handler = COMMANDS.get(command)
    if handler is None:
        sys.stderr.write(f"unknown command 'pct {command}'\n{USAGE}")
        return 255
    try:
        return handler(state.state_dir(), args)
    except PveError as err:
        sys.stderr.write(f"{err}\n")
        return err.exit_code


def _split_options(args: list[str], flags: set[str]) -> tuple[list[str], dict[str, str]]:
    """Positional arguments and `--name value` / `-name value` options, like PVE's CLI."""
    positional: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        name, has_value, value = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name in flags:
            if not has_value:
                if i + 1 >= len(args):
                    raise PveError(f"400 missing value for option '{name}'")
                i += 1
                value = args[i]
            options[name] = value
        else:
            positional.append(arg)
        i += 1
    return positional, options


def _need_args(args: list[str], names: list[str], command: str) -> None:
    """PVE::CLIHandler's answer to a wrong number of positional arguments."""
    if len(args) != len(names):
        problem = "not enough arguments" if len(args) < len(names) else "too many arguments"
        usage = " ".join(f"<{name}>" for name in names)
        raise PveError(f"400 {problem}\npct {command} {usage}")


def cmd_status(root, args):
    _need_args(args, ["vmid"], "status")
    ct = state.load_container(root, args[0])
    print(f"status: {'running' if ct.is_running() else 'stopped'}")
    return 0


def cmd_start(root, args):
    _need_args(args, ["vmid"], "start")
    ct = state.load_container(root, args[0])
    with state.config_lock(ct):
        state.start_container(ct)
    state.record_task(root, "vzstart", int(args[0]))
    return 0


def cmd_stop(root, args):
    _need_args(args, ["vmid"], "stop")
    ct = state.load_container(root, args[0])
    with state.config_lock(ct):
        state.stop_container(ct)
    state.record_task(root, "vzstop", int(args[0]))
    return 0


def cmd_config(root, args):
    _need_args(args, ["vmid"], "config")
    config = state.load_container(root, args[0]).pve_config()
    for key in sorted(config):
        if key != "digest":  # pct.pm leaves the digest out
            print(f"{key}: {config[key]}")
    for key, value in state.load_container(root, args[0]).raw_lxc():  # raw lines last
        print(f"{key}: {value}")
    return 0


def cmd_list(root, args):
    containers = state.list_containers(root)
    if containers:  # pct.pm prints nothing at all for an empty list
        row = "%-10s %-10s %-12s %-20s\n"
        sys.stdout.write(row % ("VMID", "Status", "Lock", "Name"))
        for ct in containers:
            status = "running" if ct.is_running() else "stopped"
            sys.stdout.write(row % (ct.vmid, status, "", ct.conf()["hostname"]))
    return 0


def cmd_exec(root, args):
    if "--" in args:
        split = args.index("--")
        head, command = args[:split], args[split + 1 :]
    else:
        head, command = args[:1], args[1:]
    positional, options = _split_options(head, {"keep-env"})
    if len(positional) != 1:
        raise PveError("400 not enough arguments\npct exec <vmid> [<extra-args>]")
    ct = state.load_container(root, positional[0])
    if not command:
        raise PveError("missing command")  # pct.pm: die "missing command"
    pid = ct.init_pid()
    if pid is None:
        # pct.pm (exec, ~244): checked before lxc-attach runs; Perl's die, exit 255.
        raise PveError(f"container '{ct.vmid}' not running!", 255)
    # pct.pm 226-240: lxc-attach --keep-env unless `--keep-env 0`, so the SSH session's
    # variables reach the command, with the PATH that PVE's CLI handler forces on every
    # pct run (pve-common CLIHandler.pm ~688): no /usr/local/bin.
    keep_env = options.get("keep-env", "1") in ("1", "true")
    env = dict(os.environ, PATH=PVE_CLI_PATH)
    if state.container_kind(root) == "lxc":
        # pct execs lxc-attach: its exit status (128+N on signal N, 127, 126) and its
        # signal handling (SIGTERM/SIGHUP not forwarded) are the real ones.
        sys.stdout.flush()
        os.execvpe(
            "lxc-attach",
            state.lxc.attach_argv(ct.lxcpath, ct.lxc_name, command, keep_env=keep_env),
            env,
        )
    # bubblewrap fallback: lxc-attach keeps the caller's working directory when it
    # exists in the container.
    cwd = os.getcwd()
    if not os.path.isdir(f"/proc/{pid}/root{cwd}"):
        cwd = "/"
    if not keep_env:
        # lxc-attach --clear-env: only container=lxc, its default PATH and TERM remain.
        env = {"container": "lxc", "PATH": state.CONTAINER_PATH, "HOME": "/root"}
        if "TERM" in os.environ:
            env["TERM"] = os.environ["TERM"]
    nsenter = shutil.which("nsenter") or "/usr/bin/nsenter"
    # -n: the container's network namespace (the host's own unless a test gave it one).
    argv = [nsenter, "-t", str(pid), "-p", "-u", "-n", "-m", "-r", f"--wd={cwd}", "--", *command]
    # A child, not exec: lxc-attach reports a command killed by signal N as exit status
    # 128+N (older lxc-attach returned 0 there, lxc issue 4203), while nsenter would die
    # of the same signal. stdin, stdout and stderr are inherited and pass straight through.
    sys.stdout.flush()
    child = subprocess.Popen(argv, env=env)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda signum, _frame: child.send_signal(signum))
    status = child.wait()
    return 128 - status if status < 0 else status


def _setns_mount(pid: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY)
    except OSError:
        raise PveError("failed to open the container's mount namespace") from None
    if libc.setns(fd, CLONE_NEWNS) != 0:
        raise PveError("failed to enter the container's mount namespace")
    os.close(fd)
    os.chdir("/")


def _create_file(path: str, perms: str | None) -> int:
    """pct.pm create_file: O_EXCL first (mode 0666 & ~umask), else truncate in place."""
    mode = None
    if perms is not None:
        text = perms if perms.startswith("0") else "0" + perms  # octal by default
        try:
            mode = int(text, 16) if text.lower().startswith("0x") else int(text, 8)
        except ValueError:
            raise PveError(f"invalid mode: '{perms}'") from None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0)
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
    except OSError:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        except OSError as err:
            raise PveError(f"failed to create file: {path}: {err.strerror}") from None
    if mode is not None:
        os.fchmod(fd, mode)
    return fd


def _copy(src_fd: int, dst_fd: int) -> None:
    """File::Copy's copy(): on a failed write it stops and returns false, silently."""
    while chunk := os.read(src_fd, 1 << 20):
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(dst_fd, view) :]
            except OSError:
                return


def cmd_push(root, args):
    positional, options = _split_options(args, {"perms", "user", "group"})
    _need_args(positional, ["vmid", "file", "destination"], "push")
    vmid, file, dest = positional
    # pct.pm (push): the running check comes first, so an unknown vmid says this too.
    try:
        ct = state.load_container(root, vmid)
    except PveError:
        ct = None
    if ct is None or ct.init_pid() is None:
        raise PveError("can only push files to a running CT")
    # The copy runs in a task worker (fork_worker 'push_file'). Its die reaches only
    # stderr, the copy's own result is ignored (pct.pm ~791), and the CLI handler exits
    # 0 after a worker whatever happened (CLIHandler.pm ~717).
    worker = os.fork()
    if worker == 0:
        status = 0
        try:
            _push_worker(ct, file, dest, options.get("perms"))
        except PveError as err:
            sys.stderr.write(f"{err}\n")
            status = 1
        sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(worker, 0)
    state.record_task(root, "push_file", ct.vmid, "OK" if status == 0 else "push failed")
    return 0


def _push_worker(ct, file: str, dest: str, perms: str | None) -> None:
    pid = ct.init_pid()
    try:
        src_fd = os.open(file, os.O_RDONLY)
    except OSError:
        raise PveError(f"failed to open {file} for reading") from None
    # Like pct.pm: open the source here, then create the destination from inside the
    # container's mount namespace, so the container's own mounts (read-only /) apply.
    _setns_mount(pid)
    dst_fd = _create_file(dest, perms)
    _copy(src_fd, dst_fd)
    os.close(dst_fd)
    os.close(src_fd)


def cmd_pull(root, args):
    positional, options = _split_options(args, {"perms", "user", "group"})
    _need_args(positional, ["vmid", "path", "destination"], "pull")
    vmid, path, dest = positional
    ct = state.load_container(root, vmid)
    pid = ct.init_pid()
    if pid is None:
        raise PveError("can only pull files from a running VM")  # pct.pm (pull), sic
    dst_fd = _create_file(dest, options.get("perms"))
    _setns_mount(pid)
    try:
        src_fd = os.open(path, os.O_RDONLY)
    except OSError as err:
        raise PveError(f"failed to open {path}: {err.strerror}") from None
    _copy(src_fd, dst_fd)
    os.close(dst_fd)
    os.close(src_fd)
    return 0


COMMANDS = {
    "status": cmd_status,
    "start": cmd_start,
    "stop": cmd_stop,
    "list": cmd_list,
    "config": cmd_config,
    "exec": cmd_exec,
    "push": cmd_push,
    "pull": cmd_pull,
    **pct_create.COMMANDS,
}
