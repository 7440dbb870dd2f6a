"""One jobs-stream entry, taken in: decode and check it, dead-letter what can never run, and hand the rest
to the attempt loop; ACK it once its request has a terminal status.

Rule: every job whose request id can be read gets a terminal status, even one that cannot run (bad JSON,
over the size limit, an unknown route or fallback route, a tool or answer schema the validator cannot take):
``failed`` with ``invalid_request`` or
``limit_exceeded``. A job that cannot run is also dead-lettered, once (a marker per job entry holds its
dead-letter entry id).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import msgspec

from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.schemas.errors import JobError
from sluice.schemas.jobs import JOB_FIELD, Job, JobTooLarge, decode_job, peek_request_id
from sluice.schemas.keys import WaitRecord, key_slot
from sluice.worker.append.log import PendingBatch
from sluice.worker.capacity.admission import AdmittedJob, Offered, OfferJob, estimate_tokens
from sluice.worker.capacity.fallback import job_fallback_problem
from sluice.worker.capacity.permits import FirstRoute, Leased
from sluice.worker.clock import now_ms
from sluice.worker.observability.telemetry import entry_time_ms
from sluice.worker.pipeline.attempts import run_request
from sluice.worker.pipeline.claim import claim, new_log, nothing_to_run
from sluice.worker.pipeline.context import Deps
from sluice.worker.pipeline.finalize import ack, finalize
from sluice.worker.pipeline.output_checks import intake_problem
from sluice.worker.redis import scripts
from sluice.worker.redis.retry import Fenced, with_retry

__all__ = [
    "Intake",
    "dead_letter",
    "fail_without_upstream",
    "fallback_request_id",
    "handle_entry",
    "intake_of",
    "offer_entries",
    "run_leased",
    "settle_offer",
    "settled",
]

log = logging.getLogger("sluice.worker")
_DLQ_MAXLEN = 100_000


async def dead_letter(
    deps: Deps, entry_id: str, reason: str, payload: bytes | None, request_id: str | None, shard: int = 0
) -> None:
    """One dead-letter entry per job entry, in the dead-letter stream of the entry's shard, whatever reply is
    lost. Raises ``StorageError``."""
    fields: list[object] = ["entry_id", entry_id, "reason", reason, "at", str(now_ms())]
    if payload is not None:
        fields += ["job", payload[: deps.config.max_job_bytes]]
    if request_id:
        fields += ["request_id", request_id]
    keys = deps.keys.shard(shard)
    script = deps.redis.register_script(scripts.DEAD_LETTER)  # rare: through redis-py
    await with_retry(
        lambda: script(
            keys=[keys.dead_letters, keys.dead_letter_marker(entry_id)],
            args=[deps.config.retention_seconds, _DLQ_MAXLEN, *fields],  # type: ignore[list-item]
        ),
        outage_limit=deps.config.redis_outage_limit,
    )
    log.warning("dead-lettered job", extra={"entry_id": entry_id, "reason": reason, "request_id": request_id})


def fallback_request_id(deps: Deps, entry_id: str, shard: int = 0) -> str:
    """The request id of a job without one, made from its entry (entry ids repeat across shards: the shard
    too, on a sharded layout)."""
    return f"req-s{shard}-{entry_id}" if deps.keys.sharded else f"req-{entry_id}"


async def handle_entry(
    deps: Deps, entry_id: str, fields: dict[bytes, bytes], shard: int = 0, first: FirstRoute | None = None
) -> None:
    """Run one jobs-stream entry (of job shard ``shard``) to its terminal status and ACK it (unless fenced).
    ``first``: its limited route was cooling at admission and this fallback admitted it (``settle_offer``)."""
    payload = fields.get(JOB_FIELD.encode())
    if payload is None:
        await dead_letter(deps, entry_id, f"the entry has no {JOB_FIELD!r} field", None, None, shard)
        await ack(deps, entry_id, shard)
        return
    try:
        job = decode_job(payload, max_bytes=deps.config.max_job_bytes)
    except JobError as exc:
        rid = peek_request_id(payload)
        await dead_letter(deps, entry_id, exc.message, payload, rid, shard)
        if rid:
            category = "limit_exceeded" if isinstance(exc, JobTooLarge) else "invalid_request"
            await _fail_or_stop(deps, entry_id, rid, None, category, exc.message, shard)
        await ack(deps, entry_id, shard)
        return
    rid = job.request_id or fallback_request_id(deps, entry_id, shard)
    route = deps.config.routes.get(job.route)
    reason = (
        f"unknown route {job.route!r}"
        if route is None
        else job_fallback_problem(deps.config.routes, job.route, job.fallbacks or ()) or intake_problem(deps, job)
    )
    if reason is not None:
        await dead_letter(deps, entry_id, reason, payload, rid, shard)
        await _fail_or_stop(deps, entry_id, rid, job, "invalid_request", reason, shard)
        await ack(deps, entry_id, shard)
        return
    assert route is not None  # an unknown route has its reason
    try:
        await run_request(deps, entry_id, rid, job, route, shard, first=first)
    except Fenced:
        log.warning("fenced: another worker owns the request now", extra={"request_id": rid})
        return
    await ack(deps, entry_id, shard)


class Intake(msgspec.Struct, frozen=True, gc=False):
    """A read jobs entry of a limited route, decoded and checked, ready for its route's OFFER (a Struct, as
    ``OfferJob``: one per job, untracked by the garbage collector)."""

    entry_id: str
    shard: int
    fields: dict[bytes, bytes]
    payload: bytes
    job: Job
    chain: tuple[str, ...]  # its fallback routes
    offer: OfferJob

    @property
    def request_id(self) -> str:
        return self.offer.request_id


def intake_of(deps: Deps, entry_id: str, fields: dict[bytes, bytes], shard: int = 0) -> Intake | None:
    """The entry as its route's OFFER takes it; None for every other entry (not a limited route's job, or one
    ``handle_entry`` refuses: it runs it as before, with no capacity call)."""
    adm = deps.admission
    payload = fields.get(JOB_FIELD.encode())
    if adm is None or payload is None:
        return None
    try:
        job = decode_job(payload, max_bytes=deps.config.max_job_bytes)
    except JobError:
        return None
    route = deps.config.routes.get(job.route)
    if route is None or not adm.limited(job.route):
        return None
    if job_fallback_problem(deps.config.routes, job.route, job.fallbacks or ()) or intake_problem(deps, job):
        return None
    chain = tuple(route.fallbacks if job.fallbacks is None else job.fallbacks)
    rid = job.request_id or fallback_request_id(deps, entry_id, shard)
    record = WaitRecord(
        tenant=job.tenant_name,
        priority=job.priority,
        shard=shard,
        job_entry=entry_id,
        queued_at=entry_time_ms(entry_id) or now_ms(),
        est_tokens=estimate_tokens(len(payload), job.request.max_tokens, route),
        job=payload.decode(),
    )
    # A single instance holds the jobs stream, the status and the route's store: OFFER acks and writes the status
    # itself, in the same step; on a Cluster they follow it (``settle_offer``).
    status = "" if deps.router.cluster else deps.keys.request(rid).status
    offer = OfferJob(rid, adm.call_id(), record, fallbacks=bool(chain), status=status)
    return Intake(entry_id, shard, fields, payload, job, chain, offer)


async def offer_entries(deps: Deps, route: str, entries: Sequence[Intake], slots: int) -> list[Offered]:
    """One OFFER for entries of one job shard and one limited route (docs/design-capacity.md B.4): at most
    ``slots`` admitted (the run slots the caller took for the call), each in order; the rest parked. Raises
    ``StorageError``."""
    adm = deps.admission
    assert adm is not None and entries
    over = None if deps.router.cluster else deps.keys.shard(entries[0].shard).jobs
    return await adm.offer_many(route, [e.offer for e in entries], slots=slots, hand_over=over)


def settled(got: Offered) -> bool:
    """Whether an entry's OFFER settled it alone: the route holds it (parked, or another delivery of it is
    admitted) and the script acked it (the hand-over), so ``settle_offer`` has nothing to do."""
    return got.handed and got.outcome in ("parked", "held")


async def settle_offer(
    deps: Deps, entry: Intake, got: Offered, *, start_now: bool
) -> tuple[str, AdmittedJob] | FirstRoute | bool:
    """What follows an entry's OFFER: custody is the route's from then on, so the entry is acked (by the script
    itself on a single instance). ``start_now``: the caller holds a free run slot for it. Returns (route, job)
    when admitted (run it with ``run_leased``), True when the route holds it (parked, or another delivery of it
    is admitted) or it was failed. A job with fallbacks whose route is cooling (``cooldown``: the caller holds a
    run slot for it by now) goes to the first fallback that admits it now: a ``FirstRoute`` (not acked:
    ``handle_entry(first=...)`` runs it, held by its jobs entry); when none does, it is parked on its own
    route."""
    adm = deps.admission
    assert adm is not None
    job, rid, entry_id, shard = entry.job, entry.request_id, entry.entry_id, entry.shard
    if got.outcome == "cooldown":
        first = await _first_fallback(deps, rid, entry.offer.token, job, entry.chain, len(entry.payload))
        if first is not None:
            log.info("route cooling at admission: sent to a fallback", extra={"request_id": rid, "route": first.route})
            return first
        # None admits it: it waits on its own route.
        parked = msgspec.structs.replace(entry.offer, fallbacks=False)
        over = None if deps.router.cluster else deps.keys.shard(shard).jobs
        got = (await adm.offer_many(job.route, [parked], slots=1 if start_now else 0, hand_over=over))[0]
    if got.outcome == "too_large":
        est = entry.offer.record.est_tokens
        reason = f"the job's token estimate {est} exceeds routes.{job.route}.tokens_per_minute"
        await dead_letter(deps, entry_id, reason, entry.payload, rid, shard)
        await _fail_or_stop(deps, entry_id, rid, job, "limit_exceeded", reason, shard)
    elif got.outcome == "parked" and not got.handed:
        # Advisory, in the request's own slot: the claim deletes it.
        status = deps.keys.request(rid).status
        since = str(now_ms())
        await deps.router.call(
            "control",
            key_slot(status),
            "HSET",
            status,
            "waiting_on",
            got.waiting_on,
            "waiting_route",
            job.route,
            "waiting_since",
            since,
        )
        await deps.router.call("control", key_slot(status), "HSETNX", status, "state", "queued")
    elif got.outcome == "done":  # a late delivery of a job that ran and finished: nothing to admit
        log.info("its job finished already", extra={"request_id": rid, "entry_id": entry_id})
    if not got.handed:
        await ack(deps, entry_id, shard)
    if got.outcome == "admitted":
        return job.route, AdmittedJob(rid, got.token, entry.offer.record, job)
    return True


async def _first_fallback(
    deps: Deps, rid: str, base: str, job: Job, chain: tuple[str, ...], nbytes: int
) -> FirstRoute | None:
    """The first of ``chain`` that admits attempt 1 now: a route without limits, or a limited one granting
    a permit (``<base>:1``, no lease: ACQUIRE home=0). A full one's reservation is dropped at once."""
    adm = deps.admission
    assert adm is not None
    for skipped, name in enumerate(chain):
        if not adm.limited(name):
            return FirstRoute(name, "", base, skipped)
        token = f"{base}:1"
        est = estimate_tokens(nbytes, job.request.max_tokens, deps.config.routes[name])
        got = await adm.acquire(name, token, False, request_id=rid, est_tokens=est)
        if got.outcome == "ok":
            return FirstRoute(name, token, base, skipped)
        if got.waiting_on == "concurrency":
            await adm.release(name, rid, token, "", final=False)
        else:
            adm.drop_permit(name, token)
    return None


async def run_leased(deps: Deps, route_name: str, job: AdmittedJob) -> None:
    """Run a job its route admitted (its jobs entry already acked at intake): claim with the lease token, run,
    finalize, RELEASE. A job whose record cannot run any more (its route gone from the config) ends failed."""
    adm = deps.admission
    assert adm is not None
    rec = job.record
    rid = job.request_id
    try:
        decoded = job.job or decode_job(rec.job, max_bytes=deps.config.max_job_bytes)
    except JobError as exc:  # it decoded at intake: only a changed max_job_bytes gets here
        await _fail_or_stop(deps, rec.job_entry, rid, None, "invalid_request", exc.message, rec.shard)
        await adm.release(route_name, rid, job.token, job.token, final=True)
        return
    route = deps.config.routes[route_name]
    lease = Leased(adm, route_name, job.token, rec.est_tokens)
    try:
        await run_request(deps, rec.job_entry, rid, decoded, route, rec.shard, lease)
    except Fenced:
        log.warning("fenced: another worker holds the request's lease now", extra={"request_id": rid})


async def _fail_or_stop(
    deps: Deps, entry_id: str, rid: str, job: Job | None, category: str, message: str, shard: int
) -> None:
    try:
        await fail_without_upstream(deps, entry_id, rid, job, "", category, message, shard)
    except Fenced:
        log.warning("fenced: another worker owns the request now", extra={"request_id": rid})


async def fail_without_upstream(
    deps: Deps, entry_id: str, rid: str, job: Job | None, dialect: str, category: str, message: str, shard: int = 0
) -> None:
    """A request that can never be sent (bad job, unknown route, too many deliveries) still gets a stream and
    a terminal. Raises ``Fenced``."""
    rlog = new_log(deps, rid)
    route_name, model = (job.route, job.model or "") if job else ("", "")
    c = await claim(deps, rlog, entry_id, rid, job, route_name, model, shard)
    if await nothing_to_run(deps, rlog, rid, c):
        return
    attempt = c.attempt + 1
    machine = StreamMachine(StreamInfo(f"{rid}:{attempt}", rid, dialect or "none", dialect or "none", attempt))
    events = machine.fail(category, message, ts=now_ms(), retryable=False)
    await rlog.append(attempt, PendingBatch.of(events))
    await finalize(deps, rlog, rid, events[-1], machine.result(), job)
