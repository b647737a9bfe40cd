"""The commands of dflashctl/commands/, called in this process on a fleet of one node and
of two on this machine (`host: local`, a workdir each, nothing deployed or a finished run
left in a folder): what they say, and the clear error (with what to do) of bad input.
Each command function is called as typer calls it; tests/test_commands_on_nodes.py runs
the real CLI against live runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
import yaml

from dflashctl.commands.container import create_command
from dflashctl.commands.doctor_fix import fix_all
from dflashctl.commands.exec import exec_command
from dflashctl.commands.init import init
from dflashctl.commands.logs import logs
from dflashctl.commands.pull import pull
from dflashctl.commands.restart import restart
from dflashctl.commands.run_ids import complete_run_id
from dflashctl.commands.runs import runs
from dflashctl.commands.runs_show import show
from dflashctl.commands.shell import shell
from dflashctl.commands.status import status
from dflashctl.commands.stop import stop
from dflashctl.errors import ConfigError, DflashError, UsageError
from dflashctl.ui import terminal

NAMES = ("gpu-a", "gpu-b")
RUN = "20260101-120000-ab12"
LOGS = Path(__file__).parent / "data" / "logs"
TOP = SimpleNamespace(invoked_subcommand=None)  # `runs` itself, not `runs show`


class Fleet:
    def __init__(self, root: Path, count: int) -> None:
        self.names = NAMES[:count]
        self.workdirs = [root / f"work-{name}" for name in self.names]
        (root / "src").mkdir(parents=True)
        (root / "src" / "train.py").write_text("print('hello')\n")
        self.config = str(root / "dflash.yaml")
        nodes = [
            {"name": name, "container": {"workdir": str(workdir)}}
            for name, workdir in zip(self.names, self.workdirs, strict=True)
        ]
        Path(self.config).write_text(
            yaml.safe_dump(
                {
                    "host": {"address": "local"},
                    "container": {"vmid": None, "python": sys.executable},
                    "nodes": nodes,
                    "trainer": {"source": "src", "entry": "train.py"},
                }
            )
        )

    def finished_run(self, node: int, run_id: str) -> None:
        """A run folder as a finished run leaves it."""
        rundir = self.workdirs[node] / "runs" / run_id
        rundir.mkdir(parents=True)
        (rundir / "meta.json").write_text(json.dumps({"run_id": run_id}))
        (rundir / "train.log").write_text("hello\n")
        (rundir / "exit_code").write_text("0\n")


@pytest.fixture(params=[1, 2], ids=["1 node", "2 nodes"])
def fleet(request, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    yield Fleet(tmp_path / "project", request.param)


@pytest.fixture(autouse=True)
def plain_terminal():
    """--json turns the human stdout off for the process: back on after each test."""
    yield
    terminal.set_quiet_stdout(False)
    terminal._json_printed = False


def test_stop_with_nothing_running_says_so_for_each_node(fleet, capsys):
    stop(config=fleet.config)
    said = capsys.readouterr().err
    if len(fleet.names) == 1:
        assert "nothing to stop on this machine" in said
    else:
        assert "stopped 0 run(s) on 2 of 2 nodes" in said
        assert "gpu-a: nothing to stop" in said and "gpu-b: nothing to stop" in said

    stop(config=fleet.config, json_output=True)
    answer = json.loads(capsys.readouterr().out)
    assert [node["stopped"] for node in answer["nodes"]] == [[]] * len(fleet.names)


def test_stop_refuses_a_negative_grace(fleet):
    with pytest.raises(UsageError, match="--grace must be 0 or more seconds, got -1") as refused:
        stop(config=fleet.config, grace=-1)
    assert refused.value.exit_code == 2


def test_runs_lists_each_nodes_runs_and_refuses_prune_options_without_prune(fleet, capsys):
    runs(TOP, config=fleet.config)
    said = capsys.readouterr().err
    if len(fleet.names) == 1:
        assert f"no runs in {fleet.workdirs[0]} on this machine yet" in said
    else:
        assert "no runs on gpu-a, gpu-b yet" in said

    fleet.finished_run(0, RUN)
    runs(TOP, config=fleet.config, json_output=True)
    answer = json.loads(capsys.readouterr().out)
    found = [run["id"] for node in answer["nodes"] for run in node["runs"]]
    assert found == [RUN]

    with pytest.raises(UsageError, match="--yes and --dry-run go with --prune KEEP"):
        runs(TOP, config=fleet.config, yes=True)
    with pytest.raises(UsageError, match="KEEP must be 0 or more"):
        runs(TOP, config=fleet.config, prune=-1)


def test_runs_show_names_what_is_missing_and_what_to_do(fleet, capsys):
    with pytest.raises(UsageError, match="takes one run or two to compare, got 3"):
        show(run_ids=["a", "b", "c"], config=fleet.config)
    with pytest.raises(DflashError, match=f"no run {RUN} in .*work-gpu-a/runs") as missing:
        show(run_ids=[RUN], config=fleet.config)
    assert "dflashctl runs" in missing.value.hint

    fleet.finished_run(0, RUN)
    show(run_ids=[RUN], config=fleet.config, json_output=True)
    answer = json.loads(capsys.readouterr().out)
    assert RUN in json.dumps(answer)


def test_logs_refuses_what_does_not_fit_and_classifies_a_local_file(fleet, capsys):
    with pytest.raises(UsageError, match="not a run id: '../x'"):
        logs(run_id="../x", lines=5, config=fleet.config)
    with pytest.raises(UsageError, match="--exit-code goes with --file"):
        logs(run_id=RUN, exit_code=1, config=fleet.config)
    with pytest.raises(UsageError, match="takes no RUN_ID"):
        logs(run_id=RUN, file="x.log", config=fleet.config)
    with pytest.raises(UsageError, match="cannot read nope.log"):
        logs(file="nope.log", config=fleet.config)
    with pytest.raises(DflashError, match=f"no run {RUN} in .*work-gpu-a/runs") as missing:
        logs(run_id=RUN, lines=5, config=fleet.config)
    assert "dflashctl runs" in missing.value.hint

    with pytest.raises(typer.Exit) as ended:  # the CLI's exit status
        logs(file=str(LOGS / "cuda-oom.log"), exit_code=1, lines=3, config=fleet.config)
    assert ended.value.exit_code == 1
    assert "cuda-oom.log crashed" in capsys.readouterr().err


def test_logs_of_a_finished_run_shows_it_on_every_node_that_has_it(fleet, capsys):
    for node in range(len(fleet.names)):
        fleet.finished_run(node, RUN)
    with pytest.raises(typer.Exit) as ended:
        logs(run_id=RUN, lines=5, config=fleet.config)
    assert ended.value.exit_code == 0
    said = capsys.readouterr()
    assert "hello" in said.out


def test_pull_refuses_bad_input_and_names_the_runs_there_are(fleet, tmp_path):
    with pytest.raises(UsageError, match="--step must be 0 or more, got -2"):
        pull(run_id=RUN, step=-2, config=fleet.config)
    with pytest.raises(UsageError, match="not a run id: '../x'"):
        pull(run_id="../x", config=fleet.config)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UsageError, match="exists and is not a folder") as refused:
        pull(run_id=RUN, to=blocker, config=fleet.config)
    assert refused.value.hint == "pass another --to"
    where = "node gpu-a \\(this machine\\)" if len(fleet.names) == 1 else "any node"
    with pytest.raises(DflashError, match=f"no run {RUN} on {where} \\(latest runs: none yet\\)"):
        pull(run_id=RUN, config=fleet.config)


def test_status_shows_every_node_with_nothing_launched(fleet, capsys):
    status(config=fleet.config)
    table = capsys.readouterr().out
    for name in fleet.names:
        assert name in table
    assert table.count("none launched yet") == len(fleet.names)

    status(config=fleet.config, as_json=True)
    answer = json.loads(capsys.readouterr().out)
    assert len(answer["nodes"]) == len(fleet.names)


def test_restart_with_nothing_deployed_says_to_deploy_first(fleet):
    with pytest.raises(DflashError, match="nothing is deployed in") as refused:
        restart(config=fleet.config, detach=True)
    assert "dflashctl deploy" in refused.value.hint


def test_exec_runs_in_the_workdir_on_the_node_asked_for(fleet, capfd):
    last = fleet.names[-1]
    for workdir in fleet.workdirs:
        workdir.mkdir()
    with pytest.raises(typer.Exit) as ended:
        exec_command(["pwd"], config=fleet.config, node=last)
    assert ended.value.exit_code == 0
    assert capfd.readouterr().out.strip().endswith(f"work-{last}")

    with pytest.raises(typer.Exit) as failed:
        exec_command(["sh", "-c", "exit 7"], config=fleet.config)
    assert failed.value.exit_code == 7

    with pytest.raises(UsageError, match="no node 'gpu-z' in the config") as refused:
        exec_command(["ls"], config=fleet.config, node="gpu-z")
    assert "--node takes one of: 0 (gpu-a)" in refused.value.hint


def test_shell_without_a_terminal_says_how_to_script_it(fleet, monkeypatch):
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # noqa: SIM115
    with pytest.raises(UsageError, match="shell needs a terminal") as refused:
        shell(config=fleet.config)
    assert "dflashctl exec --" in refused.value.hint


def test_container_create_without_a_vmid_says_to_set_one(fleet):
    with pytest.raises(ConfigError, match="container.vmid is not set") as refused:
        create_command(config=fleet.config)
    assert "set container.vmid" in refused.value.hint


def test_doctor_fix_has_nothing_to_fix_without_containers(fleet):
    assert fix_all(fleet.config, yes=True) == 0


def test_init_writes_a_config_that_loads_and_never_overwrites_unasked(tmp_path, capsys):
    from dflashctl.config.schema import load_config

    init(path=tmp_path)
    written = tmp_path / "dflash.yaml"
    assert "crash_patterns" in written.read_text()
    assert load_config(str(written)).nodes
    with pytest.raises(UsageError, match="already exists; not overwriting it") as refused:
        init(path=written)
    assert "--force" in refused.value.hint
    written.write_text("# mine\n")
    init(path=written, force=True)
    assert written.read_text() != "# mine\n"
    with pytest.raises(UsageError, match="no such folder"):
        init(path=tmp_path / "nope" / "dflash.yaml")


def test_run_ids_complete_from_the_first_node_newest_first(fleet):
    older, newer = "20260101-120000-aaaa", "20260102-120000-bbbb"
    fleet.finished_run(0, older)
    fleet.finished_run(0, newer)
    context = SimpleNamespace(params={"config": fleet.config})
    assert complete_run_id(context, "2026") == [newer, older]
    assert complete_run_id(context, "20260101") == [older]
    broken = SimpleNamespace(params={"config": str(Path(fleet.config).parent / "nope.yaml")})
    assert complete_run_id(broken, "") == []  # never an error in the command line
