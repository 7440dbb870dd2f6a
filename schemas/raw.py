"""The raw stream's entries, as readers see them: the provider's events exactly as received.

Rule: entry ``<attempt>-0`` is the HTTP response record (``kind`` ``http``: status and non-secret headers
as JSON in ``data``; for an error status, the bounded body in ``body``); entries ``<attempt>-<n>`` are
the n-th SSE event of the attempt (``kind`` ``sse``: ``event``, ``data``, ``id``, the byte ``offset`` where
it started, the receive time ``ts``). Optional fields: ``redacted`` = ``1`` when a configured secret was
replaced by ``REDACTION_MARKER`` before anything was stored (the provider echoed it); ``data_bytes``, the
exact bytes of ``data`` when they were not valid UTF-8 (``data`` holds them decoded with U+FFFD);
``unframed`` = ``1`` for a JSON object that came without SSE framing (Gemini's error tail); an entry of
``kind`` ``tail`` holds in ``data_bytes`` the bytes of an unfinished event that the end of the stream (or a
broken connection) cut off, from ``offset``. An AWS event-stream message (Bedrock) is an entry of ``kind``
``frame``: ``event`` its ``:event-type`` (or ``:exception-type`` / ``:error-code``), ``id`` its
``:message-type``, ``data`` its payload as text, and ``frame`` its exact bytes (prelude, headers, payload,
CRC), or, for a message that held a configured secret (flagged ``redacted``), the same message framed again
with the marker in its values (its ``offset`` still the one it came at); a frame that failed its CRC is kept
the same way, with empty ``event`` and ``id`` (bytes that never became a message, here and in a ``tail``,
hold a secret masked to its own length). The worker writes
them (``sluice.worker.append.log``);
``sluice audit`` replays them.
"""

from __future__ import annotations

import msgspec

from sluice.schemas.keys import Position

__all__ = ["REDACTION_MARKER", "RawEntry"]

# Replaces every occurrence of a configured secret (an API key the provider echoed) in what is stored. It
# is valid inside a JSON string and an SSE line, so redacted payloads still decode the same way.
REDACTION_MARKER = "[sluice:redacted]"


class RawEntry(msgspec.Struct, frozen=True):
    attempt: int
    index: int
    kind: str  # "http" | "sse" | "frame" | "tail"
    event: str = ""
    data: str = ""
    id: str = ""
    offset: int | None = None
    ts: int = 0
    redacted: bool = False
    unframed: bool = False  # not SSE: an unframed JSON object (Gemini's error tail)
    data_bytes: bytes | None = None
    body: bytes | None = None
    frame: bytes | None = None  # kind "frame": the event-stream message's exact bytes

    @classmethod
    def from_redis(cls, entry_id: bytes | str, fields: dict[bytes, bytes]) -> RawEntry:
        attempt, index = Position.from_entry_id(entry_id)

        def text(k: bytes) -> str:
            return fields.get(k, b"").decode("utf-8", "replace")

        offset, ts = text(b"offset"), text(b"ts")
        return cls(
            attempt=attempt,
            index=index,
            kind=text(b"kind"),
            event=text(b"event"),
            data=text(b"data"),
            id=text(b"id"),
            offset=int(offset) if offset.isdigit() else None,
            ts=int(ts) if ts.isdigit() else 0,
            redacted=fields.get(b"redacted") == b"1",
            unframed=fields.get(b"unframed") == b"1",
            data_bytes=fields.get(b"data_bytes"),
            body=fields.get(b"body"),
            frame=fields.get(b"frame"),
        )

    @property
    def http_status(self) -> int | None:
        if self.kind != "http":
            return None
        try:
            status = msgspec.json.decode(self.data).get("status")
        except (msgspec.DecodeError, AttributeError):
            return None
        return status if isinstance(status, int) else None
