"""The fake provider's own capacity: a concurrency cap and a requests-per-minute window, as one account.

Rule: a request is admitted only while fewer than ``max_concurrency`` admitted requests are open and
fewer than ``requests_per_minute`` were admitted in the last ``window_s`` seconds (a sliding log: at most
``requests_per_minute`` admissions in ANY window of that length, the strictest reading of a provider's
RPM). A refused request is not counted in the window (the providers do not charge a refused request)
and is answered 429 with the seconds until it would be admitted: for the window, exactly when the
oldest admission leaves it; for the cap, ``concurrency_retry_after`` (a stream's end cannot be
foreseen). Pure and synchronous: the caller passes the clock's reading, so tests can step time.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Literal

__all__ = ["CONCURRENCY_STATUSES", "Limiter", "ProviderLimits", "Refusal"]

# What a provider answers when it is at capacity: 429 (a rate limit), 503 (OpenAI / Gemini overloaded)
# or 529 (Anthropic overloaded_error). The window is always 429.
CONCURRENCY_STATUSES = (429, 503, 529)


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """None: no limit of that kind. Raises ``ValueError`` for a value that cannot be meant."""

    max_concurrency: int | None = None
    requests_per_minute: int | None = None
    window_s: float = 60.0  # the RPM window's length; shorter only to exercise expiry in a demo
    concurrency_status: int = 429
    concurrency_retry_after: float = 1.0

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "requests_per_minute"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: expected at least 1 (omit it for no limit)")
        if not 0 < self.window_s <= 3600:
            raise ValueError(f"window_s={self.window_s}: expected 0 < seconds <= 3600")
        if self.concurrency_status not in CONCURRENCY_STATUSES:
            raise ValueError(f"concurrency_status={self.concurrency_status}: expected one of {CONCURRENCY_STATUSES}")
        if not 0 <= self.concurrency_retry_after <= 3600:
            raise ValueError(f"concurrency_retry_after={self.concurrency_retry_after}: expected 0..3600 seconds")

    @property
    def active(self) -> bool:
        return self.max_concurrency is not None or self.requests_per_minute is not None


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request was not admitted and when to come back."""

    limit: Literal["concurrency", "rate"]
    status: int
    retry_after_s: float  # exact (seconds, > 0 for the window); headers round it up
    limit_value: int  # the configured limit that refused it

    @property
    def retry_after_header(self) -> str:
        """``Retry-After`` is whole seconds (RFC 9110 §10.2.3): rounded up, never earlier than exact."""
        return str(math.ceil(self.retry_after_s))

    @property
    def retry_after_text(self) -> str:
        """The exact wait in seconds, to the millisecond, as the providers' messages spell it ("47.6")."""
        return f"{self.retry_after_s:.3f}".rstrip("0").rstrip(".")


class Limiter:
    """Admission for one fake provider. ``admit`` then, for every admitted request, one ``release``."""

    def __init__(self, limits: ProviderLimits) -> None:
        self.limits = limits
        self._admitted_at: deque[float] = deque()  # admissions inside the window, oldest first (<= rpm)
        self.in_flight = 0
        self.peak_in_flight = 0
        self.admitted = 0
        self.refused_concurrency = 0
        self.refused_rate = 0

    def admit(self, now: float) -> Refusal | None:
        """None: admitted (counted in flight and in the window); else the refusal to answer."""
        lim = self.limits
        log = self._admitted_at
        while log and log[0] <= now - lim.window_s:
            log.popleft()
        rpm = lim.requests_per_minute
        if rpm is not None and len(log) >= rpm:
            self.refused_rate += 1
            wait = log[len(log) - rpm] + lim.window_s - now  # when enough admissions have left the window
            return Refusal(limit="rate", status=429, retry_after_s=wait, limit_value=rpm)
        cap = lim.max_concurrency
        if cap is not None and self.in_flight >= cap:
            self.refused_concurrency += 1
            wait = lim.concurrency_retry_after
            return Refusal(limit="concurrency", status=lim.concurrency_status, retry_after_s=wait, limit_value=cap)
        if rpm is not None:
            log.append(now)
        self.admitted += 1
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        return None

    def release(self) -> None:
        if self.in_flight <= 0:
            raise RuntimeError("release() without an admitted request")
        self.in_flight -= 1

    def statistics(self) -> dict[str, int]:
        return {
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
            "admitted": self.admitted,
            "refused_concurrency": self.refused_concurrency,
            "refused_rate": self.refused_rate,
        }
