"""Incremental ``application/vnd.amazon.eventstream`` decoder on bytes (AWS event-stream framing).

Rule: a network chunk is not a message boundary. Each message is a 12-byte prelude (total length, headers
length, both big-endian uint32, then the CRC32 of those 8 bytes), the typed headers, the payload and the
CRC32 of everything before it. Both CRCs are checked before anything is dispatched (the prelude's before
its lengths are believed): a mismatch, an impossible length or a malformed header is a
``EventStreamProtocolError`` (``protocol``, the stream is terminated as the spec demands), never a silent
stall; a message larger than ``max_frame_bytes`` is refused (``EventStreamLimitExceeded``) from its prelude
alone, so memory stays bounded whatever the peer sends. Every fault carries the messages decoded before
it in the same ``feed`` call and is raised again on every later call.

A message is dispatched as an ``SSEEvent`` (the one raw-event record of the pipeline and of the raw log):
``event`` is its ``:event-type`` (``:exception-type`` for an exception, ``:error-code`` for an unmodeled
error), ``id`` its ``:message-type``, ``data`` its payload as text, ``headers`` every decoded header, and
``frame`` the message's exact bytes, so the raw log replays it byte for byte.

Rule (secrets, ``redact_with``): redaction works on decoded values, never on the framing. A message is
checked (both CRCs, its lengths, its headers) as it came; only then, when a configured secret occurs in
it, are its string and byte-array header values and its payload redacted and the message framed
again (new lengths, new CRCs; every other header kept byte for byte), so the dispatched event and the
stored ``frame`` hold the marker where the provider echoed the secret and decode exactly as if the
provider had sent the marker itself: the outcome, the events and their categories are the ones the
message makes without the echo. The event keeps the offset where the message came, and a replay of the
stored frames follows those offsets (``resume_at``). Bytes that never became a message (a broken one, an
unfinished tail) cannot be decoded, so every secret in them is masked in place, the marker padded to the
secret's length (a whole message that failed in its headers gets its message CRC again): lengths, offsets
and the fault they make stay the same. A secret left in the framed
message (in a header's name, or straddling the binary fields: some of its bytes a length or a CRC) is
masked in the stored frame as well: that frame then no longer replays, but it never holds the secret.
"""

from __future__ import annotations

import struct
from binascii import crc32
from collections.abc import Callable, Mapping

from sluice.normalizer.redact import Redactor
from sluice.normalizer.sse import HeaderValue, SSEEvent
from sluice.schemas.errors import LimitExceeded, ProviderProtocolError

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "EventStreamDecoder",
    "EventStreamLimitExceeded",
    "EventStreamProtocolError",
    "Timestamp",
    "Uuid",
    "encode_frame",
]

DEFAULT_MAX_FRAME_BYTES = 4 << 20
_PRELUDE = 12
_MIN_FRAME = 16  # a prelude and a message CRC: no headers, no payload
_U32 = struct.Struct(">I")
_PRELUDE_FIELDS = struct.Struct(">III")
# The header naming a message, by its :message-type (an event's is :event-type).
_NAME_HEADER = {"exception": ":exception-type", "error": ":error-code"}
_MAX_CACHED_HEADERS = 64


class Timestamp(int):
    """A ``timestamp`` header value (type 8): milliseconds since the Unix epoch, kept apart from ``long``
    so a re-encoded frame keeps its type."""

    __slots__ = ()


class Uuid(bytes):
    """A ``uuid`` header value (type 9): its 16 bytes, kept apart from ``byte_array``. (The ``uuid`` module
    stays out of the sans-IO core, which must not reach for randomness.)"""

    __slots__ = ()

    def __str__(self) -> str:
        h = self.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class EventStreamProtocolError(ProviderProtocolError):
    """The framing is broken (a CRC mismatch, an impossible length, a malformed header). ``events`` holds
    what was dispatched before the fault in the same ``feed`` call; ``broken`` the bytes from the broken
    message's start to the end of what had arrived, as a raw event of their own (no headers) so the raw
    log keeps them and a replay fails at the same byte (``None`` when raised again on a later call)."""

    def __init__(self, message: str, events: list[SSEEvent], broken: SSEEvent | None = None) -> None:
        super().__init__(message)
        self.events = events
        self.broken = broken


class EventStreamLimitExceeded(LimitExceeded):
    """A message's announced length passed ``max_frame_bytes``; ``events`` as above."""

    def __init__(self, what: str, limit: int, events: list[SSEEvent]) -> None:
        super().__init__(what, limit)
        self.events = events


class _BadHeader(Exception):
    """A header that does not parse (internal: turned into ``EventStreamProtocolError`` with the offset)."""


def _fixed(fmt: str) -> Callable[[bytes, int], tuple[HeaderValue, int]]:
    s = struct.Struct(fmt)

    def read(buf: bytes, at: int) -> tuple[HeaderValue, int]:
        if at + s.size > len(buf):
            raise _BadHeader(f"a {s.size}-byte value runs past the headers")
        return s.unpack_from(buf, at)[0], at + s.size

    return read


def _sized(buf: bytes, at: int) -> tuple[bytes, int]:
    if at + 2 > len(buf):
        raise _BadHeader("a length prefix runs past the headers")
    (n,) = struct.unpack_from(">H", buf, at)
    if at + 2 + n > len(buf):
        raise _BadHeader(f"a {n}-byte value runs past the headers")
    return buf[at + 2 : at + 2 + n], at + 2 + n


def _string(buf: bytes, at: int) -> tuple[HeaderValue, int]:
    raw, at = _sized(buf, at)
    try:
        return raw.decode("utf-8"), at
    except UnicodeDecodeError:
        raise _BadHeader("a string value is not UTF-8") from None


def _timestamp(buf: bytes, at: int) -> tuple[HeaderValue, int]:
    value, at = _fixed(">q")(buf, at)
    assert isinstance(value, int)
    return Timestamp(value), at


def _uuid(buf: bytes, at: int) -> tuple[HeaderValue, int]:
    if at + 16 > len(buf):
        raise _BadHeader("a uuid value runs past the headers")
    return Uuid(buf[at : at + 16]), at + 16


# The spec's fixed set of header value types (0-9), by their type byte.
_READERS: dict[int, Callable[[bytes, int], tuple[HeaderValue, int]]] = {
    0: lambda buf, at: (True, at),
    1: lambda buf, at: (False, at),
    2: _fixed(">b"),
    3: _fixed(">h"),
    4: _fixed(">i"),
    5: _fixed(">q"),
    6: _sized,
    7: _string,
    8: _timestamp,
    9: _uuid,
}


def _headers(buf: bytes) -> dict[str, HeaderValue]:
    out: dict[str, HeaderValue] = {}
    at = 0
    while at < len(buf):
        n = buf[at]
        if n == 0 or at + 1 + n + 1 > len(buf):
            raise _BadHeader("a header name is empty or runs past the headers")
        try:
            name = bytes(buf[at + 1 : at + 1 + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise _BadHeader("a header name is not UTF-8") from None
        kind = buf[at + 1 + n]
        reader = _READERS.get(kind)
        if reader is None:
            raise _BadHeader(f"header {name!r} has unknown value type {kind}")
        if name in out:
            raise _BadHeader(f"header {name!r} appears twice")
        out[name], at = reader(buf, at + 2 + n)
    return out


def _encode_header(name: str, value: HeaderValue) -> bytes:
    key = name.encode()
    head = bytes([len(key)]) + key
    if value is True or value is False:
        return head + bytes([0 if value else 1])
    if isinstance(value, Timestamp):
        return head + b"\x08" + struct.pack(">q", value)
    if isinstance(value, int):
        return head + b"\x05" + struct.pack(">q", value)
    if isinstance(value, Uuid):
        return head + b"\x09" + value
    if isinstance(value, bytes):
        return head + b"\x06" + struct.pack(">H", len(value)) + value
    text = value.encode()
    return head + b"\x07" + struct.pack(">H", len(text)) + text


def encode_frame(headers: Mapping[str, HeaderValue], payload: bytes) -> bytes:
    """One message, framed (the fake provider's and the tests' encoder; integers become ``long``)."""
    return _frame(b"".join(_encode_header(k, v) for k, v in headers.items()), payload)


def _frame(head: bytes, payload: bytes) -> bytes:
    prelude = struct.pack(">II", _MIN_FRAME + len(head) + len(payload), len(head))
    body = prelude + _U32.pack(crc32(prelude)) + head + payload
    return body + _U32.pack(crc32(body))


# A fixed-size header value's width, by its type byte (6 and 7 carry a 2-byte length instead).
_WIDTH = {0: 0, 1: 0, 2: 1, 3: 2, 4: 4, 5: 8, 8: 8, 9: 16}


def _redact_headers(head: bytes, secrets: Redactor) -> bytes:
    """A header block that parsed, with every secret in its string and byte-array values replaced (their
    length prefixes follow); every other byte as it came. (A name is not redacted: a name that held a
    secret would leave it in the frame, which is then masked.)"""
    out = bytearray()
    at = 0
    while at < len(head):
        n = head[at]
        kind = head[at + 1 + n]
        out += head[at : at + 2 + n]
        at += 2 + n
        if kind in (6, 7):
            (size,) = struct.unpack_from(">H", head, at)
            value = secrets.redact(head[at + 2 : at + 2 + size])
            out += struct.pack(">H", len(value)) + value
            at += 2 + size
        else:
            out += head[at : at + _WIDTH[kind]]
            at += _WIDTH[kind]
    return bytes(out)


def _mask_broken(data: bytes, secrets: Redactor) -> bytes:
    """The bytes from a broken message on, every secret masked to its length. A whole message whose CRCs
    held (its fault is in its headers) gets its message CRC again, so a replay meets the same fault."""
    masked = secrets.mask(data)
    if masked == data or len(data) < _MIN_FRAME:
        return masked
    (total,) = _U32.unpack_from(data, 0)
    if _MIN_FRAME <= total <= len(data) and crc32(data[: total - 4]) == _U32.unpack_from(data, total - 4)[0]:
        body = masked[: total - 4]
        return body + _U32.pack(crc32(body)) + masked[total:]
    return masked


class EventStreamDecoder:
    """The same surface as ``SSEDecoder`` (``feed``, ``close_events``, ``close``, ``dropped_tail``,
    ``dispatched``, ``statistics``), so the ``Normalizer`` and the worker drive either framing alike."""

    def __init__(self, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._base = 0  # stream offset of self._buf[0]
        self._need = _PRELUDE  # bytes the message in progress needs before anything more can be judged
        self._failed: EventStreamProtocolError | EventStreamLimitExceeded | None = None
        self._parsed: dict[bytes, tuple[dict[str, HeaderValue], str, str]] = {}
        # The last header block seen and what it parsed to (consecutive messages mostly repeat it); at
        # first the empty block, which parses to no headers, no name, no type.
        self._last: tuple[bytes, tuple[dict[str, HeaderValue], str, str]] = (b"", ({}, "", ""))
        self.dispatched = 0
        self.bytes_in = 0
        self.dropped_tail = b""
        self.dropped_at = 0
        self._secrets: Redactor | None = None

    def redact_with(self, secrets: Redactor) -> None:
        """Remove ``secrets`` from every message from now on, after it is decoded (the module's rule)."""
        self._secrets = secrets if secrets.active else None

    def resume_at(self, offset: int) -> None:
        """The next bytes fed begin the message that came at stream ``offset`` (a replay of stored frames,
        some of which are shorter than what came: they were redacted). Only between messages."""
        if self._buf:
            raise ValueError("resume_at between messages only")
        self._base = offset

    @property
    def pending(self) -> bool:
        return bool(self._buf)

    def statistics(self) -> dict[str, int]:
        return {"bytes_in": self.bytes_in, "events": self.dispatched, "buffered_bytes": len(self._buf)}

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Decode one chunk; return the messages it completed. Raises ``EventStreamProtocolError`` or
        ``EventStreamLimitExceeded`` (and the same again on every call after)."""
        if self._failed is not None:
            # Raised again without what it carried the first time (that is already delivered).
            if isinstance(self._failed, EventStreamLimitExceeded):
                raise EventStreamLimitExceeded(self._failed.what, self._failed.limit, [])
            raise EventStreamProtocolError(self._failed.message, [])
        self.bytes_in += len(chunk)
        buf = self._buf
        if len(buf) + len(chunk) < self._need:
            # Nothing can be judged yet: only append (so a large message arriving in small chunks is
            # copied once, never rescanned).
            buf += chunk
            return []
        # Decode from one immutable ``bytes``: each slice of it is then the one copy of what it holds (the
        # frame kept for the raw log, its header block, its payload).
        buffered = bool(buf)
        if buffered:
            buf += chunk
            data = bytes(buf)
        else:
            data = chunk if type(chunk) is bytes else bytes(chunk)
        events: list[SSEEvent] = []
        start = 0
        end = len(data)
        need = self._need
        limit, parsed, base, dispatched = self.max_frame_bytes, self._parsed, self._base, self.dispatched
        last_head, last = self._last
        unpack, u32 = _PRELUDE_FIELDS.unpack_from, _U32.unpack_from
        search = self._secrets.pattern.search if self._secrets is not None and self._secrets.pattern else None
        try:
            while end - start >= need:
                total, headers_len, prelude_crc = unpack(data, start)
                if (
                    crc32(data[start : start + 8]) != prelude_crc
                    or total < _MIN_FRAME
                    or headers_len > total - _MIN_FRAME
                    or total > limit
                ):
                    self._refuse_prelude(data, start)
                if end - start < total:
                    need = total
                    break
                frame = data[start : start + total]
                body = total - 4
                if crc32(frame[:body]) != u32(frame, body)[0]:
                    raise EventStreamProtocolError(
                        f"event-stream message at byte {base + start}: message CRC mismatch", []
                    )
                payload_at = _PRELUDE + headers_len
                if headers_len == len(last_head) and frame.startswith(last_head, _PRELUDE):
                    headers, name, kind = last  # the previous message's header block again (compared in place)
                else:
                    head = frame[_PRELUDE:payload_at]
                    last = parsed.get(head) or self._parse_headers(head, base + start)
                    last_head = head  # only once it parsed: ``_last`` always pairs a block with its own parse
                    headers, name, kind = last
                try:
                    text, bad = frame[payload_at:body].decode("utf-8"), False
                except UnicodeDecodeError:
                    text, bad = frame[payload_at:body].decode("utf-8", "replace"), True
                dispatched += 1
                if search is not None and search(frame):  # a secret in it: out of the decoded values
                    events.append(self._redacted(frame, headers_len, dispatched, base + start))
                else:
                    # (positional: event, data, id, retry, index, offset, invalid_utf8, unframed, data_bytes,
                    # headers, frame)
                    events.append(
                        SSEEvent(name, text, kind, None, dispatched, base + start, bad, False, None, headers, frame)
                    )
                start += total
                need = _PRELUDE
        except EventStreamLimitExceeded as exc:
            self.dispatched = dispatched
            exc.events = events
            self._failed = exc
            raise
        except EventStreamProtocolError as exc:
            dispatched += 1
            self.dispatched = dispatched
            exc.events = events
            broken = data[start:] if self._secrets is None else _mask_broken(data[start:], self._secrets)
            exc.broken = SSEEvent(
                event="", data="", id="", retry=None, index=dispatched, offset=base + start, frame=broken
            )
            self._failed = exc
            raise
        finally:
            self._need, self._last = need, (last_head, last)
            if start:
                self._base = base + start
            # What is left is less than a message: it waits in the buffer.
            if buffered:
                del buf[:start]
            elif start < end:
                buf += data[start:] if start else data
        self.dispatched = dispatched
        return events

    def _redacted(self, frame: bytes, headers_len: int, index: int, offset: int) -> SSEEvent:
        """The message ``frame`` (checked, its headers parsed) with its secrets out of its decoded values,
        framed again, and the event that frame decodes to."""
        secrets = self._secrets
        assert secrets is not None
        head = _redact_headers(frame[_PRELUDE : _PRELUDE + headers_len], secrets)
        payload = secrets.redact(frame[_PRELUDE + headers_len : len(frame) - 4])
        stored = _frame(head, payload)
        headers = _headers(head)  # the block parsed before, and redaction keeps its structure
        kind = headers.get(":message-type")
        name = headers.get(_NAME_HEADER.get(str(kind), ":event-type"))
        try:
            text, bad = payload.decode("utf-8"), False
        except UnicodeDecodeError:
            text, bad = payload.decode("utf-8", "replace"), True
        if secrets.pattern is not None and secrets.pattern.search(stored):
            stored = secrets.mask(stored)  # the secret straddles the binary fields (the module's rule)
        return SSEEvent(
            name if isinstance(name, str) else "",
            text,
            kind if isinstance(kind, str) else "",
            None,
            index,
            offset,
            bad,
            False,
            None,
            headers,
            stored,
        )

    def _refuse_prelude(self, buf: bytes, start: int) -> None:
        """The prelude at ``start`` failed a check: raise the fault it is (its CRC is judged first, so a
        flipped length bit is a mismatch, never a limit)."""
        total, headers_len, prelude_crc = _PRELUDE_FIELDS.unpack_from(buf, start)
        at = self._base + start
        if crc32(buf[start : start + 8]) != prelude_crc:
            raise EventStreamProtocolError(f"event-stream message at byte {at}: prelude CRC mismatch", [])
        if total < _MIN_FRAME or headers_len > total - _MIN_FRAME:
            raise EventStreamProtocolError(
                f"event-stream message at byte {at}: impossible lengths (total {total}, headers {headers_len})", []
            )
        raise EventStreamLimitExceeded(f"event-stream message at byte {at}", self.max_frame_bytes, [])

    def _parse_headers(self, head: bytes, offset: int) -> tuple[dict[str, HeaderValue], str, str]:
        """Headers, and the message's name and type. A stream repeats a handful of header blocks (one per
        event type), so each distinct block is parsed once per stream (a bounded cache; the dict is shared
        by the messages that carry it and is read-only)."""
        try:
            headers = _headers(head)
        except _BadHeader as exc:
            why = str(exc)
            if self._secrets is not None:  # it may name a header; masked, as the stored bytes replay it
                why = self._secrets.mask(why.encode()).decode()
            raise EventStreamProtocolError(f"event-stream message at byte {offset}: {why}", []) from None
        kind = headers.get(":message-type")
        name = headers.get(_NAME_HEADER.get(str(kind), ":event-type"))
        parsed = (headers, name if isinstance(name, str) else "", kind if isinstance(kind, str) else "")
        if len(self._parsed) >= _MAX_CACHED_HEADERS:
            self._parsed.clear()
        self._parsed[head] = parsed
        return parsed

    def close_events(self) -> tuple[list[SSEEvent], int]:
        """End of input: nothing more can complete (a message is whole or not at all); as ``close``."""
        return [], self.close()

    def close(self) -> int:
        """End of input. Returns how many bytes of an unfinished message were dropped (kept, exactly, in
        ``dropped_tail`` from ``dropped_at`` for the raw log); after a fault nothing is dropped again."""
        dropped = len(self._buf) if self._failed is None else 0
        if dropped:
            tail = bytes(self._buf)
            self.dropped_tail = tail if self._secrets is None else self._secrets.mask(tail)
            self.dropped_at = self._base
        self._buf = bytearray()
        return dropped
