"""One request's scripts: claim it, append batches to its logs, finalize its status, publish its terminal.

Rule: every call is one idempotent, fenced script (``sluice.worker.scripts``) retried until Redis answers
or the outage limit passes (then ``StorageError``); a refused epoch raises ``Fenced`` and the caller must
stop at once. Nothing here reorders: the seq is the order.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from sluice.schemas.keys import RequestKeys
from sluice.worker import scripts
from sluice.worker.append.batch import PendingBatch
from sluice.worker.append.mux import AppendMux
from sluice.worker.clock import now_ms
from sluice.worker.redis_calls import TRANSIENT_REDIS_ERRORS, Fenced, with_retry

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
        self._publish = mux.runner(scripts.PUBLISH) if mux else redis.register_script(scripts.PUBLISH)
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
        """Mark the request running under a new epoch (or learn it is done, a duplicate, or a takeover).
        The token makes a claim sent again after a lost reply answer as the first one did."""
        token = f"{worker}:{uuid.uuid4().hex}"
        res = await self._call(
            self._claim,
            [self.keys.status],
            [token, job_entry, worker, now_ms(), route, model, msgspec.json.encode(metadata), self.keys.raw,
             self.keys.events, self.maxlen, normalizer_version, contract_version, request_id],
        )  # fmt: skip
        f = [x.decode() if isinstance(x, bytes) else str(x) for x in res]  # type: ignore[attr-defined]
        self.epoch = int(f[1])
        return ClaimInfo(f[0], int(f[1]), int(f[2]), f[3] == "1", f[4] == "1", f[5] == "1")

    def _append_call(self, attempt: int, batch: PendingBatch) -> tuple[list[str], list[object]]:
        return self._append_keys, [self.epoch, attempt, self.maxlen, *batch.packed(), *batch.blobs]

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
        except TRANSIENT_REDIS_ERRORS:
            self.redis_retries += 1
            res = await self._call(fn, keys, args)
        self.check_append(res)

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
        return mux.send_nowait(head[1], *batch.packed())

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

    async def publish(self, stream: str, marker: str, ttl: int, entry: dict[str, str]) -> str:
        """Add the request's terminal-stream entry once (the marker holds its id): a call sent again after a
        lost reply returns the existing id. Raises ``StorageError``."""
        flat: list[object] = []
        for k, v in entry.items():
            flat += [k, v]
        res = await self._call(self._publish, [stream, marker], [ttl, _TERMINAL_MAXLEN, *flat])
        return res.decode() if isinstance(res, bytes) else str(res)


_TERMINAL_MAXLEN = 1_000_000
