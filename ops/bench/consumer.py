"""The benchmark's consumer process: reads every normalized stream of a run as a client would, and measures
added latency from the fake provider's send stamps.

Rule: one process, one Redis connection, blocking ``XREAD`` over every request's event stream that has
not yet ended; each entry is counted when it arrives. A text delta served with ``stamp=1`` starts with
``⏱<unix µs>|`` written by the fake provider just before it sent the event, so receive time minus stamp
is the latency the whole pipeline added (provider send -> worker -> Redis -> this reader). Same machine,
same clock. A stream ends at its ``stream.done`` / ``stream.error``. The floor client's streams
(``sluice.bench.floor_client``) are read the same way: an entry with a ``data`` field and no ``type`` is one
raw provider event, timed from its stamp like a delta, and an ``end`` entry ends its stream. Prints
``ready`` once connected, then one JSON document with the counts and latency percentiles when every
stream ended (or the deadline passed).

Run: ``python -m sluice.bench.consumer --redis-url URL --keys-file FILE [--deadline S]``; the file lists one
events-stream key per line.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import redis
from redis.typing import KeyT, StreamIdT

from sluice.schemas.replies import read_batches

__all__ = ["STAMP", "main", "parse_stamp", "percentiles", "read_streams", "read_streams_cluster"]

STAMP = "⏱".encode()
_TERMINAL = (b"stream.done", b"stream.error")
_FLOOR = b"floor"  # by_type's name for a floor client's raw provider event


def parse_stamp(event_json: bytes) -> int | None:
    """The send time (unix µs) stamped at the start of a delta's text, or None if the event has none."""
    i = event_json.find(STAMP)
    if i < 0:
        return None
    digits = event_json[i + len(STAMP) : i + len(STAMP) + 16]
    if len(digits) != 16 or not digits.isdigit() or event_json[i + len(STAMP) + 16 : i + len(STAMP) + 17] != b"|":
        return None
    return int(digits)


def percentiles(values: list[float], points: tuple[float, ...] = (50, 90, 99, 99.9)) -> dict[str, float]:
    """Nearest-rank percentiles plus max and mean; empty input gives an empty dict."""
    if not values:
        return {}
    s = sorted(values)
    out = {f"p{p:g}": s[min(len(s) - 1, max(0, int(-(-p * len(s) // 100)) - 1))] for p in points}
    out["max"] = s[-1]
    out["mean"] = sum(s) / len(s)
    out["count"] = len(s)
    return out


class _Tally:
    """What the consumer counts, fed one read's entries at a time (single-instance or cluster reader)."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.counts: dict[str, int] = {}
        self.terminals: dict[str, int] = {}
        self.latencies: list[int] = []
        self.first_delta: list[int] = []
        self.seen_delta: set[str] = set()
        self.last_stamp: dict[str, int] = {}  # floor streams: the last delta's stamp
        self.started: set[str] = set()
        self.finished = 0
        self.timeline: list[tuple[float, int]] = []  # (unix time, streams started and not yet ended), ~100 ms
        self.first_recv = self.last_recv = 0.0
        self.events = 0
        self.reads = 0
        self.c0 = time.process_time()

    def feed(self, key: str, entries: list[tuple[bytes, dict[bytes, bytes]]], now: float, now_us: int) -> str | None:
        """Count one stream's new entries; returns the position to read after, or None once it ended."""
        if not self.first_recv:
            self.first_recv = now
        self.last_recv = now
        self.started.add(key)
        pos: str | None = None
        for entry_id, fields in entries:
            typ = fields.get(b"type")
            raw = fields.get(b"data") if typ is None else None  # a floor client's raw provider event
            stamp: int | None = None
            label: str | None = None  # set when the entry ends its stream
            if typ is None and b"end" in fields:  # the floor client's end marker: not an event
                label = "end"
            else:
                typ = typ if typ is not None else _FLOOR if raw is not None else b""
                self.events += 1
                self.counts[typ.decode()] = self.counts.get(typ.decode(), 0) + 1
            if typ == b"block.delta":
                stamp = parse_stamp(fields.get(b"event", b""))
            elif raw is not None:
                stamp = parse_stamp(raw)
                # A summary event (Responses' .done / completed) repeats the deltas' stamps, the first
                # one first: only a stamp newer than the stream's last delta is a delta's own.
                if stamp is not None and stamp <= self.last_stamp.get(key, 0):
                    stamp = None
                elif stamp is not None:
                    self.last_stamp[key] = stamp
            elif typ in _TERMINAL:
                doc = msgspec.json.decode(fields[b"event"])
                status = doc.get("status", "completed") if typ == b"stream.error" else "completed"
                category = (doc.get("error") or {}).get("category", "") if typ == b"stream.error" else ""
                label = status + (f"/{category}" if category else "")
            if label is not None:
                self.terminals[label] = self.terminals.get(label, 0) + 1
                self.finished += 1
                return None
            if stamp is not None:
                self.latencies.append(now_us - stamp)
                if key not in self.seen_delta:
                    self.seen_delta.add(key)
                    self.first_delta.append(now_us - stamp)
            pos = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
        return pos

    def tick(self, now: float, finished_before: int) -> None:
        if not self.timeline or now - self.timeline[-1][0] >= 0.1:
            # Streams in flight during this read: those that ended in it count (a fast stream may start
            # and end within one read).
            self.timeline.append((now, len(self.started) - finished_before))

    def result(self, unfinished: int) -> dict[str, Any]:
        return {
            "streams": len(self.keys),
            "unfinished": unfinished,
            "events": self.events,
            "by_type": self.counts,
            "terminals": self.terminals,
            "first_recv": self.first_recv,
            "last_recv": self.last_recv,
            "reads": self.reads,
            "inflight_timeline": self.timeline,
            "cpu_s": time.process_time() - self.c0,
            "latency_us": percentiles([float(x) for x in self.latencies]),
            "first_delta_latency_us": percentiles([float(x) for x in self.first_delta]),
        }


def read_streams(
    r: redis.Redis, keys: list[str], deadline_s: float, stop: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """Follow ``keys`` until each has its terminal event (a floor stream: its end marker), ``deadline_s``
    passes or ``stop()`` says so."""
    # Typed as redis-py's xread() takes it (Dict[KeyT, StreamIdT]; a dict[str, str] is not one: dicts are
    # invariant).
    pos: dict[KeyT, StreamIdT] = dict.fromkeys(keys, "0-0")
    tally = _Tally(keys)
    end = time.monotonic() + deadline_s
    while pos and time.monotonic() < end and not stop():
        resp = read_batches(r.xread(pos, count=1000, block=500))
        tally.reads += 1
        if not resp:
            continue
        now = time.time()
        now_us = time.time_ns() // 1000
        finished_before = tally.finished
        for key_b, entries in resp:
            key = key_b.decode()
            after = tally.feed(key, entries, now, now_us)
            if after is None:
                pos.pop(key, None)
            else:
                pos[key] = after
        tally.tick(now, finished_before)
    return tally.result(len(pos))


async def read_streams_cluster(
    url: str, keys: list[str], deadline_s: float, stop: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """The same on a Redis Cluster, where one XREAD serves one slot: a blocking XREAD per stream, each on a
    connection of its own (what a relay does per followed request)."""
    import anyio

    from sluice.worker.redis.connect import connect

    rc = connect(url, cluster=True, max_connections=len(keys) + 16)
    await rc.initialize()
    tally = _Tally(keys)
    left = set(keys)

    async def follow(key: str) -> None:
        pos = "0-0"
        while not stop():
            resp = read_batches(await rc.xread({key: pos}, count=1000, block=500))
            tally.reads += 1
            if not resp:
                continue
            now = time.time()
            finished_before = tally.finished
            after = tally.feed(key, resp[0][1], now, time.time_ns() // 1000)
            tally.tick(now, finished_before)
            if after is None:
                left.discard(key)
                return
            pos = after

    with anyio.move_on_after(deadline_s):
        async with anyio.create_task_group() as tg:
            for key in keys:
                tg.start_soon(follow, key)
    await rc.aclose()
    return tally.result(len(left))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.consumer", description=__doc__.split("\n\n")[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--keys-file", required=True)
    p.add_argument("--deadline", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--cluster", action="store_true", help="the URL names a node of a Redis Cluster")
    args = p.parse_args(argv)
    keys = [k for k in Path(args.keys_file).read_text().split("\n") if k]
    # SIGTERM (the driver saw the worker die) ends the reading early; what was counted is still reported.
    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _: stopped.append(signum))
    if args.cluster:
        import anyio

        print("ready", flush=True)
        result = anyio.run(read_streams_cluster, args.redis_url, keys, args.deadline, lambda: bool(stopped))
    else:
        r = redis.Redis.from_url(args.redis_url)
        r.ping()
        print("ready", flush=True)
        result = read_streams(r, keys, args.deadline, lambda: bool(stopped))
        r.close()
    result["stopped_early"] = bool(stopped)
    sys.stdout.write(msgspec.json.encode(result).decode() + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
