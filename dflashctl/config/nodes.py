"""The nodes of a config across several boxes: each `nodes:` entry's sections merged
over the top-level ones (before validation), then named and checked for two nodes in
one place (after it)."""

from __future__ import annotations

from typing import Any

from dflashctl.config.errors import invalid
from dflashctl.config.yaml_source import YamlSource

# Where the trainer of one node runs; also what a `nodes:` entry may override.
NODE_SECTIONS = ("host", "proxmox", "container")


def merge_node_sections(raw: dict[str, Any], source: YamlSource) -> dict[str, Any]:
    """Each `nodes:` entry's host, proxmox and container sections on top of the
    top-level ones (`host: gpu-b` is short for `host: {address: gpu-b}`, `container: 201`
    for `container: {vmid: 201}`). A value a node inherits is reported, if wrong, at the
    line where the top level wrote it. The top-level sections become the first node's."""
    nodes = raw.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        return raw
    shorthand = {"host": "address", "container": "vmid"}
    merged_nodes = []
    for index, entry in enumerate(nodes):
        if not isinstance(entry, dict):
            merged_nodes.append(entry)  # pydantic says what it should be
            continue
        entry = dict(entry)
        for section in NODE_SECTIONS:
            top = raw.get(section) if isinstance(raw.get(section), dict) else {}
            own = entry.get(section)
            if section in shorthand and own is not None and not isinstance(own, (dict, list)):
                own = {shorthand[section]: own}
                source.values[("nodes", index, section, shorthand[section])] = source.values.get(
                    ("nodes", index, section)
                )
            if own is not None and not isinstance(own, dict):
                continue  # not a mapping: reported as it is
            for key in top:
                if key not in (own or {}):
                    for table in (source.values, source.keys):
                        if (section, key) in table:
                            table[("nodes", index, section, key)] = table[(section, key)]
            entry[section] = {**top, **(own or {})}
        merged_nodes.append(entry)
    raw = dict(raw, nodes=merged_nodes)
    if isinstance(merged_nodes[0], dict):
        for section in NODE_SECTIONS:
            # A top-level section that is not a mapping stays, to be refused as it is.
            if raw.get(section) is None or isinstance(raw.get(section), dict):
                raw[section] = merged_nodes[0].get(section, {})
    return raw


def name_nodes(nodes: list[Any]) -> None:
    """An unnamed node is called after its host, plus its vmid where hosts repeat."""
    hosts = [n.host.address for n in nodes]
    for node in nodes:
        if node.name is None:
            shared = hosts.count(node.host.address) > 1
            vmid = node.container.vmid
            node.name = (
                f"{node.host.address}-{vmid if vmid is not None else 'host'}"
                if shared
                else node.host.address
            )


def no_duplicate_nodes(nodes: list[Any]) -> None:
    seen_names: dict[str, int] = {}
    seen_places: dict[tuple[Any, ...], int] = {}
    for index, node in enumerate(nodes):
        host, container = node.host, node.container
        place = (host.address, host.port, host.user, container.vmid, container.workdir)
        if place in seen_places:
            other = seen_places[place]
            where = (
                f"container {node.container.vmid}"
                if node.container.vmid is not None
                else f"workdir {node.container.workdir}"
            )
            raise invalid(
                f"the same {where} on {node.host.address} as nodes[{other}]",
                "each node is a container of its own (or a workdir of its own on a host)",
                key=("nodes", index),
            )
        seen_places[place] = index
        name = node.label()
        if name in seen_names:
            raise invalid(
                f"node name {name!r} is already the name of nodes[{seen_names[name]}]",
                "give each node its own `name:`",
                key=("nodes", index, "name"),
            )
        seen_names[name] = index
