"""config/yaml_source.py on its own: where each key and value of a dflash.yaml was
written, a key written twice, and the limits that refuse a hostile file naming its line.
How load_config words these: tests/test_config_hostile.py."""

from __future__ import annotations

import pytest
import yaml

from dflashctl.config import yaml_source
from dflashctl.config.yaml_source import Place, YamlRefused, load_yaml
from dflashctl.errors import ConfigError
from dflashctl.remote.transport.identity import check_identity_file

TEXT = """\
host:
  address: gpu-a
  port: 22
trainer:
  args: [--steps, 3]
"""


def test_every_key_and_value_has_its_line_and_column():
    source = load_yaml(TEXT)
    assert source.data == {
        "host": {"address": "gpu-a", "port": 22},
        "trainer": {"args": ["--steps", 3]},
    }
    assert source.keys[("host", "port")] == Place(3, 3)
    assert source.values[("host", "port")] == Place(3, 9)
    assert source.values[("trainer", "args", 1)] == Place(5, 19)
    assert str(source.place(("host", "port"), key=True)) == "line 3, column 3"
    # A key not written in the file: the place of its nearest written parent.
    assert source.place(("host", "user")) == source.values[("host",)]
    assert source.place(("proxmox", "node")) is None


def test_a_key_written_twice_is_reported_with_both_lines():
    source = load_yaml("host:\n  port: 22\n  port: 2222\n")
    (twice,) = source.duplicates
    assert (twice.loc, twice.first.line, twice.again.line) == (("host", "port"), 2, 3)


def test_an_alias_bomb_is_refused_at_its_line_before_it_is_built():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 8)}]" for i in range(1, 9)]
    with pytest.raises(YamlRefused) as refused:
        load_yaml("\n".join(lines) + "\n")
    assert refused.value.problem_mark is not None and refused.value.hint


def test_nesting_past_the_limit_is_refused():
    deep = "[" * (yaml_source.MAX_DEPTH + 5) + "]" * (yaml_source.MAX_DEPTH + 5)
    with pytest.raises(YamlRefused):
        load_yaml(f"x: {deep}\n")


def test_a_value_python_cannot_build_is_a_yaml_error_at_its_line():
    with pytest.raises(yaml.YAMLError) as failed:
        load_yaml("when: 2026-02-31\n")
    assert "cannot read this value" in str(failed.value) and "line 1" in str(failed.value)


def test_a_public_key_as_the_identity_names_its_private_half(tmp_path):
    private = tmp_path / "id_ed25519"
    private.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    public = tmp_path / "id_ed25519.pub"
    public.write_text("ssh-ed25519 AAAAC3Nza... me@laptop\n")
    check_identity_file(str(private))  # the private key: fine
    check_identity_file(str(tmp_path / "missing"))  # paramiko says what is missing
    with pytest.raises(ConfigError, match="is a public key") as refused:
        check_identity_file(str(public))
    assert refused.value.hint == f"set host.identity_file: {private} (the private key of this pair)"
    private.unlink()
    with pytest.raises(ConfigError) as refused:
        check_identity_file(str(public))
    assert "the file without .pub" in refused.value.hint
