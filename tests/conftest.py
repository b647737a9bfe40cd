"""Test-wide fixtures: the real SSH test host (sshd + bubblewrap containers) and the
real trainer's tiny CPU run (tests/tiny_run.py).

Two tiers: every test that needs the test host (an sshd, a container, the pct and pvesh
stand-ins) or the tiny trainer runs, or that runs the real trainer or whole deploys on
this machine (seconds each), is marked `host` here, by the fixtures it asks for, its
`slow` marker or the file it lives in; `make test-unit` runs the rest in a few minutes
(`pytest -m "not host"`), `make test` both."""

import os

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

# Files whose tests need no test host but run the real trainer (torch, torchrun ranks)
# or deploy across workdirs of this machine through the real agent and commit barrier:
# 5 to 140 s a test: with them the tier took 584 s on 2 workers, without them 120 s.
END_TO_END_FILES = frozenset(
    {
        "test_bench_checkpoint.py",
        "test_bench_quality.py",
        "test_bench_resume_broadcast.py",
        "test_commands_on_nodes.py",
        "test_commit_barrier.py",
        "test_deploy_nodes.py",
        "test_lineage.py",
        "test_nodes_rollback.py",
        "test_pipeline_checkpoint.py",
        "test_pipeline_distributed.py",
        "test_pipeline_dflash.py",
        "test_pipeline_eval.py",
        "test_pipeline_exit.py",
        "test_pipeline_one_entry.py",
        "test_pipeline_resume_ranks.py",
        "test_redeploy_finished.py",
        "test_stacks_ranks.py",
        "test_stop_report_nodes.py",
        "test_trainer_failures.py",
        "test_trainer_trackers.py",
    }
)


# A deploy across nodes whose node never arrives at the commit barrier (the faults the
# multi-node tests strike) keeps the first node's store up for the others' late reads:
# 15 s for users, each time waited out in full. 3 s here: the nodes that do arrive read
# the decision within a tenth of a second.
os.environ.setdefault("DFLASH_TEST_COMMIT_ACK_WAIT_S", "3")  # ops/launch_command.ACK_WAIT_ENV


def needs_test_host(item: pytest.Item) -> bool:
    if item.path.name in HOST_FILES | END_TO_END_FILES:
        return True
    if item.get_closest_marker("slow"):
        return True
    return not HOST_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if needs_test_host(item):
            item.add_marker(pytest.mark.host)
