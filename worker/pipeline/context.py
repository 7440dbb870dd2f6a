"""What every job of a worker process shares (``Deps``), and a running request's handle (``InFlight``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import anyio

from sluice.normalizer.checks import ValidatorCache
from sluice.normalizer.redact import Redactor
from sluice.schemas.keys import Keys
from sluice.worker.capacity.admission import Admission
from sluice.worker.capacity.spend import Spend
from sluice.worker.config import Config
from sluice.worker.credentials import CredentialStore
from sluice.worker.http import HttpClient
from sluice.worker.observability.telemetry import DISABLED, Telemetry
from sluice.worker.redis.connect import AnyRedis
from sluice.worker.redis.route import SlotRouter

__all__ = ["Deps", "InFlight"]


@dataclass(slots=True)
class InFlight:
    """A running request's handle: the control listener cancels it, the heartbeat fences it."""

    request_id: str
    entry_id: str = ""
    shard: int = 0  # the job shard the entry was read from
    scope: anyio.CancelScope | None = None
    reason: str | None = None
    category: str = "cancelled"
    fenced: bool = False  # the job was taken over: write nothing more, stop at once
    cancel_requested_at: float | None = None
    upstream_closed_at: float | None = None

    def cancel(self, reason: str, category: str = "cancelled") -> None:
        if self.reason is None:
            self.reason, self.category = reason, category
            self.cancel_requested_at = time.monotonic()
        if self.scope is not None:
            self.scope.cancel()

    def fence(self) -> None:
        """Another worker owns the job now (its heartbeat found the entry gone from this consumer)."""
        self.fenced = True
        self.cancel("the job was taken over by another worker", "worker_lost")


@dataclass(slots=True)
class Deps:
    config: Config
    redis: AnyRedis
    http: HttpClient
    keys: Keys
    consumer: str
    router: SlotRouter  # the worker's own connections to each slot's master (its scripts go there)
    inflight: dict[str, InFlight] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    telemetry: Telemetry = DISABLED
    redactor: Redactor | None = None  # built from the routes' secrets, again whenever they change
    credential_store: CredentialStore | None = None  # made on first use
    _redacting: tuple[str, ...] = ()
    admission: Admission | None = None  # the route-store client, when a route has limits
    spend: Spend | None = None  # the budget-store client, when budgets are configured
    validators: ValidatorCache = field(default_factory=ValidatorCache)  # compiled schemas, by hash, bounded

    @property
    def durable(self) -> tuple[int, int] | None:
        """(replicas, timeout ms) to WAIT for before a request's terminal status is published, or None."""
        c = self.config
        return (c.durability_replicas, c.durability_timeout_ms) if c.durability == "replica" else None

    def credentials(self) -> CredentialStore:
        """Every route's credential (``sluice.worker.credentials``)."""
        if self.credential_store is None:
            self.credential_store = CredentialStore(self.config.routes, self.env)
        return self.credential_store

    def secrets(self) -> Redactor:
        """Replaces every secret the routes' credentials hold right now (a static key, the refreshed token
        in use) in what a provider sends (they may echo it); rebuilt when that set changes."""
        held = tuple(sorted(set(self.credentials().current_secrets())))
        if self.redactor is None or self._redacting != held:
            self.redactor, self._redacting = Redactor(held), held
        return self.redactor
