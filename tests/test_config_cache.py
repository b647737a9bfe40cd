"""The validated config remembered between commands (dflashctl/config/cache.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflashctl.config import cache as config_cache
from dflashctl.config import schema as config_module
from dflashctl.config.schema import Config, load_config
from dflashctl.errors import ConfigError

CONFIG = "host:\n  address: pve.lan\ntrainer:\n  source: ../src\n"


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def entry_for(path: Path) -> Path:
    entries = list(config_cache.cache_folder().glob("*.pickle"))
    assert len(entries) == 1, entries
    return entries[0]


def write(tmp_path: Path, text: str = CONFIG) -> Path:
    path = tmp_path / "conf" / "dflash.yaml"
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return path


def test_a_second_load_comes_from_the_cache_and_equals_a_validation(tmp_path, monkeypatch):
    path = write(tmp_path)
    first = load_config(path)
    entry = entry_for(path)
    assert entry.stat().st_mode & 0o777 == 0o600
    assert entry.parent.stat().st_mode & 0o777 == 0o700

    def refuse(*args, **kwargs):
        raise AssertionError("validated again")

    monkeypatch.setattr("dflashctl.config.schema.parse_config", refuse)
    again = load_config(path)
    assert type(again) is Config
    assert again.to_dict() == first.to_dict()
    assert (again.path, again.digest) == (first.path, first.digest)
    assert again.trainer.source == str(tmp_path / "src")


def test_an_edited_file_is_validated_again(tmp_path):
    path = write(tmp_path)
    assert load_config(path).host.address == "pve.lan"
    path.write_text(CONFIG.replace("pve.lan", "other.lan"))
    assert load_config(path).host.address == "other.lan"
    path.write_text(CONFIG + "  adress: x\n")  # a mistake is refused, never served from the cache
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(path)


def test_a_changed_dflashctl_is_validated_again(tmp_path, monkeypatch):
    path = write(tmp_path)
    load_config(path)
    calls = []
    real = config_cache.package_fingerprint()
    monkeypatch.setattr(config_cache, "package_fingerprint", lambda: real + "-edited")
    validate = config_module.parse_config
    monkeypatch.setattr(
        config_module,
        "parse_config",
        lambda text, where: calls.append(where) or validate(text, where),
    )
    load_config(path)
    assert calls == [path]


def test_the_fingerprint_follows_the_package_files(tmp_path, monkeypatch):
    before = config_cache.package_fingerprint()
    module = Path(config_cache.__file__)
    info = module.stat()
    try:
        os.utime(module, ns=(info.st_atime_ns, info.st_mtime_ns + 1_000_000_000))
        assert config_cache.package_fingerprint() != before
    finally:
        os.utime(module, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert config_cache.package_fingerprint() == before


@pytest.mark.parametrize("content", [b"", b"not a pickle", b"\x80\x05garbage"])
def test_a_corrupt_entry_is_ignored_and_replaced(tmp_path, content):
    path = write(tmp_path)
    load_config(path)
    entry = entry_for(path)
    entry.write_bytes(content)
    assert load_config(path).host.address == "pve.lan"
    assert config_cache.load(path, path.read_text(), Config) is not None  # written afresh


def test_an_entry_others_can_write_is_not_read(tmp_path):
    path = write(tmp_path)
    load_config(path)
    entry = entry_for(path)
    entry.chmod(0o666)
    assert config_cache.load(path, path.read_text(), Config) is None


def test_the_same_text_elsewhere_resolves_its_own_paths(tmp_path):
    a = write(tmp_path)
    other = tmp_path / "elsewhere" / "dflash.yaml"
    other.parent.mkdir()
    other.write_text(CONFIG)
    assert load_config(a).trainer.source == str(tmp_path / "src")
    assert load_config(other).trainer.source == str(tmp_path / "src")
    nested = tmp_path / "elsewhere" / "deeper" / "dflash.yaml"
    nested.parent.mkdir()
    nested.write_text(CONFIG)
    assert load_config(nested).trainer.source == str(tmp_path / "elsewhere" / "src")


def test_a_ca_bundle_config_is_validated_every_time(tmp_path):
    bundle = tmp_path / "conf" / "ca.pem"
    bundle.parent.mkdir()
    bundle.write_text("-----BEGIN CERTIFICATE-----\n")
    proxmox = f"proxmox:\n  api: https\n  url: https://pve.lan:8006\n  token_id: root@pam!dflash\n  verify_tls: {bundle}\n"
    path = write(tmp_path, CONFIG + proxmox)
    assert load_config(path).proxmox.verify_tls == str(bundle)
    assert not config_cache.cache_folder().exists()
    bundle.unlink()  # gone: the next command says so, as it would without a cache
    with pytest.raises(ConfigError, match="CA bundle file that exists"):
        load_config(path)


def test_an_unwritable_cache_folder_never_fails_the_command(tmp_path, cache_home):
    cache_home.mkdir()
    (cache_home / "dflashctl").write_text("a file where the folder would be")
    path = write(tmp_path)
    assert load_config(path).host.address == "pve.lan"
    assert load_config(path).host.address == "pve.lan"
