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
