"""The exit statuses of the ``sluice`` commands: one table for every command that waits on or reports a
request (``enqueue --follow``, ``tail``, ``status``, ``cancel --wait``), so a script reads an outcome the same
way whichever command it ran.

Rule: a request's state decides the status (``for_state``); 2 is always unusable input or environment (bad
arguments, an unknown request, an unreadable file, Redis unreachable), never an outcome; 1 is the verdict of
a check that found a fault (``audit``: the logs disagree; ``demo``: a request not as expected).
"""

from __future__ import annotations

import enum

__all__ = ["Exit", "for_state"]


class Exit(enum.IntEnum):
    OK = 0  # the request completed; a command that reports no request did its work
    CHECK_FAILED = 1  # audit: the logs disagree; demo: a request ended otherwise than expected
    USAGE = 2  # unusable input: arguments, files, unknown request, Redis unreachable or refusing
    FAILED = 3  # the request ended failed
    INTERRUPTED = 4  # the request ended interrupted (cancelled, timed out, the provider's stream cut)
    NOT_FINISHED = 5  # status: queued or running; cancel --wait: no terminal status within --timeout
    SIGINT = 130  # stopped with Ctrl-C


_BY_STATE = {"completed": Exit.OK, "failed": Exit.FAILED, "interrupted": Exit.INTERRUPTED}


def for_state(state: str) -> Exit:
    """The status for a request in ``state`` (``queued`` / ``running``: not finished)."""
    return _BY_STATE.get(state, Exit.NOT_FINISHED)
