"""Cost from reported usage: each dialect's usage semantics pinned on a provider-shaped stream (which input
count includes the cache, whether reasoning is inside output), exact decimal costs, LiteLLM's price file,
and no usage meaning no cost."""

from __future__ import annotations

from decimal import Decimal

import pytest

from sluice.normalizer.adapters import DIALECTS
from sluice.normalizer.eventstream import encode_frame
from sluice.normalizer.machine import StreamInfo
from sluice.normalizer.pricing import (
    DIALECT_USAGE,
    PriceError,
    Prices,
    check_prices,
    cost_of,
    format_cost,
    litellm_table,
)
from sluice.normalizer.stream import Normalizer
from sluice.schemas.events import Usage


def _sse(*events: tuple[str | None, str]) -> bytes:
    out = b""
    for name, data in events:
        out += (f"event: {name}\n" if name else "").encode() + f"data: {data}\n\n".encode()
    return out


# Each dialect's stream reports: 100 uncached input tokens, 1000 cache reads, 100 visible output tokens,
# 200 reasoning tokens (Anthropic: 200 cache writes, and output 300 with its thinking inside).
BODIES = {
    "anthropic": _sse(
        (
            "message_start",
            '{"type":"message_start","message":{"id":"m","model":"claude","usage":{"input_tokens":100,'
            '"cache_read_input_tokens":1000,"cache_creation_input_tokens":200,"output_tokens":1}}}',
        ),
        (
            "message_delta",
            '{"type":"message_delta","delta":{"stop_reason":"end_turn"},"usage":{"output_tokens":300}}',
        ),
        ("message_stop", '{"type":"message_stop"}'),
    ),
    "openai-chat": _sse(
        (
            None,
            '{"id":"c","object":"chat.completion.chunk","model":"gpt","choices":[{"index":0,'
            '"delta":{"role":"assistant","content":"hi"},"finish_reason":null}]}',
        ),
        (
            None,
            '{"id":"c","object":"chat.completion.chunk","model":"gpt","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
        ),
        (
            None,
            '{"id":"c","object":"chat.completion.chunk","model":"gpt","choices":[],"usage":{"prompt_tokens":1100,'
            '"completion_tokens":300,"total_tokens":1400,"prompt_tokens_details":{"cached_tokens":1000},'
            '"completion_tokens_details":{"reasoning_tokens":200}}}',
        ),
        (None, "[DONE]"),
    ),
    "openai-responses": _sse(
        (
            "response.created",
            '{"type":"response.created","response":{"id":"r","model":"o3","status":"in_progress"}}',
        ),
        (
            "response.completed",
            '{"type":"response.completed","response":{"id":"r","model":"o3","status":"completed",'
            '"usage":{"input_tokens":1100,"output_tokens":300,"total_tokens":1400,'
            '"input_tokens_details":{"cached_tokens":1000},"output_tokens_details":{"reasoning_tokens":200}}}}',
        ),
    ),
    "gemini": _sse(
        (
            None,
            '{"candidates":[{"content":{"parts":[{"text":"hi"}],"role":"model"},"finishReason":"STOP","index":0}],'
            '"usageMetadata":{"promptTokenCount":1100,"candidatesTokenCount":100,"thoughtsTokenCount":200,'
            '"cachedContentTokenCount":1000,"totalTokenCount":1400},"modelVersion":"gemini-2.5"}',
        )
    ),
}


def _frames(*events: tuple[str, str]) -> bytes:
    headers = {":content-type": "application/json", ":message-type": "event"}
    return b"".join(encode_frame({**headers, ":event-type": name}, data.encode()) for name, data in events)


BODIES["bedrock-converse"] = _frames(
    ("messageStart", '{"role":"assistant"}'),
    ("messageStop", '{"stopReason":"end_turn"}'),
    (
        "metadata",
        '{"usage":{"inputTokens":100,"outputTokens":300,"totalTokens":1600,"cacheReadInputTokens":1000,'
        '"cacheWriteInputTokens":200},"metrics":{"latencyMs":120}}',
    ),
)

# What each dialect's normalized usage says for the same tokens: the semantics the cost depends on.
USAGE = {
    "anthropic": Usage(input_tokens=100, output_tokens=300, cache_read_tokens=1000, cache_write_tokens=200),
    "openai-chat": Usage(
        input_tokens=1100, output_tokens=300, reasoning_tokens=200, cache_read_tokens=1000, total_tokens=1400
    ),
    "openai-responses": Usage(
        input_tokens=1100, output_tokens=300, reasoning_tokens=200, cache_read_tokens=1000, total_tokens=1400
    ),
    "gemini": Usage(
        input_tokens=1100, output_tokens=300, reasoning_tokens=200, cache_read_tokens=1000, total_tokens=1400
    ),
    "bedrock-converse": Usage(
        input_tokens=100, output_tokens=300, cache_read_tokens=1000, cache_write_tokens=200, total_tokens=1600
    ),
}
PRICES = Prices(input="1", output="10", cache_read="0.1", cache_write="1.25", reasoning="20")
# anthropic: 100x1 + 1000x0.1 + 200x1.25 + 300x10 (thinking inside output, not reported apart) = 3450
# the others: 100x1 + 1000x0.1 + 100x10 + 200x20 = 5200
COST = {
    "anthropic": "0.00345",
    "openai-chat": "0.0052",
    "openai-responses": "0.0052",
    "gemini": "0.0052",
    "bedrock-converse": "0.00345",  # as anthropic: cache apart from input, reasoning inside output
}


def test_every_dialect_has_its_usage_semantics_pinned() -> None:
    assert set(DIALECT_USAGE) == set(DIALECTS) == set(BODIES)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_usage_semantics_per_dialect(dialect: str) -> None:
    norm = Normalizer(dialect, StreamInfo(f"r:{1}", "r", dialect, dialect))
    norm.feed(BODIES[dialect], 1)
    norm.close(2)
    result = norm.result()
    assert result.status == "completed", result
    assert result.usage == USAGE[dialect]
    cost = cost_of(result.usage, PRICES, dialect)
    assert cost is not None and format_cost(cost) == COST[dialect]


def test_missing_cache_and_reasoning_prices_fall_back_to_input_and_output() -> None:
    p = Prices(input="2.5", output="10")
    u = Usage(input_tokens=1100, output_tokens=300, reasoning_tokens=200, cache_read_tokens=1000)
    assert cost_of(u, p, "openai-chat") == Decimal("1100") * Decimal("2.5") / 10**6 + Decimal("3000") / 10**6


def test_no_usage_is_no_cost_not_zero() -> None:
    assert cost_of(None, PRICES, "openai-chat") is None
    assert cost_of(Usage(), PRICES, "openai-chat") == Decimal(0)
    assert format_cost(Decimal("0E-6")) == "0"


def test_prices_are_decimal_exact_and_checked() -> None:
    assert (
        format_cost(cost_of(Usage(input_tokens=3), Prices(input=0.1, output=0), "gemini") or Decimal(0)) == "0.0000003"
    )
    with pytest.raises(PriceError, match=r"prices\.x\.output must be a decimal number"):
        check_prices("prices.x", Prices(input="1", output="ten"))
    with pytest.raises(PriceError, match="non-negative"):
        check_prices("prices.x", Prices(input="-1", output="1"))


def test_litellm_price_file() -> None:
    doc = {
        "sample_spec": {"input_cost_per_token": 0},
        "gpt-4o": {
            "input_cost_per_token": 2.5e-06,
            "output_cost_per_token": 1e-05,
            "cache_read_input_token_cost": 1.25e-06,
        },
        "claude-sonnet-4": {
            "input_cost_per_token": 3e-06,
            "output_cost_per_token": 1.5e-05,
            "cache_read_input_token_cost": 3e-07,
            "cache_creation_input_token_cost": 3.75e-06,
        },
        "an-embedding": {"input_cost_per_token": 1e-07},
    }
    table = litellm_table(doc)
    assert set(table) == {"gpt-4o", "claude-sonnet-4"}
    assert table["gpt-4o"] == Prices(input="2.5", output="10", cache_read="1.25")
    assert table["claude-sonnet-4"] == Prices(input="3", output="15", cache_read="0.3", cache_write="3.75")


def test_the_provider_s_reported_cost_is_kept_beside_the_computed_one() -> None:
    from sluice.worker.config import Config, Route
    from sluice.worker.cost import cost_fields

    config = Config(
        routes={"or": Route(dialect="openai-chat", base_url="http://h")},
        prices={"or": Prices(input="1", output="2")},
        prices_version="v1",
    )
    usage = Usage(input_tokens=10, output_tokens=25, provider_cost="0.0000655")
    assert cost_fields(config, "or", "openai-chat", "", "m", usage) == {
        "usage_reported": "1",
        "provider_cost": "0.0000655",
        "cost": "0.00006",
        "currency": "USD",
        "prices_version": "v1",
    }
    # Without a price of sluice's own, the provider's figure is still kept.
    assert cost_fields(config, "elsewhere", "openai-chat", "", "m", usage)["provider_cost"] == "0.0000655"
    assert "provider_cost" not in cost_fields(config, "or", "openai-chat", "", "m", Usage(input_tokens=1))
