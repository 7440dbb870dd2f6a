"""A claimed request's attempts: each its own stream (``<request_id>:<attempt>``) with its own stream.start
and terminal, retried only while nothing was visible, then finalized.

Rule: attempts are never spliced; there is no automatic retry once a ``block.delta`` was appended (a
reader may have seen it). A cancel ends the attempt ``interrupted`` / ``cancelled``; a fenced attempt (the
job was taken over) writes nothing more and stops at once. An attempt whose acknowledged appends Redis lost
(a failover, ``LogLost``) ends ``interrupted`` / ``transport`` right after what Redis still holds: never a
log with a hole.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import anyio

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.requests import build_request
from sluice.normalizer.stream import Normalizer
from sluice.schemas.errors import WorkerError
from sluice.schemas.events import Event, StreamError
from sluice.schemas.jobs import Job
from sluice.worker.admission import Admission, Outcome
from sluice.worker.append.log import PendingBatch, RequestLog
from sluice.worker.append.store import AttemptStore
from sluice.worker.claim import claim, close_lost_attempt, end_attempt_as_stored, new_log, nothing_to_run
from sluice.worker.clock import now_ms
from sluice.worker.config import Config, Route, Timeouts
from sluice.worker.context import Deps, InFlight
from sluice.worker.finalize import finalize
from sluice.worker.redis.retry import Fenced, LogLost
from sluice.worker.telemetry import AttemptTelemetry, entry_time_ms
from sluice.worker.upstream import AttemptReport, pump

__all__ = ["REQUEST_ID_HEADER", "Leased", "run_request"]

log = logging.getLogger("sluice.worker")

# Sent upstream only on routes that opt in (``send_request_id``): producer-chosen ids are theirs to share.
REQUEST_ID_HEADER = "x-sluice-request-id"


@dataclass(slots=True)
class Leased:
    """A job admitted by its limited route: its custody (the lease) and the permit its current attempt holds.
    Attempt 1 of the claim runs on the admission's permit (token = the lease token), each later one ACQUIREs
    ``<lease token>:<attempt>`` after RELEASE final=0 of the one before; RELEASE final=1 follows FINALIZE."""

    admission: Admission
    route: str
    token: str  # the lease token, also the CLAIM's
    est_tokens: int
    permit: str = ""

    def __post_init__(self) -> None:
        self.permit = self.permit or self.token


def _outcome(term: Event | None, visible: bool) -> Outcome:
    if not isinstance(term, StreamError):
        return "ok"
    if not visible and term.error.category in ("rate_limit", "overloaded"):
        return term.error.category
    return "other"


def _settled(result: object) -> int | None:
    usage = getattr(result, "usage", None)
    if usage is None or (usage.input_tokens is None and usage.output_tokens is None):
        return None
    return (usage.input_tokens or 0) + (usage.output_tokens or 0)


async def _next_permit(deps: Deps, lease: Leased, rid: str, attempt: int, budget: float) -> bool:
    """ACQUIRE the permit of ``attempt``, waiting (cooldown, a full route) within ``budget`` seconds. False when
    the budget ran out first. Raises ``Fenced`` when the lease is no longer this claim's."""
    token = f"{lease.token}:{attempt}"
    lease.permit = token  # a reservation left by a refusal is released under this token too
    deadline = time.monotonic() + budget
    while True:
        got = await lease.admission.acquire(
            lease.route, token, True, request_id=rid, lease_token=lease.token, est_tokens=lease.est_tokens
        )
        if got.outcome == "ok":
            return True
        if got.outcome == "fenced":
            raise Fenced(f"request {rid}: its lease on route {lease.route} was taken over")
        wait = max(0.01, (got.retry_at - now_ms()) / 1000)
        wait = min(wait, 0.25) * random.uniform(0.8, 1.0) if got.waiting_on == "concurrency" else wait
        if time.monotonic() + wait > deadline:
            return False
        await anyio.sleep(wait)


async def run_request(
    deps: Deps, entry_id: str, rid: str, job: Job, route: Route, shard: int = 0, lease: Leased | None = None
) -> None:
    """Claim the request (its job entry read from job shard ``shard``), run its attempts, store its terminal
    status. ``lease``: the job was admitted by its limited route (see ``Leased``). Raises ``Fenced``."""
    cfg = deps.config
    model = job.model or route.model or ""
    rlog = new_log(deps, rid)
    # Registered before the claim, so a cancel that arrives meanwhile is not missed.
    handle = InFlight(rid, entry_id, shard)
    deps.inflight[rid] = handle
    try:
        c = await claim(deps, rlog, entry_id, rid, job, job.route, model, shard, token=lease.token if lease else None)
        if await nothing_to_run(deps, rlog, rid, c):
            if lease is not None:
                await _release(deps, lease, rid, final=True, outcome="other")
            return
        attempt = c.attempt
        if c.outcome == "takeover":
            # The lost worker may have died before writing anything: its attempt still counts.
            attempt = max(attempt, 1)
            ended = await close_lost_attempt(deps, rlog, rid, c, attempt)
            if ended is not None:
                await finalize(deps, rlog, rid, ended[0], ended[1], job)
                if lease is not None:
                    await _release(deps, lease, rid, final=True, outcome="other")
                return
        if c.cancel:
            handle.reason = "cancelled before a worker picked the request up"
        timeouts = cfg.route_timeouts(route).apply(job.timeouts)
        backoff_spent = 0.0
        # Queue wait: from the enqueue (the jobs entry id's time) to the first attempt of a fresh claim.
        queued_at = entry_time_ms(entry_id) if c.outcome == "run" else None
        last_outcome: Outcome = "other"  # the last attempt's, for the final RELEASE (cooldown, streak)
        try:
            while True:
                attempt += 1
                with deps.telemetry.attempt(
                    request_id=rid,
                    route=job.route,
                    dialect=route.dialect,
                    model=model or None,
                    attempt=attempt,
                    trace=job.trace,
                    queued_at_ms=queued_at,
                ) as tel:
                    queued_at = None
                    norm, report = await _run_attempt(
                        deps, rlog, rid, job, route, model, attempt, timeouts, handle, tel
                    )
                    term: Event | None = norm.machine.terminal_event
                    assert term is not None
                    last_outcome = _outcome(term, bool(norm.machine.visible_deltas))
                    delay = _retry_delay(cfg, term, norm, report, attempt, backoff_spent, handle)
                    tel.record_cancel(handle.cancel_requested_at, handle.upstream_closed_at)
                    tel.finish(term, norm.statistics(), retrying=delay is not None)
                if delay is None:
                    break
                log.info("retrying", extra={"request_id": rid, "attempt": attempt, "delay": delay})
                backoff_spent += delay
                if lease is not None:
                    # The retry wait holds the lease and no permit; a 429 here cools the route for the fleet.
                    ms = None if report.retry_after is None else int(report.retry_after * 1000)
                    await _release(
                        deps,
                        lease,
                        rid,
                        final=False,
                        outcome=last_outcome,
                        retry_after_ms=ms,
                        actual_tokens=_settled(norm.result()),
                    )
                    last_outcome = "other"  # reported: the final RELEASE must not count it again
                await anyio.sleep(delay)
                if lease is not None:
                    started = time.monotonic()
                    if not await _next_permit(deps, lease, rid, attempt + 1, cfg.retry.max_total - backoff_spent):
                        break  # the route stayed closed past the retry budget: this attempt's end is final
                    backoff_spent += time.monotonic() - started
            result = norm.result()
        except LogLost as exc:
            log.error(
                "Redis lost acknowledged events; the attempt ends where its log ends",
                extra={"request_id": rid, "attempt": exc.attempt},
            )
            term, result = await end_attempt_as_stored(deps, rlog, rid, exc.attempt, "transport", exc.message)
        await finalize(deps, rlog, rid, term, result, job)
        if lease is not None:  # after FINALIZE: a worker dying in between leaves a lease that expires
            await _release(deps, lease, rid, final=True, outcome=last_outcome, actual_tokens=_settled(result))
    finally:
        if lease is not None:
            lease.admission.forget(lease.route, rid, lease.token)
        if deps.inflight.get(rid) is handle:
            del deps.inflight[rid]


async def _release(
    deps: Deps,
    lease: Leased,
    rid: str,
    *,
    final: bool,
    outcome: Outcome,
    retry_after_ms: int | None = None,
    actual_tokens: int | None = None,
) -> None:
    adm = lease.admission
    # The handoff: admit as many waiting jobs as this worker has free slots (one more at the end: this
    # job's own, about to free).
    free = adm.free_slots() + (1 if final else 0) if adm.accepting() else 0
    rel = await adm.release(
        lease.route,
        rid,
        lease.permit,
        lease.token,
        final=final,
        outcome=outcome,
        retry_after_ms=retry_after_ms,
        actual_tokens=actual_tokens,
        handoff=max(0, free),
    )
    if rel.handoff.jobs:
        adm.on_handoff(lease.route, rel.handoff.jobs)
    if rel.fenced and not final:
        raise Fenced(f"request {rid}: its lease on route {lease.route} was taken over")


def _retry_delay(
    cfg: Config, term: Event, norm: Normalizer, report: AttemptReport, attempt: int, spent: float, handle: InFlight
) -> float | None:
    """Seconds to wait before the next attempt, or None when this attempt's outcome is final."""
    if not isinstance(term, StreamError) or handle.reason is not None:
        return None
    # A broken or ended connection is worth another attempt when nothing was visible yet.
    if not (term.error.retryable or term.error.category == "transport"):
        return None
    if norm.machine.visible_deltas or attempt >= cfg.retry.max_attempts:
        return None  # after a visible delta a new attempt could contradict what a reader already saw
    cap = min(cfg.retry.max_delay, cfg.retry.base_delay * 2 ** (attempt - 1))
    delay = random.uniform(cap / 2, cap)
    if report.retry_after is not None:
        delay = max(delay, min(report.retry_after, cfg.retry.max_retry_after))
    if spent + delay > cfg.retry.max_total:
        return None
    return delay


async def _run_attempt(
    deps: Deps,
    rlog: RequestLog,
    rid: str,
    job: Job,
    route: Route,
    model: str,
    attempt: int,
    timeouts: Timeouts,
    handle: InFlight,
    tel: AttemptTelemetry,
) -> tuple[Normalizer, AttemptReport]:
    """One attempt: its own stream, its own stream.start and terminal. Raises ``Fenced``."""
    info = StreamInfo(f"{rid}:{attempt}", rid, route.provider or "", route.dialect, attempt, model or None)
    norm = Normalizer(route.dialect, info, deps.config.limits)
    report = AttemptReport()
    store = AttemptStore(rlog, attempt, handle)
    try:
        await _drive(deps, norm, store, rid, job, route, model, timeouts, handle, report, tel)
        if handle.fenced:
            raise Fenced(f"request {rid}: the job was taken over while attempt {attempt} ran")
        if not norm.terminal:
            reason = handle.reason or "the attempt ended without a terminal event"
            await store.send(PendingBatch.of(norm.interrupt(handle.category, reason, now_ms())))
        await store.drain()
    finally:
        store.abandon()
    return norm, report


async def _drive(
    deps: Deps,
    norm: Normalizer,
    store: AttemptStore,
    rid: str,
    job: Job,
    route: Route,
    model: str,
    timeouts: Timeouts,
    handle: InFlight,
    report: AttemptReport,
    tel: AttemptTelemetry,
) -> None:
    if handle.reason is not None:
        return
    api_key = deps.env.get(route.api_key_env, "") if route.api_key_env else ""
    if route.api_key_env and not api_key:
        msg = f"the route's API key variable {route.api_key_env} is not set"
        await store.send(PendingBatch.of(norm.fail("authentication", msg, now_ms(), retryable=False)))
        return
    headers = dict(route.headers)
    if route.send_request_id:
        headers[REQUEST_ID_HEADER] = rid
    try:
        req = build_request(
            route.dialect, job.request, model=model, api_key=api_key, extra_headers=headers, **route.request_options
        )
    except WorkerError as exc:  # the dialect cannot express this request: nothing is sent
        await store.send(PendingBatch.of(norm.fail("invalid_request", exc.message, now_ms(), retryable=False)))
        return
    for warning in req.warnings:  # e.g. another dialect's reasoning left out: said in the stream, and logged
        norm.machine.note("request_adapted", warning)
        log.info("request adapted for the dialect", extra={"request_id": rid, "warning": warning})
    with anyio.CancelScope() as scope:
        handle.scope = scope
        if handle.reason is None:
            await pump(deps.http, route.base_url, req, norm, store.send, timeouts, report, tel, deps.secrets())
    handle.scope = None
    if scope.cancelled_caught:
        # pump's exit closed the response: the provider's connection is gone by now.
        handle.upstream_closed_at = time.monotonic()
