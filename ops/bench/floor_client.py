"""The end-to-end floor: the least work any worker must do for the same streams, measured as a process.

Rule: plain asyncio protocols, no HTTP library, no Redis library, no normalization: one socket per
stream sends the same provider request the worker sends, de-chunks the HTTP/1.1 response, splits SSE
events on blank lines (bytes only), and appends each event with an ``XADD`` packed by hiredis on one Redis
connection, every command queued in a loop tick written in one ``write`` (pipelined across streams).
When a stream's body ends it appends one ``end`` entry, so a reader (``sluice.bench.consumer``) can tell the
stream ended, as a worker's terminal event does. Its CPU per event is the floor the worker's CPU per event
is compared with, in the same run; the end markers (one per stream) are reported apart from the events.

Run: ``python -m sluice.bench.floor_client --base-url URL --dialect D --model-template 'synthetic;...;seed={i}'
--streams N --redis-url URL --prefix P`` with the API key in ``$SLUICE_BENCH_API_KEY``; prints one JSON
line: events, end markers, bytes, wall and CPU seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import re
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import hiredis
import msgspec

from sluice.normalizer.requests import build_request
from sluice.schemas.request import GenerateRequest

__all__ = ["floor_key", "main", "run_floor"]

# hiredis' stub types the argument as a 1-tuple; the alias costs no call per command (a cast() would)
_pack: Callable[[tuple[bytes | str | int, ...]], bytes] = hiredis.pack_command  # type: ignore[assignment]

_BLANK = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def floor_key(prefix: str, i: int) -> str:
    """The stream the floor client appends stream ``i``'s events to."""
    return f"{prefix}:floor:{{s{i}}}"


class _RedisPipe(asyncio.Protocol):
    """Commands queued during a loop tick go out in one write; replies are parsed by hiredis and counted (an
    error reply is kept for the driver to raise). The driver checks the stream lengths afterwards."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.pending: list[bytes] = []
        self.scheduled = False
        self.sent = 0
        self.replies = 0
        self.error: str | None = None
        self.reader = hiredis.Reader()
        self.idle = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while (reply := self.reader.gets()) is not False:
            self.replies += 1
            if isinstance(reply, hiredis.ReplyError) and self.error is None:
                self.error = str(reply)
        if self.replies >= self.sent:
            self.idle.set()

    def queue(self, cmd: bytes) -> None:
        self.pending.append(cmd)
        if not self.scheduled:
            self.scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self.scheduled = False
        assert self.transport is not None
        self.sent += len(self.pending)
        self.idle.clear()
        self.transport.write(b"".join(self.pending))
        self.pending.clear()


class _Stream(asyncio.Protocol):
    def __init__(self, request: bytes, key: bytes, redis: _RedisPipe, done: asyncio.Future[int]) -> None:
        self.request = request
        self.key = key
        self.redis = redis
        self.done = done
        self.buf = b""
        self.sse = b""
        self.headers_done = False
        self.events = 0
        self.ended = False
        self.bytes = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data
        if not self.headers_done:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            if not buf.startswith(b"HTTP/1.1 200"):
                self._finish(RuntimeError(f"provider answered {buf[:40]!r}"))
                return
            self.headers_done = True
            buf = buf[end + 4 :]
        # Chunked transfer coding (RFC 9112 §7.1): "<hex size>\r\n<data>\r\n", ended by a zero-size chunk.
        pos = 0
        while True:
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                self._split(b"")
                # The end marker, one per stream: the reader's cue that this stream ended.
                self.redis.queue(_pack((b"XADD", self.key, b"*", b"end", b"1")))
                self.ended = True
                self._finish(None)
                return
            if len(buf) < eol + 2 + size + 2:
                break
            self._split(buf[eol + 2 : eol + 2 + size])
            pos = eol + 2 + size + 2
        self.buf = buf[pos:]

    def _split(self, payload: bytes) -> None:
        self.bytes += len(payload)
        sse = self.sse + payload
        start = 0
        for m in _BLANK.finditer(sse):
            self.redis.queue(_pack((b"XADD", self.key, b"*", b"data", sse[start : m.start()])))
            self.events += 1
            start = m.end()
        self.sse = sse[start:]

    def _finish(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.transport.close()
        if not self.done.done():
            if exc is None:
                self.done.set_result(self.events)
            else:
                self.done.set_exception(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError("the provider closed the stream early"))


def _http_request(dialect: str, model: str, base_url: str, api_key: str) -> bytes:
    req = msgspec.convert({"messages": [{"role": "user", "content": "benchmark"}]}, GenerateRequest)
    pr = build_request(dialect, req, model=model, api_key=api_key)
    u = urlsplit(base_url)
    lines = [f"{pr.method} {pr.path} HTTP/1.1", f"host: {u.netloc}", f"content-length: {len(pr.body)}"]
    lines += [f"{k}: {v}" for k, v in pr.headers.items() if k.lower() not in ("host", "content-length")]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + pr.body


async def run_floor(
    base_url: str, dialect: str, model_template: str, streams: int, redis_url: str, prefix: str, api_key: str
) -> dict[str, float | int]:
    u = urlsplit(base_url)
    r = urlsplit(redis_url)
    loop = asyncio.get_running_loop()
    requests = [_http_request(dialect, model_template.format(i=i), base_url, api_key) for i in range(streams)]
    _, redis = await loop.create_connection(_RedisPipe, r.hostname or "127.0.0.1", r.port or 6379)
    if (db := (r.path or "/0").lstrip("/") or "0") != "0":
        redis.queue(_pack(("SELECT", db)))
        while redis.replies < 1:  # noqa: ASYNC110 - until "+OK\r\n" arrives
            await asyncio.sleep(0.001)
        redis.replies = redis.sent = 0  # from here on, one reply per XADD
    c0, w0 = time.process_time(), time.perf_counter()
    dones: list[asyncio.Future[int]] = []
    streams_p: list[_Stream] = []
    for i, request in enumerate(requests):
        done: asyncio.Future[int] = loop.create_future()
        key = floor_key(prefix, i).encode()
        _, proto = await loop.create_connection(
            functools.partial(_Stream, request, key, redis, done), u.hostname or "127.0.0.1", u.port or 80
        )
        dones.append(done)
        streams_p.append(proto)
    events = sum(await asyncio.gather(*dones))
    while True:  # wait for every reply
        if redis.pending:
            await asyncio.sleep(0)  # the last flush is scheduled for this tick
        elif redis.replies >= redis.sent:
            break
        else:
            await redis.idle.wait()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    assert redis.transport is not None
    redis.transport.close()
    if redis.error is not None:
        raise RuntimeError(f"Redis refused a floor append: {redis.error[:200]}")
    return {
        "streams": streams,
        "events": events,
        "end_markers": sum(s.ended for s in streams_p),
        "bytes": sum(s.bytes for s in streams_p),
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_us_per_event": cpu / events * 1e6 if events else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.floor_client", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True)
    p.add_argument("--dialect", required=True)
    p.add_argument("--model-template", required=True, help="the scenario; {i} is the stream number")
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--redis-url", required=True)
    p.add_argument("--prefix", required=True)
    args = p.parse_args(argv)
    key = os.environ.get("SLUICE_BENCH_API_KEY", "")
    result = asyncio.run(
        run_floor(args.base_url, args.dialect, args.model_template, args.streams, args.redis_url, args.prefix, key)
    )
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
