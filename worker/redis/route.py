"""The worker's own connections (appends; claims and finalizes; finalizes followed by WAIT) go to the master
of each request's slot: one hand-packed ``RedisPipe`` per purpose and master, routed by a slot map of our own.
A single instance is a cluster of one master (every slot is its own, no map to load), so this is the one
transport of the worker's scripts whatever the deployment; redis-py serves the other commands.

Rule: on a cluster the map comes from ``CLUSTER SLOTS`` (asked of any node we know, seeds first after a
failure) and is patched by every ``MOVED``; a connection failure marks it stale, so the next call reloads it
first (a failover: the replica that took over). An ``ASK`` is followed for that one call with ``ASKING`` and
the command in the same write on the target's connection (redis-py 8.1 sends them as two pool checkouts,
which loops when the target has two idle connections). ``TRYAGAIN`` (a multi-key script during a slot
migration) and ``CLUSTERDOWN`` are raised to the caller's retry policy. Every script sent through here is
idempotent, so a call whose reply was lost to a failover or a redirect can be sent again wherever the slot
lives now; a script the node lacks (a restart, a replica just promoted) is loaded and sent again.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import AskError, ClusterDownError, ClusterError, MovedError, NoScriptError
from redis.exceptions import ConnectionError as RedisConnectionError

from sluice.schemas.keys import SLOTS
from sluice.worker.redis.pipe import ConnectionChanged, Endpoint, RedisPipe
from sluice.worker.redis.retry import TRANSIENT_REDIS_ERRORS

__all__ = ["Address", "SlotRouter"]

Address = tuple[str, int]
_MAX_REDIRECTS = 16


class SlotRouter:
    def __init__(self, endpoint: Endpoint, *, cluster: bool, socket_timeout: float, connect_timeout: float) -> None:
        """``endpoint``: the single instance, or a cluster's seed node (its credentials and TLS hold for
        every node)."""
        self.cluster = cluster
        self._end = endpoint
        self._known: list[Address] = [endpoint.address]  # every node ever seen, seeds first
        self._socket_timeout, self._connect_timeout = socket_timeout, connect_timeout
        self._slots: list[Address | None] = [None if cluster else endpoint.address] * SLOTS
        self._pipes: dict[tuple[str, Address], RedisPipe] = {}
        self._stale = cluster
        self._suspect: set[Address] = set()  # failed lately: asked last when reloading
        self._refreshing: asyncio.Future[None] | None = None
        self.refreshes = 0
        self.redirects = 0
        # Changes whenever ``pipe_now``'s answer may change (the map patched or reloaded, marked stale, the
        # pipes closed), so a caller may keep its answer until then.
        self.map_version = 0

    @classmethod
    def for_url(cls, url: str, *, cluster: bool, socket_timeout: float, connect_timeout: float) -> SlotRouter:
        """The single instance or the cluster seed ``url`` names. Raises ``ValueError`` for a bad URL."""
        end = Endpoint.of(aioredis.Redis.from_url(url))  # host, port, credentials, TLS; no connection yet
        if cluster:
            end = replace(end, db=0, path="")  # a cluster has one database; its nodes speak TCP
        return cls(end, cluster=cluster, socket_timeout=socket_timeout, connect_timeout=connect_timeout)

    @classmethod
    def for_client(cls, redis: aioredis.Redis, *, socket_timeout: float, connect_timeout: float) -> SlotRouter:
        """The single instance a redis-py client connects to."""
        return cls(Endpoint.of(redis), cluster=False, socket_timeout=socket_timeout, connect_timeout=connect_timeout)

    # -- the map --------------------------------------------------------------------------------------------

    def master(self, slot: int) -> Address | None:
        return self._slots[slot]

    def masters(self) -> set[Address]:
        return {a for a in self._slots if a is not None}

    async def refresh(self) -> None:
        """Reload the slot map (one reload at a time; callers arriving meanwhile wait for it). Raises
        ``ConnectionError`` when no known node answers. A single instance has no map to load."""
        if not self.cluster:
            return
        if self._refreshing is not None:
            await asyncio.shield(self._refreshing)
            return
        self._refreshing = asyncio.get_running_loop().create_future()
        try:
            await self._reload()
        except BaseException as exc:
            self._refreshing.set_exception(exc if isinstance(exc, Exception) else ConnectionError("cancelled"))
            self._refreshing.exception()
            raise
        else:
            self._refreshing.set_result(None)
        finally:
            self._refreshing = None

    async def _reload(self) -> None:
        last: BaseException | None = None
        # Masters we route to first (the usual answerers), then every other node we know, seeds included.
        order = list(dict.fromkeys([*self.masters(), *self._known]))
        order.sort(key=lambda a: a in self._suspect)
        for addr in order:
            try:
                reply, _ = await self.pipe_at("meta", addr).request(("CLUSTER", "SLOTS"))
            except (*TRANSIENT_REDIS_ERRORS, ClusterError) as exc:
                self._suspect.add(addr)
                last = exc
                continue
            self._suspect.discard(addr)
            slots: list[Address | None] = [None] * SLOTS
            for row in reply:
                first, end, master = int(row[0]), int(row[1]), row[2]
                host = master[0].decode() if master[0] else addr[0]
                owner = (host, int(master[1]))
                slots[first : end + 1] = [owner] * (end - first + 1)
                for node in row[2:]:
                    seen = (node[0].decode() if node[0] else addr[0], int(node[1]))
                    if seen not in self._known:
                        self._known.append(seen)
            self._slots = slots
            self._stale = False
            self.map_version += 1
            self.refreshes += 1
            return
        raise ConnectionError(f"no Redis Cluster node answered CLUSTER SLOTS (last: {last!r})")

    # -- connections ----------------------------------------------------------------------------------------

    def pipe_at(self, purpose: str, addr: Address) -> RedisPipe:
        pipe = self._pipes.get((purpose, addr))
        if pipe is None:
            end = self._end if addr == self._end.address else self._end.at(addr)
            pipe = self._pipes[(purpose, addr)] = RedisPipe(
                endpoint=end, socket_timeout=self._socket_timeout, connect_timeout=self._connect_timeout
            )
        return pipe

    def pipe_now(self, purpose: str, slot: int) -> RedisPipe | None:
        """The connection to the slot's master if the map is fresh (else None: the caller takes the routed,
        waiting path, which reloads it). The same answer until ``map_version`` changes."""
        addr = self._slots[slot]
        if addr is None or self._stale:
            return None
        return self.pipe_at(purpose, addr)

    def close(self) -> None:
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()
        self.map_version += 1

    # -- routed calls -----------------------------------------------------------------------------------------

    async def evalsha(
        self,
        purpose: str,
        slot: int,
        sha: str,
        source: str,
        keys: list[str],
        args: list[object],
        *,
        wait: tuple[int, int] | None = None,
    ) -> tuple[Any, int | None]:
        """Run a script on the slot's master, following MOVED and ASK (and loading the script where a node
        lacks it, e.g. a replica just promoted); with ``wait``, a ``WAIT`` follows on the same connection:
        (reply, replicas acknowledged). Raises ``ConnectionError`` (the map is reloaded on the next call),
        ``TryAgainError``, ``ClusterDownError``, ``ClusterError`` (a redirect loop), ``ResponseError``."""
        reply, replicas, _ = await self._request(purpose, slot, ("EVALSHA", sha, len(keys), *keys, *args), source, wait)
        return reply, replicas

    async def evalsha_on(
        self,
        purpose: str,
        slot: int,
        sha: str,
        source: str,
        keys: list[str],
        args: list[object],
        connection: int | None,
    ) -> tuple[Any, int]:
        """``evalsha`` sent only on connection ``connection`` (None: any), so a reply that came on it before
        and this one come from the same server: (reply, the connection it went on). Raises as ``evalsha``,
        and ``ConnectionChanged`` (nothing sent) when that connection is gone or a redirect leads elsewhere."""
        reply, _, used = await self._request(
            purpose, slot, ("EVALSHA", sha, len(keys), *keys, *args), source, None, connection
        )
        return reply, used

    async def call(self, purpose: str, slot: int, *args: str | bytes | int | float) -> Any:
        """One plain command on the slot's master (a request's status read and flag, a job's ack), routed and
        redirected like ``evalsha``; its reply. Raises as ``evalsha``."""
        reply, _, _ = await self._request(purpose, slot, args, None, None)
        return reply

    async def _request(
        self,
        purpose: str,
        slot: int,
        cmd: tuple[Any, ...],
        source: str | None,
        wait: tuple[int, int] | None,
        connection: int | None = None,
    ) -> tuple[Any, int | None, int]:
        ask: Address | None = None
        for _ in range(_MAX_REDIRECTS):
            pipe = await self._pipe_for(purpose, slot, ask)
            try:
                used = await pipe.connect()
                if connection is not None and used != connection:
                    raise ConnectionChanged(f"connection {connection} is gone: slot {slot} is on connection {used}")
                try:
                    reply, replicas = await pipe.request(cmd, asking=ask is not None, wait=wait, connection=used)
                except NoScriptError:
                    if source is None:
                        raise
                    await pipe.request(("SCRIPT", "LOAD", source), connection=used)
                    reply, replicas = await pipe.request(cmd, asking=ask is not None, wait=wait, connection=used)
                return reply, replicas, used
            except MovedError as exc:  # before AskError: redis-py's MovedError is an AskError
                self.redirects += 1
                if not self.cluster:
                    raise
                self._slots[exc.slot_id] = (exc.host, exc.port)
                self.map_version += 1
                ask = None
            except AskError as exc:
                self.redirects += 1
                ask = (exc.host, exc.port)
            except ConnectionChanged as exc:
                if connection is not None:
                    raise
                # Unpinned, the connection dropped between connecting and sending (Redis restarting): nothing
                # was sent, which is a connection failure to the caller (retried), not a pinned call's news.
                self.map_version += 1
                raise RedisConnectionError(str(exc)) from exc
            except TRANSIENT_REDIS_ERRORS:
                self._stale = self.cluster
                self.map_version += 1
                self._suspect.add(pipe.address)
                raise
        raise ClusterError(f"slot {slot}: more than {_MAX_REDIRECTS} redirects")

    async def _pipe_for(self, purpose: str, slot: int, ask: Address | None) -> RedisPipe:
        if ask is not None:
            return self.pipe_at(purpose, ask)
        if self._stale or self._slots[slot] is None:
            await self.refresh()
        addr = self._slots[slot]
        if addr is None:
            raise ClusterDownError(f"CLUSTERDOWN slot {slot} is not served by any master")
        return self.pipe_at(purpose, addr)
