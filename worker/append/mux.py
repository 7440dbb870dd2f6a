"""Every stream's appends share one Redis connection (``AppendMux``); claims and finalizes get a second,
and finalizes that wait for replicas (``durability = "replica"``) a third.

Rule: calls made while a write is pending go out together, so a busy worker makes few large writes
instead of one per stream per event, and an idle one sends each append at once (no tick: nothing is held
back). Each call keeps its own result: a fenced or failed append affects only its own stream. Plain TCP
and Unix-socket Redis go through the hand-packed ``RedisPipe``; anything else redis-py connects (TLS,
...) through one redis-py pipeline at a time. On a Redis Cluster the same three connections exist per
master, chosen by the request's slot (``sluice.worker.append.route``), unless ``cluster_appends`` asks for
redis-py's cluster pipelines for the appends.
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

from sluice.schemas.keys import key_slot
from sluice.worker import scripts
from sluice.worker.append.pipe import RedisPipe, direct_pipe_possible
from sluice.worker.append.route import SlotRouter
from sluice.worker.cluster import AnyRedis

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

    def __init__(
        self, redis: AnyRedis, *, socket_timeout: float = 10.0, connect_timeout: float = 10.0,
        router: SlotRouter | None = None, routed_appends: bool = True,
    ) -> None:  # fmt: skip
        """``router``: a cluster's masters (claims, finalizes and WAITs go through it; appends too when
        ``routed_appends``, else through ``redis``, a cluster client)."""
        self.redis = redis
        self.script = redis.register_script(scripts.APPEND)
        self.router = router
        self.routed_appends = router is not None and routed_appends

        def direct() -> RedisPipe | None:
            if router is not None or not isinstance(redis, aioredis.Redis) or not direct_pipe_possible(redis):
                return None
            return RedisPipe(redis, socket_timeout=socket_timeout, connect_timeout=connect_timeout)

        self.pipe = direct()
        # Claims and finalizes get a direct connection of their own: not behind other streams' bulk appends
        # when Redis is slow, and not through redis-py (about 2 ms of CPU per request at 1,000 streams).
        self.control = direct()
        # Finalizes followed by WAIT (durability = "replica"): a WAIT holds its connection until replicas
        # answer, so not on the claims' connection. Opened on first use.
        self.durable = direct()
        self._scripts: dict[str, AsyncScript] = {}
        self._pending: list[_Call] = []
        self._wake = anyio.Event()

    def append_head(self, keys: list[str], args: list[object]) -> bytes:
        """The RESP of an append call up to its two packed batch arguments, which ``send_nowait`` adds: the
        same bytes for every batch of an attempt, so they are packed once."""
        packed: bytes = hiredis.pack_command(("EVALSHA", self.script.sha, len(keys), *keys, *args, b"", b""))  # type: ignore[arg-type]
        return packed[: -len(_TWO_EMPTY)]

    def send_nowait(self, head: bytes, raw: bytes, events: bytes, slot: int = 0) -> asyncio.Future[Any] | None:
        """Send one append (``append_head``'s bytes and the packed batch) without waiting for its reply:
        its future, or None when that is not possible now (no direct connection yet, or redis-py's
        pipeline): then ``call``. On a cluster ``slot`` picks the master (a redirect fails the future; the
        waiting ``call`` then follows it)."""
        pipe = self.pipe
        if pipe is None:
            if not self.routed_appends:
                return None
            assert self.router is not None
            pipe = self.router.pipe_now("append", slot)
            if pipe is None:
                return None
        packed = b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n" % (head, len(raw), raw, len(events), events)
        return pipe.send_packed_nowait(packed)

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
        router = self.router
        if router is not None:

            async def routed(keys: list[str], args: list[object]) -> object:
                res, _ = await router.evalsha("control", key_slot(keys[0]), script.sha, source, keys, args)
                return res

            return routed
        control = self.control
        if control is None:
            return script

        async def run(keys: list[str], args: list[object]) -> object:
            return await _evalsha(control, script.sha, source, keys, args)

        return run

    async def run_and_wait(
        self, source: str, keys: list[str], args: list[object], replicas: int, timeout_ms: int
    ) -> tuple[object, int]:
        """Run a script, then ``WAIT replicas timeout_ms`` on the same connection (so it counts the replicas
        holding every earlier write to that master, the request's appends included): (reply, replicas that
        acknowledged). Raises what Redis raised."""
        script = self.registered(source)
        if self.router is not None:
            res, acked = await self.router.evalsha(
                "durable", key_slot(keys[0]), script.sha, source, keys, args, wait=(replicas, timeout_ms)
            )
            return res, int(acked or 0)
        if self.durable is not None:
            cmd = ("EVALSHA", script.sha, len(keys), *keys, *args)
            try:
                res, acked = await self.durable.request(cmd, wait=(replicas, timeout_ms))  # type: ignore[arg-type]
            except NoScriptError:
                await self.durable.call("SCRIPT", "LOAD", source)
                res, acked = await self.durable.request(cmd, wait=(replicas, timeout_ms))  # type: ignore[arg-type]
            return res, int(acked or 0)
        if not isinstance(self.redis, aioredis.Redis):
            raise RuntimeError("WAIT on a cluster needs the routed connections")
        for _ in range(2):
            async with self.redis.pipeline(transaction=False) as p:  # one connection: WAIT follows the script
                p.evalsha(script.sha, len(keys), *keys, *cast(list[EncodableT], args))
                p.execute_command("WAIT", replicas, timeout_ms)
                res, acked = await p.execute(raise_on_error=False)
            if not isinstance(res, NoScriptError):
                break
            await self.redis.script_load(source)  # a pipeline does not load a missing script itself
        for reply in (res, acked):
            if isinstance(reply, Exception):
                raise reply
        return res, int(cast(int, acked))

    async def call(self, keys: list[str], args: list[object], slot: int = 0) -> object:
        """Run the append script; raises what Redis raised for this call."""
        if self.pipe is not None:
            return await _evalsha(self.pipe, self.script.sha, scripts.APPEND, keys, args)
        if self.routed_appends:
            assert self.router is not None
            res, _ = await self.router.evalsha("append", slot, self.script.sha, scripts.APPEND, keys, args)
            return res
        c = _Call(keys, args)
        self._pending.append(c)
        self._wake.set()
        await c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    async def run(self) -> None:
        try:
            if self.pipe is not None or self.routed_appends:
                await anyio.sleep_forever()
            else:
                await self._serve_batches()  # the appends go through redis-py's pipelines
        finally:
            for pipe in (self.pipe, self.control, self.durable):
                if pipe is not None:
                    pipe.close()
            if self.router is not None:
                self.router.close()

    async def _serve_batches(self) -> None:
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
                # Not pipe.evalsha(): redis-py's cluster pipeline refuses it by name, and routes the raw command.
                pipe.execute_command("EVALSHA", self.script.sha, len(c.keys), *c.keys, *cast(list[EncodableT], c.args))
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


