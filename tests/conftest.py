"""Test-wide fixtures: the real SSH test host (sshd + bubblewrap containers) and the
real trainer's tiny CPU run (tests/tiny_run.py).

Two tiers: every test that needs the test host (an sshd, a container, the pct and pvesh
stand-ins) or the tiny trainer runs is marked `host` here, by the fixtures it asks for or
by the file it lives in; `make test-unit` runs the rest (`pytest -m "not host"`)."""

import pytest

pytest_plugins = ["tests.host.fixtures", "tests.tiny_run"]

# The fixtures that start the test host or train the tiny runs. A test's fixture closure
# holds every fixture it reaches through others, so a file's own fixture built on
# `container` marks its tests too.
HOST_FIXTURES = frozenset(
    {
        "pve_host",
        "pve_host2",
        "shared_known_hosts",
        "pve_https",
        "make_container",
        "container",
        "make_network",
        "container_network",
        "write_config",
        "tiny_runs",
    }
)

# Files that start an sshd, a network namespace or containers themselves, without the
# fixtures above.
HOST_FILES = frozenset({"test_testhost.py", "test_testhost_network.py"})


def needs_test_host(item: pytest.Item) -> bool:
    if item.path.name in HOST_FILES:
        return True
    return not HOST_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if needs_test_host(item):
            item.add_marker(pytest.mark.host)
