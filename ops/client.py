"""The Python client backend services use: enqueue a job, follow its events, wait for its result,
cancel it.

Rule: the same request_id enqueued twice runs once (the status record is created with HSETNX before the
job entry is added). Positions in a request's event log are the stream entry ids ``<attempt>-<seq>``;
``events()`` follows every attempt in order and ends after the terminal event of the final attempt.
On a Redis Cluster (``cluster=True``) a job goes to its request's job shard (``sluice.schemas.keys``); the
shard count is the one the deployment recorded (``job_shards=None``) or the one given, checked against it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec

from sluice.normalizer.assemble import assemble
from sluice.schemas.errors import JobError
from sluice.schemas.events import Event, StreamDone, StreamError, decode_event
from sluice.schemas.jobs import DEFAULT_MAX_JOB_BYTES, JOB_FIELD, Job, encode_job
from sluice.schemas.keys import Keys
from sluice.schemas.replies import range_entries, read_entries
from sluice.schemas.result import Result
from sluice.terminals import Terminal, TerminalFeed
from sluice.worker.cluster import AnyRedis, connect, is_cluster

__all__ = ["TERMINAL_STATES", "SluiceClient", "Terminal", "TerminalFeed"]

TERMINAL_STATES = frozenset({"completed", "failed", "interrupted"})
_BLOCK_MS = 1000
_MAX_SEQ = 2**64 - 1


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


class SluiceClient:
    def __init__(
        self, redis: AnyRedis | str, *, key_prefix: str = "sluice", retention_seconds: int = 86400,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES, cluster: bool = False, job_shards: int | None = None,
    ) -> None:  # fmt: skip
        """``redis``: a URL (with ``cluster``, of any node of a Redis Cluster) or a client. ``job_shards``: the
        deployment's shard count; None reads the one the workers recorded (1 when none is)."""
        self.redis: AnyRedis = connect(redis, cluster=cluster) if isinstance(redis, str) else redis
        cluster = cluster or is_cluster(self.redis)
        self.keys = Keys(key_prefix, job_shards or 1, cluster)
        # The single-instance layout reads nothing more (a deployment sharding one Redis passes job_shards).
        self._layout_known = not self.keys.sharded
        self.retention_seconds = retention_seconds
        self.max_job_bytes = max_job_bytes

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def connect(self) -> Keys:
        """Learn (or check) the deployment's job shard count, once; the key layout. Raises
        ``ConfigError`` when a given ``job_shards`` differs from the recorded one."""
        if self._layout_known:
            return self.keys
        from sluice.worker.consumer import check_layout

        if self.keys.job_shards > 1 or not self.keys.cluster:
            await check_layout(self.redis, self.keys)  # given explicitly: recorded or checked
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
        """Put a job on the jobs stream; returns its request_id (generated when the job has none)."""
        if isinstance(job, dict):
            job = msgspec.convert(job, Job)
        rid = job.request_id or f"req_{uuid.uuid4().hex}"
        if job.request_id is None:
            job = msgspec.structs.replace(job, request_id=rid)
        payload = encode_job(job)
        if len(payload) > self.max_job_bytes:  # refused here rather than dead-lettered by a worker
            raise JobError(f"job is {len(payload)} bytes, over the limit of {self.max_job_bytes}")
        status = self.keys.request(rid).status
        jobs = (await self.connect()).shard_for(rid).jobs
        if not await self.redis.hsetnx(status, "state", "queued"):
            return rid  # known already: it runs once
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
        self, group: str, consumer: str, *, start: str = "0", count: int = 100, block_ms: int = _BLOCK_MS,
        claim_idle_ms: int | None = 60_000,
    ) -> TerminalFeed:  # fmt: skip
        """The terminal feed across every shard, read as ``consumer`` of the consumer group ``group`` (created
        at ``start`` when new): ``async with client.terminals("billing", "b-1") as feed: async for t in feed:
        ...; await feed.ack(t)``. Unacknowledged entries come again (``sluice.terminals`` says how)."""
        return _TerminalFeed(self, group, consumer, start=start, count=count, block_ms=block_ms,
                             claim_idle_ms=claim_idle_ms)  # fmt: skip

    async def status(self, request_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.request(request_id).status)
        return {_s(k): _s(v) for k, v in raw.items()}

    async def cancel(self, request_id: str) -> bool:
        """Ask the owning worker to close the upstream and end the request ``interrupted`` / ``cancelled``;
        a request still queued is never sent upstream. Returns False for an unknown request."""
        status = self.keys.request(request_id).status
        if not await self.redis.exists(status):
            return False
        await self.redis.hset(status, "cancel", "1")
        await self.redis.xadd(
            self.keys.control, {"action": "cancel", "request_id": request_id}, maxlen=10_000, approximate=True
        )
        return True

    async def events(self, request_id: str, after: str | int = 0, *, block_ms: int = _BLOCK_MS) -> AsyncIterator[Event]:
        """Follow the normalized stream live, from just after ``after`` (a position ``<attempt>-<seq>``,
        or a seq of attempt 1), until the terminal event of the final attempt."""
        keys = self.keys.request(request_id)
        pos = f"1-{after}" if isinstance(after, int) else after
        if pos == "1-0":
            pos = "0-0"
        while True:
            entries = read_entries(await self.redis.xread({keys.events: pos}, count=500, block=block_ms))
            for entry_id, fields in entries:
                pos = _s(entry_id)
                ev = decode_event(fields[b"event"])
                yield ev
                if isinstance(ev, StreamDone | StreamError) and await self._is_final(request_id, pos):
                    return
            if not entries:
                st = await self.status(request_id)
                if not st:
                    raise LookupError(f"unknown request {request_id}")

    async def _is_final(self, request_id: str, position: str) -> bool:
        """A terminal event ends the request only when no later attempt follows it."""
        while True:
            st = await self.status(request_id)
            attempt = int(position.split("-")[0])
            if int(st.get("attempt", "0") or 0) > attempt:
                return False
            if st.get("state") in TERMINAL_STATES:
                return int(st.get("attempt", "0") or 0) == attempt
            await anyio.sleep(0.02)  # the worker decides between retry and finalize right after the event

    async def read_attempt(self, request_id: str, attempt: int) -> list[Event]:
        resp = await self.redis.xrange(self.keys.request(request_id).events, f"{attempt}-0", f"{attempt}-{_MAX_SEQ}")
        return [decode_event(f[b"event"]) for _, f in range_entries(resp)]

    async def result(self, request_id: str, timeout: float = 60.0) -> Result:  # noqa: ASYNC109
        """Wait for the terminal status; return the final attempt's assembled result.

        A request with no status record yet (a job added with a plain XADD that no worker has claimed) is
        waited for like any other. Raises ``TimeoutError``, or ``LookupError`` when the request was never
        heard of by the end of the timeout."""
        seen = False
        try:
            with anyio.fail_after(timeout):
                while True:
                    st = await self.status(request_id)
                    seen = seen or bool(st)
                    if st.get("state") in TERMINAL_STATES:
                        break
                    await anyio.sleep(0.05)
        except TimeoutError:
            if not seen:
                raise LookupError(f"unknown request {request_id}") from None
            raise
        return assemble(await self.read_attempt(request_id, int(st.get("attempt") or 1)))


class _TerminalFeed(TerminalFeed):
    """A feed that learns the client's layout before it opens."""

    def __init__(self, client: SluiceClient, group: str, consumer: str, **kw: object) -> None:
        super().__init__(client.redis, client.keys, group, consumer, **kw)  # type: ignore[arg-type]
        self._client = client

    async def __aenter__(self) -> TerminalFeed:
        self.keys = await self._client.connect()
        return await super().__aenter__()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
