"""Registry of dialect adapters, by dialect name.

Rule: a dialect is usable once its adapter is listed in ``ADAPTERS`` ("module:Class", imported on first
use so one dialect's module never slows or breaks another's); everything else (``sluice normalize``,
routes, the worker) looks it up here and gets ``UnknownDialect`` otherwise.
"""

from __future__ import annotations

import importlib
from functools import cache

from sluice.normalizer.adapters.base import Adapter
from sluice.schemas.errors import UnknownDialect

__all__ = ["ADAPTERS", "DIALECTS", "Adapter", "adapter_class", "get_adapter"]

ADAPTERS: dict[str, str] = {
    "anthropic": "sluice.normalizer.adapters.anthropic:AnthropicAdapter",
    "openai-chat": "sluice.normalizer.adapters.openai_chat:OpenAIChatAdapter",
    "openai-responses": "sluice.normalizer.adapters.openai_responses:OpenAIResponsesAdapter",
    "gemini": "sluice.normalizer.adapters.gemini:GeminiAdapter",
    "bedrock-converse": "sluice.normalizer.adapters.bedrock_converse:BedrockConverseAdapter",
}
DIALECTS: tuple[str, ...] = tuple(ADAPTERS)


@cache
def adapter_class(dialect: str) -> type[Adapter]:
    """Raises ``UnknownDialect``."""
    target = ADAPTERS.get(dialect)
    if target is None:
        raise UnknownDialect(f"unknown dialect {dialect!r}; known: {', '.join(DIALECTS)}")
    module, _, name = target.partition(":")
    try:
        cls: type[Adapter] = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise UnknownDialect(f"dialect {dialect!r} is not supported yet") from None
    return cls


def get_adapter(dialect: str) -> Adapter:
    """A fresh adapter for one stream. Raises ``UnknownDialect``."""
    return adapter_class(dialect)()
