"""Claiming a request, and taking one over from a worker that was lost.

Rule: the claim is one idempotent script that bumps the fencing epoch (``sluice.worker.redis.scripts.CLAIM``).
On a takeover the lost worker's attempt is ended ``interrupted`` / ``worker_lost`` unless it already has a
terminal; a new attempt may then run only if nothing of the lost one was visible (attempts are never
spliced, and a reader may have seen its deltas).
"""

from __future__ import annotations

from sluice.normalizer.assemble import assemble
from sluice.normalizer.machine import StreamInfo, StreamMachine
from sluice.normalizer.stream import NORMALIZER_VERSION
from sluice.schemas.events import (
    CONTRACT_VERSION,
    ErrorCategory,
    ErrorInfo,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    decode_event,
)
from sluice.schemas.jobs import Job
from sluice.schemas.keys import Position
from sluice.schemas.replies import range_entries
from sluice.schemas.result import Result
from sluice.worker.append.log import ClaimInfo, PendingBatch, RequestLog
from sluice.worker.clock import now_ms
from sluice.worker.pipeline.context import Deps
from sluice.worker.pipeline.finalize import publish_terminal

__all__ = [
    "attempt_routes",
    "claim",
    "close_lost_attempt",
    "end_attempt_as_stored",
    "new_log",
    "nothing_to_run",
    "read_attempt",
]


# The dialect of a stream.start written for an attempt that stored none (``end_attempt_as_stored``), and of
# one written for a job that never reached a route (``intake.fail_without_upstream``).
_LOST = "unknown"
_NO_DIALECT = (_LOST, "none")


def new_log(deps: Deps, rid: str) -> RequestLog:
    return RequestLog(
        deps.router,
        deps.keys.request(rid),
        maxlen=deps.config.stream_maxlen,
        outage_limit=deps.config.redis_outage_limit,
    )


async def claim(
    deps: Deps,
    rlog: RequestLog,
    entry_id: str,
    rid: str,
    job: Job | None,
    route_name: str,
    model: str,
    shard: int = 0,
    token: str | None = None,
) -> ClaimInfo:
    """``token``: the lease token of a job admitted by its route (else a fresh one). Raises ``StorageError``."""
    # A sharded layout names the jobs stream of the entry in the status (entry ids repeat across shards).
    job_stream = deps.keys.shard(shard).jobs if deps.keys.sharded else ""
    return await rlog.claim(
        job_entry=entry_id,
        worker=deps.consumer,
        request_id=rid,
        route=route_name,
        model=model,
        metadata=job.metadata if job else {},
        normalizer_version=NORMALIZER_VERSION,
        contract_version=CONTRACT_VERSION,
        job_stream=job_stream,
        token=token,
    )


async def close_lost_attempt(
    deps: Deps, rlog: RequestLog, rid: str, claim: ClaimInfo, attempt: int
) -> tuple[Event, Result] | None:
    """Takeover: end the lost worker's attempt ``interrupted`` / ``worker_lost`` unless it already has a
    terminal. Returns the request's final (terminal event, result), or None when a new attempt may run
    (the lost attempt ended ``worker_lost`` before anything was visible). Raises ``Fenced``."""
    term, result = await end_attempt_as_stored(
        deps, rlog, rid, attempt, "worker_lost", "the worker running this attempt was lost"
    )
    lost = isinstance(term, StreamError) and term.error.category == "worker_lost"
    if lost and not claim.visible:
        return None
    return term, result


async def end_attempt_as_stored(
    deps: Deps, rlog: RequestLog, rid: str, attempt: int, category: ErrorCategory, message: str
) -> tuple[Event, Result]:
    """End an attempt where its stored log ends: its own terminal if it has one, else ``interrupted`` /
    ``category`` right after its last stored event. Returns (terminal event, result). Raises ``Fenced``."""
    events = await read_attempt(deps, rlog, attempt)
    if events and isinstance(events[-1], StreamDone | StreamError):
        return events[-1], assemble(events)
    last_seq = events[-1].seq if events else 0
    if last_seq == 0:
        # No stream.start stored: the attempt still needs one to be a valid stream.
        m = StreamMachine(StreamInfo(f"{rid}:{attempt}", rid, _LOST, _LOST, attempt))
        new: list[Event] = m.interrupt(category, message, ts=now_ms())
    else:
        err = ErrorInfo(category=category, retryable=False, message=message)
        new = [
            StreamError(
                stream_id=f"{rid}:{attempt}",
                request_id=rid,
                seq=last_seq + 1,
                ts=now_ms(),
                status="interrupted",
                error=err,
            )
        ]
    rlog.assume_stored(attempt, -1, last_seq)  # the next append follows what is stored, checked no more
    await rlog.append(attempt, PendingBatch.of(new))
    events += new
    return new[-1], assemble(events)


async def read_attempt(deps: Deps, rlog: RequestLog, attempt: int) -> list[Event]:
    entries = await deps.redis.xrange(rlog.keys.events, *Position.attempt_range(attempt))
    return [decode_event(fields[b"event"]) for _, fields in range_entries(entries)]


async def attempt_routes(deps: Deps, rlog: RequestLog, upto: int, home: str) -> list[str]:
    """The route of attempts 1..``upto`` as their stream.start says (after a takeover: the lost worker ran
    them). A start without a route: ``home`` if a worker wrote it (one from before routes were recorded ran
    only the job's own route), "" (not known) if it stands in for an attempt that stored no start of its
    own (its worker was lost first) or for a job that never reached a route."""
    routes: list[str] = []
    for attempt in range(1, upto + 1):
        entries = await deps.redis.xrange(rlog.keys.events, f"{attempt}-1", f"{attempt}-1")
        first = [decode_event(fields[b"event"]) for _, fields in range_entries(entries)]
        start = first[0] if first else None
        if not isinstance(start, StreamStart) or start.dialect in _NO_DIALECT:
            routes.append("")
        else:
            routes.append(start.route or home)
    return routes


async def nothing_to_run(deps: Deps, rlog: RequestLog, rid: str, c: ClaimInfo) -> bool:
    """The claim found the request done (published here if its finisher died before publishing) or running
    under another job entry (a duplicate): this delivery has nothing to run, only its ack."""
    if c.outcome == "done":
        if not c.published:
            await publish_terminal(deps, rlog, rid)
        return True
    return c.outcome == "duplicate"
