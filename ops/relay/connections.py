"""Every Redis connection the relay opens is made here, and their number is fixed by the config.

Rule: the relay holds at most ``redis_pool_size`` connections for short commands (a blocking pool: a
crowd of joining clients queues for a connection instead of opening one each) plus two per reader lane,
whatever the number of clients. Commands are tried once (redis-py's own retries are off): the hub
decides what a failure means (503 to a joining client, a retry with backoff for a running reader), and a
dead Redis is noticed within ``redis_timeout``. No client name is set (``CLIENT SETNAME`` is not among the
``sluice-reader`` ACL user's commands). On a Redis Cluster (``redis_cluster``) the commands and the readers
share one cluster client (``sluice.worker.redis.cluster``): its pools are per node, and a lane's XREAD there names
the keys of one slot.
"""

from __future__ import annotations

from typing import cast

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from sluice.worker.redis.cluster import SluiceCluster
from sluice.worker.redis.connect import QUIET, connect

from .config import RelayConfig

__all__ = ["RelayRedis"]


def _no_retry() -> Retry:
    return Retry(NoBackoff(), 0)


class RelayRedis:
    """The command pool and the factory of reader connections, for one relay."""

    def __init__(self, config: RelayConfig) -> None:
        self.config = config
        self.pool = aioredis.BlockingConnectionPool.from_url(
            config.redis_url,
            **QUIET,
            max_connections=config.redis_pool_size,
            timeout=config.redis_timeout,
            socket_connect_timeout=config.redis_timeout,
            socket_timeout=config.redis_timeout,
            retry=_no_retry(),
        )
        self.commands = aioredis.Redis(connection_pool=self.pool)
        self._readers: list[aioredis.Redis] = []
        self.cluster: SluiceCluster | None = None
        if config.redis_cluster:
            # The hub sends one request's keys per command, which a cluster client routes; typed as the
            # plain client the hub was written against.
            self.cluster = cast(
                SluiceCluster,
                connect(
                    config.redis_url,
                    cluster=True,
                    socket_connect_timeout=config.redis_timeout,
                    socket_timeout=config.block_ms / 1000 + config.redis_timeout,
                ),
            )
            self.commands = cast(aioredis.Redis, self.cluster)

    def reader(self) -> aioredis.Redis:
        """A client of exactly one connection for a lane's blocking XREAD (its reply may take
        ``block_ms``, so its timeout is longer than the commands'); on a cluster, the cluster client."""
        if self.cluster is not None:
            return cast(aioredis.Redis, self.cluster)
        block = self.config.block_ms / 1000
        client = aioredis.Redis.from_url(
            self.config.redis_url,
            **QUIET,
            single_connection_client=True,
            socket_connect_timeout=self.config.redis_timeout,
            socket_timeout=block + self.config.redis_timeout,
            retry=_no_retry(),
        )
        self._readers.append(client)
        return client

    def open_connections(self) -> int:
        """Connections open now (pool and readers), as the relay's own count."""
        if self.cluster is not None:
            return sum(len(node._connections) for node in self.cluster.get_nodes())
        pool = self.pool
        created = len(pool._in_use_connections) + sum(1 for c in pool._available_connections if c.is_connected)
        readers = sum(1 for r in self._readers if r.connection is not None and r.connection.is_connected)
        return created + readers

    async def aclose(self) -> None:
        if self.cluster is not None:
            await self.cluster.aclose()
        for r in self._readers:
            await r.aclose()
        await self.commands.aclose()
        await self.pool.disconnect()
