"""`pct create`, `set`, `snapshot`, `listsnapshot`, `rollback`, `destroy` and `resize` of the
stand-in (creating from an OCI archive: oci.py).

Their options, validation texts and exit statuses follow pve-container 94f5585 (read for
this): src/PVE/CLI/pct.pm (the command table: create is `create_vm` with `vmid` and
`ostemplate` as positional arguments, set is `update_vm`, snapshot/rollback the Snapshot
API), src/PVE/API2/LXC.pm (create_vm: "unable to create CT <vmid> - ..."),
src/PVE/LXC/Config.pm (the devN format: path, mode `0[0-7]{3}`, uid, gid, deny-write;
256 devices; "<path> is not a valid device path", "Path has to be defined"),
src/PVE/LXC/Tools.pm (get_device_mode_and_rdev: "Device <path> does not exist", "<path>
is not a device") and pve-common's JSONSchema/CLIHandler ("400 Parameter verification
failed." followed by one `<option>: <problem>` line per bad option; a die exits 255).
The table of what each one does is in tests/host/README.md.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time

try:  # imported by the tests as tests.host.<module>
    from . import oci, pve_conf, state
except ImportError:  # run as bin/pct, with this folder on sys.path
    import oci
    import pve_conf
    import state
PveError = state.PveError

MAX_DEVICES = 256  # Config.pm $MAX_DEVICES
# Options of create_vm / update_vm that this stand-in knows (Config.pm $confdesc, the
# part a GPU container uses); any other is refused as the schema refuses it.
_INTEGER = {"cores", "memory", "swap", "unprivileged", "start", "onboot"}
_KNOWN = {
    "hostname", "cores", "memory", "swap", "rootfs", "storage", "unprivileged", "features",
    "ostype", "start", "onboot", "password", "description", "tags", "arch", "nameserver",
    "searchdomain", "timezone", "ssh-public-keys", "entrypoint", "cmode", "env",
}  # fmt: skip
_DEFAULT_SNAPSHOT_STORAGES = ["local-lvm", "local-zfs"]  # thin LVM, ZFS: snapshots; dir: none


def _known(name: str) -> bool:
    return name in _KNOWN or bool(re.fullmatch(r"(net|mp)\d+", name)) or _device_key(name)


def _device_key(name: str) -> bool:
    match = re.fullmatch(r"dev(\d+)", name)
    return bool(match) and int(match.group(1)) < MAX_DEVICES


def _options(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """Positional arguments, then `--name value` options (every option takes a value)."""
    positional: list[str] = []
    options: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-"):
            name, has_value, value = arg.lstrip("-").partition("=")
            if not has_value:
                if i + 1 >= len(args):
                    raise PveError(f"400 Parameter verification failed.\n{name}: missing value")
                i += 1
                value = args[i]
            options[name] = value
        else:
            positional.append(arg)
        i += 1
    return positional, options


def _verify(options: dict[str, str], allowed_extra: set[str]) -> None:
    problems = []
    for name, value in options.items():
        if name in allowed_extra:
            continue
        if not _known(name):
            problems.append(
                f"{name}: property is not defined in schema and the schema does not allow "
                "additional properties"
            )
        elif name in _INTEGER and not re.fullmatch(r"-?\d+", value):
            problems.append(f"{name}: type check ('integer') failed - got '{value}'")
        elif name == "cores" and int(value) < 1:
            problems.append(f"{name}: value must have a minimum value of 1")
        elif name == "memory" and int(value) < 16:
            problems.append(f"{name}: value must have a minimum value of 16")
        elif _device_key(name):
            try:
                pve_conf.parse_device(value)
            except ValueError as err:
                problems.append(f"{name}: {err}")
    if problems:
        raise PveError("400 Parameter verification failed.\n" + "\n".join(problems), 255)


def _check_devices(root, options: dict[str, str]) -> None:
    for name, value in options.items():
        if _device_key(name):
            try:
                pve_conf.device_on_host(root, pve_conf.parse_device(value)["path"])
            except LookupError as err:
                raise PveError(str(err), 255) from None


def cmd_create(root, args):
    positional, options = _options(args)
    if len(positional) != 2:
        problem = "not enough arguments" if len(positional) < 2 else "too many arguments"
        raise PveError(f"400 {problem}\npct create <vmid> <ostemplate> [OPTIONS]")
    vmid_text, ostemplate = positional
    if not vmid_text.isdigit():
        raise PveError(
            f"400 Parameter verification failed.\nvmid: type check ('integer') failed - got "
            f"'{vmid_text}'"
        )
    vmid = int(vmid_text)
    _verify(options, set())
    ct = state.Container(root, vmid)
    if ct.exists():
        node = state.node_name(root)
        raise PveError(f"unable to create CT {vmid} - CT {vmid} already exists on node '{node}'")
    storage, _, volume = ostemplate.partition(":")
    template = pve_conf.host_root(root) / "var/lib/vz/template/cache" / volume.rpartition("/")[2]
    if not volume.startswith("vztmpl/") or not template.is_file():
        raise PveError(f"unable to create CT {vmid} - volume '{ostemplate}' does not exist")
    _check_devices(root, options)
    from_oci = oci.is_oci_archive(template)
    if from_oci and oci.version_tuple(pve_version(root)) < oci.OCI_RELEASE:
        # Unpacked as a system template, which has no /etc/os-release: Setup's detection.
        raise PveError(f"unable to create CT {vmid} - unable to detect OS distribution")
    rootfs = options.pop("rootfs", f"{options.pop('storage', 'local')}:4")
    options.pop("storage", None)
    disk_storage, _, size = rootfs.partition(":")
    start = options.pop("start", "0") == "1"
    conf = pve_conf.PveConf(pve_conf.Section(), {})
    conf.main.options.update(
        arch="amd64",
        cores=options.pop("cores", "1"),
        hostname=options.pop("hostname", f"CT{vmid}"),
        memory=options.pop("memory", "512"),
        ostype="debian",
        rootfs=f"{disk_storage}:vm-{vmid}-disk-0,size={size or 4}G",
        swap=options.pop("swap", "512"),
    )
    conf.main.options.update(options)
    said = []
    if from_oci:
        said = ["Detected OCI archive"]
        said += oci.apply_image_config(oci.image_config(template), conf.main.options, conf.main.raw)
    state.create_container(
        root,
        vmid,
        conf.main.options["hostname"],
        memory_mb=int(conf.main.options["memory"]),
        cores=int(conf.main.options["cores"]),
    )
    pve_conf.save(root, vmid, conf)
    for line in said or [f"extracting archive '{template}'"]:
        print(line)
    print(f"Total bytes read: {template.stat().st_size}")
    state.record_task(root, "vzcreate", vmid)
    if start:
        with state.config_lock(ct):
            state.start_container(ct)
        state.record_task(root, "vzstart", vmid)
    return 0


def pve_version(root) -> str:
    """The node's PVE version (host.json `pve_version`; pvesh get /version says it too)."""
    return state.host_settings(root).get("pve_version", "8.2.4")


def _conf_of(root, vmid_text: str) -> tuple[state.Container, pve_conf.PveConf]:
    ct = state.load_container(root, vmid_text)
    conf = pve_conf.load(root, ct.vmid)
    if conf is None:  # a fixture's container: its fixed configuration becomes a file
        options = {k: str(v) for k, v in ct.pve_config().items() if k != "digest"}
        conf = pve_conf.PveConf(pve_conf.Section(options), {})
    return ct, conf


def cmd_set(root, args):
    positional, options = _options(args)
    if len(positional) != 1:
        raise PveError("400 not enough arguments\npct set <vmid> [OPTIONS]")
    ct, conf = _conf_of(root, positional[0])
    deletes = [d for d in re.split(r"[,;\s]+", options.pop("delete", "")) if d]
    _verify(options, set())
    _check_devices(root, options)
    with state.config_lock(ct):
        for name in deletes:
            conf.main.options.pop(name, None)
        conf.main.options.update(options)
        pve_conf.save(root, ct.vmid, conf)
        if "hostname" in options:
            ct.conf_path.write_text(json.dumps({**ct.conf(), "hostname": options["hostname"]}))
    return 0


def _can_snapshot(root, conf: pve_conf.PveConf) -> bool:
    storage = conf.main.options.get("rootfs", "local:").split(":", 1)[0]
    allowed = state.host_settings(root).get("snapshot_storages", _DEFAULT_SNAPSHOT_STORAGES)
    return storage in allowed


def cmd_snapshot(root, args):
    positional, options = _options(args)
    if len(positional) != 2:
        raise PveError("400 not enough arguments\npct snapshot <vmid> <snapname> [OPTIONS]")
    ct, conf = _conf_of(root, positional[0])
    name = positional[1]
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_\-]*", name) or len(name) > 40:
        raise PveError(f"400 Parameter verification failed.\nsnapname: invalid format - {name}")
    if name in conf.snapshots:
        raise PveError(f"snapshot name '{name}' already used")  # AbstractConfig snapshot_prepare
    if not _can_snapshot(root, conf):
        raise PveError("snapshot feature is not available")  # AbstractConfig snapshot_prepare
    with state.config_lock(ct):
        saved = pve_conf.Section(dict(conf.main.options), list(conf.main.raw))
        saved.options.pop("parent", None)
        if "parent" in conf.main.options:
            saved.options["parent"] = conf.main.options["parent"]
        saved.options["snaptime"] = str(int(time.time()))
        if options.get("description"):
            saved.options["description"] = options["description"]
        conf.snapshots[name] = saved
        conf.main.options["parent"] = name
        keep = ct.dir / "snapshots" / name
        shutil.copytree(ct.rootfs_root, keep / "root", symlinks=True)
        pve_conf.save(root, ct.vmid, conf)
    state.record_task(root, "vzsnapshot", ct.vmid)
    return 0


def cmd_listsnapshot(root, args):
    positional, _ = _options(args)
    if len(positional) != 1:
        raise PveError("400 not enough arguments\npct listsnapshot <vmid>")
    _, conf = _conf_of(root, positional[0])
    for name, section in conf.snapshots.items():
        print(f"`-> {name:<20} {section.options.get('description', 'no-description')}")
    print("`-> current             You are here!")
    return 0


def cmd_rollback(root, args):
    positional, options = _options(args)
    if len(positional) != 2:
        raise PveError("400 not enough arguments\npct rollback <vmid> <snapname> [OPTIONS]")
    ct, conf = _conf_of(root, positional[0])
    name = positional[1]
    if name not in conf.snapshots:
        raise PveError(f"snapshot '{name}' does not exist")  # AbstractConfig snapshot_rollback
    with state.config_lock(ct):
        if ct.is_running():  # LXC's rollback stops a running container first
            state.stop_container(ct)
        saved = conf.snapshots[name]
        conf.main = pve_conf.Section(dict(saved.options), list(saved.raw))
        conf.main.options.pop("snaptime", None)
        conf.main.options["parent"] = name
        keep = ct.dir / "snapshots" / name / "root"
        shutil.rmtree(ct.rootfs_root, ignore_errors=True)
        shutil.copytree(keep, ct.rootfs_root, symlinks=True)
        pve_conf.save(root, ct.vmid, conf)
        if options.get("start") == "1":
            state.start_container(ct)
    state.record_task(root, "vzrollback", ct.vmid)
    return 0


def cmd_destroy(root, args):
    positional, _ = _options(args)
    if len(positional) != 1:
        raise PveError("400 not enough arguments\npct destroy <vmid> [OPTIONS]")
    ct = state.load_container(root, positional[0])
    if ct.is_running():
        raise PveError(f"CT {ct.vmid} is running - destroy failed")  # API2/LXC.pm destroy_vm
    state.destroy_container(ct)
    return 0


_SIZE = re.compile(r"\+?\d+(\.\d+)?[KMGT]?")  # resize_vm's size pattern
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _format_size(size: int) -> str:
    """pve-common's format_size: the largest unit that divides it."""
    for unit in ("T", "G", "M", "K"):
        if size % _UNITS[unit] == 0:
            return f"{size // _UNITS[unit]}{unit}"
    return str(size)


def cmd_resize(root, args):
    """API2/LXC.pm resize_vm: `+N` adds to the volume's size, `N` is the new size (no unit:
    bytes, JSONSchema parse_size); the early checks die before the worker (exit 255)."""
    positional, options = _options(args)
    if len(positional) != 3:
        raise PveError("400 not enough arguments\npct resize <vmid> <disk> <size> [OPTIONS]")
    vmid_text, disk, size_text = positional
    problems = []
    if disk != "rootfs" and not re.fullmatch(r"mp\d+", disk):
        problems.append(
            f"disk: value '{disk}' does not have a value in the enumeration 'rootfs, mp0, ...'"
        )
    if not _SIZE.fullmatch(size_text):
        problems.append("size: value does not match the regex pattern")
    if problems:
        raise PveError("400 Parameter verification failed.\n" + "\n".join(problems), 255)
    ct, conf = _conf_of(root, vmid_text)
    volume = conf.main.options.get(disk)
    if volume is None:
        raise PveError(f"unable to parse volume '{disk}'")  # parse_volume of an unset key
    current = pve_conf._size(volume.rpartition("size=")[2].split(",")[0])
    number = size_text.lstrip("+")
    request = int(float(number.rstrip("KMGT")) * _UNITS[number[-1] if number[-1] in "KMGT" else ""])
    new = current + request if size_text.startswith("+") else request
    if new < current:
        raise PveError("unable to shrink disk size")
    if new == current:
        raise PveError("disk is already at specified size")
    with state.config_lock(ct):
        head = re.sub(r",?size=[^,]*", "", volume)
        conf.main.options[disk] = f"{head},size={_format_size(new)}"
        pve_conf.save(root, ct.vmid, conf)
    state.record_task(root, "resize", ct.vmid)
    return 0


COMMANDS = {
    "create": cmd_create,
    "set": cmd_set,
    "snapshot": cmd_snapshot,
    "listsnapshot": cmd_listsnapshot,
    "rollback": cmd_rollback,
    "destroy": cmd_destroy,
    "resize": cmd_resize,
}

if __name__ == "__main__":
    sys.exit("run as `pct <command>`")
