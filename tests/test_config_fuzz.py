"""Fuzzed dflash.yaml files: no traceback, no hang, doctor and deploy agree.

A fixed budget of hypothesis examples (bench/bench_config_fuzz.py runs thousands and
counts). Each example goes through the code doctor and `deploy --dry-run` run before
they contact anything (tests/config_fuzz.py)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.config_fuzz import check_one, hostile_configs, make_workspace, seeds


def test_the_seeds_are_valid_configs(tmp_path):
    root = make_workspace(tmp_path)
    for text in seeds(root):
        assert check_one(root / "dflash.yaml", text) is None
        from tests.config_fuzz import deploy_verdict

        assert deploy_verdict(root / "dflash.yaml") == ("ok", "")


@settings(
    max_examples=150,
    deadline=None,
    derandomize=True,  # the same examples on every run: a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_fuzzed_configs_end_in_a_verdict_that_doctor_and_deploy_share(tmp_path, data):
    root = make_workspace(tmp_path)
    text = data.draw(hostile_configs(seeds(root)))
    assert check_one(root / "dflash.yaml", text) is None, text[:2000]
