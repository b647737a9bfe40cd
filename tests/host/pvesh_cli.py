"""`pvesh` stand-in: the LXC paths dflashctl uses, answered from state.py in the real JSON shape.

    pvesh get /version
    pvesh get /nodes
    pvesh get /nodes/<node>/lxc
    pvesh get /nodes/<node>/lxc/<vmid>/status/current
    pvesh get /nodes/<node>/lxc/<vmid>/config
    pvesh get /nodes/<node>/lxc/<vmid>/interfaces
    pvesh create /nodes/<node>/lxc/<vmid>/status/start|stop     -> a UPID
    pvesh get /nodes/<node>/tasks/<upid>/status
    pvesh get /nodes/<node>/storage/<storage>/content          (its CT templates)
    pvesh create /nodes/<node>/storage/<storage>/oci-registry-pull -reference R [-filename F]

proxmoxer's command backends (proxmoxer/backends/command_base.py) call
`pvesh <get|create|set|delete> <path> [-key value ...] --output-format json` and guess the
HTTP status from stderr: a line starting with "NNN " gives that status, a UPID gives 200,
anything else 500. Errors here keep pvesh's real text, so they map the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

try:  # imported by the tests as tests.host.<module>
    from . import oci, pve_conf, state
except ImportError:  # run as bin/pct or bin/pvesh, with this folder on sys.path
    import oci
    import pve_conf
    import state
PveError = state.PveError

VERSION = {"release": "8.2", "repoid": "faa83925c9641325", "version": "8.2.4"}


def main(argv: list[str]) -> int:
    if argv[:1] == ["__ha_start"]:  # the stand-in's ha-manager, started by an HA start
        return _ha_start(state.state_dir(), int(argv[1]), float(argv[2]))
    try:
        method, path, params, output = _parse(argv)
        failing = state.host_settings(state.state_dir()).get("failing_paths", {})
        if path.strip("/") in failing:  # a test breaks this call, with the real text
            raise PveError(failing[path.strip("/")], 255)
        result = _dispatch(state.state_dir(), method, path, params)
    except PveError as err:
        sys.stderr.write(f"{err}\n")
        return err.exit_code
    if output == "json-pretty":
        print(json.dumps(result, indent=4, sort_keys=True))
    elif result is not None:
        print(json.dumps(result, sort_keys=True))
    return 0


def _parse(argv: list[str]) -> tuple[str, str, dict[str, str], str]:
    if len(argv) < 2 or argv[0] not in ("get", "create", "set", "delete", "ls", "usage"):
        raise PveError("USAGE: pvesh <get|set|create|delete|ls|usage> <api_path> [OPTIONS]")
    method, path = argv[0], argv[1]
    params: dict[str, str] = {}
    output = "text"
    rest = argv[2:]
    i = 0
    while i < len(rest):
        name = rest[i].lstrip("-")
        value = rest[i + 1] if i + 1 < len(rest) else ""
        if name == "output-format":
            output = value
        elif name in ("noproxy", "human-readable", "noborder", "noheader"):
            i -= 1  # flags without a value
        else:
            params[name] = value
        i += 2
    return method, path, params, output


def _storage(root, method: str, path: str, storage: str, what: str, params: dict[str, str]):
    """Storage `local` (a directory storage holding CT templates) only."""
    cache = pve_conf.host_root(root) / "var/lib/vz/template/cache"
    if what == "content" and method == "get":
        if storage != "local":
            return []
        files = sorted(cache.glob("*")) if cache.is_dir() else []
        return [
            {"volid": f"local:vztmpl/{f.name}", "content": "vztmpl", "format": "tzst"
             if f.name.endswith(".zst") else "tar", "size": f.stat().st_size}
            for f in files if f.is_file()
        ]  # fmt: skip
    if what == "oci-registry-pull" and method == "create":
        settings = state.host_settings(root)
        if oci.version_tuple(settings.get("pve_version", VERSION["version"])) < oci.OCI_RELEASE:
            # pvesh.pm: a path the API of this release does not have (from memory of it)
            raise PveError(f"no 'create' handler for '{path}'", 255)
        if storage != "local":
            raise PveError(f"storage '{storage}' is not configured for content-type 'vztmpl'", 255)
        reference = params.get("reference", "")
        name = oci.pulled_name(reference, params.get("filename"))
        if (cache / name).exists():
            raise PveError(f"refusing to override existing file '{name}'", 255)
        source = settings.get("oci_registry", {}).get(reference)
        if source is None:  # skopeo copy in the task worker, failing: the task fails
            raise PveError(
                f"command 'skopeo copy docker://{reference} oci-archive:{cache}/{name}.tmp' "
                "failed: exit code 1", 255
            )  # fmt: skip
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, cache / name)
        return state.record_task(root, "ociregistrypull", 0)
    raise PveError(f"no '{method}' handler for '{path}'", 255)


def _dispatch(root, method: str, path: str, params: dict[str, str]):
    parts = [p for p in path.strip("/").split("/") if p]
    node = state.node_name(root)
    if parts == ["version"] and method == "get":
        version = state.host_settings(root).get("pve_version", VERSION["version"])
        return {**VERSION, "version": version, "release": ".".join(version.split(".")[:2])}
    if parts == ["nodes"] and method == "get":
        return [
            {
                "node": node,
                "status": "online",
                "type": "node",
                "id": f"node/{node}",
                "maxcpu": os.cpu_count(),
                "uptime": _uptime(),
            }
        ]
    if len(parts) >= 2 and parts[0] == "nodes" and parts[1] != node:
        # pvesh on a node resolves other node names through the cluster; a name it does not
        # know fails like this (PVE::Cluster, remote_node_ip).
        raise PveError(
            f"hostname lookup '{parts[1]}' failed - failed to get address info "
            f"for: {parts[1]}: Name or service not known",
            255,
        )
    tail = parts[2:]
    if len(tail) == 3 and tail[0] == "storage":
        return _storage(root, method, path, tail[1], tail[2], params)
    if tail == ["lxc"] and method == "get":
        return [_summary(ct) for ct in state.list_containers(root)]
    if len(tail) == 3 and tail[0] == "lxc" and tail[2] == "config" and method == "get":
        return state.load_container(root, tail[1]).pve_config()
    if len(tail) == 3 and tail[0] == "lxc" and tail[2] == "interfaces" and method == "get":
        return _interfaces(state.load_container(root, tail[1]))
    if len(tail) == 4 and tail[0] == "lxc" and tail[2] == "status":
        ct = state.load_container(root, tail[1])
        action = tail[3]
        if action == "current" and method == "get":
            return current_status(ct)
        if action == "start" and method == "create":
            return _start(root, ct)
        if action == "stop" and method == "create":
            with state.config_lock(ct):
                state.stop_container(ct)
            return state.record_task(root, "vzstop", ct.vmid)
    if len(tail) == 3 and tail[0] == "tasks" and tail[2] == "status" and method == "get":
        upid = tail[1]
        if not upid.startswith("UPID:") or len(upid.split(":")) != 9:
            # PVE::Tools::upid_decode, through the parameter check of the upid argument.
            raise PveError(
                f"400 Parameter verification failed.\nupid: unable to parse worker upid '{upid}'",
                255,
            )
        task = state.find_task(root, upid)
        if task is None:
            raise PveError(f"500 no such task '{upid}'", 255)
        return {
            k: task[k]
            for k in (
                "upid",
                "node",
                "pid",
                "pstart",
                "starttime",
                "type",
                "id",
                "user",
                "status",
                "exitstatus",
            )
        }
    # PVE::CLI::pvesh, for a path without a handler for this method.
    raise PveError(f"No '{method}' handler defined for '{'/'.join(parts)}'", 255)


def _start(root, ct: state.Container) -> str:
    """POST .../status/start. pvesh runs the task's worker itself and prints the task log
    before the UPID (pve-manager PVE/CLI/pvesh.pm; proxmoxer issue 117)."""
    conf = ct.conf()
    if conf.get("ha"):
        # pve-container Status.pm vm_start for an HA resource: a `hastart` task that only
        # asks ha-manager (`ha-manager set ct:<vmid> --state started`) and ends OK; the
        # CRM starts the container a little later.
        print(f"Requesting HA start for CT {ct.vmid}")
        subprocess.Popen(
            [sys.executable, sys.argv[0], "__ha_start", str(ct.vmid), str(conf["ha"])],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return state.record_task(root, "hastart", ct.vmid)
    delay = float(conf.get("start_delay_s", 0))
    if delay:
        time.sleep(delay)  # a slow start (storage activation, hooks, GPU set-up)
    with state.config_lock(ct):
        state.start_container(ct)
    warnings = conf.get("start_warnings", [])
    for warning in warnings:
        # A prestart hook's warnings land in the task log; PVE::RESTEnvironment counts
        # them and the task ends `WARNINGS: N` (pve-common Tools/UPID.pm ~89: success).
        print(f"WARN: {warning}")
    return state.record_task(
        root, "vzstart", ct.vmid, f"WARNINGS: {len(warnings)}" if warnings else "OK"
    )


def _ha_start(root, vmid: int, delay: float) -> int:
    time.sleep(delay)  # the CRM acts on its next round
    ct = state.load_container(root, vmid)
    with state.config_lock(ct):
        if not ct.is_running():
            state.start_container(ct)
    return 0


def _interfaces(ct: state.Container) -> list[dict] | None:
    """GET .../lxc/<vmid>/interfaces in the real API's shape: one {name, hwaddr, inet,
    inet6} per interface, from `ip --json address` in the container's network namespace
    (the last address of each family); nothing for a stopped container (from memory of
    pve-container's PVE::LXC::get_interfaces, not checked against its source)."""
    pid = ct.init_pid()
    if pid is None:
        return None
    shown = subprocess.run(
        ["nsenter", f"--net=/proc/{pid}/ns/net", "--", "ip", "--json", "address"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if shown.returncode != 0:
        raise PveError(f"failed to get interfaces of CT {ct.vmid}: {shown.stderr.strip()}", 255)
    result = []
    for link in json.loads(shown.stdout):
        entry = {"name": link["ifname"], "hwaddr": link.get("address")}
        for address in link.get("addr_info", []):
            if address.get("family") in ("inet", "inet6"):
                entry[address["family"]] = f"{address['local']}/{address['prefixlen']}"
        result.append(entry)
    return result


def _uptime() -> int:
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]))


def _summary(ct: state.Container) -> dict:
    """One entry of GET /nodes/<node>/lxc (PVE::LXC::vmstatus)."""
    conf = ct.conf()
    running = ct.is_running()
    started = ct.started_at()
    entry = {
        "vmid": ct.vmid,
        "name": conf["hostname"],
        "status": "running" if running else "stopped",
        "type": "lxc",
        "uptime": int(time.time() - started) if running and started else 0,
        "cpus": conf["cores"],
        "cpu": 0,
        "maxmem": conf["memory"] * 1024 * 1024,
        "mem": 0,
        "maxswap": 512 * 1024 * 1024,
        "swap": 0,
        "maxdisk": 8 * 1024**3,
        "disk": 0,
        "netin": 0,
        "netout": 0,
        "diskread": 0,
        "diskwrite": 0,
    }
    if running:
        entry["pid"] = ct.init_pid()
    return entry


def current_status(ct: state.Container) -> dict:
    """GET /nodes/<node>/lxc/<vmid>/status/current: the summary plus HA state."""
    entry = _summary(ct)
    entry["ha"] = {"managed": 1, "state": "started"} if ct.conf().get("ha") else {"managed": 0}
    return entry
