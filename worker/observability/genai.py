"""The OpenTelemetry GenAI semantic conventions as sluice emits them: attribute names, well-known values,
and which version of the (still moving) conventions applies.

Rule: one home for every ``gen_ai.*`` name. Sluice follows semantic conventions v1.41.0 (the last release
of the GenAI pages in open-telemetry/semantic-conventions before they moved to their own repository) and
the conventions' transition rule: by default it emits the v1.36.0 names an instrumentation of that age
keeps (``gen_ai.system``); ``OTEL_SEMCONV_STABILITY_OPT_IN`` holding ``gen_ai_latest_experimental``
switches to v1.41.0 (``gen_ai.provider.name``, ``gen_ai.request.stream``, the cache and reasoning token
counts, ``gen_ai.response.time_to_first_chunk`` and the ``gen_ai.client.operation.time_to_first_chunk``
metric), never both. Request parameters come from sluice's own ``GenerateRequest`` (never its messages,
system prompt or tools: no content is recorded, and there is no opt-in for it); ``error.type`` is the
contract's error category (``sluice.schemas.events.ErrorCategory``), except for a cancel on request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

from sluice.schemas.request import GenerateRequest

__all__ = [
    "GENAI_METRICS",
    "LATEST_OPT_IN",
    "OPERATION",
    "SECONDS_BUCKETS",
    "SEMCONV_VERSION",
    "TOKEN_BUCKETS",
    "GenAICall",
    "genai_call",
    "latest_from_env",
    "metric_attribute_keys",
    "provider_name",
]

SEMCONV_VERSION = "1.41.0"  # with gen_ai_latest_experimental; the default is the v1.36.0 naming
LATEST_OPT_IN = "gen_ai_latest_experimental"
OPERATION = "chat"  # every dialect sluice speaks is a chat completion (Gemini's generateContent included)
# The conventions' advisory bucket boundaries.
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
SECONDS_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
# The client metrics: name -> (unit, description, the advisory buckets, the attributes each adds to
# ``GenAICall.metric_attributes``, v1.41.0's only). time_to_first_chunk is emitted with the opt-in only.
GENAI_METRICS: dict[str, tuple[str, str, tuple[float, ...], tuple[str, ...], bool]] = {
    "gen_ai.client.operation.duration": ("s", "GenAI operation duration.", SECONDS_BUCKETS, ("error.type",), False),
    "gen_ai.client.token.usage": (
        "{token}",
        "Number of input and output tokens used.",
        TOKEN_BUCKETS,
        ("gen_ai.token.type",),
        False,
    ),
    "gen_ai.client.operation.time_to_first_chunk": (
        "s",
        "Time to receive the first chunk, from when the request is issued.",
        SECONDS_BUCKETS,
        (),
        True,
    ),
}

# The dialect's provider (gen_ai.provider.name's well-known values), unless the host says otherwise.
_BY_DIALECT = {
    "anthropic": "anthropic",
    "openai-chat": "openai",
    "openai-responses": "openai",
    "gemini": "gcp.gemini",
    "bedrock-converse": "aws.bedrock",
}
_BY_HOST_SUFFIX = (
    (".openai.azure.com", "azure.ai.openai"),
    (".services.ai.azure.com", "azure.ai.inference"),
    ("aiplatform.googleapis.com", "gcp.vertex_ai"),
    ("generativelanguage.googleapis.com", "gcp.gemini"),
    ("bedrock-runtime.amazonaws.com", "aws.bedrock"),
    ("api.anthropic.com", "anthropic"),
    ("api.openai.com", "openai"),
    ("api.deepseek.com", "deepseek"),
    ("api.groq.com", "groq"),
    ("api.mistral.ai", "mistral_ai"),
    ("api.x.ai", "x_ai"),
    ("api.perplexity.ai", "perplexity"),
)


def latest_from_env(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``OTEL_SEMCONV_STABILITY_OPT_IN`` (a comma-separated list) opts into the latest GenAI names."""
    value = (os.environ if env is None else env).get("OTEL_SEMCONV_STABILITY_OPT_IN", "")
    return LATEST_OPT_IN in {v.strip() for v in value.split(",")}


def metric_attribute_keys(latest: bool) -> tuple[str, ...]:
    """Every attribute ``GenAICall.metric_attributes`` may give, in a fixed order (a Prometheus family's label
    names; a call without one of them gives its label ``""``)."""
    system = "gen_ai.provider.name" if latest else "gen_ai.system"
    return ("gen_ai.operation.name", system, "server.address", "server.port", "gen_ai.request.model")


def provider_name(dialect: str, host: str | None) -> str:
    """The well-known ``gen_ai.provider.name`` for a route: its host when that names a provider, else its
    dialect's (the dialect's name itself for one the conventions do not list)."""
    host = (host or "").lower()
    for suffix, name in _BY_HOST_SUFFIX:
        if host == suffix.lstrip(".") or host.endswith(suffix):
            return name
    return _BY_DIALECT.get(dialect, dialect)


@dataclass(frozen=True, slots=True)
class GenAICall:
    """What the conventions say about one request before it is sent."""

    provider: str
    request_model: str | None
    # The model is the route's configured one: bounded, so it may go on metrics (a job's own model
    # string goes on the span only).
    model_is_configured: bool
    server_address: str | None
    server_port: int | None
    request: dict[str, int | float | bool | list[str]] = field(default_factory=dict)

    def span_name(self) -> str:
        return f"{OPERATION} {self.request_model}" if self.request_model else OPERATION

    def common(self, latest: bool) -> dict[str, str | int]:
        """The attributes spans and metrics share."""
        attrs: dict[str, str | int] = {
            "gen_ai.operation.name": OPERATION,
            ("gen_ai.provider.name" if latest else "gen_ai.system"): self.provider,
        }
        if self.server_address:
            attrs["server.address"] = self.server_address
            if self.server_port is not None:
                attrs["server.port"] = self.server_port
        return attrs

    def metric_attributes(self, latest: bool) -> dict[str, str | int]:
        attrs = self.common(latest)
        if self.request_model and self.model_is_configured:
            attrs["gen_ai.request.model"] = self.request_model
        return attrs

    def span_attributes(self, latest: bool) -> dict[str, str | int | float | bool | list[str]]:
        attrs: dict[str, str | int | float | bool | list[str]] = {**self.common(latest)}
        if self.request_model:
            attrs["gen_ai.request.model"] = self.request_model
        for key, value in self.request.items():
            if key != "gen_ai.request.stream" or latest:  # gen_ai.request.stream is v1.41.0's
                attrs[key] = value
        return attrs


def genai_call(
    *, dialect: str, base_url: str, request: GenerateRequest, model: str | None, configured_model: str | None
) -> GenAICall:
    """The conventions' view of a request sluice is about to send (always streaming)."""
    provider, host, port = _server(dialect, base_url)
    params: dict[str, int | float | bool | list[str]] = {"gen_ai.request.stream": True}
    if request.max_tokens is not None:
        params["gen_ai.request.max_tokens"] = request.max_tokens
    if request.temperature is not None:
        params["gen_ai.request.temperature"] = float(request.temperature)
    if request.top_p is not None:
        params["gen_ai.request.top_p"] = float(request.top_p)
    if request.stop:
        params["gen_ai.request.stop_sequences"] = list(request.stop)
    return GenAICall(
        provider=provider,
        request_model=model or None,
        model_is_configured=bool(model) and model == configured_model,
        server_address=host,
        server_port=port,
        request=params,
    )


@lru_cache(maxsize=1024)  # a route's, so as many as the configured routes
def _server(dialect: str, base_url: str) -> tuple[str, str | None, int | None]:
    """The provider's well-known name, host and port of a route (parsed once, not at each attempt)."""
    url = urlsplit(base_url)
    return provider_name(dialect, url.hostname), url.hostname, url.port or {"https": 443, "http": 80}.get(url.scheme)
