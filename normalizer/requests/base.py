"""The provider HTTP request a dialect builder produces, and the helpers every builder shares.

Rule: building a request is pure: the same ``GenerateRequest``, model, key and headers give the same
bytes. ``ProviderRequest.path`` is relative to the route's ``base_url`` (scheme, host and any proxy
prefix, never the API version: the path carries ``/v1`` or ``/v1beta``). Its ``repr`` never shows a
credential header's value nor the body (which holds prompt text), so it is safe to log.

A builder that leaves part of the request out on purpose (reasoning made by another dialect, which the
provider would refuse or misread) says so in ``ProviderRequest.warnings``, one line each: building stays
pure, and the caller decides where warnings go (a log line, a ``stream.warning``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from sluice.schemas.errors import ConfigError
from sluice.schemas.request import GenerateRequest, InvalidRequest, Reasoning, ReasoningPart

__all__ = [
    "DEFAULT_HEADERS",
    "EFFORT_BUDGETS",
    "SECRET_HEADERS",
    "ProviderRequest",
    "assemble",
    "json_text",
    "merge_patch",
    "reasoning_for",
    "require_model",
    "thinking_budget",
]

# Header names (lower case) whose values are credentials: redacted in repr, and refused in a route's
# extra headers, because keys come only from the environment (`api_key_env`), never from config.
SECRET_HEADERS: frozenset[str] = frozenset(
    {"authorization", "proxy-authorization", "x-api-key", "x-goog-api-key", "api-key", "cookie", "x-amz-security-token"}
)
DEFAULT_HEADERS: Mapping[str, str] = {"content-type": "application/json"}

# reasoning.effort -> a thinking budget, for dialects that take a budget (Anthropic, Gemini). These are
# the budgets Google maps OpenAI's reasoning_effort to in Gemini's OpenAI compatibility layer
# (https://ai.google.dev/gemini-api/docs/openai: "low", "medium", "high" -> 1K, 8K, 24K tokens).
EFFORT_BUDGETS: Mapping[str, int] = {"low": 1024, "medium": 8192, "high": 24576}

_JSON = msgspec.json.Encoder()


@dataclass(frozen=True, slots=True, repr=False)
class ProviderRequest:
    method: str
    # Relative to the route's base_url, query included (Gemini's ``?alt=sse``).
    path: str
    headers: Mapping[str, str]
    body: bytes
    # What the builder left out of the request and why (never a secret, never prompt text).
    warnings: tuple[str, ...] = ()

    def url(self, base_url: str) -> str:
        return base_url.rstrip("/") + self.path

    def __repr__(self) -> str:
        shown = {
            name: "<redacted>" if name.lower() in SECRET_HEADERS else value for name, value in self.headers.items()
        }
        return (
            f"ProviderRequest(method={self.method!r}, path={self.path!r}, headers={shown!r}, "
            f"body=<{len(self.body)} bytes>, warnings={self.warnings!r})"
        )

    __str__ = __repr__


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396 JSON Merge Patch, without mutating either argument.

    Objects merge key by key, recursively; a ``None`` (JSON null) value deletes the key; anything else,
    lists included, replaces the target's value.
    """
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged


def json_text(value: Any) -> str:
    """Compact JSON text, keys in insertion order (OpenAI sends tool arguments as a JSON string)."""
    return _JSON.encode(value).decode()


def require_model(model: str) -> str:
    if not model:
        raise InvalidRequest("no model: the job names none and its route has no default")
    return model


def thinking_budget(reasoning: Reasoning | None) -> int | None:
    """The token budget for budget-based dialects: ``budget_tokens`` if given, else from the effort
    (``None`` when the request asks for neither, e.g. only ``include_encrypted``)."""
    if reasoning is None:
        return None
    if reasoning.budget_tokens is not None:
        return reasoning.budget_tokens
    if reasoning.effort is None:
        return None
    return EFFORT_BUDGETS[reasoning.effort]


def reasoning_for(dialect: str, part: ReasoningPart, index: int, warnings: list[str]) -> ReasoningPart | None:
    """``part`` if this dialect made it; else ``None``, with a warning: a signature or an encrypted
    payload is only valid where it was made, and another provider would refuse it or read it wrong."""
    if part.dialect == dialect:
        return part
    warnings.append(f"messages[{index}]: reasoning from {part.dialect} left out ({dialect} cannot take it back)")
    return None


def assemble(
    *,
    dialect: str,
    path: str,
    auth: Mapping[str, str],
    headers: Mapping[str, str],
    body: dict[str, Any],
    req: GenerateRequest,
    extra_headers: Mapping[str, str] | None,
    warnings: list[str] | None = None,
) -> ProviderRequest:
    """Merge ``req.extra`` into the body and the route's headers over the dialect's, then encode.

    Raises ``ConfigError`` for a credential in ``extra_headers`` and ``InvalidRequest`` when ``extra``
    turns streaming off (sluice only reads streams).
    """
    merged = merge_patch(body, req.extra)
    if body.get("stream") is True and merged.get("stream") is not True:
        raise InvalidRequest(f"{dialect}: extra cannot turn streaming off")
    all_headers = {**DEFAULT_HEADERS, **headers, **auth}
    for name, value in (extra_headers or {}).items():
        lowered = name.lower()
        if lowered in SECRET_HEADERS:
            raise ConfigError(f"route header {name!r} carries credentials; keys come only from api_key_env")
        # HTTP header names are case-insensitive: the route's header replaces ours of the same name.
        all_headers = {k: v for k, v in all_headers.items() if k != lowered}
        all_headers[lowered] = value
    return ProviderRequest(
        method="POST", path=path, headers=all_headers, body=_JSON.encode(merged), warnings=tuple(warnings or ())
    )
