"""How `--help` reads: plain text that wraps whole sentences, no type labels
(`<bool>`, `<list[str]>`) beside flags, a short line per command, examples in every
command's help, and the environment variables at the root.

Typer's own help output changes with its version (its labels, its panels), so the
commands use the classes below, which format their help from click's stable parts
(params, their opts, metavar and help) whatever typer version is installed.
"""

from __future__ import annotations

import inspect
import typing
from typing import Any

from typer.core import TyperCommand, TyperGroup

# The line each command has in `dflashctl --help` (a whole sentence that fits 80
# columns beside the names).
SHORT_HELP = {
    "init": "Write a commented dflash.yaml to edit.",
    "doctor": "Check the config, SSH, Proxmox, the container, GPUs and disk.",
    "status": "Show the container, its uptime and the active run.",
    "deploy": "Send the trainer, replace the run, follow its log.",
    "restart": "Relaunch the current release and follow it.",
    "stop": "Stop the active run (and the entry script started by hand).",
    "runs": "List the runs; prune old ones; show a run's curves.",
    "runs show": "A run's state, config and curves (two: compared).",
    "logs": "Show a run's log and its crashes; -f follows it.",
    "exec": "Run a command in the container, in the run's environment.",
    "shell": "Open an interactive shell in the container.",
    "pull": "Copy a run's checkpoint, export and metrics here.",
    "stacks": "Show every thread's stack of a live run, per rank.",
    "container": "Make the GPU container a run needs (container create).",
    "container create": "Create the container from the config, GPUs passed through.",
}

EXAMPLES = {
    "init": ["dflashctl init", "dflashctl init configs/gpu-host.yaml"],
    "doctor": [
        "dflashctl doctor",
        "dflashctl doctor -c configs/gpu-host.yaml --json",
        "dflashctl doctor --fix",
    ],
    "status": ["dflashctl status", "dflashctl status --json"],
    "deploy": [
        "dflashctl deploy --dry-run",
        "dflashctl deploy",
        "dflashctl deploy --detach -- --set train.steps=2000",
        "dflashctl deploy --fresh",
    ],
    "restart": ["dflashctl restart", "dflashctl restart --fresh -- --set optim.lr=3e-4"],
    "stop": ["dflashctl stop", "dflashctl stop --json"],
    "runs": ["dflashctl runs", "dflashctl runs --prune 5", "dflashctl runs show"],
    "runs show": [
        "dflashctl runs show",
        "dflashctl runs show 20260101-120000-ab12 20260102-090000-cd34",
        "dflashctl runs show --png curves.png",
    ],
    "logs": ["dflashctl logs", "dflashctl logs -f", "dflashctl logs 20260101-120000-ab12"],
    "exec": [
        "dflashctl exec -- nvidia-smi",
        "dflashctl exec --node gpu-b -- python -m pip list",
    ],
    "shell": ["dflashctl shell", "dflashctl shell --node gpu-b"],
    "pull": [
        "dflashctl pull 20260101-120000-ab12",
        "dflashctl pull 20260101-120000-ab12 --step 400 --to ./ckpt",
    ],
    "stacks": ["dflashctl stacks", "dflashctl stacks 20260101-120000-ab12 --json"],
    "container": ["dflashctl container create --dry-run", "dflashctl container create"],
    "container create": ["dflashctl container create --dry-run", "dflashctl container create"],
}

# Every variable dflashctl reads, for the root --help (and the README).
ENVIRONMENT = [
    ("DFLASHCTL_CONFIG", "the config file when --config is not given (else ./dflash.yaml)"),
    ("DFLASHCTL_DEBUG=1", "show the Python traceback of an error, after its message"),
    ("DFLASHCTL_SSH_CONFIG", "the ssh_config file to read (default: ~/.ssh/config)"),
    ("DFLASHCTL_SSH_CLIENT=paramiko", "never send archives through the system's OpenSSH"),
    (
        "DFLASHCTL_HOST_ROOT",
        "on the Proxmox node: where container create and doctor --fix read /dev, /proc and /etc/pve (default /; the tests' fake node)",
    ),
    ("NO_COLOR", "no colour in any output"),
    ("XDG_CACHE_HOME", "where dflashctl remembers each target's last deploy"),
]


def _option_record(param: Any) -> tuple[str, str] | None:
    if getattr(param, "hidden", False):
        return None
    opts = sorted(param.opts, key=lambda o: (o.startswith("--"), o))
    names = ", ".join(opts + list(param.secondary_opts))
    takes_value = not getattr(param, "is_flag", False) and not getattr(param, "count", False)
    if takes_value:
        names += f" {param.metavar or _value_name(param)}"
    return names, param.help or ""


def _value_name(param: Any) -> str:
    """A value's placeholder when none is set: this CLI's numbers are counts and its
    fractional ones seconds."""
    kind = getattr(getattr(param, "type", None), "name", None)  # click's type
    if kind is None:  # typer 0.2x keeps the annotation instead
        annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
        kind = {int: "integer", float: "float"}.get(annotation, "")
    if kind.startswith("integer"):
        return "N"
    if kind.startswith("float"):
        return "SECONDS"
    return param.name.upper()


def _argument_name(param: Any) -> str:
    name = param.metavar or param.name.upper()
    return name if param.metavar or param.nargs == 1 else f"{name}..."


def _declared_helps(callback: Any) -> dict[str, str]:
    """The help each parameter declares in its Annotated typer.Argument/Option: older
    typer releases leave an argument's help off the click parameter."""
    if callback is None:
        return {}
    try:
        hints = typing.get_type_hints(inspect.unwrap(callback), include_extras=True)
    except Exception:  # an annotation that does not resolve: no help, not a crash
        return {}
    helps = {}
    for name, hint in hints.items():
        for extra in getattr(hint, "__metadata__", ()):
            text = getattr(extra, "help", None)
            if isinstance(text, str):
                helps[name] = text
    return helps


class _PlainHelp:
    """The formatting shared by commands and groups."""

    examples: list[str] = []

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.get_params(ctx) else []  # type: ignore[attr-defined]
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            if param.param_type_name == "argument":
                name = _argument_name(param)
                pieces.append(name if param.required or name.startswith("[") else f"[{name}]")
        if hasattr(self, "subcommand_metavar"):  # a group: its commands follow
            pieces.append(self.subcommand_metavar)
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        arguments, options = [], []
        declared = _declared_helps(getattr(self, "callback", None))
        for param in self.get_params(ctx):  # type: ignore[attr-defined]
            if param.param_type_name == "argument":
                help_text = getattr(param, "help", None) or declared.get(param.name, "")
                arguments.append((_argument_name(param), help_text))
            else:
                record = _option_record(param)
                if record:
                    options.append(record)
        if arguments:
            with formatter.section("Arguments"):
                formatter.write_dl(arguments)
        if options:
            with formatter.section("Options"):
                formatter.write_dl(options)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        if self.examples:
            with formatter.section("Examples"):
                for line in self.examples:
                    formatter.write(f"{'':>{formatter.current_indent}}{line}\n")


class PlainHelpCommand(_PlainHelp, TyperCommand):
    pass


class PlainHelpGroup(_PlainHelp, TyperGroup):
    environment = False  # the root group lists the environment variables

    def format_options(self, ctx: Any, formatter: Any) -> None:
        super().format_options(ctx, formatter)
        self.format_commands(ctx, formatter)

    def format_epilog(self, ctx: Any, formatter: Any) -> None:
        super().format_epilog(ctx, formatter)
        if self.environment:
            with formatter.section("Environment"):
                formatter.write_dl(ENVIRONMENT)


class RootHelpGroup(PlainHelpGroup):
    environment = True
    examples = ["dflashctl init", "dflashctl doctor", "dflashctl deploy", "dflashctl logs -f"]


def help_class(name: str, base: type) -> type:
    """`base` (PlainHelpCommand or PlainHelpGroup) with the examples of command `name`
    ("runs show")."""
    return type("Help_" + name.replace(" ", "_"), (base,), {"examples": EXAMPLES[name]})
