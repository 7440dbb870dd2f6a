"""A terminal-feed consumer group's lag: the age of the oldest terminal entry it has not acknowledged.

Rule: per terminal shard, the oldest unacknowledged entry is the group's oldest pending entry (delivered,
not acked: ``XPENDING`` summary) or else the first entry after its ``last-delivered-id`` (not delivered
yet); terminal entries have Redis's own ``<ms>-<n>`` ids, so the entry's age is ``now - ms``. A shard
without the group counts every entry as unread. The archiver reports it, ``sluice archive --status``
prints it and the worker warns when it nears ``retention_seconds`` (``sluice.worker.observability.archive_watch``).
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.exceptions import ResponseError

from sluice.schemas.keys import Keys
from sluice.worker.redis.connect import AnyRedis

__all__ = ["ShardLag", "group_lag"]


@dataclass(frozen=True, slots=True)
class ShardLag:
    stream: str
    pending: int  # delivered to a consumer, not acked
    undelivered: int | None  # entries after last-delivered-id (Redis 7's ``lag``; None when unknown)
    oldest_ms: int | None  # the oldest unacknowledged entry's time (unix ms), None when all are acked
    group_exists: bool

    def age_ms(self, now_ms: int) -> int:
        return max(0, now_ms - self.oldest_ms) if self.oldest_ms is not None else 0


def _ms(entry_id: object) -> int:
    s = _text(entry_id)
    return int(s.partition("-")[0])


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def group_lag(redis: AnyRedis, keys: Keys, group: str) -> list[ShardLag]:
    """Each terminal shard's lag for ``group``. Raises redis-py's errors."""
    out: list[ShardLag] = []
    for shard in keys.shards:
        stream = shard.terminal
        try:
            groups = await redis.xinfo_groups(stream)
        except ResponseError:  # no such key: nothing was ever published on this shard
            out.append(ShardLag(stream, 0, 0, None, False))
            continue
        info = next((g for g in groups if _text(g.get("name")) == group), None)
        if info is None:
            first = await redis.xrange(stream, "-", "+", count=1)
            out.append(ShardLag(stream, 0, None, _ms(first[0][0]) if first else None, False))
            continue
        summary = await redis.xpending(stream, group)
        pending = int(summary.get("pending") or 0)
        lag = info.get("lag")
        undelivered = int(lag) if lag is not None else None
        oldest: int | None = None
        if pending:
            oldest = _ms(summary["min"])
        else:
            after = await redis.xrange(stream, f"({_text(info.get('last-delivered-id'))}", "+", count=1)
            oldest = _ms(after[0][0]) if after else None
        out.append(ShardLag(stream, pending, undelivered, oldest, True))
    return out
