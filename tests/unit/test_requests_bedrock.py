"""bedrock-converse requests: sluice's request shape as the Converse API documents it, exact bodies."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sluice.normalizer.requests import ProviderRequest, build_request
from sluice.schemas.request import GenerateRequest, InvalidRequest, decode_request
from tests.eventstream_transcripts import body as transcript
from tests.helpers import run
from tests.unit.test_requests import CONVERSATION, KEY, WEATHER_SCHEMA

D = "bedrock-converse"


def build(data: dict[str, Any], **kw: Any) -> ProviderRequest:
    kw.setdefault("model", "anthropic.claude-sonnet-4-5-20250929-v1:0")
    kw.setdefault("api_key", KEY)
    return build_request(D, decode_request(msgspec.json.encode(data)), **kw)


def body(data: dict[str, Any], **kw: Any) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(build(data, **kw).body)
    return decoded


def test_simple_request_path_headers_body() -> None:
    built = build({"messages": [{"role": "user", "content": "Hello"}]})
    assert built.method == "POST"
    assert built.path == "/model/anthropic.claude-sonnet-4-5-20250929-v1%3A0/converse-stream"
    assert dict(built.headers) == {
        "content-type": "application/json",
        "accept": "application/vnd.amazon.eventstream",
        "authorization": f"Bearer {KEY}",
    }
    assert msgspec.json.decode(built.body) == {"messages": [{"role": "user", "content": [{"text": "Hello"}]}]}
    assert built.warnings == ()


@pytest.mark.parametrize(
    ("model", "segment"),
    [
        ("us.anthropic.claude-3-7-sonnet-20250219-v1:0", "us.anthropic.claude-3-7-sonnet-20250219-v1%3A0"),
        (
            "arn:aws:bedrock:us-east-1:123456789012:inference-profile/us.meta.llama3-2-1b-instruct-v1:0",
            "arn%3Aaws%3Abedrock%3Aus-east-1%3A123456789012%3Ainference-profile%2Fus.meta.llama3-2-1b-instruct-v1%3A0",
        ),
        ("synthetic;deltas=3", "synthetic%3Bdeltas%3D3"),
    ],
)
def test_the_model_id_is_one_encoded_segment(model: str, segment: str) -> None:
    assert (
        build({"messages": [{"role": "user", "content": "x"}]}, model=model).path == f"/model/{segment}/converse-stream"
    )


def test_no_key_no_auth_header_and_a_model_is_required() -> None:
    assert "authorization" not in dict(build({"messages": [{"role": "user", "content": "x"}]}, api_key=None).headers)
    with pytest.raises(InvalidRequest, match="no model"):
        build({"messages": [{"role": "user", "content": "x"}]}, model="")


def test_conversation_with_tool_calls_results_and_inference_config() -> None:
    assert body(CONVERSATION) == {
        "messages": [
            {"role": "user", "content": [{"text": "Weather in Zürich and Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"text": "Checking both."},
                    {"toolUse": {"toolUseId": "call_1", "name": "get_weather", "input": {"city": "Zürich"}}},
                    {"toolUse": {"toolUseId": "call_2", "name": "get_weather", "input": {"city": "Oslo", "unit": "C"}}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"toolResult": {"toolUseId": "call_1", "content": [{"text": "18 C, sunny"}], "status": "success"}},
                    {
                        "toolResult": {
                            "toolUseId": "call_2",
                            "content": [{"text": "station offline"}],
                            "status": "error",
                        }
                    },
                ],
            },
            {"role": "user", "content": [{"text": "And tomorrow?"}]},
        ],
        "system": [{"text": "You are terse."}],
        "inferenceConfig": {"maxTokens": 512, "temperature": 0.2, "topP": 0.9},
        "toolConfig": {
            "tools": [
                {
                    "toolSpec": {
                        "name": "get_weather",
                        "description": "Current weather for a city.",
                        "inputSchema": {"json": WEATHER_SCHEMA},
                    }
                }
            ],
            "toolChoice": {"auto": {}},
        },
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [("auto", {"auto": {}}), ("required", {"any": {}}), ({"name": "f"}, {"tool": {"name": "f"}}), ("none", None)],
)
def test_tool_choice(choice: Any, expected: dict[str, Any] | None) -> None:
    data = {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}], "tool_choice": choice}
    built = build(data)
    config = msgspec.json.decode(built.body)["toolConfig"]
    assert config.get("toolChoice") == expected
    assert config["tools"] == [
        {"toolSpec": {"name": "f", "inputSchema": {"json": {"type": "object", "properties": {}}}}}
    ]
    assert built.warnings == (
        ()
        if expected
        else ("tool_choice none cannot be expressed in Converse: the tools are sent, the model may call them",)
    )


def test_stop_sequences_and_reasoning() -> None:
    data = {"messages": [{"role": "user", "content": "x"}], "stop": ["END"], "reasoning": {"effort": "low"}}
    got = body(data)
    assert got["inferenceConfig"] == {"stopSequences": ["END"]}
    assert got["additionalModelRequestFields"] == {"thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert "additionalModelRequestFields" not in body({**data, "reasoning": {"budget_tokens": 0}})


def test_reasoning_replay_from_its_own_results_and_others_left_out() -> None:
    for case, block in [
        (
            "reasoning",
            {"reasoningText": {"text": "The user greets; answer briefly.", "signature": "EqoBCkgIARABGAIiQL"}},
        ),
        ("redacted_reasoning", {"redactedContent": "RW5jcnlwdGVkIHRoaW5raW5n"}),
    ]:
        result = run(D, transcript(case))[2]
        message = msgspec.to_builtins(result.as_message())
        data = {"messages": [{"role": "user", "content": "hi"}, message, {"role": "user", "content": "again"}]}
        built = build(data)
        assistant = msgspec.json.decode(built.body)["messages"][1]
        assert assistant["content"][0] == {"reasoningContent": block}, case
        assert built.warnings == ()
    other = {
        "role": "assistant",
        "content": [{"type": "reasoning", "dialect": "anthropic", "text": "t", "signature": "s"}],
    }
    built = build({"messages": [{"role": "user", "content": "hi"}, other]})
    assert msgspec.json.decode(built.body)["messages"] == [{"role": "user", "content": [{"text": "hi"}]}]
    assert built.warnings == (
        "messages[1]: reasoning from anthropic left out (bedrock-converse cannot take it back)",
        "messages[1]: left out, nothing in it is for bedrock-converse",
    )
    unsigned = {
        "role": "assistant",
        "content": [{"type": "reasoning", "dialect": D, "text": "t"}, {"type": "text", "text": "a"}],
    }
    built = build({"messages": [{"role": "user", "content": "hi"}, unsigned]})
    assert msgspec.json.decode(built.body)["messages"][1] == {"role": "assistant", "content": [{"text": "a"}]}
    assert built.warnings == ("messages[1]: reasoning without its signature left out (Bedrock refuses it)",)


def test_extra_merges_last() -> None:
    data = {
        "messages": [{"role": "user", "content": "x"}],
        "extra": {
            "additionalModelRequestFields": {"reasoningConfig": {"type": "enabled"}},
            "performanceConfig": {"latency": "optimized"},
        },
    }
    got = body(data)
    assert got["additionalModelRequestFields"] == {"reasoningConfig": {"type": "enabled"}}
    assert got["performanceConfig"] == {"latency": "optimized"}


def test_unused_request_type_is_the_contract() -> None:
    assert GenerateRequest  # the same request shape as every dialect
