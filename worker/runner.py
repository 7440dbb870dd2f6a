"""One job, start to finish: decode, claim, attempts (with retries only before anything was visible),
the terminal status, the terminal-stream entry, the retention TTL, and the ACK.

Rule: every request ends with exactly one terminal status, whatever happens; the job is ACKed only
after that status is stored. Each attempt is its own stream (``<request_id>:<attempt>``) with its own
stream.start and terminal: attempts are never spliced. A worker that finds itself fenced stops writing
at once and leaves the job to its new owner.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from sluice.normalizer.assemble import assemble
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.normalizer.requests import build_request
from sluice.normalizer.stream import Normalizer
from sluice.schemas.errors import StorageError, WorkerError
from sluice.schemas.events import CONTRACT_VERSION, ErrorInfo, Event, StreamDone, StreamError, decode_event
from sluice.schemas.jobs import JOB_FIELD, Job, decode_job, peek_request_id
from sluice.schemas.keys import Keys
from sluice.schemas.replies import range_entries
from sluice.schemas.result import Result, result_hash
from sluice.worker.config import Config, Route, Timeouts
from sluice.worker.http_client import HttpClient
from sluice.worker.sink import AppendMux, ClaimInfo, Fenced, PendingBatch, RequestLog, now_ms, with_retry
from sluice.worker.telemetry import DISABLED, AttemptTelemetry, Telemetry, entry_time_ms
from sluice.worker.upstream import AttemptReport, pump

__all__ = ["NORMALIZER_VERSION", "Deps", "InFlight", "dead_letter", "fail_without_upstream", "handle_entry"]

log = logging.getLogger("sluice.worker")

NORMALIZER_VERSION = "sluice-normalizer/1"
_ENC = msgspec.json.Encoder()


@dataclass(slots=True)
class InFlight:
    """A running request's handle: the control listener cancels it through ``scope``."""

    request_id: str
    scope: anyio.CancelScope | None = None
    reason: str | None = None
    category: str = "cancelled"
    cancel_requested_at: float | None = None
    upstream_closed_at: float | None = None

    def cancel(self, reason: str, category: str = "cancelled") -> None:
        if self.reason is None:
            self.reason, self.category = reason, category
            self.cancel_requested_at = time.monotonic()
        if self.scope is not None:
            self.scope.cancel()


@dataclass(slots=True)
class Deps:
    config: Config
    redis: aioredis.Redis
    http: HttpClient
    keys: Keys
    consumer: str
    inflight: dict[str, InFlight] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    telemetry: Telemetry = DISABLED
    mux: AppendMux | None = None  # the shared append pipeline (the Worker runs it)


async def _ack(deps: Deps, entry_id: str) -> None:
    await with_retry(
        lambda: deps.redis.xack(deps.keys.jobs, deps.config.group, entry_id),
        outage_limit=deps.config.redis_outage_limit,
    )


async def dead_letter(deps: Deps, entry_id: str, reason: str, payload: bytes | None, request_id: str | None) -> None:
    fields: dict[FieldT, EncodableT] = {"entry_id": entry_id, "reason": reason, "at": str(now_ms())}
    if payload is not None:
        fields["job"] = payload[: deps.config.max_job_bytes]
    if request_id:
        fields["request_id"] = request_id
    await with_retry(
        lambda: deps.redis.xadd(deps.keys.dead_letters, fields, maxlen=100_000, approximate=True),
        outage_limit=deps.config.redis_outage_limit,
    )
    log.warning("dead-lettered job", extra={"entry_id": entry_id, "reason": reason, "request_id": request_id})


async def handle_entry(deps: Deps, entry_id: str, fields: dict[bytes, bytes], *, reclaimed: bool = False) -> None:
    """Run one jobs-stream entry to its terminal status and ACK it (unless fenced). ``reclaimed``: the
    entry was taken over from a worker that went away (it may have died between status and publication)."""
    payload = fields.get(JOB_FIELD.encode())
    if payload is None:
        await dead_letter(deps, entry_id, f"the entry has no {JOB_FIELD!r} field", None, None)
        await _ack(deps, entry_id)
        return
    try:
        job = decode_job(payload, max_bytes=deps.config.max_job_bytes)
    except WorkerError as exc:
        rid = peek_request_id(payload, max_bytes=deps.config.max_job_bytes)
        await dead_letter(deps, entry_id, exc.message, payload, rid)
        if rid:
            await fail_without_upstream(deps, entry_id, rid, None, "", "invalid_request", exc.message, reclaimed)
        await _ack(deps, entry_id)
        return
    rid = job.request_id or f"req-{entry_id}"
    route = deps.config.routes.get(job.route)
    if route is None:
        reason = f"unknown route {job.route!r}"
        await dead_letter(deps, entry_id, reason, payload, rid)
        await fail_without_upstream(deps, entry_id, rid, job, "", "invalid_request", reason, reclaimed)
        await _ack(deps, entry_id)
        return
    try:
        await _run_request(deps, entry_id, rid, job, route, reclaimed)
    except Fenced:
        log.warning("fenced: another worker owns the request now", extra={"request_id": rid})
        return
    await _ack(deps, entry_id)


def _new_log(deps: Deps, rid: str) -> RequestLog:
    return RequestLog(
        deps.redis, deps.keys.request(rid), maxlen=deps.config.stream_maxlen,
        outage_limit=deps.config.redis_outage_limit, mux=deps.mux,
    )  # fmt: skip


async def _claim(
    deps: Deps, rlog: RequestLog, entry_id: str, rid: str, job: Job | None, route_name: str, model: str
) -> ClaimInfo:
    return await rlog.claim(
        job_entry=entry_id, worker=deps.consumer, request_id=rid, route=route_name, model=model,
        metadata=job.metadata if job else {}, normalizer_version=NORMALIZER_VERSION, contract_version=CONTRACT_VERSION,
    )  # fmt: skip


async def fail_without_upstream(
    deps: Deps, entry_id: str, rid: str, job: Job | None, dialect: str, category: str, message: str,
    reclaimed: bool = False,
) -> None:  # fmt: skip
    """A request that can never be sent (bad job, unknown route) still gets a stream and a terminal."""
    rlog = _new_log(deps, rid)
    claim = await _claim(deps, rlog, entry_id, rid, job, job.route if job else "", (job.model or "") if job else "")
    if claim.outcome == "done" and not claim.published and reclaimed:
        # Only a taken-over entry: its finisher died between the status and the terminal-stream entry
        # (a second, live delivery of a finished request must not publish it twice).
        await _publish_terminal(deps, rlog, rid)
    if claim.outcome in ("done", "duplicate"):
        return
    attempt = claim.attempt + 1
    machine = StreamMachine(StreamInfo(f"{rid}:{attempt}", rid, dialect or "none", dialect or "none", attempt))
    events = machine.fail(category, message, ts=now_ms(), retryable=False)
    await rlog.append(attempt, PendingBatch.of(events))
    await _finalize(deps, rlog, rid, events[-1], machine.result(), job)


async def _run_request(deps: Deps, entry_id: str, rid: str, job: Job, route: Route, reclaimed: bool) -> None:
    cfg = deps.config
    model = job.model or route.model or ""
    rlog = _new_log(deps, rid)
    # Registered before the claim, so a cancel that arrives meanwhile is not missed.
    handle = InFlight(rid)
    deps.inflight[rid] = handle
    try:
        claim = await _claim(deps, rlog, entry_id, rid, job, job.route, model)
        if claim.outcome == "done" and not claim.published and reclaimed:
            # Only a taken-over entry: its finisher died between the status and the terminal-stream entry
            # (a second, live delivery of a finished request must not publish it twice).
            await _publish_terminal(deps, rlog, rid)
        if claim.outcome in ("done", "duplicate"):
            return
        attempt = claim.attempt
        if claim.outcome == "takeover":
            # The lost worker may have died before writing anything: its attempt still counts.
            attempt = max(attempt, 1)
            ended = await _close_lost_attempt(deps, rlog, rid, claim, attempt)
            if ended is not None:
                await _finalize(deps, rlog, rid, ended[0], ended[1], job)
                return
        if claim.cancel:
            handle.reason = "cancelled before a worker picked the request up"
        timeouts = cfg.route_timeouts(route).apply(job.timeouts)
        backoff_spent = 0.0
        # Queue wait: from the enqueue (the jobs entry id's time) to the first attempt of a fresh claim.
        queued_at = entry_time_ms(entry_id) if claim.outcome == "run" else None
        while True:
            attempt += 1
            with deps.telemetry.attempt(
                request_id=rid, route=job.route, dialect=route.dialect, model=model or None, attempt=attempt,
                trace=job.trace, queued_at_ms=queued_at,
            ) as tel:  # fmt: skip
                queued_at = None
                norm, report = await _run_attempt(deps, rlog, rid, job, route, model, attempt, timeouts, handle, tel)
                term = norm.machine.terminal_event
                assert term is not None
                delay = _retry_delay(cfg, term, norm, report, attempt, backoff_spent, handle)
                tel.record_cancel(handle.cancel_requested_at, handle.upstream_closed_at)
                tel.finish(term, norm.statistics(), retrying=delay is not None)
            if delay is None:
                break
            log.info("retrying", extra={"request_id": rid, "attempt": attempt, "delay": delay})
            backoff_spent += delay
            await anyio.sleep(delay)
        await _finalize(deps, rlog, rid, term, norm.result(), job)
    finally:
        deps.inflight.pop(rid, None)


def _retry_delay(
    cfg: Config,
    term: Event,
    norm: Normalizer,
    report: AttemptReport,
    attempt: int,
    spent: float,
    handle: InFlight,
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
    deps: Deps, rlog: RequestLog, rid: str, job: Job, route: Route, model: str, attempt: int, timeouts: Timeouts,
    handle: InFlight, tel: AttemptTelemetry,
) -> tuple[Normalizer, AttemptReport]:  # fmt: skip
    """One attempt: its own stream, its own stream.start and terminal. Raises ``Fenced``."""
    info = StreamInfo(f"{rid}:{attempt}", rid, route.provider or "", route.dialect, attempt, model or None)
    norm = Normalizer(route.dialect, info, deps.config.limits)
    report = AttemptReport()
    store = _Store(rlog, attempt, handle)
    try:
        await _drive(deps, norm, store, rid, job, route, model, timeouts, handle, report, tel)
        if not norm.terminal:
            reason = handle.reason or "the attempt ended without a terminal event"
            await store(PendingBatch.of(norm.interrupt(handle.category, reason, now_ms())))
        await store.drain()
    finally:
        store.abandon()
    return norm, report


class _Store:
    """Appends one attempt's batches in order, one in flight at a time: a batch is sent and the reader goes
    on at once; the next batch first settles the one before (usually answered by then: no wait). So the
    reader never waits a round trip per event, a busy stream's next batch holds everything that arrived
    meanwhile, and an idle stream's event goes at once. Every append of a worker shares one Redis
    connection, so their order there is their order of sending. A batch whose seqs are taken is stored
    whole even when the attempt is cancelled meanwhile. When Redis stays away past the outage limit, the
    upstream is cancelled and this batch and every later one are held, then stored in order once Redis is
    back (``drain``; appends are idempotent)."""

    def __init__(self, rlog: RequestLog, attempt: int, handle: InFlight) -> None:
        self.rlog = rlog
        self.attempt = attempt
        self.handle = handle
        self.held: list[PendingBatch] = []
        self._sent: tuple[asyncio.Future[Any], PendingBatch] | None = None

    async def __call__(self, batch: PendingBatch) -> None:
        """Raises ``Fenced``."""
        if self._sent is not None:
            try:
                await self._settle()
            except anyio.get_cancelled_exc_class():
                await self._resend_shielded(batch)  # its seqs are taken: stored after the one in flight
                raise
        if self.held:
            self.held.append(batch)  # never overtakes a held batch
            return
        fut = self.rlog.send_append(self.attempt, batch)
        if fut is not None:
            self._sent = (fut, batch)
            return
        await self._append(batch)  # no connection to send on yet: the waiting path connects

    async def _settle(self) -> None:
        """The sent batch's reply: checked, or on any error appended again the waiting way (idempotent)."""
        assert self._sent is not None
        fut, batch = self._sent
        self._sent = None
        try:
            res = fut.result() if fut.done() else await fut
        except anyio.get_cancelled_exc_class():
            await self._resend_shielded(batch)
            raise
        except Exception:  # broken connection, overdue reply, unknown script: the waiting path decides
            await self._append(batch)
            return
        self.rlog.check_append(res)

    async def _append(self, batch: PendingBatch) -> None:
        try:
            await self._append_or_hold(batch)
        except anyio.get_cancelled_exc_class():
            await self._resend_shielded(batch)
            raise

    async def _resend_shielded(self, batch: PendingBatch) -> None:
        """Cancelled while the append was in flight: it may or may not have landed. Sent again under a
        shield (appends are idempotent), so the batch is stored whole before the cancel goes on."""
        with anyio.CancelScope(shield=True):
            await self._append_or_hold(batch)

    async def _append_or_hold(self, batch: PendingBatch) -> None:
        if self.held:
            self.held.append(batch)  # never overtakes a held batch
            return
        try:
            await self.rlog.append(self.attempt, batch)
        except StorageError:
            self._hold(batch)

    def _hold(self, batch: PendingBatch) -> None:
        self.handle.cancel("Redis was unavailable past the outage limit; the upstream was cancelled", "transport")
        log.error("Redis unavailable; holding the batch", extra={"request_id": self.handle.request_id})
        self.held.append(batch)

    async def drain(self) -> None:
        """Settle the sent batch, then store the held ones, retrying until Redis answers. Raises ``Fenced``."""
        with anyio.CancelScope(shield=True):
            if self._sent is not None:
                await self._settle()
            while self.held:
                try:
                    await self.rlog.append(self.attempt, self.held[0])
                    self.held.pop(0)
                except StorageError:
                    await anyio.sleep(1.0)

    def abandon(self) -> None:
        """The attempt ends without ``drain`` (fenced): the sent batch's reply is no one's business now."""
        if self._sent is not None:
            fut = self._sent[0]
            self._sent = None
            fut.add_done_callback(_consume)


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # retrieved, so asyncio does not log it as never retrieved


async def _drive(
    deps: Deps, norm: Normalizer, store: _Store, rid: str, job: Job, route: Route, model: str, timeouts: Timeouts,
    handle: InFlight, report: AttemptReport, tel: AttemptTelemetry,
) -> None:  # fmt: skip
    if handle.reason is not None:
        return
    api_key = deps.env.get(route.api_key_env, "") if route.api_key_env else ""
    if route.api_key_env and not api_key:
        msg = f"the route's API key variable {route.api_key_env} is not set"
        await store(PendingBatch.of(norm.fail("authentication", msg, now_ms(), retryable=False)))
        return
    try:
        req = build_request(
            route.dialect, job.request, model=model, api_key=api_key,
            extra_headers={**route.headers, "x-sluice-request-id": rid}, **route.request_options,
        )  # fmt: skip
    except WorkerError as exc:  # the dialect cannot express this request: nothing is sent
        await store(PendingBatch.of(norm.fail("invalid_request", exc.message, now_ms(), retryable=False)))
        return
    with anyio.CancelScope() as scope:
        handle.scope = scope
        if handle.reason is None:
            await pump(deps.http, route.base_url, req, norm, store, timeouts, report, tel)
    handle.scope = None
    if scope.cancelled_caught:
        # pump's exit closed the response: the provider's connection is gone by now.
        handle.upstream_closed_at = time.monotonic()


async def _close_lost_attempt(
    deps: Deps, rlog: RequestLog, rid: str, claim: ClaimInfo, attempt: int
) -> tuple[Event, Result] | None:
    """Takeover: end the lost worker's attempt ``interrupted`` / ``worker_lost`` unless it already has a
    terminal. Returns the request's final (terminal event, result), or None when a new attempt may run
    (the lost attempt ended ``worker_lost`` before anything was visible)."""
    events = await _read_attempt(deps, rlog, attempt)
    if events and isinstance(events[-1], StreamDone | StreamError):
        term: Event = events[-1]
    else:
        message = "the worker running this attempt was lost"
        last_seq = events[-1].seq if events else 0
        if last_seq == 0:
            # The lost worker never wrote stream.start: the attempt still needs one to be a valid stream.
            m = StreamMachine(StreamInfo(f"{rid}:{attempt}", rid, "unknown", "unknown", attempt))
            new: list[Event] = m.interrupt("worker_lost", message, ts=now_ms())
        else:
            err = ErrorInfo(category="worker_lost", retryable=False, message=message)
            new = [StreamError(
                stream_id=f"{rid}:{attempt}", request_id=rid, seq=last_seq + 1, ts=now_ms(),
                status="interrupted", error=err,
            )]  # fmt: skip
        await rlog.append(attempt, PendingBatch.of(new))
        events += new
        term = new[-1]
    lost = isinstance(term, StreamError) and term.error.category == "worker_lost"
    if lost and not claim.visible:
        return None
    return term, assemble(events)


async def _read_attempt(deps: Deps, rlog: RequestLog, attempt: int) -> list[Event]:
    entries = await deps.redis.xrange(rlog.keys.events, f"{attempt}-0", f"{attempt}-{2**63 - 1}")
    return [decode_event(fields[b"event"]) for _, fields in range_entries(entries)]


async def _finalize(deps: Deps, rlog: RequestLog, rid: str, term: Event, result: Result, job: Job | None) -> None:
    """Store the terminal status and set the TTL (retried until Redis answers: a terminal status is never
    given up on while the worker lives), then publish it on the terminal stream."""
    state = "completed" if isinstance(term, StreamDone) else term.status  # type: ignore[union-attr]
    fields: dict[str, str | int] = {
        "state": state,
        "last_seq": term.seq,
        "finished_at": now_ms(),
        "result_hash": result_hash(result),
        "stop_reason": result.stop_reason or "",
        "error": _ENC.encode(result.error).decode() if result.error else "",
        "usage": _ENC.encode(result.usage).decode() if result.usage else "",
        "published": "0",
    }
    while True:
        try:
            await rlog.finalize(deps.config.retention_seconds, fields)
            break
        except StorageError:
            log.error("Redis unavailable while storing a terminal status; retrying", extra={"request_id": rid})
            await anyio.sleep(1.0)
    # Metric attributes stay bounded: a route the config does not know is counted under "".
    route = deps.config.routes.get(job.route) if job else None
    deps.telemetry.request_finished(
        route=job.route if job and route else "", dialect=route.dialect if route else "", status=state,
        stop_reason=result.stop_reason, category=result.error.category if result.error else None,
    )  # fmt: skip
    await _publish_terminal(deps, rlog, rid)
    attempt = int(term.stream_id.rsplit(":", 1)[1]) if ":" in term.stream_id else 0
    log.info("request finished", extra={"request_id": rid, "attempt": attempt, "status": state})


async def _publish_terminal(deps: Deps, rlog: RequestLog, rid: str) -> None:
    """One terminal-stream entry per finished request, from its stored status. ``published`` records it,
    so a worker that died in between is made good by the next delivery (at-least-once: consumers of the
    terminal stream dedupe by request_id)."""
    limit = deps.config.redis_outage_limit
    names = ["state", "stop_reason", "error", "attempt", "raw_count", "event_count", "result_hash", "metadata"]
    vals = await with_retry(lambda: deps.redis.hmget(rlog.keys.status, names), outage_limit=limit)
    st = {k: (v.decode() if isinstance(v, bytes) else (v or "")) for k, v in zip(names, vals, strict=True)}
    category = msgspec.json.decode(st["error"]).get("category", "") if st["error"] else ""
    entry: dict[FieldT, EncodableT] = {
        "request_id": rid, "status": st["state"], "stop_reason": st["stop_reason"], "error_category": category,
        "attempt": st["attempt"] or "0", "raw_count": st["raw_count"] or "0", "event_count": st["event_count"] or "0",
        "result_hash": st["result_hash"], "metadata": st["metadata"] or "{}",
    }  # fmt: skip
    await with_retry(
        lambda: deps.redis.xadd(deps.keys.terminal, entry, maxlen=1_000_000, approximate=True), outage_limit=limit
    )
    await with_retry(lambda: deps.redis.hset(rlog.keys.status, "published", "1"), outage_limit=limit)
