"""The archiver: a consumer of the terminal feed that writes each finished request to the archive, then acks.

Rule: for each terminal entry (its own consumer group, every shard; several archivers share the group),
if the request's pointer already names this attempt's object, it was archived (a redelivery after a crash
between the write and the ack): only ack. Otherwise read the request's status hash and both logs in one
transaction (one slot), write the object, its index row and last the pointer (fixed names, deterministic
bytes: a rewrite writes the same), and only then ``XACK``. A destination or Redis failure is logged in one
line naming its cause and retried with back-off, and nothing is acked meanwhile, so a crash at any point loses
nothing (the entry stays pending and comes again, to this consumer on restart or to another by
``XAUTOCLAIM``) and duplicates nothing (the names are fixed). A long-running archiver retries for ever; one
given ``max_tries`` (``--once``: ``ONCE_TRIES``) stops with ``ArchiveGaveUp`` after that many failed tries of
one step. A request whose keys already expired is counted ``lost`` and logged as an error: the lag grew
past ``retention_seconds``. The lag (the oldest unacknowledged terminal entry's age) is logged every
``lag_interval`` seconds, as a warning past half the retention.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
from redis.exceptions import RedisError

from sluice.archive.record import (
    ArchiveCorrupt,
    ArchivedRequest,
    Pointer,
    decode_pointer,
    encode_json,
    encode_record,
    index_row,
    names_for,
    pointer_name,
    sha256_hex,
)
from sluice.archive.store import Destination, DestinationError
from sluice.client import SluiceClient
from sluice.client.terminals import Terminal, TerminalFeed
from sluice.schemas.states import TERMINAL_STATES
from sluice.worker.redis.lag import ShardLag, group_lag
from sluice.worker.redis.retry import describe

__all__ = [
    "DEFAULT_GROUP",
    "ONCE_TRIES",
    "ArchiveGaveUp",
    "Archiver",
    "ArchiverStats",
    "default_consumer",
    "fetch_request",
]

log = logging.getLogger("sluice.archive")
DEFAULT_GROUP = "sluice-archive"
GATE_ENV = "SLUICE_ARCHIVE_TEST_GATE"  # tests only: a directory; pause between the write and the ack
_BACKOFF_FIRST, _BACKOFF_MAX = 0.1, 5.0
# Tries of one step (a write, a read, an ack) before ``--once`` gives up: about 3 s of back-off between them,
# plus each try's own time (the S3 client retries a refused connection itself, ~3 s).
ONCE_TRIES = 6
_T = TypeVar("_T")


class ArchiveGaveUp(Exception):
    """One step failed ``max_tries`` times in a row; the message names the step and the last cause."""


def default_consumer() -> str:
    return f"archive-{socket.gethostname()}-{os.getpid()}"


@dataclass(slots=True)
class ArchiverStats:
    archived: int = 0  # objects written
    already: int = 0  # redelivered, found archived: only acked
    lost: int = 0  # keys expired before the archiver read them
    running: int = 0  # queued again since it finished: skipped
    destination_errors: int = 0
    redis_errors: int = 0
    bytes: int = 0
    events: int = 0  # raw + normalized entries archived
    lag_ms: int = 0
    outcomes: dict[str, str] = field(default_factory=dict)  # tests: request id -> last outcome


async def fetch_request(client: SluiceClient, terminal: Terminal) -> ArchivedRequest | None:
    """The request's status hash and both logs, read in one transaction; None when the status expired."""
    rk = client.keys.request(terminal.request_id)
    async with client.redis.pipeline(transaction=True) as p:
        p.hgetall(rk.status)
        p.xrange(rk.raw, "-", "+")
        p.xrange(rk.events, "-", "+")
        status, raw, events = await p.execute()
    if not status:
        return None
    attempt_v = status.get(b"attempt", b"")
    attempt = int(attempt_v) if attempt_v.isdigit() else terminal.attempt
    return ArchivedRequest(terminal.request_id, attempt, dict(terminal.fields), dict(status), list(raw), list(events))


class Archiver:
    def __init__(
        self,
        client: SluiceClient,
        destination: Destination,
        *,
        group: str = DEFAULT_GROUP,
        consumer: str | None = None,
        concurrency: int = 8,
        claim_idle_ms: int = 60_000,
        retention_seconds: int = 24 * 3600,
        lag_interval: float = 30.0,
        max_tries: int | None = None,
    ) -> None:
        """``max_tries``: give up (``ArchiveGaveUp``) after that many failed tries of one step; None: never."""
        self.client = client
        self.max_tries = max_tries
        self.destination = destination
        self.group = group
        self.consumer = consumer or default_consumer()
        self.concurrency = concurrency
        self.claim_idle_ms = claim_idle_ms
        self.retention_seconds = retention_seconds
        self.lag_interval = lag_interval
        self.stats = ArchiverStats()
        gate = os.environ.get(GATE_ENV)
        self._gate = Path(gate) if gate else None

    def statistics(self) -> ArchiverStats:
        return self.stats

    async def lag(self) -> list[ShardLag]:
        return await group_lag(self.client.redis, self.client.keys, self.group)

    async def _retry(self, what: str, fn: Callable[[], Awaitable[_T]]) -> _T:
        delay = _BACKOFF_FIRST
        tries = 0
        while True:
            try:
                return await fn()
            except DestinationError as exc:
                self.stats.destination_errors += 1
                cause = str(exc)
            except (RedisError, OSError) as exc:
                self.stats.redis_errors += 1
                cause = f"Redis failed while {what} ({describe(exc)})"
            tries += 1
            if self.max_tries is not None and tries >= self.max_tries:
                raise ArchiveGaveUp(f"{cause}; gave up after {tries} tries")
            log.warning("%s; retrying in %.1fs", cause, delay)
            await anyio.sleep(delay)
            delay = min(delay * 2, _BACKOFF_MAX)

    async def _archived(self, rid: str, attempt: int) -> bool:
        data = await self.destination.get(pointer_name(rid))
        if data is None:
            return False
        try:
            ptr: Pointer = decode_pointer(data)
        except ArchiveCorrupt:
            return False  # written again below
        return ptr.attempt == attempt

    async def archive_one(self, terminal: Terminal) -> str:
        """Archive one finished request (not acked here). Returns the outcome: archived, already, lost,
        running. Retries failures until they pass."""
        rid = terminal.request_id
        if await self._retry("reading the pointer", lambda: self._archived(rid, terminal.attempt)):
            self.stats.already += 1
            return "already"
        req = await self._retry("reading the request", lambda: fetch_request(self.client, terminal))
        if req is None:
            self.stats.lost += 1
            log.error(
                "request expired before it was archived: the archiver's lag passed retention_seconds",
                extra={"request_id": rid, "retention_seconds": self.retention_seconds},
            )
            return "lost"
        if req.status.get(b"state", b"").decode() not in TERMINAL_STATES:
            self.stats.running += 1
            log.warning("request queued again since it finished: not archived now", extra={"request_id": rid})
            return "running"
        finished = req.finished_at or int(terminal.entry_id.partition("-")[0])
        names = names_for(rid, req.attempt, finished)
        data = encode_record(req)
        digest = sha256_hex(data)
        row = encode_json(index_row(req, names, digest, len(data)))
        ptr = encode_json(
            Pointer(request_id=rid, attempt=req.attempt, object=names.object, sha256=digest, bytes=len(data))
        )
        await self._retry("writing", lambda: self.destination.put(names.object, data))
        await self._retry("writing", lambda: self.destination.put(names.index, row))
        await self._retry("writing", lambda: self.destination.put(names.pointer, ptr))
        self.stats.archived += 1
        self.stats.bytes += len(data)
        self.stats.events += len(req.raw) + len(req.events)
        return "archived"

    async def _gate_wait(self, rid: str) -> None:
        """Tests only: say the write is done, then wait for the test's release (or its SIGKILL)."""
        assert self._gate is not None
        (self._gate / f"written-{rid}").write_text(str(os.getpid()))
        while not (self._gate / "release").exists():  # noqa: ASYNC110 - another process makes the file
            await anyio.sleep(0.01)

    async def _handle(self, feed: TerminalFeed, terminal: Terminal) -> None:
        outcome = await self.archive_one(terminal)
        self.stats.outcomes[terminal.request_id] = outcome
        if self._gate is not None:
            await self._gate_wait(terminal.request_id)
        await self._retry("acking", lambda: feed.ack(terminal))

    async def _report_lag(self) -> int:
        try:
            lags = await self.lag()
        except (RedisError, OSError) as exc:
            log.warning("archive lag unknown: Redis failed (%s)", describe(exc))
            return -1
        now = int(time.time() * 1000)
        lag_ms = max((s.age_ms(now) for s in lags), default=0)
        self.stats.lag_ms = lag_ms
        fraction = lag_ms / (self.retention_seconds * 1000)
        extra = {"lag_s": round(lag_ms / 1000, 3), "retention_seconds": self.retention_seconds}
        if fraction >= 0.5:
            log.warning("archive lag is past half the retention: requests may expire unarchived", extra=extra)
        else:
            log.info("archive lag", extra=extra | {"archived": self.stats.archived})
        return lag_ms

    async def run(self, *, once: bool = False, ready: Callable[[], None] | None = None) -> ArchiverStats:
        """Archive until cancelled; with ``once``, until the group has nothing unacknowledged left. Raises
        ``ArchiveGaveUp`` when a step failed ``max_tries`` times."""
        await self.client.connect()  # the deployment's shard count: every terminal shard is read
        try:
            await self._run(once, ready)
        except BaseExceptionGroup as group:  # the task groups': a step that gave up is the one cause told
            matched, _ = group.split(ArchiveGaveUp)
            leaf: BaseException | None = matched
            while isinstance(leaf, BaseExceptionGroup):
                leaf = leaf.exceptions[0]
            if leaf is not None:
                raise leaf from None
            raise
        return self.stats

    async def _run(self, once: bool, ready: Callable[[], None] | None) -> None:
        limiter = anyio.CapacityLimiter(self.concurrency)
        async with (
            self.client.terminals(
                self.group,
                self.consumer,
                start="0",
                count=max(16, self.concurrency * 2),
                claim_idle_ms=self.claim_idle_ms,
            ) as feed,
            anyio.create_task_group() as tg,
        ):
            if ready is not None:
                ready()

            async def handle(t: Terminal) -> None:
                async with limiter:
                    await self._handle(feed, t)

            async def monitor() -> None:
                while True:
                    await self._report_lag()
                    if once and all(s.pending == 0 and s.oldest_ms is None for s in await self.lag()):
                        tg.cancel_scope.cancel()
                        return
                    await anyio.sleep(0.2 if once else self.lag_interval)

            tg.start_soon(monitor)
            async for terminal in feed:
                await limiter.acquire()  # back-pressure: read no further than the work in hand
                limiter.release()
                tg.start_soon(handle, terminal)
