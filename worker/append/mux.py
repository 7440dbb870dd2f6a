"""Every stream's appends share one Redis connection (``AppendMux``); claims and finalizes get a second.

Rule: calls made while a write is pending go out together, so a busy worker makes few large writes
instead of one per stream per event, and an idle one sends each append at once (no tick: nothing is held
back). Each call keeps its own result: a fenced or failed append affects only its own stream. Plain TCP
and Unix-socket Redis go through the hand-packed ``RedisPipe``; anything else redis-py connects (TLS,
...) through one redis-py pipeline at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import hiredis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError
from redis.typing import EncodableT

from sluice.worker import scripts
from sluice.worker.append.pipe import RedisPipe, direct_pipe_possible

__all__ = ["AppendMux"]

_TWO_EMPTY = b"$0\r\n\r\n$0\r\n\r\n"  # how pack_command ends with two empty arguments


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


