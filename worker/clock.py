"""The worker's wall clock: unix milliseconds for status records, log entries and event ``ts``."""

from __future__ import annotations

import time

__all__ = ["now_ms"]


def now_ms() -> int:
    return time.time_ns() // 1_000_000
