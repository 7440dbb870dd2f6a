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

The steps, in the order ``run_request`` takes them: the claim (``_claim``), the attempt loop (``_attempts``):
one attempt under its telemetry (``_attempt``, which runs ``_run_attempt``) whose end decides what follows
it: a hop along the fallback chain (``_hop``, ``_fall_back``) or a retry on the job's own route
(``_RetryPolicy``, ``_retry``); then finalize.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import anyio

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.requests import build_request
from sluice.normalizer.requests.base import ProviderRequest
from sluice.normalizer.stream import Normalizer
from sluice.schemas.errors import WorkerError
from sluice.schemas.events import Event, StreamError
from sluice.schemas.jobs import Job
from sluice.schemas.result import Result
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
    rlog = new_log(deps, rid)
    # Registered before the claim, so a cancel that arrives meanwhile is not missed.
    handle = InFlight(rid, entry_id, shard)
    deps.inflight[rid] = handle
    chain = FallbackChain(job.route, tuple(route.fallbacks if job.fallbacks is None else job.fallbacks))
    permits = ClaimPermits(deps.config, deps.admission, rid, job, lease, first)
    budget = AttemptBudget(deps.spend, deps.config, job, rid)
    req = _Request(deps, rid, job, route, rlog, handle, chain, permits, budget)
    try:
        start = await _claim(req, entry_id, shard, lease)
        if start is not None:
            term, result = start.ended if start.ended is not None else await _attempts(req, start, first)
            await finalize(deps, rlog, rid, term, result, job, routes=chain.tried)
        await permits.finish()  # after FINALIZE: a worker dying in between leaves a lease that expires
    finally:
        permits.forget()
        budget.forget()
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


@dataclass(frozen=True, slots=True)
class _Request:
    """One claimed request, as every step of its attempts sees it. ``route`` is the job's own route's
    configuration, ``chain`` its fallback chain (``chain.tried``: the route of every attempt so far),
    ``permits`` the permit its current attempt holds."""

    deps: Deps
    rid: str
    job: Job
    route: Route
    rlog: RequestLog
    handle: InFlight
    chain: FallbackChain
    permits: ClaimPermits
    budget: AttemptBudget


@dataclass(frozen=True, slots=True)
class _Start:
    """Where the claim leaves the request: the attempts made before (by a lost worker, or by earlier
    deliveries of the job), the enqueue time (unix ms) for the first attempt's queue wait, given on a fresh
    claim only, and the request's end when a takeover found the lost attempt's end final."""

    attempt: int
    queued_at: int | None = None
    ended: tuple[Event, Result] | None = None


@dataclass(frozen=True, slots=True)
class _Ended:
    """How one attempt ended: its terminal, its normalizer (what was visible, whether bytes came) and what
    the HTTP side reported (a retry-after)."""

    term: Event
    norm: Normalizer
    report: AttemptReport


async def _claim(req: _Request, entry_id: str, shard: int, lease: Leased | None) -> _Start | None:
    """Claim the request; None when this delivery has nothing to run (the request is done, or a duplicate's).
    A takeover first ends the lost worker's attempt (its end may be the request's) and, like any claim after
    earlier attempts, reads back the routes those attempts ran on."""
    deps, rlog, rid, job = req.deps, req.rlog, req.rid, req.job
    model = job.model or req.route.model or ""
    token = lease.token if lease else None
    c = await claim(deps, rlog, entry_id, rid, job, job.route, model, shard, token=token)
    if await nothing_to_run(deps, rlog, rid, c):
        return None
    attempt = c.attempt
    if c.outcome == "takeover":
        # The lost worker may have died before writing anything: its attempt still counts.
        attempt = max(attempt, 1)
        ended = await close_lost_attempt(deps, rlog, rid, c, attempt)
        req.chain.tried = await attempt_routes(deps, rlog, attempt, job.route)
        if ended is not None:
            return _Start(attempt, ended=ended)
    elif attempt > 0:
        req.chain.tried = await attempt_routes(deps, rlog, attempt, job.route)
    if c.cancel:
        req.handle.reason = "cancelled before a worker picked the request up"
    # Queue wait: from the enqueue (the jobs entry id's time) to the first attempt of a fresh claim.
    return _Start(attempt, entry_time_ms(entry_id) if c.outcome == "run" else None)


async def _attempts(req: _Request, start: _Start, first: FirstRoute | None) -> tuple[Event, Result]:
    """Run attempts until one's end is final, each on the route the last one's end sent it to. Returns the
    request's terminal event and result; when Redis lost an attempt's acknowledged appends, the attempt
    ends where its stored log ends. Raises ``Fenced``."""
    retries = _RetryPolicy(req.deps.config, req.chain, req.handle)
    attempt, queued_at = start.attempt, start.queued_at
    name = _first_route(req.chain, first)
    try:
        while True:
            attempt += 1
            end, hop, delay = await _attempt(req, retries, name, attempt, queued_at)
            queued_at = None
            if (following := await _next_route(req, retries, name, attempt, end, hop, delay)) is None:
                return end.term, end.norm.result()
            name = following
    except LogLost as exc:
        log.error(
            "Redis lost acknowledged events; the attempt ends where its log ends",
            extra={"request_id": req.rid, "attempt": exc.attempt},
        )
        return await end_attempt_as_stored(req.deps, req.rlog, req.rid, exc.attempt, "transport", exc.message)


def _first_route(chain: FallbackChain, first: FirstRoute | None) -> str:
    """The route of the claim's first attempt: the job's own, or the fallback that admitted the job while
    its own was cooling (the chain then goes on after that one)."""
    if first is None:
        return chain.home
    for _ in range(first.skipped + 1):
        chain.next_route()
    return first.route


async def _attempt(
    req: _Request, retries: _RetryPolicy, name: str, attempt: int, queued_at: int | None
) -> tuple[_Ended, str | None, float | None]:
    """Attempt ``attempt`` on route ``name``, under its telemetry. Its end goes to its permit and decides
    what follows, before the telemetry ends (which records whether the request goes on): a fallback route
    at once (the hop), else the job's own route after a delay, else nothing (the end is final)."""
    cfg, job, handle = req.deps.config, req.job, req.handle
    here = cfg.routes[name]
    model = model_for(req.route, job.model, here, is_home=name == job.route)
    req.chain.tried.append(name)
    with _attempt_telemetry(req, name, here, model, attempt, queued_at) as tel:
        timeouts = cfg.route_timeouts(here).apply(job.timeouts)
        end = await _run_attempt(req, name, here, model, attempt, timeouts, tel)
        norm = end.norm
        await req.budget.settle(norm.result().usage, name, model)
        req.permits.ended(
            attempt_outcome(end.term, bool(norm.machine.visible_deltas)),
            end.report.retry_after,
            settled_tokens(norm.result()),
        )
        hop = _hop(req.chain, name, end, handle)
        retries.ended(name, end)
        delay = retries.delay(name, end) if hop is None else None
        tel.record_cancel(handle.cancel_requested_at, handle.upstream_closed_at)
        tel.finish(
            end.term,
            norm.statistics(),
            retrying=hop is not None or delay is not None,
            response_id=norm.machine.response_id,
        )
    return end, hop, delay


def _attempt_telemetry(
    req: _Request, name: str, route: Route, model: str, attempt: int, queued_at: int | None
) -> AttemptTelemetry:
    """The attempt's span and metrics (a context manager); the GenAI view of the call only when telemetry
    is on (building it costs more than the no-op)."""
    telemetry = req.deps.telemetry
    return telemetry.attempt(
        request_id=req.rid,
        route=name,
        dialect=route.dialect,
        model=model or None,
        attempt=attempt,
        trace=req.job.trace,
        queued_at_ms=queued_at,
        genai=genai_call(
            dialect=route.dialect,
            base_url=route.base_url,
            request=req.job.request,
            model=model or None,
            configured_model=route.model,
        )
        if telemetry.enabled
        else None,
    )


async def _next_route(
    req: _Request,
    retries: _RetryPolicy,
    name: str,
    attempt: int,
    end: _Ended,
    hop: str | None,
    delay: float | None,
) -> str | None:
    """The route of the attempt after attempt ``attempt`` (on ``name``), which ended so: ``hop`` or the next
    fallback that admits it, at once; else the job's own route once ``delay`` passed and its permit came;
    None when there is none (that end is final)."""
    if hop is None and delay is None:
        return None
    # The attempt's permit goes back now: a retry's wait holds none, its 429 cools its route.
    await req.permits.release()
    if hop is not None:
        if (admitted := await _fall_back(req, hop, attempt)) is not None:
            return admitted
        # Every route left in the chain is full or cooling: the job's own route, under the retry policy.
        delay = retries.delay(name, end)
        if delay is None:
            return None
    assert delay is not None
    return await _retry(req, retries, delay, attempt)


async def _fall_back(req: _Request, hop: str, attempt: int) -> str | None:
    """The fallback route after attempt ``attempt`` failed: ``hop``, or the next of the chain that admits
    the attempt now; None when none does."""
    log.info("falling back", extra={"request_id": req.rid, "attempt": attempt, "route": hop})
    return await admitted_route(req.permits, req.chain, hop, attempt + 1)


async def _retry(req: _Request, retries: _RetryPolicy, delay: float, attempt: int) -> str | None:
    """The job's own route after ``delay`` seconds and its permit for the next attempt; None when the route
    stayed closed past the retry budget (attempt ``attempt``'s end is then final)."""
    log.info("retrying", extra={"request_id": req.rid, "attempt": attempt, "delay": delay})
    if not await retries.wait(delay, req.permits, attempt + 1):
        return None
    return req.chain.home


def _failed_unseen(end: _Ended, handle: InFlight) -> bool:
    """The attempt failed before anything was visible, and not because the request was cancelled nor because
    its output failed its checks nor because a budget had no room (``invalid_output`` and ``budget_exceeded``
    are never retried, nor sent to a fallback)."""
    return (
        isinstance(end.term, StreamError)
        and handle.reason is None
        and not end.norm.machine.visible_deltas
        and end.term.error.category not in ("invalid_output", "budget_exceeded")
    )


def _hop(chain: FallbackChain, name: str, end: _Ended, handle: InFlight) -> str | None:
    """The fallback route the next attempt goes to at once, or None. On the job's own route only an
    availability failure hops (``fallback.falls_back``); on a fallback route any failure before anything
    was visible moves on (its own refusal, e.g. a key it rejects, says nothing about the request)."""
    if not _failed_unseen(end, handle):
        return None
    assert isinstance(end.term, StreamError)
    if name == chain.home:
        return chain.after(end.term.error.category, visible=False, received=end.norm.bytes_in > 0)
    return chain.next_route()


@dataclass(slots=True)
class _RetryPolicy:
    """One claim's retry decision: whether (and after how long) the job's own route runs another attempt.
    Retries go to the job's own route, judged on its last failure; ``spent`` is the time waited so far
    (back-offs and permit waits), which ``retry.max_total`` bounds."""

    cfg: Config
    chain: FallbackChain
    handle: InFlight
    spent: float = 0.0
    home: _Ended | None = None  # the job's own route's last attempt: after a fallback's, the one judged

    def ended(self, name: str, end: _Ended) -> None:
        """Attempt on ``name`` ended so."""
        if name == self.chain.home:
            self.home = end

    def delay(self, name: str, end: _Ended) -> float | None:
        """The back-off before the job's own route's next attempt, the attempt on ``name`` having ended so;
        None when that end is final. A fallback's own failure says nothing of the job's own route (and
        before any attempt there, a job sent to a fallback at admission goes back at once)."""
        if name != self.chain.home and _failed_unseen(end, self.handle):
            if self.home is None:
                return 0.0
            end = self.home
        return _retry_delay(self.cfg, end, self.chain.home_attempts, self.spent, self.handle)

    async def wait(self, delay: float, permits: ClaimPermits, attempt: int) -> bool:
        """Wait ``delay`` seconds, then for the job's own route's permit of ``attempt`` within what is left of
        the budget; False when the route stayed closed past it."""
        self.spent += delay
        await anyio.sleep(delay)
        started = time.monotonic()
        if not await permits.take(self.chain.home, attempt, self.cfg.retry.max_total - self.spent):
            return False
        self.spent += time.monotonic() - started
        return True


def _retry_delay(cfg: Config, end: _Ended, attempt: int, spent: float, handle: InFlight) -> float | None:
    """Seconds to wait before the next attempt, or None when this attempt's outcome is final. ``attempt``
    counts the attempts on the job's own route (fallback attempts have their own budget, the chain)."""
    term = end.term
    if not isinstance(term, StreamError) or handle.reason is not None:
        return None
    # A broken or ended connection is worth another attempt when nothing was visible yet.
    if not (term.error.retryable or term.error.category == "transport"):
        return None
    if end.norm.machine.visible_deltas or attempt >= cfg.retry.max_attempts:
        return None  # after a visible delta a new attempt could contradict what a reader already saw
    cap = min(cfg.retry.max_delay, cfg.retry.base_delay * 2 ** (attempt - 1))
    delay = random.uniform(cap / 2, cap)
    if end.report.retry_after is not None:
        delay = max(delay, min(end.report.retry_after, cfg.retry.max_retry_after))
    if spent + delay > cfg.retry.max_total:
        return None
    return delay


async def _run_attempt(
    req: _Request, name: str, route: Route, model: str, attempt: int, timeouts: Timeouts, tel: AttemptTelemetry
) -> _Ended:
    """One attempt: its own stream, its own stream.start (naming its route) and terminal, the latter written
    here when the provider's stream gave none (a cancel, a broken connection). Raises ``Fenced``."""
    rid, handle = req.rid, req.handle
    checks = attempt_checks(req.deps, req.job, route)
    info = StreamInfo(
        f"{rid}:{attempt}",
        rid,
        route.provider or "",
        route.dialect,
        attempt,
        model or None,
        route=name,
        checks=None if isinstance(checks, str) else checks,
    )
    norm = Normalizer(route.dialect, info, req.deps.config.limits)
    report = AttemptReport()
    store = AttemptStore(req.rlog, attempt, handle)
    try:
        if isinstance(checks, str):  # a schema this worker cannot compile: nothing is sent
            await store.send(PendingBatch.of(norm.fail("invalid_request", checks, now_ms(), retryable=False)))
        else:
            await _drive(req, norm, store, name, route, model, timeouts, report, tel, attempt)
        if handle.fenced:
            raise Fenced(f"request {rid}: the job was taken over while attempt {attempt} ran")
        if not norm.terminal:
            reason = handle.reason or "the attempt ended without a terminal event"
            await store.send(PendingBatch.of(norm.interrupt(handle.category, reason, now_ms())))
        await store.drain()
    finally:
        store.abandon()
    term = norm.machine.terminal_event
    assert term is not None
    return _Ended(term, norm, report)


async def _drive(
    req: _Request,
    norm: Normalizer,
    store: AttemptStore,
    name: str,
    route: Route,
    model: str,
    timeouts: Timeouts,
    report: AttemptReport,
    tel: AttemptTelemetry,
    attempt: int,
) -> None:
    """Build the attempt's request, add its route's credential, hold its budgets' room and stream the
    response into ``norm``. Nothing is sent when the request was cancelled first, when the dialect cannot
    express the request (``invalid_request``), when the credential cannot be had (``authentication``) or when
    a budget has no room (``budget_exceeded``)."""
    if req.handle.reason is not None:
        return
    try:
        preq = _provider_request(route, req.rid, req.job, model)
    except WorkerError as exc:  # the dialect cannot express this request: nothing is sent
        await store.send(PendingBatch.of(norm.fail("invalid_request", exc.message, now_ms(), retryable=False)))
        return
    try:
        preq = await _with_credential(req.deps, name, route, preq)
    except CredentialUnavailable as exc:
        await store.send(PendingBatch.of(norm.fail("authentication", exc.message, now_ms(), retryable=False)))
        return
    for warning in preq.warnings:  # e.g. another dialect's reasoning left out: said in the stream, and logged
        norm.machine.note("request_adapted", warning)
        log.info("request adapted for the dialect", extra={"request_id": req.rid, "warning": warning})
    # The budgets' room for this attempt's worst case is held last, right before anything is sent; attempts
    # in flight under the same budget settle within their total timeout, so a wait is bounded by this one's.
    handle = req.handle
    refused = await req.budget.reserve(
        name, model, attempt, wait_s=timeouts.total, stop=lambda: handle.reason is not None
    )
    if refused is not None:
        await store.send(PendingBatch.of(norm.fail(refused[0], refused[1], now_ms(), retryable=False)))
        return
    await _stream(req, norm, store, route, preq, timeouts, report, tel)


def _provider_request(route: Route, rid: str, job: Job, model: str) -> ProviderRequest:
    """The job's request in the route's dialect, with the route's headers. Raises ``WorkerError`` when the
    dialect cannot express it."""
    headers = dict(route.headers)
    if route.send_request_id:
        headers[REQUEST_ID_HEADER] = rid
    options: dict[str, Any] = request_options(route)
    return build_request(
        route.dialect,
        job.request,
        model=model,
        api_key=None,  # the route's credential adds its own headers (``_with_credential``)
        extra_headers=headers,
        path=route.path,
        path_values={k: v for k in ("project", "location") if (v := getattr(route, k)) is not None},
        **options,
    )


async def _with_credential(deps: Deps, name: str, route: Route, preq: ProviderRequest) -> ProviderRequest:
    """``preq`` with the headers route ``name``'s credential adds (a key, a token, a signature of the URL
    and body). Raises ``CredentialUnavailable``."""
    url = preq.url(route.base_url)
    credential = deps.credentials().for_route(name)
    added = await credential.apply(OutgoingRequest(preq.method, url, preq.headers, preq.body))
    return replace(preq, headers={**preq.headers, **{k.lower(): v for k, v in added.items()}})


async def _stream(
    req: _Request,
    norm: Normalizer,
    store: AttemptStore,
    route: Route,
    preq: ProviderRequest,
    timeouts: Timeouts,
    report: AttemptReport,
    tel: AttemptTelemetry,
) -> None:
    """Send ``preq`` and stream its response into ``norm`` under a cancel scope the request's handle holds,
    so a cancel (or a fence) closes the upstream at once."""
    handle = req.handle
    with anyio.CancelScope() as scope:
        handle.scope = scope
        if handle.reason is None:
            req.budget.sent = True
            await pump(req.deps.http, route.base_url, preq, norm, store.send, timeouts, report, tel, req.deps.secrets())
    handle.scope = None
    if scope.cancelled_caught:
        # pump's exit closed the response: the provider's connection is gone by now.
        handle.upstream_closed_at = time.monotonic()
