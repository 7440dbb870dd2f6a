"""Output checks end to end (contract 1.3): a real worker checks every dialect's tool calls and structured
answers against the job's declarations, under the route's policy or the job's, and the verdicts travel to
the status record, ``sluice status``, ``sluice tail``, ``sluice audit`` (which recomputes them) and the
archive's index rows; a bad schema is refused at intake and never sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import msgspec
import pytest

from sluice.archive.record import decode_index
from sluice.harness.fake.scenarios import encode_scenario
from sluice.schemas.events import BlockStop, StreamError, StreamStart, Verdict
from sluice.schemas.keys import Keys
from sluice.worker.config import Route
from tests.helpers import wait_all_acked
from tests.integration.conftest import DIALECTS, cleanup, client_for, make_config, running_worker

# ruff: noqa: F811
from tests.integration.test_cli_harness import Service, fake, portal, service  # noqa: F401 - fixtures

# The synthetic generator's calls: get_weather then search_docs, each {"city", "days", "note", "call"}.
CALLS = "synthetic;deltas=3;tools=2;chunk=7"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["city", "days"],
}
TOOLS = [{"name": "get_weather", "parameters": WEATHER}]  # search_docs is not declared
ANSWER_TEXT = '{"city": "Paris", "temp_c": 21}'
# Spelled with the fake's scenario encoding: a %-encoded text is no model name a path segment takes.
ANSWER = encode_scenario(f"synthetic;text={quote(ANSWER_TEXT)};chunk=5")
ANSWER_SCHEMA = {"type": "object", "properties": {"temp_c": {"type": "number", "maximum": 20}}, "required": ["temp_c"]}


def _request(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "Привет"}], **fields}


def _verdicts(service: Service, rid: str) -> list[tuple[str, Verdict]]:
    return [
        (p, e.verdict) for p, e in service.events(rid) if isinstance(e, BlockStop) and isinstance(e.verdict, Verdict)
    ]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_record_one_of_parallel_calls_invalid_per_dialect(service: Service, dialect: str) -> None:
    rid = service.enqueue(dialect, CALLS, f"rec-{dialect}", request=_request(tools=TOOLS))
    st = service.wait_state(rid)
    assert st["state"] == "completed"
    verdicts = _verdicts(service, rid)
    assert [v.valid for _, v in verdicts] == [True, False]
    assert verdicts[1][1].reason == "undeclared_tool"
    assert verdicts[1][1].errors[0].message == "'search_docs' is not among the job's tools"
    assert st["invalid_calls"] == "1" and st["validator"].startswith("jsonschema-rs ")
    assert json.loads(st["checks"]) == {"tools": {"get_weather": WEATHER}}
    start = service.events(rid)[0][1]
    assert isinstance(start, StreamStart) and start.checks == "record"
    code, out, _ = service.cli("audit", rid)
    assert code == 0 and out.startswith(f"audit {rid}: OK\n"), out
    assert "  checks: 1 invalid calls (judged by jsonschema-rs " in out
    assert "checks (record, recomputed with jsonschema-rs " in out and "2 tool calls checked, 1 invalid" in out
    code, out, _ = service.cli("status", rid)
    doc = json.loads(out)
    assert (code, doc["invalid_calls"], doc["checks"]) == (0, 1, {"tools": {"get_weather": WEATHER}})
    code, out, _ = service.cli("tail", rid, "--plain")
    assert code == 0 and "[verdict: valid]" in out
    assert "[verdict: invalid (undeclared_tool): 'search_docs' is not among the job's tools]" in out
    assert out.rstrip().endswith(" · 1 invalid call]")


def test_fail_ends_the_attempt_never_retried_and_the_raw_log_intact(service: Service) -> None:
    rid = service.enqueue("openai-chat", CALLS, "fail-1", request=_request(tools=TOOLS), invalid_output="fail")
    st = service.wait_state(rid)
    assert st["state"] == "failed" and st["attempt"] == "1" and json.loads(st["routes_tried"]) == ["openai-chat"]
    error = json.loads(st["error"])
    assert error["category"] == "invalid_output" and error["retryable"] is False
    assert error["message"] == "tool call search_docs (block 2): 'search_docs' is not among the job's tools"
    events = [e for _, e in service.events(rid)]
    assert isinstance(events[0], StreamStart) and events[0].checks == "fail"
    assert isinstance(events[-1], StreamError) and isinstance(events[-2], BlockStop)
    assert int(st["raw_count"]) == service.r.xlen(service.keys.request(rid).raw) > 1
    code, out, _ = service.cli("audit", rid)
    assert code == 0 and f"audit {rid}: OK" in out, out


def test_a_bad_schema_is_refused_at_intake_and_never_sent(service: Service, fake: Any) -> None:
    before = fake.stats.total_requests
    tools = [{"name": "get_weather", "parameters": {"type": "objekt"}}]
    rid = service.enqueue("anthropic", CALLS, "bad-schema-1", request=_request(tools=tools))
    st = service.wait_state(rid)
    error = json.loads(st["error"])
    assert (st["state"], error["category"]) == ("failed", "invalid_request")
    assert error["message"].startswith("tool 'get_weather': not a valid JSON Schema: ")
    assert "\n" not in error["message"] and fake.stats.total_requests == before
    dlq = [f[b"reason"].decode() for _, f in service.r.xrange(service.keys.dead_letters)]
    assert dlq == [error["message"]]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_structured_answers_under_both_policies(service: Service, dialect: str) -> None:
    fmt = {"name": "weather", "schema": {"type": "object", "required": ["city", "temp_c"]}}
    ok = service.enqueue(dialect, ANSWER, f"ans-{dialect}", request=_request(response_format=fmt))
    st = service.wait_state(ok)
    assert (st["state"], st.get("answer_check")) == ("completed", "valid")
    bad_fmt = {"name": "weather", "schema": ANSWER_SCHEMA}
    for policy, state in (("record", "completed"), ("fail", "failed")):
        rid = service.enqueue(
            dialect, ANSWER, f"ans-{policy}-{dialect}", request=_request(response_format=bad_fmt), invalid_output=policy
        )
        st = service.wait_state(rid)
        assert (st["state"], st["answer_check"]) == (state, "invalid"), st
        term = service.events(rid)[-1][1]
        assert term.answer.errors[0].pointer == "/temp_c"  # type: ignore[union-attr]
        code, out, _ = service.cli("audit", rid)
        assert code == 0, out


def test_the_archive_rows_carry_the_verdicts(service: Service, tmp_path: Path) -> None:
    calls = service.enqueue("gemini", CALLS, "arch-calls", request=_request(tools=TOOLS))
    fmt = {"name": "weather", "schema": ANSWER_SCHEMA}
    answer = service.enqueue("anthropic", ANSWER, "arch-answer", request=_request(response_format=fmt))
    plain = service.enqueue("anthropic", "synthetic;deltas=3", "arch-plain")
    for rid in (calls, answer, plain):
        service.wait_state(rid)
    code, out, err = service.cli("archive", "--to", str(tmp_path), "--once")
    assert (code, err) == (0, ""), out
    rows = {r.request_id: r for r in (decode_index(p.read_bytes()) for p in tmp_path.glob("index/date=*/*.json"))}
    assert (rows[calls].invalid_calls, rows[calls].answer_check) == (1, "")
    assert (rows[answer].invalid_calls, rows[answer].answer_check) == (None, "invalid")
    assert (rows[plain].invalid_calls, rows[plain].answer_check) == (None, "")
    for rid in (calls, answer):
        code, out, _ = service.cli("audit", "--archive", str(tmp_path), rid)
        assert code == 0 and f"audit {rid}: OK" in out, out


@pytest.mark.asyncio
async def test_the_routes_policy_applies_and_a_job_overrides_it(fake, redis_url, key_prefix, redis_client) -> None:
    base = make_config(redis_url, key_prefix, fake.base_url)
    routes = {**base.routes, "anthropic": msgspec.structs.replace(base.routes["anthropic"], invalid_output="fail")}
    config = msgspec.structs.replace(base, routes=routes)
    assert isinstance(routes["anthropic"], Route)
    job = {"route": "anthropic", "model": CALLS, "request": _request(tools=TOOLS)}
    try:
        async with running_worker(config), client_for(config) as client:
            strict = await client.enqueue(job)
            lenient = await client.enqueue({**job, "invalid_output": "record"})
            assert (await client.result(strict, timeout=30)).error.category == "invalid_output"  # type: ignore[union-attr]
            result = await client.result(lenient, timeout=30)
            assert result.status == "completed" and result.invalid_calls == 1
            assert [c.name for c in result.tool_calls] == ["get_weather"]
            assert [c.name for c in result.invalid_tool_calls] == ["search_docs"]
            status = await client.status(lenient)
            assert (status.invalid_calls, status.answer_check) == (1, None)
            assert status.checks is not None and status.checks.tools == {"get_weather": WEATHER}
        await wait_all_acked(redis_client, Keys(key_prefix).jobs, config.group)
    finally:
        await cleanup(redis_client, key_prefix)
