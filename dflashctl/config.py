"""dflash.yaml: typed, validated configuration.

Found via --config/-c, then $DFLASHCTL_CONFIG, then ./dflash.yaml. Relative paths
resolve against the folder of the config file. Every mistake becomes one
ConfigError naming the file, the key path and what is allowed, before anything
is contacted.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from dflashctl import hints
from dflashctl.errors import ConfigError

CONFIG_ENV = "DFLASHCTL_CONFIG"
DEFAULT_CONFIG_NAME = "dflash.yaml"
LOCAL_ADDRESS = "local"


@dataclass
class HostConfig:
    address: str
    # None: take Port/User from ~/.ssh/config, else 22 and root.
    port: int | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_key: bool = False
    proxy_jump: str | None = None
    connect_timeout_s: float = 10.0
    keepalive_s: int = 15

    @property
    def is_local(self) -> bool:
        return self.address == LOCAL_ADDRESS


@dataclass
class ProxmoxConfig:
    node: str = "pve"
    api: str = "ssh"
    url: str | None = None
    token_id: str | None = None
    token_secret_env: str = "PVE_TOKEN_SECRET"
    verify_tls: bool = True


@dataclass
class ContainerConfig:
    vmid: int | None = None
    workdir: str = "/root/dflash"
    python: str = "python3"
    start_if_stopped: bool = False


@dataclass
class TrainerConfig:
    source: str = "trainer"
    entry: str = "train_dflash_pipeline.py"
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    exclude: list[str] = field(
        default_factory=lambda: ["__pycache__/", "*.pyc", ".git/", "checkpoints/", "outputs/"]
    )


@dataclass
class RetryConfig:
    """Automatic recovery: the run's supervisor restarts the trainer after a crash a
    restart fixes, resuming from the run's latest checkpoint (dflashctl/recovery.py)."""

    max_restarts: int = 3  # 0: off
    # Categories to retry; None: those whose crash rule says `retryable: true`.
    on: list[str] | None = None
    backoff_s: float = 10.0  # the first wait, doubled for each restart within the window
    max_backoff_s: float = 300.0
    window_s: float = 3600.0  # restarts counted within this window (0: the whole run)
    resume_args: list[str] = field(default_factory=lambda: ["--resume"])


@dataclass
class RunConfig:
    stop_grace_s: float = 20.0
    keep_releases: int = 5
    # A shell command run where the trainer ran once it has ended (exit_code written),
    # with DFLASH_RUN_ID, DFLASH_RUN_DIR and DFLASH_EXIT_CODE set: a notification
    # that works with nobody following the log.
    on_exit: str | None = None
    retry: RetryConfig = field(default_factory=RetryConfig)


@dataclass
class Config:
    host: HostConfig
    proxmox: ProxmoxConfig = field(default_factory=ProxmoxConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    crash_patterns: list[dict[str, Any]] = field(default_factory=list)
    # Not part of the file: where it came from and a digest of what it says.
    path: Path = field(default=Path(DEFAULT_CONFIG_NAME), metadata={"internal": True})
    digest: str = field(default="", metadata={"internal": True})

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("path")
        data.pop("digest")
        return data


# --------------------------------------------------------------------------- discovery


def find_config_path(explicit: str | os.PathLike | None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    env = os.environ.get(CONFIG_ENV)
    if env:
        return Path(env).expanduser()
    return Path.cwd() / DEFAULT_CONFIG_NAME


def load_config(explicit: str | os.PathLike | None = None) -> Config:
    """Find, parse and validate dflash.yaml; raise ConfigError on any problem."""
    path = find_config_path(explicit)
    hints.remember_config(explicit)
    if path.is_dir():
        inside = path / DEFAULT_CONFIG_NAME
        raise ConfigError(
            f"{path}: is a folder, not a config file",
            hint=f"pass the file itself: --config {inside}"
            if inside.is_file()
            else "pass the path of a dflash.yaml, or write one there with `dflashctl init`",
        )
    if not path.is_file():
        origin = (
            "--config"
            if explicit
            else f"${CONFIG_ENV}"
            if os.environ.get(CONFIG_ENV)
            else "the current folder"
        )
        raise ConfigError(
            f"{path}: no such config file (from {origin})",
            hint="write one with `dflashctl init`, or point to it with --config PATH",
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start + 1} is not UTF-8)",
            hint="a dflash.yaml is UTF-8 YAML text; write a fresh one with `dflashctl init`",
        ) from exc
    return parse_config(text, path)


def parse_config(text: str, path: Path) -> Config:
    try:
        raw = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = exc.problem or str(exc)
        raise ConfigError(
            f"{path}: malformed YAML at {where}: {problem}",
            hint="check the indentation and quoting on that line",
        ) from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections (host, proxmox, container, ...), "
            f"got {_describe(raw)}"
        )
    config = _build(Config, raw, path, prefix="")
    _resolve_paths(config, path)
    _check_semantics(config, path)
    config.path = path.resolve()
    config.digest = hashlib.sha256(
        json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    ).hexdigest()
    return config


# --------------------------------------------------------------------------- generic typed loading


def _build(cls: type, raw: Any, path: Path, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: {where}: expected a mapping, got {_describe(raw)}")
    hints = typing.get_type_hints(cls)
    public = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    allowed = [f.name for f in public]
    for key in raw:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            suggestion = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(
                f"{path}: unknown key {prefix}{key}{suggestion}",
                hint=f"allowed keys in {where}: {', '.join(allowed)}",
            )
    values = {}
    for f in public:
        keypath = f"{prefix}{f.name}"
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(
                    f"{path}: missing required value {keypath}",
                    hint=f"add `{f.name}:` under `{prefix.rstrip('.')}`"
                    if prefix
                    else f"add a `{f.name}:` section",
                )
            continue
        values[f.name] = _coerce(raw[f.name], hints[f.name], path, keypath)
    return cls(**values)


def _coerce(value: Any, hint: Any, path: Path, keypath: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, path, keypath)
    if dataclasses.is_dataclass(hint):
        return _build(hint, value if value is not None else {}, path, keypath + ".")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, keypath, "true or false", value)
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _type_error(path, keypath, "an integer", value)
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise _type_error(path, keypath, "a number", value)
    if hint is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, keypath, "a string", value)
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(path, keypath, "a list", value)
        (item_hint,) = args
        if item_hint is str:
            # Numbers in an args list are a common slip (`args: [--steps, 100]`): accept
            # scalars and keep their text, since they end up on a command line anyway.
            return [_scalar_text(v, path, f"{keypath}[{i}]") for i, v in enumerate(value)]
        return [_coerce(v, item_hint, path, f"{keypath}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(path, keypath, "a mapping", value)
        key_hint, value_hint = args
        if value_hint is str:
            return {str(k): _scalar_text(v, path, f"{keypath}.{k}") for k, v in value.items()}
        return {str(k): v for k, v in value.items()}
    raise AssertionError(f"unsupported config type {hint!r} at {keypath}")


def _scalar_text(value: Any, path: Path, keypath: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise _type_error(path, keypath, "a string", value)


def _type_error(path: Path, keypath: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{path}: {keypath}: expected {expected}, got {_describe(value)}")


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"


# --------------------------------------------------------------------------- paths and rules


def _resolve_paths(config: Config, path: Path) -> None:
    base = path.resolve().parent

    def resolve(p: str) -> str:
        expanded = Path(p).expanduser()
        return os.path.normpath(expanded if expanded.is_absolute() else (base / expanded))

    config.trainer.source = resolve(config.trainer.source)
    config.host.known_hosts = resolve(config.host.known_hosts)
    if config.host.identity_file:
        config.host.identity_file = resolve(config.host.identity_file)
    # A local workdir (no container on this machine) is a local path too.
    if config.host.is_local and config.container.vmid is None:
        config.container.workdir = resolve(config.container.workdir)
        # `python: ../.venv/bin/python` names a file next to this config, not a command.
        if "/" in config.container.python:
            config.container.python = resolve(config.container.python)


_PROXY_JUMP = re.compile(r"^(?:[^@\s]+@)?[^@:\s]+(?::\d{1,5})?$")
_TOKEN_ID = re.compile(r"^[^@\s]+@[^!\s]+![^\s]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _check_semantics(config: Config, path: Path) -> None:
    def fail(keypath: str, message: str, hint: str | None = None) -> None:
        raise ConfigError(f"{path}: {keypath}: {message}", hint=hint)

    host = config.host
    if not host.address.strip():
        fail(
            "host.address",
            "must not be empty",
            "a hostname, an IP, an ~/.ssh/config alias or 'local'",
        )
    if host.port is not None and not 1 <= host.port <= 65535:
        fail("host.port", f"expected a port between 1 and 65535, got {host.port}")
    if host.proxy_jump and not _PROXY_JUMP.match(host.proxy_jump):
        fail("host.proxy_jump", f"expected user@host[:port], got {host.proxy_jump!r}")
    if host.connect_timeout_s <= 0:
        fail("host.connect_timeout_s", "must be positive")
    if host.keepalive_s < 0:
        fail("host.keepalive_s", "must be 0 (off) or a number of seconds")

    pve = config.proxmox
    if pve.api not in ("ssh", "https"):
        fail("proxmox.api", f"expected 'ssh' or 'https', got {pve.api!r}")
    if pve.api == "https":
        if not pve.url or not pve.url.startswith("https://"):
            fail("proxmox.url", "required with api: https, e.g. https://pve.lan:8006")
        if not pve.token_id or not _TOKEN_ID.match(pve.token_id):
            fail("proxmox.token_id", "required with api: https, in the form user@realm!tokenname")
    if not _ENV_NAME.match(pve.token_secret_env):
        fail(
            "proxmox.token_secret_env",
            f"not an environment variable name: {pve.token_secret_env!r}",
        )

    ct = config.container
    if ct.vmid is not None and not 100 <= ct.vmid <= 999_999_999:
        fail(
            "container.vmid",
            f"Proxmox vmids run from 100 to 999999999, got {ct.vmid}",
            "or null to run directly on the host",
        )
    if not ct.workdir.startswith("/"):
        fail("container.workdir", f"must be an absolute path, got {ct.workdir!r}")
    if ct.workdir.rstrip("/") in ("", "/root", "/home", "/tmp", "/usr", "/etc"):
        fail(
            "container.workdir",
            f"{ct.workdir!r} is too broad: dflashctl manages releases/ and runs/ in it",
            "use a folder of its own, e.g. /root/dflash",
        )
    if not ct.python.strip():
        fail("container.python", "must name an interpreter, e.g. python3")

    tr = config.trainer
    if not tr.entry.endswith(".py") or tr.entry.startswith("/") or ".." in Path(tr.entry).parts:
        fail("trainer.entry", f"expected a .py file inside trainer.source, got {tr.entry!r}")
    for key in tr.env:
        if not _ENV_NAME.match(key):
            fail(f"trainer.env.{key}", "not a valid environment variable name")

    if config.run.stop_grace_s < 0:
        fail("run.stop_grace_s", f"must be 0 or more seconds, got {config.run.stop_grace_s}")
    if config.run.keep_releases < 1:
        fail(
            "run.keep_releases",
            f"must be at least 1 (the current release), got {config.run.keep_releases}",
        )

    retry = config.run.retry
    if retry.max_restarts < 0:
        fail("run.retry.max_restarts", f"must be 0 (off) or more, got {retry.max_restarts}")
    for key in ("backoff_s", "max_backoff_s", "window_s"):
        if getattr(retry, key) < 0:
            fail(f"run.retry.{key}", f"must be 0 or more seconds, got {getattr(retry, key)}")
    for i, category in enumerate(retry.on or []):
        if not re.match(r"^[a-z][a-z0-9_]*$", category):
            fail(f"run.retry.on[{i}]", f"{category!r} is not a crash category (lower_snake_case)")

    for i, rule in enumerate(config.crash_patterns):
        if not isinstance(rule, dict):
            fail(f"crash_patterns[{i}]", f"expected a mapping, got {_describe(rule)}")
