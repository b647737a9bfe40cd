"""The agent's entry: run one verb with its JSON parameters, answer in JSON on stdout:
`{"ok": true, ...}`, or `{"ok": false, "error": ..., "hint": ...}` (exit status 1)."""

import json
import sys

from .commit import CommitAborted
from .errors import AgentError, RolledBack, StaleBase
from .trainer_check import TrainerConfigRefused


def _answer(obj):
    sys.stdout.write(json.dumps(obj))


def main(op, params_json):
    if op == "log":
        # Only what the reader needs: it starts after every drop and should stream at once.
        from .logreader import stream_log

        p = json.loads(params_json)
        stream_log(p["workdir"], p["run_id"], int(p["offset"]), int(p["backlog"]), p["once"])
        return 0
    if op == "setup":  # streams pip's output, then one result line
        from .venvs import stream_setup

        return stream_setup(json.loads(params_json))
    if op == "exec":  # becomes the command: its output and exit status are the answer
        from .exec_env import main_exec

        return main_exec(params_json)
    from .verbs import OPERATIONS

    if op not in OPERATIONS:
        _answer({"ok": False, "error": f"unknown agent operation {op!r}"})
        return 2
    try:
        result = OPERATIONS[op](json.loads(params_json))
    except AgentError as exc:
        answer = {"ok": False, "error": exc.message, "hint": exc.hint}
        if isinstance(exc, StaleBase):
            answer["stale"] = True
        if isinstance(exc, CommitAborted):
            answer.update(aborted=True, in_doubt=exc.in_doubt)
        if isinstance(exc, RolledBack):
            answer.update(rolled_back="here" if exc.here else "peer", relaunched=exc.relaunched)
        if isinstance(exc, TrainerConfigRefused):
            answer["config_refused"] = True
        if getattr(exc, "package", None):  # a failed setup: the package pip could not get
            answer["package"] = exc.package
        _answer(answer)
        return 1
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename else ""
        _answer({"ok": False, "error": f"{exc.strerror or exc}{where}"})
        return 1
    result["ok"] = True
    _answer(result)
    return 0
