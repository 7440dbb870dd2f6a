"""The route-store client: a limited route's capacity scripts (``sluice.worker.capacity.scripts``) with
their replies typed, and what this worker holds, for the heartbeat's RENEW.

Rule: every call runs on the worker's routed connections to the master of the route's slot (a single instance
is a cluster of one), retried through outages with ``with_retry`` (each script is idempotent for its caller,
so a call whose reply was lost is simply sent again). The limits the fleet enforces are stored in the route's
state at start (``publish_limits``): a worker whose limits differ from those a live worker stored refuses to
start, naming both. Routes without limits never reach this module.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from sluice.schemas.errors import ConfigError
from sluice.schemas.jobs import Job
from sluice.schemas.keys import Keys, WaitRecord, encode_wait_record, key_slot, wait_member
from sluice.worker.capacity import scripts as cs
from sluice.worker.config import Config, Route
from sluice.worker.redis.retry import with_retry
from sluice.worker.redis.route import SlotRouter
from sluice.worker.redis.scripts import sha

__all__ = [
    "ADMIT_MAX",
    "Acquired",
    "Admission",
    "Admitted",
    "AdmittedJob",
    "LimitsMismatch",
    "OfferJob",
    "Offered",
    "Outcome",
    "Released",
    "check_unlimited_routes",
    "estimate_tokens",
    "limits_of",
]

log = logging.getLogger("sluice.worker")

Outcome = Literal["ok", "rate_limit", "overloaded", "other"]
ADMIT_MAX = 64  # the most waiting jobs one call admits (an admit loop's ADMIT, a RELEASE's handoff)
# ``worker``: the route has room, but no worker has a free run slot for the job (it is admitted by the first one
# that has: its admit loop or a RELEASE's handoff).
WaitingOn = Literal["", "concurrency", "rate", "tokens", "cooldown", "tenant", "worker"]
_ROUTE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # names a limited route can have (the config check)


class LimitsMismatch(ConfigError):
    """This worker's limits for a route differ from those a live worker of its prefix enforces."""

    code = "limits_mismatch"


# The per-job values of the intake path (OFFER's jobs and answers, admitted jobs) are Structs: built for every
# job, where a frozen dataclass's __init__ costs several times as much; untracked by the garbage collector
# (``gc=False``: they reference nothing that refers back to them), so its collections do not walk them.
class Offered(msgspec.Struct, frozen=True, gc=False):
    """``admitted`` (run it now under ``token``), ``parked`` (the route holds it: ack and go on), ``held`` (another
    delivery of it is admitted: ack and go on), ``done`` (its job ran and finished lately: a late OFFER, ack and
    go on), ``cooldown`` (its route cools and it has fallbacks: try them in a run slot, ``slot``: the one the call
    took for it, else the caller waits for one),
    ``too_large`` (its estimate passes the whole tokens_per_minute: it can never run)."""

    outcome: Literal["admitted", "parked", "held", "done", "cooldown", "too_large"]
    token: str = ""
    waiting_on: WaitingOn = ""
    retry_at: int = 0
    handed: bool = False  # the script acked the jobs entry and wrote a parked job's status (the hand-over)
    slot: bool = False  # with ``cooldown``: one of the call's run slots went to it


class OfferJob(msgspec.Struct, frozen=True, gc=False):
    """One job of an OFFER: its jobs entry is ``record.job_entry``. ``fallbacks``: a cooling route answers
    ``cooldown`` instead of parking it (the caller tries its fallbacks).
    ``status``: its request's status key, for the hand-over (a single instance only)."""

    request_id: str
    token: str
    record: WaitRecord
    fallbacks: bool = False
    status: str = ""


class AdmittedJob(msgspec.Struct, frozen=True, gc=False):
    request_id: str
    token: str  # the lease token: the CLAIM's token, and attempt 1's permit
    record: WaitRecord
    # The job as decoded at intake, when this worker admitted it at once (saves decoding it again).
    job: Job | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    jobs: list[AdmittedJob]
    retry_at: int  # unix ms when refused capacity may free with time (0: no refusal)
    waiting_on: WaitingOn


@dataclass(frozen=True, slots=True)
class Acquired:
    outcome: Literal["ok", "wait", "fenced"]
    retry_at: int = 0
    waiting_on: WaitingOn = ""


@dataclass(frozen=True, slots=True)
class Released:
    fenced: bool
    handoff: Admitted


def limits_of(config: Config, route: Route) -> str:
    """The JSON the fleet agrees on and the scripts read (``state.limits``), keys sorted: equal limits, equal
    text."""
    tenants = {
        name: {"w": t.weight, **({"c": t.max_concurrency} if t.max_concurrency else {})}
        for name, t in sorted(config.tenants.items())
    }
    doc = {
        "c": route.max_concurrency or 0,
        "rpm": route.requests_per_minute or 0,
        "tpm": route.tokens_per_minute or 0,
        "margin": route.rate_window_margin_ms,
        "cmin": route.cooldown_min_ms,
        "cmax": route.cooldown_max_ms,
        "cbase": route.cooldown_base_ms,
        "tenants": tenants,
    }
    return msgspec.json.encode(doc, order="sorted").decode()


async def check_unlimited_routes(router: SlotRouter, config: Config, keys: Keys, consumer: str, live: set[str]) -> None:
    """At start, for each route this worker serves without limits: refuse (``LimitsMismatch``) when a live
    worker of the prefix enforces limits on it (this one would send past them). Start-up only: the request
    path of a route without limits makes no capacity call."""
    for name, route in config.routes.items():
        if route.limited or not _ROUTE_NAME.fullmatch(name):
            continue
        rk = keys.route(name)
        stored, by = await router.call("capacity", key_slot(rk.state), "HMGET", rk.state, "limits", "limits_by")
        if stored is not None and by is not None and _s(by) in live - {consumer}:
            raise LimitsMismatch(
                f"routes.{name}: this worker has no limits for it, but live worker {_s(by)} of the same key prefix "
                f"{keys.prefix!r} enforces {_s(stored)}: workers of one prefix enforce one set"
            )


def estimate_tokens(payload_bytes: int, max_tokens: int | None, route: Route) -> int:
    """``ceil(bytes / 4)`` of the job as enqueued (an over-estimate of its text parts), plus its output cap
    (else the route's ``max_tokens``). Settled at RELEASE from the reported usage."""
    return math.ceil(payload_bytes / 4) + (max_tokens or route.max_tokens or 0)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


_DECODE_RECORD = msgspec.json.Decoder(WaitRecord)


def _admitted(reply: list[Any]) -> Admitted:
    jobs = [AdmittedJob(_s(r[0]), _s(r[1]), _DECODE_RECORD.decode(r[2])) for r in reply[2:]]
    return Admitted(jobs, int(float(_s(reply[0]))), _s(reply[1]))  # type: ignore[arg-type]


@dataclass(slots=True)
class _Held:
    leases: dict[str, str] = field(default_factory=dict)  # request id -> lease token
    permits: set[str] = field(default_factory=set)  # attempt tokens


class Admission:
    """One per worker. ``clock``: a test-only override of Redis's TIME (unix ms)."""

    def __init__(
        self,
        config: Config,
        keys: Keys,
        router: SlotRouter,
        consumer: str,
        *,
        clock: Callable[[], int] | None = None,
    ) -> None:
        self.config, self.keys, self.router, self.consumer = config, keys, router, consumer
        self.routes = {name: keys.route(name) for name, r in config.routes.items() if r.limited}
        self.lease_ms = config.claim_idle_ms
        # How long a finished request's late OFFER answers ``done``: a re-sent OFFER lands within its
        # sender's outage limit, a jobs entry delivered again after a claim idle time and a reader's own.
        self.finished_ms = 2 * (config.claim_idle_ms + int(config.redis_outage_limit * 1000))
        self._clock = clock
        self._calls = itertools.count(1)
        self.held: dict[str, _Held] = {name: _Held() for name in self.routes}
        # Set by the consumer (``RunSlots``): a job is admitted only into a run slot taken for it before the call
        # (an OFFER's, an ADMIT's, a RELEASE's handoff), so no admission waits for a slot; ``accepting``: whether
        # it takes jobs at all (not while stopping); ``on_handoff``: starts handed-off jobs, each in one of the
        # slots taken for the call; ``pass_slot``: a finishing leased job's own slot went to a handed-off job.
        self.take_slots: Callable[[int], int] = lambda n: 0
        self.give_slots: Callable[[int], None] = lambda n: None
        self.accepting: Callable[[], bool] = lambda: True
        self.on_handoff: Callable[[str, list[AdmittedJob]], None] = lambda route, jobs: None
        self.pass_slot: Callable[[str], None] = lambda request_id: None

    def limited(self, route: str) -> bool:
        return route in self.routes

    def _now(self) -> str:
        return str(self._clock()) if self._clock is not None else ""

    def call_id(self) -> str:
        return f"{self.consumer}.{next(self._calls)}"

    async def _run(
        self,
        route: str,
        source: str,
        call_id: str,
        args: list[object],
        *,
        durable: bool = False,
        extra_keys: tuple[str, ...] = (),
    ) -> Any:
        """One script on the route's master. ``durable`` (an OFFER, with ``durability = "replica"``): a WAIT
        follows on the same connection, its own (it blocks the connection for up to its timeout), so the
        route's store holds the job on the replicas before the caller acks its jobs entry."""
        rk = self.routes[route]
        keys = [*rk.script_keys(call_id), *extra_keys]
        slot = key_slot(rk.state)
        c = self.config
        wait = (c.durability_replicas, c.durability_timeout_ms) if durable and c.durability == "replica" else None
        purpose = "capacity" if wait is None else "capacity-durable"

        async def once() -> Any:
            argv = [self._now(), *args]
            reply, acked = await self.router.evalsha(purpose, slot, sha(source), source, keys, argv, wait=wait)
            if wait is not None and (acked or 0) < wait[0]:
                log.warning(
                    "an offered job reached fewer replicas than asked within the wait",
                    extra={"route": route, "replicas_acked": acked or 0},
                )
            return reply

        return await with_retry(once, outage_limit=self.config.redis_outage_limit)

    # -- the fleet's limits -------------------------------------------------------------------------------------

    async def publish_limits(self, live: set[str]) -> None:
        """Store this worker's limits in each limited route's state; ``live``: the consumer names of the live
        workers of the prefix. Raises ``LimitsMismatch`` when a live one stored other limits."""
        for name, rk in self.routes.items():
            mine = limits_of(self.config, self.config.routes[name])
            slot = key_slot(rk.state)
            stored, by = await self.router.call("capacity", slot, "HMGET", rk.state, "limits", "limits_by")
            if stored is not None and _s(stored) != mine and by is not None and _s(by) in live - {self.consumer}:
                raise LimitsMismatch(
                    f"routes.{name}: this worker's limits {mine} differ from {_s(stored)}, enforced by live worker "
                    f"{_s(by)} of the same key prefix {self.keys.prefix!r}: workers of one prefix enforce one set"
                )
            await self.router.call("capacity", slot, "HSET", rk.state, "limits", mine, "limits_by", self.consumer)

    # -- the scripts --------------------------------------------------------------------------------------------

    async def offer(
        self,
        route: str,
        request_id: str,
        token: str,
        record: WaitRecord,
        *,
        start_now: bool,
        fallback_only: bool = False,
    ) -> Offered:
        """One job's OFFER (``offer_many``): admitted now only with ``start_now`` (the caller holds a free run
        slot for it)."""
        job = OfferJob(request_id, token, record, fallbacks=fallback_only)
        return (await self.offer_many(route, [job], slots=1 if start_now else 0))[0]

    async def offer_many(
        self, route: str, jobs: Sequence[OfferJob], *, slots: int, hand_over: str | None = None
    ) -> list[Offered]:
        """Hand read jobs to their route in one call, each in order: admitted now under its token while the
        caller's ``slots`` (free run slots it took for the call) last, else parked in the route's queue (or
        ``held``, ``done``, ``cooldown``, ``too_large``: ``Offered``). At most ``slots`` are admitted.
        ``hand_over`` (a single instance only: the jobs' shard stream): the script also acks each job's entry
        and writes a parked job's status, when the route took custody (``Offered.handed``)."""
        args: list[object] = [self.consumer, self.lease_ms, slots, len(jobs), self.config.group, route]
        for job in jobs:
            rec = job.record
            args += [
                job.request_id,
                job.token,
                rec.tenant,
                rec.priority,
                rec.est_tokens,
                wait_member(rec.tenant, rec.queued_at, job.request_id),
                encode_wait_record(rec),
                "1" if job.fallbacks else "0",
                rec.job_entry,
            ]
        extra = (hand_over, *(job.status for job in jobs)) if hand_over is not None else ()
        replies = await self._run(route, cs.OFFER, "-", args, durable=True, extra_keys=extra)
        out: list[Offered] = []
        for job, reply in zip(jobs, replies, strict=True):
            kind = _s(reply[0])
            handed = hand_over is not None and kind in ("admitted", "parked", "held", "done")
            if kind == "admitted":
                self._hold(route, job.request_id, job.token)
                out.append(Offered("admitted", token=job.token, handed=handed))
            elif kind == "parked":
                at = int(float(_s(reply[2])))
                out.append(Offered("parked", waiting_on=_s(reply[1]), retry_at=at, handed=handed))  # type: ignore[arg-type]
            elif kind == "cooldown":
                out.append(Offered("cooldown", retry_at=int(float(_s(reply[1]))), slot=_s(reply[2]) == "1"))
            else:
                out.append(Offered(kind, handed=handed))  # type: ignore[arg-type]
        return out

    def _hold(self, route: str, request_id: str, token: str) -> None:
        """An admission of this worker: its lease and its first attempt's permit, renewed from now on."""
        held = self.held[route]
        held.leases[request_id] = token
        held.permits.add(token)

    def _took(self, route: str, adm: Admitted) -> Admitted:
        for job in adm.jobs:
            self._hold(route, job.request_id, job.token)
        return adm

    async def admit(self, route: str, n: int, *, call_id: str | None = None) -> Admitted:
        """Up to ``n`` waiting jobs, in the discipline's order, each leased to this worker."""
        cid = call_id or self.call_id()
        reply = await self._run(route, cs.ADMIT, cid, [cid, self.consumer, n, self.lease_ms])
        return self._took(route, _admitted(reply))

    async def acquire(
        self,
        route_name: str,
        token: str,
        home: bool,
        *,
        request_id: str,
        lease_token: str = "",
        est_tokens: int = 0,
    ) -> Acquired:
        """A permit on ``route_name`` for one attempt (k > 1 of a job, or a fallback attempt on a route other
        than the job's own: ``home=False``, no lease checked). Refused on concurrency it leaves a reservation
        under ``token``, which the next call with the same token turns into the permit. ``fenced``: with
        ``home``, the lease is no longer ``lease_token``'s."""
        reply = await self._run(
            route_name,
            cs.ACQUIRE,
            "-",
            [request_id, token, lease_token, self.consumer, est_tokens, self.lease_ms, "1" if home else "0"],
        )
        kind = _s(reply[0])
        if kind == "ok":
            self.held[route_name].permits.add(token)
            return Acquired("ok")
        if kind == "wait":
            self.held[route_name].permits.add(token)  # the reservation is renewed like a permit
            return Acquired("wait", int(float(_s(reply[1]))), _s(reply[2]))  # type: ignore[arg-type]
        return Acquired("fenced")

    async def renew(self, route: str) -> list[str]:
        """Extend every lease and permit this worker holds on ``route``; the request ids whose lease is no
        longer this worker's (taken over meanwhile: fence their attempts)."""
        held = self.held[route]
        leases, permits = dict(held.leases), sorted(held.permits)
        if not leases and not permits:
            return []
        pairs = [x for rid, tok in leases.items() for x in (rid, tok)]
        reply = await self._run(route, cs.RENEW, "-", [self.consumer, self.lease_ms, len(leases), *pairs, *permits])
        lost = [_s(r) for r in reply]
        for rid in lost:
            if held.leases.get(rid) == leases[rid]:
                del held.leases[rid]
        return lost

    async def release(
        self,
        route: str,
        request_id: str,
        token: str,
        lease_token: str,
        *,
        final: bool,
        outcome: Outcome = "other",
        retry_after_ms: int | None = None,
        actual_tokens: int | None = None,
        handoff: int = 0,
    ) -> Released:
        """End an attempt's permit (``final``: and the job's custody, after FINALIZE), settle its tokens, start
        or extend the route's cooldown on ``rate_limit`` / ``overloaded``, and admit up to ``handoff`` waiting
        jobs for this worker in the same round trip. For a fallback attempt's permit, ``lease_token`` is ''
        and ``final`` False."""
        cid = self.call_id()
        reply = await self._run(
            route,
            cs.RELEASE,
            cid,
            [
                request_id,
                token,
                lease_token,
                "1" if final else "0",
                outcome,
                "" if retry_after_ms is None else retry_after_ms,
                "" if actual_tokens is None else actual_tokens,
                cid,
                self.consumer,
                handoff,
                self.lease_ms,
                self.finished_ms,
            ],
        )
        held = self.held[route]
        held.permits.discard(token)
        if final and held.leases.get(request_id) == lease_token:
            del held.leases[request_id]
        return Released(_s(reply[0]) == "fenced", self._took(route, _admitted(reply[1])))

    def drop_permit(self, route: str, token: str) -> None:
        """Stop renewing one attempt token (refused without a reservation, or given up: expiry frees it)."""
        self.held[route].permits.discard(token)

    def forget(self, route: str, request_id: str, lease_token: str) -> None:
        """Stop renewing a lease and its first attempt's permit (its attempt was fenced or its job ended without
        a RELEASE reaching Redis); its later attempts' permits go with ``drop_permit``."""
        held = self.held[route]
        if held.leases.get(request_id) == lease_token:
            del held.leases[request_id]
        held.permits.discard(lease_token)
