"""The capacity permits of one claim's attempts, on the job's own route and on its fallback routes
(docs/design-capacity.md B.4, B.7; docs/notes/cap-merge.md).

Rule: an attempt on a limited route runs under a permit of that route, at most one at a time per claim.
Attempt 1 of an admitted job runs on its admission's permit (token = the lease token); every later one,
and every attempt of a job held by its jobs entry, ACQUIREs ``<base>:<attempt>`` right before it: ``home=1``
with the lease on the job's own route, ``home=0`` (a permit only, no lease checked) on a fallback route or
without a lease. The permit is released (RELEASE final=0, with the attempt's outcome, retry-after and usage)
as soon as the attempt ends, so a retry's back-off holds none and a 429 cools the route that answered it.
The lease, and RELEASE final=1 after FINALIZE, stay on the job's own route. A fallback route that is full or
cooling is skipped (one ACQUIRE, its reservation dropped); the job's own route is waited for within the
retry budget. Routes without limits make no call here.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import anyio

from sluice.schemas.events import Event, StreamError
from sluice.schemas.jobs import Job, encode_job
from sluice.worker.capacity.admission import ADMIT_MAX, Admission, Outcome, estimate_tokens
from sluice.worker.clock import now_ms
from sluice.worker.config import Config
from sluice.worker.redis.retry import Fenced

__all__ = ["ClaimPermits", "FirstRoute", "Leased", "attempt_outcome", "settled_tokens"]


@dataclass(slots=True)
class Leased:
    """A job admitted by its limited route: its custody (the lease, on ``route``, the job's own) and its
    admission's estimate. Attempt 1 of the claim runs on the admission's permit (token = the lease token)."""

    admission: Admission
    route: str
    token: str  # the lease token, also the CLAIM's
    est_tokens: int


@dataclass(frozen=True, slots=True)
class FirstRoute:
    """A job whose own route was in cooldown at admission, sent to the fallback ``route`` instead (held by
    its jobs entry, no lease): ``token`` its permit there ("" on a route without limits), ``base`` the
    claim's attempt tokens' prefix, ``skipped`` the fallbacks before it that were full or cooling."""

    route: str
    token: str
    base: str
    skipped: int


def attempt_outcome(term: Event | None, visible: bool) -> Outcome:
    """What RELEASE is told of an attempt: ``rate_limit`` / ``overloaded`` before anything was visible cool
    the route; ``ok`` resets its streak."""
    if not isinstance(term, StreamError):
        return "ok"
    if not visible and term.error.category in ("rate_limit", "overloaded"):
        return term.error.category
    return "other"


def settled_tokens(result: object) -> int | None:
    usage = getattr(result, "usage", None)
    if usage is None or (usage.input_tokens is None and usage.output_tokens is None):
        return None
    return (usage.input_tokens or 0) + (usage.output_tokens or 0)


class ClaimPermits:
    """The permit the claim's current attempt holds (or the reservation a refused ACQUIRE left), and the
    facts of the attempt that ended under it, for its RELEASE."""

    def __init__(
        self, cfg: Config, adm: Admission | None, rid: str, job: Job, lease: Leased | None, first: FirstRoute | None
    ) -> None:
        self.cfg, self.adm, self.rid, self.job, self.lease = cfg, adm, rid, job, lease
        self.base = lease.token if lease else first.base if first else adm.call_id() if adm else ""
        # The permit attempt 1 runs on: the admission's, or the fallback's that admitted it ("" none).
        self.route, self.token = ("", "")
        if lease is not None:
            self.route, self.token = lease.route, lease.token
        elif first is not None and first.token:
            self.route, self.token = first.route, first.token
        self._bytes: int | None = None
        self._ended: tuple[Outcome, int | None, int | None] = ("other", None, None)
        self._taken: list[tuple[str, str]] = []  # (route, token) of every ACQUIRE: what ``forget`` drops

    def limited(self, name: str) -> bool:
        return self.adm is not None and self.adm.limited(name)

    def _est(self, name: str) -> int:
        if self.lease is not None and name == self.lease.route:
            return self.lease.est_tokens
        if self._bytes is None:
            self._bytes = len(encode_job(self.job))
        return estimate_tokens(self._bytes, self.job.request.max_tokens, self.cfg.routes[name])

    def _home(self, name: str) -> bool:
        return self.lease is not None and name == self.lease.route

    async def take(self, name: str, attempt: int, budget: float | None) -> bool:
        """ACQUIRE the permit of ``attempt`` on ``name`` (no call on a route without limits). ``budget`` None
        (a fallback route): one try, False when the route is full or cooling. Else wait (cooldown, a full
        route) within ``budget`` seconds, False when it ran out first. Raises ``Fenced`` when the lease is
        no longer this claim's."""
        if not self.limited(name):
            self.route = ""
            return True
        adm = self.adm
        assert adm is not None
        token = f"{self.base}:{attempt}"
        self.route, self.token = name, token  # a reservation left by a refusal is released under it too
        self._taken.append((name, token))
        home = self._home(name)
        deadline = time.monotonic() + (budget or 0.0)
        while True:
            got = await adm.acquire(
                name,
                token,
                home,
                request_id=self.rid,
                lease_token=self.lease.token if home and self.lease else "",
                est_tokens=self._est(name),
            )
            if got.outcome == "ok":
                return True
            if got.outcome == "fenced":
                raise Fenced(f"request {self.rid}: its lease on route {name} was taken over")
            if budget is None:
                # Skipped: a reservation it left goes back at once, so the route's own jobs keep their place.
                if got.waiting_on == "concurrency":
                    await self.release()
                else:
                    adm.drop_permit(name, token)
                    self.route = ""
                return False
            wait = max(0.01, (got.retry_at - now_ms()) / 1000)
            wait = min(wait, 0.25) * random.uniform(0.8, 1.0) if got.waiting_on == "concurrency" else wait
            if time.monotonic() + wait > deadline:
                return False
            await anyio.sleep(wait)

    def ended(self, outcome: Outcome, retry_after: float | None, actual_tokens: int | None) -> None:
        """The attempt under the current permit ended so: its RELEASE reports it."""
        self._ended = (outcome, None if retry_after is None else int(retry_after * 1000), actual_tokens)

    async def release(self, *, final: bool = False) -> None:
        """RELEASE the current permit (``final``: and the lease, after FINALIZE), with the ended attempt's
        facts (reported once), and a handoff ADMIT of this worker's free slots on that route."""
        if self.adm is None or (not self.route and not final):
            return
        adm = self.adm
        route = self.route or (self.lease.route if self.lease else "")
        if not route:
            return
        home = self._home(route)
        outcome, retry_ms, actual = self._ended if self.route else ("other", None, None)
        token = self.token if self.route else (self.lease.token if self.lease else "")
        # The handoff's slots: the worker's free ones, taken for the call, and with ``final`` this leased job's
        # own, which goes on to the first job handed off.
        accepting = adm.accepting()
        taken = adm.take_slots(ADMIT_MAX) if accepting else 0
        own = 1 if final and accepting else 0
        try:
            rel = await adm.release(
                route,
                self.rid,
                token,
                self.lease.token if home and self.lease else "",
                final=final,
                outcome=outcome,
                retry_after_ms=retry_ms,
                actual_tokens=actual,
                handoff=taken + own,
            )
        except BaseException:
            adm.give_slots(taken)
            raise
        self.route, self._ended = "", ("other", None, None)
        got = len(rel.handoff.jobs)
        if own and got:
            adm.pass_slot(self.rid)
            got -= 1
        adm.give_slots(taken - got)
        if rel.handoff.jobs:
            adm.on_handoff(route, rel.handoff.jobs)
        if rel.fenced and not final:
            raise Fenced(f"request {self.rid}: its lease on route {route} was taken over")

    async def finish(self) -> None:
        """After FINALIZE: the last permit goes back; with a lease, RELEASE final=1 on the job's own route
        (in the same call when the last permit is there)."""
        if self.lease is None:
            await self.release()
            return
        if self.route and self.route != self.lease.route:
            await self.release()
        await self.release(final=True)

    def forget(self) -> None:
        """Stop renewing what this claim holds (it was fenced, or ended without its RELEASE reaching Redis):
        expiry gives it back."""
        if self.adm is None:
            return
        if self.lease is not None:
            self.adm.forget(self.lease.route, self.rid, self.lease.token)
        if self.route:
            self.adm.drop_permit(self.route, self.token)
        for route, token in self._taken:
            self.adm.drop_permit(route, token)
