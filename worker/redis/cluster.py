"""redis-py's asyncio ``RedisCluster`` made safe for many concurrent tasks (``SluiceCluster``; ``connect``
makes it from a URL; the measurements behind each point are in the cluster-harness notes):

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
- an ``ASK`` redirect sends ``ASKING`` and the command in one write on one connection (redis-py sends them
  as two pool checkouts: with two idle connections on the target they land on different ones and the
  redirect loops until "TTL exhausted");
- the per-node pool is large (``max_connections``): redis-py raises at the cap instead of waiting, and every
  blocked read holds a connection.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError, SlotNotCoveredError

__all__ = ["ClusterUnavailable", "SluiceCluster"]

# Set while redis-py runs one of our commands: an ``aclose()`` from inside is redis-py's own reaction to a
# redirect or a cluster error, not the owner closing the client.
_INSIDE = contextvars.ContextVar("sluice_cluster_inside", default=False)
_TORN_DOWN = "'NoneType' object has no attribute"
_STREAM_READS = ("XREAD", "XREADGROUP")
# The node an ASKING was asked for in this task: its next command carries the flag on the same connection.
_ASKING: contextvars.ContextVar[ClusterNode | None] = contextvars.ContextVar("sluice_cluster_asking", default=None)


class _AskingNode(ClusterNode):
    """A node whose ``ASKING`` rides with the next command of the same task, in one write."""

    __slots__ = ()

    async def execute_command(self, *args: Any, asking: bool = False, **kwargs: Any) -> Any:
        name = args[0] if args else b""
        if len(args) == 1 and (name.upper() if isinstance(name, str | bytes) else name) in ("ASKING", b"ASKING"):
            _ASKING.set(self)
            return True
        if _ASKING.get() is not self:
            return await super().execute_command(*args, asking=asking, **kwargs)
        _ASKING.set(None)
        connection = self.acquire_connection()
        try:
            await self.disconnect_if_needed(connection)
            await connection.send_packed_command(connection.pack_commands([("ASKING",), args]))
            with contextlib.suppress(ResponseError):  # the command's own reply says what happened
                await self.parse_response(connection, "ASKING")
            return await self.parse_response(connection, args[0], **kwargs)
        except BaseException:
            await connection.disconnect()  # a reply may be left unread: never reuse it
            raise
        finally:
            try:
                await self.disconnect_if_needed(connection)
            finally:
                self.release(connection)


_PAIRED_ASK = hasattr(ClusterNode, "disconnect_if_needed") and hasattr(ClusterNode, "acquire_connection")


class ClusterUnavailable(RedisConnectionError, RedisClusterException):
    """No node gave a usable slot map (all unreachable, or the slots not all served): a connection failure."""


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

    async def initialize(self, *args: Any, **kwargs: Any) -> SluiceCluster:
        try:
            await super().initialize(*args, **kwargs)
        except ClusterUnavailable:
            raise
        except RedisClusterException as exc:
            raise ClusterUnavailable(str(exc)) from exc
        return self

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
        except SlotNotCoveredError as exc:  # a failover under way: retried like a connection loss
            raise ClusterUnavailable(str(exc)) from exc
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

    def get_node(self, host: str | None = None, port: int | None = None, node_name: str | None = None) -> Any:
        node = super().get_node(host, port, node_name)
        if _PAIRED_ASK and type(node) is ClusterNode:
            node.__class__ = _AskingNode  # the ASK path asks for its target here
        return node

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
