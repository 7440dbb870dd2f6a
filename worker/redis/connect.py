"""Connecting to Redis, single instance or Cluster: the one place a redis-py client is made from a URL, a
URL is masked for a message, and a key prefix's recorded layout is checked.

Rule: a URL is never printed with its password (``safe_url``); a cluster client is ``SluiceCluster``
(``sluice.worker.redis.cluster``), a single instance redis-py's ``Redis``. A sharded layout records its
shard count once (``check_layout``): a process with another count is refused, since jobs enqueued for a
shard nobody reads would wait forever.
"""

from __future__ import annotations

from typing import Any, TypeAlias
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.driver_info import DriverInfo
from redis.exceptions import ResponseError

from sluice.schemas.errors import ConfigError
from sluice.schemas.keys import Keys
from sluice.worker.redis.cluster import SluiceCluster

__all__ = ["QUIET", "AnyRedis", "check_layout", "connect", "ensure_group", "env_flag", "is_cluster", "safe_url"]

AnyRedis: TypeAlias = "aioredis.Redis | SluiceCluster"


# redis-py announces itself with CLIENT SETINFO on every new connection. Redis before 7.2 has no such command,
# so an ACL file (ops/deploy/users.acl) cannot grant it on every supported server, and where it exists a
# refused one fills the ACL log: sluice's clients do not send it.
QUIET: dict[str, Any] = {"driver_info": DriverInfo(name=None, lib_version=None)}


def is_cluster(redis: object) -> bool:
    return isinstance(redis, RedisCluster)


def connect(url: str, *, cluster: bool, max_connections: int = 1000, **kwargs: Any) -> AnyRedis:
    """A client for ``url``: a ``SluiceCluster`` seeded by it when ``cluster``, else a plain ``Redis``
    (``kwargs`` are connection options: ``socket_timeout``, ...). The cluster client loads its slot map on
    its first command (call ``initialize()`` to fail early). Raises ``ValueError`` for a bad URL."""
    kwargs = {**QUIET, **kwargs}
    if not cluster:
        return aioredis.Redis.from_url(url, **kwargs)
    client = SluiceCluster.from_url(url, reinitialize_steps=0, max_connections=max_connections, **kwargs)
    assert isinstance(client, SluiceCluster)  # from_url builds cls
    return client


def env_flag(name: str, value: str) -> bool:
    """An on/off environment variable (``SLUICE_REDIS_CLUSTER``). Raises ``ConfigError`` for anything else."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ConfigError(f"{name} must be 1 or 0 (true / false), not {value!r}")


def safe_url(url: str) -> str:
    """The URL with its password masked (it is printed in errors)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "(unparsable URL)"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{user}:***@{host}" + (f":{port}" if port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


async def ensure_group(redis: AnyRedis, stream: str, group: str) -> None:
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):  # the group exists already: the one error worth swallowing
            raise


async def check_layout(redis: AnyRedis, keys: Keys) -> None:
    """Record a sharded layout's shard count, or refuse one that differs from the recorded count: jobs
    enqueued for a shard nobody reads would wait forever. Raises ``ConfigError``."""
    if not keys.sharded:
        return
    await redis.hsetnx(keys.layout, "job_shards", keys.job_shards)
    stored = await redis.hget(keys.layout, "job_shards")
    if stored is not None and int(stored) != keys.job_shards:
        raise ConfigError(
            f"{keys.layout} records job_shards = {int(stored)} for this key prefix; this process has "
            f"{keys.job_shards} (change every worker and producer together, with the old shards drained)"
        )
