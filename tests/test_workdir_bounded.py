# ruff: noqa: F811  (the `project` fixture is imported, and then asked for by name)
"""A workdir does not grow with the number of runs: the runs share one bytecode cache
(<workdir>/pycache), a release's part of it goes with the release (keep_releases), and
`runs` shows what each run's folder takes."""

from __future__ import annotations

import json
import re
import subprocess

from tests.json_answers import flat
from tests.test_deploy_support import project, wait_for  # noqa: F401
from tests.test_deploy_transfer import DFLASHCTL, cli_deploy


def release_caches(project) -> set[str]:
    """The releases that have bytecode in the shared cache."""
    cache = project.workdir / "pycache"
    releases = (project.workdir / "releases").resolve()
    base = cache / str(releases).lstrip("/")
    return {p.name for p in base.iterdir()} if base.is_dir() else set()


def test_bytecode_is_shared_and_goes_with_its_release(project):
    seen = []
    for number in range(4):
        train = project.source / "train.py"
        train.write_text(train.read_text() + f"# edit {number}\n")  # a new release each time
        done = cli_deploy(project, "--json")
        assert done.returncode == 0, done.stderr
        summary = flat(json.loads(done.stdout))
        release = project.current().name
        seen.append(release)
        wait_for(lambda r=release: r in release_caches(project), what="the release's bytecode")
        assert not (project.run_dir(summary["run_id"]) / "pycache").exists()
    # keep_releases is 2 in this project: the caches of older releases went with them.
    kept = {p.name for p in (project.workdir / "releases").iterdir() if p.is_dir()}
    assert len(kept) == 2 and kept <= set(seen)
    assert release_caches(project) <= kept
    assert seen[0] not in release_caches(project)


def test_runs_shows_each_runs_size(project):
    done = cli_deploy(project, "--json")
    assert done.returncode == 0, done.stderr
    run_id = flat(json.loads(done.stdout))["run_id"]
    (project.run_dir(run_id) / "blob").write_bytes(b"x" * 3 * 1024 * 1024)
    listed = subprocess.run(
        [*DFLASHCTL, "runs", "-c", str(project.config_path), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    (run,) = flat(json.loads(listed.stdout))["runs"]
    assert run["bytes"] >= 3 * 1024 * 1024
    table = subprocess.run(
        [*DFLASHCTL, "runs", "-c", str(project.config_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    header = table.stdout.splitlines()[0]
    assert "size" in header
    assert re.search(r" 3\.\d MiB ", table.stdout), table.stdout
