"""The fan-out hub: one Redis reader per request, shared by every client of that request.

Rule: a request's event stream is read by exactly one reader task (a blocking ``XREAD`` loop) while at
least one client follows it, however many clients there are; the reader hands each entry to every
client's bounded buffer without waiting for any client, so a slow client never slows Redis reading or
the other clients: the one whose buffer is full is cut off (its response is cancelled, the reason
logged). A client joining late or resuming from a position first catches up with its own paged
``XRANGE`` up to the reader's position at the moment it joined (its "floor"; everything after the floor
reaches it through its buffer), so it gets exactly the events after its position, once each, in order.
The reader ends the request's stream after the terminal event of the final attempt, decided like
``SluiceClient.events()``: the status hash's ``attempt`` is this attempt and its ``state`` is terminal
(a later attempt means it was not final). The last client to leave cancels the reader: nothing is kept.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.schemas.events import decode_event
from sluice.schemas.keys import Keys, RequestKeys
from sluice.schemas.replies import StreamEntry, range_entries, read_batches

from .positions import START, Entry, Position
from .visibility import VisibilityFilter

__all__ = ["TERMINAL_STATES", "Hub", "HubClosed", "Subscription"]

log = logging.getLogger("sluice.relay")

TERMINAL_STATES = frozenset({b"completed", b"failed", b"interrupted"})
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# End reasons that stop a client at once, dropping what it has not received yet.
_ABRUPT = frozenset({"shutdown", "slow", "error"})


class HubClosed(Exception):
    """The relay is shutting down and takes no new clients."""


def _parse(entry_id: bytes, fields: dict[bytes, bytes]) -> Entry | None:
    try:
        event = decode_event(fields[b"event"])
    except (KeyError, msgspec.DecodeError):
        log.error("skipping an event entry that is not a contract event", extra={"entry": entry_id.decode()})
        return None
    kind = fields.get(b"type", b"").decode() or type(event).__struct_config__.tag
    return Entry(Position.from_entry_id(entry_id), str(kind), fields[b"event"], event)


@dataclass(slots=True)
class _Stats:
    readers_started: int = 0
    xreads: int = 0
    catchup_reads: int = 0
    events_read: int = 0
    clients_total: int = 0
    clients_resumed: int = 0  # joined with a position (Last-Event-ID or ?after=)
    clients_cut_slow: int = 0
    redis_errors: int = 0


class Subscription:
    """One client's view of a request: catch-up, then its bounded buffer of live entries.

    ``next_batch`` returns the next entries after the client's position that its grant lets it see;
    ``finished`` is true once nothing more will come (``end_reason`` says why: ``final`` after the
    final terminal, ``shutdown`` when the relay stops, ``slow`` when the client was cut off, ``error``
    when the request's reader failed)."""

    def __init__(self, hub: Hub, feed: _Feed, after: Position, allow_internal: bool, client: str) -> None:
        self.hub = hub
        self.feed = feed
        self.after = after
        self.client = client
        self.filter = VisibilityFilter(allow_internal)
        self.end_reason: str | None = None
        # Set by the endpoint around its response: cancelled when the client is cut off.
        self.cancel_scope: anyio.CancelScope | None = None
        self._queue: deque[Entry] = deque()
        self._wake = anyio.Event()
        self._processed = START  # the last position given to the filter (each position once)
        floor = feed.last
        self._catchup_end = max(after, floor)
        # The filter must see the block starts of the attempt it resumes in (to know which blocks are
        # internal), so without the grant catch-up begins at the start of that attempt.
        needs_prefix = not allow_internal and after.seq > 0
        if needs_prefix:
            self._cursor: str | None = f"{after.attempt}-0"
        elif self._catchup_end > after:
            self._cursor = f"({after}" if after > START else "-"
        else:
            self._cursor = None
        if feed.final is not None:
            self.end_reason = "final"
        self.sent_events = 0

    @property
    def caught_up(self) -> bool:
        return self._cursor is None

    @property
    def finished(self) -> bool:
        if self.end_reason in _ABRUPT:
            return True
        return self.end_reason is not None and self.caught_up and not self._queue

    @property
    def final(self) -> Position | None:
        return self.feed.final

    def offer_nowait(self, entry: Entry) -> bool:
        """Called by the reader; False when the buffer is full."""
        if self.end_reason is not None:
            return True
        if len(self._queue) >= self.hub.buffer:
            return False
        self._queue.append(entry)
        self._wake.set()
        return True

    def end(self, reason: str) -> None:
        if self.end_reason is None or reason in _ABRUPT:
            self.end_reason = reason
        self._wake.set()

    def _accept(self, entries: list[Entry]) -> list[Entry]:
        out: list[Entry] = []
        for e in entries:
            if e.position <= self._processed:
                continue
            self._processed = e.position
            if self.filter.keep(e) and e.position > self.after:
                out.append(e)
        self.sent_events += len(out)
        return out

    async def next_batch(self, max_wait: float) -> list[Entry]:
        """The next visible entries, waiting at most ``max_wait`` seconds (possibly none)."""
        while self._cursor is not None and not self.finished:
            entries, self._cursor = await self.hub._range(self.feed.keys.events, self._cursor, str(self._catchup_end))
            if out := self._accept(entries):
                return out
        if self.end_reason in _ABRUPT:
            self._queue.clear()
            return []
        if not self._queue and self.end_reason is None:
            self._wake = anyio.Event()
            with anyio.move_on_after(max_wait):
                await self._wake.wait()
        batch = list(self._queue)
        self._queue.clear()
        return self._accept(batch)


@dataclass(eq=False)
class _Feed:
    request_id: str
    keys: RequestKeys
    last: Position = START  # the last entry the reader has handed out
    last_terminal: bool = False
    final: Position | None = None
    subscribers: set[Subscription] = field(default_factory=set)
    joining: int = 0  # clients waiting for the reader's first read
    failed: bool = False
    ready: anyio.Event = field(default_factory=anyio.Event)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


class Hub:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, *, buffer: int = 1000, block_ms: int = 1000, page: int = 500,
        final_poll_ms: int = 20, catchup_concurrency: int = 16,
    ) -> None:  # fmt: skip
        if buffer < 1:
            raise ValueError("the per-client buffer must hold at least one event")
        self.redis = redis
        self.keys = keys
        self.buffer = buffer
        self.block_ms = block_ms
        self.page = page
        self.final_poll_ms = final_poll_ms
        # Catch-up reads are bounded, so a crowd joining at once queues here instead of piling onto Redis.
        self._catchup_slots = anyio.Semaphore(catchup_concurrency)
        self.closing = False
        self._feeds: dict[str, _Feed] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._stats = _Stats()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Hub]:
        """Run the readers' task group; on exit every client is ended and every reader cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield self
            finally:
                self.close()
                tg.cancel_scope.cancel()
                self._tg = None

    def close(self) -> None:
        """End every client's stream now (they may resume elsewhere) and take no new ones."""
        self.closing = True
        for feed in list(self._feeds.values()):
            for sub in list(feed.subscribers):
                sub.end("shutdown")

    def statistics(self) -> dict[str, int]:
        subs = [s for f in self._feeds.values() for s in f.subscribers]
        return {
            "feeds_active": len(self._feeds),
            "readers_active": sum(1 for f in self._feeds.values() if f.final is None),
            "readers_started": self._stats.readers_started,
            "xreads": self._stats.xreads,
            "catchup_reads": self._stats.catchup_reads,
            "events_read": self._stats.events_read,
            "clients_active": len(subs),
            "clients_total": self._stats.clients_total,
            "clients_resumed": self._stats.clients_resumed,
            "clients_cut_slow": self._stats.clients_cut_slow,
            "buffered_events": sum(len(s._queue) for s in subs),
            "redis_errors": self._stats.redis_errors,
        }

    async def exists(self, request_id: str) -> bool:
        rk = self.keys.request(request_id)
        return bool(await self.redis.exists(rk.status, rk.events))

    @contextlib.asynccontextmanager
    async def subscribe(
        self, request_id: str, after: Position, *, allow_internal: bool, client: str = ""
    ) -> AsyncIterator[Subscription]:
        """Follow ``request_id`` from just after ``after``. Raises ``HubClosed`` during shutdown."""
        if self.closing or self._tg is None:
            raise HubClosed("the relay is shutting down")
        feed = self._feeds.get(request_id)
        if feed is None:
            feed = self._feeds[request_id] = _Feed(request_id, self.keys.request(request_id))
            self._stats.readers_started += 1
            self._tg.start_soon(self._read, feed)
        feed.joining += 1
        sub: Subscription | None = None
        try:
            await feed.ready.wait()
            # No await between reading the floor and joining: every entry after the floor reaches the
            # buffer, every entry up to it comes from the catch-up read.
            sub = Subscription(self, feed, after, allow_internal, client)
            feed.subscribers.add(sub)
            feed.joining -= 1
            self._stats.clients_total += 1
            self._stats.clients_resumed += after > START
            if self.closing:
                sub.end("shutdown")
            elif feed.failed:
                sub.end("error")
            yield sub
        finally:
            if sub is None:
                feed.joining -= 1
            else:
                feed.subscribers.discard(sub)
            if not feed.subscribers and not feed.joining and self._feeds.get(request_id) is feed:
                del self._feeds[request_id]
                feed.scope.cancel()

    def _cut(self, feed: _Feed, sub: Subscription) -> None:
        self._stats.clients_cut_slow += 1
        feed.subscribers.discard(sub)
        sub.end("slow")
        if sub.cancel_scope is not None:
            sub.cancel_scope.cancel()
        log.warning(
            "client cut off: buffer full, the client stopped reading",
            extra={"request_id": feed.request_id, "client": sub.client, "buffer": self.buffer,
                   "reason": f"{self.buffer} events waiting unread", "position": str(sub._processed)},
        )  # fmt: skip

    async def _range(self, key: str, start: str, end: str) -> tuple[list[Entry], str | None]:
        """One page of a catch-up read and the cursor of the next page (None: done)."""
        async with self._catchup_slots:
            self._stats.catchup_reads += 1
            rows = range_entries(await self.redis.xrange(key, start, end, count=self.page))
        more = f"({rows[-1][0].decode()}" if len(rows) == self.page else None
        return [e for e in (_parse(i, f) for i, f in rows) if e is not None], more

    async def _read(self, feed: _Feed) -> None:
        with feed.scope:
            try:
                await self._retrying(lambda: self._start(feed), feed)
                feed.ready.set()
                while feed.final is None:
                    await self._retrying(lambda: self._step(feed), feed)
            except Exception:
                # One request's reader failing (say a key of the wrong type) must not take the hub down:
                # its clients' streams end (they may retry) and the failure is logged.
                log.exception("reader failed", extra={"request_id": feed.request_id})
                for sub in list(feed.subscribers):
                    sub.end("error")
                feed.failed = True
                feed.ready.set()

    async def _retrying(self, step: Callable[[], Awaitable[None]], feed: _Feed) -> None:
        """Run one reader step; a Redis outage is waited out (clients keep their heartbeats)."""
        delay = 0.05
        while True:
            try:
                await step()
                return
            except _TRANSIENT as exc:
                self._stats.redis_errors += 1
                log.warning("Redis read failed; retrying", extra={"request_id": feed.request_id, "error": repr(exc)})
                await anyio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _start(self, feed: _Feed) -> None:
        rows = range_entries(await self.redis.xrevrange(feed.keys.events, count=1))
        if rows:
            entry = _parse(*rows[0])
            feed.last = Position.from_entry_id(rows[0][0])
            feed.last_terminal = entry is not None and entry.is_terminal
        if feed.last_terminal and await self._verdict(feed) is True:
            feed.final = feed.last

    async def _step(self, feed: _Feed) -> None:
        block = self.block_ms
        if feed.last_terminal:
            verdict = await self._verdict(feed)
            if verdict is True:
                self._finish(feed)
                return
            if verdict is None:
                block = self.final_poll_ms  # the worker decides between retry and finalize right away
        self._stats.xreads += 1
        resp = await self.redis.xread({feed.keys.events: str(feed.last)}, count=self.page, block=block)
        for _, rows in read_batches(resp):
            self._publish(feed, rows)

    def _publish(self, feed: _Feed, rows: list[StreamEntry]) -> None:
        self._stats.events_read += len(rows)
        for entry_id, fields in rows:
            # The reader moves past every entry, even one it cannot decode (it is logged and skipped).
            feed.last, feed.last_terminal = Position.from_entry_id(entry_id), False
            if (entry := _parse(entry_id, fields)) is None:
                continue
            feed.last_terminal = entry.is_terminal
            for sub in list(feed.subscribers):
                if not sub.offer_nowait(entry):
                    self._cut(feed, sub)

    async def _verdict(self, feed: _Feed) -> bool | None:
        """Is the last entry (a terminal) the final one? True, False (a later attempt follows) or None
        (the worker has not decided yet)."""
        attempt_b, state = await self.redis.hmget(feed.keys.status, ["attempt", "state"])
        if attempt_b is None and state is None:
            return True  # the status record is gone (expired): nothing more will be written
        attempt = int(attempt_b or 0)
        if attempt > feed.last.attempt:
            return False
        if state in TERMINAL_STATES:
            return True
        return None

    def _finish(self, feed: _Feed) -> None:
        feed.final = feed.last
        for sub in list(feed.subscribers):
            sub.end("final")
