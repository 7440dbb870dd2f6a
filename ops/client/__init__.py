"""The Python client backend services use: enqueue a job, follow its events, wait for its result,
cancel it.

Rule: the same request_id enqueued twice runs once (the status record is created with HSETNX before the
job entry is added). Positions in a request's event log are the stream entry ids ``<attempt>-<seq>``;
``events()`` follows every attempt in order and ends after the terminal event of the final attempt.
Everything the client raises is a ``SluiceError``: ``InvalidJob``, ``UnknownRequest``, ``ResultTimeout``,
``RedisUnavailable`` (connection or timeout) and ``RedisCommandError`` (Redis refused a command), never
redis-py's or msgspec's own exceptions. A status comes back as a typed ``Status``. On a Redis Cluster
(``cluster=True``) a job goes to its request's job shard (``sluice.schemas.keys``); the shard count is the one
the deployment recorded (``job_shards=None``) or the one given, checked against it.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, cast

import anyio
import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, WatchError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.client.terminals import Terminal, TerminalFeed
from sluice.normalizer.assemble import assemble
from sluice.schemas.errors import JobError
from sluice.schemas.events import Event, StreamDone, StreamError, decode_event
from sluice.schemas.jobs import DEFAULT_MAX_JOB_BYTES, JOB_FIELD, Job, decode_job, encode_job
from sluice.schemas.keys import REQUEST_ID_RULE, Keys, Position, valid_request_id
from sluice.schemas.replies import range_entries, read_entries
from sluice.schemas.result import Result
from sluice.schemas.states import TERMINAL_STATES
from sluice.schemas.status import Status
from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import AnyRedis, connect, is_cluster

__all__ = [
    "TERMINAL_STATES",
    "InvalidJob",
    "LayoutMismatch",
    "RedisCommandError",
    "RedisUnavailable",
    "ResultTimeout",
    "SluiceClient",
    "SluiceError",
    "Status",
    "Terminal",
    "TerminalFeed",
    "UnknownRequest",
]

_BLOCK_MS = 1000


class SluiceError(Exception):
    """Everything the client raises."""


class InvalidJob(SluiceError, ValueError):
    """The job does not decode as a job, or is over the size limit; nothing was enqueued."""


class UnknownRequest(SluiceError, LookupError):
    """No status record for this request id (never enqueued, or expired after the retention time)."""


class ResultTimeout(SluiceError, TimeoutError):
    """The request had no terminal status within the timeout (it may still finish)."""


class RedisUnavailable(SluiceError, ConnectionError):
    """Redis could not be reached, or did not answer in time."""


class LayoutMismatch(SluiceError, ValueError):
    """The job shard count given to the client differs from the one the deployment recorded."""


class RedisCommandError(SluiceError):
    """Redis answered with an error (e.g. an ACL refusal, or a key of the wrong type)."""


@contextlib.contextmanager
def _job_errors() -> Iterator[None]:
    """What encoding or decoding a job can raise, as ``InvalidJob`` with one line naming the cause."""
    try:
        yield
    except JobError as exc:
        raise InvalidJob(str(exc)) from None
    except TypeError as exc:  # a value JSON cannot hold
        raise InvalidJob(f"invalid job: {exc}") from None
    except UnicodeEncodeError as exc:
        where = exc.object[exc.start : exc.end]
        raise InvalidJob(f"invalid job: text that is not valid Unicode ({exc.reason}: {where!a})") from None
    except RecursionError:
        raise InvalidJob("invalid job: it nests too deeply to encode") from None


def _unknown_form(request_id: str) -> UnknownRequest:
    return UnknownRequest(f"no request can have the id {request_id!a}: request ids are {REQUEST_ID_RULE}")


@contextlib.contextmanager
def _redis_errors(where: str) -> Iterator[None]:
    """redis-py's exceptions as the client's own (one table, at this edge)."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise RedisUnavailable(f"Redis unreachable at {where} ({exc})") from exc
    except RedisError as exc:
        raise RedisCommandError(f"Redis at {where} answered: {exc}") from exc


def _describe(redis: AnyRedis) -> str:
    """A given connection's address as a URL, its password masked (for error messages)."""
    if isinstance(redis, SluiceCluster):
        nodes = [redis.get_default_node(), *redis.get_nodes()]
        node = next((n for n in nodes if n is not None), None)
        return f"the Redis Cluster at {node.host}:{node.port}" if node else "a Redis Cluster"
    kw = redis.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}"
    scheme = "rediss" if "SSL" in redis.connection_pool.connection_class.__name__ else "redis"
    user, password = kw.get("username") or "", kw.get("password")
    auth = f"{user}:***@" if password else (f"{user}@" if user else "")
    return f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


class SluiceClient:
    def __init__(
        self,
        redis: AnyRedis | str,
        *,
        key_prefix: str = "sluice",
        retention_seconds: int = 86400,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
        cluster: bool = False,
        job_shards: int | None = None,
    ) -> None:
        """``redis``: a URL (with ``cluster``, of any node of a Redis Cluster) or a client. ``job_shards``: the
        deployment's shard count; None reads the one the workers recorded (1 when none is)."""
        from sluice.worker.redis.connect import safe_url

        self._where = safe_url(redis) if isinstance(redis, str) else _describe(redis)
        try:
            self.redis: AnyRedis = connect(redis, cluster=cluster) if isinstance(redis, str) else redis
        except ValueError as exc:
            raise RedisUnavailable(f"bad Redis URL {self._where}: {exc}") from None
        cluster = cluster or is_cluster(self.redis)
        self.keys = Keys(key_prefix, job_shards or 1, cluster)
        # The single-instance layout reads nothing more (a deployment sharding one Redis passes job_shards).
        self._layout_known = not self.keys.sharded
        self.retention_seconds = retention_seconds
        self.max_job_bytes = max_job_bytes

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def connect(self) -> Keys:
        """Learn (or check) the deployment's job shard count, once; the key layout. Raises ``LayoutMismatch``
        when a given ``job_shards`` differs from the recorded one, ``RedisUnavailable``, ``RedisCommandError``."""
        if self._layout_known:
            return self.keys
        from sluice.schemas.errors import ConfigError
        from sluice.worker.redis.connect import check_layout

        with _redis_errors(self._where):
            if self.keys.job_shards > 1 or not self.keys.cluster:
                try:
                    await check_layout(self.redis, self.keys)  # given explicitly: recorded or checked
                except ConfigError as exc:
                    raise LayoutMismatch(exc.message) from None
            else:
                stored = await self.redis.hget(self.keys.layout, "job_shards")
                if stored is not None and int(stored) != self.keys.job_shards:
                    self.keys = Keys(self.keys.prefix, int(stored), self.keys.cluster)
        self._layout_known = True
        return self.keys

    async def __aenter__(self) -> SluiceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def enqueue(self, job: Job | dict[str, Any]) -> str:
        """Put a job on the jobs stream; returns its request_id (generated when the job has none). Safe to
        call again with the same request_id after a failure (a lost reply included): the request runs once.
        Raises ``InvalidJob`` (naming the field at fault), ``RedisUnavailable``, ``RedisCommandError``."""
        with _job_errors():
            # A Job built by hand gets the same checks as a dict: what a worker's intake would refuse.
            encoded = msgspec.json.encode(job) if isinstance(job, dict) else encode_job(job)
            job = decode_job(encoded, max_bytes=self.max_job_bytes)
            rid = job.request_id or f"req_{uuid.uuid4().hex}"
            if job.request_id is None:
                job = msgspec.structs.replace(job, request_id=rid)
            payload = encode_job(job)
        if len(payload) > self.max_job_bytes:  # refused here rather than dead-lettered by a worker
            raise InvalidJob(f"job is {len(payload)} bytes, over the limit of {self.max_job_bytes}")
        status = self.keys.request(rid).status
        jobs = (await self.connect()).shard_for(rid).jobs
        with _redis_errors(self._where):
            if not await self.redis.hsetnx(status, "state", "queued"):
                state, entry = await self.redis.hmget(status, ["state", "job_entry"])
                if state != b"queued" or entry:
                    return rid  # known already: it runs once
                # Queued, but no job entry recorded: an earlier enqueue may have lost its XADD (or its reply)
                # or died before it. The job is added (again): workers run a request once however many
                # entries carry it (a claim finds it running or done and acks the duplicate).
            now = _now_ms()
            record: dict[str, str | int] = {"request_id": rid, "queued_at": now, "route": job.route}
            if self.keys.sharded:
                record["job_stream"] = jobs
            async with self.redis.pipeline(transaction=False) as p:
                p.hset(status, mapping=record)  # type: ignore[arg-type]
                p.expire(status, self.retention_seconds)
                p.xadd(jobs, {JOB_FIELD: payload})
                res = await p.execute()
            await self.redis.hsetnx(status, "job_entry", _s(res[2]))
        return rid

    def terminals(
        self,
        group: str,
        consumer: str,
        *,
        start: str = "0",
        count: int = 100,
        block_ms: int = _BLOCK_MS,
        claim_idle_ms: int | None = 60_000,
    ) -> TerminalFeed:
        """The terminal feed across every shard, read as ``consumer`` of the consumer group ``group`` (created
        at ``start`` when new): ``async with client.terminals("billing", "b-1") as feed: async for t in feed:
        ...; await feed.ack(t)``. Unacknowledged entries come again (``sluice.client.terminals`` says how)."""
        return _TerminalFeed(
            self, group, consumer, start=start, count=count, block_ms=block_ms, claim_idle_ms=claim_idle_ms
        )

    async def status_record(self, request_id: str) -> dict[str, str]:
        """The status hash as stored (all strings); ``{}`` for an unknown request."""
        if not valid_request_id(request_id):
            return {}  # no request can have it
        with _redis_errors(self._where):
            raw = await self.redis.hgetall(self.keys.request(request_id).status)
        return {_s(k): _s(v) for k, v in raw.items()}

    async def status(self, request_id: str) -> Status:
        """The typed status. Raises ``UnknownRequest``, ``RedisUnavailable``, ``RedisCommandError``."""
        if not valid_request_id(request_id):
            raise _unknown_form(request_id)
        record = await self.status_record(request_id)
        if not record:
            raise UnknownRequest(f"unknown request {request_id} (no status record)")
        record.setdefault("request_id", request_id)
        try:
            return Status.from_record(record)
        except msgspec.ValidationError as exc:
            raise RedisCommandError(f"request {request_id}: the status record does not parse ({exc})") from None

    async def cancel(self, request_id: str) -> bool:
        """Ask the owning worker to close the upstream and end the request ``interrupted`` / ``cancelled``;
        a request still queued is never sent upstream. Returns False, writing nothing, for a request that
        already finished or is unknown."""
        if not valid_request_id(request_id):
            return False
        status = self.keys.request(request_id).status
        with _redis_errors(self._where):
            # Flag it only if it has not finished, in one optimistic transaction (WATCH: a finish between the
            # check and the write makes EXEC fail, and the check runs again). No script: a producer's ACL
            # needs no EVAL.
            async with self.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        await pipe.watch(status)
                        state = _s(await pipe.hget(status, "state"))
                        if not state or state in TERMINAL_STATES:
                            await cast(Any, pipe).unwatch()  # redis-py leaves these two untyped
                            return False
                        cast(Any, pipe).multi()
                        pipe.hset(status, "cancel", "1")
                        await pipe.execute()
                        break
                    except WatchError:
                        continue
            await self.redis.xadd(
                self.keys.control, {"action": "cancel", "request_id": request_id}, maxlen=10_000, approximate=True
            )
        return True

    async def events(self, request_id: str, after: str | int = 0, *, block_ms: int = _BLOCK_MS) -> AsyncIterator[Event]:
        """Follow the normalized stream live, from just after ``after`` (a position ``<attempt>-<seq>``,
        or a seq of attempt 1), until the terminal event of the final attempt. Raises ``UnknownRequest``."""
        if not valid_request_id(request_id):
            raise _unknown_form(request_id)
        keys = self.keys.request(request_id)
        pos = str(Position(1, after)) if isinstance(after, int) else after
        if pos == "1-0":
            pos = "0-0"
        while True:
            with _redis_errors(self._where):
                entries = read_entries(await self.redis.xread({keys.events: pos}, count=500, block=block_ms))
            for entry_id, fields in entries:
                pos = _s(entry_id)
                ev = decode_event(fields[b"event"])
                yield ev
                if isinstance(ev, StreamDone | StreamError) and await self._is_final(request_id, pos):
                    return
            if not entries:
                await self.status(request_id)  # raises UnknownRequest

    async def _is_final(self, request_id: str, position: str) -> bool:
        """A terminal event ends the request only when no later attempt follows it."""
        while True:
            st = await self.status(request_id)
            attempt = Position.from_entry_id(position).attempt
            if st.attempt > attempt:
                return False
            if st.terminal:
                return st.attempt == attempt
            await anyio.sleep(0.02)  # the worker decides between retry and finalize right after the event

    async def read_attempt(self, request_id: str, attempt: int) -> list[Event]:
        if not valid_request_id(request_id):
            return []
        with _redis_errors(self._where):
            resp = await self.redis.xrange(self.keys.request(request_id).events, *Position.attempt_range(attempt))
        return [decode_event(f[b"event"]) for _, f in range_entries(resp)]

    async def result(self, request_id: str, timeout: float = 60.0) -> Result:  # noqa: ASYNC109
        """Wait for the terminal status; return the final attempt's assembled result.

        A request with no status record yet (a job added with a plain XADD that no worker has claimed) is
        waited for like any other. Raises ``ResultTimeout``, or ``UnknownRequest`` when the request was never
        heard of by the end of the timeout (at once for an id no request can have)."""
        if not valid_request_id(request_id):
            raise _unknown_form(request_id)
        st: Status | None = None
        try:
            with anyio.fail_after(timeout):
                while st is None or not st.terminal:
                    with contextlib.suppress(UnknownRequest):
                        st = await self.status(request_id)
                    if st is None or not st.terminal:
                        await anyio.sleep(0.05)
        except TimeoutError:
            if st is None:
                raise UnknownRequest(f"unknown request {request_id}") from None
            raise ResultTimeout(f"request {request_id} is still {st.state} after {timeout:g}s") from None
        return assemble(await self.read_attempt(request_id, st.attempt or 1))


class _TerminalFeed(TerminalFeed):
    """A feed that learns the client's layout before it opens."""

    def __init__(self, client: SluiceClient, group: str, consumer: str, **kw: object) -> None:
        super().__init__(client.redis, client.keys, group, consumer, **kw)  # type: ignore[arg-type]
        self._client = client

    async def __aenter__(self) -> TerminalFeed:
        self.keys = await self._client.connect()
        with _redis_errors(self._client._where):
            return await super().__aenter__()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
