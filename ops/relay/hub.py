"""One reader per request, shared by every client following it, over a fixed number of Redis connections.

Rule: a request followed by any number of clients is read from Redis once. The first client of a
request starts its *feed*: one round trip (existence, last entry, status) decides 404, finished or live,
and every client joining meanwhile waits for that same answer, so a crowd costs one check, not one per
client. A live feed is followed by a *lane*: a lane reads all its feeds with one ``XREAD BLOCK`` over
their keys, on one of its two connections (a second ``XREAD`` with the new key set starts on the idle
connection when a feed joins while the first blocks; replies at or below a feed's position are dropped,
so the overlap is harmless). Each client has a bounded buffer of live entries and catches up on older
ones with paged ``XRANGE`` reads from the command pool; a client whose buffer fills is cut off, never
slowing the reader or the others.

Failures: a joining client gets ``Unavailable`` when Redis cannot answer the feed's first round trip (the
endpoint says 503), ``ReaderFailed`` when Redis answers it with an error (500), ``NotFound`` for an unknown
request, ``HubFull`` past ``max_clients`` and ``HubClosed`` during shutdown. Once a feed runs, Redis
outages are waited out with backoff while clients keep their heartbeats.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.schemas.events import EVENT_TAGS, decode_event
from sluice.schemas.keys import Keys, RequestKeys, key_slot
from sluice.schemas.replies import StreamEntry, range_entries, read_batches
from sluice.schemas.states import TERMINAL_STATES as STATES_TERMINAL

from .positions import START, Entry, Position
from .visibility import VisibilityFilter

__all__ = [
    "TERMINAL_STATES",
    "Hub",
    "HubClosed",
    "HubFull",
    "NotFound",
    "ReaderFailed",
    "Subscription",
    "Unavailable",
]

log = logging.getLogger("sluice.relay")

TERMINAL_STATES = frozenset(s.encode() for s in STATES_TERMINAL)  # as the status hash holds them
TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
# End reasons that stop a client at once, dropping what it has not received yet.
_ABRUPT = frozenset({"shutdown", "slow", "error"})


class HubClosed(Exception):
    """The relay is shutting down and takes no new clients."""


class HubFull(Exception):
    """``max_clients`` clients are being served already."""


class NotFound(Exception):
    """No such request (neither a status record nor events)."""


class Unavailable(Exception):
    """Redis did not answer a joining client's first round trip."""


class ReaderFailed(Exception):
    """Redis answered with an error for this request (say a key of the wrong type): 500."""


def _parse(entry_id: bytes, fields: dict[bytes, bytes]) -> Entry | None:
    try:
        event = decode_event(fields[b"event"])
    except (KeyError, msgspec.DecodeError):
        log.error("skipping an event entry that is not a contract event", extra={"entry": entry_id.decode()})
        return None
    kind = fields.get(b"type", b"").decode() or EVENT_TAGS[type(event)]
    return Entry(Position.from_entry_id(entry_id), kind, fields[b"event"], event)


@dataclass(slots=True)
class _Stats:
    readers_started: int = 0  # feeds started (one first round trip each)
    xreads: int = 0
    catchup_reads: int = 0
    events_read: int = 0
    clients_total: int = 0
    clients_resumed: int = 0  # joined with a position (Last-Event-ID or ?after=)
    clients_cut_slow: int = 0  # buffer full or write timeout
    clients_refused_full: int = 0
    clients_refused_unavailable: int = 0
    clients_not_found: int = 0
    redis_errors: int = 0
    first_read_retries: int = 0  # first reads retried once on a fresh connection after a connection error


class Subscription:
    """One client's view of a request: catch-up, then its bounded buffer of live entries.

    ``next_batch`` returns the next entries after the client's position that its grant lets it see (a
    withheld block's start as its ``block.withheld`` notice); ``finished`` is true once nothing more will
    come (``end_reason`` says why: ``final`` after the final terminal, ``shutdown`` when the relay stops,
    ``slow`` when the client was cut off, ``error`` when the request's reader failed)."""

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
            self._cursor: str | None = str(Position(after.attempt, 0))
        elif self._catchup_end > after:
            self._cursor = f"({after}" if after > START else "-"
        else:
            self._cursor = None
        if feed.final is not None:
            self.end_reason = "final"
        self._retry_delay = 0.05

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

    @property
    def buffered(self) -> int:
        return len(self._queue)

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
            seen = self.filter.view(e)
            if seen is not None and e.position > self.after:
                out.append(seen)
        return out

    async def next_batch(self, max_wait: float) -> list[Entry]:
        """The next visible entries, waiting at most about ``max_wait`` seconds (possibly none)."""
        while self._cursor is not None and not self.finished:
            try:
                entries, cursor = await self.hub._range(self.feed.keys.events, self._cursor, str(self._catchup_end))
            except TRANSIENT as exc:
                # Catch-up waits for Redis like the reader does; the empty batch keeps heartbeats going.
                self.hub._redis_failed("catch-up read", self.feed.request_id, exc)
                await anyio.sleep(min(self._retry_delay, max_wait))
                self._retry_delay = min(self._retry_delay * 2, 2.0)
                return []
            self._retry_delay, self._cursor = 0.05, cursor
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
    last: Position = START  # the last entry handed out (or the floor read at start)
    last_terminal: bool = False
    final: Position | None = None
    subscribers: set[Subscription] = field(default_factory=set)
    joining: int = 0  # clients waiting for the first round trip
    outcome: str = "starting"  # then "live", "finished", "missing", "unavailable", "failed"
    ready: anyio.Event = field(default_factory=anyio.Event)
    lane: _Lane | None = None
    settling: bool = False  # a verdict check (is the last terminal the final one?) is running


@dataclass(eq=False)
class _Lane:
    """Feeds read together by one XREAD on one of two connections."""

    index: int
    conns: list[aioredis.Redis]
    feeds: dict[str, _Feed] = field(default_factory=dict)  # by events key
    idle: list[int] = field(default_factory=lambda: [1, 0])
    backoff: float = 0.025  # after a failed XREAD, doubling up to 2 s
    dirty: bool = False  # the key set or positions changed since the newest XREAD was sent
    wake: anyio.Event = field(default_factory=anyio.Event)
    replies: list[tuple[object, BaseException | None]] = field(default_factory=list)

    def poke(self) -> None:
        self.dirty = True
        self.wake.set()


class Hub:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        *,
        reader: Callable[[], aioredis.Redis] | None = None,
        buffer: int = 1000,
        block_ms: int = 1000,
        page: int = 500,
        final_poll_ms: int = 20,
        lanes: int = 2,
        catchup_concurrency: int = 8,
        max_clients: int = 10_000,
        lane_per_slot: bool = False,
    ) -> None:
        """``lane_per_slot``: a Redis Cluster, where one XREAD serves one slot: each followed slot (each request,
        by its hash tag) gets a lane of its own, made when a feed of it first goes live."""
        if buffer < 1:
            raise ValueError("the per-client buffer must hold at least one event")
        self.redis = redis
        self.keys = keys
        self.buffer = buffer
        self.block_ms = block_ms
        self.page = page
        self.final_poll_ms = final_poll_ms
        self.max_clients = max_clients
        make_reader = reader or (lambda: redis)
        self._make_reader = make_reader
        self._slot_lanes: dict[int, _Lane] | None = {} if lane_per_slot else None
        self._lanes = [] if lane_per_slot else [_Lane(i, [make_reader(), make_reader()]) for i in range(max(1, lanes))]
        # Catch-up reads are bounded, so a crowd joining at once queues here instead of piling onto Redis.
        self._catchup_slots = anyio.Semaphore(catchup_concurrency)
        self.closing = False
        self.closed = anyio.Event()  # set by close(): multiplexed sockets close with 1012
        self._feeds: dict[str, _Feed] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._stats = _Stats()
        self._clients = 0  # subscriptions plus clients waiting to join

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Hub]:
        """Run the lanes and feed starts; on exit every client is ended and every reader cancelled."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            for lane in self._lanes:
                tg.start_soon(self._lane_loop, lane)
            try:
                yield self
            finally:
                self.close()
                tg.cancel_scope.cancel()
                self._tg = None

    def close(self) -> None:
        """End every client's stream now (they may resume elsewhere) and take no new ones."""
        self.closing = True
        self.closed.set()
        for feed in list(self._feeds.values()):
            for sub in list(feed.subscribers):
                sub.end("shutdown")

    def statistics(self) -> dict[str, int]:
        subs = [s for f in self._feeds.values() for s in f.subscribers]
        return {
            "feeds_active": len(self._feeds),
            "readers_active": sum(len(lane.feeds) for lane in self._lanes),
            "readers_started": self._stats.readers_started,
            "xreads": self._stats.xreads,
            "catchup_reads": self._stats.catchup_reads,
            "events_read": self._stats.events_read,
            "clients_active": len(subs),
            "clients_total": self._stats.clients_total,
            "clients_resumed": self._stats.clients_resumed,
            "clients_cut_slow": self._stats.clients_cut_slow,
            "clients_refused_full": self._stats.clients_refused_full,
            "clients_refused_unavailable": self._stats.clients_refused_unavailable,
            "clients_not_found": self._stats.clients_not_found,
            "buffered_events": sum(s.buffered for s in subs),
            "redis_errors": self._stats.redis_errors,
            "first_read_retries": self._stats.first_read_retries,
        }

    @contextlib.asynccontextmanager
    async def subscribe(
        self, request_id: str, after: Position, *, allow_internal: bool, client: str = ""
    ) -> AsyncIterator[Subscription]:
        """Follow ``request_id`` from just after ``after``. Raises ``HubClosed``, ``HubFull``,
        ``NotFound`` or ``Unavailable`` before yielding."""
        if self.closing or self._tg is None:
            raise HubClosed("the relay is shutting down")
        if self._clients >= self.max_clients:
            self._stats.clients_refused_full += 1
            raise HubFull(f"the relay serves its maximum of {self.max_clients} clients")
        self._clients += 1
        try:
            async with self._join(request_id, after, allow_internal, client) as sub:
                yield sub
        finally:
            self._clients -= 1

    @contextlib.asynccontextmanager
    async def _join(
        self, request_id: str, after: Position, allow_internal: bool, client: str
    ) -> AsyncIterator[Subscription]:
        feed = self._feeds.get(request_id)
        if feed is None:
            assert self._tg is not None
            feed = self._feeds[request_id] = _Feed(request_id, self.keys.request(request_id))
            self._stats.readers_started += 1
            self._tg.start_soon(self._start, feed)
        feed.joining += 1
        sub: Subscription | None = None
        try:
            await feed.ready.wait()
            if feed.outcome == "missing":
                self._stats.clients_not_found += 1
                raise NotFound(f"no such request: {request_id}")
            if feed.outcome == "unavailable":
                self._stats.clients_refused_unavailable += 1
                raise Unavailable("Redis is unreachable")
            if feed.outcome == "failed":
                raise ReaderFailed("the relay could not read this request")
            # No await between reading the floor and joining: every entry after the floor reaches the
            # buffer, every entry up to it comes from the catch-up read.
            sub = Subscription(self, feed, after, allow_internal, client)
            feed.subscribers.add(sub)
            feed.joining -= 1
            self._stats.clients_total += 1
            self._stats.clients_resumed += after > START
            if self.closing:
                sub.end("shutdown")
            yield sub
        finally:
            if sub is None:
                feed.joining -= 1
            else:
                feed.subscribers.discard(sub)
            if not feed.subscribers and not feed.joining:
                self._drop(feed)

    def _drop(self, feed: _Feed) -> None:
        if self._feeds.get(feed.request_id) is feed:
            del self._feeds[feed.request_id]
        if feed.lane is not None:
            feed.lane.feeds.pop(feed.keys.events, None)
            feed.lane.poke()
            feed.lane = None

    def _cut(self, feed: _Feed, sub: Subscription, reason: str) -> None:
        self._stats.clients_cut_slow += 1
        feed.subscribers.discard(sub)
        sub.end("slow")
        if sub.cancel_scope is not None:
            sub.cancel_scope.cancel()
        log.warning(
            "client cut off: it stopped reading",
            extra={
                "request_id": feed.request_id,
                "client": sub.client,
                "buffer": self.buffer,
                "reason": reason,
                "position": str(sub._processed),
            },
        )

    def cut(self, sub: Subscription, reason: str) -> None:
        """Cut a client off for a reason the endpoint saw (a write that timed out)."""
        if sub.end_reason != "slow":
            self._cut(sub.feed, sub, reason)

    def _redis_failed(self, what: str, request_id: str, exc: BaseException) -> None:
        self._stats.redis_errors += 1
        log.warning(f"Redis {what} failed; retrying", extra={"request_id": request_id, "error": repr(exc)})

    async def _range(self, key: str, start: str, end: str) -> tuple[list[Entry], str | None]:
        """One page of a catch-up read and the cursor of the next page (None: done)."""
        async with self._catchup_slots:
            self._stats.catchup_reads += 1
            rows = range_entries(await self.redis.xrange(key, start, end, count=self.page))
        more = f"({rows[-1][0].decode()}" if len(rows) == self.page else None
        return [e for e in (_parse(i, f) for i, f in rows) if e is not None], more

    # -- feeds ----------------------------------------------------------------------------------------

    async def _start(self, feed: _Feed) -> None:
        """The feed's first round trip: its last entry and its status record (neither: no such request).
        Only commands the deployment's ``sluice-reader`` ACL user has (XREVRANGE, HGETALL)."""
        try:
            last, status = await self._first_read(feed)
        except TRANSIENT as exc:
            self._redis_failed("first read of a request", feed.request_id, exc)
            self._settle_start(feed, "unavailable")
            return
        except Exception:
            log.exception("reader failed", extra={"request_id": feed.request_id})
            self._settle_start(feed, "failed")
            return
        exists = bool(last) or bool(status)
        if not exists:
            self._settle_start(feed, "missing")
            return
        rows = range_entries(last)
        if rows:
            entry = _parse(*rows[0])
            feed.last = Position.from_entry_id(rows[0][0])
            feed.last_terminal = entry is not None and entry.is_terminal
        if feed.last_terminal and self._judge(feed, status) is True:
            feed.final = feed.last
            self._settle_start(feed, "finished")
            return
        self._settle_start(feed, "live")
        if feed.subscribers or feed.joining:
            lane = self._lane_for(feed)
            feed.lane = lane
            lane.feeds[feed.keys.events] = feed
            lane.poke()
            if feed.last_terminal:
                self._settle(feed)

    async def _first_read(self, feed: _Feed) -> list[Any]:
        """XREVRANGE + HGETALL in one round trip. A pooled connection Redis closed while it sat idle (a
        restart, ``timeout``, ``CLIENT KILL``) fails on its first use: that failure is retried once, after
        the pool's idle connections are dropped, so the retry runs on a fresh one and the client is not
        answered a 503 for a Redis that is up. A timeout is not retried (Redis is slow, not gone), nor a
        second failure (an outage)."""
        for retry in (False, True):
            try:
                async with self.redis.pipeline(transaction=False) as p:
                    p.xrevrange(feed.keys.events, count=1)
                    p.hgetall(feed.keys.status)
                    return list(await p.execute())
            except (RedisConnectionError, ConnectionError) as exc:
                if retry:
                    raise
                self._stats.first_read_retries += 1
                log.info(
                    "Redis closed a pooled connection; retrying on a fresh one",
                    extra={"request_id": feed.request_id, "error": repr(exc)},
                )
                if (pool := getattr(self.redis, "connection_pool", None)) is not None:  # not on a cluster
                    await pool.disconnect(inuse_connections=False)
        raise AssertionError("unreachable")

    def _lane_for(self, feed: _Feed) -> _Lane:
        if self._slot_lanes is None:
            return min(self._lanes, key=lambda ln: len(ln.feeds))
        slot = key_slot(feed.keys.events)
        lane = self._slot_lanes.get(slot)
        if lane is None:
            lane = self._slot_lanes[slot] = _Lane(slot, [self._make_reader(), self._make_reader()])
            self._lanes.append(lane)
            assert self._tg is not None  # feeds go live only while the hub runs
            self._tg.start_soon(self._lane_loop, lane)
        return lane

    def _settle_start(self, feed: _Feed, outcome: str) -> None:
        feed.outcome = outcome
        feed.ready.set()
        if outcome in ("missing", "unavailable", "failed") and self._feeds.get(feed.request_id) is feed:
            # The next client asks Redis again; these joiners get the answer (404 / 503 / an error).
            del self._feeds[feed.request_id]
        if outcome == "failed":
            for sub in list(feed.subscribers):
                sub.end("error")

    def _judge(self, feed: _Feed, status: object) -> bool | None:
        """Is the last entry (a terminal) the final one? True, False (a later attempt follows) or None
        (the worker has not decided yet). ``status`` is the status hash (HGETALL)."""
        fields = status if isinstance(status, dict) else {}
        attempt_b, state = fields.get(b"attempt"), fields.get(b"state")
        if attempt_b is None and state is None:
            return True  # the status record is gone (expired): nothing more will be written
        attempt = int(attempt_b or 0)
        if attempt > feed.last.attempt:
            return False
        if state in TERMINAL_STATES:
            return True
        return None

    def _settle(self, feed: _Feed) -> None:
        if not feed.settling and self._tg is not None:
            feed.settling = True
            self._tg.start_soon(self._settle_loop, feed)

    async def _settle_loop(self, feed: _Feed) -> None:
        """After a terminal entry: poll the status until it says final (finish the feed) or a later
        attempt (the lane reads on); any new entry meanwhile ends the question too."""
        delay = self.final_poll_ms / 1000
        try:
            while feed.last_terminal and feed.lane is not None and feed.final is None:
                at = feed.last
                try:
                    verdict = self._judge(feed, await self.redis.hgetall(feed.keys.status))
                except TRANSIENT as exc:
                    self._redis_failed("status read", feed.request_id, exc)
                    verdict = None
                if feed.last != at:
                    continue
                if verdict is True:
                    self._finish(feed)
                    return
                if verdict is False:
                    return
                await anyio.sleep(delay)
                delay = min(delay * 2, self.block_ms / 1000)
        finally:
            feed.settling = False

    def _finish(self, feed: _Feed) -> None:
        feed.final = feed.last
        if feed.lane is not None:
            feed.lane.feeds.pop(feed.keys.events, None)
            feed.lane.poke()
            feed.lane = None
        for sub in list(feed.subscribers):
            sub.end("final")

    # -- lanes ----------------------------------------------------------------------------------------

    async def _lane_loop(self, lane: _Lane) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                if lane.dirty and lane.feeds and lane.idle:
                    lane.dirty = False
                    streams: dict[Any, Any] = {f.keys.events: str(f.last) for f in lane.feeds.values()}
                    tg.start_soon(self._xread, lane, lane.idle.pop(), streams)
                await lane.wake.wait()
                lane.wake = anyio.Event()
                replies, lane.replies = lane.replies, []
                for reply, error in replies:
                    if error is None:
                        self._deliver(lane, reply)
                    lane.dirty = True  # positions moved (or a read failed): read again

    async def _xread(self, lane: _Lane, conn: int, streams: dict[Any, Any]) -> None:
        error: BaseException | None = None
        reply: object = None
        try:
            self._stats.xreads += 1
            reply = await lane.conns[conn].xread(streams, count=self.page, block=self.block_ms)
        except TRANSIENT as exc:
            error = exc
            self._redis_failed("XREAD", f"lane {lane.index}", exc)
            lane.backoff = min(lane.backoff * 2, 2.0)
            await anyio.sleep(lane.backoff)
        except Exception as exc:  # a key of the wrong type: find which feed and fail it alone
            error = exc
            await self._isolate(lane, streams)
        else:
            lane.backoff = 0.025
        lane.idle.append(conn)
        lane.replies.append((reply, error))
        lane.wake.set()

    async def _isolate(self, lane: _Lane, streams: dict[Any, Any]) -> None:
        """A lane's XREAD failed with a reply error: probe each feed's key alone and fail only the
        broken ones (their clients' streams end; the failure is logged)."""
        for feed in list(lane.feeds.values()):
            try:
                await self.redis.xread({feed.keys.events: str(feed.last)}, count=1)
            except TRANSIENT:
                return
            except Exception:
                log.exception("reader failed", extra={"request_id": feed.request_id})
                lane.feeds.pop(feed.keys.events, None)
                feed.lane = None
                feed.outcome = "failed"
                for sub in list(feed.subscribers):
                    sub.end("error")

    def _deliver(self, lane: _Lane, reply: object) -> None:
        for key, rows in read_batches(reply):
            # A reply may name a feed that left the lane since the XREAD was sent: ignored.
            if (feed := lane.feeds.get(key.decode())) is not None:
                self._publish(feed, rows)

    def _publish(self, feed: _Feed, rows: list[StreamEntry]) -> None:
        for entry_id, fields in rows:
            position = Position.from_entry_id(entry_id)
            if position <= feed.last:
                continue  # the other connection's reply had it already
            self._stats.events_read += 1
            # The reader moves past every entry, even one it cannot decode (it is logged and skipped).
            feed.last, feed.last_terminal = position, False
            if (entry := _parse(entry_id, fields)) is None:
                continue
            feed.last_terminal = entry.is_terminal
            for sub in list(feed.subscribers):
                if not sub.offer_nowait(entry):
                    self._cut(feed, sub, f"{self.buffer} events waiting unread")
        if feed.last_terminal:
            self._settle(feed)
