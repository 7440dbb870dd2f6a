"""A claimed request's attempts: each its own stream (``<request_id>:<attempt>``) with its own stream.start
and terminal, retried (or sent to a fallback route, ``sluice.worker.capacity.fallback``) only while nothing was
visible, then finalized.

Rule: attempts are never spliced; there is no automatic retry once a ``block.delta`` was appended (a
reader may have seen it). A cancel ends the attempt ``interrupted`` / ``cancelled``; a fenced attempt (the
job was taken over) writes nothing more and stops at once. An attempt whose acknowledged appends Redis lost
(a failover, ``LogLost``) ends ``interrupted`` / ``transport`` right after what Redis still holds: never a
log with a hole.

On limited routes each attempt runs under a permit of its route (``sluice.worker.capacity.permits``): a fallback
route that is full or cooling is skipped like a failed hop, the job's own route is waited for within the
retry budget.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace
from typing import Any

import anyio

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.requests import build_request
from sluice.normalizer.stream import Normalizer
from sluice.schemas.errors import WorkerError
from sluice.schemas.events import Event, StreamError
from sluice.schemas.jobs import Job
from sluice.worker.append.log import PendingBatch, RequestLog
from sluice.worker.append.store import AttemptStore
from sluice.worker.capacity.fallback import FallbackChain, model_for
from sluice.worker.capacity.permits import ClaimPermits, FirstRoute, Leased, attempt_outcome, settled_tokens
from sluice.worker.capacity.spend import AttemptBudget
from sluice.worker.clock import now_ms
from sluice.worker.config import Config, Route, Timeouts, request_options
from sluice.worker.credentials import CredentialUnavailable, OutgoingRequest
from sluice.worker.observability.genai import genai_call
from sluice.worker.observability.telemetry import AttemptTelemetry, entry_time_ms
from sluice.worker.pipeline.claim import (
    attempt_routes,
    claim,
    close_lost_attempt,
    end_attempt_as_stored,
    new_log,
    nothing_to_run,
)
from sluice.worker.pipeline.context import Deps, InFlight
from sluice.worker.pipeline.finalize import finalize
from sluice.worker.pipeline.output_checks import attempt_checks
from sluice.worker.pipeline.upstream import AttemptReport, pump
from sluice.worker.redis.retry import Fenced, LogLost

__all__ = ["REQUEST_ID_HEADER", "admitted_route", "run_request"]

log = logging.getLogger("sluice.worker")

# Sent upstream only on routes that opt in (``send_request_id``): producer-chosen ids are theirs to share.
REQUEST_ID_HEADER = "x-sluice-request-id"


async def run_request(
    deps: Deps,
    entry_id: str,
    rid: str,
    job: Job,
    route: Route,
    shard: int = 0,
    lease: Leased | None = None,
    first: FirstRoute | None = None,
) -> None:
    """Claim the request (its job entry read from job shard ``shard``), run its attempts (on its route and its
    fallback routes, ``sluice.worker.capacity.fallback``), store its terminal status. ``lease``: the job was admitted
    by its limited route; ``first``: its route was cooling at admission and ``first.route`` admitted it
    (``sluice.worker.capacity.permits``). Raises ``Fenced``."""
    cfg = deps.config
    model = job.model or route.model or ""
    rlog = new_log(deps, rid)
    # Registered before the claim, so a cancel that arrives meanwhile is not missed.
    handle = InFlight(rid, entry_id, shard)
    deps.inflight[rid] = handle
    chain = FallbackChain(job.route, tuple(route.fallbacks if job.fallbacks is None else job.fallbacks))
    permits = ClaimPermits(cfg, deps.admission, rid, job, lease, first)
    budget = AttemptBudget(deps.spend, cfg, job, rid)
    try:
        c = await claim(deps, rlog, entry_id, rid, job, job.route, model, shard, token=lease.token if lease else None)
        if await nothing_to_run(deps, rlog, rid, c):
            await permits.finish()
            return
        attempt = c.attempt
        if c.outcome == "takeover":
            # The lost worker may have died before writing anything: its attempt still counts.
            attempt = max(attempt, 1)
            ended = await close_lost_attempt(deps, rlog, rid, c, attempt)
            chain.tried = await attempt_routes(deps, rlog, attempt, job.route)
            if ended is not None:
                await finalize(deps, rlog, rid, ended[0], ended[1], job, routes=chain.tried)
                await permits.finish()
                return
        elif attempt > 0:
            chain.tried = await attempt_routes(deps, rlog, attempt, job.route)
        if c.cancel:
            handle.reason = "cancelled before a worker picked the request up"
        backoff_spent = 0.0
        # Queue wait: from the enqueue (the jobs entry id's time) to the first attempt of a fresh claim.
        queued_at = entry_time_ms(entry_id) if c.outcome == "run" else None
        name = job.route
        if first is not None:  # the job's route cooled at admission: the chain goes on after first.route
            for _ in range(first.skipped + 1):
                chain.next_route()
            name = first.route
        # The job's own route's last failure: after a fallback attempt, the retry policy judges that one.
        home: tuple[Event, Normalizer, AttemptReport] | None = None
        try:
            while True:
                attempt += 1
                here = cfg.routes[name]
                here_model = model_for(route, job.model, here, is_home=name == job.route)
                chain.tried.append(name)
                with deps.telemetry.attempt(
                    request_id=rid,
                    route=name,
                    dialect=here.dialect,
                    model=here_model or None,
                    attempt=attempt,
                    trace=job.trace,
                    queued_at_ms=queued_at,
                    genai=genai_call(
                        dialect=here.dialect,
                        base_url=here.base_url,
                        request=job.request,
                        model=here_model or None,
                        configured_model=here.model,
                    )
                    if deps.telemetry.enabled
                    else None,
                ) as tel:
                    queued_at = None
                    timeouts = cfg.route_timeouts(here).apply(job.timeouts)
                    norm, report = await _run_attempt(
                        deps, rlog, rid, job, name, here, here_model, attempt, timeouts, handle, tel, budget
                    )
                    await budget.settle(norm.result().usage, name, here_model)
                    term: Event | None = norm.machine.terminal_event
                    assert term is not None
                    permits.ended(
                        attempt_outcome(term, bool(norm.machine.visible_deltas)),
                        report.retry_after,
                        settled_tokens(norm.result()),
                    )
                    hop = _next_route(chain, name, term, norm, handle)
                    if name == job.route:
                        home = (term, norm, report)
                    delay: float | None = None
                    if hop is None:
                        delay = _resume_delay(cfg, job, name, home, term, norm, report, chain, backoff_spent, handle)
                    tel.record_cancel(handle.cancel_requested_at, handle.upstream_closed_at)
                    tel.finish(
                        term,
                        norm.statistics(),
                        retrying=hop is not None or delay is not None,
                        response_id=norm.machine.response_id,
                    )
                if hop is None and delay is None:
                    break
                # The attempt's permit goes back now: a retry's wait holds none, its 429 cools its route.
                await permits.release()
                if hop is not None:
                    log.info("falling back", extra={"request_id": rid, "attempt": attempt, "route": hop})
                    nxt = await admitted_route(permits, chain, hop, attempt + 1)
                    if nxt is not None:
                        name = nxt
                        continue
                    # Every route left in the chain is full or cooling: the job's own route, under the retry policy.
                    delay = _resume_delay(cfg, job, name, home, term, norm, report, chain, backoff_spent, handle)
                    if delay is None:
                        break
                assert delay is not None
                log.info("retrying", extra={"request_id": rid, "attempt": attempt, "delay": delay})
                backoff_spent += delay
                name = job.route
                await anyio.sleep(delay)
                started = time.monotonic()
                if not await permits.take(name, attempt + 1, cfg.retry.max_total - backoff_spent):
                    break  # the route stayed closed past the retry budget: this attempt's end is final
                backoff_spent += time.monotonic() - started
            result = norm.result()
        except LogLost as exc:
            log.error(
                "Redis lost acknowledged events; the attempt ends where its log ends",
                extra={"request_id": rid, "attempt": exc.attempt},
            )
            term, result = await end_attempt_as_stored(deps, rlog, rid, exc.attempt, "transport", exc.message)
        await finalize(deps, rlog, rid, term, result, job, routes=chain.tried)
        await permits.finish()  # after FINALIZE: a worker dying in between leaves a lease that expires
    finally:
        permits.forget()
        budget.forget()
        if deps.inflight.get(rid) is handle:
            del deps.inflight[rid]


async def admitted_route(permits: ClaimPermits, chain: FallbackChain, name: str | None, attempt: int) -> str | None:
    """The fallback route attempt ``attempt`` runs on: ``name`` (the one a failed attempt handed over to)
    when it admits it now (a permit on a limited route, nothing to ask of any other), else the next of the
    chain that does; None when none left does (the job's own route then resumes under the retry policy)."""
    while name is not None:
        if await permits.take(name, attempt, None):
            return name
        log.info("fallback route full or cooling, skipped", extra={"request_id": permits.rid, "route": name})
        name = chain.next_route()
    return None


def _resume_delay(
    cfg: Config,
    job: Job,
    name: str,
    home: tuple[Event, Normalizer, AttemptReport] | None,
    term: Event,
    norm: Normalizer,
    report: AttemptReport,
    chain: FallbackChain,
    spent: float,
    handle: InFlight,
) -> float | None:
    """The back-off before the job's own route's next attempt, or None when the last attempt's end is final.
    Retries go to the job's own route, judged on its last failure: a fallback's own failure says nothing of
    it (and before any attempt there, a job sent to a fallback at admission goes back at once)."""
    if name != job.route and _failed_unseen(term, norm, handle):
        if home is None:
            return 0.0
        term, norm, report = home
    return _retry_delay(cfg, term, norm, report, chain.home_attempts, spent, handle)


def _failed_unseen(term: Event, norm: Normalizer, handle: InFlight) -> bool:
    """The attempt failed before anything was visible, and not because the request was cancelled nor because
    its output failed its checks nor because a budget had no room (``invalid_output`` and ``budget_exceeded``
    are never retried, nor sent to a fallback)."""
    return (
        isinstance(term, StreamError)
        and handle.reason is None
        and not norm.machine.visible_deltas
        and term.error.category not in ("invalid_output", "budget_exceeded")
    )


def _next_route(chain: FallbackChain, name: str, term: Event, norm: Normalizer, handle: InFlight) -> str | None:
    """The fallback route the next attempt goes to at once, or None. On the job's own route only an
    availability failure hops (``fallback.falls_back``); on a fallback route any failure before anything
    was visible moves on (its own refusal, e.g. a key it rejects, says nothing about the request)."""
    if not _failed_unseen(term, norm, handle):
        return None
    assert isinstance(term, StreamError)
    if name == chain.home:
        return chain.after(term.error.category, visible=False, received=norm.bytes_in > 0)
    return chain.next_route()


def _retry_delay(
    cfg: Config, term: Event, norm: Normalizer, report: AttemptReport, attempt: int, spent: float, handle: InFlight
) -> float | None:
    """Seconds to wait before the next attempt, or None when this attempt's outcome is final. ``attempt``
    counts the attempts on the job's own route (fallback attempts have their own budget, the chain)."""
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
    route_name: str,
    route: Route,
    model: str,
    attempt: int,
    timeouts: Timeouts,
    handle: InFlight,
    tel: AttemptTelemetry,
    budget: AttemptBudget,
) -> tuple[Normalizer, AttemptReport]:
    """One attempt: its own stream, its own stream.start (naming its route) and terminal. Raises ``Fenced``."""
    checks = attempt_checks(deps, job, route)
    info = StreamInfo(
        f"{rid}:{attempt}",
        rid,
        route.provider or "",
        route.dialect,
        attempt,
        model or None,
        route=route_name,
        checks=None if isinstance(checks, str) else checks,
    )
    norm = Normalizer(route.dialect, info, deps.config.limits)
    report = AttemptReport()
    store = AttemptStore(rlog, attempt, handle)
    try:
        if isinstance(checks, str):  # a schema this worker cannot compile: nothing is sent
            await store.send(PendingBatch.of(norm.fail("invalid_request", checks, now_ms(), retryable=False)))
        else:
            await _drive(
                deps, norm, store, rid, job, route_name, route, model, timeouts, handle, report, tel, budget, attempt
            )
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
    route_name: str,
    route: Route,
    model: str,
    timeouts: Timeouts,
    handle: InFlight,
    report: AttemptReport,
    tel: AttemptTelemetry,
    budget: AttemptBudget,
    attempt: int,
) -> None:
    if handle.reason is not None:
        return
    headers = dict(route.headers)
    if route.send_request_id:
        headers[REQUEST_ID_HEADER] = rid
    options: dict[str, Any] = request_options(route)
    try:
        req = build_request(
            route.dialect,
            job.request,
            model=model,
            api_key=None,  # the route's credential adds its own headers below
            extra_headers=headers,
            path=route.path,
            path_values={k: v for k in ("project", "location") if (v := getattr(route, k)) is not None},
            **options,
        )
    except WorkerError as exc:  # the dialect cannot express this request: nothing is sent
        await store.send(PendingBatch.of(norm.fail("invalid_request", exc.message, now_ms(), retryable=False)))
        return
    url = req.url(route.base_url)
    try:
        credential = deps.credentials().for_route(route_name)
        added = await credential.apply(OutgoingRequest(req.method, url, req.headers, req.body))
    except CredentialUnavailable as exc:
        await store.send(PendingBatch.of(norm.fail("authentication", exc.message, now_ms(), retryable=False)))
        return
    req = replace(req, headers={**req.headers, **{k.lower(): v for k, v in added.items()}})
    for warning in req.warnings:  # e.g. another dialect's reasoning left out: said in the stream, and logged
        norm.machine.note("request_adapted", warning)
        log.info("request adapted for the dialect", extra={"request_id": rid, "warning": warning})
    # The budgets' room for this attempt's worst case is held last, right before anything is sent.
    wait_s = timeouts.total  # attempts in flight under the same budget settle within theirs
    if (
        refused := await budget.reserve(
            route_name, model, attempt, wait_s=wait_s, stop=lambda: handle.reason is not None
        )
    ) is not None:
        await store.send(PendingBatch.of(norm.fail(refused[0], refused[1], now_ms(), retryable=False)))
        return
    with anyio.CancelScope() as scope:
        handle.scope = scope
        if handle.reason is None:
            budget.sent = True
            await pump(deps.http, route.base_url, req, norm, store.send, timeouts, report, tel, deps.secrets())
    handle.scope = None
    if scope.cancelled_caught:
        # pump's exit closed the response: the provider's connection is gone by now.
        handle.upstream_closed_at = time.monotonic()
