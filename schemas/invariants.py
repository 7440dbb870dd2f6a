"""An independent checker of the contract's invariants, for consumers, audits and tests.

Rule: feed it one stream's events in order; it raises ``ContractViolation`` at the first event that
breaks an invariant (first event stream.start, one stream_id, seq strictly +1, block.start with the next
index, deltas only into an open block of a matching kind, block.stop only for an open block,
stream.done only with every block closed, exactly one terminal and nothing after it) and then stays
``BROKEN``. It shares no code with the machine that produced the events, on purpose.
"""

from __future__ import annotations

import enum

from schemas.errors import ContractViolation
from schemas.events import (
    BlockDelta,
    BlockStart,
    BlockStop,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
)

__all__ = ["CHECKER_TRANSITIONS", "CheckState", "ContractChecker"]


class CheckState(enum.Enum):
    IDLE = "idle"
    OPEN = "open"
    DONE = "done"
    BROKEN = "broken"


C = CheckState
CHECKER_TRANSITIONS: dict[tuple[CheckState, type], CheckState] = {
    (C.IDLE, StreamStart): C.OPEN,
    (C.OPEN, BlockStart): C.OPEN,
    (C.OPEN, BlockDelta): C.OPEN,
    (C.OPEN, BlockStop): C.OPEN,
    (C.OPEN, StreamWarning): C.OPEN,
    (C.OPEN, StreamDone): C.DONE,
    (C.OPEN, StreamError): C.DONE,
}

_DELTA_KINDS = {
    "text": {"text", "signature"},
    "reasoning": {"text", "signature"},
    "refusal": {"text"},
    "tool_call": {"json_text", "signature"},
}


class ContractChecker:
    def __init__(self) -> None:
        self.state = C.IDLE
        self.stream_id: str | None = None
        self.seq = 0
        self.blocks = 0
        self.open: dict[int, str] = {}

    @property
    def terminal(self) -> bool:
        return self.state is C.DONE

    def process(self, event: Event) -> None:
        """Raises ``ContractViolation``."""
        nxt = CHECKER_TRANSITIONS.get((self.state, type(event)))
        if nxt is None:
            self._broken(f"{type(event).__name__} (seq {event.seq}) in state {self.state.value}")
        if self.stream_id is None:
            self.stream_id = event.stream_id
        elif event.stream_id != self.stream_id:
            self._broken(f"stream_id changed from {self.stream_id} to {event.stream_id}")
        if event.seq != self.seq + 1:
            self._broken(f"seq {event.seq} after {self.seq}")
        self._check_blocks(event)
        self.seq = event.seq
        self.state = nxt  # type: ignore[assignment]

    def _check_blocks(self, event: Event) -> None:
        if isinstance(event, BlockStart):
            b = event.block
            if b.index != self.blocks:
                self._broken(f"block.start index {b.index}, expected {self.blocks}")
            if b.kind == "tool_call" and not b.call_id:
                self._broken(f"tool_call block {b.index} without call_id")
            self.blocks += 1
            self.open[b.index] = b.kind
        elif isinstance(event, BlockDelta):
            kind = self.open.get(event.block.index)
            if kind is None:
                self._broken(f"block.delta into block {event.block.index}, which is not open")
            if kind != event.block.kind or event.delta.kind not in _DELTA_KINDS[kind]:
                self._broken(f"{event.delta.kind} delta into {kind} block {event.block.index}")
        elif isinstance(event, BlockStop):
            if self.open.pop(event.block.index, None) is None:
                self._broken(f"block.stop for block {event.block.index}, which is not open")
            if event.block.kind == "tool_call" and event.arguments is None:
                self._broken(f"tool_call block {event.block.index} stopped without parsed arguments")
        elif isinstance(event, StreamDone) and self.open:
            self._broken(f"stream.done while blocks {sorted(self.open)} are open")

    def _broken(self, message: str) -> None:
        self.state = C.BROKEN
        raise ContractViolation(message)
