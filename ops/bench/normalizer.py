"""Part 1 of ``sluice bench``: normalizer throughput per dialect, against the floor and the official SDKs,
on the same bytes in the same run.

Rule: every path gets the same pre-cut chunks (cutting is not timed) and is checked for correctness on
them before it is timed (sluice: every stream completed with the script's text and tool arguments; floor:
one decoded payload per data event; SDK: the final accumulated text and arguments), so a number always
belongs to a path that did the whole job. Each path runs ``repeat`` times after one warm-up; the best
wall time and the best process CPU time are kept (the least disturbed runs on a shared machine). Ratios
are computed from CPU time per provider event.

- ``sluice``: ``Normalizer.feed`` (WHATWG framing + adapter + state machine) and ``encode_event`` of every
  contract event, then ``close`` and the assembled ``result()``, one Normalizer per response.
- ``floor``: byte-level SSE split plus ``msgspec.json.decode`` of each data payload, nothing else; for AWS
  event-stream (Bedrock) the frame split by the prelude's lengths, both CRCs checked and the
  ``:event-type`` value located (what a correct consumer must do), plus the payload's decode.
- ``sdk``: the official SDK's decoder and accumulation (``sluice.bench.sdk``).
"""

from __future__ import annotations

import gc
import json
import re
import struct
import time
from binascii import crc32
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from sluice.bench.sdk import SDK_NAMES, SdkDriver, sdk_driver
from sluice.bench.synth import Corpus, SynthStream
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import BlockDelta, StreamDone, encode_event

__all__ = [
    "DialectResult",
    "PathTiming",
    "check_floor",
    "check_sdk",
    "check_sluice",
    "floor_stream",
    "frame_floor_stream",
    "measure",
    "run_dialect",
    "sluice_stream",
]

_BLANK = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_EOL = re.compile(rb"\r\n|\r|\n")
_DONE = b"[DONE]"
_PRELUDE = struct.Struct(">III")
_U32 = struct.Struct(">I")
_U16 = struct.Struct(">H")
# The :event-type header's name and its value type (7, string), as every message of a ConverseStream
# response lays it out.
_EVENT_TYPE = b"\x0b:event-type\x07"


class BenchCheckFailed(RuntimeError):
    """A measured path produced the wrong output: its numbers would mean nothing."""


# -- the paths -----------------------------------------------------------------------------------------


def sluice_stream(dialect: str, chunks: Iterable[bytes]) -> tuple[int, list[bytes] | None]:
    """One response through sluice; returns (contract events, None). The encoded bytes are dropped, as a
    worker hands them to Redis and forgets them."""
    norm = Normalizer(dialect, StreamInfo("bench:1", "bench", "", dialect))
    n = 0
    for chunk in chunks:
        for ev in norm.feed(chunk, 0).events:
            encode_event(ev)
            n += 1
    for ev in norm.close(0):
        encode_event(ev)
        n += 1
    norm.result()
    return n, None


def floor_stream(chunks: Iterable[bytes]) -> int:
    """Byte-level SSE split + ``msgspec.json.decode`` of each data payload; returns payloads decoded."""
    decode = msgspec.json.decode
    buf = b""
    n = 0
    for chunk in chunks:
        buf += chunk
        start = 0
        for m in _BLANK.finditer(buf):
            event = buf[start : m.start()]
            start = m.end()
            data = [line[5:] for line in _EOL.split(event) if line[:5] == b"data:"]
            if not data:
                continue
            payload = b"\n".join(d[1:] if d[:1] == b" " else d for d in data)
            if payload != _DONE:
                decode(payload)
                n += 1
        if start:
            buf = buf[start:]
    return n


def frame_floor_stream(chunks: Iterable[bytes]) -> int:
    """AWS event-stream, the least a correct consumer must do per message: split by the prelude's total
    length, check the prelude CRC (before believing the lengths) and the message CRC (the framing spec
    terminates the stream on either mismatch), locate the ``:event-type`` header's value (what the payload
    is; a message without one is an exception or error, decoded all the same), ``msgspec.json.decode`` the
    payload. Returns payloads decoded; raises ``ValueError`` on a CRC mismatch.

    It does not parse the other headers, check their types or the lengths' plausibility, bound the frame
    size, or keep the frame's bytes beyond the one slice (sluice does all of that)."""
    decode = msgspec.json.decode
    unpack, u32, u16 = _PRELUDE.unpack_from, _U32.unpack_from, _U16.unpack_from
    buf = b""
    n = 0
    for chunk in chunks:
        buf += chunk
        start = 0
        while len(buf) - start >= 12:
            total, headers, prelude_crc = unpack(buf, start)
            if crc32(buf[start : start + 8]) != prelude_crc:
                raise ValueError("prelude CRC mismatch")
            if len(buf) - start < total:
                break
            frame = buf[start : start + total]
            if crc32(frame[:-4]) != u32(frame, total - 4)[0]:
                raise ValueError("message CRC mismatch")
            end = 12 + headers
            at = frame.find(_EVENT_TYPE, 12, end)
            if at >= 0:
                at += len(_EVENT_TYPE)
                frame[at + 2 : at + 2 + u16(frame, at)[0]]  # the event's name, as a consumer dispatches on it
            decode(frame[end:-4])
            n += 1
            start += total
        if start:
            buf = buf[start:]
    return n


def _floor(stream: SynthStream) -> int:
    return frame_floor_stream(stream.chunks) if stream.eventstream else floor_stream(stream.chunks)


# -- correctness checks (not timed) ---------------------------------------------------------------------


def check_sluice(dialect: str, stream: SynthStream) -> int:
    """Run one response through sluice keeping the events; raise ``BenchCheckFailed`` unless it completed
    with exactly the script's text and tool arguments. Returns the contract events."""
    norm = Normalizer(dialect, StreamInfo("bench:1", "bench", "", dialect))
    events = [ev for chunk in stream.chunks for ev in norm.feed(chunk, 0).events]
    events += norm.close(0)
    for ev in events:
        encode_event(ev)
    text = "".join(e.delta.text for e in events if isinstance(e, BlockDelta) and e.block.kind == "text")
    result = norm.result()
    args = [b.arguments for b in result.blocks if b.kind == "tool_call"]
    expected = [json.loads(t.arguments) for t in stream.tool_calls]
    if not isinstance(events[-1], StreamDone) or text != stream.text or args != expected:
        raise BenchCheckFailed(f"sluice {dialect}: wrong output for response {stream.script.id}: {events[-1]!r}")
    return len(events)


def check_floor(stream: SynthStream) -> int:
    n = _floor(stream)
    # Every data event is a JSON payload except OpenAI chat's [DONE].
    expected = stream.sse_events - (1 if stream.body.endswith(b"data: [DONE]\n\n") else 0)
    if n != expected:
        raise BenchCheckFailed(f"floor: decoded {n} payloads, expected {expected}")
    return n


def check_sdk(driver: SdkDriver, name: str, stream: SynthStream) -> int:
    n, text, tools = driver(stream.chunks)
    got = [json.loads(t) if isinstance(t, str) else t for t in tools]
    expected = [json.loads(t.arguments) for t in stream.tool_calls]
    if text != stream.text or got != expected:
        raise BenchCheckFailed(f"{name}: wrong accumulated message for response {stream.script.id}")
    return n


# -- timing ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PathTiming:
    path: str  # sluice | floor | sdk
    name: str  # what exactly ran
    runs: int
    wall_s: float  # best of runs
    cpu_s: float  # best of runs (process CPU: user + system)
    wall_all: list[float] = field(default_factory=list)
    cpu_all: list[float] = field(default_factory=list)
    output_events: int = 0  # what the path yielded (contract events, payloads, SDK events) per pass

    def per_event_us(self, events: int) -> float:
        return self.cpu_s / events * 1e6 if events else 0.0


def measure(path: str, name: str, fn: Callable[[], int], repeat: int, *, warmup: bool = True) -> PathTiming:
    """One warm-up call (unless the caller just ran the path), then ``repeat`` timed calls; keeps the best
    wall and the best CPU time."""
    out = fn() if warmup else -1
    walls: list[float] = []
    cpus: list[float] = []
    last = 0
    for _ in range(max(1, repeat)):
        gc.collect()
        c0, w0 = time.process_time(), time.perf_counter()
        last = fn()
        w1, c1 = time.perf_counter(), time.process_time()
        walls.append(w1 - w0)
        cpus.append(c1 - c0)
    return PathTiming(path, name, len(walls), min(walls), min(cpus), walls, cpus, out if warmup else last)


@dataclass(slots=True)
class DialectResult:
    dialect: str
    streams: int
    bytes: int
    sse_events: int
    chunks: int
    contract_events: int
    paths: dict[str, PathTiming]

    def row(self, path: str) -> dict[str, float] | None:
        t = self.paths.get(path)
        if t is None:
            return None
        # Throughput both ways: per wall second (what a caller waits) and per CPU second (what a shared,
        # busy machine cannot inflate).
        return {
            "wall_s": t.wall_s,
            "cpu_s": t.cpu_s,
            "mb_per_s": self.bytes / 1e6 / t.wall_s if t.wall_s else 0.0,
            "events_per_s": self.sse_events / t.wall_s if t.wall_s else 0.0,
            "mb_per_cpu_s": self.bytes / 1e6 / t.cpu_s if t.cpu_s else 0.0,
            "events_per_cpu_s": self.sse_events / t.cpu_s if t.cpu_s else 0.0,
            "us_per_event": t.per_event_us(self.sse_events),
        }

    def ratio(self, slower: str, faster: str) -> float | None:
        """How many times ``faster`` beats ``slower`` on CPU per event (None if either is missing)."""
        a, b = self.paths.get(slower), self.paths.get(faster)
        if a is None or b is None or not b.cpu_s:
            return None
        return a.cpu_s / b.cpu_s

    def to_json(self) -> dict[str, Any]:
        return {
            "dialect": self.dialect,
            "streams": self.streams,
            "bytes": self.bytes,
            "sse_events": self.sse_events,
            "chunks": self.chunks,
            "contract_events": self.contract_events,
            "paths": {k: {**asdict(v), **(self.row(k) or {})} for k, v in self.paths.items()},
            "ratios": {
                "sdk_over_sluice": self.ratio("sdk", "sluice"),
                "sluice_over_floor": self.ratio("sluice", "floor"),
                "sdk_over_floor": self.ratio("sdk", "floor"),
            },
        }


def run_dialect(
    corpus: Corpus,
    *,
    repeat: int = 3,
    sdk_repeat: int | None = None,
    with_sdk: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> DialectResult:
    """Check, then time, every path on ``corpus``. Raises ``BenchCheckFailed``."""
    dialect = corpus.dialect
    streams = corpus.streams
    progress(f"{dialect}: checking outputs")
    contract = sum(check_sluice(dialect, s) for s in streams)
    for s in streams:
        check_floor(s)
    driver = sdk_driver(dialect) if with_sdk else None
    sdk_name = SDK_NAMES.get(dialect, "")
    if driver is not None:
        for s in streams:
            check_sdk(driver, sdk_name, s)

    def sluice_all() -> int:
        return sum(sluice_stream(dialect, s.chunks)[0] for s in streams)

    def floor_all() -> int:
        return sum(_floor(s) for s in streams)

    paths: dict[str, PathTiming] = {}
    progress(f"{dialect}: timing floor")
    # The checks above ran every path once on the same bytes: that was the warm-up.
    floor_name = (
        "frame split (2 CRCs, :event-type) + msgspec.json.decode"
        if streams[0].eventstream
        else "SSE split + msgspec.json.decode"
    )
    paths["floor"] = measure("floor", floor_name, floor_all, repeat, warmup=False)
    progress(f"{dialect}: timing sluice")
    paths["sluice"] = measure("sluice", "sluice Normalizer + encode_event", sluice_all, repeat, warmup=False)
    if driver is not None:
        sdk = driver

        def sdk_all() -> int:
            return sum(sdk(s.chunks)[0] for s in streams)

        progress(f"{dialect}: timing {sdk_name}")
        paths["sdk"] = measure("sdk", sdk_name, sdk_all, sdk_repeat or repeat, warmup=False)
    return DialectResult(dialect, len(streams), corpus.bytes, corpus.sse_events, corpus.chunks, contract, paths)
