"""The official SDKs' own stream decoding and accumulation, driven on recorded bytes without a network.

Rule: each driver builds the SDK's response object over an iterator of the benchmark's chunks and runs
the SDK classes its ``.stream()`` helper would run (``anthropic``: ``Stream`` + ``MessageStream`` with
``accumulate_event``; ``openai``: ``Stream`` + ``ChatCompletionStream`` / ``ResponseStream``, i.e.
``ChatCompletionStreamState`` / ``ResponseStreamState``) to the end, then takes the final accumulated
message. No request is built or sent: only decode + accumulation is measured. The SDKs are optional
(the ``bench`` extra); a missing one makes its driver ``None``, never an error.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import Any, cast

__all__ = ["SDK_NAMES", "SdkDriver", "sdk_driver", "sdk_versions"]

#: dialect -> the SDK path measured for it (Gemini: none requested)
SDK_NAMES: dict[str, str] = {
    "anthropic": "anthropic MessageStream",
    "openai-chat": "openai ChatCompletionStream",
    "openai-responses": "openai ResponseStream",
    "bedrock-converse": "botocore EventStream",
}

#: one stream's chunks -> (events the SDK yielded, the final text, each tool call's arguments: parsed or text)
SdkDriver = Callable[[Iterable[bytes]], tuple[int, str, list[Any]]]


def sdk_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("anthropic", "openai", "botocore"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            out[name] = None
    return out


def _http_module(streaming_module: Any) -> Any:
    # The SDKs moved from httpx to the httpx2 fork; use whichever the installed SDK itself imports.
    mod = getattr(streaming_module, "httpx2", None) or getattr(streaming_module, "httpx", None)
    if mod is None:  # pragma: no cover - an SDK layout this harness does not know
        raise ImportError("cannot find the SDK's HTTP library")
    return mod


def _response(http: Any, url: str, chunks: Iterable[bytes]) -> Any:
    return http.Response(
        200,
        headers={"content-type": "text/event-stream"},
        content=iter(chunks),
        request=http.Request("POST", url),
    )


def _anthropic() -> SdkDriver | None:
    try:
        import anthropic
        from anthropic import _streaming
        from anthropic.lib.streaming import MessageStream
        from anthropic.types import RawMessageStreamEvent
    except ImportError:
        return None
    http = _http_module(_streaming)
    # A client only supplies the SSE decoder and the response-data parser; nothing is sent.
    client = anthropic.Anthropic(api_key="bench-no-network", base_url="http://127.0.0.1:9", max_retries=0)
    not_given = getattr(anthropic, "NOT_GIVEN", None) or anthropic.not_given
    url = "http://127.0.0.1:9/v1/messages"

    def run(chunks: Iterable[bytes]) -> tuple[int, str, list[Any]]:
        raw: Any = _streaming.Stream(
            cast_to=cast(Any, RawMessageStreamEvent), response=_response(http, url, chunks), client=client
        )
        stream = MessageStream(raw, output_format=not_given)
        n = 0
        for _ in stream:
            n += 1
        message = stream.get_final_message()
        text = "".join(b.text for b in message.content if b.type == "text")
        tools = [b.input for b in message.content if b.type == "tool_use"]
        return n, text, tools

    return run


def _openai_setup(openai: Any, streaming: Any) -> tuple[Any, Any, Any]:
    """The SDK's HTTP module, a client that never reaches the network, and its "not given" marker."""
    client = openai.OpenAI(api_key="bench-no-network", base_url="http://127.0.0.1:9/v1", max_retries=0)
    return _http_module(streaming), client, getattr(openai, "omit", None) or openai.NOT_GIVEN


def _openai_chat() -> SdkDriver | None:
    try:
        import openai
        from openai import _streaming
        from openai.lib.streaming.chat import ChatCompletionStream
        from openai.types.chat import ChatCompletionChunk
    except ImportError:
        return None
    http, client, omit = _openai_setup(openai, _streaming)
    url = "http://127.0.0.1:9/v1/chat/completions"

    def run(chunks: Iterable[bytes]) -> tuple[int, str, list[Any]]:
        raw: Any = _streaming.Stream(cast_to=ChatCompletionChunk, response=_response(http, url, chunks), client=client)
        stream = ChatCompletionStream(raw_stream=raw, response_format=omit, input_tools=omit)
        n = 0
        for _ in stream:
            n += 1
        # The accumulated snapshot: get_final_completion() refuses a finish_reason "length" stream.
        message = stream.current_completion_snapshot.choices[0].message
        calls = message.tool_calls or []
        # Arguments stay text: the SDK parses them only for tools declared strict, which we do not declare.
        return n, message.content or "", [c.function.arguments for c in calls]

    return run


def _openai_responses() -> SdkDriver | None:
    try:
        import openai
        from openai import _streaming
        from openai.lib.streaming.responses import ResponseStream
        from openai.types.responses import ResponseStreamEvent
    except ImportError:
        return None
    http, client, omit = _openai_setup(openai, _streaming)
    url = "http://127.0.0.1:9/v1/responses"

    def run(chunks: Iterable[bytes]) -> tuple[int, str, list[Any]]:
        raw: Any = _streaming.Stream(
            cast_to=cast(Any, ResponseStreamEvent), response=_response(http, url, chunks), client=client
        )
        stream = ResponseStream(raw_stream=raw, text_format=omit, input_tools=omit, starting_after=None)
        n = 0
        last = None
        for last in stream:  # noqa: B007 - the last event is read after the loop
            n += 1
        # get_final_response() only knows response.completed; an incomplete one carries its own response.
        incomplete = last is not None and last.type == "response.incomplete"
        response: Any = last.response if incomplete else stream.get_final_response()  # type: ignore[union-attr]
        messages = [item for item in response.output if item.type == "message"]
        text = "".join(c.text for item in messages for c in item.content if c.type == "output_text")
        tools = [item.arguments for item in response.output if item.type == "function_call"]
        return n, text, tools

    return run


def _botocore_converse() -> SdkDriver | None:
    """What boto3's ``converse_stream`` iterates: botocore's ``EventStream`` over the service model's
    ``ConverseStreamOutput`` union with its event-stream JSON parser (CRCs checked, every event parsed to
    a dict), and the message accumulated from the deltas as a caller must."""
    try:
        import botocore.eventstream
        import botocore.parsers
        import botocore.session
    except ImportError:
        return None
    operation = botocore.session.get_session().get_service_model("bedrock-runtime").operation_model("ConverseStream")
    shape = operation.output_shape.members["stream"]
    parser = botocore.parsers.EventStreamJSONParser()

    class _Body:
        def __init__(self, chunks: Iterable[bytes]) -> None:
            self._chunks = chunks

        def stream(self) -> Iterable[bytes]:
            return iter(self._chunks)

        def close(self) -> None:
            pass

    def run(chunks: Iterable[bytes]) -> tuple[int, str, list[Any]]:
        n, text, tools = 0, [], dict[int, str]()
        for event in botocore.eventstream.EventStream(_Body(chunks), shape, parser, operation.name):
            n += 1
            delta = event.get("contentBlockDelta")
            if delta is None:
                continue
            d = delta["delta"]
            if "text" in d:
                text.append(d["text"])
            elif "toolUse" in d:
                i = delta["contentBlockIndex"]
                tools[i] = tools.get(i, "") + d["toolUse"]["input"]
        return n, "".join(text), list(tools.values())

    return run


_DRIVERS: dict[str, Callable[[], SdkDriver | None]] = {
    "anthropic": _anthropic,
    "openai-chat": _openai_chat,
    "openai-responses": _openai_responses,
    "bedrock-converse": _botocore_converse,
}


def sdk_driver(dialect: str) -> SdkDriver | None:
    """The SDK path for ``dialect``, or None (no SDK path for the dialect, or the SDK is not installed)."""
    factory = _DRIVERS.get(dialect)
    return factory() if factory is not None else None
