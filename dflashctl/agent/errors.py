"""The agent's errors: each one becomes the `{"ok": false, "error", "hint"}` answer."""


class AgentError(Exception):
    def __init__(self, message, hint=None):
        Exception.__init__(self, message)
        self.message = message
        self.hint = hint


class StaleBase(AgentError):
    """The release the caller built its plan on is not what is here (any more): it
    should inspect again and send what is really missing. Nothing was changed."""
