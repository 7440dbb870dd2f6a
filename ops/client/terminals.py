"""The terminal feed: one entry per finished request, read across every terminal shard as one consumer of a
consumer group (``SluiceClient.terminals()``).

Rule: each shard's terminal stream is read by its own reader (on a cluster one command serves one slot),
with Redis consumer-group semantics: an entry is delivered to one consumer of the group and stays in that
consumer's pending list until it is acknowledged (``ack``). A reader first re-reads its own pending entries
(id ``0``: delivered before, e.g. to a process that died or a reply lost to a failover), then new ones
(``>``); after a Redis error it starts over the same way, so nothing is skipped (delivery is at least
once: an entry whose ack was lost comes again). Entries other consumers of the group left pending longer
than ``claim_idle_ms`` are claimed (``XAUTOCLAIM``). A group that vanished (Redis restarted without its
data) is created again at ``start``. The same thing from any language: for each shard stream
``XGROUP CREATE <stream> <group> 0 MKSTREAM``, then ``XREADGROUP GROUP <group> <consumer> COUNT n BLOCK ms
STREAMS <stream> 0`` until it returns nothing, then with ``>``; ``XACK <stream> <group> <id>`` after each
entry is handled.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import cast

import anyio
import msgspec
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from redis.exceptions import RedisError, ResponseError

from sluice.schemas.keys import Keys
from sluice.schemas.replies import StreamEntry, read_entries
from sluice.worker.redis.connect import AnyRedis
from sluice.worker.redis.retry import describe

__all__ = ["Terminal", "TerminalFeed"]

log = logging.getLogger("sluice.client")
_ERRORS = (RedisError, OSError)


def _s(v: bytes | None) -> str:
    return v.decode() if v is not None else ""


@dataclass(frozen=True, slots=True)
class Terminal:
    """One terminal-stream entry: how a request ended. ``stream`` and ``entry_id`` locate it (for ``ack``)."""

    request_id: str
    status: str  # one of sluice.schemas.states.TERMINAL_STATES, as the entry holds it
    stop_reason: str
    error_category: str
    attempt: int
    raw_count: int
    event_count: int
    result_hash: str
    metadata: dict[str, str]
    durability: str  # "" (durability = primary), replica, unconfirmed
    stream: str
    entry_id: str
    fields: dict[str, str] = field(default_factory=dict)  # the entry as stored
    usage_reported: bool | None = None  # None: written before cost existed
    cost: str = ""  # a decimal string, "" when no price applied (or no usage was reported)
    currency: str = ""
    prices_version: str = ""

    @classmethod
    def from_entry(cls, stream: str, entry_id: str, raw: dict[bytes, bytes]) -> Terminal:
        f = {k.decode(): v.decode(errors="replace") for k, v in raw.items()}
        try:
            metadata = msgspec.json.decode(f.get("metadata") or "{}", type=dict[str, str])
        except msgspec.DecodeError:
            metadata = {}

        def num(name: str) -> int:
            v = f.get(name, "")
            return int(v) if v.isdigit() else 0

        return cls(
            request_id=f.get("request_id", ""),
            status=f.get("status", ""),
            stop_reason=f.get("stop_reason", ""),
            error_category=f.get("error_category", ""),
            attempt=num("attempt"),
            raw_count=num("raw_count"),
            event_count=num("event_count"),
            result_hash=f.get("result_hash", ""),
            metadata=metadata,
            durability=f.get("durability", ""),
            stream=stream,
            entry_id=entry_id,
            fields=f,
            usage_reported=f["usage_reported"] == "1" if "usage_reported" in f else None,
            cost=f.get("cost", ""),
            currency=f.get("currency", ""),
            prices_version=f.get("prices_version", ""),
        )


class TerminalFeed:
    """``async with client.terminals("billing", "billing-1") as feed: async for t in feed: ...; await
    feed.ack(t)``. Raises the client's Redis errors only from ``__aenter__`` (creating the groups); later
    Redis errors are waited out by the readers."""

    def __init__(
        self,
        redis: AnyRedis,
        keys: Keys,
        group: str,
        consumer: str,
        *,
        start: str = "0",
        count: int = 100,
        block_ms: int = 1000,
        claim_idle_ms: int | None = 60_000,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.group = group
        self.consumer = consumer
        self.start = start
        self.count = count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self._delivered: set[tuple[str, str]] = set()  # handed out, not acked yet: not handed out twice
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[Terminal] | None = None
        self._recv: MemoryObjectReceiveStream[Terminal] | None = None
        self.redis_errors = 0

    @property
    def streams(self) -> list[str]:
        return [shard.terminal for shard in self.keys.shards]

    async def __aenter__(self) -> TerminalFeed:
        for stream in self.streams:
            try:
                await self.redis.xgroup_create(stream, self.group, id=self.start, mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._send, self._recv = anyio.create_memory_object_stream[Terminal](max_buffer_size=self.count)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        for stream in self.streams:
            self._tg.start_soon(self._read, stream, self._send.clone())
        await self._send.aclose()  # the readers hold their clones
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None and self._recv is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(et, exc, tb)
        finally:
            await self._recv.aclose()

    def __aiter__(self) -> AsyncIterator[Terminal]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Terminal]:
        assert self._recv is not None, "use `async with client.terminals(...) as feed`"
        async for terminal in self._recv:
            yield terminal

    async def ack(self, terminal: Terminal) -> None:
        """Acknowledge an entry: it leaves this consumer's pending list (a lost ack only means it comes again)."""
        await self.redis.xack(terminal.stream, self.group, terminal.entry_id)
        self._delivered.discard((terminal.stream, terminal.entry_id))

    async def _read(self, stream: str, send: MemoryObjectSendStream[Terminal]) -> None:
        async with send:
            cursor = "0"  # own pending entries first; ">" once they are all handed out
            next_claim = anyio.current_time()
            delay = 0.05
            while True:
                try:
                    if self.claim_idle_ms is not None and anyio.current_time() >= next_claim:
                        next_claim = anyio.current_time() + max(0.05, self.claim_idle_ms / 2000)
                        await self._claim(stream, send)
                    block = None if cursor != ">" else self.block_ms
                    entries = read_entries(
                        await self.redis.xreadgroup(
                            self.group,
                            self.consumer,
                            {stream: cursor},
                            count=self.count,
                            block=block,
                        )
                    )
                except _ERRORS as exc:
                    self.redis_errors += 1
                    log.warning("terminal feed: reading %s failed (%s); retrying", stream, describe(exc))
                    cursor = "0"  # a reply may have been lost: its entries are pending here now
                    if isinstance(exc, ResponseError) and "NOGROUP" in str(exc):
                        await self._recreate(stream)
                    await anyio.sleep(delay)
                    delay = min(delay * 2, 2.0)
                    continue
                delay = 0.05
                if cursor != ">":
                    if not entries:
                        cursor = ">"
                        continue
                    cursor = entries[-1][0].decode()
                await self._hand_out(stream, entries, send)

    async def _recreate(self, stream: str) -> None:
        """The group is gone (a Redis restarted empty, or a failover to a replica without it): create it
        again at ``start``, so the feed resumes instead of failing every read."""
        try:
            await self.redis.xgroup_create(stream, self.group, id=self.start, mkstream=True)
            log.warning("terminal feed: the group %s on %s was gone; created it again", self.group, stream)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        except _ERRORS:
            pass  # Redis is still away: the next read fails and tries again

    async def _claim(self, stream: str, send: MemoryObjectSendStream[Terminal]) -> None:
        start = "0-0"
        while True:
            res = await self.redis.xautoclaim(
                stream, self.group, self.consumer, cast(int, self.claim_idle_ms), start_id=start, count=self.count
            )
            await self._hand_out(stream, cast(list[StreamEntry], res[1]), send)
            start = res[0].decode() if isinstance(res[0], bytes) else str(res[0])
            if start == "0-0":
                return

    async def _hand_out(self, stream: str, entries: list[StreamEntry], send: MemoryObjectSendStream[Terminal]) -> None:
        for entry_id, raw in entries:
            key = (stream, entry_id.decode())
            if not raw:  # trimmed from the stream while pending: nothing left to hand out
                await self.redis.xack(stream, self.group, key[1])
                continue
            if key in self._delivered:
                continue
            self._delivered.add(key)
            await send.send(Terminal.from_entry(stream, key[1], raw))
