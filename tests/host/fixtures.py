"""pytest fixtures for the test host. tests/conftest.py pulls them in with
`pytest_plugins = ["tests.host.fixtures"]`.

    pve_host        session: a real sshd on 127.0.0.1 (see sshd.SshServer), pct/pvesh on PATH
    pve_host2       session: a second node (pve2): its own sshd, host key, state, containers
    shared_known_hosts  session: one known_hosts file trusting both hosts
    make_container  factory: make_container(vmid=200, running=True, host=pve_host,
                    network=None) -> Container
    container       a running container 200
    container_network   2 network namespaces on one bridge (10.231.0.1, .2), see netns.py
    make_network    factory: make_network(size=2, subnet="10.231.0.0/24") -> netns.Network
    write_config    write_config(directory, vmid=200, trainer_source=None, host=pve_host,
                    **overrides) -> Path

Containers are real LXC containers (Debian's `lxc`) where LXC can start one, else
bubblewrap sandboxes; the run's summary says which kind ran (DFLASHCTL_TEST_CONTAINERS=
lxc|bwrap picks one). Where the host cannot be had (not root, no sshd/nsenter, neither
LXC nor bubblewrap) these tests skip and say why; with CI=true they fail instead, so CI
never passes by skipping them.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from . import lxc, netns, state
from .containers import Container
from .sshd import SshServer, write_known_hosts

REPO_ROOT = Path(__file__).resolve().parents[2]
NODE = "pve"
SECOND_NODE = "pve2"


def _missing_tool(name: str) -> bool:
    return shutil.which(name) is None and not Path("/usr/sbin", name).exists()


@cache
def host_problem() -> str | None:
    """Why the test host cannot run here, or None."""
    if os.geteuid() != 0:
        return "the test host needs root (sshd, bubblewrap namespaces, nsenter)"
    missing = [t for t in ("sshd", "ssh", "ssh-keygen", "nsenter") if _missing_tool(t)]
    if missing:
        return (
            f"the test host needs {', '.join(missing)} "
            f"(apt-get install openssh-server openssh-client util-linux)"
        )
    if _missing_tool("bwrap"):
        return None if not lxc.tools_missing() else "the test host needs lxc or bubblewrap"
    probe = subprocess.run(
        [
            "bwrap",
            "--unshare-pid",
            "--unshare-uts",
            "--as-pid-1",
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"bubblewrap cannot create namespaces here: {probe.stderr.strip()}"
    return None


def require_test_host() -> None:
    problem = host_problem()
    if problem is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"test host unavailable under CI: {problem}", pytrace=False)
    pytest.skip(problem)


# A container has its own /root and /tmp, which hide whatever the host keeps there.
PRIVATE_IN_CONTAINERS = (Path("/root"), Path("/tmp"))


def _read_only_binds() -> list[str]:
    """Host folders the containers still need although their private /root or /tmp hides
    them: the Python interpreter under /root/.pyenv, a checkout or venv under /root or
    /tmp (a clean clone in /tmp, as CI may make)."""
    return hidden_in_containers(
        [
            Path("/root/.pyenv"),
            REPO_ROOT,
            Path(sys.prefix),
            Path(sys.base_prefix),
            Path(sys.executable).resolve().parent,
        ]
    )


def hidden_in_containers(candidates: list[Path]) -> list[str]:
    """The existing candidates a container's private folders would hide, outermost only."""
    hidden = set()
    for path in candidates:
        path = path.resolve()
        if path.exists() and any(
            path != private and path.is_relative_to(private) for private in PRIVATE_IN_CONTAINERS
        ):
            hidden.add(path)
    # A folder inside another one is bound with it.
    kept = [p for p in hidden if not any(p != q and p.is_relative_to(q) for q in hidden)]
    return sorted(str(p) for p in kept)


def _lxc_binds() -> list[str]:
    """What an LXC container needs bound in read-only to run the test interpreter: it
    sees nothing of the host but these (and the libraries the busybox template binds)."""
    candidates = [
        Path("/root/.pyenv"),
        REPO_ROOT,
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(sys.executable).resolve().parent,
    ]
    found = {p.resolve() for p in candidates if p.exists()}
    kept = [p for p in found if not any(p != q and p.is_relative_to(q) for q in found)]
    return sorted(str(p) for p in kept)


# Which kind of container this session runs, and why LXC did not (for the summary).
CONTAINER_KIND: dict[str, str] = {}


def _host_settings(base: Path) -> dict:
    """host.json: real LXC where it starts here, else bubblewrap (and why)."""
    wanted = os.environ.get("DFLASHCTL_TEST_CONTAINERS", "")
    settings = {"node": NODE}
    reason = f"DFLASHCTL_TEST_CONTAINERS={wanted}"
    if wanted != "bwrap":
        binds = _lxc_binds()
        try:
            lxc.reap_stale_containers()
            lxc.probe(base / "lxc-probe", binds)
            rootfs = lxc.prepare_rootfs(base / "lxc-rootfs", binds)
        except (lxc.LxcUnavailable, OSError, subprocess.SubprocessError) as err:
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            if wanted == "lxc":
                pytest.fail(f"LXC containers asked for but unavailable: {reason}", pytrace=False)
        else:
            CONTAINER_KIND.update(kind="lxc", detail=lxc.version())
            return dict(
                settings,
                containers="lxc",
                lxc_prefix=lxc.session_prefix(),
                lxc_rootfs=str(rootfs),
                ro_binds=binds,
            )
    if _missing_tool("bwrap"):
        pytest.fail(f"no containers for the test host: LXC: {reason}; no bwrap", pytrace=False)
    CONTAINER_KIND.update(kind="bwrap", detail=f"LXC not used: {reason}")
    local_bin = base / "usr-local-bin"
    local_bin.mkdir()
    python3 = local_bin / "python3"  # the interpreter where a Debian container's pip puts tools
    python3.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python3.chmod(0o755)
    return dict(settings, containers="bwrap", ro_binds=_read_only_binds(), local_bin=str(local_bin))


def pytest_sessionfinish(session):
    # Under several test workers the summary is written by the controller, which made no
    # container itself: each worker hands it what it ran.
    if CONTAINER_KIND and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["container_kind"] = json.dumps(CONTAINER_KIND)


@pytest.hookimpl(optionalhook=True)  # a hook of the test-worker plugin, absent without it
def pytest_testnodedown(node, error):
    ran = getattr(node, "workeroutput", {}).get("container_kind")
    if ran:
        CONTAINER_KIND.update(json.loads(ran))


def pytest_terminal_summary(terminalreporter):
    if CONTAINER_KIND:
        terminalreporter.write_line(
            f"test host containers: {CONTAINER_KIND['kind']} ({CONTAINER_KIND['detail']})"
        )


def _serve(base: Path, settings: dict, **server_options):
    """A test host's sshd over its state folder; on the way out every container of its
    state is killed and removed, then sshd (and with it what sessions left) stopped."""
    state_dir = base / "state"
    state_dir.mkdir()
    (state_dir / "host.json").write_text(json.dumps(settings))
    server = SshServer(
        workdir=base / "ssh", state_dir=state_dir, node=settings["node"], **server_options
    )
    try:
        server.start()
        yield server
    finally:
        for ct in state.list_containers(state_dir):
            state.destroy_container(ct)
        server.stop()


@pytest.fixture(scope="session")
def pve_host(tmp_path_factory):
    """The test host: sshd on 127.0.0.1:<port>, root login with `identity_file`, host key
    in `known_hosts`; sessions run the pct/pvesh stand-ins against `state_dir`."""
    require_test_host()
    netns.reap_stale_holders()
    base = tmp_path_factory.mktemp("pve-host")
    yield from _serve(base, _host_settings(base))


@pytest.fixture(scope="session")
def pve_host2(pve_host, tmp_path_factory):
    """A second node, `pve2`, as a second Proxmox host of a cluster: its own sshd (port,
    host key, `known_hosts`), its own state and containers (its pct/pvesh see only those),
    the same container kind and root filesystem as pve_host. It accepts pve_host's
    client key, as a user's one key is authorized on all their hosts."""
    base = tmp_path_factory.mktemp("pve-host2")
    settings = json.loads((pve_host.state_dir / "host.json").read_text())
    settings["node"] = SECOND_NODE
    if settings.get("containers") == "lxc":
        # LXC names cgroups after the container: both nodes may have a container 200.
        settings["lxc_prefix"] = f"{lxc.session_prefix()}{SECOND_NODE}-"
    yield from _serve(base, settings, client_key=pve_host.identity_file)


@pytest.fixture(scope="session")
def shared_known_hosts(pve_host, pve_host2, tmp_path_factory) -> Path:
    """One known_hosts file with both hosts' keys (a config's top-level known_hosts)."""
    return write_known_hosts(
        tmp_path_factory.mktemp("known-hosts") / "known_hosts", pve_host, pve_host2
    )


@pytest.fixture
def make_container(pve_host):
    """make_container(vmid=200, running=True, hostname=None, host=None, network=None)
    -> Container, on `host` (pve_host unless given, e.g. pve_host2), in the network
    namespace of `network` (a netns.Endpoint, e.g. container_network[0]) if given.
    Every container made is killed and removed after the test."""
    made: list[Container] = []

    def make(
        vmid: int = 200,
        running: bool = True,
        hostname: str | None = None,
        *,
        host: SshServer | None = None,
        network: netns.Endpoint | None = None,
    ) -> Container:
        state_dir = (host or pve_host).state_dir
        if state.Container(state_dir, vmid).exists():
            raise ValueError(f"container {vmid} already exists in this test")
        state.create_container(
            state_dir, vmid, hostname, netns=network.state_entry() if network else None
        )
        handle = Container(state_dir, vmid, network=network)
        made.append(handle)
        if running:
            handle.start()
        return handle

    yield make
    for handle in made:
        handle.destroy()


@pytest.fixture
def make_network():
    """make_network(size=2, subnet="10.231.0.0/24") -> netns.Network: `size` network
    namespaces of our own on one bridge, addresses .1, .2, ...; holders killed after the
    test."""
    made: list[netns.Network] = []

    def make(size: int = 2, subnet: str = netns.SUBNET) -> netns.Network:
        require_test_host()
        try:
            network = netns.Network(size, subnet)
        except netns.NetworkUnavailable as err:
            if os.environ.get("CI") == "true":
                pytest.fail(f"no container network under CI: {err}", pytrace=False)
            pytest.skip(f"no container network here: {err}")
        made.append(network)
        return network

    yield make
    for network in made:
        network.close()


@pytest.fixture
def container_network(make_network) -> netns.Network:
    """Two endpoints, 10.231.0.1/24 and 10.231.0.2/24 (eth0, default route), for
    make_container(..., network=container_network[i])."""
    return make_network(2)


@pytest.fixture
def container(make_container) -> Container:
    """A running container 200 with an empty /root and /tmp."""
    return make_container(200)


def build_config(host, *, vmid: int | None = 200, trainer_source: Path | None = None) -> dict:
    """The dflash.yaml content (templates/dflash.yaml schema) for the test host."""
    return {
        "host": {
            "address": host.address,
            "port": host.port,
            "user": host.user,
            "identity_file": str(host.identity_file),
            "known_hosts": str(host.known_hosts),
            "accept_new_host_key": False,
            "proxy_jump": None,
            "connect_timeout_s": 10,
            "keepalive_s": 15,
        },
        "proxmox": {
            "node": host.node,
            "api": "ssh",
            "url": None,
            "token_id": None,
            "token_secret_env": "PVE_TOKEN_SECRET",
            "verify_tls": True,
        },
        "container": {
            "vmid": vmid,
            "workdir": "/root/dflash",
            # This interpreter (and its venv) is visible read-only inside the containers.
            "python": sys.executable,
            "start_if_stopped": False,
        },
        "trainer": {
            "source": str(trainer_source or REPO_ROOT / "trainer"),
            "entry": "train_dflash_pipeline.py",
            "args": ["--config", "configs/tiny-cpu.yaml"],
            "env": {},
            "exclude": ["__pycache__/", "*.pyc", ".git/", "checkpoints/", "outputs/"],
        },
        "run": {"stop_grace_s": 5, "keep_releases": 5},
        "crash_patterns": [],
    }


def apply_overrides(config: dict, overrides: dict) -> dict:
    """Overrides as dotted keys ("run.stop_grace_s": 1) or nested dicts (run={...})."""
    result = copy.deepcopy(config)
    for key, value in overrides.items():
        parts = key.split(".")
        target = result
        for part in parts[:-1]:
            target = target.setdefault(part, {})
        last = parts[-1]
        if isinstance(value, dict) and isinstance(target.get(last), dict):
            target[last] = apply_overrides(target[last], value)
        else:
            target[last] = value
    return result


@pytest.fixture
def write_config(pve_host):
    """write_config(directory, vmid=200, trainer_source=None, host=None, **overrides) ->
    Path of a dflash.yaml for the test host (`host`: pve_host unless given, e.g.
    pve_host2). `directory` may also be the yaml path itself."""

    def write(
        directory: Path,
        vmid: int | None = 200,
        trainer_source: Path | None = None,
        *,
        host: SshServer | None = None,
        **overrides,
    ) -> Path:
        directory = Path(directory)
        path = directory if directory.suffix in (".yaml", ".yml") else directory / "dflash.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        config = build_config(host or pve_host, vmid=vmid, trainer_source=trainer_source)
        path.write_text(yaml.safe_dump(apply_overrides(config, overrides), sort_keys=False))
        return path

    return write


TOKEN_ID, TOKEN_SECRET = "root@pam!dflash", "5e1f2a3b-token-secret"


@pytest.fixture(scope="session")
def pve_https(pve_host, tmp_path_factory):
    """The Proxmox REST API over HTTPS on 127.0.0.1 (https_api.py), over pve_host's state
    (a container started through it runs for pct), with a self-signed certificate made
    now (`.certificate`, `.fingerprint`) and the token root@pam!dflash (TOKEN_SECRET)."""
    from .https_api import HttpsApi

    server = HttpsApi(pve_host.state_dir, tmp_path_factory.mktemp("pve-https")).start()
    user, _, name = TOKEN_ID.partition("!")
    server.add_token(user, name, TOKEN_SECRET)
    try:
        yield server
    finally:
        server.stop()
