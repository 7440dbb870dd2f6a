"""The budget-store client: an attempt's worst case held in every budget its job falls under before anything
is sent, and settled at its end to the cost of the usage its provider reported (``sluice.worker.capacity.scripts``
RESERVE, EXTEND, SETTLE; docs/capacity.md#budgets).

Rule: an attempt reserves right before its request is sent, at its own route's prices (a retry and a fallback
each hold their own), under the id ``<request id>:<attempt>``; the reservation is renewed by the heartbeat like a
permit (``lease_ms`` = ``claim_idle_ms``) and settled once when the attempt ends: to the cost of the reported
usage, whole when none was reported, nothing when the request was never sent. A reservation its worker stopped
renewing (dead, frozen, fenced) is charged whole at expiry. Money is counted in whole micro-units of the
currency, a worst case and a cost rounded up, a limit down, so ``spent + reserved <= amount`` holds exactly.
Every call is idempotent for its caller and sent again through outages (``with_retry``). The RESERVEs, and the
SETTLEs, a worker asks of one tenant's store in one event-loop pass go in one script call (``_Batches``): each
is taken in order as if alone, and each caller gets its own reply, so batching changes the round trips only.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any, Literal

import anyio
import anyio.lowlevel

from sluice.normalizer.pricing import cost_of, format_cost
from sluice.schemas.events import Usage
from sluice.schemas.jobs import Job, encode_job
from sluice.schemas.keys import BudgetKeys, Keys, key_slot
from sluice.worker import clock
from sluice.worker.capacity import scripts as cs
from sluice.worker.capacity.budgets import (
    BudgetRef,
    amount_of,
    budgets_for,
    removable_from,
    window_bounds,
    worst_case,
)
from sluice.worker.config import Config
from sluice.worker.cost import prices_for
from sluice.worker.redis.retry import with_retry
from sluice.worker.redis.route import SlotRouter
from sluice.worker.redis.scripts import sha

__all__ = ["AttemptBudget", "Reserved", "Spend", "from_micro", "to_micro"]

log = logging.getLogger("sluice.worker")

_MICRO = Decimal(1_000_000)


def to_micro(amount: Decimal, *, up: bool) -> int:
    """Whole micro-units of the currency: a charge rounded up, a limit down."""
    return int((amount * _MICRO).to_integral_value(ROUND_CEILING if up else ROUND_FLOOR))


def from_micro(units: int) -> Decimal:
    return Decimal(units) / _MICRO


def _opt(ms: int | None) -> object:
    return "" if ms is None else ms


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@dataclass(slots=True)
class _Batch:
    items: list[list[object]] = field(default_factory=list)
    done: anyio.Event = field(default_factory=anyio.Event)
    replies: list[Any] | None = None
    error: BaseException | None = None


class _Batches:
    """Calls of one script on one tenant's store, gathered over one event-loop pass: the first caller sends
    them all (shielded: the others wait on it) and each caller gets the reply to its own item."""

    def __init__(self, send: Callable[[str, str, list[object]], Any]) -> None:
        self._send = send
        self._open: dict[tuple[str, str], _Batch] = {}

    async def call(self, tenant: str, source: str, item: list[object]) -> Any:
        key = (tenant, source)
        batch = self._open.get(key)
        first = batch is None
        if batch is None:
            batch = self._open[key] = _Batch()
        index = len(batch.items)
        batch.items.append(item)
        if first:
            with anyio.CancelScope(shield=True):  # once a batch is open, it is sent: its callers wait on it
                await anyio.lowlevel.checkpoint()  # the callers already due in this pass join the batch
                del self._open[key]
                try:
                    batch.replies = await self._send(tenant, source, [x for it in batch.items for x in it])
                except Exception as exc:
                    batch.error = exc
                finally:
                    batch.done.set()
        else:
            await batch.done.wait()
        if batch.error is not None:
            raise batch.error
        assert batch.replies is not None
        return batch.replies[index]


@dataclass(frozen=True, slots=True)
class Reserved:
    """``ok`` (held, or held already), ``done`` (settled already: a RESERVE sent again after its attempt
    ended), ``full`` (``budget`` has ``left`` in its currency, less than the worst case; ``settled``: its settled
    spend alone leaves no room, else reservations in flight hold the room and may give it back)."""

    outcome: Literal["ok", "done", "full"]
    budget: str = ""
    left: Decimal = Decimal(0)
    settled: bool = False


class Spend:
    """One per worker with budgets configured. ``clock``: a test-only override of Redis's TIME (unix ms)."""

    def __init__(self, config: Any, keys: Keys, router: SlotRouter, *, clock: Callable[[], int] | None = None) -> None:
        self.config, self.keys, self.router = config, keys, router
        self.lease_ms: int = config.claim_idle_ms
        self.done_ms: int = 2 * (config.claim_idle_ms + int(config.redis_outage_limit * 1000))
        self._clock = clock
        self.held: dict[str, set[str]] = {}  # tenant -> reservation ids this worker renews
        self._batches = _Batches(self._run)

    def _now(self) -> str:
        return str(self._clock()) if self._clock is not None else ""

    def _store(self, tenant: str) -> BudgetKeys:
        return self.keys.budget(tenant)

    async def _run(self, tenant: str, source: str, args: list[object]) -> Any:
        bk = self._store(tenant)
        slot, keys = key_slot(bk.state), bk.script_keys()

        async def once() -> Any:
            reply, _ = await self.router.evalsha("budget", slot, sha(source), source, keys, [self._now(), *args])
            return reply

        return await with_retry(once, outage_limit=self.config.redis_outage_limit)

    def now_ms(self) -> int | None:
        return self._clock() if self._clock is not None else None

    async def reserve(self, res_id: str, refs: list[BudgetRef], amount: Decimal, now_ms: int) -> Reserved:
        """Hold ``amount`` in every budget of ``refs`` (one tenant's, outermost first), in the windows ``now_ms``
        falls in, or in none when one of them has no room."""
        tenant = refs[0].tenant
        lines: list[object] = []
        for ref in refs:
            start, end = window_bounds(ref.budget, now_ms)
            limit = to_micro(amount_of(ref.budget), up=False)
            until = removable_from(ref.budget, end)
            lines += [f"{ref.name}|{start}", limit, ref.name, _opt(end), ref.budget.currency, _opt(until)]
        self.held.setdefault(tenant, set()).add(res_id)  # renewed from now on: a lost reply leaves it held
        reply = await self._batches.call(
            tenant, cs.RESERVE, [res_id, to_micro(amount, up=True), self.lease_ms, self.done_ms, len(refs), *lines]
        )
        kind = _s(reply[0])
        if kind in ("ok", "held"):
            return Reserved("ok")
        self.held[tenant].discard(res_id)
        if kind == "done":
            return Reserved("done")
        return Reserved("full", _s(reply[1]), from_micro(int(_s(reply[2]))), _s(reply[3]) == "1")

    async def settle(self, tenant: str, res_id: str, cost: Decimal | None, *, sent: bool) -> str:
        """End a reservation: charged ``cost`` (rounded up), whole when ``cost`` is None, nothing when the request
        was never ``sent``. Returns the memo ``<how>:<micro-units charged>`` (the first settlement's, when this
        one is a repeat or the reservation was charged at expiry)."""
        mode = "release" if not sent else "whole" if cost is None else "cost"
        args: list[object] = [res_id, mode, "" if cost is None else to_micro(cost, up=True)]
        reply = await self._batches.call(tenant, cs.SETTLE, args)
        self.held.get(tenant, set()).discard(res_id)
        return _s(reply[1]) if len(reply) > 1 else _s(reply[0])

    async def extend(self) -> list[str]:
        """Renew every reservation this worker holds; the ids no longer held (charged whole at expiry)."""
        lost: list[str] = []
        for tenant, ids in list(self.held.items()):
            if not ids:
                continue
            reply = await self._run(tenant, cs.EXTEND, [self.lease_ms, *sorted(ids)])
            gone = [_s(r) for r in reply]
            ids.difference_update(gone)
            lost += gone
        return lost

    def forget(self, tenant: str, res_id: str) -> None:
        """Stop renewing a reservation (its attempt was fenced, or its settlement never reached Redis): expiry
        charges it whole."""
        self.held.get(tenant, set()).discard(res_id)


@dataclass(slots=True)
class AttemptBudget:
    """The reservations of one claim's attempts, one at a time. ``charged_to``: the budgets the last attempt
    was held in (its terminal's ``budget``)."""

    spend: Spend | None
    config: Config
    job: Job
    rid: str
    charged_to: list[str] = field(default_factory=list)
    sent: bool = False  # the held attempt's request was handed to the provider
    _held: tuple[str, str] | None = None  # (tenant, reservation id) not settled yet
    _bytes: int | None = None

    async def reserve(
        self, route_name: str, model: str, attempt: int, *, wait_s: float = 0.0, stop: Callable[[], bool] = bool
    ) -> tuple[str, str] | None:
        """Hold the worst case of ``attempt`` on ``route_name``; None when held (or no budget applies), else the
        attempt's failure: (category, one line). While only reservations in flight keep the room, wait for them
        (up to ``wait_s`` seconds, polling, until ``stop()``); when the settled spend leaves none, refused at
        once, or waited for the same way under a budget with ``when_full = "wait"`` (its window may turn, or
        spend be released). Raises ``StorageError``."""
        if self.spend is None:
            return None
        refs = budgets_for(self.config, self.job.tenant_name, self.job.budget_key, self.job.route)
        if not refs:
            return None
        route = self.config.routes[route_name]
        priced = prices_for(self.config, route_name, model, route.provider or "")
        if priced is None:
            return (
                "invalid_request",
                f"route {route_name!r} has no price for model {model!r}: a budgeted job cannot run",
            )

        max_tokens = self.job.request.max_tokens or route.max_tokens
        if not max_tokens:
            return (
                "invalid_request",
                f"a budgeted job needs max_tokens (the job's, or routes.{route_name}.max_tokens) to bound its cost",
            )
        if self._bytes is None:
            self._bytes = len(encode_job(self.job))
        # Input bound: the job's JSON bytes (a token encodes at least one byte of the text it stands for).
        amount = worst_case(priced[0], self._bytes, max_tokens)
        res_id = f"{self.rid}:{attempt}"
        deadline, waited = time.monotonic() + wait_s, False
        while True:
            now = self.spend.now_ms() or clock.now_ms()
            got = await self.spend.reserve(res_id, refs, amount, now)
            waits = not got.settled or any(r.name == got.budget and r.budget.when_full == "wait" for r in refs)
            if got.outcome != "full" or not waits or stop() or time.monotonic() >= deadline:
                break
            if not waited:
                waited = True
                log.info("waiting for budget room", extra={"request_id": self.rid, "budget": got.budget})
            await anyio.sleep(random.uniform(0.05, 0.25))  # until an attempt in flight settles its reservation
        if got.outcome == "full":
            return (
                "budget_exceeded",
                f"{got.budget} has {format_cost(got.left)} {priced[0].currency} left, this attempt's worst case is"
                f" {format_cost(amount.quantize(Decimal('0.000001'), ROUND_CEILING))}",
            )
        self._held, self.sent = (refs[0].tenant, res_id), False
        self.charged_to = [r.name for r in refs]
        return None

    async def settle(self, usage: Usage | None, route_name: str, model: str) -> None:
        """Settle the held reservation to the cost of ``usage`` at ``route_name``'s prices (whole without usage).
        Raises ``StorageError``."""
        if self.spend is None or self._held is None:
            return
        tenant, res_id = self._held
        route = self.config.routes[route_name]
        priced = prices_for(self.config, route_name, model, route.provider or "")
        cost = cost_of(usage, priced[0], route.dialect) if priced is not None else None
        self._held = None
        await self.spend.settle(tenant, res_id, cost, sent=self.sent)

    def forget(self) -> None:
        if self.spend is not None and self._held is not None:
            self.spend.forget(*self._held)
            self._held = None
