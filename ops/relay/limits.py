"""Process limits and back-off hints: the descriptor limit raised at start, jittered retry delays.

Rule: each client costs a file descriptor, and the usual soft limit (1,024) is far below what a relay
serves, so start-up raises the soft limit to the hard one and says what it got. A refused client is told
when to come back with a delay drawn uniformly from ``[base, base + jitter]``, so clients refused
together (say during a Redis outage) come back spread out rather than all in the same second.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

__all__ = ["FdLimits", "RetryHint", "fd_soft_limit", "open_fds", "raise_fd_limit", "retry_hint"]

_RNG = random.SystemRandom()


@dataclass(frozen=True, slots=True)
class FdLimits:
    soft: int
    hard: int
    raised_from: int | None  # the soft limit before, when it was raised


def raise_fd_limit(cap: int = 1_048_576) -> FdLimits | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most ``cap`` when the hard one is
    unlimited). None where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return FdLimits(soft, hard, None)
        return FdLimits(target, hard, soft)
    return FdLimits(soft, hard, None)


def fd_soft_limit() -> int | None:
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_fds() -> int | None:
    """Descriptors this process has open (Linux), else None."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


@dataclass(frozen=True, slots=True)
class RetryHint:
    seconds: float

    @property
    def header(self) -> str:
        """``Retry-After`` takes whole seconds (RFC 9110 10.2.3): rounded up, never early."""
        return str(max(1, math.ceil(self.seconds)))

    @property
    def ms(self) -> int:
        return int(self.seconds * 1000)


def retry_hint(base: float, jitter: float) -> RetryHint:
    return RetryHint(base + _RNG.uniform(0, max(0.0, jitter)))
