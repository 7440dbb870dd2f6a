"""The UI projection a client may ask for (``?coalesce_ms=N``): runs of small text deltas become one event.

Rule: only ``block.delta`` events with ``delta.kind == "text"`` of a non-tool block merge, and only with
the event right before them in the stream (same attempt, same block, seq + 1), so the merged text is
exactly their texts concatenated and nothing else is reordered. A run is held at most ``window`` seconds
from its first delta (and at most ``max_chars`` characters); anything else (block boundaries, tool-call
events, signatures, warnings, errors, the terminal) flushes the run and passes one to one, unchanged and
never delayed. A merged event is the last delta of its run with the joined text, its ``raw`` refs the
union, and one extra field ``coalesced: {first_seq, last_seq, count}``; its position is that of the
last delta, so resuming from it is exact. A run of one passes unchanged. Pure: the caller passes
``now`` (seconds, monotonic) and asks for ``deadline()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from sluice.schemas.events import BlockDelta, Delta

from .positions import Entry, Position

__all__ = ["Coalescer", "Frame", "frame_of"]

_ENC = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True)
class Frame:
    """One event as sent to a client: its resume position, contract type and JSON."""

    position: Position
    type: str
    data: bytes
    merged: int = 1  # how many stored events this frame stands for


def frame_of(entry: Entry) -> Frame:
    return Frame(entry.position, entry.type, entry.data)


def _mergeable(entry: Entry) -> bool:
    ev = entry.event
    return isinstance(ev, BlockDelta) and ev.delta.kind == "text" and ev.block.kind != "tool_call"


class Coalescer:
    def __init__(self, window: float, *, max_chars: int = 32_768) -> None:
        self.window = window
        self.max_chars = max_chars
        self._run: list[Entry] = []
        self._chars = 0
        self._since = 0.0
        self.merged_frames = 0

    def deadline(self) -> float | None:
        """When the held run must go out (None: nothing held)."""
        return self._since + self.window if self._run else None

    def push(self, entry: Entry, now: float) -> list[Frame]:
        """Frames to send now, in order, after ``entry`` arrived."""
        if not _mergeable(entry):
            return [*self.flush(), frame_of(entry)]
        out = self.due(now)
        if self._run and not self._continues(entry):
            out += self.flush()
        if not self._run:
            self._since = now
        self._run.append(entry)
        self._chars += len(entry.event.delta.text)  # type: ignore[union-attr]
        if self._chars >= self.max_chars or self.window <= 0:
            out += self.flush()
        return out

    def due(self, now: float) -> list[Frame]:
        """The held run, if its time is up."""
        deadline = self.deadline()
        return self.flush() if deadline is not None and now >= deadline else []

    def flush(self) -> list[Frame]:
        run, self._run, self._chars = self._run, [], 0
        if not run:
            return []
        if len(run) == 1:
            return [frame_of(run[0])]
        self.merged_frames += 1
        return [_merge(run)]

    def _continues(self, entry: Entry) -> bool:
        last = self._run[-1]
        a, b = last.event, entry.event
        return (
            entry.position.attempt == last.position.attempt and b.seq == a.seq + 1 and b.block.index == a.block.index  # type: ignore[union-attr]
        )


def _merge(run: list[Entry]) -> Frame:
    last = run[-1].event
    assert isinstance(last, BlockDelta)
    raw = list(dict.fromkeys(r for e in run for r in e.event.raw))
    text = "".join(e.event.delta.text for e in run)  # type: ignore[union-attr]
    merged = msgspec.structs.replace(last, delta=Delta(kind="text", text=text), raw=raw)
    doc = msgspec.to_builtins(merged)
    doc["coalesced"] = {"first_seq": run[0].event.seq, "last_seq": last.seq, "count": len(run)}
    return Frame(run[-1].position, "block.delta", _ENC.encode(doc), merged=len(run))
