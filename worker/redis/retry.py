"""Redis calls that survive a blip: retried with back-off until Redis answers or an outage limit passes.

Rule: only idempotent operations go through ``with_retry`` (every script of ``sluice.worker.redis.scripts``,
XACK, reads), because a retried call may be one that already ran and lost its reply. A refused epoch is
``Fenced``: the request was taken over and this worker must stop writing at once.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from redis.exceptions import ClusterError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.schemas.errors import StorageError, WorkerError

__all__ = [
    "BACKOFF_FIRST",
    "BACKOFF_MAX",
    "TRANSIENT_REDIS_ERRORS",
    "Fenced",
    "LogLost",
    "LoopBackoff",
    "describe",
    "is_transient",
    "with_retry",
]

T = TypeVar("T")
# A cluster's CLUSTERDOWN (a failover under way), TRYAGAIN (a multi-key call during a slot migration) and
# a redirect loop pass like a connection loss.
TRANSIENT_REDIS_ERRORS = (
    RedisConnectionError,
    RedisTimeoutError,
    ConnectionError,
    OSError,
    ClusterError,
    TryAgainError,
)


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


class LogLost(WorkerError):
    """Redis no longer holds appends it acknowledged (a failover promoted a replica that had not received
    them): the attempt cannot go on without a gap in its log, so it ends where the stored log ends."""

    code = "log_lost"
    category = "transport"

    def __init__(self, message: str, attempt: int) -> None:
        super().__init__(message)
        self.attempt = attempt


async def with_retry(fn: Callable[[], Awaitable[T]], *, outage_limit: float) -> T:
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
            if time.monotonic() + delay > deadline:
                raise StorageError(f"Redis unavailable for {outage_limit:.0f}s ({type(exc).__name__})") from exc
            await anyio.sleep(delay)
            delay = min(delay * 2, 1.0)


# How long a process waits between tries while Redis does not answer: the worker's start-up and its
# background loops alike (0.5 s doubling to 30 s).
BACKOFF_FIRST, BACKOFF_MAX = 0.5, 30.0


def describe(exc: BaseException) -> str:
    """The failure for a log line: its class and the server's (or the socket's) own message."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class LoopBackoff:
    """A background loop's view of Redis failing (reading jobs, cancels, heartbeats): back-off between tries
    as start-up waits, and one log line per change of state (the first failure, a different failure, the
    recovery), with the server's message, instead of a line per try.

    ``failed`` logs when the state changed and returns the delay to wait before the next try (the caller
    sleeps: a loop paced by its own interval may not); ``ok`` logs the recovery once."""

    def __init__(self, logger: logging.Logger, what: str, **extra: object) -> None:
        self._log, self._what, self._extra = logger, what, extra
        self._state: str | None = None  # the failure being backed off, or None while Redis answers
        self._since = 0.0
        self.delay = BACKOFF_FIRST
        self.failures = 0

    @property
    def failing(self) -> bool:
        return self._state is not None

    def failed(self, exc: BaseException) -> float:
        # Connection failures are one state whatever the socket said; a server error is its message
        # (NOGROUP after Redis came back empty is news, a second connection refusal is not).
        state = type(exc).__name__ if is_transient(exc) else describe(exc)
        if state != self._state:
            if self._state is None:
                self._since = time.monotonic()
            else:
                self.delay = BACKOFF_FIRST  # another failure: Redis answered something, try again soon
            self._state = state
            self._log.warning(
                f"{self._what} failed ({describe(exc)}); retrying with back-off",
                extra={**self._extra, "retry_in": self.delay},
            )
        delay = self.delay
        self.delay = min(self.delay * 2, BACKOFF_MAX)
        self.failures += 1
        return delay

    def ok(self) -> None:
        if self._state is None:
            return
        self._log.info(
            f"{self._what} works again",
            extra={**self._extra, "after_s": round(time.monotonic() - self._since, 1), "failures": self.failures},
        )
        self._state, self.delay, self.failures = None, BACKOFF_FIRST, 0
