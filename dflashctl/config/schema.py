"""dflash.yaml: typed, validated configuration (pydantic models).

Found via --config/-c, then $DFLASHCTL_CONFIG, then ./dflash.yaml. Relative paths
resolve against the folder of the config file. Every mistake becomes one
ConfigError naming the file, the YAML line and column, the key path and what is
allowed, before anything is contacted (see config_errors.py for the wording).

Types are strict (a quoted "22" is not a port, `yes please` is not a boolean), except
where a slip is harmless: numbers in trainer.args/env become text, since they end
up on a command line or in the environment anyway. A check of one field's value is
written in its type (config/base.checked); validators are left for checks that
change the value or read several fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dflashctl import hints
from dflashctl.config import cache as config_cache
from dflashctl.config.base import (
    Section,
    TextList,
    TextMapping,
    checked,
    resolve_path,
)
from dflashctl.config.crash_patterns import rule_problems
from dflashctl.config.errors import (
    Problem,
    config_error,
    describe,
    duplicate_problems,
    invalid,
    problems,
)
from dflashctl.config.nodes import (
    merge_node_sections,
    name_nodes,
    no_duplicate_nodes,
)
from dflashctl.config.run import RunConfig
from dflashctl.config.setup import SetupConfig
from dflashctl.config.yaml_source import MAX_FILE_BYTES, YamlRefused, load_yaml
from dflashctl.errors import ConfigError

CONFIG_ENV = "DFLASHCTL_CONFIG"
DEFAULT_CONFIG_NAME = "dflash.yaml"
LOCAL_ADDRESS = "local"

_PROXY_JUMP = re.compile(r"^(?:[^@\s]+@)?[^@:\s]+(?::\d{1,5})?$")
_TOKEN_ID = re.compile(r"^[^@\s]+@[^!\s]+![^\s]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

Port = Annotated[
    int,
    checked(lambda v: 1 <= v <= 65535, "expected a port between 1 and 65535, got {value}"),
]


class HostConfig(Section):
    address: Annotated[
        str,
        checked(
            str.strip,
            "must not be empty",
            "a hostname, an IP, an ~/.ssh/config alias or 'local'",
        ),
    ]
    # None: take Port/User from ~/.ssh/config, else 22 and root.
    port: Port | None = None
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str = "~/.ssh/known_hosts"
    accept_new_host_key: bool = False
    proxy_jump: Annotated[
        str | None,
        checked(
            lambda v: not v or _PROXY_JUMP.match(v), "expected user@host[:port], got {value!r}"
        ),
    ] = None
    connect_timeout_s: Annotated[float, checked(lambda v: v > 0, "must be positive")] = 10.0
    keepalive_s: Annotated[
        int, checked(lambda v: v >= 0, "must be 0 (off) or a number of seconds")
    ] = 15

    @property
    def is_local(self) -> bool:
        return self.address == LOCAL_ADDRESS

    @field_validator("known_hosts", "identity_file")
    @classmethod
    def _local_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else resolve_path(value, info)


class ProxmoxConfig(Section):
    node: Annotated[
        str, checked(str.strip, "is empty", "the Proxmox node's name, as `pvecm nodes` lists it")
    ] = "pve"
    api: Annotated[
        str, checked(lambda v: v in ("ssh", "https"), "expected 'ssh' or 'https', got {value!r}")
    ] = "ssh"
    url: str | None = None
    token_id: str | None = None
    token_secret_env: Annotated[
        str, checked(_ENV_NAME.match, "not an environment variable name: {value!r}")
    ] = "PVE_TOKEN_SECRET"
    # true | false | a CA bundle path | sha256:AB:CD:... (the certificate pinned, as
    # `pvenode cert info` prints its fingerprint); see remote/proxmox_tls.py
    verify_tls: bool | str = True
    # A container start can wait on storage, hooks and GPU set-up; an HA start on the
    # cluster resource manager. pvesh's own 60 s is too short for some of those.
    start_timeout_s: Annotated[
        float, checked(lambda v: v > 0, "must be a positive number of seconds")
    ] = 300.0

    @field_validator("verify_tls")
    @classmethod
    def _verify_tls(cls, value: bool | str) -> bool | str:
        from dflashctl.remote.proxmox_tls import parse_verify_tls

        try:
            parse_verify_tls(value)
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return value

    @model_validator(mode="after")
    def _https_needs_a_token(self) -> ProxmoxConfig:
        if self.api == "https":
            if not self.url or not self.url.startswith("https://"):
                raise invalid("required with api: https, e.g. https://pve.lan:8006", key="url")
            if not self.token_id or not _TOKEN_ID.match(self.token_id):
                raise invalid(
                    "required with api: https, in the form user@realm!tokenname", key="token_id"
                )
        return self


Count = Annotated[int | None, checked(lambda v: v >= 1, "must be 1 or more, got {value}")]


class ContainerConfig(Section):
    vmid: Annotated[
        int | None,
        checked(
            lambda v: 100 <= v <= 999_999_999,
            "Proxmox vmids run from 100 to 999999999, got {value}",
            "or null to run directly on the host",
        ),
    ] = None
    workdir: str = "/root/dflash"
    python: Annotated[str, checked(str.strip, "must name an interpreter, e.g. python3")] = "python3"
    start_if_stopped: bool = False
    # What `dflashctl container create` makes (dflashctl/container/spec.py reads them).
    template: str | None = None  # e.g. local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst
    storage: str = "local-lvm"  # where the root disk goes
    hostname: str | None = None
    cores: Count = None
    memory: Count = None  # MiB, as pct takes it
    disk: Count = None  # GiB
    gpus: Literal["all"] | list[int] | None = None
    shm_size: str | None = None  # /dev/shm, e.g. 16G; default: 1G per rank of the node
    unprivileged: bool = True
    net0: str = "name=eth0,bridge=vmbr0,ip=dhcp"
    # The NVIDIA user-space installer for the host driver's {version}: a URL fetched in
    # the container, or a file on this machine sent there.
    nvidia_installer: str = (
        "https://us.download.nvidia.com/XFree86/Linux-x86_64/{version}/"
        "NVIDIA-Linux-x86_64-{version}.run"
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list) and any(
            not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in value
        ):
            raise invalid(f"GPU indices are whole numbers from 0, got {value}", "e.g. [0, 1]")
        if isinstance(value, str) and value != "all":
            raise invalid(f"{value!r} is not a GPU selection", "all, or a list such as [0, 1]")
        return value

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"\d+[KMGT]?", str(value).strip(), re.I):
            raise invalid(f"{value!r} is not a size", "e.g. 16G or 512M")
        return None if value is None else str(value).strip().upper()


# Left out of a deploy unless trainer.exclude says otherwise: caches, version control,
# and the weights, data and run outputs that a trainer folder often holds (a deploy
# names what it left out).
DEFAULT_EXCLUDE = [
    "__pycache__/", "*.pyc", ".git/", ".venv/", "venv/", ".ipynb_checkpoints/",
    "*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.h5",
    "*.npy", "*.npz", "*.arrow", "*.parquet",
    "checkpoints/", "outputs/", "data/", "datasets/", "wandb/", "runs/", "mlruns/",
    "lightning_logs/",
]  # fmt: skip


class TrainerConfig(Section):
    source: str = "trainer"
    entry: Annotated[
        str,
        checked(
            lambda v: v.endswith(".py") and not v.startswith("/") and ".." not in Path(v).parts,
            "expected a .py file inside trainer.source, got {value!r}",
        ),
    ] = "train_dflash_pipeline.py"
    args: TextList = Field(default_factory=list)
    env: TextMapping = Field(default_factory=dict)
    exclude: list[str] = Field(default_factory=lambda: list(DEFAULT_EXCLUDE))
    # A deploy that would send more than this asks first (off a terminal: needs --yes);
    # null: never ask.
    confirm_above_mb: Annotated[
        float | None,
        checked(
            lambda v: v >= 0, "must be 0 or more megabytes, got {value}", "or null to never ask"
        ),
    ] = 100.0

    @field_validator("source")
    @classmethod
    def _source(cls, value: str, info: ValidationInfo) -> str:
        if not value.strip():  # would deploy the config's own folder
            raise invalid("is empty", "name the trainer's folder, e.g. trainer.source: trainer")
        return resolve_path(value, info)

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _ENV_NAME.match(name):
                raise invalid("not a valid environment variable name", key=name)
        return value


_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class NodeConfig(Section):
    """One node of a run across several boxes: a host and its container. In the file
    each section holds only what differs from the top-level section of the same name
    (merged in parse_config)."""

    # None: the host's address (and the vmid, when shared)
    name: Annotated[
        str | None,
        checked(
            _NODE_NAME.match,
            "{value!r} is not a node name",
            "letters, digits, '.', '_' and '-', e.g. gpu-a",
        ),
    ] = None
    host: HostConfig
    proxmox: ProxmoxConfig = Field(default_factory=ProxmoxConfig)
    container: ContainerConfig = Field(default_factory=ContainerConfig)

    def label(self) -> str:
        assert self.name is not None  # named by Config._nodes
        return self.name


class TorchrunConfig(Section):
    """How several nodes run as one torchrun job (static rendezvous: node rank r hosts
    ranks r*N .. r*N+N-1, so rank 0, which writes the checkpoints, is on the first node)."""

    nproc_per_node: int | str = "gpu"  # processes per node: a number, or gpu/auto/cpu
    port: Port = 29400  # on the first node's container: torchrun's rendezvous store
    # On the first node's container too: where every node's launch agrees to go on
    # (the old run's torchrun still holds `port` then); default port + 1.
    commit_port: Port | None = None
    # Where the other nodes reach the first node's container; None: the address it
    # has on its default route, asked from inside it at each launch.
    address: Annotated[
        str | None,
        checked(
            lambda v: v.strip() and not any(c.isspace() for c in v),
            "expected a hostname or an IP address, got {value!r}",
        ),
    ] = None
    args: TextList = Field(default_factory=list)  # more torchrun options, before the script

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _nproc(cls, value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise invalid(f"expected a number or gpu, auto or cpu, got {describe(value)}")
        if isinstance(value, int) and value < 1:
            raise invalid(f"must be at least 1, got {value}")
        if isinstance(value, str) and value not in ("gpu", "auto", "cpu"):
            raise invalid(f"expected a number or gpu, auto or cpu, got {value!r}")
        return value

    @model_validator(mode="after")
    def _default_commit_port(self) -> TorchrunConfig:
        if self.commit_port is None:
            if self.port == 65535:
                raise invalid(
                    "defaults to port + 1, and port is 65535: set commit_port",
                    key="commit_port",
                )
            self.commit_port = self.port + 1
        if self.commit_port == self.port:
            raise invalid(
                "must differ from port (the old run's torchrun holds that port while the "
                "nodes agree on the new one)",
                key="commit_port",
            )
        return self


class Config(Section):
    # Declared first: a mistake inside a node is reported there, not as its copy in host.
    nodes: list[NodeConfig] = Field(default_factory=list)
    host: HostConfig
    proxmox: ProxmoxConfig = Field(default_factory=ProxmoxConfig)
    container: ContainerConfig = Field(default_factory=ContainerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunConfig = Field(default_factory=RunConfig)
    torchrun: TorchrunConfig = Field(default_factory=TorchrunConfig)
    setup: SetupConfig = Field(default_factory=SetupConfig)
    # Checked by dflashctl.crash.rules, which knows the form of a rule.
    crash_patterns: list[dict[str, Any]] = Field(default_factory=list)
    # Not part of the file: where it came from and a digest of what it says.
    _path: Path = PrivateAttr(default=Path(DEFAULT_CONFIG_NAME))
    _digest: str = PrivateAttr(default="")

    @property
    def path(self) -> Path:
        return self._path

    @property
    def digest(self) -> str:
        return self._digest

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()

    def for_node(self, index: int) -> Config:
        """This config as if it named node `index` alone: everything that works on one
        target (sync, launch, follow) takes it unchanged."""
        node = self.nodes[index]
        return self.model_copy(
            update={
                "host": node.host,
                "proxmox": node.proxmox,
                "container": node.container,
                "nodes": [node],
            }
        )

    def node_configs(self) -> list[Config]:
        return [self.for_node(i) for i in range(len(self.nodes))]

    @model_validator(mode="before")
    @classmethod
    def _every_section_from_the_file(cls, data: Any) -> Any:
        """A left-out or empty section is an empty mapping, validated like a written one."""
        if not isinstance(data, dict):
            return data
        filled = {
            name: {} for name in ("proxmox", "container", "trainer", "run", "torchrun", "setup")
        }
        filled.update({k: v for k, v in data.items() if not (v is None and k in filled)})
        if filled.get("host", "") is None:
            filled["host"] = {}
        return filled

    @model_validator(mode="after")
    def _workdir(self, info: ValidationInfo) -> Config:
        written = bool(self.nodes)
        if not written:  # the plain case: one node, the top-level sections
            self.nodes = [
                NodeConfig(host=self.host, proxmox=self.proxmox, container=self.container)
            ]
        for index, node in enumerate(self.nodes):
            where = ("nodes", index, "container") if written else ("container",)
            node.container = _checked_container(node.host, node.container, info, where)
        name_nodes(self.nodes)
        if written:
            no_duplicate_nodes(self.nodes)
        first = self.nodes[0]
        self.host, self.proxmox, self.container = first.host, first.proxmox, first.container
        return self


def _checked_container(
    host: HostConfig, ct: ContainerConfig, info: ValidationInfo, where: tuple[Any, ...]
) -> ContainerConfig:
    # A local workdir (no container on this machine) is a local path too, and
    # `python: ../.venv/bin/python` names a file next to this config, not a command.
    if host.is_local and ct.vmid is None:
        update = {"workdir": resolve_path(ct.workdir, info)}
        if "/" in ct.python:
            update["python"] = resolve_path(ct.python, info)
        ct = ct.model_copy(update=update)
    if not ct.workdir.startswith("/"):
        raise invalid(f"must be an absolute path, got {ct.workdir!r}", key=(*where, "workdir"))
    if ct.workdir.rstrip("/") in ("", "/root", "/home", "/tmp", "/usr", "/etc"):
        raise invalid(
            f"{ct.workdir!r} is too broad: dflashctl manages releases/ and runs/ in it",
            "use a folder of its own, e.g. /root/dflash",
            key=(*where, "workdir"),
        )
    return ct


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
        with path.open("rb") as stream:  # no more than the limit, whatever the file is
            data = stream.read(MAX_FILE_BYTES + 1)
        # Past the limit, the cut may fall inside a character: parse_config refuses it.
        text = data.decode("utf-8", "strict" if len(data) <= MAX_FILE_BYTES else "replace")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start + 1} is not UTF-8)",
            hint="a dflash.yaml is UTF-8 YAML text; write a fresh one with `dflashctl init`",
        ) from exc
    remembered = config_cache.load(path, text, Config)
    if remembered is not None:
        return remembered
    config = parse_config(text, path)
    config_cache.store(path, text, config)
    return config


def parse_config(text: str, path: Path) -> Config:
    try:
        source = load_yaml(text)
    except YamlRefused as exc:
        mark = exc.problem_mark
        raise ConfigError(
            f"{path}, line {mark.line + 1}, column {mark.column + 1}: refused: {exc.problem}",
            hint=exc.hint,
        ) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "somewhere"
        problem = exc.problem or str(exc)
        raise ConfigError(
            f"{path}: malformed YAML at {where}: {problem}",
            hint="check the indentation and quoting on that line",
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: malformed YAML: {exc}") from None
    raw = {} if source.data is None else source.data
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: expected a mapping of sections (host, proxmox, container, ...), "
            f"got {describe(raw)}"
        )
    found: list[Problem] = duplicate_problems(source)
    raw = merge_node_sections(raw, source)
    # The crash rules are part of the config: every command that reads it (doctor,
    # deploy, logs ...) refuses the same mistakes in them.
    found += rule_problems(raw.get("crash_patterns"), source)
    try:
        config = Config.model_validate(raw, context={"base": path.resolve().parent})
    except ValidationError as exc:
        found += problems(exc, Config, source)
    if found:
        raise config_error(path, found)
    config._path = path.resolve()
    config._digest = hashlib.sha256(
        json.dumps(config.to_dict(), sort_keys=True, default=str).encode()
    ).hexdigest()
    return config
