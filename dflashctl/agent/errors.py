"""The agent's errors: each one becomes the `{"ok": false, "error", "hint"}` answer."""


class AgentError(Exception):
    def __init__(self, message, hint=None):
        Exception.__init__(self, message)
        self.message = message
        self.hint = hint


class StaleBase(AgentError):
    """The release the caller built its plan on is not what is here (any more): it
    should inspect again and send what is really missing. Nothing was changed."""


class RolledBack(AgentError):
    """The new run could not start everywhere after the old one was stopped (here, or
    on another node of the run): it is not running here, and the previous release was
    launched again (`relaunched`) or nothing runs. `here`: this node is the one whose
    launch failed."""

    def __init__(self, message, hint=None, relaunched=False, here=True):
        AgentError.__init__(self, message, hint)
        self.relaunched = relaunched
        self.here = here


class CommitAborted(AgentError):
    """The nodes decided not to launch: nothing was stopped anywhere (or, in doubt,
    nothing here); commit.py."""

    def __init__(self, message, hint=None, in_doubt=False):
        AgentError.__init__(self, message, hint)
        self.in_doubt = in_doubt


def error_answer(exc):
    """The `{"ok": false, ...}` answer for an AgentError (with what its kind adds) or
    an OSError."""
    if not isinstance(exc, AgentError):
        where = f" ({exc.filename})" if exc.filename else ""
        return {"ok": False, "error": f"{exc.strerror or exc}{where}"}
    answer = {"ok": False, "error": exc.message, "hint": exc.hint}
    if isinstance(exc, StaleBase):
        answer["stale"] = True
    if isinstance(exc, CommitAborted):
        answer.update(aborted=True, in_doubt=exc.in_doubt)
    if isinstance(exc, RolledBack):
        answer.update(rolled_back="here" if exc.here else "peer", relaunched=exc.relaunched)
    return answer
