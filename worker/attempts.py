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
from sluice.worker.claim import claim, close_lost_attempt, end_attempt_as_stored, new_log, nothing_to_run
from sluice.worker.clock import now_ms
from sluice.worker.config import Config, Route, Timeouts
from sluice.worker.context import Deps, InFlight
from sluice.worker.credentials import CredentialUnavailable, OutgoingRequest
from sluice.worker.finalize import finalize
from sluice.worker.redis.retry import Fenced, LogLost
from sluice.worker.telemetry import AttemptTelemetry, entry_time_ms
from sluice.worker.upstream import AttemptReport, pump

__all__ = ["REQUEST_ID_HEADER", "run_request"]

log = logging.getLogger("sluice.worker")

# Sent upstream only on routes that opt in (``send_request_id``): producer-chosen ids are theirs to share.
REQUEST_ID_HEADER = "x-sluice-request-id"


async def run_request(deps: Deps, entry_id: str, rid: str, job: Job, route: Route, shard: int = 0) -> None:
    """Claim the request (its job entry read from job shard ``shard``), run its attempts, store its terminal
    status. Raises ``Fenced``."""
    cfg = deps.config
    model = job.model or route.model or ""
    rlog = new_log(deps, rid)
    # Registered before the claim, so a cancel that arrives meanwhile is not missed.
    handle = InFlight(rid, entry_id, shard)
    deps.inflight[rid] = handle
    try:
        c = await claim(deps, rlog, entry_id, rid, job, job.route, model, shard)
        if await nothing_to_run(deps, rlog, rid, c):
            return
        attempt = c.attempt
        if c.outcome == "takeover":
            # The lost worker may have died before writing anything: its attempt still counts.
            attempt = max(attempt, 1)
            ended = await close_lost_attempt(deps, rlog, rid, c, attempt)
            if ended is not None:
                await finalize(deps, rlog, rid, ended[0], ended[1], job)
                return
        if c.cancel:
            handle.reason = "cancelled before a worker picked the request up"
        timeouts = cfg.route_timeouts(route).apply(job.timeouts)
        backoff_spent = 0.0
        # Queue wait: from the enqueue (the jobs entry id's time) to the first attempt of a fresh claim.
        queued_at = entry_time_ms(entry_id) if c.outcome == "run" else None
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
                    delay = _retry_delay(cfg, term, norm, report, attempt, backoff_spent, handle)
                    tel.record_cancel(handle.cancel_requested_at, handle.upstream_closed_at)
                    tel.finish(term, norm.statistics(), retrying=delay is not None)
                if delay is None:
                    break
                log.info("retrying", extra={"request_id": rid, "attempt": attempt, "delay": delay})
                backoff_spent += delay
                await anyio.sleep(delay)
            result = norm.result()
        except LogLost as exc:
            log.error(
                "Redis lost acknowledged events; the attempt ends where its log ends",
                extra={"request_id": rid, "attempt": exc.attempt},
            )
            term, result = await end_attempt_as_stored(deps, rlog, rid, exc.attempt, "transport", exc.message)
        await finalize(deps, rlog, rid, term, result, job)
    finally:
        if deps.inflight.get(rid) is handle:
            del deps.inflight[rid]


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
    headers = dict(route.headers)
    if route.send_request_id:
        headers[REQUEST_ID_HEADER] = rid
    options: dict[str, Any] = dict(route.request_options)
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
        credential = deps.credentials().for_route(job.route)
        added = await credential.apply(OutgoingRequest(req.method, url, req.headers, req.body))
    except CredentialUnavailable as exc:
        await store.send(PendingBatch.of(norm.fail("authentication", exc.message, now_ms(), retryable=False)))
        return
    req = replace(req, headers={**req.headers, **{k.lower(): v for k, v in added.items()}})
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
