"""Redis calls that survive a blip: retried with back-off until Redis answers or an outage limit passes.

Rule: only idempotent operations go through ``with_retry`` (every script of ``sluice.worker.scripts``,
XACK, reads), because a retried call may be one that already ran and lost its reply. A refused epoch is
``Fenced``: the request was taken over and this worker must stop writing at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.schemas.errors import StorageError, WorkerError

__all__ = ["TRANSIENT_REDIS_ERRORS", "Fenced", "is_transient", "with_retry"]

T = TypeVar("T")
TRANSIENT_REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def is_transient(exc: BaseException) -> bool:
    """A connection-level failure: the command may or may not have run, and sending it again is the cure.
    redis-py also lets a write on a connection that was just reset surface as uvloop's ``RuntimeError``
    ("unable to perform operation on <TCPTransport closed=True>") or, while it reconnects, as an
    ``AttributeError`` on its missing transport (``writelines``): those are connection failures too."""
    if isinstance(exc, TRANSIENT_REDIS_ERRORS):
        return True
    text = str(exc)
    if isinstance(exc, RuntimeError):
        return "unable to perform operation" in text or "handler is closed" in text
    return isinstance(exc, AttributeError) and "writelines" in text


class Fenced(WorkerError):
    """Another worker took this request over (its epoch is newer): this one must not write again."""

    code = "fenced"
    category = "worker_lost"


async def with_retry(fn: Callable[[], Awaitable[T]], *, outage_limit: float, retries: list[int] | None = None) -> T:
    """Run one idempotent Redis operation, retrying connection errors with back-off (redis-py reconnects
    on the next command). Raises ``StorageError`` once Redis stayed away past ``outage_limit`` seconds."""
    deadline = time.monotonic() + outage_limit
    delay = 0.05
    while True:
        try:
            return await fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            if retries is not None:
                retries[0] += 1
            if time.monotonic() + delay > deadline:
                raise StorageError(f"Redis unavailable for {outage_limit:.0f}s ({type(exc).__name__})") from exc
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)
