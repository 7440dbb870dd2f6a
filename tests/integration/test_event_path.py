"""One event's path, pinned: the sluice source files whose lines run between a socket read of the provider's
response and the write of its append to Redis, traced over one real worker request, equal the documented list.

Counting rule: a file counts when one of its lines runs (``sys.settrace`` line events, in the event loop's
thread) from the wire client's ``_Conn.data_received`` to the append pipe's ``_Proto._flush``; coroutines only
resumed on the way up to the reading task run no line and do not count, nor does the fake provider (``ops/``).
The per-event set is the one most segments share (the first segment also holds the attempt's set-up: the
packed append head, the route). The append script then runs in Redis (``worker/redis/scripts.py``
``APPEND``), one more file on the path that no tracer sees.
"""

from __future__ import annotations

import collections
import os
import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import redis.asyncio as aioredis

from tests.integration.conftest import cleanup, client_for, make_config, running_worker

ROOT = Path(__file__).resolve().parents[2]
_CORE = tuple(str(ROOT / d) + os.sep for d in ("worker", "normalizer", "schemas"))
NOTES = ROOT / "docs" / "code-layout.md"

# The path, in order: file -> the functions of it that run for every event (anthropic dialect, wire client).
EVENT_PATH: dict[str, tuple[str, ...]] = {
    "worker/http/wire.py": ("_Conn.data_received", "WireResponse.receive"),
    "worker/http/http1.py": ("ResponseParser.feed",),
    "worker/pipeline/upstream.py": ("_read_body", "_ReadWindow.read", "_Timers.fed", "_ReadWindow.made_events"),
    "normalizer/redact.py": ("RedactingStream.feed",),
    "worker/clock.py": ("now_ms",),
    "normalizer/stream.py": ("Normalizer.feed", "Normalizer._process_all", "Normalizer._process"),
    "normalizer/sse.py": ("SSEDecoder.feed",),
    "normalizer/adapters/anthropic.py": ("AnthropicAdapter.feed",),
    "normalizer/machine.py": ("StreamMachine.process",),
    "normalizer/assemble.py": ("Assembly.apply",),
    "worker/append/log.py": ("PendingBatch.normalized", "RequestLog.send_append"),
    "worker/append/store.py": ("AttemptStore.send",),
    "worker/redis/pipe.py": ("RedisPipe.send_packed_nowait", "_Proto.send", "_Proto._flush"),
}
IN_REDIS = ("worker/redis/scripts.py", "APPEND")


def _documented() -> list[tuple[str, str]]:
    """The numbered ``file`` ``functions`` lines of the notes' path list."""
    text = NOTES.read_text()
    section = text[text.index("## One event's path") :]
    section = section[: section.index("\n## ", 1)]
    rows = re.findall(r"^\d+\. `([^`]+)` ((?:`[^`]+`(?:, )?)+)", section, re.M)
    return [(f, fn) for f, fns in rows for fn in re.findall(r"`([^`]+)`", fns)]


def test_the_documented_path_is_the_pinned_one() -> None:
    want = [(f, fn) for f, fns in EVENT_PATH.items() for fn in fns] + [IN_REDIS]
    assert _documented() == want


@pytest.mark.asyncio
async def test_one_event_crosses_the_documented_files(
    fake: Any, redis_url: str, key_prefix: str, redis_client: aioredis.Redis
) -> None:
    config = make_config(redis_url, key_prefix, fake.base_url)
    segments: list[list[tuple[str, str]]] = []
    current: list[tuple[str, str]] | None = None
    loop_thread = threading.get_ident()

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_filename.startswith(_CORE) and threading.get_ident() == loop_thread:
            return on_line
        return None

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal current
        if event == "line":
            where = (os.path.relpath(frame.f_code.co_filename, ROOT), frame.f_code.co_qualname)
            if current is None and where == ("worker/http/wire.py", "_Conn.data_received"):
                current = []
            if current is not None:
                current.append(where)
                if where == ("worker/redis/pipe.py", "_Proto._flush"):
                    segments.append(current)
                    current = None
        return on_line

    try:
        async with running_worker(config), client_for(config) as client:
            job = {
                "route": "anthropic",
                "model": "synthetic;deltas=40;pace_ms=5",
                "request": {"messages": [{"role": "user", "content": "x"}]},
            }
            rid = await client.enqueue(job)
            sys.settrace(on_call)
            try:
                result = await client.result(rid, timeout=60)
            finally:
                sys.settrace(None)
        assert result.status == "completed", result
        shared = collections.Counter(frozenset(f for f, _ in s) for s in segments)
        files, count = shared.most_common(1)[0]
        assert len(segments) >= 40 and count >= len(segments) // 2, shared
        assert sorted(files) == sorted(EVENT_PATH)
        steady = [s for s in segments if frozenset(f for f, _ in s) == files]
        ran = {where for s in steady for where in s}
        for f, fns in EVENT_PATH.items():
            for fn in fns:
                assert (f, fn) in ran, (f, fn)
    finally:
        await cleanup(redis_client, key_prefix)
