"""One jobs-stream entry, taken in: decode and check it, dead-letter what can never run, and hand the rest
to the attempt loop; ACK it once its request has a terminal status.

Rule: every job whose request id can be read gets a terminal status, even one that cannot run (bad JSON,
over the size limit, an unknown route or fallback route): ``failed`` with ``invalid_request`` or
``limit_exceeded``. A job that cannot run is also dead-lettered, once (a marker per job entry holds its
dead-letter entry id).
"""

from __future__ import annotations

import logging

from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.schemas.errors import JobError
from sluice.schemas.jobs import JOB_FIELD, Job, JobTooLarge, decode_job, peek_request_id
from sluice.worker.append.log import PendingBatch
from sluice.worker.attempts import run_request
from sluice.worker.claim import claim, new_log, nothing_to_run
from sluice.worker.clock import now_ms
from sluice.worker.context import Deps
from sluice.worker.fallback import job_fallback_problem
from sluice.worker.finalize import ack, finalize
from sluice.worker.redis import scripts
from sluice.worker.redis.retry import Fenced, with_retry

__all__ = ["dead_letter", "fail_without_upstream", "fallback_request_id", "handle_entry"]

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


async def handle_entry(deps: Deps, entry_id: str, fields: dict[bytes, bytes], shard: int = 0) -> None:
    """Run one jobs-stream entry (of job shard ``shard``) to its terminal status and ACK it (unless fenced)."""
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
        else job_fallback_problem(deps.config.routes, job.route, job.fallbacks or ())
    )
    if reason is not None:
        await dead_letter(deps, entry_id, reason, payload, rid, shard)
        await _fail_or_stop(deps, entry_id, rid, job, "invalid_request", reason, shard)
        await ack(deps, entry_id, shard)
        return
    assert route is not None  # an unknown route has its reason
    try:
        await run_request(deps, entry_id, rid, job, route, shard)
    except Fenced:
        log.warning("fenced: another worker owns the request now", extra={"request_id": rid})
        return
    await ack(deps, entry_id, shard)


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
