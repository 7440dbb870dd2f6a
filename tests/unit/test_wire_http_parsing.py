"""The wire client's HTTP/1.1 response parsing, fed bytes directly (no socket): framing, re-chunking,
decoding, and the typed failures for broken responses."""

from __future__ import annotations

import gzip
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.worker.http.errors import DecodingError, HTTPError, InvalidHeader, RemoteProtocolError
from sluice.worker.http.wire import _Conn, _request_head


class _Transport:
    def __init__(self) -> None:
        self.paused = False
        self.closed = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _conn(max_buffer: int = 1 << 20) -> tuple[_Conn, _Transport]:
    conn = _Conn(None, ("http", "h", 80), max_buffer)  # type: ignore[arg-type]
    t = _Transport()
    conn.connection_made(t)  # type: ignore[arg-type]
    return conn, t


def _chunked(*parts: bytes, trailer: bytes = b"") -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + b"0\r\n" + trailer + b"\r\n"


HEAD_CHUNKED = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
BODY = [b'event: a\ndata: {"x": 1}\n\n', "data: é€😀\n\n".encode(), b"", b"data: " + b"z" * 5000 + b"\n\n"]


def _feed(conn: _Conn, data: bytes, cuts: list[int]) -> None:
    pos = 0
    for cut in sorted(set(cuts)):
        if 0 < cut < len(data):
            conn.data_received(data[pos:cut])
            pos = cut
    conn.data_received(data[pos:])


def test_chunked_body_is_de_framed_with_headers_and_trailers() -> None:
    conn, _ = _conn()
    conn.data_received(HEAD_CHUNKED + _chunked(*[p for p in BODY if p], trailer=b"X-Trailer: 1\r\n"))
    assert conn.status == 200 and conn.head_done and conn.done and conn.keep_alive
    assert conn.headers.get("Content-Type") == "text/event-stream"
    assert bytes(conn.body) == b"".join(BODY)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=6000), max_size=40))
def test_any_rechunking_of_the_bytes_gives_the_same_body(cuts: list[int]) -> None:
    data = HEAD_CHUNKED + _chunked(*[p for p in BODY if p])
    conn, _ = _conn()
    _feed(conn, data, cuts)
    assert conn.done and conn.error is None
    assert bytes(conn.body) == b"".join(BODY)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3000), max_size=20))
def test_gzip_body_is_decoded_at_any_rechunking(cuts: list[int]) -> None:
    payload = b"".join(BODY) * 3
    packed = gzip.compress(payload)
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
    conn, _ = _conn()
    _feed(conn, head + packed, cuts)
    assert conn.done and bytes(conn.body) == payload


def test_deflate_and_close_delimited_bodies() -> None:
    conn, _ = _conn()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Encoding: deflate\r\n\r\n" + zlib.compress(b"hello world"))
    assert not conn.done and not conn.keep_alive  # the body ends with the connection
    conn.eof_received()
    assert conn.done and conn.error is None and bytes(conn.body) == b"hello world"


def test_interim_response_is_skipped() -> None:
    conn, _ = _conn()
    conn.data_received(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\nHTTP/1.1 429 Too Many\r\nRetry-After: 3\r\n")
    assert not conn.head_done
    conn.data_received(b"Content-Length: 2\r\n\r\n{}")
    assert conn.status == 429 and conn.headers.get("retry-after") == "3" and bytes(conn.body) == b"{}"


def test_repeated_headers_are_joined_and_http10_is_not_kept_alive() -> None:
    conn, _ = _conn()
    conn.data_received(b"HTTP/1.0 200 OK\r\nVia: a\r\nvia: b\r\nContent-Length: 0\r\n\r\n")
    assert conn.headers["via"] == "a, b" and conn.done and not conn.keep_alive


@pytest.mark.parametrize(
    ("data", "message", "kind"),
    [
        (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x status line", RemoteProtocolError),
        (HEAD_CHUNKED + b"zz\r\n", "bad chunk size", RemoteProtocolError),
        (HEAD_CHUNKED + b"3\r\nabcXY", "chunk data not followed by CRLF", RemoteProtocolError),
        (HEAD_CHUNKED + b"1" * 5000, "chunk size line too long", RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "bad content-length", RemoteProtocolError),
        (
            b"HTTP/1.1 200 OK\r\nContent-Encoding: br\r\nContent-Length: 1\r\n\r\n",
            "unsupported content-encoding",
            RemoteProtocolError,
        ),
        (b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nnope", "DecodingError", DecodingError),
        (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 70_000, "response head too large", RemoteProtocolError),
        (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line", RemoteProtocolError),
    ],
)
def test_broken_responses_fail_typed_and_close_the_socket(data: bytes, message: str, kind: type[HTTPError]) -> None:
    conn, t = _conn()
    conn.data_received(data)
    assert type(conn.error) is kind and message in str(conn.error)
    assert t.closed and not conn.keep_alive


def test_truncated_chunked_body_is_an_error_not_an_end() -> None:
    conn, _ = _conn()
    conn.data_received(HEAD_CHUNKED + b"5\r\nab")
    conn.eof_received()
    assert not conn.done and isinstance(conn.error, RemoteProtocolError)
    assert bytes(conn.body) == b"ab"  # what arrived is still handed out


def test_reading_pauses_past_the_buffer_bound_and_resumes_when_taken() -> None:
    conn, t = _conn(max_buffer=100)
    conn.data_received(HEAD_CHUNKED + b"50\r\n" + b"a" * 80 + b"\r\n")
    assert not t.paused
    conn.data_received(b"50\r\n" + b"b" * 80 + b"\r\n")
    assert t.paused
    assert conn.take() == b"a" * 80 + b"b" * 80 and not t.paused and not conn.body


def test_bytes_after_the_body_spoil_reuse() -> None:
    conn, _ = _conn()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA")
    assert conn.done and bytes(conn.body) == b"ok" and not conn.keep_alive


def test_request_head_refuses_header_injection_and_sets_framing() -> None:
    head = _request_head("POST", "/v1/x?alt=sse", "h:8080", {"X-A": "1", "Content-Length": "9"}, 12)
    text = head.decode()
    assert text.startswith("POST /v1/x?alt=sse HTTP/1.1\r\nhost: h:8080\r\n")
    assert "content-length: 12\r\n" in text and "Content-Length: 9" not in text
    assert "accept-encoding: identity" in text and text.endswith("\r\n\r\n")
    with pytest.raises(InvalidHeader, match="InvalidHeader"):
        _request_head("POST", "/", "h", {"X-A": "1\r\nX-Injected: 1"}, 0)


def test_no_content_has_no_body_even_without_a_length() -> None:
    conn, _ = _conn()
    conn.data_received(b"HTTP/1.1 204 No Content\r\nDate: x\r\n\r\n")
    assert conn.done and conn.keep_alive and not conn.body


def test_a_gzip_bomb_is_inflated_only_as_the_reader_takes_room() -> None:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    packed = z.compress(b"data: ") + b"".join(z.compress(b"a" * (1 << 20)) for _ in range(50)) + z.flush()
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
    conn, t = _conn(max_buffer=32 * 1024)
    conn.data_received(head + packed)
    assert len(conn.body) <= 32 * 1024 and t.paused and not conn.done
    total = 0
    while conn.body or not conn.done:  # as WireResponse.receive reads: what is buffered, then the end
        piece = conn.take()
        assert 0 < len(piece) <= 32 * 1024
        total += len(piece)
    assert total == 6 + 50 * (1 << 20) and not t.paused


def test_a_compressed_body_cut_short_is_an_error() -> None:
    packed = gzip.compress(b"x" * 1000)[:-12]
    head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(packed)
    conn, _ = _conn()
    conn.data_received(head + packed)
    assert isinstance(conn.error, DecodingError) and "ended early" in str(conn.error)
