"""HTTP error responses before the stream: status and provider error body to the contract's categories.

Rule: the category comes from the HTTP status (401 authentication, 402 billing, 403 permission, 404
not_found, 400/413/422 invalid_request, 408 timeout, 429 rate_limit, 529 overloaded, other 5xx
server_error); the provider's own code (OpenAI ``error.code`` or ``error.type``, Anthropic
``error.type``, Gemini ``error.status``) is kept as ``provider_code``; the message is short and safe.
One exception: a Google ``google.rpc.ErrorInfo`` reason in ``error.details`` that names the problem more
precisely than the status (``ERROR_INFO_REASONS``: Gemini answers a bad key with 400 INVALID_ARGUMENT
and reason API_KEY_INVALID) decides the category, and the reason is the ``provider_code``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.schemas.events import RETRYABLE_CATEGORIES, ErrorCategory

__all__ = ["ERROR_INFO_REASONS", "HTTP_STATUS_CATEGORIES", "HttpFailure", "classify_http_error", "error_info_reason"]

HTTP_STATUS_CATEGORIES: dict[int, ErrorCategory] = {
    400: "invalid_request",
    401: "authentication",
    402: "billing",
    403: "permission",
    404: "not_found",
    408: "server_error",
    413: "invalid_request",
    422: "invalid_request",
    429: "rate_limit",
    503: "overloaded",
    529: "overloaded",
}


# google.rpc.ErrorInfo reason -> category, where the status alone says less (a bad key is not a bad request).
ERROR_INFO_REASONS: dict[str, ErrorCategory] = {"API_KEY_INVALID": "authentication"}


@dataclass(frozen=True, slots=True)
class HttpFailure:
    category: ErrorCategory
    provider_code: str | None
    message: str
    retryable: bool


def _category(status: int) -> ErrorCategory:
    if status in HTTP_STATUS_CATEGORIES:
        return HTTP_STATUS_CATEGORIES[status]
    if status >= 500:
        return "server_error"
    if 400 <= status < 500:
        return "invalid_request"
    return "unknown"


def error_info_reason(details: Any) -> str | None:
    """The first ``google.rpc.ErrorInfo`` reason in an error's ``details`` that ``ERROR_INFO_REASONS`` knows."""
    for detail in details if isinstance(details, list) else ():
        reason = detail.get("reason") if isinstance(detail, dict) else None
        if isinstance(reason, str) and reason in ERROR_INFO_REASONS:
            return reason
    return None


def _provider_error(body: bytes) -> tuple[str | None, str | None, str | None]:
    try:
        doc: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None, None, None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return None, None, None
    code = err.get("status") or err.get("code") or err.get("type")  # Gemini, OpenAI, Anthropic
    msg = err.get("message")
    return (
        (str(code) if code is not None else None),
        (msg if isinstance(msg, str) else None),
        error_info_reason(err.get("details")),
    )


def classify_http_error(status: int, body: bytes) -> HttpFailure:
    category = _category(status)
    code, msg, reason = _provider_error(body)
    if reason is not None:
        category, code = ERROR_INFO_REASONS[reason], reason
    text = (msg or "").strip()
    if len(text) > 300:
        text = text[:297] + "..."
    message = f"provider answered HTTP {status}" + (f": {text}" if text else "")
    retryable = category in RETRYABLE_CATEGORIES or status == 408
    return HttpFailure(category, code, message, retryable)
