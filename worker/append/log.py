"""One request's scripts: claim it, append batches to its logs, finalize its status, publish its terminal.

Rule: every call is one idempotent, fenced script (``sluice.worker.scripts``) retried until Redis answers
or the outage limit passes (then ``StorageError``); a refused epoch raises ``Fenced`` and the caller must
stop at once. Nothing here reorders: the seq is the order. After an append failed (a broken connection, a
lost reply, a redirect), the next one first checks that the streams still reach the last entries acknowledged
before (``APPEND_AFTER``): a failover may have lost them, and ``LogLost`` is raised instead of appending
after a hole.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
from redis.commands.core import AsyncScript

from sluice.schemas.keys import RequestKeys, key_slot
from sluice.worker import scripts
from sluice.worker.append.batch import PendingBatch
from sluice.worker.append.mux import AppendMux
from sluice.worker.clock import now_ms
from sluice.worker.cluster import AnyRedis
from sluice.worker.redis_calls import Fenced, LogLost, is_transient, with_retry

__all__ = ["ClaimInfo", "RequestLog"]


@dataclass(slots=True)
class ClaimInfo:
    outcome: str  # run | takeover | duplicate | done
    epoch: int
    attempt: int
    visible: bool
    cancel: bool
    published: bool


class RequestLog:
    def __init__(
        self, redis: AnyRedis, keys: RequestKeys, *, maxlen: int = 0, outage_limit: float = 30.0,
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
        self._publish = mux.runner(scripts.PUBLISH) if mux else redis.register_script(scripts.PUBLISH)
        self._append_keys = [keys.status, keys.raw, keys.events]
        self.slot = key_slot(keys.status)  # every key of the request shares it (one hash tag)
        self._head: tuple[tuple[int, int], bytes] | None = None  # (epoch, attempt) and its append_head
        self.epoch = 0
        self.appends = 0
        self.redis_retries = 0
        # The last raw index and seq acknowledged per attempt (-1: none), and whether the next append checks
        # that Redis still holds them.
        self.stored: dict[int, tuple[int, int]] = {}
        self.verify_next = False

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
        normalizer_version: str, contract_version: str, job_stream: str = "",
    ) -> ClaimInfo:  # fmt: skip
        """Mark the request running under a new epoch (or learn it is done, a duplicate, or a takeover).
        The token makes a claim sent again after a lost reply answer as the first one did."""
        token = f"{worker}:{uuid.uuid4().hex}"
        res = await self._call(
            self._claim,
            [self.keys.status],
            [token, job_entry, worker, now_ms(), route, model, msgspec.json.encode(metadata), self.keys.raw,
             self.keys.events, self.maxlen, normalizer_version, contract_version, request_id, job_stream],
        )  # fmt: skip
        f = [x.decode() if isinstance(x, bytes) else str(x) for x in res]  # type: ignore[attr-defined]
        self.epoch = int(f[1])
        return ClaimInfo(f[0], int(f[1]), int(f[2]), f[3] == "1", f[4] == "1", f[5] == "1")

    def _append_call(self, attempt: int, batch: PendingBatch) -> tuple[list[str], list[object]]:
        return self._append_keys, [self.epoch, attempt, self.maxlen, *batch.packed(), *batch.blobs]

    async def append(self, attempt: int, batch: PendingBatch) -> None:
        """Raises ``Fenced``, ``LogLost`` or ``StorageError``."""
        if not len(batch):
            return
        keys, args = self._append_call(attempt, batch)
        if self.verify_next:
            res = await self._append_after(attempt, keys, args)
        else:
            fn: Callable[..., Awaitable[object]] = self._routed_append if self.mux is not None else cast(
                AsyncScript, self._append
            )
            try:  # the first try without the retry wrapper's closures: this runs once per batch
                res = await fn(keys, args)
            except Exception as exc:
                if not is_transient(exc):
                    raise
                self.redis_retries += 1
                self.verify_next = True
                res = await self._append_after(attempt, keys, args)
        self.check_append(res, attempt, batch)

    async def _append_after(self, attempt: int, keys: list[str], args: list[object]) -> object:
        raw, seq = self.stored.get(attempt, (-1, -1))
        fn = self.mux.runner(scripts.APPEND_AFTER) if self.mux else self.redis.register_script(scripts.APPEND_AFTER)
        res = await self._call(fn, keys, [*args, f"{raw} {seq}"])
        if res in (b"gap", "gap"):
            raise LogLost(
                f"Redis no longer holds appends it acknowledged (raw {raw}, seq {seq} of attempt {attempt}): "
                "a failover lost them", attempt,
            )  # fmt: skip
        return res

    async def _routed_append(self, keys: list[str], args: list[object]) -> object:
        assert self.mux is not None
        return await self.mux.call(keys, args, self.slot)

    def send_append(self, attempt: int, batch: PendingBatch) -> asyncio.Future[Any] | None:
        """Send one append without waiting for it: its reply's future (give its result to
        ``check_append``; on an error, ``append`` the same batch again: appends are idempotent), or None
        when only ``append`` can send it now."""
        mux = self.mux
        if mux is None or batch.blobs:  # the packed head has room for the two batch arguments only
            return None
        head = self._head
        if head is None or head[0] != (self.epoch, attempt):
            fixed = (self.epoch, attempt)
            head = self._head = (fixed, mux.append_head(self._append_keys, [*fixed, self.maxlen]))
        return mux.send_nowait(head[1], *batch.packed(), self.slot)

    def check_append(self, res: object, attempt: int, batch: PendingBatch) -> None:
        """Raises ``Fenced`` when the reply says the request was taken over."""
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        self.appends += 1
        self.verify_next = False
        raw, seq = self.stored.get(attempt, (-1, -1))
        self.stored[attempt] = (
            batch.raw[-1][0] if batch.raw else raw, batch.events[-1][0] if batch.events else seq  # type: ignore[assignment]
        )

    def assume_stored(self, attempt: int, raw: int, seq: int) -> None:
        """What Redis holds of the attempt now (read back after ``LogLost``): the next append follows it."""
        self.stored[attempt] = (raw, seq)
        self.verify_next = False

    async def finalize(
        self, ttl: int, fields: dict[str, str | int], *, wait: tuple[int, int] | None = None
    ) -> int | None:
        """Set the final status fields and the retention TTL. With ``wait`` (replicas, timeout ms), WAIT on
        the connection that wrote them and return how many replicas acknowledged the request's writes.
        Raises ``Fenced`` or ``StorageError``."""
        flat: list[object] = []
        for k, v in fields.items():
            flat += [k, v]
        keys, args = [self.keys.status, self.keys.raw, self.keys.events], [self.epoch, ttl, *flat]
        acked: int | None = None
        if wait is None:
            res = await self._call(self._finalize, keys, args)
        else:
            res, acked = await self._call_and_wait(scripts.FINALIZE, keys, args, wait)
        if res in (b"fenced", "fenced"):
            raise Fenced(f"request {self.keys.status} was taken over (epoch {self.epoch} is stale)")
        return acked

    async def _call_and_wait(
        self, source: str, keys: list[str], args: list[object], wait: tuple[int, int]
    ) -> tuple[object, int]:
        """A script followed by WAIT on its connection, retried like ``_call`` (the scripts write even when
        sent again, so the WAIT always follows a write of its own connection)."""
        counter = [0]
        if self.mux is not None:
            mux = self.mux
            fn: Callable[[], Awaitable[tuple[object, int]]] = lambda: mux.run_and_wait(source, keys, args, *wait)  # noqa: E731
        else:
            fn = lambda: _pipeline_and_wait(self.redis, source, keys, args, wait)  # noqa: E731
        try:
            return await with_retry(fn, outage_limit=self.outage_limit, retries=counter)
        finally:
            self.redis_retries += counter[0]

    async def publish(
        self, stream: str, marker: str, ttl: int, entry: dict[str, str], *, wait: tuple[int, int] | None = None
    ) -> str:
        """Add the request's terminal-stream entry once (the marker holds its id): a call sent again after a
        lost reply returns the existing id. With ``wait``, WAIT for replicas after it (best effort: the
        count is not kept). Raises ``StorageError``."""
        flat: list[object] = []
        for k, v in entry.items():
            flat += [k, v]
        keys, args = [stream, marker], [ttl, _TERMINAL_MAXLEN, *flat]
        if wait is None:
            res = await self._call(self._publish, keys, args)
        else:
            res, _ = await self._call_and_wait(scripts.PUBLISH, keys, args, wait)
        return res.decode() if isinstance(res, bytes) else str(res)


_TERMINAL_MAXLEN = 1_000_000


async def _pipeline_and_wait(
    redis: Any, source: str, keys: list[str], args: list[object], wait: tuple[int, int]
) -> tuple[object, int]:
    """Without the worker's own connections (tests, tools): a script and WAIT in one redis-py pipeline, on
    one connection of a single-instance Redis."""
    await redis.script_load(source)
    sha = redis.register_script(source).sha
    async with redis.pipeline(transaction=False) as p:
        p.evalsha(sha, len(keys), *keys, *args)
        p.execute_command("WAIT", *wait)
        res, acked = await p.execute()
    return res, int(acked)
