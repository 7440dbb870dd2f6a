"""``sluice bench http``: what reading an HTTP/1.1 chunked SSE body costs per event, by parser, fed as a
socket feeds the wire client (one chunk per read, as a paced stream arrives; or 64 KiB reads, flat out).

Rule: every path must hand out exactly the body's bytes (checked each run); the best of ``repeat`` runs is
kept (least disturbed by whatever else the machine runs). Paths: the wire client's connection (parser,
decoding, buffer and wake-ups: what the worker pays), ``worker/http/http1.py`` alone, h11 (httpx's parser) and
httptools (llhttp, uvicorn's) when installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from sluice.worker.http.http1 import Data, ResponseParser
from sluice.worker.http.wire import _Conn

__all__ = ["HttpParseResult", "run_http_parse"]

_EVENT = (
    b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta",'
    b'"text":"' + b"lorem ipsum dolor sit amet " * 5 + b'"}}\n\n'
)
_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@dataclass(frozen=True, slots=True)
class HttpParseResult:
    path: str
    reads: str  # "chunk per read" | "64 KiB reads"
    us_per_event: float

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reads": self.reads, "us_per_event": self.us_per_event}


class _Transport:
    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def is_closing(self) -> bool:
        return False


def _reads(events: int, bulk: bool) -> list[bytes]:
    chunk = b"%x\r\n%s\r\n" % (len(_EVENT), _EVENT)
    if not bulk:
        return [_HEAD, *([chunk] * events), b"0\r\n\r\n"]
    data = _HEAD + chunk * events + b"0\r\n\r\n"
    return [data[i : i + 65536] for i in range(0, len(data), 65536)]


def _wire(reads: list[bytes]) -> int:
    conn = _Conn(cast(asyncio.AbstractEventLoop, None), ("http", "h", 80), 32 * 1024)
    conn.connection_made(cast(asyncio.Transport, _Transport()))
    got = 0
    for r in reads:
        conn.data_received(r)
        got += len(conn.take())
    return got


def _http1(reads: list[bytes]) -> int:
    parser, got = ResponseParser(), 0
    for r in reads:
        for ev in parser.feed(r):
            if type(ev) is Data:
                got += len(ev.data)
    return got


def _h11(reads: list[bytes]) -> int:
    import h11

    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("host", "h"), ("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    got = 0
    for r in reads:
        conn.receive_data(r)
        while (ev := conn.next_event()) is not h11.NEED_DATA:
            if type(ev) is h11.Data:
                got += len(ev.data)
            elif type(ev) is h11.EndOfMessage:
                break
    return got


def _httptools() -> Callable[[list[bytes]], int] | None:
    try:
        import httptools  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None

    def run(reads: list[bytes]) -> int:
        body = [0]

        class _Sink:
            def on_body(self, data: bytes) -> None:
                body[0] += len(data)

        parser = httptools.HttpResponseParser(_Sink())
        for r in reads:
            parser.feed_data(r)
        return body[0]

    return run


def run_http_parse(*, events: int, repeat: int, progress: Callable[[str], object] = print) -> list[HttpParseResult]:
    paths: dict[str, Callable[[list[bytes]], int]] = {
        "wire client (http1 + connection)": _wire,
        "http1 parser alone": _http1,
        "h11": _h11,
    }
    if (ht := _httptools()) is not None:
        paths["httptools"] = ht
    else:
        progress("httptools is not installed: its row is skipped (pip install httptools)")
    out = []
    for bulk in (False, True):
        reads = _reads(events, bulk)
        label = "64 KiB reads" if bulk else "chunk per read"
        for name, fn in paths.items():
            best = float("inf")
            for _ in range(repeat):
                t = time.perf_counter()
                got = fn(reads)
                best = min(best, time.perf_counter() - t)
                if got != len(_EVENT) * events:
                    raise RuntimeError(f"{name} handed out {got} body bytes, not {len(_EVENT) * events}")
            out.append(HttpParseResult(name, label, best / events * 1e6))
    return out
