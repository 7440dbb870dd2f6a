"""HTTP errors before the stream: the status decides the category, unless a Google ErrorInfo reason names
the problem more precisely (Gemini answers a bad key with 400 INVALID_ARGUMENT, reason API_KEY_INVALID)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.normalizer.http_errors import HttpFailure, classify_http_error

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "http_errors"


def test_gemini_bad_key_is_authentication() -> None:
    body = (FIXTURES / "gemini_api_key_invalid.json").read_bytes()
    message = "provider answered HTTP 400: API key not valid. Please pass a valid API key."
    assert classify_http_error(400, body) == HttpFailure("authentication", "API_KEY_INVALID", message, False)


def test_gemini_other_invalid_argument_stays_invalid_request() -> None:
    failure = classify_http_error(400, (FIXTURES / "gemini_invalid_argument.json").read_bytes())
    assert (failure.category, failure.provider_code, failure.retryable) == (
        "invalid_request",
        "INVALID_ARGUMENT",
        False,
    )


@pytest.mark.parametrize(
    ("status", "body", "category", "code", "retryable"),
    [
        (
            401,
            b'{"type":"error","error":{"type":"authentication_error","message":"invalid x-api-key"}}',
            "authentication",
            "authentication_error",
            False,
        ),
        (
            429,
            b'{"error":{"message":"Rate limit","type":"requests","code":"rate_limit_exceeded"}}',
            "rate_limit",
            "rate_limit_exceeded",
            True,
        ),
        (
            529,
            b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}',
            "overloaded",
            "overloaded_error",
            True,
        ),
        (503, b'{"error":{"code":503,"message":"busy","status":"UNAVAILABLE"}}', "overloaded", "UNAVAILABLE", True),
        (502, b"<html>bad gateway</html>", "server_error", None, True),
        (408, b"", "server_error", None, True),
        (418, b"{}", "invalid_request", None, False),
        (
            400,
            b'{"error":{"details":"not a list","status":"INVALID_ARGUMENT"}}',
            "invalid_request",
            "INVALID_ARGUMENT",
            False,
        ),
    ],
)
def test_status_decides_without_a_known_reason(
    status: int, body: bytes, category: str, code: str | None, retryable: bool
) -> None:
    failure = classify_http_error(status, body)
    assert (failure.category, failure.provider_code, failure.retryable) == (category, code, retryable)


def test_geminis_retry_hint_is_read_from_its_error_body() -> None:
    from sluice.worker.pipeline.upstream import retry_delay_in_body

    body = b'{"error":{"code":429,"details":[{"@type":"type.googleapis.com/google.rpc.QuotaFailure"},'
    body += b'{"@type":"type.googleapis.com/google.rpc.RetryInfo","retryDelay":"47.6s"}]}}'
    assert retry_delay_in_body(body) == 47.6
    assert retry_delay_in_body(b'{"error":{"message":"x"}}') is None
    assert retry_delay_in_body(b"not json") is None
    assert retry_delay_in_body(b'{"error":{"details":[{"retryDelay":"soon"}]}}') is None
