"""Shared test helpers: normalizing bytes, compact event summaries, re-chunking, and reading metrics (the SDK's
data points and the same series on a prometheus-client registry)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec
from prometheus_client.utils import floatToGoString

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
    Verdict,
)
from sluice.schemas.result import Result
from sluice.worker.observability.genai import GENAI_METRICS, metric_attribute_keys
from sluice.worker.observability.metrics import label_name, prometheus_name
from sluice.worker.observability.telemetry import DURATION_BUCKETS, LABELS, METRICS

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
        return f"start {ev.model}" + ("" if ev.checks is msgspec.UNSET else f" checks={ev.checks}")
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
            why += _verdict(ev.verdict)
            return f"stop {ev.block.index} {msgspec.json.encode(ev.arguments, order='sorted').decode()}{why}"
        return f"stop {ev.block.index}"
    if isinstance(ev, StreamWarning):
        return f"warning {ev.code} {ev.count}"
    if isinstance(ev, StreamDone):
        return f"done {ev.stop_reason} {ev.provider_stop_reason}" + _verdict(ev.answer, "answer")
    if isinstance(ev, StreamError):
        e = ev.error
        return f"{ev.status} {e.category} {e.provider_code} retryable={e.retryable}" + _verdict(ev.answer, "answer")
    raise AssertionError(ev)


def _verdict(verdict: Verdict | msgspec.UnsetType, what: str = "verdict") -> str:
    """`` verdict=valid`` or `` verdict=schema:/city:enum,...`` (reason, then each error's pointer and keyword)."""
    if isinstance(verdict, msgspec.UnsetType):
        return ""
    if verdict.valid:
        return f" {what}=valid"
    where = ",".join(f"{e.pointer}:{e.keyword}" for e in verdict.errors if e.keyword)
    return f" {what}={verdict.reason}" + (f":{where}" if where else "") + ("+" if verdict.more_errors else "")


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


def metric_value(reader: Any, name: str, **attrs: Any) -> Any:
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


def checkout_hint(extra: str) -> str:
    """The install hint in the suite's own venv: requirements/dev.py manages it, with this checkout editable."""
    root = Path(__file__).resolve().parents[1]
    return (
        f"pip install -e '{root}[{extra}]' (this venv follows requirements/*.txt: `python3 requirements/dev.py "
        "test` sets up one with every extra, and a package installed by hand is removed at the next lock change)"
    )


def _spec(name: str, latest: bool) -> tuple[str, str, tuple[str, ...], tuple[float, ...]]:
    """An instrument's kind, unit, attribute keys (its labels, in order) and buckets."""
    if name in METRICS:
        kind, unit, _ = METRICS[name]
        return kind, unit, LABELS.get(name, ("route", "dialect")), DURATION_BUCKETS
    unit, _, buckets, extra, _ = GENAI_METRICS[name]
    return "histogram", unit, (*metric_attribute_keys(latest), *extra), buckets


def _prom(name: str, latest: bool, attrs: dict[str, Any]) -> tuple[str, dict[str, str], tuple[float, ...]]:
    """The sample name's base, the labels of ``attrs``' series and the buckets of ``name`` on /metrics."""
    _, unit, keys, buckets = _spec(name, latest)
    family, suffix = prometheus_name(name, unit)
    base = family if not suffix or family.endswith(f"_{suffix}") else f"{family}_{suffix}"
    return base, {label_name(k): str(attrs.get(k, "")) for k in keys}, buckets


def prom_value(registry: Any, name: str, **attrs: Any) -> float | None:
    """A counter's or up-down counter's sample in the registry (None: no such series)."""
    base, labels, _ = _prom(name, False, attrs)
    return registry.get_sample_value(base + ("_total" if METRICS[name][0] == "counter" else ""), labels)


def prom_histogram(registry: Any, name: str, *, latest: bool = False, **attrs: Any) -> tuple[Any, Any, list[Any]]:
    """A histogram's (count, sum, cumulative bucket counts up to +Inf) in the registry."""
    base, labels, bounds = _prom(name, latest, attrs)
    les = [floatToGoString(b) for b in bounds] + ["+Inf"]
    buckets = [registry.get_sample_value(f"{base}_bucket", {**labels, "le": le}) for le in les]
    return registry.get_sample_value(f"{base}_count", labels), registry.get_sample_value(f"{base}_sum", labels), buckets


def cumulative(point: Any) -> list[int]:
    out, total = [], 0
    for n in point.bucket_counts:
        total += n
        out.append(total)
    return out


def both_value(reader: Any, registry: Any, name: str, *, latest: bool = False, **attrs: Any) -> Any:
    """The one SDK data point of ``name`` with exactly these attributes (sum, or the histogram point),
    after checking the registry's samples of the same series hold the same figures (count, sum, buckets)."""
    point = metric_value(reader, name, **attrs)
    if _spec(name, latest)[0] == "histogram":
        assert prom_histogram(registry, name, latest=latest, **attrs) == (point.count, point.sum, cumulative(point))
    else:
        assert prom_value(registry, name, **attrs) == point
    return point


def both_none(reader: Any, registry: Any, name: str, *, latest: bool = False, **attrs: Any) -> None:
    """Nothing was recorded into ``name``'s series of ``attrs`` in either sink (the registry may hold the
    series at zero: an attempt's label children are made at its route's first attempt)."""
    assert not [p for p in metric_points(reader).get(name, []) if dict(p.attributes) == attrs]
    if _spec(name, latest)[0] == "histogram":
        assert prom_histogram(registry, name, latest=latest, **attrs)[0] in (0, None)
    else:
        assert prom_value(registry, name, **attrs) in (0, None)


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``sluice ARGV`` in-process, through its real entry point: (exit status, stdout, stderr)."""
    from sluice.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse: --help, usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err
