"""Connecting to Redis, single instance or Cluster: the one place a redis-py client is made from a URL.

Rule: a cluster client is redis-py's asyncio ``RedisCluster`` made safe for many concurrent tasks
(``SluiceCluster``; the measurements behind each point are in the cluster-harness notes):

- the slot map is loaded before any keyed command runs (redis-py 8.1 routes a keyed command sent before
  ``initialize()`` to a random primary, and a burst of them bounces with MOVED);
- ``reinitialize_steps=0`` and no client-wide close: redis-py's reaction to CLUSTERDOWN, to every n-th
  MOVED and to a failed pipeline is ``aclose()``, which disconnects every connection of every node,
  including ones other tasks are reading a reply from (lost XREADGROUP replies, XADDs applied twice,
  ``'NoneType' object has no attribute 'writelines'``). Here those internal closes only mark the slot map
  stale: the next command reloads it and every connection stays;
- an ``AttributeError`` of a connection torn down under a command becomes ``ConnectionError`` (the command
  was not sent; callers retry it like any connection loss);
- ``XREAD`` / ``XREADGROUP`` are routed by their ``STREAMS`` keys, without the two ``COMMAND GETKEYS``
  round trips to the default node redis-py makes for every such read;
- the per-node pool is large (``max_connections``): redis-py raises at the cap instead of waiting, and every
  blocked read holds a connection.
"""

from __future__ import annotations

import contextvars
from typing import Any, TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException

__all__ = ["AnyRedis", "SluiceCluster", "connect", "is_cluster"]

AnyRedis: TypeAlias = "aioredis.Redis | SluiceCluster"

# Set while redis-py runs one of our commands: an ``aclose()`` from inside is redis-py's own reaction to a
# redirect or a cluster error, not the owner closing the client.
_INSIDE = contextvars.ContextVar("sluice_cluster_inside", default=False)
_TORN_DOWN = "'NoneType' object has no attribute"
_STREAM_READS = ("XREAD", "XREADGROUP")


def _torn_down(exc: AttributeError) -> RedisConnectionError:
    return RedisConnectionError(f"the connection was closed under the command ({exc})")


class _Pipeline(ClusterPipeline):
    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        token = _INSIDE.set(True)
        try:
            return await super().execute(raise_on_error, allow_redirections)
        except AttributeError as exc:
            if _TORN_DOWN not in str(exc):
                raise
            raise _torn_down(exc) from exc
        finally:
            _INSIDE.reset(token)


class SluiceCluster(RedisCluster):
    """redis-py's asyncio cluster client with the module rule's fixes."""

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()  # before the routing decision, which needs the slot map
        token = _INSIDE.set(True)
        try:
            return await super().execute_command(*args, **kwargs)
        except AttributeError as exc:
            if _TORN_DOWN not in str(exc):
                raise
            raise _torn_down(exc) from exc
        finally:
            _INSIDE.reset(token)

    async def aclose(self) -> None:
        if _INSIDE.get():
            # redis-py reacting to CLUSTERDOWN, a MOVED or a failed pipeline: reload the slot map before the
            # next command; the nodes (and their pools) are kept across a reload.
            self._initialize = True
            return
        await super().aclose()

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if shard_hint:
            raise RedisClusterException("shard_hint is deprecated in cluster mode")
        return _Pipeline(self, transaction)  # type: ignore[abstract]  # redis-py's own stubs mark it abstract

    async def _determine_slot(self, command: str, *args: Any) -> int:
        name = command.upper() if isinstance(command, str) else command
        if name in _STREAM_READS:
            for i, arg in enumerate(args):
                if isinstance(arg, str | bytes) and (arg.upper() in ("STREAMS", b"STREAMS")):
                    rest = args[i + 1 :]
                    slots = {self.keyslot(k) for k in rest[: len(rest) // 2]}
                    if len(slots) == 1:
                        return slots.pop()
                    break
        return await super()._determine_slot(command, *args)


def is_cluster(redis: object) -> bool:
    return isinstance(redis, RedisCluster)


def connect(url: str, *, cluster: bool, max_connections: int = 1000, **kwargs: Any) -> AnyRedis:
    """A client for ``url``: a ``SluiceCluster`` seeded by it when ``cluster``, else a plain ``Redis``
    (``kwargs`` are connection options: ``socket_timeout``, ...). The cluster client loads its slot map on
    its first command (call ``initialize()`` to fail early). Raises ``ValueError`` for a bad URL."""
    if not cluster:
        return aioredis.Redis.from_url(url, **kwargs)
    client = SluiceCluster.from_url(url, reinitialize_steps=0, max_connections=max_connections, **kwargs)
    assert isinstance(client, SluiceCluster)  # from_url builds cls
    return client
