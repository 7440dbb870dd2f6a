"""An independent checker of the contract's invariants, for consumers, audits and tests.

Rule: feed it one stream's events in order; it raises ``ContractViolation`` at the first event that
breaks an invariant (first event stream.start, one stream_id and request_id, seq strictly +1,
block.start with the next index, deltas only into an open block of a matching id and kind and never
empty, block.stop only for an open block (a text, reasoning or refusal block only after a delta: an empty
string never opens a block; parsed arguments on tool calls and only on them, unless they are null with
``arguments_error: "truncated"``, after which only warnings and a ``stream.done`` with stop reason
``length`` may follow), stream.done only with every block closed, exactly one terminal and nothing after
it; (1.3) verdicts only in a stream whose stream.start names ``checks``, a call's only on a tool call's
stop with parsed arguments, the answer's only on a terminal, and under ``checks: "fail"`` an invalid
verdict is followed at once by ``stream.error`` ``invalid_output``) and then stays ``BROKEN``. It shares
no code with the machine that produced the events, on purpose: only the contract's own vocabularies
(``sluice.schemas.events``).
"""

from __future__ import annotations

import enum
from typing import NoReturn

import msgspec

from sluice.schemas.errors import ContractViolation
from sluice.schemas.events import (
    BLOCK_DELTA_KINDS,
    BlockDelta,
    BlockKind,
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


class ContractChecker:
    def __init__(self) -> None:
        self.state = C.IDLE
        self.stream_id: str | None = None
        self.request_id: str | None = None
        self.seq = 0
        self.blocks = 0
        self.open: dict[int, BlockKind] = {}
        self._ids: dict[int, str] = {}  # block index -> the id its block.start announced
        self._seen_ids: set[str] = set()
        self._has_delta: set[int] = set()
        self._truncated: int | None = None  # the tool call stopped as truncated: only the end may follow
        self._policy: str | None = None  # stream.start's ``checks`` (1.3); None: no verdict may appear
        self._must_fail: int | None = None  # a tool call invalid under "fail": stream.error must come next

    @property
    def terminal(self) -> bool:
        return self.state is C.DONE

    def process(self, event: Event) -> None:
        """Raises ``ContractViolation``."""
        nxt = CHECKER_TRANSITIONS.get((self.state, type(event)))
        if nxt is None:
            self._broken(f"{type(event).__name__} (seq {event.seq}) in state {self.state.value}")
        if self.stream_id is None:
            self.stream_id, self.request_id = event.stream_id, event.request_id
        elif event.stream_id != self.stream_id:
            self._broken(f"stream_id changed from {self.stream_id} to {event.stream_id}")
        elif event.request_id != self.request_id:
            self._broken(f"request_id changed from {self.request_id} to {event.request_id}")
        if event.seq != self.seq + 1:
            self._broken(f"seq {event.seq} after {self.seq}")
        ends_cut = isinstance(event, StreamWarning) or (isinstance(event, StreamDone) and event.stop_reason == "length")
        if self._truncated is not None and not ends_cut:
            self._broken(f"{type(event).__name__} after tool call {self._truncated} was stopped as truncated")
        self._check_verdicts(event)
        self._check_blocks(event)
        self.seq = event.seq
        self.state = nxt

    def _check_blocks(self, event: Event) -> None:
        if isinstance(event, BlockStart):
            b = event.block
            if b.index != self.blocks:
                self._broken(f"block.start index {b.index}, expected {self.blocks}")
            if b.kind == "tool_call" and not b.call_id:
                self._broken(f"tool_call block {b.index} without call_id")
            if b.id in self._seen_ids:
                self._broken(f"block id {b.id!r} reused by block {b.index}")
            self.blocks += 1
            self.open[b.index] = b.kind
            self._ids[b.index] = b.id
            self._seen_ids.add(b.id)
        elif isinstance(event, BlockDelta):
            kind = self._open_kind(event, "block.delta")
            if event.delta.kind not in BLOCK_DELTA_KINDS[kind]:
                self._broken(f"{event.delta.kind} delta into {kind} block {event.block.index}")
            if not event.delta.text:
                self._broken(f"empty delta into block {event.block.index}")
            self._has_delta.add(event.block.index)
        elif isinstance(event, BlockStop):
            index = event.block.index
            kind = self._open_kind(event, "block.stop")
            del self.open[index]
            truncated = event.arguments_error is not msgspec.UNSET
            if kind == "tool_call" and event.arguments is None and not truncated:
                self._broken(f"tool_call block {index} stopped without parsed arguments")
            if truncated and (kind != "tool_call" or event.arguments is not None):
                self._broken(f"block {index} stopped as truncated with arguments, or is not a tool call")
            if kind != "tool_call" and event.arguments is not None:
                self._broken(f"{kind} block {index} stopped with arguments")
            if kind != "tool_call" and index not in self._has_delta:
                self._broken(f"{kind} block {index} stopped without any content (an empty block)")
            if truncated:
                self._truncated = index
        elif isinstance(event, StreamDone) and self.open:
            self._broken(f"stream.done while blocks {sorted(self.open)} are open")

    def _check_verdicts(self, event: Event) -> None:
        if isinstance(event, StreamStart):
            self._policy = None if event.checks is msgspec.UNSET else event.checks
            return
        if self._must_fail is not None and not (
            isinstance(event, StreamError) and event.error.category == "invalid_output"
        ):
            self._broken(f"{type(event).__name__} after tool call {self._must_fail} was invalid under checks: fail")
        verdict = None
        if isinstance(event, BlockStop) and event.verdict is not msgspec.UNSET:
            verdict = event.verdict
            if event.arguments is None:
                self._broken(f"block {event.block.index} has a verdict but no parsed arguments")
        elif isinstance(event, StreamDone | StreamError) and event.answer is not msgspec.UNSET:
            verdict = event.answer
        if verdict is None:
            return
        if self._policy is None:
            self._broken(f"a verdict at seq {event.seq} in a stream whose stream.start names no checks")
        if isinstance(event, StreamDone) and not verdict.valid and self._policy == "fail":
            self._broken("stream.done with an invalid answer under checks: fail")
        if isinstance(event, BlockStop) and not verdict.valid and self._policy == "fail":
            self._must_fail = event.block.index

    def _open_kind(self, event: BlockDelta | BlockStop, what: str) -> BlockKind:
        """The kind of the open block ``event`` names; its id and kind must match its block.start."""
        b = event.block
        kind = self.open.get(b.index)
        if kind is None:
            self._broken(f"{what} for block {b.index}, which is not open")
        if b.kind != kind or b.id != self._ids[b.index]:
            self._broken(f"{what} names block {b.index} as {b.id}/{b.kind}, opened as {self._ids[b.index]}/{kind}")
        return kind

    def _broken(self, message: str) -> NoReturn:
        self.state = C.BROKEN
        raise ContractViolation(message)
