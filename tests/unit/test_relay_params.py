"""The relay's pure checks: query parameters, origins, retry hints and the descriptor limit."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from sluice.relay.limits import retry_hint
from sluice.relay.origins import OriginPolicy
from sluice.relay.params import ParamError, StreamParams, parse_stream_params
from sluice.relay.positions import START, Position


def _parse(query: list[tuple[str, str]], headers: dict[str, str] | None = None) -> StreamParams:
    return parse_stream_params(query, headers or {}, max_coalesce_ms=5000)


def test_valid_parameters() -> None:
    p = _parse([("after", "2-7"), ("coalesce_ms", "50"), ("token", "sl1.a.b")])
    assert p == StreamParams(after=Position(2, 7), after_part=None, window=0.05, format="sse", token="sl1.a.b")
    assert _parse([]).after == START
    # Last-Event-ID wins over ?after= (a browser sends the newer position on every reconnect)
    assert _parse([("after", "1-1")], {"last-event-id": "3-4"}).after == Position(3, 4)
    assert _parse([("after", "1-1")], {"last-event-id": "  "}).after == Position(1, 1)
    ai = _parse([("format", "ai-sdk"), ("after", "2-7.1")])
    assert (ai.after, ai.after_part, ai.format) == (Position(2, 7), 1, "ai-sdk")


@given(st.text(max_size=12))
def test_coalesce_ms_is_ascii_digits_in_range_or_refused(raw: str) -> None:
    try:
        window = _parse([("coalesce_ms", raw)]).window
    except ParamError:
        assert not (raw.isascii() and raw.isdigit() and int(raw) <= 5000)
    else:
        assert raw.isascii() and raw.isdigit() and window == int(raw) / 1000


@given(st.text(max_size=24))
def test_positions_are_exact_or_refused(raw: str) -> None:
    try:
        after = _parse([("after", raw)]).after
    except ParamError:
        return
    text = raw.strip()
    assert text == "" or text.isascii()
    assert after == START or str(after) == text or f"1-{int(text)}" == str(after)


def test_origins() -> None:
    same = Headers({"origin": "http://relay.example:8090", "host": "relay.example:8090"})
    assert OriginPolicy(()).check(same) == (True, False)
    tls = Headers({"origin": "https://relay.example", "host": "relay.example:443"})
    assert OriginPolicy(()).check(tls) == (True, False)
    other = Headers({"origin": "https://app.example", "host": "relay.example"})
    assert OriginPolicy(()).check(other) == (False, True)
    assert OriginPolicy(["https://APP.example:443/"]).check(other) == (True, True)
    assert OriginPolicy(["https://app.example:8443"]).check(other) == (False, True)
    assert OriginPolicy(["*"]).check(other) == (True, True)
    assert OriginPolicy(()).check(Headers({"host": "relay.example"})) == (True, False)  # no Origin: not a browser's
    assert OriginPolicy(["*"]).check(Headers({"origin": "null", "host": "x"})) == (False, True)  # sandboxed frames
    for bad in ("app.example", "ftp://app.example", "https://app.example/path", "https://"):
        with pytest.raises(ValueError):
            OriginPolicy([bad])


def test_retry_hints_are_spread_and_never_early() -> None:
    hints = [retry_hint(2.0, 3.0) for _ in range(50)]
    assert all(2.0 <= h.seconds <= 5.0 for h in hints) and len({h.ms for h in hints}) > 1
    assert all(int(h.header) >= h.seconds and int(h.header) - 1 < h.seconds for h in hints)
    assert retry_hint(0.2, 0).header == "1"  # whole seconds, at least one


def test_the_descriptor_limit_is_raised_to_the_hard_limit() -> None:
    code = (
        "import resource\n"
        "from sluice.relay.limits import raise_fd_limit\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "got = raise_fd_limit()\n"
        "print(got.raised_from, got.soft == (hard if hard != resource.RLIM_INFINITY else 1048576),"
        " resource.getrlimit(resource.RLIMIT_NOFILE)[0] == got.soft)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["256", "True", "True"]
