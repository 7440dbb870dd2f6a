"""Incremental ``text/event-stream`` decoder on bytes (WHATWG HTML §9.2.5-9.2.6).

Rule: a network chunk is not a message boundary. Lines end at CRLF, LF or a lone CR and nothing else
(never ``str.splitlines``: U+2028, NEL, VT and FF are content); a CR at the end of a chunk waits for the
next byte; one leading BOM is stripped; comments dispatch nothing but are counted (heartbeats); an
event is dispatched only by a blank line, so an unterminated event at EOF is dropped. Line and event
sizes are capped so memory stays bounded whatever the peer sends.

One opt-in departure (``unframed_json``, for Gemini, whose servers append a pretty-printed JSON error body
without any ``data:`` framing before they close): outside an event, a line starting with ``{`` begins an
unframed JSON object, collected line by line until its braces balance (or the input ends) and dispatched
as one event flagged ``unframed``, as google-genai recovers it. The spec would ignore those lines as
unknown fields and the error would be lost.
"""

from __future__ import annotations

import re

import msgspec

from sluice.schemas.errors import LimitExceeded

__all__ = ["HeaderValue", "SSEDecoder", "SSEEvent", "SSELimitExceeded"]

_EOL = re.compile(rb"\r\n|\r|\n")
# The usual event, whole: an optional event line, one data line, a blank line (LF or CRLF ends). Field
# values lose one leading space, as the spec says.
_SIMPLE_EVENT = re.compile(rb"(?:event: ?([^\r\n]*)\r?\n)?data: ?([^\r\n]*)\r?\n\r?\n")
_BOM = b"\xef\xbb\xbf"
_JSON_TOKENS = re.compile(rb'["\\{}]')
DEFAULT_MAX_LINE_BYTES = 1 << 20
DEFAULT_MAX_EVENT_BYTES = 4 << 20


# An AWS event-stream header's value (its ten types: bool; int8-64 and timestamp as int; byte_array and uuid
# as bytes; string as str). ``sluice.normalizer.eventstream`` marks timestamps and UUIDs with their own types.
HeaderValue = bool | int | bytes | str


class SSEEvent(msgspec.Struct, frozen=True):
    """One dispatched event (a msgspec Struct: built in C, one per provider event). ``index`` counts
    dispatched events from 1; ``offset`` is the stream byte offset where the event's first line starts;
    ``id`` is the last-event-id buffer at dispatch.

    The one raw-event record of the pipeline for both framings: an AWS event-stream message
    (``sluice.normalizer.eventstream``) fills ``headers`` and ``frame`` (its exact bytes)."""

    event: str
    data: str
    id: str
    retry: int | None
    index: int
    offset: int
    invalid_utf8: bool = False
    # Not SSE at all: an unframed JSON object (``unframed_json``); ``data`` holds its lines.
    unframed: bool = False
    # The exact bytes of ``data`` when decoding lost them (invalid UTF-8 became U+FFFD); else None.
    data_bytes: bytes | None = None
    # An AWS event-stream message: its decoded headers and its exact bytes (prelude to message CRC).
    headers: dict[str, HeaderValue] | None = None
    frame: bytes | None = None


class SSELimitExceeded(LimitExceeded):
    """A line or an event passed its cap. ``events`` holds what was dispatched before the fault in the
    same ``feed`` call, so nothing already received is lost."""

    def __init__(self, what: str, limit: int, events: list[SSEEvent]) -> None:
        super().__init__(what, limit)
        self.events = events


def _decode(raw: bytes) -> tuple[str, bool]:
    try:
        return raw.decode("utf-8"), False
    except UnicodeDecodeError:
        # WHATWG "UTF-8 decode": invalid sequences become U+FFFD, not a fatal error.
        return raw.decode("utf-8", "replace"), True


class SSEDecoder:
    def __init__(
        self,
        *,
        max_line_bytes: int = DEFAULT_MAX_LINE_BYTES,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        unframed_json: bool = False,
    ) -> None:
        self.max_line_bytes = max_line_bytes
        self.max_event_bytes = max_event_bytes
        self.unframed_json = unframed_json
        self._json: list[bytes] | None = None  # the lines of an unframed JSON object being collected
        self._json_offset = 0
        self._json_bytes = 0
        self._json_depth = 0
        self._json_in_string = False
        self._json_escape = False
        self._buf = bytearray()
        self._base = 0  # stream offset of self._buf[0]
        self._scan_from = 0
        self._skip_lf = False
        self._at_start = True  # no byte seen yet: a BOM may still come
        self._data: list[str] = []
        self._data_raw: dict[int, bytes] = {}  # data lines (by position) whose bytes decoding replaced
        self._data_bytes = 0
        self.dropped_tail = b""  # what ``close`` dropped: the bytes of an event the end of input cut off
        self._partial = bytearray()  # the bytes of the event in progress that left the buffer already
        self.dropped_at = 0  # the stream offset where ``dropped_tail`` began
        self._event_type = ""
        self._last_id = ""  # the last-event-ID buffer
        self._dispatched_id = ""  # its value at the last blank line: what a reconnect sends
        self._retry: int | None = None
        self._event_offset: int | None = None
        self._event_bad_utf8 = False
        self._failed: SSELimitExceeded | None = None
        self.dispatched = 0
        self.comments = 0
        self.bytes_in = 0
        self.invalid_utf8 = 0

    @property
    def retry(self) -> int | None:
        """The reconnection time (ms) the stream asked for, if any."""
        return self._retry

    @property
    def last_event_id(self) -> str:
        """The id to resume from (``Last-Event-ID``). WHATWG copies the buffer to the source's last
        event ID only at a blank line, even one that dispatches nothing; an ``id`` line of an event
        cut off by EOF never takes effect."""
        return self._dispatched_id

    def statistics(self) -> dict[str, int]:
        return {
            "bytes_in": self.bytes_in,
            "events": self.dispatched,
            "comments": self.comments,
            "invalid_utf8_events": self.invalid_utf8,
            "buffered_bytes": len(self._buf),
        }

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode one chunk; return the events it completed.

        Raises ``SSELimitExceeded`` when a line or an event passes its cap (and on every call after).
        """
        if self._failed is not None:
            raise self._failed
        self.bytes_in += len(chunk)
        if self._skip_lf and chunk:
            # A CR ended the previous chunk: a leading LF here belongs to that CRLF.
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
                self._base += 1
        self._buf += chunk
        if self._at_start:
            if len(self._buf) < len(_BOM) and _BOM.startswith(bytes(self._buf)):
                return []
            self._at_start = False
            if self._buf.startswith(_BOM):
                del self._buf[: len(_BOM)]
                self._base += len(_BOM)
        events: list[SSEEvent] = []
        buf = self._buf
        start = 0
        try:
            crs = chunk.count(b"\r")
            if not crs or (crs == chunk.count(b"\r\n") and chunk[-1:] != b"\r"):
                # The common cases: LF or CRLF line ends only. Every CR before this chunk was consumed as
                # a line end, so the buffer holds no other CR.
                start = self._feed_lf(buf, events)
            else:
                start = self._feed_any(buf, events)
            if len(buf) - start > self.max_line_bytes:
                raise SSELimitExceeded("SSE line", self.max_line_bytes, events)
        except SSELimitExceeded as exc:
            # Sticky: the stream is unusable, so drop everything buffered (memory stays bounded).
            self._failed = exc
            self._buf = bytearray()
            self._data, self._data_bytes = [], 0
            self._json = None
            raise
        if self._event_offset is not None:
            # An event is in progress: its bytes consumed so far are kept (bounded by the event cap) so the
            # end of input can report exactly what it cut off.
            begin = self._event_offset - self._base
            if begin >= 0:
                self._partial[:] = buf[begin:start]
            else:
                self._partial += buf[:start]
        elif self._partial:
            self._partial.clear()
        del buf[:start]
        self._base += start
        self._scan_from = len(buf)
        return events

    def _feed_lf(self, buf: bytearray, events: list[SSEEvent]) -> int:
        """Lines split on LF (a CR right before it belongs to the line end). A whole event of the usual
        shape (an optional ``event`` line, one ``data`` line, a blank line) starting at an event boundary
        is matched in one step; anything else goes line by line through ``_line``. Same outcome either
        way, at a fraction of the calls."""
        start = 0
        max_line = self.max_line_bytes
        simple_limit = min(max_line, self.max_event_bytes)
        find = buf.find
        match = _SIMPLE_EVENT.match
        # A partial line left by the last call is not rescanned from its start (an endless line in tiny
        # chunks stays linear): the first line goes the line way.
        nl = find(b"\n", self._scan_from)
        while nl >= 0:
            if (
                (start or not self._scan_from)
                and self._event_offset is None
                and not self._event_type
                and self._json is None
            ):
                m = match(buf, start)
                if m is not None and m.end() - start <= simple_limit:
                    etype, data = m.group(1, 2)
                    try:
                        event = etype.decode() if etype else "message"
                        text = data.decode()
                    except UnicodeDecodeError:
                        pass  # the line way replaces and flags it
                    else:
                        self.dispatched += 1
                        self._dispatched_id = self._last_id
                        events.append(
                            SSEEvent(event, text, self._last_id, self._retry, self.dispatched, self._base + start)
                        )
                        start = m.end()
                        nl = find(b"\n", start)
                        continue
            end = nl - 1 if nl > start and buf[nl - 1] == 0x0D else nl  # CRLF: the CR is part of the end
            if end - start > max_line:
                raise SSELimitExceeded("SSE line", max_line, events)
            if end == start and self._json is None:
                self._dispatch(events)
            else:
                self._line(bytes(buf[start:end]), self._base + start, events)
            start = nl + 1
            nl = find(b"\n", start)
        return start

    def _feed_any(self, buf: bytearray, events: list[SSEEvent]) -> int:
        start = 0
        for m in _EOL.finditer(buf, self._scan_from):
            if m.start() - start > self.max_line_bytes:
                raise SSELimitExceeded("SSE line", self.max_line_bytes, events)
            self._line(bytes(buf[start : m.start()]), self._base + start, events)
            start = m.end()
            # A CR as the very last byte may be the first half of a CRLF split across chunks.
            if start == len(buf) and m.group() == b"\r":
                self._skip_lf = True
        return start

    def close_events(self) -> tuple[list[SSEEvent], int]:
        """End of input, with ``unframed_json``: an unframed JSON object still being collected (its last
        line may lack a line end) is dispatched as it is; then as ``close``."""
        events: list[SSEEvent] = []
        if self.unframed_json and self._failed is None:
            tail = bytes(self._buf)
            if tail and self._json is None and self._starts_json(tail):
                self._json_begin(self._base)
            if self._json is not None:
                if tail:
                    self._json_line(tail, events)
                    self._buf = bytearray()
                if self._json is not None:
                    self._json_dispatch(events)
        return events, self.close()

    def close(self) -> int:
        """End of input. An event not ended by a blank line is never dispatched (WHATWG "end of file");
        returns how many bytes of such an unfinished event were dropped: from its first field line (or an
        unterminated non-comment line) to the end of input. A trailing comment drops no event."""
        start = self._event_offset
        if start is None and self._buf and self._buf[:1] != b":":
            start = self._base
        dropped = 0 if start is None else self._base + len(self._buf) - start
        if self._json is not None:  # an unframed object left unbalanced (closed by close_events otherwise)
            start = self._json_offset if start is None else min(start, self._json_offset)
            dropped = self._base + len(self._buf) - start
            self._json = None
        if dropped and start is not None:
            # Kept for the raw log: the unfinished event's bytes, exactly as they came.
            begin = start - self._base
            head = self._partial if begin < 0 else b""
            self.dropped_tail = bytes(head) + bytes(self._buf[max(0, begin) :])
            self.dropped_at = start
        self._partial = bytearray()
        self._buf = bytearray()
        self._data_raw = {}
        self._data, self._data_bytes, self._event_type = [], 0, ""
        self._event_offset, self._event_bad_utf8 = None, False
        return dropped

    def _line(self, line: bytes, offset: int, events: list[SSEEvent]) -> None:
        if self._json is not None:
            self._json_line(line, events)
            return
        if not line:
            self._dispatch(events)
            return
        if self.unframed_json and self._starts_json(line):
            self._json_begin(offset)
            self._json_line(line, events)
            return
        if line[:1] == b":":
            self.comments += 1
            return
        if self._event_offset is None:
            self._event_offset = offset
        name, colon, value = line.partition(b":")
        if colon and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            self._data_bytes += len(value) + 1
            if self._data_bytes > self.max_event_bytes:
                raise SSELimitExceeded("SSE event", self.max_event_bytes, events)
            text, bad = _decode(value)
            if bad:
                self._event_bad_utf8 = True
                self._data_raw[len(self._data)] = bytes(value)
            self._data.append(text)
        elif name == b"event":
            self._event_type, bad = _decode(value)
            self._event_bad_utf8 |= bad
        elif name == b"id":
            if b"\0" not in value:
                self._last_id, bad = _decode(value)
                self._event_bad_utf8 |= bad
        elif name == b"retry" and value.isdigit():  # bytes.isdigit(): ASCII digits only, as the spec says
            self._retry = int(value)
        # Any other field name (case-sensitive) is ignored.

    # -- unframed JSON (opt-in) --------------------------------------------------------------------

    def _starts_json(self, line: bytes) -> bool:
        """Outside any event (no field line yet), a line whose first non-blank byte is ``{``."""
        return self._event_offset is None and not self._data and line.lstrip(b" \t")[:1] == b"{"

    def _json_begin(self, offset: int) -> None:
        self._json, self._json_offset, self._json_bytes = [], offset, 0
        self._json_depth, self._json_in_string, self._json_escape = 0, False, False

    def _json_line(self, line: bytes, events: list[SSEEvent]) -> None:
        assert self._json is not None
        self._json_bytes += len(line) + 1
        if self._json_bytes > self.max_event_bytes:
            raise SSELimitExceeded("SSE event", self.max_event_bytes, events)
        self._json.append(line)
        depth, in_string, escape = self._json_depth, self._json_in_string, self._json_escape
        for m in _JSON_TOKENS.finditer(line):
            c = m.group()
            if escape:
                escape = False
            elif in_string:
                if c == b"\\":
                    # A backslash escapes the next byte: the next match, when that byte is a token itself.
                    escape = line[m.end() : m.end() + 1] in (b'"', b"\\", b"{", b"}")
                elif c == b'"':
                    in_string = False
            elif c == b'"':
                in_string = True
            elif c == b"{":
                depth += 1
            elif c == b"}":
                depth -= 1
        self._json_depth, self._json_in_string, self._json_escape = depth, in_string, escape
        if depth <= 0 and not in_string:
            self._json_dispatch(events)

    def _json_dispatch(self, events: list[SSEEvent]) -> None:
        assert self._json is not None
        raw = b"\n".join(self._json)
        text, bad = _decode(raw)
        self._json = None
        self.dispatched += 1
        if bad:
            self.invalid_utf8 += 1
        events.append(
            SSEEvent(
                event="message",
                data=text,
                id=self._last_id,
                retry=self._retry,
                index=self.dispatched,
                offset=self._json_offset,
                invalid_utf8=bad,
                unframed=True,
                data_bytes=raw if bad else None,
            )
        )

    def _dispatch(self, events: list[SSEEvent]) -> None:
        self._dispatched_id = self._last_id
        offset = self._event_offset
        self._event_offset = None
        if not self._data:
            # Nothing to fire; the id (already stored) still takes effect.
            self._event_type, self._event_bad_utf8 = "", False
            self._data_raw = {}
            return
        self.dispatched += 1
        exact = None
        if self._event_bad_utf8:
            self.invalid_utf8 += 1
            if self._data_raw:
                exact = b"\n".join(self._data_raw.get(i, s.encode()) for i, s in enumerate(self._data))
                self._data_raw = {}
        events.append(
            SSEEvent(
                event=self._event_type or "message",
                data="\n".join(self._data),
                id=self._last_id,
                retry=self._retry,
                index=self.dispatched,
                offset=offset if offset is not None else self._base,
                invalid_utf8=self._event_bad_utf8,
                data_bytes=exact,
            )
        )
        self._data, self._data_bytes, self._event_type, self._event_bad_utf8 = [], 0, "", False
