"""HTTP error responses before the stream: status and provider error body to the contract's categories.

Rule: the category comes from the HTTP status (401 authentication, 402 billing, 403 permission, 404
not_found, 400/413/422 invalid_request, 408 timeout, 429 rate_limit, 529 overloaded, other 5xx
server_error); the provider's own code (OpenAI ``error.code`` or ``error.type``, Anthropic
``error.type``, Gemini ``error.status``) is kept as ``provider_code``; the message is short and safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.schemas.events import RETRYABLE_CATEGORIES

__all__ = ["HTTP_STATUS_CATEGORIES", "HttpFailure", "classify_http_error"]

HTTP_STATUS_CATEGORIES: dict[int, str] = {
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


@dataclass(frozen=True, slots=True)
class HttpFailure:
    category: str
    provider_code: str | None
    message: str
    retryable: bool


def _category(status: int) -> str:
    if status in HTTP_STATUS_CATEGORIES:
        return HTTP_STATUS_CATEGORIES[status]
    if status >= 500:
        return "server_error"
    if 400 <= status < 500:
        return "invalid_request"
    return "unknown"


def _provider_error(body: bytes) -> tuple[str | None, str | None]:
    try:
        doc: Any = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None, None
    err = doc.get("error") if isinstance(doc, dict) else None
    if not isinstance(err, dict):
        return None, None
    code = err.get("status") or err.get("code") or err.get("type")  # Gemini, OpenAI, Anthropic
    msg = err.get("message")
    return (str(code) if code is not None else None), (msg if isinstance(msg, str) else None)


def classify_http_error(status: int, body: bytes) -> HttpFailure:
    category = _category(status)
    code, msg = _provider_error(body)
    text = (msg or "").strip()
    if len(text) > 300:
        text = text[:297] + "..."
    message = f"provider answered HTTP {status}" + (f": {text}" if text else "")
    retryable = category in RETRYABLE_CATEGORIES or status == 408
    return HttpFailure(category, code, message, retryable)
