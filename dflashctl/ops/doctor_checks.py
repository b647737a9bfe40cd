"""doctor's checks of one target, from SSH to free disk and the setup venv: each a
pass, a warning or a failure with its fix. The command (commands/doctor.py) runs them
and says them; ops/doctor_nodes.py runs them on every node."""

from __future__ import annotations

import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dflashctl import hints
from dflashctl.errors import EXIT_HOST, EXIT_OK, EXIT_USAGE, ConfigError, DflashError, HostError
from dflashctl.humanize import human_bytes, human_duration

if TYPE_CHECKING:
    from dflashctl.remote.deploy_target import Target

PYTHON_TIMEOUT_S = 15.0
TORCH_TIMEOUT_S = 60.0  # importing torch reads a few hundred MB the first time
MIN_FREE_BYTES = 2 * 1024**3
PASS, FAIL, SKIP, WARN = "pass", "fail", "skip", "warn"
# ConnectFailed.reason -> the check that failed, where it is not "SSH reachable".
_CONNECT_STEP = {
    "host_key_unknown": "host key known",
    "host_key_changed": "host key known",
    "auth": "SSH login",
}


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skip | warn
    detail: str
    fix: str | None = None
    config_problem: bool = False  # failed because of dflash.yaml (exit 2), not the host
    seconds: float = 0.0
    node: str | None = None  # several nodes: whose check it is (None: about them all)


class Doctor:
    """Runs the checks in order, remembering which ones failed."""

    def __init__(self, on_check: Callable[[Check], None]) -> None:
        self.checks: list[Check] = []
        self._on_check = on_check

    def add(self, check: Check) -> Check:
        self.checks.append(check)
        self._on_check(check)
        return check

    def skip(self, name: str, because: str) -> None:
        self.add(Check(name, SKIP, f"skipped: {because}"))

    def skip_rest(self, because: str) -> None:
        """Every check of a node (NODE_CHECKS) not made yet, skipped."""
        done = {c.name for c in self.checks}
        for name in NODE_CHECKS:
            if name not in done:
                self.skip(name, because)

    def run(self, name: str, probe: Callable[[], tuple[str, str] | str]) -> bool:
        """probe returns the detail (or (status, detail)); a DflashError is a failure."""
        start = time.monotonic()
        try:
            answer = probe()
        except DflashError as exc:
            self.add(
                Check(
                    name,
                    FAIL,
                    exc.message,
                    exc.hint,
                    isinstance(exc, ConfigError),
                    time.monotonic() - start,
                )
            )
            return False
        status, detail = answer if isinstance(answer, tuple) else (PASS, answer)
        self.add(Check(name, status, detail, seconds=time.monotonic() - start))
        return status != FAIL

    @property
    def exit_code(self) -> int:
        failed = [c for c in self.checks if c.status == FAIL]
        if not failed:
            return EXIT_OK
        return EXIT_USAGE if all(c.config_problem for c in failed) else EXIT_HOST


# --------------------------------------------------------------------------- the checks


def _connect_checks(doctor: Doctor, config: Any, transport: Any) -> bool:
    """SSH reachable, host key known, SSH login: one connection attempt, three answers."""
    from dflashctl.remote.transport import ConnectFailed

    if config.host.is_local:
        doctor.add(Check("SSH reachable", PASS, "host.address is local: no SSH needed"))
        doctor.skip("host key known", "no SSH (host.address: local)")
        doctor.skip("SSH login", "no SSH (host.address: local)")
        return True
    start = time.monotonic()
    try:
        transport.connect()
        version, key = transport.server_summary()
    except ConnectFailed as exc:
        failed_step = _CONNECT_STEP.get(exc.reason, "SSH reachable")
        for name in ("SSH reachable", "host key known", "SSH login"):
            if name == failed_step:
                doctor.add(
                    Check(name, FAIL, exc.message, exc.hint, seconds=time.monotonic() - start)
                )
                break
            doctor.add(
                Check(
                    name,
                    PASS,
                    f"{transport.destination.hostname} port "
                    f"{transport.destination.port} answers SSH"
                    if name == "SSH reachable"
                    else "the host key matches known_hosts",
                )
            )
        return False
    except ConfigError as exc:  # e.g. host.identity_file names a missing file
        doctor.add(Check("SSH login", FAIL, exc.message, exc.hint, True))
        return False
    seconds = time.monotonic() - start
    dest = transport.destination
    doctor.add(
        Check(
            "SSH reachable",
            PASS,
            f"{dest.hostname} port {dest.port} answers ({version})",
            seconds=seconds,
        )
    )
    saved = " (new: saved to known_hosts)" if transport.saved_host_keys else ""
    doctor.add(Check("host key known", PASS, f"{key} matches {config.host.known_hosts}{saved}"))
    doctor.add(Check("SSH login", PASS, f"logged in as {dest.user}"))
    return True


# The newest checkpoint of the workdir's runs (the bundled trainer's layout) and its
# size, by what its files hold (--apparent-size where du has it): what the next
# checkpoint will need, about.
_DISK_SCRIPT = (
    'p=$1; while [ ! -e "$p" ]; do p=$(dirname "$p"); done; df -Pk "$p"; '
    'c=$(ls -dt "$1"/runs/*/outputs/checkpoints/step-* 2>/dev/null | head -n 1); '
    'if [ -n "$c" ]; then '
    'k=$(du -sk --apparent-size "$c" 2>/dev/null || du -sk "$c"); '
    'echo "checkpoint ${k%%[!0-9]*} $c"; fi'
)


def _disk_probe(target: Target, workdir: str) -> tuple[str, str]:
    result = target.run(["sh", "-c", _DISK_SCRIPT, "sh", workdir], timeout=PYTHON_TIMEOUT_S)
    lines = result.stdout_text.strip().splitlines()
    checkpoint = next(
        (line.split(" ", 2) for line in lines if line.startswith("checkpoint ")), None
    )
    fields = [line for line in lines if not line.startswith("checkpoint ")][-1].split()
    free = int(fields[3]) * 1024
    mounted = fields[5]
    detail = f"{human_bytes(free)} free for {workdir} (on {mounted})"
    prune = hints.command("runs --prune 5")
    if free < MIN_FREE_BYTES:
        raise HostError(
            f"only {detail}",
            hint="free space there (old runs and their checkpoints go with "
            f"{prune}) or point container.workdir elsewhere",
        )
    if checkpoint is not None and checkpoint[1].isdigit():
        needs = int(checkpoint[1]) * 1024
        if free < needs:
            return WARN, (
                f"{detail}, less than a checkpoint takes: the newest, "
                f"{checkpoint[2]}, is {human_bytes(needs)}; the next one "
                f"would fill the disk (free space with {prune})"
            )
        detail += f", {human_bytes(needs)} per checkpoint"
    return PASS, detail


def _python_probe(target: Target, python: str) -> str:
    # Where a bare name is found (on a root login's PATH in a container) is part of
    # the answer: "Python 3.11.2 (/usr/local/bin/python3)".
    script = 'command -v "$0" || true; exec "$0" --version'
    result = target.run(["sh", "-c", script, python], timeout=PYTHON_TIMEOUT_S, check=False)
    if result.exit_status != 0:
        where = " on a login's PATH there" if "/" not in python else ""
        raise HostError(
            f"{python} does not run in {target.describe()}{where}: "
            f"{result.last_error_line() or f'exit status {result.exit_status}'}",
            hint="install python3 there, or set container.python to its interpreter",
        )
    lines = (result.stdout_text + result.stderr_text).strip().splitlines()
    found = lines[0] if len(lines) > 1 and lines[0].startswith("/") else None
    version = lines[-1].strip() if lines else "?"
    return f"{version} ({found})" if found and found != python else version


_TORCH_SCRIPT = (
    "import importlib.util as u, torch; "
    "print(' '.join(m for m in ('transformers', 'safetensors', 'yaml', 'pydantic') "
    "if u.find_spec(m) is None) or '-', torch.__version__, torch.cuda.is_available(), "
    "torch.cuda.device_count() if torch.cuda.is_available() else 0)"
)
# The bundled trainer's packages besides torch (pyproject's `trainer` extra), by import name.
_PIP_NAMES = {"yaml": "pyyaml"}


def _torch_probe(target: Target, python: str) -> tuple[str, str]:
    result = target.run([python, "-c", _TORCH_SCRIPT], timeout=TORCH_TIMEOUT_S, check=False)
    if result.exit_status != 0:
        raise HostError(
            f"torch cannot be imported by {python} in {target.describe()}: "
            f"{result.last_error_line()}",
            hint=f"install it there: `{python} -m pip install torch`",
        )
    *missing, version, cuda, count = result.stdout_text.split()
    gpus = f"CUDA with {count} GPU(s)" if cuda == "True" else "no CUDA (CPU only)"
    missing = [m for m in missing if m != "-"]
    if missing:
        install = " ".join(_PIP_NAMES.get(m, m) for m in missing)
        return WARN, (
            f"torch {version}, {gpus}; the bundled trainer also needs {', '.join(missing)}: "
            f"`{python} -m pip install {install}` there"
        )
    return PASS, f"torch {version}, {gpus}"


def _gpu_probe(target: Target) -> tuple[str, str]:
    result = target.run(["nvidia-smi", "-L"], timeout=PYTHON_TIMEOUT_S, check=False)
    if result.exit_status in (126, 127):
        return WARN, "nvidia-smi is not installed there: no GPUs visible (CPU training only)"
    gpus = [line for line in result.stdout_text.splitlines() if line.startswith("GPU ")]
    if result.exit_status != 0 or not gpus:
        raise HostError(
            f"nvidia-smi finds no GPU: {result.last_error_line() or 'no output'}",
            hint="set container.gpus and run `dflashctl doctor --fix` (or `dflashctl "
            "container create`): it passes the GPUs through and installs the host "
            "driver's libraries",
        )
    names = sorted({line.split(":", 1)[1].split("(")[0].strip() for line in gpus})
    return PASS, f"{len(gpus)} GPU(s): {', '.join(names)}"


def _passthrough_checks(doctor: Doctor, config: Any, target: Target) -> None:
    """container.gpus set: what `doctor --fix` repairs, each a failure with its fix."""
    from dflashctl.container import repair

    start = time.monotonic()
    try:
        found = repair.findings(config, target, repair.survey(config, target))
    except DflashError as exc:
        doctor.add(Check("GPU passthrough", FAIL, exc.message, exc.hint))
        return
    for finding in found:
        fix = finding.fix + ("" if finding.apply is None else " (dflashctl doctor --fix)")
        doctor.add(Check(finding.name, FAIL, finding.problem, fix))
    if not found:
        doctor.add(
            Check(
                "GPU passthrough",
                PASS,
                "devices, majors, driver libraries and /dev/shm match the host",
                seconds=time.monotonic() - start,
            )
        )


def source_check(doctor: Doctor, config: Any) -> None:
    """What deploy checks before it contacts anything (trainer.source, the entry, every
    .py compiles): "all checks passed" then means a deploy will start."""
    from dflashctl.ops.deploy import preflight

    start = time.monotonic()
    try:
        manifest, checked, _ = preflight(config)
    except DflashError as exc:
        doctor.add(Check("trainer source", FAIL, exc.message, exc.hint, True, 0.0))
        return
    doctor.add(
        Check(
            "trainer source",
            PASS,
            f"{config.trainer.source}: {len(manifest)} files, {checked} Python files compile, "
            f"entry {config.trainer.entry}",
            seconds=time.monotonic() - start,
        )
    )


# The checks of one node, in order (after "config valid" and "trainer source").
NODE_CHECKS = [
    "SSH reachable",
    "host key known",
    "SSH login",
    "Proxmox API answers",
    "container runs",
    "python",
    "torch",
    "GPUs",
    "free disk",
    "setup venv",
    "trainer config",
]


def check_target(doctor: Doctor, config: Any, target: Target) -> bool:
    """Every check of the one target `config` names, from SSH to free disk; the caller
    closes the target. True when its python runs (the agent can be asked things)."""
    from dflashctl.remote.connect import open_proxmox

    transport = target.transport
    if not _connect_checks(doctor, config, transport):
        doctor.skip_rest("needs a working SSH connection")
        return False
    vmid = config.container.vmid
    if vmid is None:
        doctor.skip("Proxmox API answers", "no container configured (container.vmid: null)")
        doctor.skip("container runs", "no container configured: the trainer runs on the host")
    else:
        from dflashctl.remote import proxmox

        api = None

        def api_probe() -> str:
            nonlocal api
            api = open_proxmox(config, transport)
            via = "pvesh over SSH" if config.proxmox.api == "ssh" else config.proxmox.url
            return f"Proxmox VE {proxmox.api_version(api)} ({via})"

        if not doctor.run("Proxmox API answers", api_probe) and api is None:
            # Not even opened (https token, requests): nothing below can work. A
            # failed /version alone says nothing about the rest: go on.
            doctor.skip_rest("needs the Proxmox API")
            return False

        def container_probe() -> str:
            from dflashctl.remote.pct import ContainerNotRunning, not_running_hint

            status = proxmox.container_status(api, config.proxmox.node, vmid)
            if not status.running:
                raise ContainerNotRunning(
                    f"container {vmid} ({status.name}) is {status.status}",
                    hint=not_running_hint(vmid),
                )
            return (
                f"container {vmid} ({status.name}) is running, up {human_duration(status.uptime_s)}"
            )

        if not doctor.run("container runs", container_probe):
            doctor.skip_rest("needs the container running")
            return False

    python = config.container.python
    python_runs = doctor.run("python", lambda: _python_probe(target, python))
    if python_runs:
        doctor.run("torch", lambda: _torch_probe(target, python))
    else:
        doctor.skip("torch", "needs python")
    doctor.run("GPUs", lambda: _gpu_probe(target))
    if vmid is not None and config.container.gpus is not None:
        _passthrough_checks(doctor, config, target)
    doctor.run("free disk", lambda: _disk_probe(target, config.container.workdir))
    if python_runs:
        from dflashctl.ops.setup_env import doctor_probe

        doctor.run("setup venv", lambda: doctor_probe(config, target))
        doctor.run("trainer config", lambda: _trainer_config_probe(config, target))
    else:
        doctor.skip("setup venv", "needs python")
        doctor.skip("trainer config", "needs python")
    return python_runs


def _trainer_config_probe(config: Any, target: Target) -> tuple[str, str]:
    """What deploy asks the trainer before it stops the old run (agent/trainer_check.py):
    its config read by the current release with the run's interpreter."""
    from dflashctl.ops import setup_env
    from dflashctl.ops.launching import hang_env, trainer_command
    from dflashctl.remote import agent_client

    params = {
        "workdir": config.container.workdir,
        "entry": config.trainer.entry,
        "command": trainer_command(config, []),
        "env": {**hang_env(config), **config.trainer.env},
        "setup": setup_env.setup_params(config),
    }
    try:
        answer = agent_client.call_agent(
            target, config.container.python, "trainer_check", params, timeout=600
        )
    except agent_client.AgentFailed as exc:
        if "nothing is deployed" in exc.message:
            return WARN, "nothing deployed yet: deploy checks it before it stops anything"
        raise
    where = f"release {answer['release']} with {answer['python']}"
    if not answer.get("checked"):
        return PASS, f"not checked: {config.trainer.entry} does not read DFLASH_CHECK_CONFIG"
    if answer.get("refused"):
        raise ConfigError(
            f"{where}: {answer['refused']}",
            hint="fix the trainer config, then deploy (deploy refuses it before it stops "
            "the running one)",
        )
    return PASS, f"{where}: the trainer accepts {shlex.join(config.trainer.args)}"
