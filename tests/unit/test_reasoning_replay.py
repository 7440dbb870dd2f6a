"""Reasoning across turns: a result becomes the assistant message of the next request (``Result.as_message``)
and each dialect's builder sends its own reasoning back in the exact wire shape its provider documents;
reasoning made by another dialect is left out with a warning, never sent where it is invalid.

Expected bodies are written from the providers' documentation: Anthropic ``thinking`` {thinking,
signature} and ``redacted_thinking`` {data} blocks in the assistant turn; an OpenAI Responses
``reasoning`` input item {summary, encrypted_content} (stateless, no ``rs_`` id) with ``include:
["reasoning.encrypted_content"]`` when asked; Gemini parts with their ``thoughtSignature``.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from sluice.normalizer.requests import build_request
from sluice.schemas.request import (
    GenerateRequest,
    InvalidRequest,
    Message,
    Reasoning,
    ReasoningPart,
    TextPart,
    ToolCallPart,
    ToolResultPart,
    decode_request,
    encode_request,
)
from sluice.schemas.result import Result, ResultBlock
from tests.helpers import TRANSCRIPTS, run

USER = Message(role="user", content="Where is order A-1042?")
DIALECTS = ("anthropic", "openai-chat", "openai-responses", "gemini")


def result_of(case: str) -> Result:
    dialect = case.partition("/")[0]
    result = run(dialect, (TRANSCRIPTS / f"{case}.sse").read_bytes())[2]
    assert result.status == "completed" and result.dialect == dialect
    return result


def next_turn(result: Result, **kw: Any) -> GenerateRequest:
    """The conversation continued: the user's question, the assistant's turn, the tool results."""
    message = result.as_message()
    results = [ToolResultPart(call_id=c.call_id, content="shipped") for c in result.tool_calls]
    return GenerateRequest(messages=[USER, message, Message(role="tool", content=results)], **kw)


def body(dialect: str, req: GenerateRequest) -> tuple[dict[str, Any], tuple[str, ...]]:
    built = build_request(dialect, req, model="m", api_key="k")
    return json.loads(built.body), built.warnings


# -- each dialect takes its own reasoning back ------------------------------------------------------


def test_anthropic_thinking_and_redacted_thinking_go_back_signed() -> None:
    req = next_turn(result_of("anthropic/thinking_tool_use"), reasoning=Reasoning(budget_tokens=2048))
    sent, warnings = body("anthropic", req)
    assert warnings == ()
    assert sent["messages"][1] == {
        "role": "assistant",
        "content": [
            {
                "type": "thinking",
                "thinking": "The user wants the order status.",
                "signature": "EpUBCkYIBRgCKkDthink1==",
            },
            {"type": "redacted_thinking", "data": "EmwKAhgBEgyRedacted2=="},
            {"type": "tool_use", "id": "toolu_01K", "name": "lookup_order", "input": {"order_id": "A-1042"}},
        ],
    }
    assert sent["messages"][2] == {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_01K", "content": "shipped", "is_error": False}],
    }


def test_responses_reasoning_item_goes_back_with_its_encrypted_content() -> None:
    req = next_turn(
        result_of("openai-responses/reasoning_encrypted_function_call"),
        reasoning=Reasoning(effort="medium", include_encrypted=True),
    )
    sent, warnings = body("openai-responses", req)
    assert warnings == ()
    assert sent["include"] == ["reasoning.encrypted_content"]
    assert sent["reasoning"] == {"effort": "medium"}
    assert sent["input"][1:] == [
        {
            "type": "reasoning",
            "summary": [
                {"type": "summary_text", "text": "**Looking the order up**"},
                {"type": "summary_text", "text": "I need the order id."},
            ],
            "encrypted_content": "gAAAAABpFinalEncrypted==",
        },
        {"type": "function_call", "call_id": "call_enc1", "name": "lookup_order", "arguments": '{"order_id":"A-1042"}'},
        {"type": "function_call_output", "call_id": "call_enc1", "output": "shipped"},
    ]


def test_gemini_signatures_stay_on_their_parts() -> None:
    req = next_turn(result_of("gemini/thought_signatures_function_call"))
    sent, warnings = body("gemini", req)
    assert warnings == ()
    assert sent["contents"][1] == {
        "role": "model",
        "parts": [
            {"text": "**Finding the order**\nI should look it up.", "thought": True},
            {"text": "Let me check.", "thoughtSignature": "CiQBtextSig=="},
            {
                "functionCall": {"name": "lookup_order", "args": {"order_id": "A-1042"}},
                "thoughtSignature": "CiQBcallSig==",
            },
            {"functionCall": {"name": "lookup_order", "args": {"order_id": "B-7"}}},  # parallel: only the first signed
        ],
    }
    assert sent["contents"][2] == {
        "role": "user",
        "parts": [
            {"functionResponse": {"name": "lookup_order", "response": {"output": "shipped"}}},
            {"functionResponse": {"name": "lookup_order", "response": {"output": "shipped"}}},
        ],
    }


def test_the_message_survives_the_job_json() -> None:
    for case in (
        "anthropic/thinking_tool_use",
        "openai-responses/reasoning_encrypted_function_call",
        "gemini/thought_signatures_function_call",
    ):
        req = next_turn(result_of(case))
        assert decode_request(encode_request(req)) == req


# -- moving between dialects ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "origin"),
    [
        ("anthropic/thinking_tool_use", "anthropic"),
        ("openai-responses/reasoning_encrypted_function_call", "openai-responses"),
        ("gemini/thought_signatures_function_call", "gemini"),
    ],
)
@pytest.mark.parametrize("target", DIALECTS)
def test_reasoning_from_another_dialect_is_left_out_with_a_warning(case: str, origin: str, target: str) -> None:
    req = next_turn(result_of(case), reasoning=Reasoning(effort="low", include_encrypted=True))
    sent, warnings = body(target, req)
    text = json.dumps(sent)
    signatures = ("EpUBCkYIBRgCKkDthink1==", "EmwKAhgBEgyRedacted2==", "gAAAAABpFinalEncrypted==", "CiQB")
    if target == origin:
        assert warnings == ()
        return
    assert warnings and all(w.startswith("messages[1]: reasoning") for w in warnings)
    assert not any(s in text for s in signatures)  # never sent where it means nothing
    # The rest of the turn is still there: the tool calls and their results.
    for call in req.messages[1].content:
        if isinstance(call, ToolCallPart):
            assert call.name in text


def test_gemini_keeps_a_call_signature_that_came_from_gemini_only() -> None:
    req = next_turn(result_of("anthropic/thinking_tool_use"))
    sent, _ = body("gemini", req)
    assert sent["contents"][1] == {
        "role": "model",
        "parts": [{"functionCall": {"name": "lookup_order", "args": {"order_id": "A-1042"}}}],
    }


def test_a_message_left_with_nothing_is_left_out() -> None:
    only = Message(role="assistant", content=[ReasoningPart(dialect="gemini", text="thinking", signature="s")])
    req = GenerateRequest(messages=[USER, only, Message(role="user", content="and?")])
    for target in ("anthropic", "openai-chat"):
        sent, warnings = body(target, req)
        assert [m["role"] for m in sent["messages"]] == ["user", "user"]
        assert warnings[-1] == f"messages[1]: left out, nothing in it is for {target}"
    sent, warnings = body("openai-responses", req)
    assert [item.get("role") for item in sent["input"]] == ["user", "user"]


# -- what a dialect cannot take back, even its own ---------------------------------------------------


def test_anthropic_thinking_without_its_signature_is_left_out() -> None:
    msg = Message(role="assistant", content=[ReasoningPart(dialect="anthropic", text="hmm"), TextPart(text="Hi")])
    sent, warnings = body("anthropic", GenerateRequest(messages=[USER, msg]))
    assert sent["messages"][1]["content"] == [{"type": "text", "text": "Hi"}]
    assert warnings == ("messages[1]: thinking without its signature left out (Anthropic refuses it)",)


def test_responses_reasoning_without_encrypted_content_is_left_out() -> None:
    msg = Message(
        role="assistant", content=[ReasoningPart(dialect="openai-responses", summary=["s"]), TextPart(text="Hi")]
    )
    sent, warnings = body("openai-responses", GenerateRequest(messages=[USER, msg]))
    assert sent["input"][1:] == [{"type": "message", "role": "assistant", "content": "Hi"}]
    assert "include_encrypted" in warnings[0]


def test_responses_raw_reasoning_text_goes_back_as_content() -> None:
    part = ReasoningPart(dialect="openai-responses", text="raw thought", encrypted="enc")
    sent, _ = body("openai-responses", GenerateRequest(messages=[USER, Message(role="assistant", content=[part])]))
    assert sent["input"][1] == {
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "raw thought"}],
        "encrypted_content": "enc",
    }


def test_chat_completions_has_no_place_for_reasoning() -> None:
    msg = Message(role="assistant", content=[ReasoningPart(dialect="openai-chat", text="r"), TextPart(text="Hi")])
    sent, warnings = body("openai-chat", GenerateRequest(messages=[USER, msg]))
    assert sent["messages"][1] == {"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}
    assert warnings == ("messages[1]: reasoning left out (openai-chat has no place for it)",)


@pytest.mark.parametrize("dialect", DIALECTS)
def test_include_encrypted_alone_asks_only_responses_for_anything(dialect: str) -> None:
    sent, _ = body(dialect, GenerateRequest(messages=[USER], reasoning=Reasoning(include_encrypted=True)))
    assert ("include" in sent) == (dialect == "openai-responses")
    assert not {"reasoning", "reasoning_effort", "thinking"} & set(sent)
    assert "thinkingConfig" not in sent.get("generationConfig", {})


# -- the request shape --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (
            {"role": "user", "content": [{"type": "reasoning", "dialect": "anthropic", "text": "x"}]},
            "user messages cannot carry reasoning parts",
        ),
        (
            {"role": "assistant", "content": [{"type": "reasoning", "dialect": "anthropic"}]},
            "a reasoning part carries no text, summary, signature or encrypted payload",
        ),
        ({"role": "assistant", "content": [{"type": "reasoning", "dialect": "", "text": "x"}]}, "dialect"),
        (
            {"role": "user", "content": [{"type": "text", "text": "x", "signature": "s"}]},
            "user messages cannot carry signatures",
        ),
    ],
)
def test_the_shape_refuses_misplaced_or_empty_reasoning(message: dict[str, Any], error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        decode_request(json.dumps({"messages": [message]}))


# -- Result accessors ---------------------------------------------------------------------------------


def test_text_and_tool_calls() -> None:
    result = result_of("gemini/thought_signatures_function_call")
    assert result.text == "Let me check."  # reasoning is not the answer's text
    assert [(c.name, c.call_id, c.arguments, c.signature) for c in result.tool_calls] == [
        ("lookup_order", "call_req_t:1_2", {"order_id": "A-1042"}, "CiQBcallSig=="),
        ("lookup_order", "call_req_t:1_3", {"order_id": "B-7"}, None),
    ]


def test_a_cut_call_is_neither_a_tool_call_nor_in_the_message() -> None:
    result = result_of("anthropic/max_tokens_in_tool_json")
    assert result.tool_calls == []
    assert result.as_message() == Message(role="assistant", content=[TextPart(text="I'll write the file.")])


def test_only_a_completed_result_continues_a_conversation() -> None:
    failed = run("gemini", (TRANSCRIPTS / "gemini/unframed_error_tail.sse").read_bytes())[2]
    assert failed.tool_calls == [] and failed.text == "The capital of France is"
    with pytest.raises(ValueError, match="this one is failed"):
        failed.as_message()
    with pytest.raises(ValueError, match="nothing to send back"):
        Result(status="completed", dialect="anthropic").as_message()


def test_chat_reasoning_is_not_carried_into_the_message() -> None:
    result = run("openai-chat", (TRANSCRIPTS / "openai-chat/deepseek_reasoning.sse").read_bytes())[2]
    message = result.as_message()
    assert all(isinstance(p, TextPart) for p in message.content)


def test_a_refusal_goes_back_as_text() -> None:
    result = Result(
        status="completed",
        dialect="openai-responses",
        blocks=[ResultBlock(index=0, kind="refusal", text="I can't help with that.")],
    )
    assert result.as_message().content == [TextPart(text="I can't help with that.")]


def test_result_json_round_trips_with_the_new_fields() -> None:
    result = result_of("openai-responses/reasoning_encrypted_function_call")
    assert msgspec.json.decode(msgspec.json.encode(result), type=Result) == result
