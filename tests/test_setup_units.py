"""setup's tricky parts on their own: the config section, naming the package pip
could not get, the names a requirements file asks for, and the commands' CLI errors
(exit codes, no traceback) before anything is contacted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.agent.venvs import failure, requirement_names, setup_spec
from dflashctl.config.schema import parse_config
from dflashctl.errors import ConfigError
from dflashctl.ops.setup_env import setup_params

MINIMAL = "host:\n  address: pve.lan\n"
DFLASHCTL = [sys.executable, "-m", "dflashctl"]


def test_setup_section_defaults_and_values(tmp_path):
    config = parse_config(MINIMAL, tmp_path / "d.yaml")
    assert config.setup.requirements == "requirements.txt" and config.setup.commands == []
    config = parse_config(
        MINIMAL + "setup:\n  requirements: reqs/gpu.txt\n  pip_args: [--no-index]\n"
        "  commands: ['pip install -e .']\n",
        tmp_path / "d.yaml",
    )
    assert config.setup.requirements == "reqs/gpu.txt"
    assert config.setup.pip_args == ["--no-index"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("setup:\n  requirements: /etc/reqs.txt\n", "setup.requirements: expected a file inside"),
        ("setup:\n  requirements: ../reqs.txt\n", "setup.requirements: expected a file inside"),
        ("setup:\n  commands: 'pip install x'\n", "setup.commands: expected a list"),
        ("setup:\n  commands: ['  ']\n", "setup.commands.0: an empty command"),
        ("setup:\n  timeout_s: 0\n", "setup.timeout_s: must be more than 0 seconds"),
        ("setup:\n  requirments: r.txt\n", "unknown key setup.requirments"),
    ],
)
def test_setup_mistakes_are_config_errors(tmp_path, text, expected):
    with pytest.raises(ConfigError) as caught:
        parse_config(MINIMAL + text, tmp_path / "d.yaml")
    assert expected in caught.value.message


def test_setup_params_only_when_something_is_installed(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    text = MINIMAL + f"trainer:\n  source: {source}\n"
    assert setup_params(parse_config(text, tmp_path / "d.yaml")) is None
    (source / "requirements.txt").write_text("numpy\n")
    params = setup_params(parse_config(text, tmp_path / "d.yaml"))
    assert params is not None and params["requirements"] == "requirements.txt"
    off = parse_config(text + "setup:\n  requirements: null\n", tmp_path / "d.yaml")
    assert setup_params(off) is None


PIP_NOT_FOUND = """\
Looking in links: wheels
ERROR: Could not find a version that satisfies the requirement flash-attn==9.9 (from versions: none)
ERROR: No matching distribution found for flash-attn==9.9
"""


@pytest.mark.parametrize(
    ("output", "package"),
    [
        (PIP_NOT_FOUND, "flash-attn==9.9"),
        (
            "ERROR: Could not find a version that satisfies the requirement torchx>=2 "
            "(from versions: 0.1)\n",
            "torchx>=2",
        ),
        ("ERROR: Directory './pkgs/mine' is not installable. Neither 'setup.py'\n", "./pkgs/mine"),
        ("  Building wheel for bad (pyproject.toml) ... error\nFailed to build bad\n", "bad"),
    ],
)
def test_a_failed_pip_names_the_package(output, package):
    error = failure("pip install", 1, output)
    assert error.package == package
    assert package in error.message and "nothing was stopped" in error.message


def test_an_unrecognised_failure_says_its_last_line():
    error = failure("pip install -e .", 2, "working...\nsomething odd happened\n")
    assert error.package is None
    assert "something odd happened" in error.message and "exit status 2" in error.message


def test_requirement_names(tmp_path):
    (tmp_path / "pkgs" / "mine").mkdir(parents=True)
    (tmp_path / "pkgs" / "mine" / "pyproject.toml").write_text('[project]\nname = "my-lib"\n')
    text = (
        "# comment\n-r base.txt\n--find-links wheels\nnumpy>=1.26  # pinned\n"
        "PyYAML[extra]==6.0\ntorch @ https://example.invalid/torch.whl\n"
        "wheels/hello_pkg-1.0-py3-none-any.whl\n./pkgs/mine\n-e ./other\n"
    )
    assert requirement_names(str(tmp_path), text) == [
        "numpy",
        "PyYAML",
        "torch",
        "hello_pkg",
        "my-lib",
    ]


def test_the_key_follows_the_content(tmp_path):
    (tmp_path / "requirements.txt").write_text("numpy\n")
    setup = {"requirements": "requirements.txt", "commands": [], "pip_args": []}
    key, _ = setup_spec(str(tmp_path), setup)
    assert key == setup_spec(str(tmp_path), dict(setup))[0]
    assert key != setup_spec(str(tmp_path), dict(setup, pip_args=["--no-index"]))[0]
    (tmp_path / "requirements.txt").write_text("numpy==2\n")
    assert key != setup_spec(str(tmp_path), setup)[0]
    assert setup_spec(str(tmp_path / "none"), setup) == (None, None)


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*DFLASHCTL, *args], capture_output=True, text=True, cwd=cwd, stdin=subprocess.DEVNULL
    )


def test_cli_errors_before_anything_is_contacted(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASHCTL_CONFIG", raising=False)
    no_config = cli("exec", "--", "true", cwd=tmp_path)
    assert no_config.returncode == 2 and "dflash.yaml" in no_config.stderr
    (tmp_path / "dflash.yaml").write_text(MINIMAL + "setup:\n  commands: ['']\n")
    bad = cli("shell", cwd=tmp_path)
    assert bad.returncode == 2 and "setup.commands.0: an empty command" in bad.stderr
    for args in (["pull", "x", "--step", "-1"], ["pull", "../etc"], ["pull"], ["exec"]):
        done = cli(*args, cwd=tmp_path)
        assert done.returncode == 2, (args, done.stderr)
        assert "Traceback" not in done.stderr


PIP_WITHOUT_DNS = """Looking in indexes: https://pypi.x.example/simple
WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError('<x>: \
Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': \
/simple/tabulate/
ERROR: Could not find a version that satisfies the requirement tabulate>=0.9 (from versions: none)
ERROR: No matching distribution found for tabulate>=0.9"""


def test_an_index_pip_never_reached_is_said_as_such_not_as_a_wrong_name():
    no_dns = failure("pip install", 1, PIP_WITHOUT_DNS)
    assert "pip could not reach the package index (name resolution failed for pypi.x.example" in (
        no_dns.message
    )
    assert "while looking for tabulate>=0.9" in no_dns.message
    refused = failure(
        "pip install",
        1,
        PIP_WITHOUT_DNS.replace(
            "[Errno -3] Temporary failure in name resolution", "Connection refused"
        ),
    )
    assert "could not connect to pypi.x.example: Connection refused" in refused.message
    # The index answered in the end (a retry, then the versions it has): the version is wrong.
    answered = failure(
        "pip install", 1, PIP_WITHOUT_DNS.replace("(from versions: none)", "(from versions: 0.8)")
    )
    assert "pip found no distribution of it" in answered.message
