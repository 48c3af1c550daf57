"""The errors every layer may raise for a one-line exit (gptcuda/cli.py `guarded` prints them), and
`describe_os_error`, the one line that names an OSError's path. Imports nothing from gptcuda."""
from __future__ import annotations

import errno


class UsageError(Exception):
    """An argument or option that cannot be used as given; str(err) is the message."""


class RunError(Exception):
    """A run directory (out_dir) that cannot be used as asked; str(err) is one line naming the path."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))


def describe_os_error(e: OSError, what: str | None = None) -> str:
    """One line naming the path of an OSError (and what was being done to it)."""
    reason = e.strerror or type(e).__name__
    if e.errno == errno.ENOSPC:
        reason = "no space left on device"
    if e.filename is None:
        head = what or "I/O error"
    else:
        head = f"{what} {e.filename}" if what else str(e.filename)
    return f"{head}: {reason}"
