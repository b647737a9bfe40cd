"""The setup step of a launch: setup.requirements and setup.commands installed into a
venv in the container (the agent's venvs.py), its output streamed here as it comes.

The agent's `launch` makes the venv itself when it is missing (so restart and every
other launch run from it too), but silently; a deploy runs the streamed `setup` verb
first, so the user sees pip at work, and a failure stops nothing. A setup this machine
saw succeed for the same content on the same target is not streamed again: the launch
then only checks that the venv is still there (and remakes it if not).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from platformdirs import user_cache_path

from dflashctl.config.schema import Config
from dflashctl.errors import HostError
from dflashctl.remote import agent_client
from dflashctl.remote.deploy_target import Target
from dflashctl.reporting import SILENT, Reporter

RESULT_PREFIX = "DFLASH-SETUP-RESULT "  # the agent's last line (agent/venvs.py)


class SetupFailed(HostError):
    """pip (or a setup command) failed in the container; nothing was stopped."""

    def __init__(self, message: str, *, hint: str | None = None, package: str | None = None):
        super().__init__(message, hint=hint)
        self.package = package


def setup_params(config: Config) -> dict[str, Any] | None:
    """config.setup for the agent, or None when it installs nothing (no requirements
    file in trainer.source, no commands)."""
    setup = config.setup
    requirements = setup.requirements
    if requirements and not (Path(config.trainer.source) / requirements).is_file():
        requirements = None
    if requirements is None and not setup.commands:
        return None
    return {
        "requirements": requirements,
        "commands": list(setup.commands),
        "pip_args": list(setup.pip_args),
        "timeout_s": setup.timeout_s,
    }


def _memory(config: Config, params: dict[str, Any]) -> Path:
    """Where this machine notes that the setup of this content succeeded on this target."""
    text = ""
    if params.get("requirements"):
        text = (Path(config.trainer.source) / params["requirements"]).read_text(errors="replace")
    host, ct = config.host, config.container
    where = [host.address, host.port, host.user, ct.vmid, ct.workdir, ct.python]
    blob = json.dumps([where, text, params["commands"], params["pip_args"]])
    folder = user_cache_path("dflashctl", appauthor=False) / "setups"
    return folder / hashlib.sha256(blob.encode()).hexdigest()[:24]


def needs_streaming(config: Config) -> bool:
    """Should this launch run the streamed setup first? (A setup that installs
    something and that this machine has not seen succeed there.)"""
    params = setup_params(config)
    return params is not None and not _memory(config, params).exists()


def remember(config: Config) -> None:
    params = setup_params(config)
    if params is None:
        return
    path = _memory(config, params)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("ok\n")
    except OSError:
        pass  # best effort: the next deploy streams the (quick) check again


def run_setup(
    config: Config,
    target: Target,
    release: str | None,
    *,
    label: str = "",
    report: Reporter = SILENT,
) -> dict[str, Any] | None:
    """The streamed setup for `release` (None: the current one): pip's output reported
    a line at a time as it comes (`label` names the node); returns the venv
    ({"key", "venv", "python", "built", "seconds"}) or None when nothing is installed;
    raises SetupFailed naming the package."""
    params = setup_params(config)
    if params is None:
        return None
    python = config.container.python
    call = {"workdir": config.container.workdir, "release": release, "setup": params}
    agent_client.install(target, python)
    result, output = _stream(target, python, call, label, report)
    if result is None and agent_client.is_agent_missing(output):
        agent_client.install(target, python, force=True)
        result, output = _stream(target, python, call, label, report)
    if result is None:
        tail = output.decode("utf-8", "replace").strip().splitlines()
        raise HostError(
            f"the setup step on {target.describe()} ended without a result"
            + (f": {tail[-1]}" if tail else ""),
            hint="run the deploy again; `dflashctl doctor` checks the environment",
        )
    if not result.get("ok"):
        raise SetupFailed(
            f"{result.get('error')} (on {target.describe()})",
            hint=result.get("hint"),
            package=result.get("package"),
        )
    venv = result.get("venv")
    if venv:
        how = "made" if venv.get("built") else "up to date"
        seconds = float(venv.get("seconds") or 0.0)
        report.done(f"{label + ' ' if label else ''}setup: venv {venv['key']} {how}", seconds)
    remember(config)
    return venv


def _stream(
    target: Target, python: str, call: dict[str, Any], label: str, report: Reporter
) -> tuple[dict[str, Any] | None, bytes]:
    argv = [
        python,
        "-S",
        "-c",
        agent_client.bootstrap("setup", call, with_bundle=False),
        "DFLASH-SETUP",
    ]
    result = None
    seen = bytearray()
    pending = b""
    with target.stream(argv) as stream:
        while True:
            data = stream.read(1.0)
            if data is None:
                continue
            if data == b"":
                break
            seen = (seen + data)[-65536:]
            pending += data
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                line = raw.decode("utf-8", "replace")
                if line.startswith(RESULT_PREFIX):
                    result = json.loads(line[len(RESULT_PREFIX) :])
                else:
                    report.output(label, line)
    return result, bytes(seen)


def setup_every_node(
    nodes: list[Any], releases: list[str | None], report: Reporter = SILENT
) -> None:
    """The streamed setup on every node at once (each line prefixed by its node), when
    any node has not seen this setup succeed; the first failure raised, naming its node."""
    from dflashctl.remote.nodes import names_each_node, on_every_node, values_or_raise

    if not any(needs_streaming(node.config) for node in nodes):
        return
    outcomes = on_every_node(
        nodes,
        lambda node: run_setup(
            node.config,
            node.target,
            releases[node.index],
            label=node.name if names_each_node(nodes) else "",
            report=report,
        ),
    )
    values_or_raise(outcomes, "setting up the venv")


def doctor_probe(config: Config, target: Target) -> tuple[str, str]:
    """doctor's check: the venv of the current release's setup exists, and its python
    imports the top-level modules of what the requirements name."""
    params = setup_params(config)
    if params is None:
        return "pass", "nothing to install (no setup.requirements file, no setup.commands)"
    call = {"workdir": config.container.workdir, "setup": params}
    try:
        answer = agent_client.call_agent(
            target, config.container.python, "setup_check", call, timeout=600
        )
    except agent_client.AgentFailed as exc:
        if "nothing is deployed" in exc.message:
            return "warn", "nothing deployed yet: the first deploy makes the venv"
        raise
    if not answer.get("needed"):
        return "pass", "the current release installs nothing"
    if not answer.get("ready"):
        raise HostError(
            f"no venv for the current release's setup (expected {answer.get('venv')})",
            hint="deploy or restart makes it (its output shows pip's errors, if any)",
        )
    imports = answer.get("imports") or {}
    broken = {name: why for name, why in imports.items() if why != "ok"}
    if broken:
        listed = "; ".join(f"{name}: {why}" for name, why in broken.items())
        raise HostError(
            f"the venv {answer.get('venv')} does not import: {listed}",
            hint="deploy again with the requirement fixed; a package installed by hand "
            "in the venv is lost at the next setup",
        )
    names = ", ".join(imports) if imports else "no named requirements"
    return "pass", f"venv {answer.get('venv')} imports {names}"
