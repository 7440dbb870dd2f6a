"""The upstream side of issue 13's method: a transcript served by an upstream of the tests' own, reset at
every event boundary and inside every event, before and after the first visible delta.

The outcome follows from what the worker had stored when the connection broke, never from where the
test cut (a reset may take unread bytes with it): nothing visible yet -> the attempt ends ``interrupted``
/ ``transport`` and a new attempt (served whole) completes; a delta visible -> ``interrupted`` /
``transport`` and no retry; the provider's terminal signal stored -> ``completed``. Attempts are never
spliced: each stored attempt is the normalization of its own raw events, and every invariant of
``tests.faults.invariants`` holds.
"""

from __future__ import annotations

import pytest

from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.stream import normalize_bytes
from sluice.schemas.events import BlockDelta, StreamDone, StreamError
from sluice.schemas.keys import Keys
from tests.faults.invariants import check_request
from tests.faults.upstream import Received, Reply, ScriptedUpstream
from tests.helpers import TRANSCRIPTS, wait_all_acked
from tests.integration.conftest import cleanup, client_for, make_config, raw_log_as_sse, running_worker, without_ts

pytestmark = pytest.mark.asyncio

CASES = [("anthropic", "text_tool_use"), ("openai-chat", "parallel_tool_calls")]


def _events(body: bytes) -> list[bytes]:
    """The body split after each blank line (LF framing in these transcripts)."""
    out, start = [], 0
    while (end := body.find(b"\n\n", start)) >= 0:
        out.append(body[start : end + 2])
        start = end + 2
    if start < len(body):
        out.append(body[start:])
    return out


def _cut_points(pieces: list[bytes]) -> list[int]:
    """Every event boundary, and the middle of every event."""
    cuts, pos = [], 0
    for p in pieces:
        cuts.append(pos + len(p) // 2)
        pos += len(p)
        cuts.append(pos)
    return cuts


@pytest.mark.parametrize(("dialect", "name"), CASES)
async def test_a_reset_anywhere_in_the_stream_ends_as_what_was_stored_says(
    redis_url, key_prefix, redis_client, dialect, name
):
    path = TRANSCRIPTS / dialect / f"{name}.sse"
    if not path.exists():
        pytest.skip(f"no transcript {path}")
    body = path.read_bytes()
    pieces = _events(body)
    cuts = _cut_points(pieces)
    plan: dict[str, int] = {}

    def respond(req: Received, n: int) -> Reply:
        rid = req.headers["x-sluice-request-id"]
        first = sum(1 for r in upstream.received if r.headers.get("x-sluice-request-id") == rid) == 1
        return Reply(200, pieces=pieces, cut_at=plan[rid] if first else None)

    keys = Keys(key_prefix)
    seen = {"retried": 0, "visible": 0, "completed": 0}
    async with ScriptedUpstream(respond) as upstream:
        config = make_config(redis_url, key_prefix, upstream.base_url)
        try:
            async with running_worker(config), client_for(config) as client:
                for i, cut in enumerate(cuts):
                    rid = f"cut{i}-{cut}"
                    plan[rid] = cut
                    await client.enqueue(
                        {
                            "route": dialect,
                            "model": "m",
                            "request_id": rid,
                            "request": {"messages": [{"role": "user", "content": "hi"}]},
                        }
                    )
                    result = await client.result(rid, timeout=30)
                    await wait_all_acked(redis_client, keys.jobs, config.group)
                    facts = await check_request(redis_client, keys, rid)
                    first = facts.attempts[1]
                    visible = any(isinstance(e, BlockDelta) for e in first)
                    where = f"cut at byte {cut} of {len(body)}"
                    if isinstance(first[-1], StreamDone):
                        assert list(facts.attempts) == [1] and result.status == "completed", where
                        seen["completed"] += 1
                    else:
                        assert isinstance(first[-1], StreamError), where
                        assert (first[-1].status, first[-1].error.category) == ("interrupted", "transport"), where
                        if visible:  # a reader may have seen it: never retried
                            assert list(facts.attempts) == [1] and result.status == "interrupted", where
                            seen["visible"] += 1
                        else:
                            assert list(facts.attempts) == [1, 2] and result.status == "completed", where
                            assert isinstance(facts.attempts[2][-1], StreamDone), where
                            seen["retried"] += 1
                    # never spliced: every attempt is exactly what its own raw events normalize to
                    raw = await redis_client.xrange(keys.request(rid).raw)
                    for attempt, stored in facts.attempts.items():
                        mine = [(i_, f) for i_, f in raw if i_.startswith(f"{attempt}-".encode())]
                        info = StreamInfo(f"{rid}:{attempt}", rid, "", dialect, attempt, "m", route=dialect)
                        _, offline, _ = normalize_bytes([raw_log_as_sse(mine)], dialect, info)
                        replayed = [without_ts(e) for e in offline[: len(stored) - 1]]
                        assert [without_ts(e) for e in stored[:-1]] == replayed, (where, attempt)
        finally:
            await cleanup(redis_client, key_prefix)
    # each kind of ending happened, or the enumeration tested less than it claims
    assert all(seen.values()), seen
