"""Decoding a job and peeking at a refused one's request id are bounded whatever the bytes (issue 36, item 9):
``decode_job`` raises ``JobError`` (one line) and nothing else, ``peek_request_id`` never raises, both linear
in the input; depth and value counts are exact at their limits; strings never count."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sluice.schemas.errors import JobError
from sluice.schemas.jobs import (
    MAX_JOB_DEPTH,
    MAX_JOB_VALUES,
    JobTooComplex,
    JobTooLarge,
    decode_job,
    peek_request_id,
)


def _job(extra: bytes = b"{}", rid: bytes = b'"r-1"', *, rid_first: bool = False) -> bytes:
    body = b'"route":"claude","request":{"messages":[{"role":"user","content":"hi"}],"extra":' + extra + b"}"
    member = b'"request_id":' + rid
    return b"{" + (member + b"," + body if rid_first else body + b"," + member) + b"}"


def _nest(n: int) -> bytes:
    return b"[" * n + b"]" * n


# The job's own objects (the job, its request, extra's object) are 3 levels: the nest adds the rest.
_OWN = 3


def test_the_depth_limit_is_exact() -> None:
    assert decode_job(_job(b'{"x":' + _nest(MAX_JOB_DEPTH - _OWN) + b"}")).request_id == "r-1"
    with pytest.raises(JobTooComplex) as exc:
        decode_job(_job(b'{"x":' + _nest(MAX_JOB_DEPTH - _OWN + 1) + b"}"))
    assert exc.value.message == f"job nests {MAX_JOB_DEPTH + 1} levels deep, over the limit of {MAX_JOB_DEPTH}"
    assert exc.value.category == "invalid_request"


def test_the_values_limit_holds() -> None:
    many = b'{"x":[' + b",".join([b"0"] * MAX_JOB_VALUES) + b"]}"
    with pytest.raises(JobTooComplex, match=r"^job holds about \d+ values, over the limit of 100000$"):
        decode_job(_job(many), max_bytes=1 << 22)
    fewer = b'{"x":[' + b",".join([b"0"] * (MAX_JOB_VALUES // 2)) + b"]}"
    assert decode_job(_job(fewer), max_bytes=1 << 22).request_id == "r-1"


def test_brackets_and_commas_inside_strings_never_count() -> None:
    text = json.dumps("[" * 5000 + "," * 200_000 + '\\"{').encode()
    job = decode_job(_job(b'{"x":' + text + b"}"), max_bytes=1 << 22)
    assert job.request.extra["x"].startswith("[[[")


@pytest.mark.parametrize("depth", [2_000, 100_000])
@pytest.mark.parametrize("rid_first", [False, True])
def test_a_deep_job_is_refused_and_its_request_id_still_read(depth: int, rid_first: bool) -> None:
    data = _job(b'{"x":' + _nest(depth) + b"}", rid_first=rid_first)
    with pytest.raises(JobTooComplex, match=f"^job nests {depth + _OWN} levels deep"):
        decode_job(data)
    assert peek_request_id(data) == "r-1"


@pytest.mark.parametrize(
    ("data", "rid"),
    [
        (b"[" * 100_000, None),  # not an object
        (b'{"a":' + _nest(5_000) + b',"request_id":"r-2","request_id":"r-3"}', "r-3"),  # the last, as msgspec
        (b'{"a":' + _nest(5_000) + b',"request\\u005fid":"r-4"}', "r-4"),  # an escaped key
        (b'{"a":{"request_id":"inner"},"b":' + _nest(5_000) + b"}", None),  # only a top-level member counts
        (b'{"a":' + _nest(5_000) + b',"request_id":["r-5"]}', None),  # not a string
        (b'{"a":' + _nest(5_000) + b',"request_id":"r\xff"}', None),  # not UTF-8
        (b'{"a":' + _nest(5_000) + b',"request_id":"bad id"}', None),  # not a valid id
        (b'{"a":"' + b"\\" * 5 + b"[" * 5000, None),  # cut inside a string
    ],
)
def test_peek_reads_only_a_top_level_string_request_id(data: bytes, rid: str | None) -> None:
    assert peek_request_id(data) == rid


def test_not_utf8_is_a_one_line_refusal_and_the_id_is_still_read() -> None:
    data = _job(b'{"x":"h\xff\xfei"}')
    with pytest.raises(JobError) as exc:
        decode_job(data)
    assert exc.value.message == "job is not valid JSON: Invalid UTF-8 encoded string"
    assert peek_request_id(data) == "r-1"
    with pytest.raises(JobError, match=r"^job is not valid JSON: it is not UTF-8 text$"):
        decode_job('{"route":"claude","request":{"messages":[]},"x":"\ud800"}')


def test_a_huge_job_is_refused_before_anything_is_read() -> None:
    data = _job(b'{"x":"' + b"a" * (2 << 20) + b'"}')
    with pytest.raises(JobTooLarge):
        decode_job(data)
    assert peek_request_id(data) == "r-1"


def test_the_scans_are_linear_on_hostile_bytes() -> None:
    """Open strings full of escapes (quadratic for a scan that backtracks or restarts at each quote: minutes
    at this size), deep open nests of arrays and of objects, alternating brackets, wide arrays: each 1 MiB
    case is refused and peeked in well under two seconds (about 0.5 s for the worst here, on one core)."""
    mib = 1 << 20
    cases = [
        b'"\\"' * (mib // 3),
        b'{"a":"' + b"\\" * mib,
        b"[" * mib,
        b"[]," * (mib // 3),
        b'{"a":' + b'{"b":' * (mib // 5),
        b'{"a":' + b"[{}," * (mib // 4),
    ]
    for data in cases:
        started = time.perf_counter()
        with pytest.raises(JobError):
            decode_job(data, max_bytes=2 * mib)
        peek_request_id(data)
        assert time.perf_counter() - started < 2.0, data[:20]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400) | st.text(max_size=200).map(str.encode))
def test_any_bytes_decode_or_refuse_as_a_job_error_and_peek_never_raises(data: bytes) -> None:
    try:
        decode_job(data)
    except JobError as exc:
        assert "\n" not in exc.message
    peek_request_id(data)


_VALUES = st.recursive(
    st.none() | st.integers() | st.text() | st.just("request_id"),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=12) | st.just("request_id"), c, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(_VALUES, st.booleans(), st.booleans())
def test_peek_finds_the_top_level_id_whatever_the_rest_holds(extra: object, deep: bool, rid_first: bool) -> None:
    """Through msgspec (shallow) and through the scan (a 2,000-level nest beside it) alike: the top-level
    request_id, never a "request_id" key or string anywhere inside the request."""
    nest = b',"d":' + _nest(2_000) if deep else b""
    data = _job(b'{"x":' + msgspec.json.encode(extra) + nest + b"}", rid_first=rid_first)
    assert peek_request_id(data) == "r-1"
