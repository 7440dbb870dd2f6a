"""Writes one request's raw and normalized logs and its status record to Redis.

Rule: every write goes through a fenced, idempotent script (``sluice.worker.scripts``); a batch is re-sent
as is after a connection error until Redis answers or the outage limit passes (then ``StorageError``);
a refused epoch raises ``Fenced`` and the caller must stop at once. Nothing here reorders: the seq is
the order.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import anyio
import hiredis
import msgspec
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from sluice.normalizer.sse import SSEEvent
from sluice.schemas.errors import StorageError, WorkerError
from sluice.schemas.events import BlockDelta, Event, encode_event
from sluice.schemas.keys import RequestKeys
from sluice.worker import scripts
from sluice.worker.redis_pipe import RedisPipe, direct_pipe_possible

__all__ = [
    "TRANSIENT_REDIS_ERRORS",
    "AppendMux",
    "ClaimInfo",
    "Fenced",
    "PendingBatch",
    "RequestLog",
    "now_ms",
    "with_retry",
]

T = TypeVar("T")
_TRANSIENT = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)
TRANSIENT_REDIS_ERRORS = _TRANSIENT


async def with_retry(fn: Callable[[], Awaitable[T]], *, outage_limit: float, retries: list[int] | None = None) -> T:
    """Run one idempotent Redis operation, retrying connection errors with back-off (redis-py reconnects
    on the next command). Raises ``StorageError`` once Redis stayed away past ``outage_limit`` seconds."""
    deadline = time.monotonic() + outage_limit
    delay = 0.05
    while True:
        try:
            return await fn()
        except _TRANSIENT as exc:
            if retries is not None:
                retries[0] += 1
            if time.monotonic() + delay > deadline:
                raise StorageError(f"Redis unavailable for {outage_limit:.0f}s ({type(exc).__name__})") from exc
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Fenced(WorkerError):
    """Another worker took this request over (its epoch is newer): this one must not write again."""

    code = "fenced"
    category = "worker_lost"


@dataclass(slots=True)
class ClaimInfo:
    outcome: str  # run | takeover | duplicate | done
    epoch: int
    attempt: int
    visible: bool
    cancel: bool
    published: bool


@dataclass(slots=True)
class PendingBatch:
    """Raw entries and events waiting for one append call, in order."""

    raw: list[tuple[int, str, str, str, str, int, int]] = field(default_factory=list)
    events: list[tuple[int, str, str, int]] = field(default_factory=list)

    @classmethod
    def of(cls, events: Iterable[Event]) -> PendingBatch:
        """A batch of contract events only (a terminal written without provider data)."""
        b = cls()
        for ev in events:
            b.add_event(ev)
        return b

    def add_raw(self, index: int, kind: str, event: str, data: str, sse_id: str, offset: int, ts: int) -> None:
        self.raw.append((index, kind, event, data, sse_id, offset, ts))

    def add_event(self, ev: Event) -> None:
        # As str, not bytes: Redis's Lua cmsgpack does not read msgpack's bin type.
        if type(ev) is BlockDelta:  # nearly every event, and the only visible kind: the shortest way
            self.events.append((ev.seq, _DELTA_TAG, encode_event(ev).decode(), 1))
            return
        self.events.append((ev.seq, _tag(ev), encode_event(ev).decode(), 0))

    def add_sse_events(self, sse: list[SSEEvent], ts: int) -> None:
        self.raw += [(e.index, "sse", e.event, e.data, e.id, e.offset, ts) for e in sse]

    def __len__(self) -> int:
        return len(self.raw) + len(self.events)


_PACK = msgspec.msgpack.Encoder().encode
_TWO_EMPTY = b"$0\r\n\r\n$0\r\n\r\n"  # how pack_command ends with two empty arguments


def _tag(ev: Event) -> str:
    return type(ev).__struct_config__.tag  # type: ignore[return-value]


_DELTA_TAG: str = BlockDelta.__struct_config__.tag  # type: ignore[assignment]


@dataclass(slots=True, eq=False)
class _Call:
    keys: list[str]
    args: list[object]
    done: anyio.Event = field(default_factory=anyio.Event)
    result: object = None
    error: BaseException | None = None


class AppendMux:
    """Every stream's appends share one connection: calls made while a write is pending go out together,
    so a busy worker makes few large writes instead of one per stream per event, and an idle one sends
    each append at once (no tick: nothing is held back). Each call keeps its own result: a fenced or
    failed append affects only its own stream. Plain TCP and Unix-socket Redis go through the hand-packed
    ``RedisPipe``; anything else redis-py connects (TLS, ...) through one redis-py pipeline at a time."""

    def __init__(self, redis: aioredis.Redis, *, socket_timeout: float = 10.0, connect_timeout: float = 10.0) -> None:
        self.redis = redis
        self.script = redis.register_script(scripts.APPEND)

        def direct() -> RedisPipe | None:
            if not direct_pipe_possible(redis):
                return None
            return RedisPipe(redis, socket_timeout=socket_timeout, connect_timeout=connect_timeout)

        self.pipe = direct()
        # Claims and finalizes get a direct connection of their own: not behind other streams' bulk appends
        # when Redis is slow, and not through redis-py (about 2 ms of CPU per request at 1,000 streams).
        self.control = direct()
        self._scripts: dict[str, AsyncScript] = {}
        self._pending: list[_Call] = []
        self._wake = anyio.Event()

    def append_head(self, keys: list[str], args: list[object]) -> bytes:
        """The RESP of an append call up to its two packed batch arguments, which ``send_nowait`` adds: the
        same bytes for every batch of an attempt, so they are packed once."""
        packed: bytes = hiredis.pack_command(("EVALSHA", self.script.sha, len(keys), *keys, *args, b"", b""))  # type: ignore[arg-type]
        return packed[: -len(_TWO_EMPTY)]

    def send_nowait(self, head: bytes, raw: bytes, events: bytes) -> asyncio.Future[Any] | None:
        """Send one append (``append_head``'s bytes and the packed batch) without waiting for its reply:
        its future, or None when that is not possible now (no direct connection yet, or redis-py's
        pipeline): then ``call``."""
        if self.pipe is None:
            return None
        packed = b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (head, len(raw), raw, len(events), events)
        return self.pipe.send_packed_nowait(packed)

    def registered(self, source: str) -> AsyncScript:
        """Another of the worker's scripts, registered (hashed) once per worker, run through redis-py."""
        script = self._scripts.get(source)
        if script is None:
            script = self._scripts[source] = self.redis.register_script(source)
        return script

    def runner(self, source: str) -> Callable[..., Awaitable[object]]:
        """``fn(keys=, args=)`` running a claim or finalize script on the control connection when there is
        one (else through redis-py)."""
        script = self.registered(source)
        control = self.control
        if control is None:
            return script

        async def run(keys: list[str], args: list[object]) -> object:
            return await _evalsha(control, script.sha, source, keys, args)

        return run

    async def call(self, keys: list[str], args: list[object]) -> object:
        """Run the append script; raises what Redis raised for this call."""
        if self.pipe is not None:
            return await _evalsha(self.pipe, self.script.sha, scripts.APPEND, keys, args)
        c = _Call(keys, args)
        self._pending.append(c)
        self._wake.set()
        await c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    async def run(self) -> None:
        if self.pipe is not None:
            try:
                await anyio.sleep_forever()
            finally:
                self.pipe.close()
                if self.control is not None:
                    self.control.close()
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            batch, self._pending = self._pending, []
            if batch:
                await self._send(batch, reload=True)

    async def _send(self, batch: list[_Call], *, reload: bool) -> None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            for c in batch:
                pipe.evalsha(self.script.sha, len(c.keys), *c.keys, *cast(list[EncodableT], c.args))
            results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # delivered to every caller, whose retry policy decides
            for c in batch:
                c.error = exc
                c.done.set()
            return
        missing = []
        for c, res in zip(batch, results, strict=True):
            if isinstance(res, NoScriptError) and reload:
                missing.append(c)  # Redis restarted or flushed its scripts: load and send those again
            elif isinstance(res, Exception):
                c.error = res
                c.done.set()
            else:
                c.result = res
                c.done.set()
        if missing:
            try:
                await self.redis.script_load(scripts.APPEND)
            except Exception as exc:  # as above: the callers' retry policy decides
                for c in missing:
                    c.error = exc
                    c.done.set()
                return
            await self._send(missing, reload=False)


async def _evalsha(pipe: RedisPipe, sha: str, source: str, keys: list[str], args: list[object]) -> object:
    cmd = (sha, len(keys), *keys, *args)
    try:
        return await pipe.call("EVALSHA", *cmd)  # type: ignore[arg-type]
    except NoScriptError:  # Redis restarted or flushed its scripts: load it and send again
        await pipe.call("SCRIPT", "LOAD", source)
        return await pipe.call("EVALSHA", *cmd)  # type: ignore[arg-type]


class RequestLog:
    def __init__(
        self, redis: aioredis.Redis, keys: RequestKeys, *, maxlen: int = 0, outage_limit: float = 30.0,
        mux: AppendMux | None = None,
    ) -> None:  # fmt: skip
        self.redis = redis
        self.keys = keys
        self.maxlen = maxlen
        self.outage_limit = outage_limit
        self.mux = mux
        self._append = redis.register_script(scripts.APPEND) if mux is None else None
        self._claim = mux.runner(scripts.CLAIM) if mux else redis.register_script(scripts.CLAIM)
        self._finalize = mux.runner(scripts.FINALIZE) if mux else redis.register_script(scripts.FINALIZE)
        self._append_keys = [keys.status, keys.raw, keys.events]
        self._head: tuple[tuple[int, int], bytes] | None = None  # (epoch, attempt) and its append_head
        self.epoch = 0
        self.appends = 0
        self.redis_retries = 0

    async def _call(self, fn: object, keys: list[str], args: list[object]) -> object:
        """Run one script, retrying transient connection errors with back-off (the scripts are
        idempotent). Raises ``StorageError`` once Redis stayed away past the outage limit."""
        counter = [0]
        try:
            return await with_retry(
                lambda: fn(keys=keys, args=args),  # type: ignore[operator]
                outage_limit=self.outage_limit,
                retries=counter,
            )
        finally:
            self.redis_retries += counter[0]

    async def claim(
        self, *, job_entry: str, worker: str, request_id: str, route: str, model: str, metadata: dict[str, str],
        normalizer_version: str, contract_version: str,
    ) -> ClaimInfo:  # fmt: skip
        res = await self._call(
            self._claim,
            [self.keys.status],
            [job_entry, worker, now_ms(), route, model, msgspec.json.encode(metadata), self.keys.raw,
             self.keys.events, self.maxlen, normalizer_version, contract_version, request_id],
        )  # fmt: skip
        f = [x.decode() if isinstance(x, bytes) else str(x) for x in res]  # type: ignore[attr-defined]
        self.epoch = int(f[1])
        return ClaimInfo(f[0], int(f[1]), int(f[2]), f[3] == "1", f[4] == "1", f[5] == "1")

    def _append_call(self, attempt: int, batch: PendingBatch) -> tuple[list[str], list[object]]:
        return self._append_keys, [self.epoch, attempt, self.maxlen, _PACK(batch.raw), _PACK(batch.events)]

    async def append(self, attempt: int, batch: PendingBatch) -> None:
        """Raises ``Fenced`` or ``StorageError``."""
        if not len(batch):
            return
        keys, args = self._append_call(attempt, batch)
        fn: Callable[[list[str], list[Any]], Awaitable[object]] = (
            self.mux.call if self.mux is not None else cast(AsyncScript, self._append)
        )
        try:  # the first try without the retry wrapper's closures: this runs once per batch
            res = await fn(keys, args)
        except _TRANSIENT:
            self.redis_retries += 1
            res = await self._call(fn, keys, args)
        self.check_append(res)

    def send_append(self, attempt: int, batch: PendingBatch) -> asyncio.Future[Any] | None:
        """Send one append without waiting for it: its reply's future (give its result to
        ``check_append``; on an error, ``append`` the same batch again: appends are idempotent), or None
        when only ``append`` can send it now."""
        mux = self.mux
        if mux is None:
            return None
        head = self._head
        if head is None or head[0] != (self.epoch, attempt):
            fixed = (self.epoch, attempt)
            head = self._head = (fixed, mux.append_head(self._append_keys, [*fixed, self.maxlen]))
        return mux.send_nowait(head[1], _PACK(batch.raw), _PACK(batch.events))

    def check_append(self, res: object) -> None:
        """Raises ``Fenced`` when the reply says the request was taken over."""
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        self.appends += 1

    async def finalize(self, ttl: int, fields: dict[str, str | int]) -> None:
        """Set the final status fields and the retention TTL. Raises ``Fenced`` or ``StorageError``."""
        flat: list[object] = []
        for k, v in fields.items():
            flat += [k, v]
        res = await self._call(
            self._finalize, [self.keys.status, self.keys.raw, self.keys.events], [self.epoch, ttl, *flat]
        )
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
