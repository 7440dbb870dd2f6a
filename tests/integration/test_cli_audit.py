"""``sluice audit`` against requests the real worker wrote: it passes on good requests of every dialect and
every way an attempt can end, and reports the exact first divergence when a stored log is altered."""

from __future__ import annotations

import re
import time

import msgspec
import pytest

from sluice.schemas.events import BlockDelta, decode_event
from tests.integration.conftest import DIALECTS

# The harness fixtures are imported by name, so test arguments shadow them (F811) on purpose.
# ruff: noqa: F811
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

RICH = "synthetic;deltas=12;tools=2;reasoning=3;chunk=7"


def _audit_ok(service: Service, rid: str) -> str:
    code, out, err = service.cli("audit", rid)
    assert (code, err) == (0, ""), out
    assert out.startswith(f"audit {rid}: OK\n")
    assert "MISMATCH" not in out and "problem" not in out
    assert "ts differs" not in out  # the raw entries' receive times reproduce every event's ts
    return out


@pytest.mark.parametrize("dialect", DIALECTS)
def test_audit_passes_per_dialect(service: Service, dialect: str) -> None:
    rid = service.enqueue(dialect, RICH, f"a-{dialect}")
    st = service.wait_state(rid)
    assert st["state"] == "completed"
    out = _audit_ok(service, rid)
    n_events = len(service.events(rid))
    n_raw = service.r.xlen(service.keys.request(rid).raw)
    assert f"streams: raw {n_raw} entries (status says {n_raw}), events {n_events} (status says {n_events})" in out
    assert re.search(
        rf"attempt 1 \[{dialect}/\S+\]: {n_raw - 1} raw events, HTTP 200; {n_events} stored / "
        rf"{n_events} replayed events: ok",
        out,
    ), out
    assert out.endswith(f"  result hash: {st['result_hash']} (status record = stored events = replay)\n")


# How each way of ending is explained: (route, model, job extras, expected state, text the audit shows).
ENDINGS = [
    (
        "anthropic",
        "synthetic;deltas=6;error_after=3",
        {},
        "failed",
        "the provider's events end it (failed / overloaded",
    ),
    (
        "openai-chat",
        "synthetic;deltas=4;drop_terminal=1",
        {},
        "interrupted",
        "the body ended after the last raw event (interrupted / transport",
    ),
    ("gemini", "synthetic;deltas=4;drop_terminal=1", {}, "interrupted", "the body ended after the last raw event"),
    ("openai-responses", "synthetic;deltas=5;malformed_json=3", {}, "failed", "(failed / protocol: raw event"),
    ("anthropic", "synthetic;deltas=5;invalid_utf8=3", {}, "failed", "is not valid UTF-8"),
    (
        "anthropic",
        "synthetic;status=401",
        {},
        "failed",
        "HTTP 401, replayed from the stored body: failed / authentication",
    ),
    (
        "openai-chat",
        "synthetic;deltas=50;pace_ms=400",
        {"timeouts": {"idle": 0.3}},
        "interrupted",
        "ended outside the provider's events after ",
    ),
    (
        "anthropic",
        "synthetic;deltas=5;first_byte_ms=2000",
        {"timeouts": {"first_byte": 0.2}},
        "interrupted",
        "interrupted / timeout: first_byte timeout",
    ),
    (
        "openai-responses",
        "synthetic;deltas=20;reset=3",
        {},
        "interrupted",
        "/ transport: the connection broke mid-stream",
    ),
    (
        "nowhere",
        "synthetic",
        {},
        "failed",
        "never reached a provider: failed / invalid_request: unknown route 'nowhere'",
    ),
]


@pytest.mark.parametrize(("route", "model", "extra", "state", "shown"), ENDINGS)
def test_audit_explains_every_ending(
    service: Service, route: str, model: str, extra: dict, state: str, shown: str
) -> None:
    rid = service.enqueue(route, model, f"end-{route}", **extra)
    assert service.wait_state(rid)["state"] == state
    out = _audit_ok(service, rid)
    assert shown in out, out


def test_audit_retried_request_checks_every_attempt(service: Service) -> None:
    rid = service.enqueue("anthropic", "synthetic;deltas=3;status=529;times=1;id=audit-retry", "retry-1")
    assert service.wait_state(rid)["state"] == "completed"
    out = _audit_ok(service, rid)
    assert "attempt 1 [anthropic/anthropic]: 0 raw events, HTTP 529" in out
    assert "HTTP 529, replayed from the stored body: failed / overloaded" in out
    assert "attempt 2 [anthropic/anthropic]:" in out and "the provider's events end it (stop)" in out


def test_audit_cancelled_request(service: Service) -> None:
    rid = service.enqueue("gemini", "synthetic;deltas=400;pace_ms=20", "cancel-a")
    service.wait_state(rid, ("running",))
    while not any(isinstance(ev, BlockDelta) for _, ev in service.events(rid)):
        time.sleep(0.02)
    assert service.cli("cancel", rid, "--wait")[0] == 4  # ended interrupted (the exit table)
    out = _audit_ok(service, rid)
    assert "interrupted / cancelled: cancelled on request" in out


def _rewrite(service: Service, key: str, change: dict[str, object]) -> None:
    """Replace a stream by a copy with some entries' fields changed (an entry id cannot be re-added)."""
    entries = service.r.xrange(key)
    ttl = service.r.ttl(key)
    service.r.delete(key)
    for entry_id, fields in entries:
        eid = entry_id.decode()
        service.r.xadd(key, {**fields, **change.get(eid, {})}, id=eid)  # type: ignore[dict-item]
    if ttl > 0:
        service.r.expire(key, ttl)


def test_audit_reports_the_first_divergence_of_an_altered_event(service: Service) -> None:
    rid = service.enqueue("openai-chat", "synthetic;deltas=6", "tamper-1")
    service.wait_state(rid)
    _audit_ok(service, rid)
    events = service.events(rid)
    pos, original = next((i, ev) for i, ev in events if isinstance(ev, BlockDelta) and ev.seq >= 4)
    assert isinstance(original, BlockDelta)
    altered = msgspec.structs.replace(original, delta=msgspec.structs.replace(original.delta, text="TAMPERED"))
    key = service.keys.request(rid).events
    _rewrite(service, key, {pos: {"event": msgspec.json.encode(altered)}})
    assert decode_event(service.r.xrange(key, pos, pos)[0][1][b"event"]) == altered

    code, out, err = service.cli("audit", rid)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"audit {rid}: MISMATCH"
    i = lines.index(f"    first divergence at seq {original.seq}:")
    assert lines[i + 1] == "      stored:   " + msgspec.json.encode(altered).decode()
    assert lines[i + 2] == "      replayed: " + msgspec.json.encode(original).decode()
    # the result assembled from the altered log no longer has the status record's hash either
    assert "problem: the status record's result_hash" in out and "is not the stored events'" in out
    i = lines.index("  result hash: DIFFER")
    assert lines[i + 1] == "    status record  " + service.status(rid)["result_hash"]
    assert lines[i + 2] != lines[i + 3].replace("replay        ", "stored events")  # the replay kept the original


def test_audit_reports_an_altered_raw_event(service: Service) -> None:
    rid = service.enqueue("anthropic", "synthetic;deltas=4", "tamper-2")
    service.wait_state(rid)
    key = service.keys.request(rid).raw
    raw = service.r.xrange(key)
    target = next(i.decode() for i, f in raw if b'"text_delta"' in f[b"data"])
    data = service.r.xrange(key, target, target)[0][1][b"data"].replace(b'"text":"', b'"text":"X', 1)
    _rewrite(service, key, {target: {"data": data}})
    code, out, _ = service.cli("audit", rid)
    assert code == 1
    m = re.search(r"first divergence at seq (\d+)", out)
    assert m is not None
    stored = dict(service.events(rid))
    diverging = next(ev for ev in stored.values() if ev.seq == int(m.group(1)))
    assert diverging.raw == [int(target.split("-")[1])]  # the event that raw entry produced
    assert '"text":"X' in out.split("replayed: ")[1]


def test_audit_since_summarizes_and_flags_mismatches(service: Service) -> None:
    rids = [service.enqueue(d, "synthetic;deltas=3", f"since-{d}") for d in DIALECTS]
    for rid in rids:
        service.wait_state(rid)
    code, out, err = service.cli("audit", "--since", "10m")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert sorted(line.split()[1] for line in lines[:-1]) == sorted(rids)
    assert all(line.startswith("ok ") for line in lines[:-1])
    assert lines[-1] == "audited 4 request(s) finished in the last 10m: 4 ok, 0 mismatched, 0 missing (expired)"

    service.r.hset(service.keys.request(rids[1]).status, "result_hash", "sha256:0")
    service.r.delete(service.keys.request(rids[2]).status)
    code, out, _ = service.cli("audit", "--since", "1h", "--quiet")
    assert code == 1
    lines = out.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"MISMATCH  {rids[1]}  completed")
    assert lines[1] == "audited 4 request(s) finished in the last 1h: 2 ok, 1 mismatched, 1 missing (expired)"


def test_audit_refuses_a_running_request(service: Service) -> None:
    rid = service.enqueue("anthropic", "synthetic;deltas=400;pace_ms=20", "running-a")
    service.wait_state(rid, ("running",))
    code, out, err = service.cli("audit", rid)
    assert code == 2 and out == ""
    assert err == f"sluice audit: request {rid} is running: audit checks finished requests\n"
    service.cli("cancel", rid, "--wait")
