"""The errors a user can cause: the bottom of the import graph (imports nothing of dominospec).

Every stage, the server and the CLI raise these for bad input or environment; `dominospec`
and `pipeline/<stage>.py` print them as one line (`error: ...`, exit code 2), without a
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(RuntimeError):
    """An error caused by the user's input or environment: printed without a traceback."""


class ParamsError(UserError, ValueError):
    """A params file that cannot be used: unknown key, missing key, or wrong type."""


class TargetError(UserError):
    """The target cannot be found or loaded as configured."""
