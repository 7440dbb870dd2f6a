"""Request translation: exact provider requests built from sluice's own request shape, per dialect."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sluice.normalizer.requests import BUILDERS, ProviderRequest, build_request, merge_patch
from sluice.schemas.errors import ConfigError, JobError, UnknownDialect
from sluice.schemas.request import (
    GenerateRequest,
    InvalidRequest,
    Message,
    NamedToolChoice,
    Reasoning,
    TextPart,
    Tool,
    ToolCallPart,
    ToolResultPart,
    decode_request,
    encode_request,
)

KEY = "sk-test-SECRET-0123456789"
DIALECTS = ("openai-chat", "openai-responses", "anthropic", "gemini")

WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["C", "F"]}},
    "required": ["city"],
    "additionalProperties": False,
}

SIMPLE = {"messages": [{"role": "user", "content": "Hello"}]}

# System, a tool definition, an assistant turn with text and two tool calls, their results (one an
# error) in two consecutive tool messages, then a user follow-up.
CONVERSATION: dict[str, Any] = {
    "system": "You are terse.",
    "messages": [
        {"role": "user", "content": "Weather in Zürich and Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking both."},
                {"type": "tool_call", "call_id": "call_1", "name": "get_weather", "arguments": {"city": "Zürich"}},
                {
                    "type": "tool_call",
                    "call_id": "call_2",
                    "name": "get_weather",
                    "arguments": {"city": "Oslo", "unit": "C"},
                },
            ],
        },
        {"role": "tool", "content": [{"type": "tool_result", "call_id": "call_1", "content": "18 C, sunny"}]},
        {
            "role": "tool",
            "content": [{"type": "tool_result", "call_id": "call_2", "content": "station offline", "is_error": True}],
        },
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ],
    "tools": [{"name": "get_weather", "description": "Current weather for a city.", "parameters": WEATHER_SCHEMA}],
    "tool_choice": "auto",
    "max_tokens": 512,
    "temperature": 0.2,
    "top_p": 0.9,
}


def req(data: dict[str, Any] | None = None, **changes: Any) -> GenerateRequest:
    return decode_request(msgspec.json.encode({**(data or SIMPLE), **changes}))


def build(dialect: str, request: GenerateRequest | None = None, **kw: Any) -> ProviderRequest:
    kw.setdefault("model", "gemini-2.5-flash" if dialect == "gemini" else "model-x")
    kw.setdefault("api_key", KEY)
    return build_request(dialect, request or req(), **kw)


def body(dialect: str, request: GenerateRequest | None = None, **kw: Any) -> dict[str, Any]:
    decoded: dict[str, Any] = msgspec.json.decode(build(dialect, request, **kw).body)
    return decoded


# ---------------------------------------------------------------------------------------------------
# Simple request: path, headers, body
# ---------------------------------------------------------------------------------------------------

SIMPLE_EXPECTED: dict[str, tuple[str, dict[str, str], dict[str, Any]]] = {
    "openai-chat": (
        "/v1/chat/completions",
        {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        {
            "model": "model-x",
            "messages": [{"role": "user", "content": "Hello"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "openai-responses": (
        "/v1/responses",
        {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
        {
            "model": "model-x",
            "input": [{"type": "message", "role": "user", "content": "Hello"}],
            "stream": True,
        },
    ),
    "anthropic": (
        "/v1/messages",
        {"content-type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": KEY},
        {
            "model": "model-x",
            "max_tokens": 4096,
            "messages": [{"role": "user", "content": "Hello"}],
            "stream": True,
        },
    ),
    "gemini": (
        "/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse",
        {"content-type": "application/json", "x-goog-api-key": KEY},
        {"contents": [{"role": "user", "parts": [{"text": "Hello"}]}]},
    ),
}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_simple_request(dialect: str) -> None:
    path, headers, expected = SIMPLE_EXPECTED[dialect]
    built = build(dialect)
    assert built.method == "POST"
    assert built.path == path
    assert dict(built.headers) == headers
    assert msgspec.json.decode(built.body) == expected


def test_every_dialect_has_a_builder() -> None:
    # bedrock-converse has its own module (tests/unit/test_requests_bedrock.py)
    assert tuple(BUILDERS) == (*DIALECTS, "bedrock-converse")


# ---------------------------------------------------------------------------------------------------
# Multi-turn conversation with a tool call and its result
# ---------------------------------------------------------------------------------------------------

CONVERSATION_EXPECTED: dict[str, dict[str, Any]] = {
    "openai-chat": {
        "model": "model-x",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Zürich and Oslo?"},
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Checking both."}],
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Zürich"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Oslo","unit":"C"}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "station offline"},
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather for a city.",
                    "parameters": WEATHER_SCHEMA,
                },
            }
        ],
        "tool_choice": "auto",
        "max_completion_tokens": 512,
        "temperature": 0.2,
        "top_p": 0.9,
        "stream": True,
        "stream_options": {"include_usage": True},
    },
    "openai-responses": {
        "model": "model-x",
        "instructions": "You are terse.",
        "input": [
            {"type": "message", "role": "user", "content": "Weather in Zürich and Oslo?"},
            {"type": "message", "role": "assistant", "content": "Checking both."},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Zürich"}'},
            {
                "type": "function_call",
                "call_id": "call_2",
                "name": "get_weather",
                "arguments": '{"city":"Oslo","unit":"C"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": "station offline"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And tomorrow?"}]},
        ],
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Current weather for a city.",
                "parameters": WEATHER_SCHEMA,
                "strict": False,
            }
        ],
        "tool_choice": "auto",
        "max_output_tokens": 512,
        "temperature": 0.2,
        "top_p": 0.9,
        "stream": True,
    },
    "anthropic": {
        "model": "model-x",
        "max_tokens": 512,
        "system": "You are terse.",
        "messages": [
            {"role": "user", "content": "Weather in Zürich and Oslo?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Checking both."},
                    {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Zürich"}},
                    {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {"city": "Oslo", "unit": "C"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "18 C, sunny", "is_error": False},
                    {"type": "tool_result", "tool_use_id": "call_2", "content": "station offline", "is_error": True},
                ],
            },
            {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
        ],
        "tools": [
            {"name": "get_weather", "description": "Current weather for a city.", "input_schema": WEATHER_SCHEMA}
        ],
        "tool_choice": {"type": "auto"},
        "temperature": 0.2,
        "top_p": 0.9,
        "stream": True,
    },
    "gemini": {
        "systemInstruction": {"parts": [{"text": "You are terse."}]},
        "contents": [
            {"role": "user", "parts": [{"text": "Weather in Zürich and Oslo?"}]},
            {
                "role": "model",
                "parts": [
                    {"text": "Checking both."},
                    {"functionCall": {"name": "get_weather", "args": {"city": "Zürich"}}},
                    {"functionCall": {"name": "get_weather", "args": {"city": "Oslo", "unit": "C"}}},
                ],
            },
            {
                "role": "user",
                "parts": [
                    {"functionResponse": {"name": "get_weather", "response": {"output": "18 C, sunny"}}},
                    {"functionResponse": {"name": "get_weather", "response": {"error": "station offline"}}},
                ],
            },
            {"role": "user", "parts": [{"text": "And tomorrow?"}]},
        ],
        "tools": [
            {
                "functionDeclarations": [
                    {
                        "name": "get_weather",
                        "description": "Current weather for a city.",
                        "parametersJsonSchema": WEATHER_SCHEMA,
                    }
                ]
            }
        ],
        "toolConfig": {"functionCallingConfig": {"mode": "AUTO"}},
        "generationConfig": {"maxOutputTokens": 512, "temperature": 0.2, "topP": 0.9},
    },
}


@pytest.mark.parametrize("dialect", DIALECTS)
def test_conversation_with_tool_call_and_result(dialect: str) -> None:
    assert body(dialect, req(CONVERSATION)) == CONVERSATION_EXPECTED[dialect]


def test_gemini_resolves_function_names_by_call_id() -> None:
    # Two different functions; results come back in the opposite order of the calls.
    request = GenerateRequest(
        messages=[
            Message(role="user", content="go"),
            Message(
                role="assistant",
                content=[
                    ToolCallPart(call_id="a", name="first", arguments={}),
                    ToolCallPart(call_id="b", name="second", arguments={"x": 1}, signature="sig-b"),
                ],
            ),
            Message(
                role="tool",
                content=[ToolResultPart(call_id="b", content="2"), ToolResultPart(call_id="a", content="1")],
            ),
        ],
    )
    assert body("gemini", request)["contents"][1:] == [
        {
            "role": "model",
            "parts": [
                {"functionCall": {"name": "first", "args": {}}},
                {"functionCall": {"name": "second", "args": {"x": 1}}, "thoughtSignature": "sig-b"},
            ],
        },
        {
            "role": "user",
            "parts": [
                {"functionResponse": {"name": "second", "response": {"output": "2"}}},
                {"functionResponse": {"name": "first", "response": {"output": "1"}}},
            ],
        },
    ]


def test_tool_results_merge_only_when_consecutive() -> None:
    # call, result, call, result: two separate user turns for Anthropic and Gemini.
    request = GenerateRequest(
        messages=[
            Message(role="user", content="go"),
            Message(role="assistant", content=[ToolCallPart(call_id="a", name="f")]),
            Message(role="tool", content=[ToolResultPart(call_id="a", content="1")]),
            Message(role="assistant", content=[ToolCallPart(call_id="b", name="f")]),
            Message(role="tool", content=[ToolResultPart(call_id="b", content="2")]),
        ],
    )
    assert [m["role"] for m in body("anthropic", request)["messages"]] == [
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert [m["role"] for m in body("gemini", request)["contents"]] == ["user", "model", "user", "model", "user"]
    # OpenAI: an assistant turn that only calls tools has null content.
    assert body("openai-chat", request)["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }


def test_assistant_string_content_and_user_text_parts() -> None:
    request = GenerateRequest(
        messages=[
            Message(role="user", content=[TextPart(text="a"), TextPart(text="b")]),
            Message(role="assistant", content="c"),
            Message(role="user", content="d"),
        ],
    )
    assert body("openai-chat", request)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    # Assistant text parts without tool calls: a content array and no tool_calls key.
    only_text = GenerateRequest(
        messages=[Message(role="user", content="q"), Message(role="assistant", content=[TextPart(text="t")])]
    )
    assert body("openai-chat", only_text)["messages"][1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "t"}],
    }
    assert body("openai-responses", request)["input"] == [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {"type": "message", "role": "assistant", "content": "c"},
        {"type": "message", "role": "user", "content": "d"},
    ]
    assert body("anthropic", request)["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": "d"},
    ]
    assert body("gemini", request)["contents"] == [
        {"role": "user", "parts": [{"text": "a"}, {"text": "b"}]},
        {"role": "model", "parts": [{"text": "c"}]},
        {"role": "user", "parts": [{"text": "d"}]},
    ]


def test_empty_system_and_empty_description_are_omitted() -> None:
    request = req(system="", tools=[{"name": "f"}])
    assert body("openai-chat", request)["messages"] == [{"role": "user", "content": "Hello"}]
    assert body("openai-chat", request)["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    assert "instructions" not in body("openai-responses", request)
    assert "system" not in body("anthropic", request)
    assert "systemInstruction" not in body("gemini", request)
    assert body("anthropic", request)["tools"] == [{"name": "f", "input_schema": {"type": "object", "properties": {}}}]


# ---------------------------------------------------------------------------------------------------
# Tool choice, stop, max tokens, reasoning
# ---------------------------------------------------------------------------------------------------

TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "openai-chat": {
        "auto": "auto",
        "none": "none",
        "required": "required",
        "named": {"type": "function", "function": {"name": "f"}},
    },
    "openai-responses": {
        "auto": "auto",
        "none": "none",
        "required": "required",
        "named": {"type": "function", "name": "f"},
    },
    "anthropic": {
        "auto": {"type": "auto"},
        "none": {"type": "none"},
        "required": {"type": "any"},
        "named": {"type": "tool", "name": "f"},
    },
    "gemini": {
        "auto": {"functionCallingConfig": {"mode": "AUTO"}},
        "none": {"functionCallingConfig": {"mode": "NONE"}},
        "required": {"functionCallingConfig": {"mode": "ANY"}},
        "named": {"functionCallingConfig": {"mode": "ANY", "allowedFunctionNames": ["f"]}},
    },
}


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("choice", ["auto", "none", "required", "named"])
def test_tool_choice(dialect: str, choice: str) -> None:
    value: Any = {"name": "f"} if choice == "named" else choice
    built = body(dialect, req(tools=[{"name": "f"}, {"name": "g"}], tool_choice=value))
    field = "toolConfig" if dialect == "gemini" else "tool_choice"
    assert built[field] == TOOL_CHOICES[dialect][choice]


@pytest.mark.parametrize("dialect", DIALECTS)
def test_tool_choice_without_tools_is_not_sent(dialect: str) -> None:
    built = body(dialect, req(tool_choice="none"))
    assert not {"tools", "tool_choice", "toolConfig"} & set(built)


@pytest.mark.parametrize(
    ("dialect", "expected"),
    [
        ("openai-chat", {"stop": ["END", "\n\n"]}),
        ("anthropic", {"stop_sequences": ["END", "\n\n"]}),
        ("gemini", {"generationConfig": {"stopSequences": ["END", "\n\n"]}}),
    ],
)
def test_stop(dialect: str, expected: dict[str, Any]) -> None:
    built = body(dialect, req(stop=["END", "\n\n"]))
    assert {key: built[key] for key in expected} == expected


def test_responses_refuses_stop() -> None:
    with pytest.raises(InvalidRequest, match="openai-responses has no stop sequences"):
        build("openai-responses", req(stop=["END"]))
    # An empty list asks for nothing.
    assert "stop" not in body("openai-responses", req(stop=[]))


def test_openai_chat_max_tokens_field() -> None:
    assert body("openai-chat", req(max_tokens=64))["max_completion_tokens"] == 64
    legacy = body("openai-chat", req(max_tokens=64), max_tokens_field="max_tokens")
    assert legacy["max_tokens"] == 64
    assert "max_completion_tokens" not in legacy
    with pytest.raises(ConfigError, match="max_tokens_field must be one of"):
        build("openai-chat", max_tokens_field="max_new_tokens")


def test_openai_chat_stream_options_can_be_left_out() -> None:
    assert body("openai-chat", req())["stream_options"] == {"include_usage": True}
    assert body("openai-chat", req(), stream_options="include_usage")["stream_options"] == {"include_usage": True}
    omitted = body("openai-chat", req(), stream_options="omit")
    assert "stream_options" not in omitted and omitted["stream"] is True
    # extra still merges last: a route that omits the field can still have a job ask for something else
    assert body("openai-chat", req(extra={"stream_options": {"x": 1}}), stream_options="omit")["stream_options"] == {
        "x": 1
    }
    with pytest.raises(ConfigError, match="stream_options must be one of include_usage, omit"):
        build("openai-chat", stream_options="none")


@pytest.mark.parametrize("dialect", ["openai-responses", "anthropic", "gemini"])
@pytest.mark.parametrize("option", ["max_tokens_field", "stream_options"])
def test_options_are_per_dialect(dialect: str, option: str) -> None:
    with pytest.raises(ConfigError, match="unknown request option"):
        build(dialect, **{option: "max_tokens"})


@pytest.mark.parametrize(
    ("reasoning", "max_tokens", "expected"),
    [
        ({"effort": "low"}, None, {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        ({"effort": "medium"}, None, {"max_tokens": 12288, "thinking": {"type": "enabled", "budget_tokens": 8192}}),
        ({"effort": "high"}, None, {"max_tokens": 28672, "thinking": {"type": "enabled", "budget_tokens": 24576}}),
        ({"budget_tokens": 2000}, None, {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2000}}),
        ({"budget_tokens": 4096}, None, {"max_tokens": 8192, "thinking": {"type": "enabled", "budget_tokens": 4096}}),
        # budget_tokens wins over effort; an explicit max_tokens is kept as given.
        (
            {"effort": "high", "budget_tokens": 3000},
            20000,
            {"max_tokens": 20000, "thinking": {"type": "enabled", "budget_tokens": 3000}},
        ),
        ({"budget_tokens": 0}, None, {"max_tokens": 4096}),
    ],
)
def test_anthropic_thinking(reasoning: dict[str, Any], max_tokens: int | None, expected: dict[str, Any]) -> None:
    built = body("anthropic", req(reasoning=reasoning, max_tokens=max_tokens))
    assert {key: built[key] for key in ("max_tokens", "thinking") if key in built} == expected


@pytest.mark.parametrize(
    ("reasoning", "expected"),
    [
        ({"effort": "low"}, {"thinkingBudget": 1024, "includeThoughts": True}),
        ({"effort": "high"}, {"thinkingBudget": 24576, "includeThoughts": True}),
        ({"budget_tokens": 512}, {"thinkingBudget": 512, "includeThoughts": True}),
        ({"budget_tokens": 0}, {"thinkingBudget": 0}),
    ],
)
def test_gemini_thinking(reasoning: dict[str, Any], expected: dict[str, Any]) -> None:
    assert body("gemini", req(reasoning=reasoning))["generationConfig"] == {"thinkingConfig": expected}


def test_openai_reasoning_effort() -> None:
    assert body("openai-chat", req(reasoning={"effort": "high"}))["reasoning_effort"] == "high"
    assert body("openai-responses", req(reasoning={"effort": "low", "budget_tokens": 99}))["reasoning"] == {
        "effort": "low"
    }


@pytest.mark.parametrize("dialect", ["openai-chat", "openai-responses"])
def test_openai_refuses_budget_only_reasoning(dialect: str) -> None:
    with pytest.raises(InvalidRequest, match=f"{dialect} takes reasoning.effort"):
        build(dialect, req(reasoning={"budget_tokens": 2048}))


# ---------------------------------------------------------------------------------------------------
# extra: RFC 7396 merge, last
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("target", "patch", "result"),
    [
        # RFC 7396, Appendix A (the rows that apply to JSON objects and values).
        ({"a": "b"}, {"a": "c"}, {"a": "c"}),
        ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
        ({"a": "b"}, {"a": None}, {}),
        ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
        ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
        ({"a": "c"}, {"a": ["b"]}, {"a": ["b"]}),
        ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
        ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
        (["a", "b"], ["c", "d"], ["c", "d"]),
        ({"a": "b"}, ["c"], ["c"]),
        ({"a": "foo"}, None, None),
        ({"a": "foo"}, "bar", "bar"),
        ({"e": None}, {"a": 1}, {"e": None, "a": 1}),
        ([1, 2], {"a": "b", "c": None}, {"a": "b"}),
        ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ],
)
def test_merge_patch_rfc7396(target: Any, patch: Any, result: Any) -> None:
    before = msgspec.json.encode(target)
    assert merge_patch(target, patch) == result
    assert msgspec.json.encode(target) == before  # never mutates its input


def test_extra_merges_into_nested_objects() -> None:
    request = req(
        reasoning={"effort": "medium"},
        extra={"reasoning": {"summary": "auto"}, "store": False, "metadata": {"team": "a"}},
    )
    built = body("openai-responses", request)
    assert built["reasoning"] == {"effort": "medium", "summary": "auto"}
    assert built["store"] is False
    assert built["metadata"] == {"team": "a"}


def test_extra_null_deletes_and_lists_replace() -> None:
    request = req(
        max_tokens=64,
        stop=["A"],
        extra={"max_completion_tokens": None, "max_tokens": 64, "stop": ["B"], "stream_options": None},
    )
    assert body("openai-chat", request) == {
        "model": "model-x",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 64,
        "stop": ["B"],
        "stream": True,
    }


def test_extra_gemini_generation_config_and_safety() -> None:
    safety = [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}]
    request = req(temperature=0.5, extra={"generationConfig": {"topK": 40}, "safetySettings": safety})
    assert body("gemini", request) == {
        "contents": [{"role": "user", "parts": [{"text": "Hello"}]}],
        "generationConfig": {"temperature": 0.5, "topK": 40},
        "safetySettings": safety,
    }


def test_extra_anthropic_tool_choice_field() -> None:
    request = req(tools=[{"name": "f"}], tool_choice="auto", extra={"tool_choice": {"disable_parallel_tool_use": True}})
    assert body("anthropic", request)["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True}


@pytest.mark.parametrize("dialect", ["openai-chat", "openai-responses", "anthropic"])
@pytest.mark.parametrize("stream", [False, None, "yes"])
def test_extra_cannot_turn_streaming_off(dialect: str, stream: Any) -> None:
    with pytest.raises(InvalidRequest, match="cannot turn streaming off"):
        build(dialect, req(extra={"stream": stream}))


def test_extra_cannot_ask_for_several_choices() -> None:
    with pytest.raises(InvalidRequest, match="n > 1 is not supported"):
        build("openai-chat", req(extra={"n": 2}))
    assert body("openai-chat", req(extra={"n": 1}))["n"] == 1
    with pytest.raises(InvalidRequest, match="candidateCount > 1 is not supported"):
        build("gemini", req(extra={"generationConfig": {"candidateCount": 3}}))
    assert body("gemini", req(extra={"generationConfig": {"candidateCount": 1}}))["generationConfig"] == {
        "candidateCount": 1
    }


# ---------------------------------------------------------------------------------------------------
# Headers and secrets
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
@pytest.mark.parametrize("api_key", [None, ""])
def test_no_key_no_auth_header(dialect: str, api_key: str | None) -> None:
    headers = dict(build(dialect, api_key=api_key).headers)
    assert not {"authorization", "x-api-key", "x-goog-api-key"} & set(headers)


def test_route_headers_add_and_override_case_insensitively() -> None:
    built = build(
        "anthropic",
        extra_headers={"Anthropic-Version": "2024-01-01", "anthropic-beta": "interleaved-thinking-2025-05-14"},
    )
    assert dict(built.headers) == {
        "content-type": "application/json",
        "x-api-key": KEY,
        "anthropic-version": "2024-01-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14",
    }
    openrouter = build("openai-chat", extra_headers={"HTTP-Referer": "https://example.org", "X-Title": "demo"})
    assert dict(openrouter.headers) == {
        "content-type": "application/json",
        "authorization": f"Bearer {KEY}",
        "http-referer": "https://example.org",
        "x-title": "demo",
    }


@pytest.mark.parametrize("name", ["Authorization", "x-api-key", "X-Goog-Api-Key", "api-key", "Cookie"])
def test_route_headers_cannot_carry_credentials(name: str) -> None:
    with pytest.raises(ConfigError, match="carries credentials") as caught:
        build("openai-chat", extra_headers={name: "sk-route-secret"})
    assert "sk-route-secret" not in str(caught.value)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_repr_never_shows_the_key_or_the_prompt(dialect: str) -> None:
    built = build(dialect, req(CONVERSATION), extra_headers={"x-trace": "visible"})
    for text in (repr(built), str(built), f"{built}", repr([built])):
        assert KEY not in text
        assert "Zürich" not in text
        assert "You are terse" not in text
        assert "<redacted>" in text
        assert "visible" in text
        assert built.path in text
    assert f"body=<{len(built.body)} bytes>" in repr(built)


def test_url_joins_base_url_and_path() -> None:
    built = build("gemini")
    expected = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:streamGenerateContent?alt=sse"
    assert built.url("https://generativelanguage.googleapis.com/") == expected
    assert build("openai-chat").url("https://openrouter.ai/api") == "https://openrouter.ai/api/v1/chat/completions"


# ---------------------------------------------------------------------------------------------------
# Model placement
# ---------------------------------------------------------------------------------------------------


def test_gemini_model_goes_in_the_path_only() -> None:
    built = build("gemini", model="models/gemini-2.5-pro")
    assert built.path == "/v1beta/models/gemini-2.5-pro:streamGenerateContent?alt=sse"
    assert b"gemini-2.5-pro" not in built.body


def test_gemini_parameterised_model_is_percent_encoded() -> None:
    built = build("gemini", model="synthetic;deltas=3:x")
    assert built.path == "/v1beta/models/synthetic%3Bdeltas%3D3%3Ax:streamGenerateContent?alt=sse"


@pytest.mark.parametrize("model", ["../files", "a/b", "models/", "x?alt=json", "x#y", "gemini 2", "-x"])
def test_gemini_refuses_a_model_that_is_not_a_plain_name(model: str) -> None:
    with pytest.raises(InvalidRequest, match="a model name is letters"):
        build("gemini", model=model)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_a_model_is_required(dialect: str) -> None:
    with pytest.raises(InvalidRequest, match="no model"):
        build(dialect, model="")


def test_unknown_dialect() -> None:
    with pytest.raises(UnknownDialect, match="unknown dialect 'cohere'"):
        build("cohere")


# ---------------------------------------------------------------------------------------------------
# Purity
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dialect", DIALECTS)
def test_building_is_pure(dialect: str) -> None:
    request = req(CONVERSATION, extra={"metadata": {"k": "v"}})
    before = encode_request(request)
    first, second = build(dialect, request), build(dialect, request)
    assert first == second
    assert encode_request(request) == before


# ---------------------------------------------------------------------------------------------------
# The request shape: decoding and validation
# ---------------------------------------------------------------------------------------------------


def test_shape_round_trips() -> None:
    request = req(CONVERSATION, tool_choice={"name": "get_weather"}, reasoning={"effort": "low"}, stop=["x"])
    assert decode_request(encode_request(request)) == request
    assert request.tool_choice == NamedToolChoice(name="get_weather")
    assert request.reasoning == Reasoning(effort="low")
    assert request.messages[3].content == [ToolResultPart(call_id="call_2", content="station offline", is_error=True)]
    assert request.tools == [
        Tool(name="get_weather", description="Current weather for a city.", parameters=WEATHER_SCHEMA)
    ]


def test_invalid_request_is_a_job_error() -> None:
    assert issubclass(InvalidRequest, JobError)
    assert InvalidRequest.code == "invalid_request"
    assert InvalidRequest.category == "invalid_request"
    assert not InvalidRequest.retryable


def _call(call_id: str = "c1") -> dict[str, Any]:
    return {"role": "assistant", "content": [{"type": "tool_call", "call_id": call_id, "name": "f"}]}


def _result(call_id: str = "c1") -> dict[str, Any]:
    return {"role": "tool", "content": [{"type": "tool_result", "call_id": call_id, "content": "ok"}]}


USER = {"role": "user", "content": "hi"}

INVALID: list[tuple[dict[str, Any], str]] = [
    ({"messages": []}, "messages is empty"),
    ({"messages": [{"role": "tool", "content": "42"}]}, "tool messages carry tool_result parts, not a string"),
    ({"messages": [{"role": "user", "content": []}]}, "user message content is an empty list"),
    (
        {"messages": [{"role": "user", "content": [{"type": "tool_call", "call_id": "c", "name": "f"}]}]},
        "user messages cannot carry tool_call parts",
    ),
    (
        {"messages": [USER, _call(), _result(), {**_result(), "role": "assistant"}]},
        "assistant messages cannot carry tool_result parts",
    ),
    (
        {"messages": [USER, {"role": "tool", "content": [{"type": "text", "text": "x"}]}]},
        "tool messages cannot carry text parts",
    ),
    ({"messages": [USER, _result("nope")]}, "tool result for 'nope' answers no earlier tool call"),
    ({"messages": [USER, _result(), _call()]}, "answers no earlier tool call"),
    ({"messages": [USER, _call(), _result(), _call()]}, "tool call id 'c1' is reused"),
    ({"messages": [USER, _call(), _result(), _result()]}, "tool call 'c1' answered twice"),
    ({"messages": [USER], "tools": [{"name": "f"}, {"name": "f"}]}, "tool names are not unique"),
    ({"messages": [USER], "tools": [{"name": "get weather"}]}, "matching regex"),
    ({"messages": [USER], "tools": [{"name": "1st"}]}, "matching regex"),
    ({"messages": [USER], "tools": [{"name": "x" * 65}]}, "matching regex"),
    ({"messages": [USER], "tool_choice": "required"}, 'tool_choice "required" needs tools'),
    ({"messages": [USER], "tools": [{"name": "f"}], "tool_choice": {"name": "g"}}, "names 'g', which is not"),
    ({"messages": [USER], "tool_choice": "any"}, "Invalid enum value 'any'"),
    ({"messages": [USER], "reasoning": {}}, "reasoning needs effort, budget_tokens or include_encrypted"),
    ({"messages": [USER], "reasoning": {"effort": "max"}}, "Invalid enum value 'max'"),
    ({"messages": [USER], "reasoning": {"budget_tokens": -1}}, ">= 0"),
    ({"messages": [USER], "max_tokens": 0}, ">= 1"),
    ({"messages": [USER], "temperature": -0.1}, ">= 0"),
    ({"messages": [USER], "top_p": 1.5}, "<= 1"),
    ({"messages": [USER], "seed": 1}, "unknown field `seed`"),
    ({"messages": [{"role": "system", "content": "x"}]}, "Invalid enum value 'system'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x"}]}]}, "Invalid value 'image'"),
    ({"messages": [USER, {**_call(), "content": [{"type": "tool_call", "call_id": "", "name": "f"}]}]}, "length >= 1"),
]


@pytest.mark.parametrize(("data", "message"), INVALID)
def test_invalid_requests_are_refused_with_a_clear_message(data: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRequest, match="invalid request") as caught:
        decode_request(msgspec.json.encode(data))
    assert message in str(caught.value)


def test_invalid_json_is_an_invalid_request() -> None:
    with pytest.raises(InvalidRequest, match="invalid request: Input data was truncated"):
        decode_request(b'{"messages": [')


def test_validation_also_runs_when_built_in_python() -> None:
    with pytest.raises(InvalidRequest, match="messages is empty"):
        GenerateRequest(messages=[])
    with pytest.raises(InvalidRequest, match="tool messages carry tool_result parts, not a string"):
        Message(role="tool", content="x")
    with pytest.raises(InvalidRequest, match="reasoning needs effort, budget_tokens or include_encrypted"):
        Reasoning()
    with pytest.raises(InvalidRequest, match="answers no earlier tool call"):
        GenerateRequest(messages=[Message(role="tool", content=[ToolResultPart(call_id="x", content="")])])


ANSWER_FORMAT = {"name": "weather", "description": "the forecast", "schema": WEATHER_SCHEMA, "strict": True}


@pytest.mark.parametrize(
    ("dialect", "where", "expected"),
    [
        (
            "openai-chat",
            "response_format",
            {"type": "json_schema", "json_schema": {**ANSWER_FORMAT}},
        ),
        ("openai-responses", "text", {"format": {"type": "json_schema", **ANSWER_FORMAT}}),
        ("anthropic", "output_config", {"format": {"type": "json_schema", "schema": WEATHER_SCHEMA}}),
        (
            "gemini",
            "generationConfig",
            {"responseMimeType": "application/json", "responseJsonSchema": WEATHER_SCHEMA},
        ),
        (
            "bedrock-converse",
            "outputConfig",
            {
                "textFormat": {
                    "type": "json_schema",
                    "structure": {
                        "jsonSchema": {
                            "schema": msgspec.json.encode(WEATHER_SCHEMA).decode(),
                            "name": "weather",
                            "description": "the forecast",
                        }
                    },
                }
            },
        ),
    ],
)
def test_response_format_goes_where_each_dialect_reads_a_json_schema_answer(
    dialect: str, where: str, expected: dict[str, Any]
) -> None:
    sent = body(dialect, req(SIMPLE, response_format=ANSWER_FORMAT))
    assert sent[where] == expected
    assert where not in body(dialect, req(SIMPLE))


def test_response_format_names_like_a_tool() -> None:
    with pytest.raises(InvalidRequest, match=r"response_format\.name"):
        decode_request(msgspec.json.encode({**SIMPLE, "response_format": {"name": "a b", "schema": {}}}))
