"""The independent contract checker rejects every broken sequence, built by hand event by event.

Rule: each case starts from a valid stream and breaks exactly one invariant; the checker must raise
``ContractViolation`` at that event (not before), and stay broken afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from sluice.schemas.errors import ContractViolation
from sluice.schemas.events import (
    Block,
    BlockDelta,
    BlockStart,
    BlockStop,
    Delta,
    ErrorInfo,
    Event,
    OpenBlock,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
)
from sluice.schemas.invariants import CHECKER_TRANSITIONS, CheckState, ContractChecker

SID, RID = "r:1", "r"


class Seq:
    """Builds events with consecutive seq numbers, so each case only spells out what it breaks."""

    def __init__(self) -> None:
        self.n = 0

    def _c(self, seq: int | None, sid: str, rid: str) -> dict[str, object]:
        self.n += 1
        return {"stream_id": sid, "request_id": rid, "seq": self.n if seq is None else seq, "ts": 0}

    def start(self, seq: int | None = None, sid: str = SID, rid: str = RID) -> StreamStart:
        return StreamStart(**self._c(seq, sid, rid), provider="p", dialect="d", model=None, attempt=1)  # type: ignore[arg-type]

    def open(self, index: int, kind: str = "text", call_id: str | None = None, bid: str | None = None) -> BlockStart:
        if kind == "tool_call" and call_id is None:
            call_id = f"call_{index}"
        block = OpenBlock(
            id=bid or f"b_{index}", index=index, kind=kind, call_id=call_id, name="f" if call_id else None
        )  # type: ignore[arg-type]
        return BlockStart(**self._c(None, SID, RID), block=block)  # type: ignore[arg-type]

    def delta(
        self, index: int, kind: str = "text", dk: str = "text", text: str = "x", bid: str | None = None
    ) -> BlockDelta:
        block = Block(id=bid or f"b_{index}", index=index, kind=kind)  # type: ignore[arg-type]
        return BlockDelta(**self._c(None, SID, RID), block=block, delta=Delta(kind=dk, text=text))  # type: ignore[arg-type]

    def stop(
        self,
        index: int,
        kind: str = "text",
        arguments: dict[str, object] | None = None,
        bid: str | None = None,
        truncated: bool = False,
    ) -> BlockStop:
        block = Block(id=bid or f"b_{index}", index=index, kind=kind)  # type: ignore[arg-type]
        extra = {"arguments_error": "truncated"} if truncated else {}
        return BlockStop(**self._c(None, SID, RID), block=block, arguments=arguments, **extra)  # type: ignore[arg-type]

    def warn(self) -> StreamWarning:
        return StreamWarning(**self._c(None, SID, RID), code="w", message="w")  # type: ignore[arg-type]

    def done(self, seq: int | None = None, sid: str = SID, rid: str = RID, stop: str = "stop") -> StreamDone:
        return StreamDone(**self._c(seq, sid, rid), stop_reason=stop, provider_stop_reason=None, usage=None)  # type: ignore[arg-type]

    def error(self, status: str = "failed") -> StreamError:
        err = ErrorInfo(category="protocol", retryable=False, message="m")
        return StreamError(**self._c(None, SID, RID), status=status, error=err)  # type: ignore[arg-type]


def run(events: list[Event]) -> ContractChecker:
    checker = ContractChecker()
    for ev in events:
        checker.process(ev)
    return checker


# -- valid streams ----------------------------------------------------------------------------------

VALID: dict[str, Callable[[Seq], list[Event]]] = {
    "empty": lambda s: [s.start(), s.done()],
    "text": lambda s: [s.start(), s.open(0), s.delta(0), s.delta(0), s.stop(0), s.done()],
    "all kinds": lambda s: [
        s.start(),
        s.open(0, "reasoning"),
        s.delta(0, "reasoning"),
        s.delta(0, "reasoning", "signature"),
        s.open(1, "text"),  # blocks may overlap (OpenAI Chat interleaves text and tool calls)
        s.delta(1, "text", "signature"),
        s.stop(0, "reasoning"),
        s.open(2, "tool_call"),
        s.delta(2, "tool_call", "json_text", "{}"),
        s.delta(2, "tool_call", "signature"),
        s.stop(2, "tool_call", {}),
        s.stop(1),
        s.open(3, "refusal"),
        s.warn(),
        s.delta(3, "refusal"),
        s.stop(3, "refusal"),
        s.warn(),
        s.done(),
    ],
    "failed with open blocks": lambda s: [s.start(), s.open(0), s.delta(0), s.open(1, "tool_call"), s.error()],
    "a tool call cut at the token limit": lambda s: [
        s.start(),
        s.open(0, "tool_call"),
        s.delta(0, "tool_call", "json_text", '{"a": '),
        s.stop(0, "tool_call", truncated=True),
        s.warn(),
        s.done(stop="length"),
    ],
    "interrupted at once": lambda s: [s.start(), s.error("interrupted")],
}


@pytest.mark.parametrize("name", list(VALID))
def test_valid_streams_pass(name: str) -> None:
    checker = run(VALID[name](Seq()))
    assert checker.terminal and checker.state is CheckState.DONE


def test_a_stream_without_terminal_is_not_terminal() -> None:
    s = Seq()
    checker = run([s.start(), s.open(0)])
    assert not checker.terminal and checker.state is CheckState.OPEN


# -- broken streams: the last event of each list is the one that must be rejected --------------------

BROKEN: dict[str, Callable[[Seq], list[Event]]] = {
    "first event not stream.start": lambda s: [s.open(0)],
    "warning before start": lambda s: [s.warn()],
    "done before start": lambda s: [s.done()],
    "second stream.start": lambda s: [s.start(), s.start()],
    "seq not starting at 1": lambda s: [s.start(seq=2)],
    "seq gap": lambda s: [s.start(), s.done(seq=3)],
    "seq repeated": lambda s: [s.start(), s.open(0), s.done(seq=2)],
    "stream_id changed": lambda s: [s.start(), s.done(sid="other:1")],
    "request_id changed": lambda s: [s.start(), s.done(rid="other")],
    "first block index not 0": lambda s: [s.start(), s.open(1)],
    "block index skipped": lambda s: [s.start(), s.open(0), s.open(2)],
    "block index reused": lambda s: [s.start(), s.open(0), s.delta(0), s.stop(0), s.open(0)],
    "block id reused": lambda s: [s.start(), s.open(0), s.delta(0), s.stop(0), s.open(1, bid="b_0")],
    "tool_call without call_id": lambda s: [s.start(), s.open(0, "tool_call", call_id="")],
    "delta into a never-opened block": lambda s: [s.start(), s.delta(0)],
    "delta into a closed block": lambda s: [s.start(), s.open(0), s.delta(0), s.stop(0), s.delta(0)],
    "empty delta": lambda s: [s.start(), s.open(0), s.delta(0, text="")],
    "text block stopped without content": lambda s: [s.start(), s.open(0), s.stop(0)],
    "reasoning block stopped without content": lambda s: [s.start(), s.open(0, "reasoning"), s.stop(0, "reasoning")],
    "delta naming another kind": lambda s: [s.start(), s.open(0, "reasoning"), s.delta(0, "text")],
    "delta naming another id": lambda s: [s.start(), s.open(0), s.delta(0, bid="b_9")],
    "json_text into text": lambda s: [s.start(), s.open(0), s.delta(0, "text", "json_text")],
    "json_text into reasoning": lambda s: [s.start(), s.open(0, "reasoning"), s.delta(0, "reasoning", "json_text")],
    "text into tool_call": lambda s: [s.start(), s.open(0, "tool_call"), s.delta(0, "tool_call", "text")],
    "signature into refusal": lambda s: [s.start(), s.open(0, "refusal"), s.delta(0, "refusal", "signature")],
    "stop of a never-opened block": lambda s: [s.start(), s.stop(0)],
    "stop twice": lambda s: [s.start(), s.open(0), s.delta(0), s.stop(0), s.stop(0)],
    "stop naming another kind": lambda s: [s.start(), s.open(0), s.stop(0, "tool_call", {})],
    "stop naming another id": lambda s: [s.start(), s.open(0), s.stop(0, bid="b_1")],
    "tool_call stop without arguments": lambda s: [s.start(), s.open(0, "tool_call"), s.stop(0, "tool_call")],
    "text stop with arguments": lambda s: [s.start(), s.open(0), s.stop(0, "text", {"a": 1})],
    "done with an open block": lambda s: [s.start(), s.open(0), s.open(1), s.delta(1), s.stop(1), s.done()],
    "truncated text block": lambda s: [s.start(), s.open(0), s.delta(0), s.stop(0, truncated=True)],
    "truncated with arguments": lambda s: [
        s.start(),
        s.open(0, "tool_call"),
        s.stop(0, "tool_call", {"a": 1}, truncated=True),
    ],
    "truncated, then done with another stop reason": lambda s: [
        s.start(),
        s.open(0, "tool_call"),
        s.stop(0, "tool_call", truncated=True),
        s.done(stop="tool_use"),
    ],
    "truncated, then an error": lambda s: [
        s.start(),
        s.open(0, "tool_call"),
        s.stop(0, "tool_call", truncated=True),
        s.error(),
    ],
    "truncated, then more content": lambda s: [
        s.start(),
        s.open(0, "tool_call"),
        s.stop(0, "tool_call", truncated=True),
        s.open(1),
    ],
    "warning after done": lambda s: [s.start(), s.done(), s.warn()],
    "second done": lambda s: [s.start(), s.done(), s.done()],
    "error after done": lambda s: [s.start(), s.done(), s.error()],
    "error after error": lambda s: [s.start(), s.error(), s.error("interrupted")],
    "block after error": lambda s: [s.start(), s.error(), s.open(0)],
    "start after error": lambda s: [s.start(), s.error(), s.start()],
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_streams_are_rejected_at_the_breaking_event(name: str) -> None:
    *good, bad = BROKEN[name](Seq())
    checker = run(good)  # everything before the breaking event is fine
    with pytest.raises(ContractViolation):
        checker.process(bad)
    assert checker.state is CheckState.BROKEN and not checker.terminal


def test_broken_is_sticky() -> None:
    s = Seq()
    checker = run([s.start()])
    with pytest.raises(ContractViolation):
        checker.process(s.delta(0))
    # Even an event that would have been valid is refused now.
    fresh = Seq()
    fresh.n = 1
    with pytest.raises(ContractViolation):
        checker.process(fresh.done())
    assert checker.state is CheckState.BROKEN


def test_checker_table_has_no_moves_out_of_done_or_broken() -> None:
    assert {state for state, _ in CHECKER_TRANSITIONS} == {CheckState.IDLE, CheckState.OPEN}
