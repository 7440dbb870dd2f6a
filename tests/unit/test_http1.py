"""worker/http/http1.py against h11, the reference sans-IO HTTP/1.1 implementation: random valid responses
(every framing, interim responses, trailers, folded headers, LF-only heads), random faults and random byte
flips, each cut into random pieces, must give the same events (body bytes joined) or both fail."""

from __future__ import annotations

from typing import Any

import h11
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.worker.http.http1 import (
    Data,
    EndOfMessage,
    HTTPProtocolError,
    InformationalResponse,
    Response,
    ResponseParser,
)

_FRAMING = {b"content-length", b"transfer-encoding"}  # h11 rewrites their values; framing is compared instead
Outcome = list[Any]


def _add(out: Outcome, item: tuple[Any, ...]) -> None:
    if item[0] == "data" and out and out[-1][0] == "data":
        out[-1] = ("data", out[-1][1] + item[1])
    elif item[0] != "data" or item[1]:
        out.append(item)


def _headers(items: Any) -> list[tuple[bytes, bytes]]:
    return [(bytes(k).lower(), bytes(v)) for k, v in items if bytes(k).lower() not in _FRAMING]


def run_h11(chunks: list[bytes]) -> Outcome:
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=1 << 20)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "x"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    out: Outcome = []
    try:
        for chunk in [*chunks, b""]:
            conn.receive_data(chunk)
            while True:
                ev = conn.next_event()
                if ev is h11.NEED_DATA:
                    break
                if isinstance(ev, h11.InformationalResponse):
                    _add(out, ("interim", ev.status_code, _headers(ev.headers)))
                elif isinstance(ev, h11.Response):
                    _add(out, ("response", ev.status_code, _headers(ev.headers)))
                elif isinstance(ev, h11.Data):
                    _add(out, ("data", bytes(ev.data)))
                elif isinstance(ev, h11.EndOfMessage):
                    _add(out, ("end", _headers(ev.headers)))
                    return out
                else:  # ConnectionClosed before the response ended
                    _add(out, ("error",))
                    return out
    except h11.RemoteProtocolError:
        _add(out, ("error",))
    return out


def _ours(out: Outcome, events: list[Any]) -> bool:
    for ev in events:
        if isinstance(ev, InformationalResponse):
            _add(out, ("interim", ev.status, _headers(ev.headers)))
        elif isinstance(ev, Response):
            _add(out, ("response", ev.status, _headers(ev.headers)))
        elif isinstance(ev, Data):
            _add(out, ("data", ev.data))
        else:
            assert isinstance(ev, EndOfMessage)
            _add(out, ("end", _headers(ev.trailers)))
            return True
    return False


def run_ours(chunks: list[bytes]) -> Outcome:
    parser = ResponseParser(max_head=1 << 20)
    out: Outcome = []
    try:
        for chunk in chunks:
            if _ours(out, parser.feed(chunk)):
                return out
        _ours(out, parser.feed_eof())
    except HTTPProtocolError as exc:
        _ours(out, exc.events)
        _add(out, ("error",))
    return out


# -- random responses --------------------------------------------------------------------------------------------

_TCHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-!#$%&'*+.^_`|~"
_TOKEN = st.text(_TCHARS, min_size=1, max_size=12)
_VALUE = st.binary(max_size=20).map(lambda b: bytes(c for c in b if c > 0x20 and c != 0x7F) or b"v")
_SAFE_NAME = _TOKEN.map(str.encode).filter(lambda n: n.lower() not in _FRAMING | {b"connection"})


@st.composite
def header_lines(draw: st.DrawFn) -> list[bytes]:
    lines = []
    for _ in range(draw(st.integers(0, 4))):
        name, value = draw(_SAFE_NAME), draw(_VALUE)
        ows = draw(st.sampled_from([b"", b" ", b"\t ", b"  "]))
        lines.append(name + b":" + ows + value + draw(st.sampled_from([b"", b" "])))
        if draw(st.integers(0, 9)) == 0:  # obsolete line folding
            lines.append(draw(st.sampled_from([b" ", b"\t"])) + draw(_VALUE))
    return lines


@st.composite
def responses(draw: st.DrawFn) -> bytes:
    eol = draw(st.sampled_from([b"\r\n", b"\n"]))
    out = b""
    for _ in range(draw(st.integers(0, 2))):
        status = draw(st.sampled_from([100, 102, 103, 199]))
        out += b"HTTP/1.1 %d Info" % status + eol + b"".join(h + eol for h in draw(header_lines())) + eol
    version = draw(st.sampled_from([b"1.1", b"1.0"]))
    status = draw(st.sampled_from([200, 201, 204, 206, 299, 304, 400, 401, 429, 500, 503, 529, 999]))
    reason = draw(st.sampled_from([b" OK", b"", b" ", b" Too Many\tRequests", b" \xe9t\xe9"]))
    lines = draw(header_lines())
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["chunked", "length", "close", "length-and-chunked"]))
    tail = b""
    if framing in ("chunked", "length-and-chunked"):
        te = draw(st.sampled_from([b"chunked", b"Chunked", b"CHUNKED"]))
        lines.insert(draw(st.integers(0, len(lines))), b"Transfer-Encoding: " + te)
        if framing == "length-and-chunked":
            lines.append(b"Content-Length: %d" % draw(st.integers(0, 50)))
        cuts = sorted(draw(st.sets(st.integers(1, max(1, len(body) - 1)), max_size=4))) if body else []
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True) if body[a:b]]
        for part in parts:
            size = draw(st.sampled_from(["%x", "%X", "0%x"])) % len(part)
            ext = draw(st.sampled_from([b"", b";name=value", b";x", b" "]))
            tail += size.encode() + ext + b"\r\n" + part + b"\r\n"
        tail += b"0\r\n" + b"".join(h + b"\r\n" for h in draw(header_lines())) + b"\r\n"
    elif framing == "length":
        n = len(body)
        lines.append(draw(st.sampled_from([b"Content-Length: %d" % n, b"content-length: %d, %d" % (n, n)])))
        if draw(st.booleans()):
            lines.append(b"Content-Length: %d" % n)
        tail = body
    else:
        tail = body
    if draw(st.booleans()):
        lines.append(draw(st.sampled_from([b"Connection: close", b"connection: keep-alive"])))
    return b"HTTP/" + version + b" %d" % status + reason + eol + b"".join(h + eol for h in lines) + eol + tail


_FAULTS = [
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 20 OK"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 2000 OK"),
    (b"HTTP/1.1 200 OK", b"HTTX/1.1 200 OK"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 200 O\x00K"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 099 OK"),
    (b"HTTP/1.1 200 OK", b"HTTP/1.1 101 Switching"),
    (b"HTTP/1.1 200 OK", b" HTTP/1.1 200 OK"),
    (b"HTTP/1.1 200 OK", b"\r\nHTTP/1.1 200 OK"),
    (b"X-A: 1", b"X-A 1"),
    (b"X-A: 1", b"X-A : 1"),
    (b"X-A: 1", b"X(A): 1"),
    (b"X-A: 1", b"X-A: 1\x00"),
    (b"X-A: 1", b" X-A: 1"),
    (b"Content-Length: 5", b"Content-Length: abc"),
    (b"Content-Length: 5", b"Content-Length: -5"),
    (b"Content-Length: 5", b"Content-Length: 5, 6"),
    (b"Content-Length: 5", b"Content-Length: 5\r\nContent-Length: 6"),
    (b"Content-Length: 5", b"Content-Length: 9"),  # the body ends early: EOF inside it
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip, chunked"),
    (b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"),
    (b"5\r\nhello\r\n", b"zz\r\nhello\r\n"),
    (b"5\r\nhello\r\n", b"5\r\nhelloXY"),
    (b"5\r\nhello\r\n", b"5\r\nhello\n"),
    (b"5\r\nhello\r\n", b"\r\nhello\r\n"),
    (b"5\r\nhello\r\n", b"5 ;x\r\nhello\r\n"),
    (b"5\r\nhello\r\n", b"6\r\nhello\r\n"),
    (b"0\r\n\r\n", b"0\r\nbad trailer\r\n\r\n"),
    (b"0\r\n\r\n", b"0\r\n"),  # EOF where the trailer belongs
]
_BASES = [
    b"HTTP/1.1 200 OK\r\nX-A: 1\r\nContent-Length: 5\r\n\r\nhello",
    b"HTTP/1.1 200 OK\r\nX-A: 1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
]


def _cut(data: bytes, cuts: set[int]) -> list[bytes]:
    points = sorted(c for c in cuts if 0 < c < len(data))
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]


@settings(max_examples=400, deadline=None)
@given(responses(), st.data())
def test_valid_responses_give_h11s_events(raw: bytes, data: st.DataObject) -> None:
    cuts = data.draw(st.sets(st.integers(1, max(1, len(raw) - 1)), max_size=12))
    # Cuts between a CR and its LF stress the parser's scan marks: drawn on purpose, not left to chance.
    after_cr = [i + 1 for i, byte in enumerate(raw) if byte == 0x0D]
    if after_cr:
        cuts |= data.draw(st.sets(st.sampled_from(after_cr), max_size=3))
    chunks = _cut(raw, cuts)
    expected = run_h11(chunks)
    assert run_ours(chunks) == expected
    assert run_ours([raw]) == expected
    assert run_ours(list(_cut(raw, set(range(len(raw)))))) == expected  # a byte at a time


@pytest.mark.parametrize(("old", "new"), _FAULTS)
def test_each_fault_is_refused_as_h11_refuses_it(old: bytes, new: bytes) -> None:
    for base in _BASES:
        if old in base:
            raw = base.replace(old, new, 1)
            for chunks in ([raw], _cut(raw, set(range(len(raw))))):
                got = run_ours(chunks)
                assert got == run_h11(chunks)
                assert got[-1] == ("error",)


@settings(max_examples=400, deadline=None)
@given(responses(), st.data())
def test_random_byte_flips_are_judged_as_h11_judges_them(raw: bytes, data: st.DataObject) -> None:
    flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=3))
    buf = bytearray(raw)
    for at, byte in flips:
        buf[at] = byte
    chunks = _cut(bytes(buf), data.draw(st.sets(st.integers(0, len(buf)), max_size=8)))
    assert run_ours(chunks) == run_h11(chunks)


@settings(max_examples=200, deadline=None)
@given(responses(), st.integers(0, 2000))
def test_truncated_responses_are_judged_as_h11_judges_them(raw: bytes, keep: int) -> None:
    chunks = [raw[:keep]]
    assert run_ours(chunks) == run_h11(chunks)


def test_bounds_on_heads_and_chunk_lines() -> None:
    parser = ResponseParser(max_head=100)
    with pytest.raises(HTTPProtocolError, match="too large"):
        parser.feed(b"HTTP/1.1 200 OK\r\nX: " + b"a" * 200)
    parser = ResponseParser(max_line=10)
    parser.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    with pytest.raises(HTTPProtocolError, match="too long"):
        parser.feed(b"5;" + b"x" * 20)


def test_keep_alive_and_trailing_bytes() -> None:
    p = ResponseParser()
    assert p.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")[-1] == EndOfMessage([])
    assert p.done and p.keep_alive and not p.trailing
    p.feed(b"extra")
    assert p.trailing and not p.keep_alive
    for head in (b"HTTP/1.0 200 OK\r\nContent-Length: 0\r\n\r\n", b"HTTP/1.1 200 OK\r\nConnection: Close\r\n\r\n"):
        p = ResponseParser()
        p.feed(head)
        assert not p.keep_alive


def test_a_chunk_line_cut_at_its_cr_then_a_whole_chunk_then_the_last() -> None:
    """Found by the property above: a scan mark left by a cut chunk line must not outlive that line."""
    raw = b"HTTP/1.1 200\r\nTransfer-Encoding: chunked\r\n\r\n01\r\n\x00\r\n0\r\n\r\n"
    cut = raw.index(b"01\r\n") + 3
    assert run_ours([raw[:cut], raw[cut:]]) == run_h11([raw[:cut], raw[cut:]])
    assert run_ours([raw[:cut], raw[cut:]])[-1] == ("end", [])
