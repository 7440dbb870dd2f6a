"""A request's end: the terminal status (with the retention TTL), its one terminal-stream entry, the ACK.

Rule: the status is stored first (retried while the worker lives: a terminal status is never given up
on), then published once (a marker beside the terminal stream holds the entry id, so a re-sent publish
or a later delivery of the same request adds nothing), then the job is ACKed. A worker that dies in
between leaves the job pending; whoever takes it over finds the request done and publishes it if the
marker is missing. The status fields the entry carries are read back in the finalize's own write (same
connection, after the script: one round trip); a status that reads back as not terminal (a failover lost
the write) is stored again first. Every command of a request goes on the routed pipes
(``sluice.worker.redis.route``), not through redis-py.

With ``durability = "replica"`` the status is stored with ``durability: waiting``, then ``WAIT`` runs on the
connection that stored it: the request's appends went to the same master before, so the count covers the
whole log. The status then says ``replica`` (that many replicas hold it; ``replicas_acked``) or
``unconfirmed`` (the wait timed out), and only then is the terminal entry published (followed by a WAIT of its
own) and the job acked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import anyio
import msgspec

from sluice.schemas.errors import StorageError
from sluice.schemas.events import Event, StreamDone, StreamError
from sluice.schemas.jobs import Job
from sluice.schemas.keys import key_slot
from sluice.schemas.result import Result, result_hash
from sluice.schemas.states import TERMINAL_STATES, TerminalState
from sluice.worker.append.log import RequestLog
from sluice.worker.capacity.budgets import budgets_for
from sluice.worker.capacity.fallback import model_for
from sluice.worker.clock import now_ms
from sluice.worker.cost import COST_FIELDS, cost_fields
from sluice.worker.observability.archive_watch import check_archive_lag
from sluice.worker.pipeline.context import Deps
from sluice.worker.pipeline.output_checks import status_fields
from sluice.worker.redis.retry import with_retry

__all__ = ["ack", "finalize", "publish_terminal"]

log = logging.getLogger("sluice.worker")
_ENC = msgspec.json.Encoder()
_STATUS_NAMES = (
    "state",
    "stop_reason",
    "error",
    "attempt",
    "raw_count",
    "event_count",
    "result_hash",
    "metadata",
    "durability",
    *COST_FIELDS,
)


def _attempt_of(term: Event) -> int:
    _, _, attempt = term.stream_id.rpartition(":")
    return int(attempt) if attempt.isdigit() else 0


async def finalize(
    deps: Deps, rlog: RequestLog, rid: str, term: Event, result: Result, job: Job | None, *, routes: Sequence[str] = ()
) -> None:
    """Store the terminal status and set the TTL, then publish it. ``routes``: the route of each attempt, in
    order (``attempt_route`` / ``routes_tried``; none for a request that never reached a route). Raises
    ``Fenced``."""
    assert isinstance(term, StreamDone | StreamError)
    state: TerminalState = term.status
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
    if routes:
        fields["attempt_route"] = routes[-1]
        fields["routes_tried"] = _ENC.encode(list(routes)).decode()
    # Priced by the final attempt's route (a fallback's own prices) and the model it asked for there.
    priced_name = routes[-1] if routes else (job.route if job else "")
    priced = deps.config.routes.get(priced_name)
    if job is not None and priced is not None:
        home = deps.config.routes.get(job.route, priced)
        model = model_for(home, job.model, priced, is_home=priced_name == job.route)
        fields |= cost_fields(deps.config, priced_name, priced.dialect, priced.provider or "", model, result.usage)
    else:
        fields["usage_reported"] = "1" if result.usage is not None else "0"
    fields |= status_fields(job, result)  # (1.3) the declarations, the validator, the verdicts' counts
    if job is not None and deps.config.budgets:
        charged = budgets_for(deps.config, job.tenant_name, job.budget_key, job.route)
        if charged:  # the budgets its attempts were held and settled in (docs/capacity.md#budgets)
            fields["budgets"] = _ENC.encode([b.name for b in charged]).decode()
    if deps.durable is not None:
        fields["durability"] = "waiting"
    while True:
        stored = await _store(deps, rlog, rid, fields)
        if await publish_terminal(deps, rlog, rid, stored):
            break
        log.error("the stored terminal status was lost (a failover?); storing it again", extra={"request_id": rid})
    # Metric attributes stay bounded: a route the config does not know is counted under "".
    route = deps.config.routes.get(job.route) if job else None
    category = result.error.category if result.error else None
    deps.telemetry.request_finished(
        route=job.route if job and route else "",
        dialect=route.dialect if route else "",
        status=state,
        stop_reason=result.stop_reason,
        category=category,
    )
    extra: dict[str, object] = {"request_id": rid, "attempt": _attempt_of(term), "status": state}
    if result.error:
        extra |= {"category": result.error.category, "error": result.error.message}
    log.info("request finished", extra=extra)
    await check_archive_lag(
        deps.redis, deps.keys, deps.config, deps.consumer
    )  # rate-limited; retention safety (issue 25)


async def _store(deps: Deps, rlog: RequestLog, rid: str, fields: dict[str, str | int]) -> list[bytes | None] | None:
    """FINALIZE, and the status fields the terminal entry needs read back in the same round trip; with
    durability, FINALIZE, WAIT and record what it said (the entry's fields are read afterwards, None).
    Raises ``Fenced``."""
    limit = deps.config.redis_outage_limit
    while True:
        try:
            if deps.durable is None:
                vals = await rlog.finalize_and_read(deps.config.retention_seconds, fields, list(_STATUS_NAMES))
                # Not terminal: the read overtook a script sent again after NOSCRIPT (a restart), or the write
                # was lost; publish_terminal reads the status again and tells which.
                state = vals[0].decode() if vals[0] else ""
                return vals if state in TERMINAL_STATES else None
            acked = await rlog.finalize(deps.config.retention_seconds, fields, wait=deps.durable)
            break
        except StorageError:
            log.error("Redis unavailable while storing a terminal status; retrying", extra={"request_id": rid})
            await anyio.sleep(1.0)
    if acked is None:
        return None
    replicas, timeout_ms = deps.durable
    outcome = "replica" if acked >= replicas else "unconfirmed"
    if outcome == "unconfirmed":
        log.warning(
            "the request's log reached fewer replicas than asked within the wait",
            extra={"request_id": rid, "replicas_acked": acked, "replicas": replicas, "timeout_ms": timeout_ms},
        )
    await with_retry(
        lambda: deps.redis.hset(rlog.keys.status, mapping={"durability": outcome, "replicas_acked": acked}),
        outage_limit=limit,
    )
    return None


async def publish_terminal(deps: Deps, rlog: RequestLog, rid: str, stored: list[bytes | None] | None = None) -> bool:
    """The request's one terminal-stream entry, built from its stored status (``stored``: its fields as
    just read back, else read here); False (nothing published) when the status is not terminal (its write
    was lost). Raises ``StorageError``."""
    vals = stored if stored is not None else await rlog.read_status(list(_STATUS_NAMES))
    st = {k: (v.decode() if isinstance(v, bytes) else (v or "")) for k, v in zip(_STATUS_NAMES, vals, strict=True)}
    if st["state"] not in TERMINAL_STATES:
        return False
    category = msgspec.json.decode(st["error"]).get("category", "") if st["error"] else ""
    entry = {
        "request_id": rid,
        "status": st["state"],
        "stop_reason": st["stop_reason"],
        "error_category": category,
        "attempt": st["attempt"] or "0",
        "raw_count": st["raw_count"] or "0",
        "event_count": st["event_count"] or "0",
        "result_hash": st["result_hash"],
        "metadata": st["metadata"] or "{}",
    }
    if st["durability"]:
        entry["durability"] = st["durability"]
    entry |= {name: st[name] for name in COST_FIELDS if st[name]}
    shard = deps.keys.shard_for(rid)
    await rlog.publish(
        shard.terminal, shard.terminal_marker(rid), deps.config.retention_seconds, entry, wait=deps.durable
    )
    await rlog.mark_published()
    return True


async def ack(deps: Deps, entry_id: str, shard: int = 0) -> None:
    """ACK a job entry of the shard it was read from."""
    jobs = deps.keys.shard(shard).jobs
    await with_retry(
        lambda: deps.router.call("control", key_slot(jobs), "XACK", jobs, deps.config.group, entry_id),
        outage_limit=deps.config.redis_outage_limit,
    )
