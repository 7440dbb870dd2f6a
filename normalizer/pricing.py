"""The cost of a request from the usage its provider reported: a pure function of (usage, prices, dialect).

Rule: prices are per million tokens, decimal (never binary floats: ``Decimal(str(value))``), one currency per
table. What a dialect's normalized ``Usage`` counts differs, and the cost depends on it
(``DIALECT_USAGE``, pinned per dialect by tests/unit/test_pricing.py):

- ``anthropic``: ``input_tokens`` excludes the cache: cache reads and cache writes are counted apart and
  billed apart; ``output_tokens`` includes extended thinking (no separate reasoning count is reported).
- ``openai-chat``: ``input_tokens`` (``prompt_tokens``) includes the cached tokens
  (``prompt_tokens_details.cached_tokens``) and any cache writes; ``output_tokens``
  (``completion_tokens``) includes ``reasoning_tokens``.
- ``openai-responses``: the same as openai-chat (``input_tokens_details.cached_tokens`` inside
  ``input_tokens``, ``output_tokens_details.reasoning_tokens`` inside ``output_tokens``).
- ``gemini``: ``input_tokens`` (``promptTokenCount``) includes ``cachedContentTokenCount``; the adapter
  makes ``output_tokens`` = ``candidatesTokenCount + thoughtsTokenCount``, so it includes reasoning.
- ``bedrock-converse``: like anthropic: ``inputTokens`` excludes ``cacheReadInputTokens`` and
  ``cacheWriteInputTokens`` (reported apart); ``outputTokens`` includes any reasoning (not broken out).

So cost = uncached input x input + cache reads x cache_read + cache writes x cache_write + (output less
reasoning) x output + reasoning x reasoning, where a missing cache_read / cache_write price is the input
price and a missing reasoning price the output price. No usage, no cost (``None``): the caller records
``usage_reported = 0`` rather than a cost of 0. ``litellm_table`` reads LiteLLM's
``model_prices_and_context_window.json`` (prices per token) into the same tables.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import NamedTuple

import msgspec

from sluice.schemas.events import Usage

__all__ = [
    "DIALECT_USAGE",
    "PriceError",
    "Prices",
    "UsageSemantics",
    "check_prices",
    "cost_of",
    "format_cost",
    "litellm_table",
    "prices_version",
]

_MILLION = Decimal(1_000_000)


class PriceError(ValueError):
    """A price that is not a non-negative decimal number; the message names it."""


class UsageSemantics(NamedTuple):
    input_includes_cache: bool  # input_tokens counts cache reads and writes too
    output_includes_reasoning: bool  # output_tokens counts reasoning_tokens too


DIALECT_USAGE: dict[str, UsageSemantics] = {
    "anthropic": UsageSemantics(input_includes_cache=False, output_includes_reasoning=True),
    "openai-chat": UsageSemantics(input_includes_cache=True, output_includes_reasoning=True),
    "openai-responses": UsageSemantics(input_includes_cache=True, output_includes_reasoning=True),
    "gemini": UsageSemantics(input_includes_cache=True, output_includes_reasoning=True),
    "bedrock-converse": UsageSemantics(input_includes_cache=False, output_includes_reasoning=True),
}


class Prices(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Per million tokens, in ``currency``; TOML numbers or decimal strings (``"2.50"``)."""

    input: str | float | int
    output: str | float | int
    cache_read: str | float | int | None = None
    cache_write: str | float | int | None = None
    reasoning: str | float | int | None = None
    currency: str = "USD"


def _dec(name: str, value: str | float | int) -> Decimal:
    try:
        d = Decimal(str(value))
    except InvalidOperation:
        raise PriceError(f"{name} must be a decimal number, not {value!r}") from None
    if not d.is_finite() or d < 0:
        raise PriceError(f"{name} must be a non-negative decimal number, not {value!r}")
    return d


def check_prices(key: str, p: Prices) -> None:
    """Raises ``PriceError`` naming ``key.field`` for a price that does not parse."""
    for name in ("input", "output", "cache_read", "cache_write", "reasoning"):
        v = getattr(p, name)
        if v is not None:
            _dec(f"{key}.{name}", v)
    if not p.currency:
        raise PriceError(f"{key}.currency must not be empty")


def cost_of(usage: Usage | None, prices: Prices, dialect: str) -> Decimal | None:
    """The request's cost in ``prices.currency``; None when no usage was reported."""
    if usage is None:
        return None
    sem = DIALECT_USAGE.get(dialect, UsageSemantics(True, True))
    p_in, p_out = _dec("input", prices.input), _dec("output", prices.output)
    p_cr = _dec("cache_read", prices.cache_read) if prices.cache_read is not None else p_in
    p_cw = _dec("cache_write", prices.cache_write) if prices.cache_write is not None else p_in
    p_re = _dec("reasoning", prices.reasoning) if prices.reasoning is not None else p_out
    cache_read, cache_write = usage.cache_read_tokens or 0, usage.cache_write_tokens or 0
    reasoning = usage.reasoning_tokens or 0
    uncached = usage.input_tokens or 0
    if sem.input_includes_cache:
        uncached = max(0, uncached - cache_read - cache_write)
    output = usage.output_tokens or 0
    if sem.output_includes_reasoning:
        output = max(0, output - reasoning)
    total = uncached * p_in + cache_read * p_cr + cache_write * p_cw + output * p_out + reasoning * p_re
    return total / _MILLION


def format_cost(cost: Decimal) -> str:
    """A plain decimal string (no exponent), trailing zeros dropped: ``0.0032``, ``0``."""
    text = format(cost, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def prices_version(doc: bytes) -> str:
    """A price table's version when the configuration names none: a hash of its canonical bytes."""
    return "sha256:" + hashlib.sha256(doc).hexdigest()[:16]


def litellm_table(doc: object) -> dict[str, Prices]:
    """LiteLLM's price file (``{model: {"input_cost_per_token": ..., ...}}``, per token) as per-million
    ``Prices`` by model name. Entries without both input and output prices are skipped."""
    if not isinstance(doc, Mapping):
        raise PriceError("a LiteLLM price file is a JSON object of models")
    out: dict[str, Prices] = {}
    for model, spec in doc.items():
        if model == "sample_spec" or not isinstance(spec, Mapping):
            continue
        i, o = spec.get("input_cost_per_token"), spec.get("output_cost_per_token")
        if not isinstance(i, int | float | str) or not isinstance(o, int | float | str):
            continue

        def per_million(key: str, spec: Mapping[str, object] = spec, model: str = str(model)) -> str | None:
            v = spec.get(key)
            if not isinstance(v, int | float | str):
                return None
            return format_cost(_dec(f"{model}.{key}", v) * _MILLION)

        out[str(model)] = Prices(
            input=per_million("input_cost_per_token") or "0",
            output=per_million("output_cost_per_token") or "0",
            cache_read=per_million("cache_read_input_token_cost"),
            cache_write=per_million("cache_creation_input_token_cost"),
            reasoning=per_million("output_cost_per_reasoning_token"),
        )
    return out
