"""The request-state vocabulary: where a request is, as its status record, its terminal event and its
assembled result say it.

Rule: written once, here, as ``Literal``s; the sets code checks against are derived from them with
``get_args``. A request is ``queued`` (its job waits on a jobs stream), ``running`` (a worker claimed it),
then terminal: ``completed`` on the provider's terminal signal with every block closed, ``failed`` or
``interrupted`` otherwise. The status hash and the terminal stream hold these names as strings (the
append and claim scripts write ``running`` in Lua, where no Python name reaches).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = [
    "REQUEST_STATES",
    "TERMINAL_STATES",
    "FailedState",
    "RequestState",
    "ResultStatus",
    "TerminalState",
]

FailedState = Literal["failed", "interrupted"]  # a stream.error's status
TerminalState = Literal["completed", FailedState]
RequestState = Literal["queued", "running", TerminalState]
ResultStatus = Literal["running", TerminalState]  # an assembled result: running until its terminal event

REQUEST_STATES: tuple[RequestState, ...] = get_args(RequestState)
TERMINAL_STATES: frozenset[TerminalState] = frozenset(get_args(TerminalState))
