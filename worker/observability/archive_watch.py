"""Retention safety: a worker warns when the archivers' lag nears ``retention_seconds``.

Rule: with ``archive_group`` set, at most once per ``CHECK_EVERY`` seconds per worker process, a request's
finalize reads that group's lag over every terminal shard (``sluice.worker.redis.lag``) and logs a warning
when the oldest unarchived terminal entry is older than ``archive_lag_warn x retention_seconds``: past
``retention_seconds`` its request's keys expire before an archiver reads them. A failed read is skipped
(the next check tries again); the check never fails a request. The last lag read is also the gauge
``sluice.archive.lag`` in seconds (``observe_archive_lag``: on ``/metrics`` as ``sluice_archive_lag_seconds``),
labelled with the group; a scrape reads the last value, never Redis.
"""

from __future__ import annotations

import logging
import time

from redis.exceptions import RedisError

from sluice.schemas.keys import Keys
from sluice.worker.config import Config
from sluice.worker.observability.telemetry import Telemetry
from sluice.worker.redis.connect import AnyRedis
from sluice.worker.redis.lag import group_lag

__all__ = ["CHECK_EVERY", "check_archive_lag", "observe_archive_lag"]

log = logging.getLogger("sluice.worker")
CHECK_EVERY = 30.0
_next_check: dict[str, float] = {}  # consumer name -> monotonic time of its next check
_last_lag: dict[str, int] = {}  # consumer name -> the lag (ms) its last check read


def observe_archive_lag(telemetry: Telemetry, consumer: str, group: str) -> None:
    """Define the gauge of ``consumer``'s last archive-lag read on ``telemetry`` (nothing when telemetry is
    off; no series until a check has run)."""
    if not group:
        return

    def read() -> list[tuple[float, dict[str, str]]]:
        lag = _last_lag.get(consumer)
        return [] if lag is None else [(lag / 1000, {"group": group})]

    telemetry.observe(
        "sluice.archive.lag",
        "s",
        "age of the oldest terminal entry the archivers have not acked (the worker's last check)",
        read,
    )


async def check_archive_lag(redis: AnyRedis, keys: Keys, config: Config, consumer: str) -> int | None:
    """The lag in ms when a check ran (and warned if it had to), else None."""
    group = config.archive_group
    if not group:
        return None
    now = time.monotonic()
    if now < _next_check.get(consumer, 0.0):
        return None
    _next_check[consumer] = now + CHECK_EVERY
    try:
        lags = await group_lag(redis, keys, group)
    except (RedisError, OSError):
        return None
    wall = int(time.time() * 1000)
    lag_ms = max((s.age_ms(wall) for s in lags), default=0)
    _last_lag[consumer] = lag_ms
    retention_ms = config.retention_seconds * 1000
    if lag_ms >= config.archive_lag_warn * retention_ms:
        log.warning(
            "the archive lag nears retention_seconds: finished requests may expire before they are archived",
            extra={
                "archive_group": group,
                "lag_s": round(lag_ms / 1000, 3),
                "retention_seconds": config.retention_seconds,
            },
        )
    return lag_ms
