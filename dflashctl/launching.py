"""What deploy and restart share: the launch parameters the agent's `launch` and
`deploy` verbs take, the stop-and-launch call, and how stopped and launched runs are
reported and followed."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING, Any, cast

from dflashctl import agent_client, hints, recovery, terminal
from dflashctl.agent_messages import LaunchAnswer, LaunchParams, ProcessToStop, StoppedProcess
from dflashctl.config import Config
from dflashctl.connect import open_target
from dflashctl.crash import Rule
from dflashctl.errors import HostError
from dflashctl.follow import follow_run, report_result

if TYPE_CHECKING:
    from dflashctl.target import Target


def process_scope(config: Config) -> str:
    """Where a hand-started trainer may be: anywhere in a container of its own; on a
    machine without one, only under the workdir (other projects share the machine)."""
    return "container" if config.container.vmid is not None else "workdir"


def trainer_command(config: Config, extra_args: list[str]) -> list[str]:
    return [config.container.python, config.trainer.entry, *config.trainer.args, *extra_args]


def launch_params(
    config: Config,
    run_id: str,
    release: str | None,
    command: list[str],
    meta: dict[str, Any],
    grace_s: float | None = None,
) -> LaunchParams:
    return {
        "workdir": config.container.workdir,
        "release": release,
        "run_id": run_id,
        "entry": config.trainer.entry,
        "scope": process_scope(config),
        "command": command,
        "env": {
            **config.trainer.env,
            **({"DFLASH_ON_EXIT": config.run.on_exit} if config.run.on_exit else {}),
        },
        "grace_s": config.run.stop_grace_s if grace_s is None else grace_s,
        "keep_releases": config.run.keep_releases,
        "meta": meta,
        "supervisor": recovery.supervisor_program(),
        "recovery": recovery.recovery_settings(config),
    }


def stop_and_launch(config: Config, target: Target, params: LaunchParams) -> LaunchAnswer:
    """Stop stale runs and launch `params["release"]` (None: the current one) in one
    round trip: a deploy with nothing to send, and restart."""
    grace = float(params["grace_s"])
    timeout = grace + 120
    try:
        answer = agent_client.call_agent(
            target, config.container.python, "launch", params, timeout=timeout
        )
        return cast(LaunchAnswer, answer)
    except HostError as exc:
        if params.get("release"):
            exc.hint = exc.hint or (
                f"release {params['release']} is unpacked in {config.container.workdir}/releases; "
                f"{hints.command('restart')} launches the current release again"
            )
        raise


def describe_stopped(stopped: StoppedProcess) -> str:
    who = f"run {stopped['run_id']}" if stopped.get("run_id") else "hand-started process"
    what = f"{who} (pid {stopped['pid']})"
    if stopped["ended"] == "terminated":
        how = f"exited after SIGTERM in {stopped.get('seconds', 0):.1f} s"
    elif stopped["ended"] == "killed":
        how = f"killed with SIGKILL after the {stopped.get('seconds', 0):.0f} s grace period"
    else:
        how = stopped["ended"]
    code = stopped.get("exit_code")
    if code is not None:
        how += f", exit code {code}"
    return f"stopped {what}: {how}"


def print_stopped(stopped: list[StoppedProcess], seconds: float) -> None:
    if not stopped:
        return
    for index, item in enumerate(stopped):
        terminal.step_done(describe_stopped(item), seconds if index == 0 else 0.0)


def describe_target_to_stop(item: ProcessToStop) -> str:
    who = f"run {item['run_id']}" if item.get("run_id") else "hand-started"
    scope = "its process group" if item.get("group") else "the process and its children"
    return f"pid {item['pid']} ({who}, {scope}): {item.get('cmdline', '')}"


def print_launched(launched: LaunchAnswer, run_id: str, command: list[str], seconds: float) -> None:
    """The runs the agent stopped, then the one it launched; `seconds` is the time the
    stop and launch took together."""
    stop_s = float(launched.get("stop_seconds") or 0.0) if launched["stopped"] else 0.0
    print_stopped(launched["stopped"], stop_s)
    terminal.step_done(
        f"launched run {run_id} (pid {launched['run']['pid']}) from release "
        f"{launched['release']}: {shlex.join(command)}",
        max(seconds - stop_s, 0.0),
    )


# --------------------------------------------------------------------------- following


def follow_unless_detached(
    config: Config, target: Target, rules: list[Rule], summary: dict[str, Any], *, detach: bool
) -> tuple[int, dict[str, Any]]:
    """Follow the new run's log as `logs --follow` does; (exit code, summary with the
    run's result)."""
    run_id = summary["run_id"]
    if detach:
        terminal.info(f"follow it with {hints.command(f'logs -f {run_id}')}")
        return 0, summary
    result = follow_run(
        lambda: open_target(config),
        config.container.workdir,
        run_id,
        rules=rules,
        target=target,
        python=config.container.python,
        from_offset=0,
    )
    summary["result"] = result.to_json()
    return report_result(result), summary
