"""dflash.yaml with several nodes: merging, naming, checks, and the one-node plain case."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dflashctl.config.schema import parse_config
from dflashctl.errors import ConfigError

TWO_NODES = """\
host:
  user: root
  port: 2222
container:
  workdir: /root/dfl
nodes:
  - host: gpu-a
    container: 201
  - name: b
    host: {address: gpu-b, port: 22}
    container: {vmid: 305, python: /opt/py/bin/python3}
    proxmox: {node: pve2}
"""


def parse(tmp_path: Path, text: str):
    return parse_config(textwrap.dedent(text), tmp_path / "dflash.yaml")


def error(tmp_path: Path, text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(tmp_path, text)
    return info.value


def test_nodes_take_the_top_level_sections_as_defaults(tmp_path):
    config = parse(tmp_path, TWO_NODES)
    a, b = config.nodes
    assert len(config.nodes) > 1
    assert (a.name, a.host.address, a.host.port, a.host.user) == ("gpu-a", "gpu-a", 2222, "root")
    assert (a.container.vmid, a.container.workdir, a.container.python) == (
        201,
        "/root/dfl",
        "python3",
    )
    assert (b.name, b.host.port, b.proxmox.node, b.container.python) == (
        "b",
        22,
        "pve2",
        "/opt/py/bin/python3",
    )
    # The top-level sections are the first node's: one-target code reads them unchanged.
    assert config.host == a.host and config.container == a.container


def test_for_node_is_the_config_of_that_node_alone(tmp_path):
    config = parse(tmp_path, TWO_NODES)
    second = config.for_node(1)
    assert second.host.address == "gpu-b" and second.container.vmid == 305
    assert second.proxmox.node == "pve2" and len(second.nodes) == 1
    assert second.digest == config.digest and second.path == config.path
    assert [c.host.address for c in config.node_configs()] == ["gpu-a", "gpu-b"]


def test_a_config_without_nodes_is_one_node(tmp_path):
    config = parse(tmp_path, "host:\n  address: pve.lan\ncontainer:\n  vmid: 200\n")
    assert len(config.nodes) == 1
    (node,) = config.nodes
    assert (node.name, node.host.address, node.container.vmid) == ("pve.lan", "pve.lan", 200)
    assert config.for_node(0).host == config.host


def test_nodes_on_one_host_are_named_with_their_vmid(tmp_path):
    config = parse(
        tmp_path,
        "nodes:\n  - {host: gpu-a, container: 201}\n  - {host: gpu-a, container: 202}\n",
    )
    assert [n.name for n in config.nodes] == ["gpu-a-201", "gpu-a-202"]


def test_torchrun_settings_and_their_checks(tmp_path):
    config = parse(tmp_path, TWO_NODES + "torchrun:\n  nproc_per_node: 2\n  port: 29500\n")
    assert (config.torchrun.nproc_per_node, config.torchrun.port) == (2, 29500)
    assert parse(tmp_path, TWO_NODES).torchrun.nproc_per_node == "gpu"
    bad = error(tmp_path, TWO_NODES + "torchrun:\n  nproc_per_node: gpus\n")
    assert "torchrun.nproc_per_node: expected a number or gpu, auto or cpu" in bad.message
    assert (
        "must be at least 1"
        in error(tmp_path, TWO_NODES + "torchrun: {nproc_per_node: 0}\n").message
    )
    assert "torchrun.port" in error(tmp_path, TWO_NODES + "torchrun: {port: 70000}\n").message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # a mistake inside a node: its own line, its key path
        (
            "nodes:\n  - host: gpu-a\n    contaner: 201\n",
            "line 3, column 5: unknown key nodes[0].contaner (did you mean nodes[0].container?)",
        ),
        (
            "nodes:\n  - host: gpu-a\n  - host: {address: gpu-b, port: 0}\n",
            "line 3, column 34: nodes[1].host.port: expected a port between 1 and 65535",
        ),
        # an inherited mistake: reported where the top level wrote it
        (
            "host:\n  port: 99999\nnodes:\n  - host: gpu-a\n",
            "line 2, column 9: host.port: expected a port between 1 and 65535",
        ),
        ("nodes:\n  - container: 201\n", "missing required value nodes[0].host.address"),
        ("nodes: 3\n", "nodes: expected a list, got int 3"),
        ("nodes:\n  - host: a\n  - 7\n", "nodes[1]: expected a mapping"),
        (
            "nodes:\n  - host: a\n    name: 'gpu a'\n",
            "nodes[0].name: 'gpu a' is not a node name",
        ),
        (
            "nodes:\n  - {host: gpu-a, container: 201}\n  - {host: gpu-a, container: 201}\n",
            "nodes[1]: the same container 201 on gpu-a as nodes[0]",
        ),
        (
            "nodes:\n  - {host: gpu-a, name: x}\n  - {host: gpu-b, name: x}\n",
            "nodes[1].name: node name 'x' is already the name of nodes[0]",
        ),
        (
            "nodes:\n  - host: gpu-a\n    container: {workdir: rel}\n",
            "nodes[0].container.workdir: must be an absolute path",
        ),
    ],
)
def test_node_mistakes_name_the_node_and_the_line(tmp_path, text, expected):
    assert expected in error(tmp_path, text).message


def test_a_mistake_every_node_inherits_is_said_once(tmp_path):
    text = "host:\n  addreso: gpu-a\nnodes:\n  - host: gpu-a\n  - host: gpu-b\n"
    message = error(tmp_path, text).message
    assert message.count("addreso") == 1, message
    assert "line 2, column 3: unknown key host.addreso" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("host: a\ntrainer:\n  source: ''\n", "line 3, column 11: trainer.source: is empty"),
        (
            "nodes:\n  - host: gpu-a\n  - host: gpu-b\n    proxmox: {node: ''}\n",
            "line 4, column 21: nodes[1].proxmox.node: is empty",
        ),
        ("host: a\nproxmox:\n  node: ''\n", "line 3, column 9: proxmox.node: is empty"),
    ],
)
def test_empty_values_that_cannot_work_are_refused_with_line_and_column(tmp_path, text, expected):
    assert expected in error(tmp_path, text).message
