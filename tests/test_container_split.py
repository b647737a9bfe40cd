"""Ranks of one host split over several containers (container/split.py): which nodes
form such a group, the GPUs a container's config passes through, and the error when
the first container of a group is gone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflashctl.container import ctconfig
from dflashctl.container.repair import missing_container
from dflashctl.container.split import gpus_in, split_groups
from dflashctl.errors import HostError


def node(name: str, transport: object, vmid: int | None) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        config=SimpleNamespace(container=SimpleNamespace(vmid=vmid)),
        target=SimpleNamespace(transport=transport),
    )


def test_only_several_containers_on_one_host_form_a_group():
    pve1 = SimpleNamespace(description="root@pve1:22")
    pve2 = SimpleNamespace(description="root@pve2:22")
    a, b = node("a", pve1, 200), node("b", pve1, 201)
    same = node("c", pve2, 300), node("d", pve2, 300)  # two nodes of one container: fine
    local = node("e", pve1, None)  # no container at all
    assert split_groups([a, *same, b, local]) == [[a, b]]
    assert split_groups([a, node("f", pve2, 201)]) == []


def test_the_gpus_a_container_config_passes_through():
    config = ctconfig.parse(
        "arch: amd64\n"
        "dev0: /dev/nvidia0\n"
        "dev1: /dev/nvidia3\n"
        "dev2: /dev/nvidiactl\n"
        "dev3: /dev/nvidia-uvm\n"
    )
    assert gpus_in(config) == {0, 3}
    assert gpus_in(ctconfig.parse("arch: amd64\n")) == set()


def test_a_missing_first_container_says_how_to_make_it():
    with pytest.raises(HostError, match="container 200 does not exist on root@pve1:22") as gone:
        raise missing_container(
            200, SimpleNamespace(transport=SimpleNamespace(description="root@pve1:22"))
        )
    assert "dflashctl container create" in gone.value.hint
