"""The agent's entry: run one verb with its JSON parameters, answer in JSON on stdout:
`{"ok": true, ...}`, or `{"ok": false, "error": ..., "hint": ...}` (exit status 1)."""

import json
import sys

from .errors import AgentError, error_answer
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
    except (AgentError, OSError) as exc:
        answer = error_answer(exc)
        if isinstance(exc, TrainerConfigRefused):
            answer["config_refused"] = True
        if getattr(exc, "package", None):  # a failed setup: the package pip could not get
            answer["package"] = exc.package
        _answer(answer)
        return 1
    result["ok"] = True
    _answer(result)
    return 0
