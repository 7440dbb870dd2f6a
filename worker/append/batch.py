"""What one append call carries: raw rows and contract events, in order, packed for the append script.

Rule: the raw stream's entry layout is defined here and read back through ``sluice.schemas.raw``: every
row has ``kind``, ``event``, ``data``, ``id``, ``offset`` and ``ts``; optional fields follow as name/value
pairs (``redacted``: a configured secret was replaced; ``data_bytes``: the exact bytes where the decoded
``data`` lost them; ``body``: an HTTP error body). Text travels as msgpack str (Redis's Lua cmsgpack does
not read msgpack's bin type); exact bytes travel as separate script arguments, named in the row by their
position (``blobs``), because Redis values are binary-safe and script arguments too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from sluice.normalizer.sse import SSEEvent
from sluice.schemas.events import EVENT_TAGS, BlockDelta, Event, encode_event
from sluice.schemas.raw import REDACTION_MARKER

__all__ = ["PendingBatch", "RawRow", "event_tag"]

# index, kind, event, data, id, offset, ts, then name/value pairs (a value that is an int names a blob)
RawRow = tuple[object, ...]

_PACK = msgspec.msgpack.Encoder().encode


def event_tag(ev: Event) -> str:
    return EVENT_TAGS[type(ev)]


_DELTA_TAG = EVENT_TAGS[BlockDelta]


@dataclass(slots=True)
class PendingBatch:
    """Raw rows and events waiting for one append call, in order."""

    raw: list[RawRow] = field(default_factory=list)
    events: list[tuple[int, str, str, int]] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[Event]) -> PendingBatch:
        """A batch of contract events only (a terminal written without provider data)."""
        b = cls()
        for ev in events:
            b.add_event(ev)
        return b

    @classmethod
    def normalized(cls, raw: list[SSEEvent], events: Iterable[Event], ts: int) -> PendingBatch:
        """What one ``Normalizer.feed`` (or ``close_batch``) gave: its raw events, then its contract events."""
        b = cls()
        b.add_sse_events(raw, ts)
        for ev in events:
            b.add_event(ev)
        return b

    def add_raw(
        self,
        index: int,
        kind: str,
        event: str,
        data: str,
        sse_id: str,
        offset: int,
        ts: int,
        *,
        extra_text: dict[str, str] | None = None,
        extra_bytes: dict[str, bytes] | None = None,
    ) -> None:
        row: list[object] = [index, kind, event, data, sse_id, offset, ts]
        for name, text in (extra_text or {}).items():
            row += [name, text]
        for name, blob in (extra_bytes or {}).items():
            self.blobs.append(blob)
            row += [name, len(self.blobs)]  # 1-based: the script reads ARGV[5 + n]
        self.raw.append(tuple(row))

    def add_event(self, ev: Event) -> None:
        # As str, not bytes: Redis's Lua cmsgpack does not read msgpack's bin type.
        if type(ev) is BlockDelta:  # nearly every event, and the only visible kind: the shortest way
            self.events.append((ev.seq, _DELTA_TAG, encode_event(ev).decode(), 1))
            return
        self.events.append((ev.seq, event_tag(ev), encode_event(ev).decode(), 0))

    def add_sse_events(self, sse: list[SSEEvent], ts: int) -> None:
        for e in sse:
            redacted = REDACTION_MARKER in e.data or REDACTION_MARKER in e.event or REDACTION_MARKER in e.id
            if not (redacted or e.unframed or e.data_bytes is not None):  # nearly every event: the short way
                self.raw.append((e.index, "sse", e.event, e.data, e.id, e.offset, ts))
                continue
            text = {"redacted": "1"} if redacted else {}
            if e.unframed:
                text["unframed"] = "1"
            blobs = {"data_bytes": e.data_bytes} if e.data_bytes is not None else None
            self.add_raw(e.index, "sse", e.event, e.data, e.id, e.offset, ts, extra_text=text, extra_bytes=blobs)

    def add_tail(self, index: int, tail: bytes, offset: int, ts: int) -> None:
        """The bytes of an unfinished event the end of the stream cut off (``kind`` ``tail``)."""
        if tail:
            redacted = {"redacted": "1"} if REDACTION_MARKER.encode() in tail else {}
            self.add_raw(index, "tail", "", "", "", offset, ts, extra_text=redacted, extra_bytes={"data_bytes": tail})

    def packed(self) -> tuple[bytes, bytes]:
        """The script's two packed arguments (raw rows, events); ``blobs`` follow them when there are any."""
        return _PACK(self.raw), _PACK(self.events)

    def __len__(self) -> int:
        return len(self.raw) + len(self.events)
