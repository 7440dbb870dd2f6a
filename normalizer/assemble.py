"""Assemble the result of one stream from its contract events (what a consumer or an audit does).

Rule: the result follows only from the events: block texts are their deltas concatenated in seq order;
a tool call's ``arguments`` is the object its ``block.stop`` carried, and only when the stream ended
``stream.done`` (its ``arguments_error`` whatever the ending); a stream without a terminal event is
``running``; the dialect is the one ``stream.start`` names. A log capped with MAXLEN gives the
result of what it still holds. It must agree with the machine's own
``result()`` for every stream (a tested property).
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from sluice.schemas.events import BlockDelta, BlockStart, BlockStop, Event, StreamDone, StreamError, StreamStart
from sluice.schemas.result import Result, ResultBlock

__all__ = ["assemble"]


def assemble(events: Iterable[Event]) -> Result:
    blocks: dict[int, ResultBlock] = {}
    texts: dict[int, list[str]] = {}
    sigs: dict[int, list[str]] = {}
    args: dict[int, dict[str, object] | None] = {}
    usage = None
    dialect = None
    terminal: StreamDone | StreamError | None = None
    for ev in events:
        if isinstance(ev, BlockStart):
            ob = ev.block
            blocks[ob.index] = ResultBlock(
                index=ob.index, kind=ob.kind, name=ob.name, call_id=ob.call_id, visibility=ob.visibility,
                encrypted=ob.encrypted,
            )  # fmt: skip
            texts[ob.index], sigs[ob.index] = [], []
        elif isinstance(ev, BlockDelta | BlockStop):
            i = ev.block.index
            if i not in blocks:  # its block.start was trimmed away (a capped log): keep what is there
                blocks[i] = ResultBlock(index=i, kind=ev.block.kind)
                texts[i], sigs[i] = [], []
            if isinstance(ev, BlockStop):
                args[i] = ev.arguments
                if ev.arguments_error is not msgspec.UNSET:
                    blocks[i].arguments_error = ev.arguments_error
            else:
                (sigs if ev.delta.kind == "signature" else texts)[i].append(ev.delta.text)
        elif isinstance(ev, StreamDone | StreamError):
            terminal, usage = ev, ev.usage
        elif isinstance(ev, StreamStart):
            dialect = ev.dialect
    done = isinstance(terminal, StreamDone)
    out = []
    for index in sorted(blocks):
        b = blocks[index]
        text = "".join(texts[index])
        is_tool = b.kind == "tool_call"
        b.text = None if is_tool else text
        b.arguments_text = text if is_tool else None
        b.arguments = args.get(index) if (is_tool and done) else None
        b.signature = "".join(sigs[index]) or None
        out.append(b)
    if terminal is None:
        return Result(status="running", blocks=out, dialect=dialect)
    if isinstance(terminal, StreamDone):
        return Result(
            status="completed", stop_reason=terminal.stop_reason, provider_stop_reason=terminal.provider_stop_reason,
            usage=usage, blocks=out, dialect=dialect,
        )  # fmt: skip
    return Result(status=terminal.status, error=terminal.error, usage=usage, blocks=out, dialect=dialect)
