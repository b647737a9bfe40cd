"""dflash.yaml loading: discovery, typing, paths, and one clear error per mistake."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dflashctl.config.schema import DEFAULT_EXCLUDE, load_config, parse_config
from dflashctl.errors import ConfigError
from dflashctl.resources import template_path

MINIMAL = "host:\n  address: pve.lan\n"


def write(tmp_path: Path, text: str, name: str = "dflash.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_template_is_a_valid_config(tmp_path):
    config = load_config(template_path("dflash.yaml"))
    assert config.host.address == "pve.lan"
    assert config.container.vmid == 200
    assert config.trainer.exclude[0] == "__pycache__/"
    assert config.trainer.exclude == DEFAULT_EXCLUDE  # the template shows the defaults
    assert config.trainer.confirm_above_mb == 100
    assert len(config.digest) == 64


def test_defaults_and_relative_paths_resolve_against_the_config_folder(tmp_path):
    path = write(
        tmp_path,
        MINIMAL + "trainer:\n  source: ../src\nhost_extra: 1\n".replace("host_extra: 1\n", ""),
    )
    config = load_config(path)
    assert config.host.port is None and config.host.user is None  # left to ~/.ssh/config
    assert config.trainer.source == str(tmp_path.parent / "src")
    assert config.run.keep_releases == 5
    assert config.path == path.resolve()


def test_discovery_order(tmp_path, monkeypatch):
    a = write(tmp_path, MINIMAL.replace("pve.lan", "from-env"), "a.yaml")
    write(tmp_path, MINIMAL.replace("pve.lan", "from-cwd"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DFLASHCTL_CONFIG", raising=False)
    assert load_config(None).host.address == "from-cwd"
    monkeypatch.setenv("DFLASHCTL_CONFIG", str(a))
    assert load_config(None).host.address == "from-env"
    b = write(tmp_path, MINIMAL.replace("pve.lan", "explicit"), "b.yaml")
    assert load_config(b).host.address == "explicit"


def test_local_workdir_is_a_local_path(tmp_path):
    path = write(tmp_path, "host:\n  address: local\ncontainer:\n  vmid: null\n  workdir: /tmp/x\n")
    config = load_config(path)
    assert config.host.is_local and config.container.vmid is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (MINIMAL + "  adress: x\n", "unknown key host.adress (did you mean host.address?)"),
        ("hosts:\n  address: x\n", "unknown key hosts (did you mean host?)"),
        ("proxmox:\n  node: pve\n", "missing required value host"),
        ("host:\n  port: 22\n", "missing required value host.address"),
        (MINIMAL + "  port: twenty\n", "host.port: expected an integer, got str 'twenty'"),
        (MINIMAL + "  port: 70000\n", "host.port: expected a port between 1 and 65535, got 70000"),
        (
            MINIMAL + "  accept_new_host_key: 'yes please'\n",
            "host.accept_new_host_key: expected true or false",
        ),
        (
            MINIMAL + "container:\n  vmid: abc\n",
            "container.vmid: expected an integer, got str 'abc'",
        ),
        (MINIMAL + "container:\n  vmid: 5\n", "container.vmid: Proxmox vmids run from 100"),
        (
            MINIMAL + "container:\n  workdir: relative/dir\n",
            "container.workdir: must be an absolute path",
        ),
        (MINIMAL + "container:\n  workdir: /root\n", "container.workdir: '/root' is too broad"),
        (MINIMAL + "proxmox:\n  api: rest\n", "proxmox.api: expected 'ssh' or 'https', got 'rest'"),
        (MINIMAL + "proxmox:\n  api: https\n", "proxmox.url: required with api: https"),
        (
            MINIMAL + "proxmox:\n  api: https\n  url: https://pve:8006\n  token_id: nope\n",
            "proxmox.token_id: required with api: https, in the form user@realm!tokenname",
        ),
        (MINIMAL + "trainer:\n  args: --steps 5\n", "trainer.args: expected a list, got str"),
        (MINIMAL + "trainer:\n  env: [A]\n", "trainer.env: expected a mapping, got a list"),
        (
            MINIMAL + "trainer:\n  env: {1BAD: x}\n",
            "trainer.env.1BAD: not a valid environment variable name",
        ),
        (
            MINIMAL + "trainer:\n  entry: ../escape.py\n",
            "trainer.entry: expected a .py file inside trainer.source",
        ),
        (MINIMAL + "run:\n  keep_releases: 0\n", "run.keep_releases: must be at least 1"),
        (MINIMAL + "run:\n  stop_grace_s: -1\n", "run.stop_grace_s: must be 0 or more seconds"),
        (
            MINIMAL + "run:\n  commit_timeout_s: 0\n",
            "run.commit_timeout_s: must be more than 0 seconds, got 0",
        ),
        (MINIMAL + "run:\n  commit_timeout_s: soon\n", "run.commit_timeout_s: expected a number"),
        (
            MINIMAL + "trainer:\n  confirm_above_mb: -5\n",
            "trainer.confirm_above_mb: must be 0 or more megabytes",
        ),
        (MINIMAL + "crash_patterns: [oops]\n", "crash_patterns[0]: expected a mapping"),
        ("- just\n- a list\n", "expected a mapping of sections"),
        (MINIMAL + "  proxy_jump: 'a b@c'\n", "host.proxy_jump: expected user@host[:port]"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert expected in str(info.value)
    assert info.value.exit_code == 2


def test_malformed_yaml_reports_its_line(tmp_path):
    path = write(tmp_path, "host:\n  address: pve\n  port: [1, 2\nrun: {}\n")
    with pytest.raises(
        ConfigError, match=r"malformed YAML at line 4, column 4: expected .,. or .\]., but got .:."
    ):
        load_config(path)


def test_a_folder_as_config_says_so_and_names_the_file_inside(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file") as info:
        load_config(tmp_path)
    assert "dflashctl init" in info.value.hint
    inside = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert info.value.exit_code == 2
    assert f"--config {inside}" in info.value.hint


def test_a_binary_config_is_a_config_error_not_a_traceback(tmp_path):
    path = tmp_path / "dflash.yaml"
    path.write_bytes(b"host:\n  address: \xff\xfe\n")
    with pytest.raises(ConfigError, match=r"not a text file \(byte 18 is not UTF-8\)") as info:
        load_config(path)
    assert str(path) in str(info.value) and info.value.exit_code == 2


def test_numbers_in_args_and_env_become_text(tmp_path):
    config = parse_config(
        MINIMAL + "trainer:\n  args: [--steps, 100]\n  env: {N: 2, FLAG: true}\n",
        tmp_path / "d.yaml",
    )
    assert config.trainer.args == ["--steps", "100"]
    assert config.trainer.env == {"N": "2", "FLAG": "true"}


def test_digest_changes_with_content(tmp_path):
    a = parse_config(MINIMAL, tmp_path / "d.yaml")
    b = parse_config(MINIMAL + "run:\n  keep_releases: 3\n", tmp_path / "d.yaml")
    assert a.digest != b.digest


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dflashctl", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_init_writes_template_and_refuses_to_overwrite(tmp_path):
    first = run_cli("init", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    written = (tmp_path / "dflash.yaml").read_text()
    # the template, naming the built-in crash rules where this installation has them
    rules = str(template_path("crash_patterns.yaml"))
    assert written == template_path("dflash.yaml").read_text().replace(
        "templates/crash_patterns.yaml", rules
    )
    (tmp_path / "dflash.yaml").write_text("host:\n  address: mine\n")
    second = run_cli("init", cwd=tmp_path)
    assert second.returncode == 2
    assert "already exists" in second.stderr and "--force" in second.stderr
    assert (tmp_path / "dflash.yaml").read_text() == "host:\n  address: mine\n"
    third = run_cli("init", "--force", cwd=tmp_path)
    assert third.returncode == 0
    assert (tmp_path / "dflash.yaml").read_text() == written


def test_help_does_not_import_heavy_modules(tmp_path):
    probe = (
        "import sys, runpy; sys.argv=['dflashctl','--help'];\n"
        "try:\n    runpy.run_module('dflashctl', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "heavy=[m for m in ('torch','paramiko','proxmoxer','transformers') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert "HEAVY []" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # An unknown key points at the key itself, a bad value at the value.
        (MINIMAL + "  adress: x\n", "line 3, column 3: unknown key host.adress"),
        (MINIMAL + "  port: twenty\n", "line 3, column 9: host.port: expected an integer"),
        (
            MINIMAL + "run:\n  keep_releases: 5\n  stop_grace_s: -2\n",
            "line 5, column 17: run.stop_grace_s: must be 0 or more seconds",
        ),
        (
            MINIMAL + "trainer:\n  args: [--steps, [1]]\n",
            "line 4, column 19: trainer.args[1]: expected a string, got a list",
        ),
        # A key that is missing is reported where its section starts.
        ("run: {}\nhost:\n  port: 22\n", "line 3, column 3: missing required value host.address"),
    ],
)
def test_mistakes_say_where_they_are_in_the_file(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}, {expected}" in str(info.value)


def test_unknown_key_hint_lists_the_allowed_keys(tmp_path):
    path = write(tmp_path, MINIMAL + "run:\n  keep: 3\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "unknown key run.keep (did you mean run.keep_releases?)" in str(info.value)
    assert info.value.hint == (
        "allowed keys in run: stop_grace_s, keep_releases, on_exit, retry, hang, gpus, "
        "start_line, start_timeout_s, commit_timeout_s"
    )


def test_empty_sections_take_the_defaults_and_paths_still_resolve(tmp_path):
    config = parse_config(MINIMAL + "trainer:\nrun: null\n", tmp_path / "d.yaml")
    assert config.trainer.source == str(tmp_path / "trainer")
    assert config.run.keep_releases == 5
    assert config.host.known_hosts == str(Path.home() / ".ssh" / "known_hosts")


def test_the_commit_timeout_is_how_long_the_nodes_wait_for_each_other(tmp_path):
    from dflashctl.ops.launch_command import commit_deadline

    default = parse_config(MINIMAL, tmp_path / "d.yaml")
    assert default.run.commit_timeout_s == 120
    # On top: the largest upload at 1 MB/s; with nothing to build, half of it.
    assert commit_deadline(default, 3_000_000) == 123
    assert commit_deadline(default, 0) == 60
    short = parse_config(MINIMAL + "run:\n  commit_timeout_s: 8\n", tmp_path / "d.yaml")
    assert commit_deadline(short, 3_000_000) == 11
    assert commit_deadline(short, 0) == 4


def test_local_relative_workdir_and_python_resolve_against_the_config(tmp_path):
    config = parse_config(
        "host:\n  address: local\ncontainer:\n  vmid: null\n  workdir: work\n"
        "  python: ../venv/bin/python\n",
        tmp_path / "d.yaml",
    )
    assert config.container.workdir == str(tmp_path / "work")
    assert config.container.python == str(tmp_path.parent / "venv" / "bin" / "python")
