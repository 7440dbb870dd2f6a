"""Which routes the workers of one key prefix serve, and the rule that they all serve the same.

Rule: workers sharing a key prefix share one jobs stream (and its consumer group), so a job may go to any
of them; a worker that lacks a route the others serve would fail that route's jobs for the whole fleet.
So every worker records its routes in ``{prefix}:workers`` (one field per consumer, refreshed with its
heartbeat, with its retention_seconds for the tools), and a worker whose routes differ from those of a
live worker of the group refuses to start, naming both. Workers for other routes run as a group of their
own under another ``key_prefix``.
"""

from __future__ import annotations

import msgspec

from sluice.schemas.errors import ConfigError
from sluice.schemas.keys import Keys
from sluice.worker.clock import now_ms
from sluice.worker.config import Config
from sluice.worker.redis.connect import AnyRedis

__all__ = ["GroupMismatch", "Member", "announce", "leave", "live_members"]


class GroupMismatch(ConfigError):
    """This worker's routes differ from those of a live worker sharing its key prefix."""

    code = "group_mismatch"


class Member(msgspec.Struct, frozen=True):
    routes: list[str]
    at: int  # unix ms of its last heartbeat
    # Its configuration's retention_seconds, for tools that run without the file (`sluice archive --status`);
    # None from a worker that predates the field.
    retention_seconds: int | None = None


_DECODE = msgspec.json.Decoder(Member)
_ENCODE = msgspec.json.Encoder()


def _live_window_ms(config: Config) -> int:
    # A member counts while it could still hold jobs: a worker that stopped heartbeating longer than this
    # has had its jobs taken over.
    return max(3 * config.heartbeat_ms, config.claim_idle_ms)


async def live_members(redis: AnyRedis, keys: Keys, config: Config) -> dict[str, Member]:
    """The workers of ``keys.prefix`` that heartbeated within the live window, by consumer name (an
    operator's view: ``sluice enqueue --follow`` says when none serves a queued request's route)."""
    now, window = now_ms(), _live_window_ms(config)
    live: dict[str, Member] = {}
    for name, raw in (await redis.hgetall(keys.workers)).items():
        try:
            member = _DECODE.decode(raw)
        except msgspec.DecodeError:
            continue
        if now - member.at < window:
            live[name.decode() if isinstance(name, bytes) else str(name)] = member
    return live


async def announce(redis: AnyRedis, keys: Keys, consumer: str, config: Config, *, check: bool) -> None:
    """Record this worker's routes (and the time). With ``check``, first refuse (``GroupMismatch``) when a
    live member of the group serves other routes."""
    mine = sorted(config.routes)
    now = now_ms()
    if check:
        for name, raw in (await redis.hgetall(keys.workers)).items():
            other = name.decode() if isinstance(name, bytes) else str(name)
            try:
                member = _DECODE.decode(raw)
            except msgspec.DecodeError:
                continue
            if other != consumer and now - member.at < _live_window_ms(config) and member.routes != mine:
                raise GroupMismatch(
                    f"this worker serves routes {', '.join(mine)}, but worker {other} of the same group (key "
                    f"prefix {keys.prefix!r}) serves {', '.join(member.routes) or 'none'}: workers of one prefix "
                    "share one jobs stream and must serve the same routes (run this one under its own key_prefix)"
                )
    await redis.hset(keys.workers, consumer, _ENCODE.encode(Member(mine, now, config.retention_seconds)))


async def leave(redis: AnyRedis, keys: Keys, consumer: str) -> None:
    """A worker that stops cleanly leaves the group at once (one that died leaves when its heartbeat ages)."""
    await redis.hdel(keys.workers, consumer)
