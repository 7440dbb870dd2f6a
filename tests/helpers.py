"""Shared test helpers: normalizing bytes, compact event summaries, re-chunking, and reading metrics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.sse import SSEEvent
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import (
    BlockDelta,
    BlockStart,
    BlockStop,
    Event,
    StreamDone,
    StreamError,
    StreamStart,
    StreamWarning,
)
from sluice.schemas.result import Result

TRANSCRIPTS = Path(__file__).parent / "fixtures" / "transcripts"
# A transcript's body: ``.sse`` for text/event-stream dialects, ``.eventstream`` (AWS event-stream) for Bedrock.
BODY_SUFFIXES = (".sse", ".eventstream")


def transcript_bodies() -> list[Path]:
    """Every transcript body, by dialect then case; goldens sit beside each (``.jsonl``, ``.result.json``)."""
    return sorted(p for suffix in BODY_SUFFIXES for p in TRANSCRIPTS.glob(f"*/*{suffix}"))


def info(dialect: str, request_id: str = "req_t", attempt: int = 1, model: str | None = None) -> StreamInfo:
    return StreamInfo(
        stream_id=f"{request_id}:{attempt}",
        request_id=request_id,
        provider="",
        dialect=dialect,
        attempt=attempt,
        model=model,
    )


def run(dialect: str, chunks: Sequence[bytes] | bytes, **kw: object) -> tuple[list[SSEEvent], list[Event], Result]:
    if isinstance(chunks, bytes):
        chunks = [chunks]
    return normalize_bytes(chunks, dialect, info(dialect), **kw)  # type: ignore[arg-type]


def brief(ev: Event) -> str:
    """One readable line per contract event, for exact expected sequences in tests."""
    if isinstance(ev, StreamStart):
        return f"start {ev.model}"
    if isinstance(ev, BlockStart):
        b = ev.block
        extra = f" {b.name} {b.call_id}" if b.kind == "tool_call" else ""
        extra += f" {b.visibility}" if b.visibility else ""
        return f"open {b.index} {b.kind}{extra}"
    if isinstance(ev, BlockDelta):
        return f"delta {ev.block.index} {ev.delta.kind} {ev.delta.text!r}"
    if isinstance(ev, BlockStop):
        if ev.block.kind == "tool_call":
            why = f" {ev.arguments_error}" if ev.arguments_error else ""
            return f"stop {ev.block.index} {msgspec.json.encode(ev.arguments, order='sorted').decode()}{why}"
        return f"stop {ev.block.index}"
    if isinstance(ev, StreamWarning):
        return f"warning {ev.code} {ev.count}"
    if isinstance(ev, StreamDone):
        return f"done {ev.stop_reason} {ev.provider_stop_reason}"
    if isinstance(ev, StreamError):
        e = ev.error
        return f"{ev.status} {e.category} {e.provider_code} retryable={e.retryable}"
    raise AssertionError(ev)


def briefs(events: Sequence[Event]) -> list[str]:
    return [brief(e) for e in events]


def rechunk(raw: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted(set(c for c in cuts if 0 < c < len(raw)))
    return [raw[a:b] for a, b in zip([0, *points], [*points, len(raw)], strict=True)]


def check_invariants(events: Sequence[Event]) -> None:
    """The contract's invariants, checked independently of the machine that produced the events."""
    from sluice.schemas.invariants import ContractChecker

    checker = ContractChecker()
    for ev in events:
        checker.process(ev)
    assert checker.terminal, "no terminal event"


def metric_points(reader: Any) -> dict[str, list[Any]]:
    """Instrument name -> its data points (all attribute sets), collected from an in-memory metric reader."""
    out: dict[str, list[Any]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = list(m.data.data_points)
    return out


def metric_value(reader: Any, name: str, **attrs: str) -> Any:
    """The one data point of ``name`` with exactly these attributes (sum, or the histogram point)."""
    points = [p for p in metric_points(reader).get(name, []) if dict(p.attributes) == attrs]
    assert len(points) == 1, (name, attrs, metric_points(reader).get(name))
    return points[0].value if hasattr(points[0], "value") else points[0]


async def wait_all_acked(redis: Any, jobs_key: str, group: str) -> None:
    """Until the group has no pending job. A worker acks last, just after it published the terminal: a
    reader who saw the result may look a moment before that on a busy machine."""
    with anyio.fail_after(10):
        while (await redis.xpending(jobs_key, group))["pending"]:  # noqa: ASYNC110 - the state is in Redis
            await anyio.sleep(0.05)


async def wait_all_handled(redis: Any, jobs_key: str, group: str) -> None:
    """Until every entry of the jobs stream was delivered to the group and acked: what a worker does with a
    job is over (a duplicate included), not merely the request's result visible."""
    with anyio.fail_after(20):
        while True:
            # The last id the stream generated, not its last entry: the workers trim settled entries away.
            last = (await redis.xinfo_stream(jobs_key))["last-generated-id"]
            groups = {g["name"].decode(): g for g in await redis.xinfo_groups(jobs_key)}
            g = groups.get(group)
            if g is not None and g["last-delivered-id"] == last and not g["pending"]:
                return
            await anyio.sleep(0.05)
