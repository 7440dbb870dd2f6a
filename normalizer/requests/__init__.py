"""Request translation: sluice's ``GenerateRequest`` to each dialect's exact HTTP request.

Rule: ``build_request`` is the one entry point, pure (no IO, no clock, no randomness). Each dialect
module documents its own mapping; every one asks for a stream (``stream: true``, or Gemini's
``alt=sse``), puts the model where its provider wants it, sends the key in its provider's auth header
(none when ``api_key`` is empty, for keyless local servers) and merges ``req.extra`` into the body last
(RFC 7396). ``extra_headers`` are the route's non-secret headers; they override the dialect's headers
of the same name and may not carry credentials. ``options`` are route-level dialect settings
(``openai-chat``: ``max_tokens_field``, ``stream_options``; ``anthropic``: ``vertex``). ``path`` is the route's
path template (``sluice.normalizer.requests.paths``), filled with the model and ``path_values``; without one,
the dialect's own path (or its options' default, ``default_path``: Claude on Vertex).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any

from sluice.normalizer.requests import anthropic, bedrock_converse, gemini, openai_chat, openai_responses
from sluice.normalizer.requests.base import ProviderRequest, merge_patch
from sluice.normalizer.requests.paths import fill_path
from sluice.schemas.errors import ConfigError, UnknownDialect
from sluice.schemas.request import GenerateRequest

__all__ = [
    "BUILDERS",
    "ProviderRequest",
    "build_request",
    "default_path",
    "merge_patch",
    "options_for",
]

_MODULES: tuple[ModuleType, ...] = (openai_chat, openai_responses, anthropic, gemini, bedrock_converse)
BUILDERS: Mapping[str, Callable[..., ProviderRequest]] = {module.DIALECT: module.build for module in _MODULES}
_OPTIONS: Mapping[str, frozenset[str]] = {module.DIALECT: module.OPTIONS for module in _MODULES}


def build_request(
    dialect: str,
    req: GenerateRequest,
    *,
    model: str,
    api_key: str | None,
    extra_headers: Mapping[str, str] | None = None,
    path: str | None = None,
    path_values: Mapping[str, str] | None = None,
    **options: Any,
) -> ProviderRequest:
    """The provider request for ``req`` in ``dialect``.

    Raises ``UnknownDialect``, ``InvalidRequest`` (the dialect cannot express the request) and
    ``ConfigError`` (a credential in ``extra_headers``, an unknown or invalid option).
    """
    builder = BUILDERS.get(dialect)
    if builder is None:
        raise UnknownDialect(f"unknown dialect {dialect!r}; known: {', '.join(BUILDERS)}")
    unknown = sorted(set(options) - _OPTIONS[dialect])
    if unknown:
        raise ConfigError(f"{dialect}: unknown request option(s) {', '.join(unknown)}")
    built = builder(req, model=model, api_key=api_key, extra_headers=extra_headers, **options)
    template = path if path is not None else default_path(dialect, options)
    if template is None:
        return built
    return replace(built, path=fill_path(template, dialect, model=model, values=path_values or {}))


def default_path(dialect: str, options: Mapping[str, Any]) -> str | None:
    """The path template a route of ``dialect`` with ``options`` uses when it names none; None: the
    builder's own. Raises ``ConfigError`` for an invalid option value."""
    return anthropic.default_path(options) if dialect == anthropic.DIALECT else None


def options_for(dialect: str) -> frozenset[str]:
    """The route-level request options a dialect's builder takes (empty for an unknown dialect)."""
    return _OPTIONS.get(dialect, frozenset())
