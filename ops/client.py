"""The Python client backend services use: enqueue a job, follow its events, wait for its result,
cancel it.

Rule: the same request_id enqueued twice runs once (the status record is created with HSETNX before the
job entry is added). Positions in a request's event log are the stream entry ids ``<attempt>-<seq>``;
``events()`` follows every attempt in order and ends after the terminal event of the final attempt.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgspec
import redis.asyncio as aioredis

from sluice.normalizer.assemble import assemble
from sluice.schemas.errors import JobError
from sluice.schemas.events import Event, StreamDone, StreamError, decode_event
from sluice.schemas.jobs import DEFAULT_MAX_JOB_BYTES, JOB_FIELD, Job, encode_job
from sluice.schemas.keys import Keys
from sluice.schemas.replies import range_entries, read_entries
from sluice.schemas.result import Result

__all__ = ["TERMINAL_STATES", "SluiceClient"]

TERMINAL_STATES = frozenset({"completed", "failed", "interrupted"})
_BLOCK_MS = 1000
_MAX_SEQ = 2**64 - 1


def _s(v: bytes | str | None) -> str:
    return v.decode() if isinstance(v, bytes) else (v or "")


class SluiceClient:
    def __init__(
        self, redis: aioredis.Redis | str, *, key_prefix: str = "sluice", retention_seconds: int = 86400,
        max_job_bytes: int = DEFAULT_MAX_JOB_BYTES,
    ) -> None:  # fmt: skip
        self.redis = aioredis.Redis.from_url(redis) if isinstance(redis, str) else redis
        self.keys = Keys(key_prefix)
        self.retention_seconds = retention_seconds
        self.max_job_bytes = max_job_bytes

    async def aclose(self) -> None:
        await self.redis.aclose()

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
        if not await self.redis.hsetnx(status, "state", "queued"):
            return rid  # known already: it runs once
        now = _now_ms()
        async with self.redis.pipeline(transaction=False) as p:
            p.hset(status, mapping={"request_id": rid, "queued_at": now, "route": job.route})
            p.expire(status, self.retention_seconds)
            p.xadd(self.keys.jobs, {JOB_FIELD: payload})
            res = await p.execute()
        await self.redis.hsetnx(status, "job_entry", _s(res[2]))
        return rid

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


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
