"""The one request-id rule (``sluice.schemas.keys``): 1-128 ASCII letters, digits and ``- _ . :``, checked
against an independent spelling of the same set over any text hypothesis makes."""

from __future__ import annotations

import string

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sluice.schemas.errors import JobError
from sluice.schemas.jobs import decode_job, peek_request_id
from sluice.schemas.keys import REQUEST_ID_RULE, valid_request_id

ALLOWED = set(string.ascii_letters + string.digits + "-_.:")


@given(st.text(max_size=140) | st.text(alphabet=sorted(ALLOWED), min_size=1, max_size=140))
def test_the_rule_is_ascii_letters_digits_and_four_marks(rid: str) -> None:
    assert valid_request_id(rid) == (1 <= len(rid) <= 128 and set(rid) <= ALLOWED)


@pytest.mark.parametrize("rid", ["r\u0435q-1", "req\u00a01", "٣", "ｒeq", "req-1\n", "a b", "", "x" * 129])
def test_lookalikes_and_other_letters_are_refused_where_jobs_are_decoded(rid: str) -> None:
    job = msgspec.json.encode(
        {"route": "r", "request_id": rid, "request": {"messages": [{"role": "user", "content": "x"}]}}
    )
    with pytest.raises(JobError) as info:
        decode_job(job)
    assert str(info.value) == f"invalid job: request_id must be {REQUEST_ID_RULE}"
    assert peek_request_id(job) is None  # no status is written under an id no request can have
