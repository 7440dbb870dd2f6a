"""HTTP/1.1 response parsing without I/O (h11's model): bytes in, events out.

Rule: ``ResponseParser.feed(data)`` returns the events the bytes completed (``InformationalResponse``,
``Response``, ``Data``, ``EndOfMessage``) and ``feed_eof()`` those the connection's end completes; a
response that breaks HTTP/1.1 raises ``HTTPProtocolError`` and the parser stays failed. Framing follows
RFC 9112 §6.3 as h11 reads it (the wire client's parser is differentially tested against h11): 1xx
responses are skipped past, 204 and 304 never have a body, ``Transfer-Encoding: chunked`` (the only coding
accepted) beats ``Content-Length``, and otherwise the body runs to the connection's end. Heads and chunk
lines are bounded (``max_head``, ``max_line``); body bytes are handed out as they come, all of one
``feed`` merged into one ``Data`` (chunk boundaries mean nothing to a byte stream).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "Data",
    "EndOfMessage",
    "Event",
    "HTTPProtocolError",
    "InformationalResponse",
    "Response",
    "ResponseParser",
]


class HTTPProtocolError(Exception):
    """The peer's response is not valid HTTP/1.1. ``events``: what the same ``feed`` completed before the
    fault (body bytes before a broken chunk are kept)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.events: list[Event] = []


@dataclass(frozen=True, slots=True)
class InformationalResponse:
    """A 1xx response (103 Early Hints, 100 Continue): the real one follows."""

    status: int
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True, slots=True)
class Response:
    """The final response's head. Header names are lower-cased, in order, repeats kept."""

    status: int
    headers: list[tuple[bytes, bytes]]
    http_version: bytes
    reason: bytes


@dataclass(slots=True)
class Data:
    # Not frozen: one is made per read on the hot path, and a frozen dataclass's __init__ costs twice as much.
    data: bytes


@dataclass(frozen=True, slots=True)
class EndOfMessage:
    trailers: list[tuple[bytes, bytes]]


Event = InformationalResponse | Response | Data | EndOfMessage


class _S(Enum):
    HEAD = "head"
    LENGTH = "length"  # Content-Length body: _remaining bytes left
    CHUNK_SIZE = "chunk size line"
    CHUNK_DATA = "chunk data"  # _remaining bytes of this chunk left
    CHUNK_CRLF = "CRLF after chunk data"  # _remaining bytes of it left
    TRAILER = "trailer"
    CLOSE = "body delimited by the connection's end"
    DONE = "done"
    FAILED = "failed"


# RFC 9110 / 9112 grammar as h11 writes it (h11/_abnf.py); matched with fullmatch.
_VCHAR_OR_OBS = rb"[^\x00\s]"
_STATUS_LINE = re.compile(rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: ((?:[ \t]|" + _VCHAR_OR_OBS + rb")*))?")
_FIELD = re.compile(
    rb"([-!#$%&'*+.^_`|~0-9a-zA-Z]+):[ \t]*((?:" + _VCHAR_OR_OBS + rb"+(?:[ \t]+" + _VCHAR_OR_OBS + rb"+)*)?)[ \t]*"
)
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*")
_CHUNK_PLAIN = re.compile(rb"([0-9A-Fa-f]{1,20})\r\n")  # the usual chunk head: size and CRLF, nothing else
_DIGITS = re.compile(rb"[0-9]{1,20}")
_HEAD_END = re.compile(rb"\n\r?\n")
_FOLD = re.compile(rb"[ \t]+")


class ResponseParser:
    """One response on one connection (a new parser per response)."""

    def __init__(self, *, max_head: int = 64 * 1024, max_line: int = 4 * 1024) -> None:
        self._max_head = max_head
        self._max_line = max_line
        self._buf = bytearray()
        self._scan = 0  # where to go on looking for the end of a head or a line
        self._state = _S.HEAD
        self._remaining = 0
        self.keep_alive = True  # the connection may carry another request after this response
        self.trailing = False  # bytes arrived after the response ended: the connection is not reusable

    @property
    def done(self) -> bool:
        return self._state is _S.DONE

    def feed(self, data: bytes) -> list[Event]:
        """The events ``data`` completes. Raises ``HTTPProtocolError``."""
        state = self._state
        if state is _S.DONE:
            if data:
                self.trailing = True
                self.keep_alive = False
            return []
        if state is _S.FAILED:
            raise HTTPProtocolError("the response already failed")
        events: list[Event] = []
        # The common cases, a read inside a body with nothing held back: no copy into the buffer.
        if not self._buf:
            if state is _S.CLOSE:
                return [Data(data)] if data else []
            if state is _S.LENGTH and len(data) < self._remaining:
                self._remaining -= len(data)
                return [Data(data)] if data else []
            if state is _S.CHUNK_SIZE:
                pos = self._whole_chunks(data, events)
                if pos == len(data):
                    return events
                data = data[pos:]
        self._buf += data
        try:
            self._parse(events)
        except HTTPProtocolError as exc:
            self._state = _S.FAILED
            self.keep_alive = False
            exc.events = events
            raise
        return events

    def _whole_chunks(self, data: bytes, events: list[Event]) -> int:
        """The fast path: every whole chunk of the plain shape at the start of ``data`` becomes one ``Data``;
        returns where the rest (anything else, the last chunk included) begins, for the general parser."""
        parts: list[bytes] = []
        pos, n = 0, len(data)
        match = _CHUNK_PLAIN.match
        while pos < n:
            m = match(data, pos)
            if m is None:
                break
            size = int(m[1], 16)
            start = m.end()
            end = start + size
            if size == 0 or end + 2 > n or data[end : end + 2] != b"\r\n":
                break
            parts.append(data[start:end])
            pos = end + 2
        if parts:
            events.append(Data(parts[0] if len(parts) == 1 else b"".join(parts)))
        return pos

    def feed_eof(self) -> list[Event]:
        """The connection ended: the events that completes, or ``HTTPProtocolError`` when the response was
        not over (a body delimited by the connection's end is the one that ends here)."""
        self.keep_alive = False
        state = self._state
        if state is _S.CLOSE:
            self._state = _S.DONE
            return [EndOfMessage([])]
        if state is _S.DONE:
            return []
        self._state = _S.FAILED
        if state is _S.HEAD:
            raise HTTPProtocolError(
                "the peer closed the connection inside the response head"
                if self._buf
                else "the peer closed the connection before a response"
            )
        raise HTTPProtocolError(f"the peer closed the connection inside the response ({state.value})")

    # -- parsing ------------------------------------------------------------------------------------------------

    def _parse(self, events: list[Event]) -> None:
        out = bytearray()  # body bytes of this feed, handed out as one Data
        try:
            self._loop(events, out)
        finally:
            if out:
                events.append(Data(bytes(out)))

    def _loop(self, events: list[Event], out: bytearray) -> None:
        buf = self._buf
        pos = 0
        n = len(buf)
        while pos < n:
            state = self._state
            if state is _S.HEAD:
                del buf[:pos]
                pos, n = 0, len(buf)
                head = self._take_head()
                if head is None:
                    break
                events.append(head)
                pos, n = 0, len(buf)
                if isinstance(head, Response) and self._state is _S.DONE:
                    events.append(EndOfMessage([]))
            elif state is _S.LENGTH:
                take = min(self._remaining, n - pos)
                out += buf[pos : pos + take]
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._end(events, out, [])
            elif state is _S.CLOSE:
                out += buf[pos:]
                pos = n
            elif state is _S.CHUNK_DATA:
                take = min(self._remaining, n - pos)
                out += buf[pos : pos + take]
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state, self._remaining = _S.CHUNK_CRLF, 2
            elif state is _S.CHUNK_CRLF:
                # Compared as it arrives (h11 does too): a wrong byte fails at once.
                want = b"\r\n"[2 - self._remaining :]
                got = bytes(buf[pos : pos + len(want)])
                if got != want[: len(got)]:
                    raise HTTPProtocolError(f"chunk data not followed by CRLF (got {got!r})")
                pos += len(got)
                self._remaining -= len(got)
                if self._remaining == 0:
                    self._state = _S.CHUNK_SIZE
            elif state is _S.CHUNK_SIZE:
                m = _CHUNK_PLAIN.match(buf, pos)
                if m is not None:  # a whole chunk of the usual shape: straight through
                    size = int(m[1], 16)
                    start = m.end()
                    stop = start + size
                    if size and stop + 2 <= n and buf[stop : stop + 2] == b"\r\n":
                        out += memoryview(buf)[start:stop]
                        pos, self._scan = stop + 2, 0  # a partial line's scan mark no longer applies
                        continue
                end = buf.find(b"\r\n", pos + max(0, self._scan - 1))
                if end < 0:
                    if n - pos > self._max_line:
                        raise HTTPProtocolError("chunk size line too long")
                    self._scan = n - pos  # the buffer is cut at pos below
                    break
                m = _CHUNK_LINE.fullmatch(buf, pos, end)
                if m is None:
                    raise HTTPProtocolError(f"bad chunk size line {bytes(buf[pos:end])[:40]!r}")
                pos, self._scan = end + 2, 0
                self._remaining = int(m[1], 16)
                self._state = _S.CHUNK_DATA if self._remaining else _S.TRAILER
            elif state is _S.TRAILER:
                del buf[:pos]
                pos, n = 0, len(buf)
                lines = self._take_lines()
                if lines is None:
                    break
                pos, n = 0, len(buf)
                trailers = _fields(lines)
                _framing_headers(trailers)  # validated as a head's are (h11 does so too)
                self._end(events, out, trailers)
            else:  # DONE: bytes past the response's end
                self.trailing = True
                self.keep_alive = False
                pos = n
                break
        del buf[:pos]

    def _end(self, events: list[Event], out: bytearray, trailers: list[tuple[bytes, bytes]]) -> None:
        if out:
            events.append(Data(bytes(out)))
            out.clear()
        events.append(EndOfMessage(trailers))
        self._state = _S.DONE

    def _take_lines(self) -> list[bytes] | None:
        """The lines up to the first blank line (h11: LF or CRLF endings), or None when it has not
        arrived. ``[]`` when the buffer starts with the blank line."""
        buf = self._buf
        if buf[:1] == b"\n" or buf[:2] == b"\r\n":
            del buf[: 1 if buf[:1] == b"\n" else 2]
            self._scan = 0
            return []
        m = _HEAD_END.search(buf, max(0, self._scan - 2))
        if m is None:
            if len(buf) > self._max_head:
                raise HTTPProtocolError("response head too large")
            self._scan = len(buf)
            return None
        block = bytes(buf[: m.end()])
        del buf[: m.end()]
        self._scan = 0
        lines = block.split(b"\n")[:-2]
        return [line[:-1] if line.endswith(b"\r") else line for line in lines]

    def _take_head(self) -> InformationalResponse | Response | None:
        lines = self._take_lines()
        if lines is None:
            if self._buf and self._buf[0] < 0x21:  # no status line starts with a control or a space
                raise HTTPProtocolError("not an HTTP/1.x status line")
            return None
        if not lines:
            raise HTTPProtocolError("a blank line where the status line belongs")
        m = _STATUS_LINE.fullmatch(lines[0])
        if m is None:
            raise HTTPProtocolError(f"not an HTTP/1.x status line {lines[0][:80]!r}")
        status = int(m[2])
        headers = _fields(lines[1:])
        te, length = _framing_headers(headers)
        if status < 100:
            raise HTTPProtocolError(f"status {status} is not a response status")
        if status == 101:
            raise HTTPProtocolError("101 Switching Protocols, but no upgrade was asked for")
        if status < 200:
            return InformationalResponse(status, headers)
        version = m[1]
        tokens = b",".join(v for k, v in headers if k == b"connection").lower().split(b",")
        if version != b"1.1" or b"close" in (t.strip() for t in tokens):
            self.keep_alive = False
        if status in (204, 304):  # never a body, whatever the headers say
            self._state = _S.DONE
        elif te:
            self._state = _S.CHUNK_SIZE
        elif length is not None:
            self._state, self._remaining = (_S.LENGTH, length) if length else (_S.DONE, 0)
        else:
            self._state = _S.CLOSE
            self.keep_alive = False
        return Response(status, headers, version, m[3] or b"")


def _fields(lines: list[bytes]) -> list[tuple[bytes, bytes]]:
    """Header lines as (lower-cased name, value); obsolete line folding joined with a space (RFC 9112 §5.2)."""
    joined: list[bytes] = []
    for line in lines:
        fold = _FOLD.match(line)
        if fold is not None:
            if not joined:
                raise HTTPProtocolError("a continuation line before any header")
            joined[-1] += b" " + line[fold.end() :]
        else:
            joined.append(line)
    fields: list[tuple[bytes, bytes]] = []
    for line in joined:
        m = _FIELD.fullmatch(line)
        if m is None:
            raise HTTPProtocolError(f"malformed header line {line[:60]!r}")
        fields.append((m[1].lower(), m[2]))
    return fields


def _framing_headers(headers: list[tuple[bytes, bytes]]) -> tuple[bool, int | None]:
    """(chunked?, content length) from the headers; refuses what would make the body's end ambiguous."""
    chunked = False
    length: bytes | None = None
    for name, value in headers:
        if name == b"content-length":
            values = {v.strip() for v in value.split(b",")}
            if len(values) != 1:
                raise HTTPProtocolError("conflicting content-length values")
            v = values.pop()
            if _DIGITS.fullmatch(v) is None:
                raise HTTPProtocolError("bad content-length")
            if length is not None and length != v:
                raise HTTPProtocolError("conflicting content-length headers")
            length = v
        elif name == b"transfer-encoding":
            if chunked:
                raise HTTPProtocolError("more than one transfer-encoding header")
            if value.lower() != b"chunked":
                raise HTTPProtocolError(f"unsupported transfer-encoding {value[:40]!r}")
            chunked = True
    return chunked, int(length) if length is not None else None
