"""The one fold of contract events into blocks: what a consumer, an audit, the CLI views and the machine's
own result are built from.

Rule: the result follows only from the events: block texts are their deltas concatenated in seq order
(signature deltas apart); a tool call's ``arguments`` is the object its ``block.stop`` carried, and only
when the stream ended ``stream.done`` (its ``arguments_error`` and its ``verdict`` whatever the ending); the
answer's verdict is the terminal's; ``invalid_calls`` counts the tool calls whose verdict is invalid (None when
no call carries one); a stream without a
terminal event is ``running``; the dialect is the one ``stream.start`` names. A ``stream.start`` begins
an attempt, so the fold starts over (attempts are never spliced). A log capped with MAXLEN gives the
result of what it still holds: a delta or stop whose ``block.start`` was trimmed away starts its block
there. ``Assembly`` folds event by event (the views show it as it grows); ``assemble`` folds a whole
stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluice.schemas.events import (
    ArgumentsError,
    Block,
    BlockDelta,
    BlockKind,
    BlockStart,
    BlockStop,
    Delta,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    Verdict,
    Visibility,
)
from sluice.schemas.result import Result, ResultBlock

__all__ = ["AssembledBlock", "Assembly", "assemble"]


@dataclass(slots=True)
class AssembledBlock:
    """One block as its events have built it so far."""

    index: int
    kind: BlockKind
    name: str | None = None
    call_id: str | None = None
    visibility: Visibility | None = None
    encrypted: bool = False
    text_parts: list[str] = field(default_factory=list)  # text or json_text deltas, in seq order
    signature_parts: list[str] = field(default_factory=list)
    closed: bool = False  # its block.stop was seen
    arguments: dict[str, Any] | None = None  # what its block.stop carried, however the stream ended
    arguments_error: ArgumentsError | None = None
    verdict: Verdict | None = None  # (1.3) its block.stop's check

    def add(self, delta: Delta) -> None:
        """One ``block.delta``'s content, in seq order."""
        (self.signature_parts if delta.kind == "signature" else self.text_parts).append(delta.text)

    @property
    def text(self) -> str:
        """The text (a tool call's: its argument text) received so far."""
        return "".join(self.text_parts)

    def result(self, completed: bool) -> ResultBlock:
        """The block of the result; a tool call's arguments only when the stream ``completed``."""
        text = self.text
        is_tool = self.kind == "tool_call"
        return ResultBlock(
            index=self.index,
            kind=self.kind,
            text=None if is_tool else text,
            signature="".join(self.signature_parts) or None,
            name=self.name,
            call_id=self.call_id,
            arguments=self.arguments if (is_tool and completed) else None,
            arguments_text=text if is_tool else None,
            arguments_error=self.arguments_error,
            verdict=self.verdict,
            visibility=self.visibility,
            encrypted=self.encrypted,
        )


class Assembly:
    """The fold of one stream's events (the latest attempt's, when fed several)."""

    __slots__ = ("blocks", "dialect", "terminal")

    def __init__(self) -> None:
        self.blocks: dict[int, AssembledBlock] = {}
        self.dialect: str | None = None
        self.terminal: StreamDone | StreamError | None = None

    def apply(self, ev: Event) -> AssembledBlock | None:
        """Fold one event in; returns the block it touched, if any."""
        if type(ev) is BlockDelta:  # nearly every event: first
            blk = self.blocks.get(ev.block.index) or self._trimmed(ev.block)
            blk.add(ev.delta)
            return blk
        if isinstance(ev, BlockStart):
            ob = ev.block
            blk = self.blocks[ob.index] = AssembledBlock(
                index=ob.index,
                kind=ob.kind,
                name=ob.name,
                call_id=ob.call_id,
                visibility=ob.visibility,
                encrypted=ob.encrypted,
            )
            return blk
        if isinstance(ev, BlockStop):
            blk = self.blocks.get(ev.block.index) or self._trimmed(ev.block)
            blk.closed, blk.arguments = True, ev.arguments
            if ev.arguments_error is not msgspec.UNSET:
                blk.arguments_error = ev.arguments_error
            if ev.verdict is not msgspec.UNSET:
                blk.verdict = ev.verdict
            return blk
        if isinstance(ev, StreamDone | StreamError):
            self.terminal = ev
        elif isinstance(ev, StreamStart):
            self.blocks, self.dialect, self.terminal = {}, ev.dialect, None
        return None

    def _trimmed(self, ref: Block) -> AssembledBlock:
        """A block whose ``block.start`` is not in the log (capped, or read from a later position)."""
        blk = self.blocks[ref.index] = AssembledBlock(index=ref.index, kind=ref.kind)
        return blk

    def result(self) -> Result:
        t = self.terminal
        done = isinstance(t, StreamDone)
        blocks = [self.blocks[i].result(done) for i in sorted(self.blocks)]
        checked = [b.verdict for b in blocks if b.verdict is not None]
        invalid = sum(not v.valid for v in checked) if checked else None
        if t is None:
            return Result(status="running", blocks=blocks, dialect=self.dialect, invalid_calls=invalid)
        answer = t.answer if t.answer is not msgspec.UNSET else None
        if isinstance(t, StreamDone):
            return Result(
                status="completed",
                stop_reason=t.stop_reason,
                provider_stop_reason=t.provider_stop_reason,
                usage=t.usage,
                blocks=blocks,
                dialect=self.dialect,
                answer=answer,
                invalid_calls=invalid,
            )
        return Result(
            status=t.status,
            error=t.error,
            usage=t.usage,
            blocks=blocks,
            dialect=self.dialect,
            answer=answer,
            invalid_calls=invalid,
        )


def assemble(events: Iterable[Event]) -> Result:
    """The result of a whole stream."""
    fold = Assembly()
    for ev in events:
        fold.apply(ev)
    return fold.result()
