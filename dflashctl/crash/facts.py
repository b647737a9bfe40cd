"""The particulars of a failure, read from its lines, for the categories whose hint
needs them: the bad record's file:line, the full disk's path and free space, the
port in use, the package missing, the tokenizer's and vocabulary's sizes, the rank a
collective waited for. They go into the event's `details` and its hint (`Here: ...`).
Standard library only.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from dflashctl.crash.events import CrashEvent

_FILE_LINE = re.compile(
    r"(?P<file>(?:[A-Za-z]:)?[^\s:'\"()]+\.(?:jsonl|json|txt|parquet|csv)):(?P<line>\d+)"
)
_JSON_POSITION = re.compile(r"line (?P<line>\d+) column (?P<column>\d+)")
_WRITING = re.compile(r"\(writing (?P<path>\S+?); (?P<free>.+? free of .+? at \S+?)\)")
_ERRNO_PATH = re.compile(r"\[Errno (?:28|122)\] [^:]+: '(?P<path>[^']+)'")
_PORT = re.compile(r"\bport[: =]+(?P<port>\d{2,5})\b|:(?P<port2>\d{4,5})\b")
_MODULE = re.compile(r"No module named '(?P<module>[\w.]+)'|cannot import (?P<name>[\w.]+)")
_PIP = re.compile(r"(?P<pip>\S*python\S* -m pip install .+?)\s*$")
_BYTES = re.compile(r"allocate (?P<bytes>\d+) bytes")
_POSITION = re.compile(r"byte (?P<byte>\d+) of the file|in position (?P<position>\d+)")
_FRAME_TEXT = re.compile(r"^(?P<file>.+?):(?P<line>\d+)(?: in (?P<function>.+))?$")
_ENDPOINT = re.compile(
    r"\((?P<host>[\w.:-]+), (?P<port>\d{2,5})\)|(?P<host2>[\w.-]+):(?P<port2>\d{2,5})\b"
)
_JOINED = re.compile(r"(?P<joined>\d+)/(?P<expected>\d+) clients joined")
_SIZES = re.compile(r"has (?P<ids>\d+) tokens but the target's vocabulary has (?P<vocab>\d+)")
# Module names that pip knows by another name.
_PIP_NAMES = {
    "yaml": "pyyaml",
    "pydantic_core": "pydantic",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "google": "protobuf",
    "tensorboard": "tensorboard",
}
_TRAINER_PACKAGES = "torch transformers safetensors 'pydantic>=2.6' pyyaml"


def add_facts(event: CrashEvent, others: list[int]) -> None:
    """Fill `event.details` and end its hint with what applies here. `others`: the
    other ranks of the job (the ones a timed-out collective may have waited for)."""
    reader = _READERS.get(event.category)
    if reader is None:
        return
    text = "\n".join([event.message or "", *event.excerpt])
    said = reader(event, text, others)
    if said:
        event.hint = f"{event.hint} Here: {said}"


def _data_error(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _FILE_LINE.search(event.message or "") or _FILE_LINE.search(text)
    position = _POSITION.search(event.message or "")
    if position:
        event.details.update(byte=int(position["byte"] or position["position"]))
    if found:
        event.details.update(file=found["file"], line=int(found["line"]))
        return (
            f"{found['file']}:{found['line']}: fix or remove that record "
            f"(sed -n '{found['line']}p' {found['file']} shows it)."
        )
    position = _JSON_POSITION.search(event.message or "")
    if position:
        event.details.update(line=int(position["line"]), column=int(position["column"]))
        return f"line {position['line']}, column {position['column']} of the file being read."
    if "byte" in event.details:
        return (
            f"byte {event.details['byte']} of the file being read is not UTF-8 "
            "(`grep -naxv '.*' FILE` lists the lines that are not)."
        )
    return None


def _code_error(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _FRAME_TEXT.match(event.last_frame or "")
    if found is None:
        return None
    event.details.update(file=found["file"], line=int(found["line"]))
    return f"{found['file']}:{found['line']}: {event.message or event.exception}."


def _disk_full(event: CrashEvent, text: str, others: list[int]) -> str | None:
    writing = _WRITING.search(text)
    if writing:
        event.details.update(path=writing["path"], free=writing["free"])
        return f"writing {writing['path']}; {writing['free']}."
    errno_path = _ERRNO_PATH.search(text)
    if errno_path:
        event.details.update(path=errno_path["path"])
        return f"writing {errno_path['path']}; check `df -h {errno_path['path']}`."
    return None


def _host_memory(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _BYTES.search(text)
    if not found:
        return None
    count = int(found["bytes"])
    event.details.update(bytes=count)
    return f"one allocation of {_size(count)}."


def _port_in_use(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _PORT.search(event.message or "") or _PORT.search(text)
    if not found:
        return None
    port = int(found["port"] or found["port2"])
    event.details.update(port=port)
    return f"port {port}: `ss -ltnp 'sport = :{port}'` on that host says who holds it."


def _setup_error(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _MODULE.search(event.message or "") or _MODULE.search(text)
    pip = _PIP.search(event.message or "")
    module = (found["module"] or found["name"]) if found else None
    if module:
        event.details.update(module=module)
    if pip:
        event.details.update(pip=pip["pip"])
        return f"{module or 'a package'} is missing: {pip['pip']}"
    if module is None:
        return None
    top = module.split(".")[0]
    own = [line for line in event.excerpt if f"{os.sep}{top}{os.sep}" in line and "File " in line]
    if "." in module and own and event.exception == "ModuleNotFoundError":
        # A submodule of a package the traceback runs in: the program's own code names
        # a module it does not have (a typo, a file left out), not a missing package.
        event.category, event.rule = "code_error", "import_error_own_code"
        event.hint = (
            "A module of the program imports a module of its own package that is not "
            "there (a rename, a typo, a file left out): a code error, not a missing "
            "package. Fix the import at the file and line below and deploy again."
        )
        where = _FRAME_TEXT.match(event.last_frame or "")
        if where:
            event.details.update(file=where["file"], line=int(where["line"]))
            return f"{where['file']}:{where['line']} imports {module}, which its own package does not have."
        return f"{module}: the program's own package does not have it."
    if top == "dflash":
        return (
            f"{module} is the trainer's own package: the release is incomplete or "
            "trainer.entry runs from another folder; deploy again."
        )
    package = _PIP_NAMES.get(top, top.replace("_", "-"))
    command = f"python -m pip install {package}"
    event.details.update(pip=command)
    return (
        f"{module} is missing: {command} with container.python (the trainer needs "
        f"{_TRAINER_PACKAGES})."
    )


def _collective_timeout(event: CrashEvent, text: str, others: list[int]) -> str | None:
    if event.rank is None or not others:
        return None
    event.details.update(waited_for=others)
    names = ", ".join(str(r) for r in others)
    which = "rank" if len(others) == 1 else "one of ranks"
    return (
        f"rank {event.rank} timed out waiting for {which} {names}, which stopped taking part: "
        "look at its log at that moment."
    )


def _rendezvous(event: CrashEvent, text: str, others: list[int]) -> str | None:
    joined = _JOINED.search(event.message or "") or _JOINED.search(text)
    if joined:
        count, expected = int(joined["joined"]), int(joined["expected"])
        event.details.update(joined=count, expected=expected)
        return (
            f"{count} of {expected} nodes joined: the {expected - count} missing never reached "
            "this node (read their logs)."
        )
    found = _ENDPOINT.search(event.message or "")
    if found is None:
        return None
    host, port = found["host"] or found["host2"], int(found["port"] or found["port2"])
    event.details.update(address=host, port=port)
    return f"{host}:{port} did not answer: `nc -vz {host} {port}` from this node tells."


def _vocabulary(event: CrashEvent, text: str, others: list[int]) -> str | None:
    found = _SIZES.search(text)
    if not found:
        return None
    event.details.update(tokenizer_size=int(found["ids"]), vocab_size=int(found["vocab"]))
    return f"the tokenizer has {found['ids']} ids, the target's vocabulary {found['vocab']}."


def _size(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"


_READERS: dict[str, Callable[[CrashEvent, str, list[int]], str | None]] = {
    "data_error": _data_error,
    "code_error": _code_error,
    "disk_full": _disk_full,
    "host_memory": _host_memory,
    "port_in_use": _port_in_use,
    "setup_error": _setup_error,
    "gloo_timeout": _collective_timeout,
    "nccl_timeout": _collective_timeout,
    "config_error": _vocabulary,
    "rendezvous": _rendezvous,
}
